"""pretrain_llama.py --window-size 8,0 --window-attn-skip-freq [1,0,1,1]: layers 1, 3 and 4 attend within a window of
8 tokens, layer 2 over the whole sequence of 64. In float64, from the single rank's checkpoint after its first
iteration (each pipeline rank draws its own initial weights, as in Megatron), the run at t=2 with sequence
parallelism under ckpt=ours and the run at p=2 (whose second stage holds layers 3 and 4: the pattern reads the model's
layer numbers, not the stage's) give the single rank's next losses and gradient norms within 1e-10 relative; the
window changes the run (the flag is not ignored); and a checkpoint saved with the window does not resume without
it."""
from __future__ import annotations

import pytest

from driver_harness import TINY_MODEL, check_ok, losses_and_grad_norms, run_pretrain

WINDOW = ["--window-size", "8,0", "--window-attn-skip-freq", "[1,0,1,1]"]
COMMON = [*TINY_MODEL, "--mock-data", "--make-vocab-size-divisible-by", "256", "--micro-batch-size", "1",
          "--global-batch-size", "4", "--train-iters", "3", "--h3t-float64", "--ckpt", "no"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single rank's three iterations (losses, then gradient norms) and its checkpoints after each."""
    d = tmp_path_factory.mktemp("window_ref")
    got = losses_and_grad_norms(d / "ref.json", [*COMMON, *WINDOW, "--save", str(d / "ckpt"), "--save-interval", "1"],
                                nproc=1, iterations=3)
    return got, d / "ckpt"


@pytest.mark.parametrize("flags", [["--tensor-model-parallel-size", "2", "--sequence-parallel", "--ckpt", "ours"],
                                   ["--pipeline-model-parallel-size", "2"]], ids=["t2-sp-ours", "p2"])
def test_layouts_match_the_single_rank(reference, tmp_path, flags):
    ref, ckpt = reference
    got = losses_and_grad_norms(tmp_path / "run.json", [*COMMON, *WINDOW, *flags, "--load", str(ckpt),
                                                        "--ckpt-step", "1"], nproc=2, iterations=2)
    assert got == pytest.approx([*ref[1:3], *ref[4:6]], rel=1e-10, abs=0)
    assert ref[2] < ref[0]


def test_the_window_changes_the_run(reference, tmp_path):
    plain = losses_and_grad_norms(tmp_path / "plain.json", COMMON, nproc=1, iterations=3)
    # the same weights and tokens: the windowed layers' attention alone tells the losses apart from the first one
    assert all(abs(a - b) > 1e-6 * abs(a) for a, b in zip(plain[:3], reference[0][:3])), (plain, reference[0])


def test_a_windowed_checkpoint_does_not_resume_without_its_window(reference):
    proc = run_pretrain([*COMMON, "--window-size", "8,0", "--load", str(reference[1])])
    assert proc.returncode != 0
    assert "was saved with --window-attn-skip-freq 1, 0, 1, 1, this run has None" in proc.stderr + proc.stdout
    check_ok(run_pretrain([*COMMON, *WINDOW, "--load", str(reference[1]), "--ckpt-step", "2"]))
