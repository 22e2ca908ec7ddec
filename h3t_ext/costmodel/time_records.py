"""The time model's records: one layer's and the output layer's seconds per microbatch by part (``LayerTime``,
``HeadTime``, ``ShapeTimes``, which also holds an FP8 plan's BF16 layer) and an iteration's seconds by term
(``TimeTerms``). :mod:`h3t_ext.costmodel.timing` prices them; the timeline and the closed form sum them."""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Optional


@functools.lru_cache(maxsize=None)
def record_fields(cls) -> tuple[str, ...]:
    """The fields of a record type, in order (``dataclasses.fields`` is slow; the search sums thousands)."""
    return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class LayerTime:
    """Seconds of one transformer layer for one microbatch on one rank, by part. The forward action of a
    model chunk runs ``fwd + tp_fwd + cp_fwd`` per layer, its backward action the rest (``forward_action`` /
    ``backward_action``); the fields add up to ``total``."""

    fwd: float
    """Forward kernels: GEMMs, attention (with the context-parallel merges), element-wise."""
    bwd: float
    """Backward kernels: data- and weight-gradient GEMMs, attention backward, element-wise backward."""
    recompute: float
    """Recomputation run in the backward: ckpt=ours the norms and activation, selective the attention core,
    full the whole forward (its communication is in ``tp_recompute`` / ``cp_recompute``)."""
    tp_fwd: float = 0.0
    """Exposed tensor-parallel communication of the forward."""
    tp_bwd: float = 0.0
    """... of the backward (what outlasts the GEMMs it overlaps)."""
    tp_recompute: float = 0.0
    """... of the recomputed forward (ckpt=full)."""
    cp_fwd: float = 0.0
    """Exposed context-parallel K/V ring exchange of the forward."""
    cp_bwd: float = 0.0
    """... of the backward."""
    cp_recompute: float = 0.0
    """... of the recomputed forward (ckpt=full)."""
    ep_fwd: float = 0.0
    """A MoE layer's token exchange (dispatch and combine over the expert-parallel ranks) in the forward."""
    ep_bwd: float = 0.0
    """... of the gradients in the backward."""
    ep_recompute: float = 0.0
    """... of the recomputed forward (ckpt=full)."""

    @property
    def tp(self) -> float:
        return self.tp_fwd + self.tp_bwd + self.tp_recompute

    @property
    def ep(self) -> float:
        return self.ep_fwd + self.ep_bwd + self.ep_recompute

    @property
    def cp(self) -> float:
        return self.cp_fwd + self.cp_bwd + self.cp_recompute

    @property
    def forward_action(self) -> float:
        """What one layer adds to a FORWARD action of the schedule."""
        return self.fwd + self.tp_fwd + self.cp_fwd + self.ep_fwd

    @property
    def backward_action(self) -> float:
        """What one layer adds to a BACKWARD action (recompute included)."""
        return (self.bwd + self.recompute + self.tp_bwd + self.tp_recompute + self.cp_bwd + self.cp_recompute
                + self.ep_bwd + self.ep_recompute)

    @property
    def total(self) -> float:
        return sum(getattr(self, name) for name in record_fields(LayerTime))


@dataclass(frozen=True)
class HeadTime:
    """The output layer and vocabulary-parallel cross entropy of one microbatch on the last stage."""

    fwd: float
    """Output GEMM and the cross entropy's forward kernels."""
    bwd: float
    """Data- and weight-gradient GEMMs and the cross entropy's backward kernels."""

    @property
    def total(self) -> float:
        return self.fwd + self.bwd


@dataclass(frozen=True)
class ShapeTimes:
    """Everything the time model prices per microbatch for one shape: a layer and the output layer (and, in an FP8
    plan with --first-last-layers-bf16, a BF16 layer: ``bf16_layer``)."""

    layer: LayerTime
    head: HeadTime
    bf16_layer: Optional[LayerTime] = None
    """An FP8 plan's BF16 first / last layer (None without them: every layer is ``layer``)."""
    merge_hidden: float = 0.0
    """Seconds of token exchange one merged pair of layers hides (a forward's and another microbatch's backward's,
    --overlap-moe-expert-parallel-comm: :func:`h3t_ext.costmodel.moe.merged_layer_seconds`); 0 without it."""

    def extra(self, bf16: int, *parts: str) -> float:
        """What ``bf16`` BF16 layers add over as many FP8 layers, summed over the :class:`LayerTime` ``parts`` (its
        fields or sums such as ``tp`` and ``forward_action``; ``total`` where none are named); exactly 0.0 without BF16
        layers, so a plan without them prices as before."""
        lb = self.bf16_layer
        if not bf16 or lb is None:
            return 0.0
        lt = self.layer
        return bf16 * sum(getattr(lb, n) - getattr(lt, n) for n in parts or ("total",))

    def mean_layer(self, layers: int, bf16: int) -> LayerTime:
        """The average of ``layers`` layers, ``bf16`` of them BF16 layers (``layer`` itself without them)."""
        lb = self.bf16_layer
        if not bf16 or lb is None or layers <= 0:
            return self.layer
        share = bf16 / layers
        return LayerTime(*((1 - share) * getattr(self.layer, f) + share * getattr(lb, f)
                           for f in record_fields(LayerTime)))

    def busy_terms(self, microbatches: int, layers: int, bf16: int, head: bool) -> dict[str, float]:
        """A rank's busy seconds by :class:`TimeTerms` field over ``microbatches`` microbatches of its ``layers``
        layers (``bf16`` of them BF16 layers) and, where ``head``, the output layer: ``compute``, ``recompute``,
        ``tp_comm``, ``cp_comm`` and ``ep_comm``, as the closed form and the timeline both split a rank's work."""
        lt, m = self.layer, microbatches
        return {"compute": m * (layers * (lt.fwd + lt.bwd) + (self.head.total if head else 0.0)
                                + self.extra(bf16, "fwd", "bwd")),
                "recompute": m * (layers * lt.recompute + self.extra(bf16, "recompute")),
                "tp_comm": m * (layers * lt.tp + self.extra(bf16, "tp")),
                "cp_comm": m * (layers * lt.cp + self.extra(bf16, "cp")),
                "ep_comm": m * (layers * lt.ep + self.extra(bf16, "ep"))}


@dataclass(frozen=True)
class TimeTerms:
    """Seconds of one iteration by term; they add up to ``total``. ``as_dict`` gives the keys of
    ``--explain`` and ``--json`` (``time_terms_s``)."""

    compute: float
    """Forward and backward kernels of every layer (and the output layer) the critical rank runs."""
    recompute: float
    tp_comm: float
    cp_comm: float
    pp_p2p: float
    """Pipeline transfers on the critical path (and the tied-embedding gradient all-reduce)."""
    bubble: float
    """Pipeline warm-up and cool-down: waiting for other ranks' compute."""
    dp_exposed: float
    optimizer: float
    offload_exposed: float
    """Waiting for host<->device copies (the timeline: reloads that end after their backward would start)."""
    ep_comm: float = 0.0
    """MoE token exchanges (dispatch and combine over the expert-parallel ranks, forward, backward and recompute)."""

    @property
    def total(self) -> float:
        return sum(getattr(self, name) for name in record_fields(TimeTerms))

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in record_fields(TimeTerms)}


__all__ = ["HeadTime", "LayerTime", "ShapeTimes", "TimeTerms", "record_fields"]
