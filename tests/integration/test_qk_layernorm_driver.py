"""pretrain_llama.py --qk-layernorm: the q and k norms' weights are shared by the heads that the tensor-parallel ranks
split, so their gradients are summed over the tensor-parallel group whether or not the sequence is split too. t=2,
with and without --sequence-parallel, under ckpt ours and no, gives the losses and gradient norms of one rank within
1e-5 relative (reduction order); a missing reduction leaves each rank's q/k norm weights on its own heads' gradient
and the runs part from the second iteration on."""
from __future__ import annotations

import pytest

from driver_harness import TINY_MODEL, check_ok, losses_and_grad_norms, metrics, run_pretrain

COMMON = [*TINY_MODEL, "--mock-data", "--make-vocab-size-divisible-by", "256", "--micro-batch-size", "1",
          "--global-batch-size", "4", "--train-iters", "3", "--qk-layernorm"]


def _losses(tmp_path, name: str, flags: list[str], nproc: int) -> list[float]:
    return losses_and_grad_norms(tmp_path / f"{name}.json", [*COMMON, *flags], nproc=nproc, iterations=3)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("qk_ref"), "ref", ["--ckpt", "no"], nproc=1)


@pytest.mark.parametrize("flags", [["--sequence-parallel", "--ckpt", "ours"], ["--ckpt", "no"]],
                         ids=["sp-ours", "no-sp-no"])
def test_tp2_matches_single_rank(reference, tmp_path, flags):
    got = _losses(tmp_path, "tp2", ["--tensor-model-parallel-size", "2", *flags], nproc=2)
    assert got == pytest.approx(reference, rel=1e-5, abs=0)
    assert reference[2] < reference[0]


def test_the_norms_are_built_and_change_the_run(reference, tmp_path):
    plain = tmp_path / "plain.json"
    check_ok(run_pretrain([a for a in COMMON if a != "--qk-layernorm"] + ["--ckpt", "no", "--metrics-json", str(plain)]))
    assert [r["loss"] for r in metrics(plain)["iterations"]] != reference[:3]
