"""pretrain_llama.py --pipeline-model-parallel-layout: megatron-core builds each model chunk's layers as the layout
writes them, and the h3t schedules run them. In float64, from the single rank's checkpoint after its first iteration
(each pipeline rank draws its own initial weights, as in Megatron), two ranks under an uneven layout (Et|tttL) and an
interleaved one with chunks that hold no transformer layer (E|tt|tt|L: the embedding alone, then the loss alone) give
the single rank's next losses and gradient norms within 1e-12 relative; --metrics-json records the layout. So does
interleaving with --microbatch-group-size-per-virtual-pipeline-stage (every chunk runs all 4 microbatches before the
next takes over), which megatron-core passes to its schedule and which h3t-plan calibrate prices."""
from __future__ import annotations

import pytest

from driver_harness import TINY_MODEL, losses_and_grad_norms, metrics

COMMON = [*TINY_MODEL, "--mock-data", "--make-vocab-size-divisible-by", "256", "--micro-batch-size", "1",
          "--global-batch-size", "4", "--train-iters", "3", "--h3t-float64", "--ckpt", "no"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single rank's three iterations (losses, then gradient norms) and its checkpoints after each."""
    d = tmp_path_factory.mktemp("layout_ref")
    got = losses_and_grad_norms(d / "ref.json", [*COMMON, "--save", str(d / "ckpt"), "--save-interval", "1"],
                                nproc=1, iterations=3)
    return got, d / "ckpt"


@pytest.mark.parametrize("layout", ["Et|tttL", "E|tt|tt|L"])
def test_layouts_match_the_single_rank(reference, tmp_path, layout):
    ref, ckpt = reference
    path = tmp_path / "run.json"
    got = losses_and_grad_norms(path, [*COMMON, "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
                                       layout, "--load", str(ckpt), "--ckpt-step", "1"], nproc=2, iterations=2)
    assert got == pytest.approx([*ref[1:3], *ref[4:6]], rel=1e-12, abs=0)
    assert metrics(path)["config"]["pipeline_model_parallel_layout"] == layout  # what h3t-plan calibrate prices


def test_grouped_interleaving_matches_the_single_rank(reference, tmp_path):
    ref, ckpt = reference
    path = tmp_path / "run.json"
    got = losses_and_grad_norms(path, [*COMMON, "--pipeline-model-parallel-size", "2",
                                       "--num-layers-per-virtual-pipeline-stage", "1",
                                       "--microbatch-group-size-per-virtual-pipeline-stage", "4", "--load", str(ckpt),
                                       "--ckpt-step", "1"], nproc=2, iterations=2)
    assert got == pytest.approx([*ref[1:3], *ref[4:6]], rel=1e-12, abs=0)
    assert metrics(path)["config"]["microbatch_group_size_per_vp_stage"] == 4
