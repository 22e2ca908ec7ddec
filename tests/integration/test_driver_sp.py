"""pretrain_llama.py with --sequence-parallel on CPU ranks gives the losses of a run without it.

* t=2 --sequence-parallel --ckpt ours on 2 ranks against a single-rank --ckpt no run;
* t=2 x p=2 --sequence-parallel --ckpt ours --offload-alpha 0.5 on 4 ranks against p=2 --ckpt no on
  2 ranks (each pipeline stage draws its weights from --seed + 100 x its rank, as Megatron seeds, so
  a pipelined run is compared with a pipelined reference).

Weights are tensor-parallel invariant (megatron-core's CPU initialisation draws the full matrix and
keeps the shard); ``--make-vocab-size-divisible-by 256`` pads the vocabulary alike for t=1 and t=2.
Losses and gradient norms must agree within 1e-5 relative; they differ only by reduction order. The
gradient norm is what shows that the norm weights' gradients are summed over the tensor-parallel
group (each rank's norm sees only its sequence shard); three iterations of losses alone do not.
"""
from __future__ import annotations

import pytest

from driver_harness import TINY_MODEL, losses_and_grad_norms

COMMON = [*TINY_MODEL, "--mock-data", "--make-vocab-size-divisible-by", "256", "--micro-batch-size", "1",
          "--global-batch-size", "4", "--train-iters", "3"]
SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]


def _losses(tmp_path, name: str, flags: list[str], nproc: int) -> list[float]:
    """Losses, then gradient norms, of the three iterations."""
    return losses_and_grad_norms(tmp_path / f"{name}.json", [*COMMON, *flags], nproc=nproc, iterations=3)


def test_tp2_sequence_parallel_ours_matches_single_rank(tmp_path):
    ref = _losses(tmp_path, "ref", ["--ckpt", "no"], nproc=1)
    sp = _losses(tmp_path, "sp", [*SP, "--ckpt", "ours"], nproc=2)
    assert sp == pytest.approx(ref, rel=1e-5, abs=0)
    assert ref[2] < ref[0]  # the model learns


def test_tp2_pp2_sequence_parallel_ours_offload_matches_pipeline_reference(tmp_path):
    pipe = ["--pipeline-model-parallel-size", "2"]
    ref = _losses(tmp_path, "ref_pp2", [*pipe, "--ckpt", "no"], nproc=2)
    sp = _losses(tmp_path, "sp_pp2", [*pipe, *SP, "--ckpt", "ours", "--offload-alpha", "0.5"], nproc=4)
    assert sp == pytest.approx(ref, rel=1e-5, abs=0)
