"""The search's recompute axis: h3t-ext's per-layer ckpt modes, Megatron's block recompute with the smallest N
that fits, and Megatron's selective ``core_attn`` where it changes memory.

A :class:`RecomputeMode` is one value of the axis. ``block`` modes stand for ``--recompute-granularity full
--recompute-method block --recompute-num-layers N`` on top of a base (``no`` or ``ours``, :func:`h3t_ext.ckpt.split_ckpt`
allows both) with N chosen per (layout, micro batch) by :func:`smallest_block_layers`: the first N layers of every
model chunk keep only their input, the others what their base keeps, so a stage's peak memory falls with N (each
layer moved into a unit trades its kept bytes for its input; the one unit re-created in backward is the same for
every N >= 1) and its time rises with N (each such layer reruns its forward). Hence the smallest N that fits is
the only block plan worth pricing: any larger N is slower, any smaller one does not fit. "Fits" is at the search's
alpha (0 with ``auto`` and ``balanced``): block recompute is the alternative to offloading activations, and the
search prices both (the base with its smallest alpha, block-N without offload) and keeps the faster. N = 0 (the
base already fits without offload) and N = the chunk's layers (every layer a unit: ``full``) are other modes.

Selective ``core_attn`` drops what the attention core keeps beyond q, k, v: with flash attention only its
``softmax_lse`` (nothing the planner should trade time for), with unfused attention the s^2 scores. The search
offers it (on base ``no``: ``ckpt=selective``; on base ``ours``) only with ``attention_backend='unfused'``.

:meth:`RecomputeMode.fails_where` is the search's memory pruning: a candidate cannot fit where a mode that keeps
no more did not fit at the same or a smaller micro batch.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Union

from h3t_ext.ckpt import NO_RECOMPUTE, SELECTIVE_CORE_ATTN, Ckpt, Recompute, split_ckpt
from h3t_ext.costmodel import ModelSpec, Plan, SystemSpec
from h3t_ext.costmodel.memory import stage_peak_function
from h3t_ext.costmodel.recompute import chunk_layers
from h3t_ext.costmodel.reserve import default_memory_budget_bytes

R_BLOCK_UNNEEDED = "recompute block: not needed (the plan fits without recompute or activation offload)"
R_BLOCK_WHOLE = "recompute block: a model chunk of one layer (block recompute of it is ckpt full)"
R_BLOCK_NONE = ("memory: recompute block does not fit without activation offload with any N below the model "
                "chunk's layers")

_BASE_RANK = {Ckpt.FULL: 0, Ckpt.OURS: 1, Ckpt.NO: 2}
"""Per-layer bases from least to most kept (``full`` keeps only the layer input)."""


@dataclass(frozen=True)
class RecomputeMode:
    """One value of the search's recompute axis."""

    ckpt: Ckpt
    """The plan's ``ckpt`` (:func:`h3t_ext.ckpt.normal_form`: ``full``, ``ours``, ``no`` or ``selective``)."""
    recompute: Recompute = NO_RECOMPUTE
    """Megatron's recompute the plan carries on top of ``ckpt`` (``ours`` with selective ``core_attn``)."""
    block: bool = False
    """Megatron's block recompute on top of ``ckpt`` (``no``/``ours``), N chosen per candidate."""

    @classmethod
    def of(cls, mode: Union[str, Ckpt, "RecomputeMode"]) -> "RecomputeMode":
        """``mode`` itself, or the plain mode of a ckpt value."""
        return mode if isinstance(mode, RecomputeMode) else cls(Ckpt.parse(mode))

    @property
    def base(self) -> Ckpt:
        """The per-layer base: ``no``, ``ours`` or ``full`` (full recompute of every layer)."""
        base, recompute = split_ckpt(self.ckpt, self.recompute)
        return Ckpt.FULL if recompute.full else base

    @property
    def selective(self) -> bool:
        """Whether selective ``core_attn`` is on."""
        return split_ckpt(self.ckpt, self.recompute)[1].selective

    def recompute_of(self, num_layers: Optional[int]) -> Recompute:
        """Megatron's record of a plan of this mode (block: with ``num_layers``; None: the base alone)."""
        if self.block and num_layers is not None:
            return Recompute("full", "block", num_layers)
        return self.recompute

    def fails_where(self, other: "RecomputeMode") -> bool:
        """True when a plan of this mode cannot fit where one of ``other`` did not (same layout, same or larger
        micro batch): ``other`` keeps no more. A block mode's failure is "no N fits without offload", a plain
        mode's "no alpha fits", so only ``full`` (which keeps less than any block N, offload or not) prunes
        across the two; selective and plain modes prune only their own kind."""
        if other.block != self.block:
            return other == FULL_MODE
        if self.selective != other.selective:
            return other == FULL_MODE
        return _BASE_RANK[self.base] >= _BASE_RANK[other.base]


