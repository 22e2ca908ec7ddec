"""Saved activation bytes: per layer and token, and per pipeline stage over the schedule's timeline.

Bytes are per token of a rank's local sequence shard (s / (c * t) tokens with sequence parallel).
Terms of one transformer layer (elements per token; ``dtype_bytes`` each unless noted fp32):

* ``layer_input``       h      input of the first norm (also the residual)
* ``norm1_rstd``        1 fp32 reciprocal RMS saved by the first norm
* ``norm1_output``      h      input of the QKV GEMM
* ``qk_norm_input``     with --qk-layernorm, what the q and k norms save of the QKV projection's output: megatron-core
                               reshapes q into a copy (q) and hands k over as a view of that output; the local
                               spec's norm keeps the view, and with it all of the output (q + 2 h_kv): 2 q + 2 h_kv
                               (measured, tests/integration/test_activations.py); TransformerEngine's norm saves a
                               contiguous copy of its input (``transformer_engine/pytorch/ops/basic/rmsnorm.py``,
                               ``op_forward``: ``input_.contiguous()`` is what it saves), so on the 'te' spec
                               q + h_kv (read from TE's code, not yet measured on a GPU)
* ``qk_norm_rstd``      (heads + groups) fp32: the q and k norms' per-head rstd
* ``query``             h      rotated query saved by flash attention
* ``key_value``         2 h_kv rotated key and value saved by flash attention
* ``softmax_lse``       heads fp32 (heads/t per token of the full s/c sequence = heads per local token)
* ``attention_output``  h      output of flash attention = input of the projection GEMM
* ``norm2_input``       h      residual after attention (input of the second norm)
* ``norm2_rstd``        1 fp32
* ``norm2_output``      h      input of FC1
* ``fc1_output``        2f     (f with GeLU) input of the activation function
* ``swiglu_output``     f      output of the activation function, which FC2 saves as its input: one tensor
                               (TransformerEngine's ``_Linear.forward`` saves the tensor it is given when no cast is
                               needed, ``saved_inputmat = inputmat``; the local spec's linear layer too)
* ``fc2_input``         f      FC2's own FP8 copy of that input (1 byte each), with FP8 only; the bf16
                               ``swiglu_output`` is then freed once FC2 has quantized it
* ``glu_activation``    f      an unfused SwiGLU's ``silu(gate)``, kept by the product for its backward
                               (:func:`mlp_activation_impl` 'unfused' and 'legacy'; the 'te' spec only)
* ``glu_linear_shifted`` f     megatron-core's unfused SwiGLU's ``linear + glu_linear_offset``, the product's other
                               factor ('unfused' only: the legacy model multiplies the linear half, a view of
                               ``fc1_output``, directly)
* ``hidden_dropout_mask`` 2 h bytes: the bool masks of the two bias-dropout-adds, with hidden dropout
                               (flash attention's dropout keeps only its RNG state)

With FP8 (--fp8-format, ``fp8=True``; 'te' spec only) TransformerEngine saves the inputs of its four GEMMs
quantized, 1 byte per element (``transformer_engine/pytorch/module/linear.py`` and ``layernorm_linear.py``,
``_Linear.forward``: after the forward GEMM the quantized input is kept with ``update_usage(rowwise_usage=False,
columnwise_usage=True)`` -- its FP8 transpose for the weight-gradient GEMM -- or, when the backward must
all-gather it again under sequence parallelism, its FP8 row-wise local shard): ``norm1_output`` (QKV input, the
fused norm's FP8 output), ``norm2_output`` (FC1 input) and ``fc2_input`` become 1 byte. The projection's input is
flash attention's output, which attention itself keeps in bf16 for its backward: ``attention_output`` stays and
the projection's own FP8 copy is ``projection_input_fp8`` (h bytes, 1 byte each).

ckpt='ours' drops ``norm1_output``, ``norm2_output`` and ``swiglu_output``/``fc2_input`` (recomputed in
backward from the kept norm inputs, rstd and FC1 output). ckpt='full' keeps only ``layer_input``. Megatron's
``--recompute-*`` flags (``Plan.recompute``: full uniform/block with N layers, selective modules) are priced
per chunk by :mod:`h3t_ext.costmodel.recompute`.
With bf16 and the 'te' spec, ckpt=no is 12h + 4h_kv + 6f (+ 4 heads + 8) bytes (8f with the legacy model's
SwiGLU, 10f with megatron-core's unfused one), ours 8h + 4h_kv + 4f (+ ...).

Which SwiGLU runs (:func:`mlp_activation_impl`): megatron-core's fused bias-SwiGLU (Megatron-LM's default) saves
its input only, and FC2 its output; unfused (--no-bias-swiglu-fusion) megatron-core 0.16+ computes
``silu(gate) * (linear + offset)`` op by op and the product saves both factors; the legacy model (the ATC '24 runs,
Megatron-Kwai: ``F.silu(x[0]) * x[1]``) saves ``silu(gate)`` and a view. The measured ATC '24 ckpt=no peaks
(Figure 7, held out) are the legacy count; the local spec (h3t-ext's runtime) saves what the fused kernel saves.

The last stage also holds the output layer's saved tensors of the microbatch whose last chunk is
in its forward or backward (``output_layer_bytes``: the final norm's input, rstd and output, the
fp32 softmax the vocabulary-parallel cross entropy keeps for backward, its int64 masked targets and
bool mask). On the last stage that chunk's backward follows its forward at once, so this is one
microbatch's worth at the peak, never offloaded. With the 'local' spec megatron-core's unfused
RoPE also keeps cos and sin ([s/c, 1, 1, d] for q and for k) per layer and microbatch
(``rope_bytes_per_layer``); fused RoPE (TransformerEngine) keeps none.

Stage peaks are priced over the schedule builder's action lists (``build_schedule``): every rank's
timeline of compute actions gives the held microbatch-chunks, split into whole ones and offloaded ones
(see ``residency_lines``). Large schedules (a search prices thousands) use the closed form of that walk,
which tests assert equal to the walk for every p <= 10, v <= 4.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from h3t_ext.ckpt import NO_RECOMPUTE, Ckpt, Recompute
from h3t_ext.costmodel import moe
from h3t_ext.costmodel.moe import local_tokens  # one rule: b s / (c t) tokens of a rank's local sequence shard
from h3t_ext.costmodel.layer_offload import layer_offload, layers_per_chunk
from h3t_ext.costmodel.fp8 import bf16_layers_in
from h3t_ext.costmodel.recompute import chunk_layers_bytes, chunk_units, core_attention_pinned_qkv, plan_recompute, \
    recomputes_core_attention, selective_terms
from h3t_ext.costmodel.elementwise import CROSS_ENTROPY_SAVED_BYTES
from h3t_ext.costmodel.specs import ModelSpec
from h3t_ext.costmodel.te_version import cross_entropy_impl
from h3t_ext.dtypes import BF16, BOOL, FP8, FP32, INT64
from h3t_ext.schedule import COMPUTE_KINDS, ActionKind, ScheduleConfig, build_schedule, offloaded_chunk_count, \
    reload_counts

REPLICATED_WITHOUT_SP = ("layer_input", "norm1_rstd", "norm1_output", "norm2_input", "norm2_rstd", "norm2_output",
                          "hidden_dropout_mask")
GLU_UNFUSED_TERMS = ("glu_activation", "glu_linear_shifted")
"""The saved tensors an unfused SwiGLU adds (module docstring)."""
_OURS_DROPS = ("norm1_output", "norm2_output", "swiglu_output", "fc2_input") + GLU_UNFUSED_TERMS
MLP_ACTIVATION_IMPLS = ("fused", "unfused", "legacy")
"""How a SwiGLU MLP's activation runs on the 'te' spec (:func:`mlp_activation_impl`)."""


