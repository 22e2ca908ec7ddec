"""Iteration time from the shapes each rank runs: every term is kernels (kernels.py) or collectives
(collectives.py) priced with the system file's datasheet numbers and named efficiencies.

Per microbatch, layer and rank (tokens T = micro_batch * s / c of the rank's context shard; with sequence
parallelism the GEMMs see all T tokens of the tensor-parallel group, the norms T / t):

* GEMMs: QKV [T, h] x [h, (h + 2 h_kv)/t], projection [T, h/t] x [h/t, h], FC1 [T, h] x [h, fc1/t],
  FC2 [T, f/t] x [f/t, h]; backward runs the data-gradient GEMM (same FLOPs) and the weight-gradient GEMM
  that accumulates into the fp32 main grads. Each is priced by ``kernels.gemm_seconds`` (tile and wave
  quantization over the SMs, memory-bound roofline for thin GEMMs). With --fp8-format all three run at the FP8
  rate and each GEMM input / output gradient is cast (``fp8.cast_seconds``; the weights' cast: ``optimizer``).
* attention: flash attention over the rank's heads (h/t) and chunk (``attention_seconds``), slower with
  attention dropout (``kernels.flash_attention_seconds``); with context
  parallelism a ring of c steps in which each step's K/V exchange with the neighbour runs against that
  step's attention block (only what outlasts the block is exposed; backward moves K/V and dK/dV).
* element-wise: norms, residual adds (with hidden dropout, their masks), RoPE and the activation function
  as HBM traffic.
* ``recompute``: ckpt=ours the norm outputs and activation function; Megatron's recompute as
  :mod:`h3t_ext.costmodel.recompute` prices it (full units their forward, selective core_attn / mlp their forward);
  full one more forward of every layer (and its tensor-parallel traffic).
* ``tp_comm``: sequence parallel: 4 collectives (all-gather / reduce-scatter of [T, h]) forward, 6
  backward; without sequence parallel 2 all-reduces each way. --tp-comm-overlap leaves
  ``tp_comm_overlap_exposed`` of them on the critical path; without it the forward ones are exposed and the
  backward re-gather and gradient reduce-scatter/all-reduce run against the data/weight-gradient GEMMs
  (Megatron's async communication in the linear layers), exposed only where they outlast those GEMMs.
* ``pp_p2p``: activations between pipeline ranks, one hop per virtual stage boundary: the first
  microbatch's forward and the last one's backward cross all p v - 1 boundaries on the critical path
  (2 (p v - 1) hops: at each warm-up wrap rank 0 has finished its p chunks while the microbatch still needs
  p hops to come back); plain 1F1B also waits for the two blocking exchanges of every steady-state
  microbatch, and so does the interleaved schedule without --overlap-p2p-communication for its one exchange
  (forward and backward together) of every steady-state microbatch and chunk. With tied embeddings and
  p > 1, the word-embedding gradient all-reduce between the first and the last stage after the backward.
* ``bubble``: (interleaved) 1F1B: 1/v of one microbatch's forward + backward on every rank but the slowest
  ((p - 1)/v microbatches of the slowest rank when the ranks are alike).
* ``dp_exposed`` and ``optimizer``: the data-parallel terms, :mod:`h3t_ext.costmodel.data_parallel` (DDP
  buckets x per-collective NCCL latency, ring or tree, what the last microbatch's backward / the first
  forward cannot hide, the optimizer step on the shard); this module passes it the overlap windows.
* ``offload_exposed``: PCIe copies that do not fit behind what they overlap: each reload the compute action it is
  issued before, the first offloaded backward's reload also the offload queue ahead of it, less the bubble and a
  lighter stage's spare compute that the fill, drain and stalls share (``_offload_exposed``).
"""
from __future__ import annotations

import functools
import math
from typing import Optional
from dataclasses import replace

from h3t_ext.costmodel import fp8, moe
from h3t_ext.costmodel.collectives import (
    Link,
    all_gather_seconds,
    all_reduce_seconds,
    group_link,
    host_copy_seconds,
    p2p_link,
    p2p_seconds,
)
from h3t_ext.costmodel.elementwise import (
    NORM_KERNELS_BWD,
    NORM_KERNELS_FWD,
    activation_extra_kernels,
    cross_entropy_seconds,
    layer_elementwise_bytes,
    timed_activation_impl,
)
from h3t_ext.costmodel.activations import ReloadCounts, mlp_activation_impl
from h3t_ext.costmodel.kernels import (
    LINEAR_PASSES,
    KernelRates,
    elementwise_seconds,
    flash_attention_seconds,
    kernel_rates,
    linear_pass_seconds,
    recipe_rates,
    unfused_attention_seconds,
)
from h3t_ext.costmodel.data_parallel import dp_exposed, optimizer_step_seconds
from h3t_ext.costmodel.layer_offload import p1_exposed_seconds
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.recompute import chunk_layers, chunk_units, plan_recompute, recompute_seconds
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec
from h3t_ext.costmodel.te_version import cross_entropy_impl
from h3t_ext.costmodel.time_records import HeadTime, LayerTime, ShapeTimes, TimeTerms, record_fields  # noqa: F401 (re-exported)
from h3t_ext.dtypes import BF16, FP32