FULL_MODE = RecomputeMode(Ckpt.FULL)


MOE_OURS = Recompute.parse("selective", modules=("layernorm", "moe_act"), moe=True)
"""What a MoE model's plans use in place of ckpt ``ours`` (which runs in h3t-ext's runtime, without MoE layers):
Megatron's selective recompute of the norms and the experts' activation, which drops the same tensors."""


def search_modes(ckpt: Optional[str], attention_backend: str, *, moe: bool = False) -> tuple[RecomputeMode, ...]:
    """The recompute axis of a search, least kept memory first (a fixed ``ckpt``: that mode alone): ``full``, block
    on ``ours`` and on ``no``, with unfused attention selective ``core_attn`` on ``ours`` and on ``no``, then
    ``ours`` and ``no``. A MoE model's (``moe``): what Megatron-LM runs, ``full``, block on ``no``, :data:`MOE_OURS`
    and ``no``."""
    if ckpt is not None:
        return (RecomputeMode.of(ckpt),)
    if moe:
        return (FULL_MODE, RecomputeMode(Ckpt.NO, block=True), RecomputeMode(Ckpt.NO, MOE_OURS),
                RecomputeMode(Ckpt.NO))
    selective = (RecomputeMode(Ckpt.OURS, SELECTIVE_CORE_ATTN), RecomputeMode(Ckpt.SELECTIVE)) \
        if attention_backend == "unfused" else ()
    return (FULL_MODE, RecomputeMode(Ckpt.OURS, block=True), RecomputeMode(Ckpt.NO, block=True), *selective,
            RecomputeMode(Ckpt.OURS), RecomputeMode(Ckpt.NO))


@dataclass(frozen=True)
class BlockChoice:
    """The block recompute of one candidate: its N, or why there is none."""

    num_layers: Optional[int]
    """N, the smallest that fits; None with ``reason``."""
    reason: Optional[str] = None
    """R_BLOCK_UNNEEDED, R_BLOCK_WHOLE or R_BLOCK_NONE."""


def _alphas(alpha_mode, p: int) -> tuple[float, ...]:
    """The alpha of every stage a block plan must fit at: 0 with ``auto``/``balanced``, else the fixed ones."""
    if isinstance(alpha_mode, str):
        return (0.0,) * p
    if isinstance(alpha_mode, tuple):
        return tuple(float(a) for a in alpha_mode)
    return (float(alpha_mode),) * p


def _fits(model: ModelSpec, plan: Plan, alphas: Sequence[float], budget: int, system: SystemSpec) -> bool:
    return all(stage_peak_function(model, plan, k, system)(alphas[k]) <= budget
               for k in range(plan.pipeline_model_parallel_size))


def smallest_block_layers(model: ModelSpec, system: SystemSpec, plan: Plan, *, alpha_mode="auto",
                          memory_budget_bytes: Optional[int] = None) -> BlockChoice:
    """The smallest ``--recompute-num-layers`` N in [1, chunk layers - 1] with which ``plan`` (its base ckpt, no
    recompute of its own) plus block recompute fits every stage at the search's alpha (module docstring), by
    bisection on the stages' peak memory (it falls with N for N >= 1); the reason when none is worth pricing."""
    layers = chunk_layers(model, plan)
    if layers < 2:
        return BlockChoice(None, R_BLOCK_WHOLE)
    alphas = _alphas(alpha_mode, plan.pipeline_model_parallel_size)
    budget = default_memory_budget_bytes(model, plan, system) if memory_budget_bytes is None else memory_budget_bytes
    if _fits(model, plan, alphas, budget, system):
        return BlockChoice(None, R_BLOCK_UNNEEDED)

    def fits(n: int) -> bool:
        return _fits(model, replace(plan, recompute=Recompute("full", "block", n)), alphas, budget, system)

    lo, hi = 1, layers - 1  # the answer, if any, is in [lo, hi]
    if not fits(hi):
        return BlockChoice(None, R_BLOCK_NONE)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return BlockChoice(lo)


__all__ = ["BlockChoice", "FULL_MODE", "R_BLOCK_NONE", "R_BLOCK_UNNEEDED", "R_BLOCK_WHOLE", "RecomputeMode",
           "search_modes", "smallest_block_layers"]