def mlp_activation_impl(plan) -> str:
    """'legacy' (``use_legacy_models``), 'fused' (``bias_activation_fusion``, Megatron-LM's default) or 'unfused'."""
    if plan.use_legacy_models:
        return "legacy"
    return "fused" if plan.bias_activation_fusion else "unfused"


def activation_bytes_per_layer_token(model: ModelSpec, ckpt: str, *, dtype_bytes: int = BF16,
                                     layer_spec: str = "te", dropout_mask_bytes: int = BOOL,
                                     fp8: bool = False, activation_impl: str = "fused") -> dict[str, int]:
    """Saved bytes of one layer per local token, by term, plus ``total``. ``dropout_mask_bytes``: bytes per
    element of a hidden-dropout mask: 1 on a GPU (CUDA's fused dropout keeps a bool mask); PyTorch's CPU
    dropout keeps its noise tensor in the activation dtype (pass ``dtype_bytes`` for the CPU stand-in).
    ``fp8``: TransformerEngine's FP8 linear layers save their inputs in FP8 (module docstring).
    ``activation_impl``: :func:`mlp_activation_impl` of the plan (read on the 'te' spec with SwiGLU)."""
    return dict(_layer_terms(model, ckpt, dtype_bytes, layer_spec, dropout_mask_bytes, fp8, activation_impl))


