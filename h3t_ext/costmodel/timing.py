"""Iteration time: structural terms priced with the system's peaks and a few fitted efficiencies.

Per microbatch and rank (all v chunks):

* ``compute``   GEMMs (2 * tokens * params / t FLOPs forward, twice that backward) at ``gemm`` efficiency,
                causal flash attention (2 * s^2 * h / (c t) FLOPs forward, twice that backward) at
                ``attention`` efficiency, and memory-bound elementwise work (norms, RoPE, SwiGLU, residual
                adds) priced by HBM bytes at ``elementwise_hbm`` efficiency. First stage: nothing extra
                worth pricing; last stage: the output-layer GEMM and the cross entropy.
                The weight-gradient GEMMs accumulate into the fp32 main grads (gradient-accumulation
                fusion): every microbatch reads and writes 8 bytes per parameter, so a wgrad GEMM takes
                max(its FLOPs at ``gemm``, those bytes at ``elementwise_hbm``) (``_wgrad``). Its intensity is
                tokens/4 FLOP per byte (tokens = mb * s / c, t cancels); at the H800 rates it is
                memory-bound below 4 * gemm / hbm ~ 900 tokens per GEMM. The published rows (4096+
                tokens per GEMM) are compute-bound, so the term changes none of them.
* ``recompute`` ckpt=ours: the two RMSNorm outputs and the SwiGLU output, memory-bound; ckpt=full:
                one more forward of every layer.
* ``tp_comm``   sequence-parallel all-gathers / reduce-scatters over NVLink; the fraction that the
                userbuffer overlap does not hide is ``tp_comm_exposed``.
* ``cp_comm``   K/V all-gather (forward), its re-gather and the reduce-scatter of the K/V gradients
                (backward), each exposed only where a data dependency leaves nothing to hide behind
                (``_cp_exposed``: a half of K/V cannot move before the GEMM that produces it; the overlap
                with the QKV GEMM is on except for GQA models).
* ``pp_p2p``    activations between pipeline ranks; overlapped in the steady state, exposed on the
                fill/drain critical path (2 (p-1) hops).
* ``bubble``    interleaved 1F1B: (p-1)/v of one microbatch's forward+backward on the slowest rank.
* ``dp_exposed`` distributed optimizer: fp32 gradient reduce-scatter and bf16 parameter all-gather over
                the data-parallel group, exposed unless the plan overlaps them (see ``_dp_exposed``).
* ``optimizer`` Adam step on the optimizer shard and zeroing of the grad buffer (memory-bound).
* ``offload_exposed`` PCIe copies that do not fit behind the compute action they overlap (the
                offload hides behind the next action, a backward in the steady state; the reload behind
                the action before the backward, a forward).

Group placement follows the rank order tensor, context, data, pipeline: a group whose span
(stride * size) fits in a node talks over NVLink, otherwise over the network.
"""
from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass

from h3t_ext.costmodel.memory import stage_params
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec

BF16, FP32 = 2, 4


@dataclass(frozen=True)
class _Rates:
    gemm: float
    attention: float
    hbm: float
    nvlink: float
    network: float
    pcie: float
    tp_exposed: float


def _rates(system: SystemSpec) -> _Rates:
    e = system.efficiency
    return _Rates(
        gemm=system.peak_bf16_flops * e("gemm"),
        attention=system.peak_bf16_flops * e("attention"),
        hbm=system.hbm_bandwidth * e("elementwise_hbm"),
        nvlink=system.nvlink_bandwidth * e("nvlink"),
        network=system.network_bandwidth * e("network"),
        pcie=system.pcie_bandwidth * e("pcie"),
        tp_exposed=e("tp_comm_exposed"),
    )


