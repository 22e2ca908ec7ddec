"""Faults end cleanly: a diverging run stops with one line and leaves a finite latest checkpoint;
resume with dropout is bit-exact (measurement code draws from no run RNG stream)."""
from __future__ import annotations

import json
import math

import torch

from driver_harness import TINY_MODEL, check_ok, corpus_prefix, losses, run_pretrain  # noqa: F401


def _strict_json(path):
    def refuse(token):
        raise ValueError(f"non-strict JSON constant {token}")
    with open(path) as f:
        return json.load(f, parse_constant=refuse)


def test_divergence_stops_with_one_line_and_a_finite_checkpoint(corpus_prefix, tmp_path):  # noqa: F811
    ckpt = tmp_path / "ckpt"
    argv = [*TINY_MODEL, "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "20",
            "--data-path", corpus_prefix, "--save", str(ckpt), "--save-interval", "1",
            "--metrics-json", str(tmp_path / "m.json"), "--clip-grad", "0"]
    argv[argv.index("--lr") + 1] = "1e6"
    proc = run_pretrain(argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("pretrain_llama.py: error: iteration ")
    assert "is nan" in lines[0] or "is inf" in lines[0]
    stopped_at = int(lines[0].split("iteration ")[1].split(":")[0])
    latest = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 1 <= latest < stopped_at
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(ckpt / f"iter_{latest:07d}"), str(tmp_path / "plain.pt"))  # no process group needed
    tensors = [t for t in torch.load(tmp_path / "plain.pt", weights_only=False).values() if torch.is_tensor(t)]
    assert len(tensors) > 10 and all(torch.isfinite(t).all() for t in tensors)


def test_metrics_json_is_strict_on_every_layout(corpus_prefix, tmp_path):  # noqa: F811
    out = tmp_path / "m.json"
    check_ok(run_pretrain([*TINY_MODEL, "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2",
                           "--data-path", corpus_prefix, "--pipeline-model-parallel-size", "2",
                           "--metrics-json", str(out)], nproc=2))
    data = _strict_json(out)
    assert all(math.isfinite(r["loss"]) for r in data["iterations"])


def test_resume_with_dropout_is_bit_exact(corpus_prefix, tmp_path):  # noqa: F811
    argv = [*TINY_MODEL, "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "4",
            "--data-path", corpus_prefix, "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    full = tmp_path / "full.json"
    check_ok(run_pretrain([*argv, "--metrics-json", str(full)]))
    ckpt = tmp_path / "ckpt"
    check_ok(run_pretrain([*argv, "--save", str(ckpt), "--exit-interval", "2"]))
    resumed = tmp_path / "resumed.json"
    check_ok(run_pretrain([*argv, "--load", str(ckpt), "--metrics-json", str(resumed)]))
    ref = losses(full)
    assert losses(resumed) == ref[2:]