@functools.lru_cache(maxsize=1024)
def _layer_terms(model: ModelSpec, ckpt: str, dtype_bytes: int, layer_spec: str,
                 dropout_mask_bytes: int = BOOL, fp8: bool = False,
                 activation_impl: str = "fused") -> tuple[tuple[str, int], ...]:
    if layer_spec not in ("te", "local"):
        raise ValueError(f"layer_spec must be 'te' or 'local', got {layer_spec!r}")
    if activation_impl not in MLP_ACTIVATION_IMPLS:
        raise ValueError(f"activation_impl must be one of {', '.join(MLP_ACTIVATION_IMPLS)}, got {activation_impl!r}")
    if ckpt == "selective":  # flash attention saves no s^2 scores: recomputing the core saves nothing more
        ckpt = "no"
    if ckpt not in ("no", "full", "ours"):
        raise ValueError(f"ckpt must be 'no', 'full' or 'ours', got {ckpt!r}")
    h, hkv, f, b = model.hidden_size, model.kv_hidden_size, model.dense_ffn_hidden_size, dtype_bytes
    q = model.query_hidden_size  # h unless --kv-channels makes heads x d differ from it
    terms = {
        "layer_input": h * b,
        "norm1_rstd": FP32,
        "norm1_output": h * b,
        "query": q * b,
        "key_value": 2 * hkv * b,
        "softmax_lse": model.num_attention_heads * FP32,
        "attention_output": q * b,
        "norm2_input": h * b,
        "norm2_rstd": FP32,
        "norm2_output": h * b,
        "fc1_output": model.fc1_width * b,
        "swiglu_output": f * b,  # FC2's input too: one tensor
        "fc2_input": 0,
        "hidden_dropout_mask": 2 * h * dropout_mask_bytes if model.hidden_dropout > 0 else 0,
    }
    if layer_spec == "te" and model.swiglu and activation_impl != "fused":
        terms.update(glu_activation=f * b, glu_linear_shifted=f * b if activation_impl == "unfused" else 0)
    if model.qk_layernorm:  # kept by ckpt=ours: a GEMM output and the norms' statistics
        terms.update(qk_norm_input=(q + hkv if layer_spec == "te" else 2 * q + 2 * hkv) * b,
                     qk_norm_rstd=(model.num_attention_heads + model.num_query_groups) * FP32)
    if fp8:  # FC2 keeps its FP8 copy; the activation's bf16 output is freed once FC2 has quantized it
        if layer_spec != "te":
            raise ValueError("FP8 runs in TransformerEngine: layer_spec must be 'te'")
        terms.update(norm1_output=h * FP8, norm2_output=h * FP8, swiglu_output=0, fc2_input=f * FP8,
                     projection_input_fp8=q * FP8)
    if ckpt == "ours":
        terms = {k: (0 if k in _OURS_DROPS else v) for k, v in terms.items()}
    elif ckpt == "full":
        terms = {k: (v if k == "layer_input" else 0) for k, v in terms.items()}
    terms["total"] = sum(terms.values())
    return tuple(terms.items())


@functools.lru_cache(maxsize=1024)
def layer_bytes_per_local_token(model: ModelSpec, ckpt: str, *, tensor_model_parallel_size: int = 1,
                                sequence_parallel: bool = True, dtype_bytes: int = BF16,
                                layer_spec: str = "te", dropout_mask_bytes: int = BOOL, fp8: bool = False,
                                recompute: Recompute = NO_RECOMPUTE, activation_impl: str = "fused") -> int:
    """Total saved bytes of one layer per local token; without sequence parallel the norm-side terms are
    replicated over the tensor-parallel group (t times more tokens). ``recompute``: Megatron's selective
    modules drop their terms (:mod:`h3t_ext.costmodel.recompute`; full recompute is per unit, not per layer)."""
    terms = selective_terms(dict(_layer_terms(model, ckpt, dtype_bytes, layer_spec, dropout_mask_bytes, fp8,
                                              activation_impl)), recompute)
    total = terms["total"]
    if not sequence_parallel and tensor_model_parallel_size > 1:
        total += (tensor_model_parallel_size - 1) * sum(terms[k] for k in REPLICATED_WITHOUT_SP)
    return total


_RankLines = tuple[tuple[tuple[int, int], ...], int, int, tuple[int, int, int, int, int]]
"""Per rank: Pareto-maximal (full, offloaded) held-chunk counts, offloaded microbatch-chunks, how many of those
have their RELOAD issued before a forward (the rest before a backward), and the first offloaded backward's wait for
the offload queue (:class:`ReloadCounts`)."""


