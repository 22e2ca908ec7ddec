"""--optimizer-cpu-offload through the driver (gloo): from one checkpoint of a single-rank run, offload 0.5 at
d=1 and at d=2 with the distributed optimizer, at t=2 and at p=2 with --ckpt ours, gives the single-rank losses; the
measured ``state_bytes`` of every rank are the bytes the split rule puts on each side, computed here from the
tiny Llama's parameter shapes, and at p=2 each stage's are the cost model's terms for it; an interrupted offloaded
run resumes bit-exact."""
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


def _bytes_match_the_cost_model(single_rank, flags, m, world):
    """Each rank's measured bytes are the cost model's terms for its stage (the CPU stand-in's fp32 parameters, no
    separate master), within 1% per kind and side, up to megatron-core's whole-tensor offload split (it offloads
    whole tensors -- whole slices of the distributed optimizer's share: the model's F x n is off by less than one
    of them, at most the stage's 512 x 64 embedding or output layer, in that kind's bytes per element) and Adam's
    4-byte step counts."""
    from h3t_ext.costmodel.memory import stage_state_bytes
    from h3t_training.config.run_spec import model_spec, run_plan
    from h3t_training.config.sections import parse_args

    config = parse_args([*single_rank[0], *flags], world_size=world)
    plan = run_plan(config)
    model = model_spec(config, VOCAB)
    offload = plan.optimizer_offload_fraction not in (0.0, 1.0)
    tensor = VOCAB * H if offload else 0  # the largest tensor of either stage (embedding, output layer)
    per_element = {("device", "optimizer"): 8, ("host", "grads"): 4, ("host", "optimizer"): 12}  # m v; grad; master m v
    steps = 4 * len(_llama_shapes())
    for measured in m["state_bytes"]:
        predicted = stage_state_bytes(model, plan, measured["pipeline_rank"], param_bytes=4, master_weights=False)
        for side in ("device", "host"):
            for kind in ("params", "grads", "optimizer"):
                want, got = measured[side][kind], predicted[side][kind]
                bound = 0.01 * want + tensor * per_element.get((side, kind), 0) + steps
                assert abs(got - want) <= bound, (measured["pipeline_rank"], side, kind, got, want)
        assert predicted["device"]["params"] == measured["device"]["params"]  # whole: nothing is split there
    return plan


def test_offload_with_p2_gives_the_single_rank_losses_and_the_cost_models_bytes(single_rank, tmp_path):
    """Pipeline 2 with offload 0.5 and --ckpt ours: the single-rank losses, and each stage's measured bytes are the
    cost model's terms for that stage (:func:`_bytes_match_the_cost_model`)."""
    flags = ["--pipeline-model-parallel-size", "2", *OFFLOAD]
    m = _run(single_rank, tmp_path, flags, 2)
    _close(single_rank[2], [r["loss"] for r in m["iterations"]], 1e-6)
    plan = _bytes_match_the_cost_model(single_rank, flags, m, 2)
    assert plan.pipeline_model_parallel_size == 2 and plan.optimizer_offload_fraction == FRACTION
    assert sorted(s["pipeline_rank"] for s in m["state_bytes"]) == [0, 1]


def test_distributed_optimizer_at_d2_holds_the_cost_models_half(single_rank, d2_offload, tmp_path):
    """d=2 with the distributed optimizer (megatron-core's cut of the gradient buffer), without and with offload
    0.5: the single-rank losses, and each rank's measured optimizer bytes are the cost model's n / 2 within 1% (the
    buffer's padding), its parameters and gradients whole."""
    m = _run(single_rank, tmp_path, [], 2)
    _close(single_rank[2], [r["loss"] for r in m["iterations"]], 1e-6)
    plan = _bytes_match_the_cost_model(single_rank, [], m, 2)
    assert plan.data_parallel_size == 2 and plan.use_distributed_optimizer
    _bytes_match_the_cost_model(single_rank, OFFLOAD, d2_offload, 2)
    one = expected_state_bytes(1, 0.0)[0]["device"]["optimizer"]
    for s in m["state_bytes"]:  # each half of the padded buffer
        assert abs(s["device"]["optimizer"] - one / 2) <= 0.01 * one / 2
