"""Data-parallel terms of one iteration: the gradient reduce-scatter (all-reduce), the parameter all-gather
and the optimizer step on the shard -- what makes throughput fall as GPUs are added at a fixed layout.

* Buckets (megatron-core 0.16.1 ``distributed/distributed_data_parallel.py``): with --overlap-grad-reduce
  the gradient buffer is cut into buckets of ``--ddp-bucket-size`` parameters, default max(40M, 1M x d);
  without it one bucket holds the whole buffer. Megatron's training loop builds model chunks after the
  first (interleaved schedule) with ``disable_bucketing``: one bucket each. Every bucket is one NCCL
  collective, so the stream costs buckets x the collective's latency plus its bytes over the bus bandwidth.
* Latency of one collective over d ranks (NCCL's own tuning model, ``src/graph/tuning.cc``): ring
  reduce-scatter / all-gather take d - 1 steps, a ring all-reduce 2 (d - 1) -- linear in d; NCCL's tree
  all-reduce (double binary tree over the nodes, a chain inside each) 2 (log2 nodes x network step +
  (members per node - 1) x NVLink step). NCCL picks the faster per call (:func:`all_reduce_choice`); reduce-
  scatter and all-gather have only the ring.
* Exposure (:func:`bucketed_exposed`): with --overlap-grad-reduce the buckets start as the last
  microbatch's backward produces them, so only what outlasts that backward is exposed, at least the last
  bucket; without it all of it. --overlap-param-gather mirrors it against the first forwards of the next
  iteration; without it the all-gather after the optimizer step is exposed whole.
* Optimizer step (:func:`optimizer_step_seconds`): HBM-bound on the shard, ``ADAM_BYTES_PER_PARAM`` per
  parameter / the optimizer shards, plus zeroing the full fp32 gradient buffer.

With a fixed global batch, more replicas also mean fewer microbatches per replica and so a larger share of
pipeline bubble; that term is the pipeline's (``timing``/``timeline``: the bubble is fixed per iteration
while the compute shrinks with m).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from h3t_ext.costmodel import fp8, moe, optimizer_offload
from h3t_ext.costmodel.collectives import Link, all_gather_seconds, group_link, group_node_spread
from h3t_ext.costmodel.kernels import elementwise_seconds, kernel_rates
from h3t_ext.costmodel.memory import optimizer_shard_params, stage_expert_params, stage_params
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec
from h3t_ext.dtypes import BF16, FP32

DDP_BUCKET_PARAMS = 40_000_000
"""Megatron DDP's default bucket size: max(40M, 1M x data-parallel size) parameters (megatron-core 0.16.1
``DistributedDataParallel.__init__``: larger buckets at large d keep the ring's per-rank chunk
bandwidth-bound)."""
DDP_BUCKET_PARAMS_PER_RANK = 1_000_000


def default_bucket_params(data_parallel_size: int) -> int:
    """megatron-core DDP's bucket size when ``--ddp-bucket-size`` is not given: max(40M, 1M x d) parameters."""
    return max(DDP_BUCKET_PARAMS, DDP_BUCKET_PARAMS_PER_RANK * data_parallel_size)
OPTIMIZER_KERNELS = 4
"""Optimizer step (per bucket, counted once): the gradient-norm kernel of clipping, Adam (multi-tensor
apply), the fp32 master -> bf16 weight copy and the gradient zeroing (``ADAM_BYTES_PER_PARAM`` + fp32)."""
ADAM_BYTES_PER_PARAM = FP32 + (4 * FP32 + 3 * FP32) + (FP32 + BF16)
"""Optimizer step per parameter of the shard, as Megatron's mixed-precision optimizers run it (separate
kernels): the gradient-norm kernel of gradient clipping (--clip-grad, default 1.0) reads the fp32 gradient;
Adam reads grad, master, m, v and writes master, m, v (fp32); _copy_main_params_to_model_params reads the
fp32 master and writes the bf16 weight."""