@functools.lru_cache(maxsize=4096)
def _walk_schedule(p: int, m: int, v: int, g: Optional[int] = None) -> tuple[_RankLines, ...]:
    """Per rank, from the builder's action lists: Pareto-maximal (full, offloaded) held-chunk counts over
    the compute actions, the number of offloaded microbatch-chunks and of those whose RELOAD comes right before a
    forward in the list. ``g``: the interleaved schedule's microbatch group size (None: p)."""
    sched = build_schedule(p, m, v, microbatch_group_size_per_vp_stage=g if v > 1 else None)
    out = []
    for rank in range(p):
        off = sched.offloaded(rank)
        compute = sched.compute_actions(rank)
        forward_led, queue = _walk_reloads(sched.ranks[rank], off)
        held: set[tuple[int, int]] = set()
        counted: set[tuple[int, int]] = set()
        pairs: set[tuple[int, int]] = set()
        for k, a in enumerate(compute):
            key = (a.microbatch, a.chunk)
            if k >= 2:  # the offload of the forward two actions back has finished: 1 - alpha stays
                old = compute[k - 2]
                okey = (old.microbatch, old.chunk)
                if old.kind is ActionKind.FORWARD and okey in off and okey in held:
                    counted.add(okey)
            if a.kind is ActionKind.FORWARD:
                held.add(key)
            pairs.add((len(held) - len(counted), len(counted)))
            if a.kind is ActionKind.BACKWARD:
                held.discard(key)
                counted.discard(key)
        pareto = sorted(q for q in pairs
                        if not any(o != q and o[0] >= q[0] and o[0] + o[1] >= q[0] + q[1] for o in pairs))
        out.append((tuple(pareto), len(off), forward_led, queue))
    return tuple(out)


def _walk_reloads(acts, off) -> tuple[int, tuple[int, int, int, int, int]]:
    """From one rank's action list: the RELOADs issued right before a forward, and :class:`ReloadCounts`'s
    ``queue`` (zeros without offloads)."""
    kinds: list[ActionKind] = []  # of the compute actions so far
    offload_at: dict[tuple[int, int], int] = {}  # offloaded chunk -> compute index of its forward
    reload_at: dict[tuple[int, int], int] = {}  # reloaded chunk -> compute index of the compute after its RELOAD
    first_backward = None
    for a in acts:
        key = (a.microbatch, a.chunk)
        if a.kind is ActionKind.OFFLOAD:
            offload_at[key] = len(kinds) - 1
        elif a.kind is ActionKind.RELOAD:
            reload_at[key] = len(kinds)
        elif a.kind in COMPUTE_KINDS:
            if a.kind is ActionKind.BACKWARD and key in off and first_backward is None:
                first_backward = key
            kinds.append(a.kind)
    forward_led = sum(kinds[k] is ActionKind.FORWARD for k in reload_at.values())
    if first_backward is None:
        return forward_led, (0, 0, 0, 0, 0)
    first = min(offload_at.values())
    issued = reload_at[first_backward]

    def forwards(n: int) -> int:
        return sum(k is ActionKind.FORWARD for k in kinds[:n])
    return forward_led, (forwards(first + 1), first + 1 - forwards(first + 1),
                         sum(i <= offload_at[first_backward] for i in offload_at.values()), forwards(issued),
                         issued - forwards(issued))


@functools.lru_cache(maxsize=4096)
def _closed_form(p: int, m: int, v: int, g: Optional[int] = None) -> tuple[_RankLines, ...]:
    """What :func:`_walk_schedule` returns, in closed form (equality with the builder is asserted for
    every p <= 12, v <= 5 and valid m <= 4p in tests/unit/test_costmodel_activations.py, and for every valid group
    size g at p <= 6, v <= 4, m <= 3p + 2 in tests/unit/test_microbatch_group.py).

    The peak is the first steady-state forward (or the last forward when the warm-up covers every
    chunk): it holds N = min(warm-up + 1, m v) chunks, the warm-up being 2 (p - r - 1) + (v - 1) g forwards
    with interleaving (megatron-core's count), of which the two newest are still whole. Every
    chunk is offloaded except where its backward follows too closely: with m <= 2 all of a rank's first
    m; otherwise, with v > 1, the last rank's last chunk of every microbatch, and with v = 1 the last
    rank entirely and the first and last microbatch of the rank before it. With a group g other than p the
    offloaded chunks are counted from the builder's compute order (:func:`h3t_ext.schedule.offloaded_chunk_count`,
    O(m v)): the last rank's last chunk of a microbatch no longer always meets its backward at once.

    A reload is issued before the compute that precedes its chunk's backward: a forward for the backwards of the
    steady state (S = m v - warm-up of them, each after a forward), a backward in the cool-down. Of the S steady
    backwards, the last rank's (v > 1) own last chunk of each microbatch (m of them) and, at v = 1, every one of the
    last rank's and the first of the rank before it follow their forward too closely to be offloaded. Without a steady
    state (the warm-up covers every chunk) only the first backward follows a forward, that of the last forward, and
    its chunk is offloaded when two computes lie between its forward (microbatch 0's last chunk, forward (v - 1) p)
    and it (compute m v).
    """
    grouped = ScheduleConfig(pipeline_model_parallel_size=p, num_microbatches=m, virtual_pipeline_model_parallel_size=v,
                             microbatch_group_size_per_vp_stage=g) if g is not None and v > 1 and m > 2 else None
    out = []
    for r in range(p):
        warm = 2 * (p - r - 1) + (v - 1) * (p if g is None else g) if v > 1 else p - r - 1
        n = min(warm + 1, m * v)
        full = min(2, n)
        if grouped is not None:  # g > p: which chunks meet their backward at once follows the builder's order
            offloaded = offloaded_chunk_count(grouped, r)
        elif m <= 2:
            offloaded = m * v - m
        elif v > 1:
            offloaded = m * v - (m if r == p - 1 else 0)
        else:
            offloaded = m * v - (m if warm == 0 else (2 if warm == 1 else 0))
        steady = m * v - min(warm, m * v)
        if grouped is not None or (m <= 2 and offloaded):  # the builder's compute order (O(m v))
            forward_led, queue = reload_counts(grouped or ScheduleConfig(
                pipeline_model_parallel_size=p, num_microbatches=m, virtual_pipeline_model_parallel_size=v), r)
        else:
            forward_led, queue = (_default_group_reload_counts(p, m, v, r, warm, steady) if offloaded
                                  else (0, (0, 0, 0, 0, 0)))
        out.append((((full, n - full),), offloaded, forward_led, queue))
    return tuple(out)


