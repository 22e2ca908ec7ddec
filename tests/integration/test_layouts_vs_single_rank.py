"""Issue #9's equivalence through the driver: t=2 with sequence parallelism, c=2, t=2 x p=2 and
c=2 x p=2, each with ckpt=ours (and offload where the pipeline can overlap it), give the losses of a
single-rank run within 1e-5 relative. Weights are seeded per pipeline rank (as Megatron seeds), so the
runs start from one checkpoint written by the single-rank run and resharded to each layout.

Issue #24's float64 check: with ``--h3t-float64`` (parameters, activations, gradients, pipeline transfers and
the loss in float64) every variant (t with sequence parallelism, c, p, v, data parallelism with the distributed
optimizer, ckpt no/ours/full, alpha) gives the single-rank losses and gradient norms within 1e-10 relative over
three iterations: float32's 1e-5 cannot tell roundoff from a bug, float64's can (a wrong gradient term moves
the gradient norm by far more than 1e-10, float64 roundoff by about 1e-13)."""
from __future__ import annotations

import pytest

from driver_harness import TINY_MODEL, check_ok, losses, metrics, run_pretrain  # noqa: F401

COMMON = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4", "--lr-warmup-iters", "1",
          "--make-vocab-size-divisible-by", "256", "--ckpt", "ours"]  # one padded vocabulary for t = 1 and 2
LAYOUTS = {
    "t2-sp": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2),
    "c2": (["--context-parallel-size", "2"], 2),
    "t2-sp-p2": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                  "--offload-alpha", "0.5"], 4),
    "c2-p2": (["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--offload-alpha", "0.5"], 4),
}


FLOAT64_TOL = 1e-10
FLOAT64_LAYOUTS = {
    "t2-sp-no": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--ckpt", "no"], 2),
    "c2-ours": (["--context-parallel-size", "2"], 2),
    "d2-distopt-full": (["--use-distributed-optimizer", "--ckpt", "full"], 2),
    "p2-v2-ours-offload": (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                            "--offload-alpha", "0.5"], 2),
    "t2-sp-c2-p2-offload": (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size",
                             "2", "--pipeline-model-parallel-size", "2", "--offload-alpha", "0.5"], 8),
}


def _single_rank(corpus_prefix, d, extra=()):
    argv = [*TINY_MODEL, *COMMON, *extra, "--data-path", corpus_prefix]
    check_ok(run_pretrain([*argv, "--save", str(d / "ckpt"), "--exit-interval", "1"]))
    check_ok(run_pretrain([*argv, "--load", str(d / "ckpt"), "--metrics-json", str(d / "ref.json")]))
    ref = losses(d / "ref.json")
    assert len(ref) == 3 and len(set(ref)) == 3
    return argv, d / "ckpt", ref


@pytest.fixture(scope="module")
def single_rank(corpus_prefix, tmp_path_factory):
    return _single_rank(corpus_prefix, tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module")
def single_rank_float64(corpus_prefix, tmp_path_factory):
    argv, ckpt, _ = _single_rank(corpus_prefix, tmp_path_factory.mktemp("single64"), ["--h3t-float64"])
    return argv, ckpt, metrics(ckpt.parent / "ref.json")["iterations"]


def _run_layout(argv, ckpt, layout, tmp_path) -> list[dict]:
    """The metrics of every iteration of ``layout`` (flags, ranks) started from the single-rank checkpoint."""
    flags, nproc = layout
    out = tmp_path / "m.json"
    check_ok(run_pretrain([*argv, *flags, "--load", str(ckpt), "--metrics-json", str(out)], nproc=nproc))
    return metrics(out)["iterations"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_gives_the_single_rank_losses(single_rank, layout, tmp_path):
    argv, ckpt, ref = single_rank
    got = [r["loss"] for r in _run_layout(argv, ckpt, LAYOUTS[layout], tmp_path)]
    assert len(got) == len(ref)
    for a, b in zip(ref, got):
        assert abs(a - b) <= 1e-5 * abs(a), (layout, ref, got)


@pytest.mark.parametrize("layout", sorted(FLOAT64_LAYOUTS))
def test_layout_gives_the_single_rank_losses_and_gradients_in_float64(single_rank_float64, layout, tmp_path):
    argv, ckpt, ref = single_rank_float64
    got = _run_layout(argv, ckpt, FLOAT64_LAYOUTS[layout], tmp_path)
    assert len(got) == len(ref) == 3
    for it, (a, b) in enumerate(zip(ref, got), start=1):
        for key in ("loss", "grad_norm"):
            rel = abs(a[key] - b[key]) / abs(a[key])
            assert rel <= FLOAT64_TOL, f"{layout} iteration {it}: {key} {b[key]!r} vs one rank's {a[key]!r} ({rel:.2g})"


def test_float64_runs_are_float64(single_rank, single_rank_float64):
    """The float64 reference is not float32 relabelled: its losses differ from float32's by float32 roundoff."""
    ref32, ref64 = single_rank[2], [r["loss"] for r in single_rank_float64[2]]
    diffs = [abs(a - b) / abs(b) for a, b in zip(ref32, ref64)]
    assert all(0 < d < 1e-5 for d in diffs), diffs