@dataclass(frozen=True)
class DataParallelComm:
    """The data-parallel collectives of one iteration on the stage with most parameters, before overlap."""

    buckets: int
    """Collectives per stream (gradient reduce, parameter gather): Megatron's DDP buckets."""
    grad_seconds: float
    """Gradient reduce-scatter (distributed optimizer) or all-reduce of every bucket, back to back."""
    param_seconds: float
    """Parameter all-gather of every bucket (distributed optimizer; 0 without it)."""
    latency_seconds: float
    """The part of grad_seconds + param_seconds that is per-collective latency (buckets x steps)."""
    last_grad_bucket_seconds: float
    """One bucket of the first model chunk (the last gradients the backward completes, the first parameters
    the forward needs): what overlap cannot hide."""
    last_param_bucket_seconds: float
    all_reduce_algorithm: str
    """``ring`` or ``tree``: what NCCL picks for the all-reduce (``ring`` for reduce-scatter/all-gather)."""


def ddp_buckets(model: ModelSpec, plan: Plan, params: int) -> tuple[int, float]:
    """(buckets, parameters of one first-chunk bucket) of a stage of ``params`` parameters: the first model
    chunk cut into max(40M, 1M x d)-parameter buckets with --overlap-grad-reduce (one bucket of all of them
    without it), one bucket per further chunk (v chunks of params / v)."""
    if not plan.overlap_grad_reduce:
        return 1, float(params)
    v = plan.virtual_size(model.num_layers)
    size = default_bucket_params(plan.data_parallel_size)
    first = max(1, math.ceil(params / v / size))
    return first + (v - 1), params / v / first


def _nodes(stride: int, size: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes a group spans, members per node) for a group of ``size`` ranks ``stride`` apart."""
    if group_node_spread(stride, size, gpus_per_node) == 0:
        return 1, size
    per_node = max(1, gpus_per_node // stride) if stride < gpus_per_node else 1
    per_node = min(per_node, size)
    return -(-size // per_node), per_node


def tree_all_reduce_latency(stride: int, size: int, system: SystemSpec) -> float:
    """Latency of NCCL's tree all-reduce: up and down a double binary tree over the nodes (log2 nodes
    network steps) and a chain through the members inside each node."""
    nodes, per_node = _nodes(stride, size, system.gpus_per_node)
    return 2 * (math.ceil(math.log2(nodes)) * system.network_latency_s + (per_node - 1) * system.nvlink_latency_s) \
        if nodes > 1 else 2 * (per_node - 1) * system.nvlink_latency_s


def all_reduce_choice(nbytes: float, size: int, stride: int, link: Link, system: SystemSpec) -> tuple[float, str]:
    """Seconds and algorithm of one all-reduce of ``nbytes`` as NCCL picks it: the ring, 2 (n - 1) step
    latencies + 2 (n - 1)/n bytes, or the tree, its log-depth latency + 2 bytes over the same bus bandwidth
    (each rank sends and receives the buffer once up and once down)."""
    if size <= 1:
        return 0.0, "ring"
    ring = 2 * all_gather_seconds(nbytes, size, link)
    tree = tree_all_reduce_latency(stride, size, system) + 2 * nbytes / link.bandwidth
    return (tree, "tree") if tree < ring else (ring, "ring")


def dp_comm(model: ModelSpec, plan: Plan, system: SystemSpec) -> DataParallelComm:
    """The data-parallel collectives of one iteration (:class:`DataParallelComm`), not yet overlapped. A MoE model's
    routed experts have buffers of their own, reduced over their expert data-parallel group (edp ranks ``ep etp``
    apart) after the dense parameters' (d ranks t apart): the two streams' collectives add up."""
    d, p, t = plan.data_parallel_size, plan.pipeline_model_parallel_size, plan.tensor_model_parallel_size
    n, stage = max((stage_params(model, plan, k), k) for k in {0, p - 1})
    experts = stage_expert_params(model, plan, stage)
    fp8_weights = fp8.gemm_weight_params(model, plan, plan.stage_fp8_layers(model.num_layers, stage))
    dense = _group_comm(model, plan, system, n - experts, d, t, fp8_weights)
    if not experts:
        return dense
    edp, grid = moe.expert_data_parallel_size(plan), plan.expert_model_parallel_size * moe.expert_tensor_parallel_size(plan)
    ex = _group_comm(model, plan, system, experts, edp, grid)
    if ex.buckets == 0:
        return dense
    if dense.buckets == 0:
        return ex
    return DataParallelComm(dense.buckets + ex.buckets, dense.grad_seconds + ex.grad_seconds,
                            dense.param_seconds + ex.param_seconds, dense.latency_seconds + ex.latency_seconds,
                            max(dense.last_grad_bucket_seconds, ex.last_grad_bucket_seconds),
                            max(dense.last_param_bucket_seconds, ex.last_param_bucket_seconds), dense.all_reduce_algorithm)


def _group_comm(model: ModelSpec, plan: Plan, system: SystemSpec, n: int, d: int, t: int,
                fp8_weights: int = 0) -> DataParallelComm:
    """The collectives of ``n`` parameters' gradients (and parameters) over a group of ``d`` ranks ``t`` apart,
    ``fp8_weights`` of them FP8 layers' GEMM weights (all-gathered in FP8 with --fp8-param-gather)."""
    if d == 1 or n <= 0:
        return DataParallelComm(0, 0.0, 0.0, 0.0, 0.0, 0.0, "ring")
    link = group_link(t, d, system)
    if plan.use_torch_fsdp2:  # collectives per fully_shard unit, not DDP buckets
        return _fsdp2_comm(model, plan, n, link)
    buckets, last = ddp_buckets(model, plan, n)
    rest = (n - last) / max(1, buckets - 1)  # the other buckets (all alike when v = 1)
    gbytes = plan.grad_bytes  # fp32, or bf16 with --grad-reduce-in-bf16
    if plan.use_distributed_optimizer:
        # reduce-scatter: the same ring cost as the all-gather of its input
        pbytes = fp8.param_gather_bytes(plan, n, fp8_weights)  # BF16; with --fp8-param-gather FP8 GEMM weights
        last_g, last_p = all_gather_seconds(last * gbytes, d, link), all_gather_seconds(last * pbytes, d, link)
        grads = last_g + (buckets - 1) * all_gather_seconds(rest * gbytes, d, link)
        params = last_p + (buckets - 1) * all_gather_seconds(rest * pbytes, d, link)
        latency, algo = 2 * buckets * (d - 1) * link.latency, "ring"
    else:
        last_g, algo = all_reduce_choice(last * gbytes, d, t, link, system)
        grads = last_g + (buckets - 1) * all_reduce_choice(rest * gbytes, d, t, link, system)[0]
        params = last_p = 0.0
        latency = buckets * (2 * (d - 1) * link.latency if algo == "ring" else tree_all_reduce_latency(t, d, system))
    return DataParallelComm(buckets, grads, params, latency, last_g, last_p, algo)