def _default_group_reload_counts(p: int, m: int, v: int, r: int, warm: int,
                                 steady: int) -> tuple[int, tuple[int, int, int, int, int]]:
    """:func:`h3t_ext.schedule.reload_counts` in closed form for megatron-core's default group (m > 2, rank ``r``
    offloads): see :func:`_closed_form`."""
    if steady == 0:
        forward_led = int((v - 1) * p <= m * v - 3)
    elif v == 1:
        forward_led = steady - (1 if warm == 1 else 0)
    else:
        forward_led = steady - (m if r == p - 1 else 0)
    n = m * v
    if v == 1:  # the first backward's chunk is offloaded (warm-up >= 2), else the second (the rank before the last)
        if warm == 1:
            return forward_led, (2, 0, 1, 2, 1)
        return forward_led, (1, 0, 1, warm if steady else n - 1, 0)
    if r < p - 1:  # the first backward's, microbatch 0's last chunk, forward (v - 1) p
        return forward_led, (1, 0, (v - 1) * p + 1, warm if steady else n - 1, 0)
    # the last rank: its first p backwards are its own last chunks (not offloaded); the next, microbatch 0's chunk
    # v - 2 (forward (v - 2) p), is in the steady state when more than p backwards are, else the cool-down's first
    if steady > p:
        return forward_led, (1, 0, (v - 2) * p + 1, warm + p, p)
    return forward_led, (1, 0, (v - 2) * p + 1, n, p - 1)


def _rank_timelines(p: int, m: int, v: int, g: Optional[int] = None) -> tuple[_RankLines, ...]:
    """The closed form of the builder's lists. It was checked equal to :func:`_walk_schedule` for all 1,828
    valid (p, m, v) with p m v <= 256 (every runtime-sized schedule); tests keep asserting it for p <= 12,
    v <= 5, m <= 4p, and with every valid group size g for small p, v, m. Walking the lists cost a third of a
    planner search's time. ``g`` = p is the default, and is cached as None."""
    return _closed_form(p, m, v, None if g in (None, p) or v == 1 else g)


def residency_lines(p: int, m: int, v: int, rank: int, g: Optional[int] = None) -> tuple[tuple[int, int], ...]:
    """(full, offloaded) held-chunk counts that can be the peak of ``rank``'s timeline.

    Over the compute actions of the builder's list, a held microbatch-chunk is *full* on the device
    (not offloadable, its forward is running, or its offload still overlaps the next compute action)
    or *offloaded* (1 - alpha of it stays on the device). Activation bytes during a compute action are
    A * (full + (1 - alpha) * offloaded); only the Pareto-maximal pairs are kept. ``g``: the interleaved
    schedule's microbatch group size (--microbatch-group-size-per-virtual-pipeline-stage; None: p).
    """
    return _rank_timelines(p, m, v, g)[rank][0]


def rank_offloads(p: int, m: int, v: int, rank: int, g: Optional[int] = None) -> int:
    """Microbatch-chunks ``rank`` offloads per iteration (0 means no reload buffer)."""
    return _rank_timelines(p, m, v, g)[rank][1]