CP_MERGE_BYTES_FWD = BF16 + FP32 + FP32
"""Context-parallel ring forward, per output element and step: read the step's bf16 output, read and write
the fp32 accumulated output (the softmax-lse rescaling of TransformerEngine's ring attention)."""
CP_MERGE_BYTES_BWD = FP32 + FP32
"""Backward, per dQ / dK / dV element and step: read and write the fp32 gradient accumulators."""
ELEMENTWISE_KERNELS_FWD = 2 * NORM_KERNELS_FWD + 2 + 1
"""Element-wise kernels of one layer's forward in megatron-core 0.16.1 ``transformer/transformer_layer.py``:
``input_layernorm`` and ``pre_mlp_layernorm``, the two jit-fused bias-dropout-adds (``self_attn_bda``,
``mlp_bda``: ``fusions/fused_bias_dropout.py``, one kernel each) and the jit-fused activation
(``bias_swiglu_impl`` / ``bias_gelu_impl``, ``transformer/mlp.py``)."""
ELEMENTWISE_KERNELS_BWD = 2 * NORM_KERNELS_BWD + 2 + 1
"""... and of its backward: the two norm backwards, autograd's sums of the residual stream's two gradients
(where the stream feeds a norm and an add: one add kernel at each of the two residual branches) and the
jit-fused activation backward (``bias_swiglu_back`` / ``bias_gelu_back``); plus ``HIDDEN_DROPOUT_KERNELS_BWD``
with hidden dropout, ``BIAS_GRAD_KERNELS`` with linear biases and ``ROPE_KERNELS`` with rotary embeddings."""
HIDDEN_DROPOUT_KERNELS_BWD = 2
"""With hidden dropout the two fused bias-dropout-adds have a jit-fused backward each (mask x gradient);
without it the add passes the gradient through (no kernel)."""
BIAS_GRAD_KERNELS = 1
"""With linear biases: autograd's reduction over the tokens of the full-size bias gradient the fused
bias-activation function returns (the other biases come from cuBLAS epilogues)."""
ROPE_KERNELS = 2
"""Rotary embeddings (Llama): ``apply_rotary_pos_emb`` on q and on k in ``transformer/attention.py``
(TransformerEngine's fused RoPE, one kernel each), forward and again backward."""
OURS_RECOMPUTE_KERNELS = 2 * NORM_KERNELS_FWD + 1
"""ckpt=ours recomputes the two norms' outputs and the activation function in the backward."""
CP_MERGE_KERNELS = 2
"""Context-parallel ring: per step after the first, the softmax-lse correction and the fp32 accumulation
of the step's partial result (TransformerEngine's ``AttnFuncWithCPAndKVP2P``: two element-wise kernels)."""
LAYER_GEMMS = ("qkv", "proj", "fc1", "fc2")
"""The linear layers of one transformer layer, in order."""