FSDP2_EXTRA_UNITS = 2
"""``fully_shard`` units of a chunk beside its transformer layers: the embedding and the output layer (the chunk
itself, whose own parameters are the final norm's, is gathered with the last of them)."""


def _fsdp2_comm(model: ModelSpec, plan: Plan, n: int, link: Link) -> DataParallelComm:
    """Torch FSDP2's collectives for one microbatch (:func:`dp_exposed` multiplies them): one all-gather of each
    ``fully_shard`` unit's parameters and one reduce-scatter of its gradients, both in the parameters' dtype (no
    mixed-precision policy: megatron-core's wrapper passes none, so bf16 with --bf16); a unit is a layer (or the
    embedding / output layer), n / units parameters each."""
    d = plan.data_parallel_size
    units = plan.stage_layers(model.num_layers, 0) + FSDP2_EXTRA_UNITS
    one = all_gather_seconds(n / units * BF16, d, link)
    return DataParallelComm(units, units * one, units * one, 2 * units * (d - 1) * link.latency, one, one, "ring")


def bucketed_exposed(comm: float, buckets: int, chunks: int, unit: float, group: int,
                     last_bucket: float | None = None) -> float:
    """Exposed part of Megatron's bucketed gradient reduce-scatter (or parameter all-gather) stream on the
    rank that finishes last (rank 0), with ``chunks`` = v model chunks of ``unit`` seconds of one
    microbatch's backward (forward) each.

    Interleaved 1F1B runs its last group of microbatches (``group`` = g_last of them: m mod g, or g, with g
    = --microbatch-group-size-per-virtual-pipeline-stage, by default p) as g_last backward units of chunk v - 1,
    then g_last of chunk v - 2, ..., g_last of chunk 0 (megatron-core's schedule table), so chunk j's gradients
    are complete j g_last units before the end, and within its last unit they arrive bucket by bucket. One link
    drains them in that order, each chunk carrying comm / v: it ends max_j ((j + 1) comm / v - j g_last unit -
    unit) after the backward -- j = v - 1 (the link is the bottleneck: comm - ((v - 1) g_last + 1) unit) or
    j = 0 (the last chunk alone: comm / v - unit) -- and at least one bucket after it. The parameter all-gather
    mirrors it in the forward with the first group, g microbatches (chunk j is first used j g units after the
    start). v = 1: comm - unit. ``last_bucket``: seconds of that last bucket (default comm / buckets)."""
    window = ((chunks - 1) * group + 1) * unit
    return max(comm / buckets if last_bucket is None else last_bucket, comm - window, comm / chunks - unit)