@dataclass(frozen=True)
class ReloadCounts:
    """How one rank's activation copies meet its computes (:func:`rank_reload_counts`), in counts of computes: what
    the closed form prices the copies' exposed time by (``timing.offload_exposed_seconds``).

    A reload is issued right before the compute that precedes its chunk's backward and overlaps that one compute:
    ``before_forward`` of the rank's offloaded chunks have it a forward, ``before_backward`` a backward. Offloads run
    one after another on their own copy stream from the first offloaded forward on, so the first offloaded backward's
    reload also waits for the offloads queued up to its own chunk's: ``queued_offloads`` of them, started after the
    ``queue_start_forwards`` forwards and ``queue_start_backwards`` backwards up to the first offloaded forward, against
    the ``reload_after_forwards`` forwards and ``reload_after_backwards`` backwards that run before its reload is
    issued."""
    before_forward: int
    before_backward: int
    queue_start_forwards: int = 0
    queue_start_backwards: int = 0
    queued_offloads: int = 0
    reload_after_forwards: int = 0
    reload_after_backwards: int = 0


def rank_reload_counts(p: int, m: int, v: int, rank: int, g: Optional[int] = None) -> ReloadCounts:
    """:class:`ReloadCounts` of pipeline rank ``rank`` (the closed form of the builder's lists,
    :func:`_closed_form`)."""
    _, offloaded, forward_led, queue = _rank_timelines(p, m, v, g)[rank]
    return ReloadCounts(forward_led, offloaded - forward_led, *queue)


def chunk_resident_factor(lines: tuple[tuple[int, int], ...], alpha: float, offloads: bool) -> float:
    """Peak activation bytes of a rank in units of one microbatch-chunk's bytes A, including the
    reload double buffer (2 * alpha * A when the rank offloads anything)."""
    peak = max(full + (1.0 - alpha) * n_off for full, n_off in lines)
    return peak + (2.0 * alpha if offloads and alpha > 0 else 0.0)


