"""--load of a checkpoint Megatron-LM itself wrote (torch_dist, and --ckpt-format torch without common.pt): its
args stand for this driver's 'h3t' section (h3t_training.loop.megatron_written). The driver trains and saves; a
helper (tests/megatron_written_checkpoint.py) rewrites the checkpoint into Megatron-LM's own layout."""
from __future__ import annotations

import json
import subprocess

import pytest

from driver_harness import COMMON_PT, PYTHON, REPO, TINY_MODEL, _env, check_ok, losses, read_common, \
    run_pretrain  # noqa: F401

COMMON = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4", "--lr-decay-style", "cosine",
          "--lr-warmup-iters", "1", "--hidden-dropout", "0.1"]
"""Dropout: the losses depend on the RNG states the checkpoint restores."""


def _rewrite(src, dst, fmt: str, flags: list[str], *extra: str) -> None:
    proc = subprocess.run([PYTHON, str(REPO / "tests" / "megatron_written_checkpoint.py"), str(src), str(dst), fmt,
                           *extra, "--", *flags], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def saved(corpus_prefix, tmp_path_factory):
    """The driver's checkpoint at iteration 2, its own resume with --no-load-optim, and that checkpoint in
    Megatron-LM's two layouts."""
    root = tmp_path_factory.mktemp("megatron")
    flags = [*TINY_MODEL, *COMMON, "--data-path", corpus_prefix]
    check_ok(run_pretrain([*flags, "--save", str(root / "ours"), "--exit-interval", "2"]))
    check_ok(run_pretrain([*flags, "--load", str(root / "ours"), "--no-load-optim", "--metrics-json",
                           str(root / "ref.json")]))
    for fmt in ("torch_dist", "torch"):
        _rewrite(root / "ours", root / fmt, fmt, flags)
    return root, flags


def _refused(proc) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_a_megatron_lm_checkpoint_continues_with_its_weights_iteration_and_samples(saved, fmt):
    root, flags = saved
    if fmt == "torch":  # Megatron-LM's own layouts: no common.pt, or one without this driver's section
        assert not (root / fmt / "iter_0000002" / "common.pt").exists()
    else:
        assert "h3t" not in read_common(root / fmt / "iter_0000002")
    out = root / f"{fmt}.json"
    proc = run_pretrain([*flags, "--load", str(root / fmt), "--no-load-optim", "--metrics-json", str(out)])
    check_ok(proc)
    assert "iterations from 2" in proc.stdout
    notice = [l for l in proc.stdout.splitlines() if "was written by Megatron-LM" in l]
    assert notice == [f"note: --load {root / fmt}: checkpoint iteration 2 was written by Megatron-LM: taking the "
                      "model weights, the iteration and its 8 consumed samples (its args checked as this driver's "
                      "own checkpoints are: model shape, schedule, padding, layout); not taking the optimizer state "
                      "(--no-load-optim), the FLOPs count, the rerun state machine; the optimizer starts from the "
                      "loaded weights"]
    assert "RNG states start from --seed" not in proc.stdout  # Megatron's torch state restored
    ref = losses(root / "ref.json")
    assert len(ref) == 2 and ref[0] != ref[1]
    assert losses(out) == ref  # bit for bit: the saved weights, RNG and data position
    assert [r["iteration"] for r in json.load(open(out))["iterations"]] == [3, 4]


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_a_megatron_lm_checkpoint_needs_no_load_optim_on_cpu(saved, fmt):
    root, flags = saved
    line = _refused(run_pretrain([*flags, "--load", str(root / fmt)]))
    # torch_dist: the file the common state came from, common.pt (0.16-0.18) or the shard files' .metadata (0.19)
    file = root / fmt / "iter_0000002" / ((COMMON_PT or [".metadata"])[0] if fmt == "torch_dist"
                                          else "mp_rank_00/model_optim_rng.pt")
    assert line.endswith(f"--load {root / fmt}: checkpoint iteration 2 was written by Megatron-LM: its optimizer "
                         f"state ({file}) is megatron-core's, which this run's CPU optimizer does not read; add "
                         "--no-load-optim (or --finetune) to continue from its model weights with a fresh "
                         "optimizer"), line


def test_megatron_lm_args_of_another_model_or_without_a_field_are_refused(saved, tmp_path):
    root, flags = saved
    _rewrite(root / "ours", tmp_path / "wide", "torch_dist", flags, "--set", "hidden_size=128")
    line = _refused(run_pretrain([*flags, "--load", str(tmp_path / "wide"), "--no-load-optim"]))
    assert "checkpoint iteration 2 was saved with --hidden-size 128, this run has 64" in line
    _rewrite(root / "ours", tmp_path / "partial", "torch", flags, "--drop", "padded_vocab_size")
    line = _refused(run_pretrain([*flags, "--load", str(tmp_path / "partial"), "--no-load-optim"]))
    file = tmp_path / "partial" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    assert line.endswith(f"checkpoint file {file} (written by Megatron-LM) has no field 'padded_vocab_size' in its "
                         "args; it cannot be checked against this run"), line


def test_data_parallel_random_init_takes_each_replicas_rng_state(saved, tmp_path):
    """Under --data-parallel-random-init Megatron-LM's rng_state list holds one state per data-parallel rank and its
    load_checkpoint takes the rank's own; without the flag the first. At d = 2 with dropout: the flag on (r0, r1)
    trains otherwise than on (r0, r0), and the run without the flag on (r0, r1) equals the flag on (r0, r0) (both
    replicas restart from r0, with the same weights). A checkpoint saved without the flag, loaded with it, is one
    line (Megatron-LM's check_checkpoint_args refuses it too).""" 
    root, flags = saved
    for copies in ("same", "distinct", "one"):
        mark = () if copies == "one" else ("--set", "data_parallel_random_init=True")
        _rewrite(root / "ours", tmp_path / copies, "torch_dist", flags, "--rng-copies", copies, *mark)

    def run(copies, *extra, nproc=2):
        out = tmp_path / f"{copies}{''.join(extra)}.json"
        proc = run_pretrain([*flags, "--load", str(tmp_path / copies), "--no-load-optim", *extra,
                             "--metrics-json", str(out)], nproc=nproc)
        return proc, out

    losses_of = {}
    for copies, extra in (("same", ("--data-parallel-random-init",)), ("distinct", ("--data-parallel-random-init",)),
                          ("distinct", ())):
        proc, out = run(copies, *extra)
        check_ok(proc)
        losses_of[(copies, extra)] = losses(out)
    flag = ("--data-parallel-random-init",)
    assert losses_of[("distinct", ())] == losses_of[("same", flag)]
    assert losses_of[("distinct", flag)] != losses_of[("same", flag)]
    proc, _ = run("one", *flag, nproc=1)  # refused before any process group, on every rank alike
    assert "was written by Megatron-LM without --data-parallel-random-init" in _refused(proc)
