"""Data-parallel scaling at a fixed layout (costmodel/data_parallel.py): as replicas are added with the
global batch fixed, tokens/s per GPU falls, and the named terms say why."""
from dataclasses import replace

import pytest

from h3t_ext.costmodel import Plan, estimate, get_model, get_system
from h3t_ext.costmodel.data_parallel import all_reduce_choice, dp_comm, tree_all_reduce_latency
from h3t_ext.costmodel.collectives import group_link


def _plan(gpus: int, **kw) -> Plan:
    return Plan(num_gpus=gpus, seq_length=4096, global_batch_size=1024, micro_batch_size=1,
                tensor_model_parallel_size=8, overlap_grad_reduce=True, overlap_param_gather=True, **kw)


def test_tokens_per_gpu_fall_as_dp_grows_at_fixed_layout_and_global_batch():
    """7B, t = 8, micro batch 1, 8 -> 1024 GPUs: d = 1 ... 128, m = 1024 ... 8 microbatches per replica."""
    model, system = get_model("llama-7b"), get_system("h100-sxm")
    ests = [estimate(model, _plan(g), system, timeline=False) for g in (8, 64, 256, 1024)]
    tps = [e.tokens_per_second_per_gpu for e in ests]
    dp = [e.time_terms.dp_exposed for e in ests]
    comm = [dp_comm(model, e.plan, system) for e in ests]
    assert all(a > b for a, b in zip(tps, tps[1:])), tps
    assert dp[0] == 0.0 and all(a < b for a, b in zip(dp[1:], dp[2:])), dp
    # the bucket stream's latency: buckets of max(40M, 1M d) parameters, 2 (d - 1) ring steps per bucket
    assert [c.buckets for c in comm] == [0, 22, 22, 7], comm
    lat = system.network_latency_s
    assert comm[3].latency_seconds == 2 * 7 * 127 * lat
    # the fall from 64 to 1024 GPUs is the exposed data-parallel time (the per-microbatch work is the same,
    # m shrinks with d): time per microbatch grows by what dp_exposed (and the optimizer) add
    per_mb = [(e.time_terms.total - e.time_terms.dp_exposed - e.time_terms.optimizer) / e.plan.num_microbatches
              for e in ests[1:]]
    assert max(per_mb) / min(per_mb) - 1 < 1e-9, per_mb
    drop = 1 - tps[3] / tps[1]
    explained = 1 - (ests[1].time_terms.total / ests[1].plan.num_microbatches) / (
        ests[3].time_terms.total / ests[3].plan.num_microbatches)
    assert abs(drop - explained) < 1e-9 and drop > 0.01, (drop, explained)


def test_fixed_global_batch_grows_the_bubble_share_with_a_pipeline():
    """With p = 4 more replicas at a fixed global batch leave fewer microbatches: the bubble is a larger share."""
    model, system = get_model("llama-7b"), get_system("h100-sxm")
    shares = []
    for g in (32, 256, 1024):
        e = estimate(model, _plan(g, pipeline_model_parallel_size=4), system, timeline=False)
        shares.append(e.time_terms.bubble / e.time_terms.total)
    assert shares[0] < shares[1] < shares[2], shares


def test_all_reduce_takes_the_tree_over_many_nodes_for_small_buckets():
    """NCCL's choice: the ring's 2 (n - 1) step latencies grow linearly, the tree's with log2 nodes; a small
    all-reduce over 128 nodes takes the tree, a large one over 2 nodes the ring."""
    system = get_system("h100-sxm")
    link = group_link(8, 128, system)
    secs, algo = all_reduce_choice(1e6, 128, 8, link, system)
    assert algo == "tree" and secs < 2 * 127 * link.latency
    assert tree_all_reduce_latency(8, 128, system) == 2 * 7 * system.network_latency_s
    _, algo = all_reduce_choice(4e9, 2, 8, group_link(8, 2, system), system)
    assert algo == "ring"
    model = get_model("llama-7b")
    c = dp_comm(model, replace(_plan(1024), use_distributed_optimizer=False, overlap_grad_reduce=False), system)
    assert c.buckets == 1 and c.param_seconds == 0.0


def test_grad_reduce_in_bf16_halves_the_gradient_buffer_and_its_reduction():
    """--grad-reduce-in-bf16: the gradient buffer holds 2 bytes per parameter instead of 4 (megatron-core's DDP with
    grad_reduce_in_fp32 off) and the reduce-scatter moves half the bytes; the flag round-trips through the planner's
    flags, and the driver's translation reads it."""
    from h3t_ext.costmodel.memory import stage_memory
    from h3t_ext.planner.flags import megatron_flags, plan_from_megatron_flags

    model, system = get_model("llama-7b"), get_system("h100-sxm")
    fp32, bf16 = _plan(64), _plan(64, grad_reduce_in_bf16=True)
    g32, g16 = stage_memory(model, fp32, 0, 0.0).terms["grads"], stage_memory(model, bf16, 0, 0.0).terms["grads"]
    assert g32 == 2 * g16 and g16 == stage_memory(model, bf16, 0, 0.0).terms["weights"]  # bf16 weights: 2 bytes too
    c32, c16 = dp_comm(model, fp32, system), dp_comm(model, bf16, system)
    assert c32.buckets == c16.buckets and c16.param_seconds == c32.param_seconds
    assert c16.grad_seconds < c32.grad_seconds
    # ring time = latency + bytes / bandwidth: the bandwidth part halves
    assert (c16.grad_seconds - c16.latency_seconds / 2) == \
        pytest.approx((c32.grad_seconds - c32.latency_seconds / 2) / 2, rel=1e-9)
    flags = megatron_flags(bf16)
    assert "--grad-reduce-in-bf16" in flags and "--grad-reduce-in-bf16" not in megatron_flags(fp32)
    assert plan_from_megatron_flags(flags, num_gpus=64, seq_length=4096).grad_reduce_in_bf16