def output_layer_bytes(model: ModelSpec, plan, *, dtype_bytes: int = BF16,
                       sequence_parallel: bool = True) -> dict[str, int]:
    """Saved bytes of the output layer of one microbatch on the last stage, by term, plus ``total``.

    The final norm works on the local sequence shard (s/(c t) tokens; s/c without sequence
    parallel) and the output GEMM saves that shard of its input. The vocabulary-parallel cross
    entropy (megatron-core ``tensor_parallel/cross_entropy.py``) casts the logits of the gathered
    sequence (s/c tokens, V_pad/t columns) to fp32, turns them into the softmax in place and saves
    it with the int64 masked targets and the bool target mask. The bf16 logits themselves are not
    saved (see ``logits_transient`` in memory.py); TransformerEngine's fused one before 2.18 saves
    them instead, holding their gradient (``cross_entropy_softmax`` at
    :data:`~h3t_ext.costmodel.elementwise.CROSS_ENTROPY_SAVED_BYTES`)."""
    t, c = plan.tensor_model_parallel_size, plan.context_parallel_size
    seq_tokens = plan.micro_batch_size * plan.seq_length // c
    norm_tokens = seq_tokens // t if sequence_parallel else seq_tokens
    h, b = model.hidden_size, dtype_bytes
    saved = CROSS_ENTROPY_SAVED_BYTES[cross_entropy_impl(plan)]
    terms = {
        "final_norm_input": norm_tokens * h * b,
        "final_norm_rstd": norm_tokens * FP32,
        "final_norm_output": norm_tokens * h * b,
        "cross_entropy_softmax": seq_tokens * (model.padded_vocab_size(t) // t) * saved,
        "cross_entropy_targets": seq_tokens * INT64,
        "cross_entropy_target_mask": seq_tokens * BOOL,
    }
    terms["total"] = sum(terms.values())
    return terms


def unfused_scores_bytes_per_layer(model: ModelSpec, plan, *, dtype_bytes: int = BF16,
                                   dropout_mask_bytes: int = BOOL) -> int:
    """The s^2 tensors Megatron's unfused core attention (--attention-backend unfused/local) saves per layer and
    microbatch for its backward: the fused scale-mask-softmax's output (the probabilities, activation dtype),
    and with --attention-dropout > 0 the dropout mask and the dropped probabilities that feed the P.V batched
    GEMM (Korthikanti et al. 2022, Sec. 4.1: 5as^2b bytes per layer at bf16 with dropout). Over the rank's
    a/t heads. Flash attention and TE's fused attention keep none; selective ``core_attn`` recomputes the core
    attention and a full unit the whole layer (:func:`microbatch_chunk_bytes` counts this for the layers outside
    units only), so both keep none either."""
    if plan.attention_backend != "unfused" or recomputes_core_attention(plan_recompute(plan)[1]) \
            or plan.ckpt == "full":
        return 0
    per_score = dtype_bytes + ((dropout_mask_bytes + dtype_bytes) if model.attention_dropout > 0 else 0)
    heads = model.num_attention_heads // plan.tensor_model_parallel_size
    s = plan.seq_length // plan.context_parallel_size
    return plan.micro_batch_size * heads * s * s * per_score


def rope_bytes_per_layer(model: ModelSpec, plan, *, dtype_bytes: int = BF16, layer_spec: str = "te") -> int:
    """cos and sin ([s/c, 1, 1, head_dim], for q and for k) that megatron-core's unfused RoPE saves per
    layer and microbatch with the 'local' spec; 0 with the 'te' spec (fused RoPE) and without RoPE."""
    if layer_spec != "local" or not model.rotates_qk:
        return 0
    return 4 * (plan.seq_length // plan.context_parallel_size) * model.head_dim * dtype_bytes


def layer_kept_bytes(model: ModelSpec, plan, *, tensor_model_parallel_size: int, sequence_parallel: bool = True,
                     dtype_bytes: int = BF16, layer_spec: str = "te", dropout_mask_bytes: int = BOOL,
                     fp8: bool = False) -> int:
    """Saved bytes of one layer and microbatch outside full-recompute units (``plan``'s ckpt and selective
    modules): the per-token terms over :func:`local_tokens` (a MoE layer's router and experts:
    :func:`h3t_ext.costmodel.moe.kept_expert_bytes`), the local spec's RoPE cos/sin and unfused attention's scores."""
    if model.mixed_moe:  # the pattern's average layer
        opts = dict(tensor_model_parallel_size=tensor_model_parallel_size, sequence_parallel=sequence_parallel,
                    dtype_bytes=dtype_bytes, layer_spec=layer_spec, dropout_mask_bytes=dropout_mask_bytes, fp8=fp8)
        phi = model.moe_layer_fraction
        return int(round((1 - phi) * layer_kept_bytes(model.dense_variant(), plan, **opts)
                         + phi * layer_kept_bytes(model.moe_variant(), plan, **opts)))
    base, recompute = plan_recompute(plan)
    per_tok = layer_bytes_per_local_token(
        model, base, recompute=recompute, tensor_model_parallel_size=tensor_model_parallel_size,
        sequence_parallel=sequence_parallel, dtype_bytes=dtype_bytes, layer_spec=layer_spec,
        dropout_mask_bytes=dropout_mask_bytes, fp8=fp8, activation_impl=mlp_activation_impl(plan))
    per_tok += core_attention_pinned_qkv(model, recompute, layer_spec=layer_spec, dtype_bytes=dtype_bytes)
    per_tok += moe.kept_expert_bytes(model, plan, base, recompute.modules if recompute.selective else (),
                                     dtype_bytes=dtype_bytes)
    return (local_tokens(plan) * per_tok
            + rope_bytes_per_layer(model, plan, dtype_bytes=dtype_bytes, layer_spec=layer_spec)
            + unfused_scores_bytes_per_layer(model, plan, dtype_bytes=dtype_bytes, dropout_mask_bytes=dropout_mask_bytes))


def microbatch_chunk_bytes(model: ModelSpec, plan, stage: Optional[int] = None, *, dtype_bytes: int = BF16,
                           layer_spec: str = "te", sequence_parallel: bool = True,
                           dropout_mask_bytes: int = BOOL, fp8: bool = False) -> int:
    """A: saved bytes of one microbatch-chunk (l layers, or the stage's layers without interleaving) on pipeline
    rank ``stage`` (None: a middle stage). The stage matters with uneven first/last stages and --account-for-*
    (whose first/last stage's chunks differ by the embedding's / loss's layer slot under interleaving: A is then
    their mean), and the first stage's chunks also carry the embedding's dropout mask
    (:func:`embedding_dropout_chunk_bytes`)."""
    t = plan.tensor_model_parallel_size
    v = plan.virtual_size(model.num_layers)
    split = plan.pipeline_split(model.num_layers)
    chunks = {plan.layers_per_rank(model.num_layers) // v: 1} if stage is None else split.chunk_layer_counts(stage)
    _, recompute = plan_recompute(plan)
    opts = dict(tensor_model_parallel_size=t, sequence_parallel=sequence_parallel, dtype_bytes=dtype_bytes,
                layer_spec=layer_spec, dropout_mask_bytes=dropout_mask_bytes, fp8=fp8)
    kept = layer_kept_bytes(model, plan, **opts)
    unit_input = local_tokens(plan) * layer_bytes_per_local_token(model, Ckpt.FULL, **opts)
    chunk = (sum(k * chunk_layers_bytes(n, recompute, kept=kept, unit_input=unit_input) for n, k in chunks.items())
             // sum(chunks.values()))
    if fp8 and stage is not None and plan.has_bf16_layers:
        chunk += _bf16_layers_extra(model, plan, stage, layer_kept_bytes(model, plan, **{**opts, "fp8": False}) - kept)
    if stage == 0:
        chunk += embedding_dropout_chunk_bytes(model, plan, sequence_parallel=sequence_parallel,
                                               dropout_mask_bytes=dropout_mask_bytes)
    return chunk


def _bf16_layers_extra(model: ModelSpec, plan, stage: int, more: int) -> int:
    """What an FP8 plan's BF16 first / last layers on ``stage`` save beyond as many FP8 layers, per microbatch-chunk
    (the mean over the stage's chunks, as :func:`microbatch_chunk_bytes`): ``more`` bytes for each such layer that
    keeps its own activations. A full-recompute unit keeps only its input, the same in both precisions; the units are
    a chunk's first layers (megatron-core's uniform and block methods)."""
    split, L = plan.pipeline_split(model.num_layers), model.num_layers
    _, recompute = plan_recompute(plan)
    v = split.virtual_pipeline_model_parallel_size
    total = 0
    for c, b in enumerate(plan.chunk_bf16_layers(L, stage)):
        if b:
            n = split.chunk_layers(stage, c)
            inside = chunk_units(recompute, n)[1]
            total += bf16_layers_in(plan.num_layers_at_start_in_bf16, plan.num_layers_at_end_in_bf16, L,
                                    split.layer_offset(stage, c) + inside, n - inside)
    return total * more // v


def stage_activation_peak_bytes(model: ModelSpec, plan, *, dtype_bytes: int = BF16, layer_spec: str = "te",
                                sequence_parallel: bool = True, alphas: Optional[tuple[float, ...]] = None,
                                dropout_mask_bytes: int = BOOL) -> tuple[int, ...]:
    """Peak saved-activation bytes (with the reload double buffer) of every pipeline stage of ``plan``.

    ``alphas`` overrides ``plan.alphas()``. On the first stage of interleaved 1F1B with m > p this is
    A * (N - (N - 4) * alpha), N = 2(p-1) + (v-1)p + 1, A the bytes of one of its microbatch-chunks
    (:func:`microbatch_chunk_bytes`, in FP8 where ``plan.fp8`` is set, as the memory model prices it); the last
    stage adds one microbatch's :func:`output_layer_bytes`. At pipeline size 1 the offload is layer-granular
    (:mod:`h3t_ext.costmodel.layer_offload`)."""
    p, m = plan.pipeline_model_parallel_size, plan.num_microbatches
    v = plan.virtual_size(model.num_layers)
    opts = dict(dtype_bytes=dtype_bytes, layer_spec=layer_spec, sequence_parallel=sequence_parallel,
                dropout_mask_bytes=dropout_mask_bytes, fp8=plan.fp8 is not None)
    head = output_layer_bytes(model, plan, dtype_bytes=dtype_bytes, sequence_parallel=sequence_parallel)["total"]
    alphas = plan.alphas() if alphas is None else alphas
    layers = layers_per_chunk(model, plan)

    def factor(r: int) -> float:
        if layers is not None:
            lo = layer_offload(alphas[r], layers)
            return lo.resident + lo.reload_buffer
        g = plan.microbatch_group_size_per_vp_stage
        return chunk_resident_factor(residency_lines(p, m, v, r, g), alphas[r], rank_offloads(p, m, v, r, g) > 0)

    return tuple(int(round(microbatch_chunk_bytes(model, plan, r, **opts) * factor(r))) + (head if r == p - 1 else 0)
                 for r in range(p))


def embedding_dropout_chunk_bytes(model: ModelSpec, plan, *, sequence_parallel: bool = True,
                                  dropout_mask_bytes: int = BOOL) -> int:
    """The mask of the embedding's dropout (--hidden-dropout, on the sequence-parallel shard) that the first
    stage keeps per microbatch with its first model chunk, spread over the v chunks of the first stage: the
    bytes each of its microbatch-chunks carries beyond the layers' (exact without a virtual pipeline, a small
    approximation with one: one mask against a chunk's 30-odd h bytes per token and layer)."""
    if model.hidden_dropout <= 0:
        return 0
    t, c = plan.tensor_model_parallel_size, plan.context_parallel_size
    tokens = plan.micro_batch_size * plan.seq_length // c // (t if sequence_parallel else 1)
    return tokens * model.hidden_size * dropout_mask_bytes // plan.virtual_size(model.num_layers)