def layer_gemm_shapes(model: ModelSpec, plan: Plan) -> dict[str, tuple[int, int, int]]:
    """(m, n, k) of the four linear layers of one layer on one rank (X[m, k] -> Y[m, n], m the GEMMs' tokens);
    ``kernels.linear_pass_gemm`` gives the GEMM each pass runs."""
    t, tokens = plan.tensor_model_parallel_size, plan.micro_batch_size * plan.seq_length // plan.context_parallel_size
    h, q, hkv, f = model.hidden_size, model.query_hidden_size, model.kv_hidden_size, model.dense_ffn_hidden_size
    return dict(zip(LAYER_GEMMS, ((tokens, (q + 2 * hkv) // t, h), (tokens, h, q // t),
                                  (tokens, model.fc1_width // t, h), (tokens, h, f // t))))


def output_layer_gemm_shape(model: ModelSpec, plan: Plan) -> tuple[int, int, int]:
    """(m, n, k) of the output layer on the last stage: tokens x the rank's padded vocabulary shard x h."""
    t = plan.tensor_model_parallel_size
    tokens = plan.micro_batch_size * plan.seq_length // plan.context_parallel_size
    return tokens, model.padded_vocab_size(t) // t, model.hidden_size


def layer_gemm_seconds(model: ModelSpec, plan: Plan, r: KernelRates) -> dict[str, float]:
    """Forward, data-gradient and weight-gradient GEMM seconds of one layer (one microbatch, one rank),
    and the QKV and FC1 backward GEMMs that the sequence-parallel backward communication overlaps; all
    three at the FP8 rate with --fp8-format (TransformerEngine runs dgrad and wgrad in FP8 too)."""
    return dict(_layer_gemms(tuple(layer_gemm_shapes(model, plan).values()), r, plan.fp8 is not None))


@functools.lru_cache(maxsize=4096)
def _layer_gemms(shapes: tuple[tuple[int, int, int], ...], r: KernelRates, q: bool) -> tuple[tuple[str, float], ...]:
    """:func:`layer_gemm_seconds` of the four GEMM shapes (pure; memoised: plans of many micro batch and context
    sizes share their tokens, and every checkpointing mode its GEMMs)."""
    fwd = dgrad = wgrad = 0.0
    per = []
    for m, n, k in shapes:
        f, d, w = (linear_pass_seconds(p, m, n, k, r, fp8=q) for p in LINEAR_PASSES)
        fwd, dgrad, wgrad = fwd + f, dgrad + d, wgrad + w
        per.append((f, d, w))
    return (("fwd", fwd), ("dgrad", dgrad), ("wgrad", wgrad), ("qkv_dgrad", per[0][1]), ("qkv_wgrad", per[0][2]),
            ("fc1_dgrad", per[2][1]), ("fc1_wgrad", per[2][2]))


def _cp_link(plan: Plan, system: SystemSpec) -> Link:
    return p2p_link(plan.tensor_model_parallel_size, plan.context_parallel_size, system)


def attention_seconds(model: ModelSpec, plan: Plan, system: SystemSpec, r: KernelRates) -> dict[str, float]:
    """Attention of one layer (one microbatch, one rank): forward and backward seconds including what the
    context-parallel K/V ring leaves exposed (reported separately as ``cp_fwd``/``cp_bwd``)."""
    c = plan.context_parallel_size
    kernel = plan.attention_kernel(system)
    link = _cp_link(plan, system) if c > 1 and kernel != "unfused" else None
    windowed = model.windowed_layers if model.window_size is not None and model.window_size < plan.seq_length \
        else 0
    return dict(_attention(model.num_attention_heads, model.head_dim, model.kv_hidden_size, model.query_hidden_size,
                           model.attention_dropout > 0, kernel, plan.tensor_model_parallel_size, c,
                           plan.seq_length, plan.micro_batch_size, r, link,
                           model.window_size if windowed else None, windowed / model.num_layers))


@functools.lru_cache(maxsize=4096)
def _attention(heads: int, d: int, kv_hidden: int, q_hidden: int, drop: bool, kernel: str, t: int, c: int, s: int,
               mb: int, r: KernelRates, link: Optional[Link], window: Optional[int] = None,
               windowed_share: float = 0.0) -> tuple[tuple[str, float], ...]:
    """:func:`attention_seconds` of the model's attention sizes and the plan's (pure; memoised: every
    checkpointing mode and precision of a search shares it). With a sliding ``window`` on ``windowed_share`` of the
    layers, the flash kernels of an average layer: that share of the band's time and the rest of the causal
    triangle's (the unfused attention computes every score whatever the mask; the plan check refuses a window with
    context parallelism)."""
    bh = mb * heads // t
    if kernel == "unfused":
        return (("fwd", unfused_attention_seconds(bh, s // c, d, r, backward=False, dropout=drop)),
                ("bwd", unfused_attention_seconds(bh, s // c, d, r, backward=True, dropout=drop)), ("cp_fwd", 0.0),
                ("cp_bwd", 0.0))
    if c == 1:
        def layer(backward: bool) -> float:
            full = flash_attention_seconds(bh, s, s, d, r, causal=True, backward=backward, dropout=drop, kernel=kernel)
            if window is None:
                return full
            band = flash_attention_seconds(bh, s, s, d, r, causal=True, backward=backward, dropout=drop,
                                           window=window, kernel=kernel)
            return windowed_share * band + (1.0 - windowed_share) * full
        return (("fwd", layer(False)), ("bwd", layer(True)), ("cp_fwd", 0.0), ("cp_bwd", 0.0))
    # load-balanced causal ring (2c chunks): step 0 is the rank's own causal block, steps 1..c-1 are
    # s/c queries against half of a neighbour's s/c keys
    q = s // c
    out = {"cp_fwd": 0.0, "cp_bwd": 0.0}
    kv_bytes = mb * q * 2 * kv_hidden // t * BF16
    for name, backward, bytes_per_step in (("fwd", False, kv_bytes), ("bwd", True, 2 * kv_bytes)):
        diag = flash_attention_seconds(bh, q, q, d, r, causal=True, backward=backward, dropout=drop, kernel=kernel)
        off = flash_attention_seconds(bh, q, q // 2, d, r, causal=False, backward=backward, dropout=drop,
                                      kernel=kernel)
        send = p2p_seconds(bytes_per_step, link)
        # the c steps: the diagonal block, then c - 1 off-diagonal ones; every step after the first merges its
        # partial result into fp32 accumulators
        merge = (CP_MERGE_BYTES_BWD if backward else CP_MERGE_BYTES_FWD) * mb * q * (
            q_hidden + (2 * kv_hidden if backward else 0)) // t
        out[name] = diag + (c - 1) * off + (c - 1) * elementwise_seconds(merge, r, kernels=CP_MERGE_KERNELS)
        # the next block's K/V travels while a step computes (not after the last): exposed where it is longer
        out["cp_" + name] = max(0.0, send - diag) + (c - 2) * max(0.0, send - off)
    return tuple(out.items())


def _timed_activation_impl(plan: Plan) -> str:
    """The SwiGLU the time model prices (``elementwise.LEGACY_GLU_TIMED_AS_FUSED``)."""
    return timed_activation_impl(mlp_activation_impl(plan))


def _tp_seconds(model: ModelSpec, plan: Plan, system: SystemSpec, g: dict[str, float]) -> tuple[float, float]:
    """Exposed tensor-parallel communication of one layer: (forward, backward) seconds."""
    t = plan.tensor_model_parallel_size
    if t == 1:
        return 0.0, 0.0
    link = group_link(1, t, system)
    nbytes = plan.micro_batch_size * plan.seq_length // plan.context_parallel_size * model.hidden_size * BF16
    if plan.sequence_parallel:
        one = all_gather_seconds(nbytes, t, link)
        fwd_total, bwd_total = 4 * one, 6 * one
        bwd_overlappable = [(one, g["qkv_dgrad"]), (one, g["qkv_wgrad"]), (one, g["fc1_dgrad"]), (one, g["fc1_wgrad"])]
        bwd_blocking = 2 * one
    else:
        one = all_reduce_seconds(nbytes, t, link)
        fwd_total, bwd_total = 2 * one, 2 * one
        bwd_overlappable = [(one, g["qkv_wgrad"]), (one, g["fc1_wgrad"])]
        bwd_blocking = 0.0
    if plan.tp_comm_overlap:
        e = system.efficiency("tp_comm_overlap_exposed")
        return e * fwd_total, e * bwd_total
    return fwd_total, bwd_blocking + sum(max(0.0, comm - gemm) for comm, gemm in bwd_overlappable)


_CACHE_LIMIT = 65536
_shape_cache: dict = {}


def _shape_key(model: ModelSpec, plan: Plan, system: SystemSpec) -> tuple:
    """Everything a layer's (and the output layer's) time depends on; a search prices many plans that share it.
    (SystemSpec's hash leaves out its efficiencies, so their values are part of the key: fits try many.)"""
    return (model, system, tuple(system.efficiencies.values()), plan.tensor_model_parallel_size,
            plan.context_parallel_size, plan.seq_length,
            plan.micro_batch_size, plan.ckpt, plan.sequence_parallel, plan.tp_comm_overlap,
            plan.attention_kernel(system),
            plan.fp8 is not None, plan.fp8_recipe, plan.has_bf16_layers, plan.recompute, _timed_activation_impl(plan),
            cross_entropy_impl(plan),
            chunk_layers(model, plan) if plan.recompute.full else None,
            (plan.expert_model_parallel_size, plan.expert_tensor_parallel_size, plan.moe_token_dispatcher_type,
             plan.moe_grouped_gemm, plan.moe_shared_expert_overlap, plan.overlap_moe_expert_parallel_comm)
            if model.is_moe else None)


def shape_times(model: ModelSpec, plan: Plan, system: SystemSpec) -> ShapeTimes:
    """The layer's and the output layer's times of ``plan``'s shape. Memoised by ``_shape_key``: the cache
    only remembers this pure function's results, nothing else reads it."""
    key = _shape_key(model, plan, system)
    hit = _shape_cache.get(key)
    if hit is None:
        if len(_shape_cache) > _CACHE_LIMIT:
            _shape_cache.clear()
        bf16 = _layer_time(model, bf16_variant(plan), system) if plan.has_bf16_layers else None
        layer, x = (_layer_time(model, plan, system), None) if model.mixed_moe else _layer_parts(model, plan, system)
        hit = _shape_cache[key] = ShapeTimes(layer, _head_time(model, plan, system), bf16,
                                             _merge_hidden(model, plan, system, layer, x))
    return hit


def _merge_hidden(model: ModelSpec, plan: Plan, system: SystemSpec, lt: LayerTime,
                  x: Optional[moe.MoELayerTime]) -> float:
    """Seconds of exchange a merged forward-backward layer pair hides with --overlap-moe-expert-parallel-comm: the
    layer's forward and backward one after the other (``lt``, its MoE record ``x``), less the two merged
    (:func:`h3t_ext.costmodel.moe.merged_layer_seconds`); a pattern of dense and MoE layers hides its MoE layers'
    share."""
    if not (model.is_moe and plan.overlap_moe_expert_parallel_comm):
        return 0.0
    if model.mixed_moe:
        variant = model.moe_variant()
        return model.moe_layer_fraction * _merge_hidden(variant, plan, system, *_layer_parts(variant, plan, system))
    pre_fwd = lt.forward_action - lt.ep_fwd - x.mlp_fwd
    pre_bwd = lt.backward_action - lt.ep_bwd - lt.ep_recompute - x.mlp_dgrad - x.mlp_wgrad
    merged = moe.merged_layer_seconds(pre_fwd, x.mlp_fwd, pre_bwd, x.mlp_dgrad, x.mlp_wgrad, x.exchange)
    return max(0.0, lt.forward_action + lt.backward_action - lt.ep_recompute - merged)


def bf16_variant(plan: Plan) -> Plan:
    """``plan`` as its BF16 first / last layers run: without FP8 (the rest of the plan alike)."""
    return replace(plan, fp8=None, fp8_param_gather=False, first_last_layers_bf16=False)


def layer_time(model: ModelSpec, plan: Plan, system: SystemSpec) -> LayerTime:
    """Seconds of one layer for one microbatch on one rank, by part."""
    return shape_times(model, plan, system).layer


def head_time(model: ModelSpec, plan: Plan, system: SystemSpec) -> HeadTime:
    """Output layer and vocabulary-parallel cross entropy of one microbatch, forward and backward."""
    return shape_times(model, plan, system).head


def head_seconds(model: ModelSpec, plan: Plan, system: SystemSpec) -> float:
    """Output layer and vocabulary-parallel cross entropy of one microbatch (forward + backward)."""
    return head_time(model, plan, system).total


def _layer_time(model: ModelSpec, plan: Plan, system: SystemSpec) -> LayerTime:
    if model.mixed_moe:  # the pattern's average layer (exact per chunk where each holds the pattern's share)
        phi = model.moe_layer_fraction
        dense, moe_ = _layer_time(model.dense_variant(), plan, system), _layer_time(model.moe_variant(), plan, system)
        return LayerTime(**{f: (1 - phi) * getattr(dense, f) + phi * getattr(moe_, f) for f in record_fields(LayerTime)})
    return _layer_parts(model, plan, system)[0]


def _layer_parts(model: ModelSpec, plan: Plan, system: SystemSpec) -> tuple[LayerTime, Optional[moe.MoELayerTime]]:
    """One kind of layer (a dense one, or every layer of a MoE model that is not a pattern): its time by part and its
    MoE record (None for a dense layer)."""
    r = recipe_rates(kernel_rates(system), system, plan.fp8_recipe if plan.fp8 is not None else None)
    g = layer_gemm_seconds(model, plan, r)
    a = attention_seconds(model, plan, system, r)
    impl = _timed_activation_impl(plan)
    elem_fwd, elem_bwd, elem_ours, masks = layer_elementwise_bytes(model, plan, impl)
    rope = ROPE_KERNELS if model.rotates_qk else 0  # RoPE's kernels (as layer_elementwise_bytes)
    qk_fwd, qk_bwd = (2 * NORM_KERNELS_FWD, 2 * NORM_KERNELS_BWD) if model.qk_layernorm else (0, 0)
    act_f, act_b = (activation_extra_kernels(model.fc1_width, model.dense_ffn_hidden_size, backward=b, impl=impl)
                    for b in (False, True))
    e_fwd = elementwise_seconds(elem_fwd + masks, r, kernels=ELEMENTWISE_KERNELS_FWD + rope + qk_fwd + act_f)
    e_bwd = elementwise_seconds(elem_bwd + masks, r, kernels=ELEMENTWISE_KERNELS_BWD + rope + qk_bwd + act_b + (
        HIDDEN_DROPOUT_KERNELS_BWD if model.hidden_dropout > 0 else 0) + (BIAS_GRAD_KERNELS if model.add_bias_linear else 0))
    tp_f, tp_b = _tp_seconds(model, plan, system, g)
    cast_fwd, cast_bwd = fp8.cast_seconds(model, plan, r)  # (0, 0) in BF16
    fwd = g["fwd"] + a["fwd"] + e_fwd + cast_fwd
    bwd = g["dgrad"] + g["wgrad"] + a["bwd"] + e_bwd + cast_bwd
    base, recompute = plan_recompute(plan)  # ckpt full / selective are Megatron's recompute on ckpt no
    shapes = layer_gemm_shapes(model, plan)
    mlp_fwd = sum(linear_pass_seconds("fwd", *shapes[k], r, fp8=plan.fp8 is not None) for k in ("fc1", "fc2"))
    ours = elementwise_seconds(elem_ours, r, kernels=OURS_RECOMPUTE_KERNELS + act_f) if base == "ours" else 0.0
    x = moe.layer_seconds(model, plan, system, r, (shapes["fc1"], shapes["fc2"])) if model.is_moe else None
    if x is not None:
        fwd, bwd, ours = fwd + x.fwd, bwd + x.bwd, ours + (x.act if base == "ours" else 0.0)
    rec, tp_rec, cp_rec = recompute_seconds(
        recompute, chunk_layers(model, plan), forward=fwd, attention_forward=a["fwd"], mlp_forward=mlp_fwd,
        base=ours, tp_forward=tp_f, cp_forward=a["cp_fwd"],
        moe_forward=None if x is None else {"moe": x.fwd + x.exchange, "moe_act": x.act})
    layers = chunk_layers(model, plan)  # a full unit's layers rerun their exchanges too
    ep_rec = x.exchange * chunk_units(recompute, layers)[1] / layers if x is not None and layers > 0 else 0.0
    return LayerTime(fwd=fwd, bwd=bwd, recompute=rec, tp_fwd=tp_f, tp_bwd=tp_b, tp_recompute=tp_rec,
                     cp_fwd=a["cp_fwd"], cp_bwd=a["cp_bwd"], cp_recompute=cp_rec,
                     ep_fwd=0.0 if x is None else x.exchange_fwd, ep_bwd=0.0 if x is None else x.exchange_bwd,
                     ep_recompute=ep_rec), x


def _head_time(model: ModelSpec, plan: Plan, system: SystemSpec) -> HeadTime:
    return _head_seconds(*output_layer_gemm_shape(model, plan), kernel_rates(system), cross_entropy_impl(plan))


@functools.lru_cache(maxsize=4096)
def _head_seconds(tokens: int, v_shard: int, h: int, r: KernelRates, fusion: Optional[str] = None) -> HeadTime:
    """:func:`_head_time` of the output layer's GEMM shape (pure; memoised like :func:`_layer_gemms`)."""
    fwd = linear_pass_seconds("fwd", tokens, v_shard, h, r) + cross_entropy_seconds(tokens, v_shard, r, backward=False,
                                                                                    fusion=fusion)
    bwd = (linear_pass_seconds("dgrad", tokens, v_shard, h, r) + linear_pass_seconds("wgrad", tokens, v_shard, h, r)
           + cross_entropy_seconds(tokens, v_shard, r, backward=True, fusion=fusion))
    return HeadTime(fwd, bwd)


def _pipeline_link(plan: Plan, system: SystemSpec) -> Link:
    return p2p_link(plan.tensor_model_parallel_size * plan.data_parallel_size, plan.pipeline_model_parallel_size,
                    system)


def pipeline_hop_seconds(model: ModelSpec, plan: Plan, system: SystemSpec) -> float:
    """One pipeline transfer: Megatron sends 1/t of the activation between stages (sequence parallel, or the
    scatter-gather optimization without it, which all-gathers it over NVLink on arrival)."""
    return _hop_seconds(model, plan, plan.micro_batch_size, _pipeline_link(plan, system))


def _hop_seconds(model: ModelSpec, plan: Plan, micro_batch_size: int, link: Link) -> float:
    tokens = micro_batch_size * plan.seq_length // plan.context_parallel_size
    hop_bytes = tokens // plan.tensor_model_parallel_size * model.hidden_size * BF16
    return p2p_seconds(hop_bytes, link)


def tied_embedding_seconds(model: ModelSpec, plan: Plan, system: SystemSpec) -> float:
    """Tied embeddings with p > 1: the first stage's word embedding and the last stage's output layer are one
    weight, so after the backward Megatron all-reduces its fp32 gradient shard (V/t x h) between the two ranks
    (finalize_model_grads, _allreduce_word_embedding_grads): a 2-rank all-reduce, bytes / link, exposed."""
    t = plan.tensor_model_parallel_size
    if plan.pipeline_model_parallel_size == 1 or model.untie_embeddings_and_output_weights:
        return 0.0
    return all_reduce_seconds(model.padded_vocab_size(t) // t * model.hidden_size * FP32, 2, _pipeline_link(plan, system))


def pipeline_p2p_seconds(model: ModelSpec, plan: Plan, system: SystemSpec) -> float:
    """The ``pp_p2p`` term: activations between pipeline ranks on the critical path of one iteration, and
    the gradient all-reduce of a tied embedding between the first and the last stage."""
    return pipeline_p2p_seconds_by_micro_batch(model, plan, system, (plan.micro_batch_size,))[0]


def pipeline_p2p_seconds_by_micro_batch(model: ModelSpec, plan: Plan, system: SystemSpec,
                                        micro_batch_sizes: tuple[int, ...]) -> list[float]:
    """:func:`pipeline_p2p_seconds` of ``plan`` at each of ``micro_batch_sizes`` (the same numbers as for the plan
    with that micro batch size; the search bounds every micro batch of a layout with them)."""
    p = plan.pipeline_model_parallel_size
    if p == 1:
        return [0.0] * len(micro_batch_sizes)
    v, link, tied = plan.virtual_size(model.num_layers), _pipeline_link(plan, system), None
    out = []
    for mb in micro_batch_sizes:
        m = plan.global_batch_size // (mb * plan.data_parallel_sample_shards)  # Plan.num_microbatches at mb
        hop = _hop_seconds(model, plan, mb, link)
        # the first microbatch's forward (and the last one's backward) crosses every virtual stage boundary
        # on the critical path: at each of the v - 1 wraps of the warm-up, rank 0 has done its p chunks
        # while the microbatch took p hops more to come back (and the same in the cool-down)
        activations = 2 * (p * v - 1) * hop
        if v == 1:  # 1F1B: send_forward_recv_backward and send_backward_recv_forward block every steady step
            activations += 2 * m * hop
        elif not plan.overlap_p2p_comm:  # each interleaved step waits for its batched exchange (both directions)
            activations += m * v * hop
        tied = tied_embedding_seconds(model, plan, system) if tied is None else tied
        out.append(activations + tied)
    return out


def dp_seconds_lower_bound(model: ModelSpec, plan: Plan, system: SystemSpec) -> float:
    """The ``dp_exposed`` term with unbounded overlap windows: exact without --overlap-grad-reduce and
    --overlap-param-gather, never more than the term otherwise (at least one bucket stays exposed)."""
    return dp_exposed(model, plan, system, math.inf, math.inf, math.inf)


def stage_microbatch_seconds(model: ModelSpec, plan: Plan, system: SystemSpec, stage: int) -> float:
    """One microbatch's forward + backward (all its chunks) on pipeline rank ``stage``."""
    st = shape_times(model, plan, system)
    p, L = plan.pipeline_model_parallel_size, model.num_layers
    return (plan.stage_layers(L, stage) * st.layer.total + (st.head.total if stage == p - 1 else 0.0)
            + st.extra(plan.stage_bf16_layers(L, stage)))


def slowest_stage(model: ModelSpec, plan: Plan, system: SystemSpec) -> int:
    """The pipeline rank with the longest microbatch (middle stages are alike: first, one middle, last)."""
    return max(plan.representative_stages(model.num_layers),
               key=lambda k: stage_microbatch_seconds(model, plan, system, k))


def dp_exposed_seconds(model: ModelSpec, plan: Plan, system: SystemSpec) -> float:
    """The ``dp_exposed`` term: windows of the slowest stage's chunk backward / forward and microbatch."""
    st = shape_times(model, plan, system)
    lt = st.layer
    slow = slowest_stage(model, plan, system)
    layers, v = plan.stage_layers(model.num_layers, slow), plan.virtual_size(model.num_layers)
    b = plan.stage_bf16_layers(model.num_layers, slow)  # an FP8 plan's BF16 layers: in the mean chunk's windows
    return dp_exposed(model, plan, system, (layers * (lt.bwd + lt.recompute) + st.extra(b, "bwd", "recompute")) / v,
                      (layers * lt.fwd + st.extra(b, "fwd")) / v, stage_microbatch_seconds(model, plan, system, slow))


def optimizer_seconds(model: ModelSpec, plan: Plan, system: SystemSpec) -> float:
    """The ``optimizer`` term (:func:`h3t_ext.costmodel.data_parallel.optimizer_step_seconds`)."""
    return optimizer_step_seconds(model, plan, system)


def merged_pairs(p: int, m: int, v: int, rank: int, group: Optional[int] = None) -> int:
    """Forward-backward pairs rank ``rank`` merges with --overlap-moe-expert-parallel-comm, as megatron-core's combined
    1F1B schedules them: at pipeline size 1 each backward with the next forward (m - 1); with a pipeline its
    steady-state steps, the m v computes of each kind less its warm-up forwards, (p - rank - 1) 2 + (v - 1) g with g
    the microbatch group of a virtual stage (default p), and on the last rank one less (its first steady-state forward
    is the first microbatch's last chunk, whose own backward follows it: one microbatch, nothing to merge). The
    timeline pairs the builder's lists by the same rule (tests/unit/test_moe_a2a_overlap.py)."""
    if p == 1:
        return max(0, m - 1)
    warmup = min(m * v, (p - rank - 1) * 2 + (v - 1) * (group or p))
    return max(0, m * v - warmup - (rank == p - 1))


def offload_exposed_seconds(model: ModelSpec, plan: Plan, system: SystemSpec, *, alphas: tuple[float, ...],
                            chunk_bytes: tuple[int, ...], reloads: tuple[ReloadCounts, ...]) -> float:
    """The closed form's ``offload_exposed`` term (:func:`time_terms`, arguments alike) alone: what the planner's
    bounds count of a fixed alpha (``planner/bounds.py``)."""
    slow = slowest_stage(model, plan, system)
    return _offload_exposed(model, plan, system, slow, alphas, chunk_bytes, reloads, _bubble(model, plan, system, slow))


def _bubble(model: ModelSpec, plan: Plan, system: SystemSpec, slow: int) -> float:
    """The ``bubble`` term (:func:`time_terms`): the warm-up and cool-down are the forward and backward of the first
    and last microbatch on every rank but the slowest one (which runs all m in between): (p - 1)/v microbatches when
    the ranks are alike, less when the last rank is the slow one only because it also runs the output layer."""
    p, L = plan.pipeline_model_parallel_size, model.num_layers
    if p == 1:
        return 0.0
    st = shape_times(model, plan, system)
    everyone = L * st.layer.total + st.head.total + st.extra(fp8.bf16_layers_in(
        plan.num_layers_at_start_in_bf16, plan.num_layers_at_end_in_bf16, L, 0, L))
    return (everyone - stage_microbatch_seconds(model, plan, system, slow)) / plan.virtual_size(L)


def _offload_exposed(model: ModelSpec, plan: Plan, system: SystemSpec, slow: int, alphas: tuple[float, ...],
                     chunk_bytes: tuple[int, ...], reloads: tuple[ReloadCounts, ...], bubble: float) -> float:
    """``offload_exposed``: at p = 1 the layer-granular copies of every microbatch (``chunk_bytes``: the one stage's),
    else the stage that ends last with its copies: per stage k (``chunk_bytes[k]``: one of its microbatch-chunks'
    saved bytes, ``reloads[k]``: its :class:`~h3t_ext.costmodel.activations.ReloadCounts`), what each reload outlasts
    of the compute it overlaps, and what the first offloaded backward's reload waits for the offload queue besides.

    As on the timeline, an offload delays no compute (it runs on its own copy stream and only its chunk's reload
    waits for it); once the first reload has waited for the queue the offloads keep up (the steady state issues one a
    forward and backward, no faster than the reloads run; the cool-down issues none). A reload overlaps its compute
    action whole: the kernels and the tensor-, context- and expert-parallel communication the action exposes
    (``LayerTime.forward_action``), of the stage's mean chunk. The queue's wait and the cool-down's reloads fall in
    the phases where the rank also waits for its peers (``bubble``, the pipeline's fill and drain): a rank waits for
    whichever ends later, so only what they outlast the bubble by is exposed (the hops' waits are not counted as
    cover: with them the closed form fell 4-19% under the timeline's copies where those were exposed); a
    steady-state reload's is exposed whole. A stage lighter than the slowest waits for it anyway: its stalls fill the
    compute it has less first."""
    if not any(a > 0 for a in alphas):
        return 0.0
    st = shape_times(model, plan, system)
    p, m, L = plan.pipeline_model_parallel_size, plan.num_microbatches, model.num_layers
    if p == 1:  # layer-granular (h3t_ext.costmodel.layer_offload)
        layers, b = plan.stage_layers(L, 0), plan.stage_bf16_layers(L, 0)
        return m * p1_exposed_seconds(st.mean_layer(layers, b), st.head.total, chunk_bytes[0], layers, alphas[0],
                                      system)
    lt, v = st.layer, plan.virtual_size(L)
    top = stage_microbatch_seconds(model, plan, system, slow)
    off = 0.0
    for k, (a, chunk, c) in enumerate(zip(alphas, chunk_bytes, reloads)):
        if a <= 0 or not chunk:
            continue
        layers, b = plan.stage_layers(L, k), plan.stage_bf16_layers(L, k)
        f_chunk = (layers * lt.forward_action + st.extra(b, "forward_action")) / v
        b_chunk = (layers * lt.backward_action + st.extra(b, "backward_action")) / v
        copy = host_copy_seconds(a * chunk, system)
        queue = (c.queue_start_forwards * f_chunk + c.queue_start_backwards * b_chunk + c.queued_offloads * copy
                 - c.reload_after_forwards * f_chunk - c.reload_after_backwards * b_chunk)
        fill_and_drain = c.before_backward * max(0.0, copy - b_chunk) + max(0.0, queue)
        spare = m * (top - stage_microbatch_seconds(model, plan, system, k))
        off = max(off, c.before_forward * max(0.0, copy - f_chunk) + max(0.0, fill_and_drain - bubble) - spare)
    return off


def time_terms(model: ModelSpec, plan: Plan, system: SystemSpec, *, alphas: tuple[float, ...],
               chunk_bytes: tuple[int, ...], reloads: tuple[ReloadCounts, ...]) -> TimeTerms:
    """The closed form: seconds per iteration by term (they add up to the iteration time). The cost model's
    time is the timeline (:mod:`h3t_ext.costmodel.timeline`); this form prices the same terms without walking
    the schedule, and the planner prunes with it."""
    p = plan.pipeline_model_parallel_size
    m, L = plan.num_microbatches, model.num_layers
    v = plan.virtual_size(L)
    st = shape_times(model, plan, system)

    slow = slowest_stage(model, plan, system)
    layers = plan.stage_layers(L, slow)
    b = plan.stage_bf16_layers(L, slow)  # an FP8 plan's BF16 first / last layers on the slow rank (st.extra)
    bubble = _bubble(model, plan, system, slow)

    pp = pipeline_p2p_seconds(model, plan, system)

    off = _offload_exposed(model, plan, system, slow, alphas, chunk_bytes, reloads, bubble)
    busy = st.busy_terms(m, layers, b, slow == p - 1)
    if st.merge_hidden:  # --overlap-moe-expert-parallel-comm: the slow rank's merged forward-backward pairs
        busy["ep_comm"] -= merged_pairs(p, m, v, slow, plan.microbatch_group_size_per_vp_stage) * st.merge_hidden \
            * layers / v
    return TimeTerms(
        **busy,
        pp_p2p=pp,
        bubble=bubble,
        dp_exposed=dp_exposed_seconds(model, plan, system),
        optimizer=optimizer_seconds(model, plan, system),
        offload_exposed=off,
    )
