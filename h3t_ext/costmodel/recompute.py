"""Megatron's activation recompute in the cost model: the saved bytes and the recompute time of a model chunk
under ``--recompute-granularity full|selective`` with its method, number of layers and modules
(:class:`h3t_ext.ckpt.Recompute`, ``Plan.recompute``), on top of the per-layer base ckpt (``no`` or ``ours``).

What each setting keeps (per layer and local token, terms of :mod:`h3t_ext.costmodel.activations`), as the
runtime's spec builds it (:mod:`h3t_ext.runtime.modules.recompute`, megatron-core 0.16.1's semantics):

* full: a unit of ``u`` consecutive layers keeps its input (``layer_input``, h) and nothing else; a chunk of
  ``L`` layers has ``L / N`` units with ``uniform`` (N must divide L) and ``min(N, L)`` one-layer units with
  ``block`` (its other layers keep what their base keeps). Block with N >= L is uniform with 1 (ckpt=full);
  N = 0 layers recomputed is no recompute.
* selective ``core_attn``: the attention core keeps its inputs q, k, v, which flash attention keeps anyway: only
  ``softmax_lse`` is dropped (and the s^2 scores of the unfused core attention, see
  :func:`recomputes_core_attention`). With the 'local' spec the kept v is megatron-core's view into the fused QKV
  GEMM output, whose whole storage it keeps alive, where the CPU's flash kernel kept a copy of v: h + h_kv more
  elements (:func:`core_attention_pinned_qkv`; measured: +92 fp32 per token for h = 64, h_kv = 32, 4 heads).
* selective ``layernorm``: the two norm outputs and their fp32 statistics (``norm1_output``, ``norm2_output``,
  ``norm1_rstd``, ``norm2_rstd``); the norms keep their inputs, which the residual keeps anyway.
* selective ``mlp``: ``fc1_output``, ``swiglu_output``, ``fc2_input`` and an unfused SwiGLU's two factors; the MLP's input (``norm2_output``) stays
  unless ``layernorm`` drops it too.

Recompute time (per layer and microbatch, averaged over a chunk's layers, :func:`recompute_seconds`): a full unit
reruns its layers' forward once (and their tensor- and context-parallel forward traffic); selective reruns the
attention core's forward (``core_attn``) and the FC1/FC2 forward GEMMs (``mlp``); the norms' recompute
(``layernorm``) is an element-wise pass over bytes the backward reads anyway and is not priced. During a unit's
backward its ``u`` layers' activations live at once (:func:`unit_workspace_layers`).
"""
from __future__ import annotations

import functools
from typing import Optional

from h3t_ext.ckpt import Ckpt, Recompute, split_ckpt

_MLP_TERMS = ("fc1_output", "swiglu_output", "fc2_input", "glu_activation", "glu_linear_shifted")
"""A dense MLP's saved terms inside the MLP (:mod:`h3t_ext.costmodel.activations`; its input is the norm's)."""
SELECTIVE_DROPS: dict[str, tuple[str, ...]] = {
    "core_attn": ("softmax_lse",),
    "layernorm": ("norm1_output", "norm2_output", "norm1_rstd", "norm2_rstd"),
    "mlp": _MLP_TERMS,
    "shared_experts": _MLP_TERMS,
    "moe": (),
    "moe_act": (),
}
"""The per-layer terms each selective module drops (module docstring); in a MoE model the dense MLP terms are its
shared expert's (``shared_experts``), and ``moe`` / ``moe_act`` drop expert terms
(:func:`h3t_ext.costmodel.moe.kept_expert_bytes`)."""


def plan_recompute(plan) -> tuple[Ckpt, Recompute]:
    """(base ``NO``/``OURS``, Megatron's recompute) of ``plan`` (``ckpt`` full/selective are their recompute)."""
    return split_ckpt(plan.ckpt, plan.recompute)