@functools.lru_cache(maxsize=4096)
def group_node_spread(stride: int, size: int, gpus_per_node: int) -> int:
    """Fewest members any group of this dimension has in one of its nodes; 0 when every group lies inside
    one node. Groups are ``inner + outer * stride * size + j * stride`` (j < size), the rank order of
    Megatron (tensor fastest, then context, data, pipeline); the layout repeats every lcm(block, node)."""
    block = stride * size
    period = block * gpus_per_node // math.gcd(block, gpus_per_node)
    fewest, crosses = size, False
    for base in range(0, period, block):
        for inner in range(stride):
            nodes = collections.Counter((base + inner + j * stride) // gpus_per_node for j in range(size))
            if len(nodes) > 1:
                crosses = True
                fewest = min(fewest, min(nodes.values()))
    return fewest if crosses else 0


def group_bandwidth(stride: int, size: int, system: SystemSpec, rates: _Rates) -> float:
    """Per-GPU bus bandwidth of a ring collective over ``size`` ranks ``stride`` apart.

    Inside a node: NVLink. Across nodes NCCL runs one ring channel per NIC, so a node holding k members
    of the group drives k NICs; the node with the fewest members sets the pace: min(NVLink, k * network).
    """
    k = group_node_spread(stride, size, system.gpus_per_node)
    return rates.nvlink if k == 0 else min(rates.nvlink, k * rates.network)


def p2p_bandwidth(stride: int, size: int, system: SystemSpec, rates: _Rates) -> float:
    """Bandwidth of a transfer between pipeline neighbours ``stride`` apart (one NIC when any neighbour
    pair crosses a node; the fill/drain critical path goes through every pair)."""
    return rates.nvlink if group_node_spread(stride, size, system.gpus_per_node) == 0 else rates.network


def _wgrad(gemm: float, params: float, rates: _Rates) -> float:
    """Seconds of a weight-gradient GEMM of ``gemm`` seconds' FLOPs that accumulates into the fp32 main
    grads of ``params`` parameters (read + write, 8 bytes each): the roofline of the two."""
    return max(gemm, 2 * FP32 * params / rates.hbm)


def _layer_times(model: ModelSpec, plan: Plan, rates: _Rates) -> dict[str, float]:
    """Seconds of one layer for one microbatch on one rank: forward and backward parts."""
    t, c, s, mb = plan.tensor_model_parallel_size, plan.context_parallel_size, plan.seq_length, plan.micro_batch_size
    h, hkv, f = model.hidden_size, model.kv_hidden_size, model.ffn_hidden_size
    seq = mb * s // c  # tokens of the rank's context shard
    local = seq // t
    gemm = 2 * seq * model.params_per_layer / t / rates.gemm
    wgrad = _wgrad(gemm, model.params_per_layer / t, rates)
    attn = 2 * mb * s * s * h / (c * t) / rates.attention
    # elementwise bytes: norms + residual adds on local tokens, RoPE + activation on the full shard.
    elem_bytes = BF16 * (local * 10 * h + seq * (model.fc1_width + f + 2 * (h + hkv)) / t)
    elem = elem_bytes / rates.hbm
    recompute_ours = BF16 * (local * 4 * h + seq * (model.fc1_width + f) / t) / rates.hbm
    return {"gemm_f": gemm, "attn_f": attn, "elem_f": elem, "fwd": gemm + attn + elem,
            "bwd": gemm + wgrad + 2 * attn + 2 * elem, "recompute_ours": recompute_ours,
            "qkv_gemm": 2 * seq * (h * h + 2 * h * hkv) / t / rates.gemm,
            "q_gemm": 2 * seq * h * h / t / rates.gemm, "kv_gemm": 2 * seq * h * hkv / t / rates.gemm}


def _cp_exposed(gather: float, lt: dict[str, float], *, overlap: bool, full_recompute: bool) -> float:
    """Exposed seconds of one layer's context-parallel K/V traffic (one microbatch, one rank).

    ``gather``: one all-gather of the rank's K and V shards over the context-parallel group (the
    reduce-scatter of their gradients moves the same bytes). K and V are two halves on one communication
    stream; a half cannot be sent before the GEMM that produces it, nor consumed before it arrives.

    * forward, overlap on: the QKV GEMM runs as K, V, Q; K is gathered behind the V and Q GEMMs, V behind
      the Q GEMM; what outlasts the Q GEMM is exposed. Overlap off: the whole gather.
    * backward, re-gather of the saved K/V shards: issued when the layer's backward starts, it runs behind
      the MLP and output-projection backward GEMMs. ckpt=full re-runs the forward (and its gather) instead.
    * backward, reduce-scatter of dK, dV (after the attention backward), overlap on: behind the Q part of
      the QKV dgrad + wgrad, then dV's half behind the K part; overlap off: exposed.
    """
    a, gq, gkv = gather / 2, lt["q_gemm"], lt["kv_gemm"]
    if overlap:
        ag_v_end = max(gkv + a, 2 * gkv) + a
        fwd = max(0.0, ag_v_end - (2 * gkv + gq))
        start_k = max(2 * gq, a)
        start_v = max(start_k + 2 * gkv, 2 * a)
        rs = start_v - 2 * gq - 2 * gkv
    else:
        fwd, rs = gather, gather
    if full_recompute:
        return 2 * fwd + rs
    regather = max(0.0, gather - 2 * (lt["gemm_f"] - lt["qkv_gemm"]))
    return fwd + regather + rs


def _dp_exposed(plan: Plan, reduce_scatter: float, all_gather: float, v: int, cooldown: float) -> float:
    """Exposed data-parallel seconds. Without overlap both collectives are on the critical path. With
    --overlap-grad-reduce the reduce-scatter of chunks v-1..1 runs behind the cool-down backwards (the
    last chunk's share stays exposed); with --overlap-param-gather the all-gather of chunks 1..v-1 runs
    behind the next iteration's forwards (the first chunk's share stays exposed)."""
    rs, ag = reduce_scatter, all_gather
    if plan.overlap_grad_reduce:
        rs = rs / v + max(0.0, (v - 1) / v * rs - cooldown)
    if plan.overlap_param_gather:
        ag = ag / v
    return rs + ag


def time_terms(model: ModelSpec, plan: Plan, system: SystemSpec, *, alphas: tuple[float, ...],
               chunk_bytes: int, offloaded_chunks: tuple[int, ...]) -> dict[str, float]:
    """Seconds per iteration by term (they add up to the iteration time)."""
    r = _rates(system)
    t, c, p = plan.tensor_model_parallel_size, plan.context_parallel_size, plan.pipeline_model_parallel_size
    d, m, mb, s = plan.data_parallel_size, plan.num_microbatches, plan.micro_batch_size, plan.seq_length
    v = plan.virtual_size(model.num_layers)
    h, V = model.hidden_size, model.padded_vocab_size(t)
    lt = _layer_times(model, plan, r)
    layers = model.num_layers // p
    seq = mb * s // c
    local = seq // t

    fwd = layers * lt["fwd"]
    bwd = layers * lt["bwd"]
    head_gemm = 2 * seq * V * h / t / r.gemm  # output GEMM
    head_ce = BF16 * seq * V / t * 4 / r.hbm  # cross entropy
    head_fb = 2 * head_gemm + _wgrad(head_gemm, V * h / t, r) + 3 * head_ce  # forward + dgrad + wgrad
    rec = {"no": 0.0, "ours": layers * lt["recompute_ours"], "full": fwd}[plan.ckpt]

    # tensor parallel (sequence parallel): 4 collectives forward, 6 backward, (t-1)/t of s/c*h bf16 each
    tp = 0.0
    if t > 1:
        vol = (t - 1) / t * seq * h * BF16
        n_coll = 10 + (4 if plan.ckpt == "full" else 0)
        tp = layers * n_coll * vol / group_bandwidth(1, t, system, r) * r.tp_exposed
    cp = 0.0
    if c > 1:
        kv = (c - 1) / c * mb * s * 2 * model.kv_hidden_size * BF16 / t
        cp = layers * _cp_exposed(kv / group_bandwidth(t, c, system, r), lt,
                                  overlap=model.num_query_groups == model.num_attention_heads,
                                  full_recompute=plan.ckpt == "full")

    # the last rank (output layer + loss) sets the pace of the steady state
    per_mb = fwd + bwd + head_fb + rec + tp + cp
    bubble = (p - 1) / v * per_mb if p > 1 else 0.0

    hop = local * h * BF16 / p2p_bandwidth(t * d, p, system, r) if p > 1 else 0.0
    pp = 2 * (p - 1) * hop

    # offload: per chunk, the copy that does not fit behind the compute action it overlaps
    off = 0.0
    if chunk_bytes and any(a > 0 for a in alphas):
        f_chunk = (fwd + tp / 3) / v
        b_chunk = (bwd + rec + 2 * tp / 3) / v
        worst = 0.0
        for a, n in zip(alphas, offloaded_chunks):
            copy = a * chunk_bytes / r.pcie
            worst = max(worst, n * (max(0.0, copy - f_chunk) + max(0.0, copy - b_chunk)))
        off = worst

    # data parallel (distributed optimizer)
    n = max(stage_params(model, plan, k) for k in {0, p - 1})
    dp = 0.0
    if d > 1:
        bw = group_bandwidth(t, d, system, r)
        rs = (d - 1) / d * n * FP32 / bw
        ag = (d - 1) / d * n * BF16 / bw
        dp = _dp_exposed(plan, rs, ag, v, cooldown=(v - 1) * p * (bwd + rec) / v if p > 1 else 0.0)
    opt = n * (FP32 * 3 * 2 + BF16) / d / r.hbm + n * FP32 / r.hbm  # Adam step on the shard + zero grads

    return {
        "compute": m * (fwd + bwd + head_fb),
        "recompute": m * rec,
        "tp_comm": m * tp,
        "cp_comm": m * cp,
        "pp_p2p": pp,
        "bubble": bubble,
        "dp_exposed": dp,
        "optimizer": opt,
        "offload_exposed": off,
    }
