"""Megatron-LM's --data-parallel-random-init through pretrain_llama.py at d = 2: each replica seeds its generators
with ``+ 10 x data-parallel rank`` and takes the first replica's weights (megatron-core DDP's ``broadcast_params``), so
without dropout the run is the one without the flag, with dropout the replicas draw their own masks (other losses),
and a resume restores each replica's own generator."""
from __future__ import annotations

import pytest

from driver_harness import TINY_MODEL, check_ok, metrics, run_pretrain

COMMON = [*TINY_MODEL, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
          "--global-batch-size", "4", "--micro-batch-size", "1", "--train-iters", "4", "--eval-iters", "0"]
FLAG = ["--data-parallel-random-init"]
DROPOUT = ["--hidden-dropout", "0.1"]


def _losses(tmp_path, name, flags):
    out = tmp_path / f"{name}.json"
    check_ok(run_pretrain([*COMMON, *flags, "--metrics-json", str(out)], nproc=2))
    return [r["loss"] for r in metrics(out)["iterations"]]


def test_without_dropout_the_weights_are_the_first_replicas(tmp_path):
    assert _losses(tmp_path, "flag", FLAG) == _losses(tmp_path, "plain", [])


def test_with_dropout_each_replica_draws_its_own_masks_and_resumes_them(tmp_path):
    plain = _losses(tmp_path, "plain", DROPOUT)
    full = _losses(tmp_path, "full", [*DROPOUT, *FLAG])
    assert full[0] != plain[0]
    ckpt = tmp_path / "ckpt"
    first = _losses(tmp_path, "first", [*DROPOUT, *FLAG, "--save", str(ckpt), "--exit-interval", "2"])
    resumed = _losses(tmp_path, "resumed", [*DROPOUT, *FLAG, "--load", str(ckpt)])
    assert first == full[:2] and resumed == pytest.approx(full[2:], rel=1e-6)