def selective_terms(terms: dict[str, int], recompute: Recompute) -> dict[str, int]:
    """``terms`` (one layer's saved bytes by term, with ``total``) with the selective modules' terms dropped."""
    drop = {k for m in recompute.modules for k in SELECTIVE_DROPS[m]} if recompute.selective else set()
    out = {k: (0 if k in drop else v) for k, v in terms.items() if k != "total"}
    out["total"] = sum(out.values())
    return out


def core_attention_pinned_qkv(model, recompute: Recompute, *, layer_spec: str, dtype_bytes: int) -> int:
    """Bytes per local token that selective ``core_attn`` keeps beyond what the core itself kept: the rest of the
    fused QKV output pinned by the kept view of v (the 'local' spec; module docstring), 0 otherwise."""
    if layer_spec != "local" or not recompute.recomputes("core_attn"):
        return 0
    return (model.query_hidden_size + model.kv_hidden_size) * dtype_bytes


@functools.lru_cache(maxsize=1024)
def chunk_units(recompute: Recompute, layers: int) -> tuple[int, int]:
    """(units, layers inside units) of full recompute in a model chunk of ``layers`` layers (pure; memoised: the
    search asks it for thousands of plans)."""
    units, inside, _ = recompute.unit_shape(layers)
    return units, inside


def chunk_layers_bytes(layers: int, recompute: Recompute, *, kept: int, unit_input: int) -> int:
    """Saved bytes of a chunk's ``layers`` layers: ``unit_input`` per full-recompute unit, ``kept`` per other
    layer (both in the same unit: per local token, or per microbatch)."""
    units, inside = chunk_units(recompute, layers)
    return units * unit_input + (layers - inside) * kept


def kept_layers(recompute: Recompute, layers: int) -> int:
    """Layers of a chunk that keep their own activations (outside full-recompute units)."""
    return layers - chunk_units(recompute, layers)[1]


def recomputes_core_attention(recompute: Recompute) -> bool:
    """True when selective recompute reruns the attention core (its s^2 scores are then never kept)."""
    return recompute.recomputes("core_attn")


def unit_workspace_layers(recompute: Recompute, layers: int) -> int:
    """Layers whose activations a unit's backward re-creates at once (0 without full recompute)."""
    return recompute.unit_shape(layers)[2]


def recompute_seconds(recompute: Recompute, layers: int, *, forward: float, base: float, attention_forward: float,
                      mlp_forward: float, tp_forward: float, cp_forward: float,
                      moe_forward: Optional[dict[str, float]] = None) -> tuple[float, float, float]:
    """(compute, tensor-parallel, context-parallel) recompute seconds per layer and microbatch, averaged over a
    chunk of ``layers`` layers: a layer inside a full unit reruns its ``forward`` (and its traffic); the others
    rerun their ``base`` recompute (ckpt=ours's element-wise part) plus the selective modules (a MoE model's
    ``shared_experts``, ``moe`` and ``moe_act``: the forward seconds ``moe_forward`` gives them)."""
    if layers <= 0:
        return 0.0, 0.0, 0.0
    share = chunk_units(recompute, layers)[1] / layers
    selective = (attention_forward if recompute.recomputes("core_attn") else 0.0) + (
        mlp_forward if recompute.recomputes("mlp") or recompute.recomputes("shared_experts") else 0.0) + sum(
        x for module, x in (moe_forward or {}).items() if recompute.recomputes(module))
    return (share * forward + (1 - share) * (base + selective), share * tp_forward, share * cp_forward)


def chunk_layers(model, plan, stage: Optional[int] = None) -> int:
    """Layers of one model chunk on pipeline rank ``stage`` (None: a middle stage)."""
    v = plan.virtual_size(model.num_layers)
    rank_layers = plan.layers_per_rank(model.num_layers) if stage is None else plan.stage_layers(model.num_layers,
                                                                                                 stage)
    return rank_layers // v


__all__ = ["SELECTIVE_DROPS", "chunk_layers", "core_attention_pinned_qkv", "chunk_layers_bytes", "chunk_units", "kept_layers", "plan_recompute",
           "recompute_seconds", "recomputes_core_attention", "selective_terms", "unit_workspace_layers"]
