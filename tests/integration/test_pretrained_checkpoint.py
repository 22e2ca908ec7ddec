"""Megatron-LM's --pretrained-checkpoint: where --load holds no checkpoint the run finetunes from that one (as
--finetune: its weights, iteration 0, a fresh optimizer); once --load holds the run's own checkpoint, the run resumes
from it. Without a checkpoint in either: one line, as Megatron-LM raises."""
from __future__ import annotations

import json

from driver_harness import TINY_MODEL, check_ok, losses, run_pretrain  # noqa: F401

RUN = ["--micro-batch-size", "1", "--global-batch-size", "2", "--lr-warmup-iters", "0"]


def _iterations(path) -> list[int]:
    return [r["iteration"] for r in json.load(open(path))["iterations"]]


def test_finetunes_from_the_pretrained_checkpoint_then_resumes_its_own(corpus_prefix, tmp_path):
    common = [*TINY_MODEL, *RUN, "--data-path", corpus_prefix]
    base = tmp_path / "base"
    check_ok(run_pretrain([*common, "--train-iters", "3", "--save", str(base)]))
    ref = tmp_path / "ref.json"  # Megatron-LM's --finetune of the same checkpoint
    check_ok(run_pretrain([*common, "--train-iters", "4", "--load", str(base), "--finetune", "--metrics-json",
                           str(ref)]))
    tuned, first = tmp_path / "tuned", tmp_path / "first.json"
    flags = [*common, "--train-iters", "4", "--load", str(tuned), "--save", str(tuned), "--pretrained-checkpoint",
             str(base)]
    proc = run_pretrain([*flags, "--exit-interval", "2", "--metrics-json", str(first)])
    check_ok(proc)
    assert f"finetuning from --pretrained-checkpoint {base}" in proc.stdout, proc.stdout[:3000]
    assert _iterations(first) == [1, 2] and losses(first) == losses(ref)[:2]
    resumed = tmp_path / "resumed.json"
    proc = run_pretrain([*flags, "--metrics-json", str(resumed)])  # --load now holds iteration 2: resume from it
    check_ok(proc)
    assert "finetuning" not in proc.stdout and "iterations from 2" in proc.stdout
    assert _iterations(resumed) == [3, 4] and losses(resumed) == losses(ref)[2:]


def test_no_checkpoint_in_either_is_one_line(corpus_prefix, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_pretrain([*TINY_MODEL, *RUN, "--data-path", corpus_prefix, "--train-iters", "2", "--load",
                         str(tmp_path / "none"), "--pretrained-checkpoint", str(empty)])
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        f"no checkpoint in --load {tmp_path / 'none'} or --pretrained-checkpoint {empty}"), proc.stderr