def dp_exposed(model: ModelSpec, plan: Plan, system: SystemSpec, bwd_unit: float, fwd_unit: float,
               mb_window: float = math.inf) -> float:
    """Exposed data-parallel communication of one iteration (the stage with most parameters). ``bwd_unit``
    and ``fwd_unit``: one microbatch's backward (forward) of one model chunk (:func:`bucketed_exposed`).

    Megatron FSDP with sharded gradients reduce-scatters after every microbatch's backward (m times the
    traffic; with --overlap-grad-reduce it runs behind the compute of the following microbatches,
    ``mb_window`` seconds each, and the last one's backward); with sharded parameters it also all-gathers
    them before every microbatch's forward and backward (2 m times; with --overlap-param-gather behind
    the compute, which the two share: their traffic together hides only in the m microbatches' compute), and there
    is no all-gather after the optimizer step. Torch FSDP2 does the same, always
    overlapped (its prefetching streams), with one all-gather per microbatch instead of two when it keeps the
    gathered parameters from the forward to the backward (--torch-fsdp2-no-reshard-after-forward)."""
    c = dp_comm(model, plan, system)
    if c.buckets == 0:
        return 0.0
    grads, params, buckets = c.grad_seconds, c.param_seconds, c.buckets
    v = plan.virtual_size(model.num_layers)
    last_group, first_group = plan.last_microbatch_group(), plan.microbatch_group_size()
    bwd_window = ((v - 1) * last_group + 1) * bwd_unit
    strategy = plan.sharding_strategy
    if strategy is not None:
        m = plan.num_microbatches
        grads *= m
        if plan.overlap_grad_reduce or plan.use_torch_fsdp2:
            grads = max(grads / (m * buckets), grads - (m - 1) * mb_window - bwd_window)
        if strategy == "optim_grads_params":
            gathers = m if plan.use_torch_fsdp2 and not plan.torch_fsdp2_reshard_after_forward else 2 * m
            traffic = c.grad_seconds * m + c.param_seconds * gathers
            params *= gathers
            if plan.overlap_param_gather or plan.use_torch_fsdp2:
                params = max(params / (gathers * buckets), params - m * mb_window)
            # the reduce-scatters and all-gathers share the data-parallel link: together they hide only in the
            # microbatches' compute
            return max(grads + params, traffic - m * mb_window)
    elif plan.overlap_grad_reduce:
        grads = bucketed_exposed(grads, buckets, v, bwd_unit, last_group, c.last_grad_bucket_seconds)
    if plan.overlap_param_gather and params:
        params = bucketed_exposed(params, buckets, v, fwd_unit, first_group, c.last_param_bucket_seconds)
    return grads + params


def optimizer_step_seconds(model: ModelSpec, plan: Plan, system: SystemSpec) -> float:
    """The ``optimizer`` term: the step on the optimizer shard of the stage with most parameters (HBM-bound:
    ``ADAM_BYTES_PER_PARAM`` per parameter of the shard, the fp32 gradient zeroing of the whole buffer); with FP8
    also the weights' once-per-iteration cast (``fp8.step_seconds``); with --optimizer-cpu-offload the device
    steps 1 - F of the shard and the CPU the rest (``optimizer_offload.step_seconds``)."""
    p = plan.pipeline_model_parallel_size
    n, k = max((stage_params(model, plan, k), k) for k in {0, p - 1})
    shard = optimizer_shard_params(model, plan, k, n)
    on_device = optimizer_offload.device_params(shard, plan)
    return elementwise_seconds(on_device * ADAM_BYTES_PER_PARAM + n * FP32, kernel_rates(system),
                               kernels=OPTIMIZER_KERNELS) \
        + fp8.step_seconds(model, plan, system, plan.stage_fp8_layers(model.num_layers, k)) \
        + optimizer_offload.step_seconds(model, plan, system, shard)
