"""--optimizer-cpu-offload through the driver (gloo): from one checkpoint of a single-rank run, offload 0.5 at
d=1 and at d=2 with the distributed optimizer, and at t=2 with --ckpt ours, gives the single-rank losses; the
measured ``state_bytes`` of every rank are the bytes the split rule puts on each side, computed here from the
tiny Llama's parameter shapes; an interrupted offloaded run resumes bit-exact."""
from __future__ import annotations

import pytest
import torch

from driver_harness import TINY_MODEL, check_ok, losses, metrics, run_pretrain, single_rank_reference
from state_bytes_harness import H, VOCAB, _llama_shapes, expected_state_bytes

COMMON = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4", "--lr-warmup-iters", "1",
          "--make-vocab-size-divisible-by", "256", "--ckpt", "ours", "--use-distributed-optimizer", "--mock-data"]
OFFLOAD = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--optimizer-offload-fraction", "0.5"]
FRACTION = 0.5
@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    argv = [*TINY_MODEL, *COMMON]
    ckpt, m = single_rank_reference(tmp_path_factory.mktemp("single"), argv)
    ref = [r["loss"] for r in m["iterations"]]
    assert len(ref) == 3 and len(set(ref)) == 3
    return argv, ckpt, ref


def _run(single_rank, tmp_path, flags, nproc, name="m.json"):
    argv, ckpt, _ = single_rank
    check_ok(run_pretrain([*argv, *flags, "--load", str(ckpt), "--metrics-json", str(tmp_path / name)], nproc=nproc))
    return metrics(tmp_path / name)


def _close(ref, got, rel):
    assert len(got) == len(ref)
    for a, b in zip(ref, got):
        assert abs(a - b) <= rel * abs(a), (ref, got)


def test_offload_at_d1_gives_the_same_losses_and_the_split_bytes(single_rank, tmp_path):
    m = _run(single_rank, tmp_path, OFFLOAD, 1)
    assert [r["loss"] for r in m["iterations"]] == single_rank[2]  # the same fp32 math: bit for bit
    sb = m["state_bytes"]
    assert [{k: s[k] for k in ("device", "host")} for s in sb] == expected_state_bytes(1, FRACTION)
    assert sb[0]["device"]["params"] == 4 * sum(torch.Size(s).numel() for s in _llama_shapes())


@pytest.fixture(scope="module")
def d2_offload(single_rank, tmp_path_factory):
    return _run(single_rank, tmp_path_factory.mktemp("d2"), OFFLOAD, 2)


def test_offload_at_d2_with_the_distributed_optimizer(single_rank, d2_offload):
    _close(single_rank[2], [r["loss"] for r in d2_offload["iterations"]], 1e-6)
    sb = sorted(d2_offload["state_bytes"], key=lambda s: s["data_parallel_rank"])
    assert [{k: s[k] for k in ("device", "host")} for s in sb] == expected_state_bytes(2, FRACTION)
    one = expected_state_bytes(1, FRACTION)[0]

    def moments(s):  # Adam's moments and steps on both sides (optimizer bytes less the host's master copies)
        return s["device"]["optimizer"] + s["host"]["optimizer"] - s["host"]["grads"]
    assert sum(moments(s) for s in sb) == moments(one)
    for s in sb:  # half of d=1's, up to the whole-parameter split (the largest parameter: an embedding)
        assert abs(moments(s) - moments(one) / 2) <= 8 * VOCAB * H / 2


def test_offloaded_run_resumes_bit_exact(single_rank, tmp_path):
    """d=2 from scratch: a run saved after its first iteration and resumed gives the uninterrupted run's losses
    (the host partition's moments saved with the rest, its master copies reloaded from the model)."""
    argv = [*single_rank[0], *OFFLOAD, "--train-iters", "3"]
    check_ok(run_pretrain([*argv, "--metrics-json", str(tmp_path / "full.json")], nproc=2))
    check_ok(run_pretrain([*argv, "--save", str(tmp_path / "c"), "--exit-interval", "1"], nproc=2))
    check_ok(run_pretrain([*argv, "--load", str(tmp_path / "c"), "--metrics-json", str(tmp_path / "r.json")], nproc=2))
    assert losses(tmp_path / "r.json") == losses(tmp_path / "full.json")[1:]


def test_offload_with_t2_and_ckpt_ours(single_rank, tmp_path):
    tp = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    plain = _run(single_rank, tmp_path, tp, 2, "plain.json")
    off = _run(single_rank, tmp_path, [*tp, *OFFLOAD], 2, "off.json")
    assert [r["loss"] for r in off["iterations"]] == [r["loss"] for r in plain["iterations"]]
    _close(single_rank[2], [r["loss"] for r in off["iterations"]], 1e-6)
    for s, p in zip(off["state_bytes"], plain["state_bytes"]):
        assert s["device"]["params"] == p["device"]["params"] and s["host"]["grads"] > 0
        assert s["device"]["optimizer"] + s["host"]["optimizer"] - s["host"]["grads"] == p["device"]["optimizer"]
