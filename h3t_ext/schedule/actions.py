"""The data of a schedule: action kinds, one action, and the shape of one iteration's schedule.

:mod:`h3t_ext.schedule.builder` makes per-rank lists of :class:`Action`; :mod:`h3t_ext.schedule.posting`
orders their transfers; both read these types from here.
"""
from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass
from typing import Optional

from h3t_ext.layout import ParallelLayout


class ActionKind(str, enum.Enum):
    """What one step of a rank's action list does."""

    FORWARD = "F"
    BACKWARD = "B"
    RECV_FORWARD = "RF"
    SEND_FORWARD = "SF"
    RECV_BACKWARD = "RB"
    SEND_BACKWARD = "SB"
    OFFLOAD = "OFF"
    RELOAD = "RL"


STEP_KINDS: tuple[ActionKind, ...] = (
    ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.RECV_FORWARD, ActionKind.SEND_FORWARD,
    ActionKind.RECV_BACKWARD, ActionKind.SEND_BACKWARD, ActionKind.OFFLOAD, ActionKind.RELOAD)
"""The kind of each step code. A *step* is one action as a plain tuple ``(code, microbatch, chunk, peer, layer)``
(``STEP_KINDS[code]`` its kind): what the builder and the posting order compute on and the cost model's
timeline reads (:func:`step_action` makes the :class:`Action`)."""
S_F, S_B, S_RF, S_SF, S_RB, S_SB, S_OFF, S_RL = range(len(STEP_KINDS))
STEP_CODES = {k: i for i, k in enumerate(STEP_KINDS)}

COMPUTE_KINDS = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD})
COMM_KINDS = frozenset(
    {ActionKind.RECV_FORWARD, ActionKind.SEND_FORWARD, ActionKind.RECV_BACKWARD, ActionKind.SEND_BACKWARD}
)


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule."""

    kind: ActionKind
    """What the step does."""
    microbatch: int
    """Microbatch index in ``[0, num_microbatches)``."""
    chunk: int = 0
    """Local model chunk index in ``[0, v)`` (always 0 without interleaving)."""
    peer: Optional[int] = None
    """Pipeline rank on the other end, for send/recv actions; None otherwise."""
    layer: Optional[int] = None
    """Layer-granular OFFLOAD/RELOAD (pipeline size 1): the layer of the microbatch-chunk it moves, counted
    from 0 in the chunk. Such an action runs *inside* the compute action just before it in the list:
    ``OFFLOAD(layer=l)`` when layer l+1's forward starts, ``RELOAD(layer=l)`` when layer l+1's backward
    starts. None: the whole microbatch-chunk (chunk-granular, with pipelines)."""

    def __str__(self) -> str:  # compact form used in tests and --explain output
        s = f"{self.kind.value}{self.microbatch}"
        if self.chunk:
            s += f".{self.chunk}"
        if self.layer is not None:
            s += f"@{self.layer}"
        return s


def step_action(step: tuple) -> Action:
    """The :class:`Action` of a step ``(code, microbatch, chunk, peer, layer)``."""
    return Action(STEP_KINDS[step[0]], step[1], step[2], step[3], step[4])


def action_step(a: Action) -> tuple:
    """The step of an :class:`Action` (inverse of :func:`step_action`)."""
    return (STEP_CODES[a.kind], a.microbatch, a.chunk, a.peer, a.layer)


def layer_offload_fractions(alpha: float, num_layers: int) -> tuple[float, ...]:
    """The one rule of layer-granular offload: the fraction of each layer's saved bytes that goes to the host.

    alpha means what it means chunk-granularly, the first alpha of a microbatch-chunk's saved bytes in save
    order, with the layers taken as equal: layers ``0 .. floor(alpha L) - 1`` whole, the next one in part
    (``alpha L - floor(alpha L)`` of its bytes, in save order). The last layer never offloads (no later
    layer's forward hides its copy, and its backward comes first), so alpha above (L - 1) / L offloads
    (L - 1) / L."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    x = round(float(alpha) * num_layers, 9)  # 0.5 * 4 is 2 layers, not 2.0000000001
    return tuple(0.0 if l == num_layers - 1 else min(1.0, max(0.0, x - l)) for l in range(num_layers))


def offloaded_layers(alpha: float, num_layers: int) -> int:
    """Layers (from the first) with an OFFLOAD/RELOAD pair: those of :func:`layer_offload_fractions` > 0."""
    return min(num_layers - 1, max(0, math.ceil(round(float(alpha) * num_layers, 9))))


@dataclass(frozen=True)
class ScheduleConfig:
    """Shape of one iteration's pipeline schedule."""

    pipeline_model_parallel_size: int
    """Number of pipeline ranks p."""
    num_microbatches: int
    """Microbatches per iteration m."""
    virtual_pipeline_model_parallel_size: int = 1
    """Model chunks per rank v (1 means plain 1F1B)."""
    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Megatron's grouping of microbatches per virtual stage; None means p."""
    forward_only: bool = False
    """Forward passes only (evaluation): no backward, no offload."""
    offload: bool = True
    """Emit OFFLOAD/RELOAD actions for the microbatch-chunks that can hide them."""
    offload_stages: Optional[tuple[bool, ...]] = None
    """Per pipeline rank, whether it offloads at all (its alpha > 0); None: every rank (with ``offload``).
    A rank that does not offload gets no OFFLOAD/RELOAD actions, so its list is the list that runs."""
    offload_alphas: Optional[tuple[float, ...]] = None
    """Per pipeline rank, its offload fraction alpha (a rank with alpha 0 does not offload). Layer-granular
    offload (pipeline size 1) needs it with ``num_layers_per_chunk``: which layers offload follows from it
    (:func:`layer_offload_fractions`). None: only ``offload_stages`` says which ranks offload."""
    num_layers_per_chunk: Optional[int] = None
    """Transformer layers of one model chunk. At pipeline size 1 (no microbatch has a compute action between
    its forward and its backward to hide a whole-chunk offload behind) the offload is layer-granular when this
    and ``offload_alphas`` are given; None: no layer-granular offload."""

    def __post_init__(self) -> None:
        _ = self.layout  # the sizes and megatron-core's interleaving rules: h3t_ext.layout raises LayoutError
        p = self.pipeline_model_parallel_size
        for name in ("offload_stages", "offload_alphas"):
            value = getattr(self, name)
            if value is not None and len(value) != p:
                raise ValueError(f"{name} has {len(value)} entries for {p} pipeline ranks")
        if self.num_layers_per_chunk is not None and self.num_layers_per_chunk < 1:
            raise ValueError(f"num_layers_per_chunk must be >= 1, got {self.num_layers_per_chunk}")

    def rank_offloads(self, rank: int) -> bool:
        """Whether ``rank``'s list carries OFFLOAD/RELOAD actions (where a microbatch-chunk can hide them)."""
        if not self.offload or self.forward_only:
            return False
        if self.offload_alphas is not None and not self.offload_alphas[rank] > 0:
            return False
        return True if self.offload_stages is None else bool(self.offload_stages[rank])

    @property
    def layer_granular(self) -> bool:
        """Offload per layer rather than per microbatch-chunk: pipeline size 1, with the layers and alphas known."""
        return (self.pipeline_model_parallel_size == 1 and self.num_layers_per_chunk is not None
                and self.offload_alphas is not None)

    def rank_offloaded_layers(self, rank: int) -> int:
        """Layers of each microbatch-chunk ``rank`` offloads layer-granularly (0 when it does not)."""
        if not self.layer_granular or not self.rank_offloads(rank):
            return 0
        return offloaded_layers(self.offload_alphas[rank], self.num_layers_per_chunk)

    @functools.cached_property
    def layout(self) -> ParallelLayout:
        """The pipeline part of the parallel layout (t = c = d = 1); constructing it checks the rules."""
        return ParallelLayout(pipeline_model_parallel_size=self.pipeline_model_parallel_size,
                              virtual_pipeline_model_parallel_size=self.virtual_pipeline_model_parallel_size,
                              num_microbatches=self.num_microbatches,
                              microbatch_group_size_per_vp_stage=self.microbatch_group_size_per_vp_stage)

    @property
    def interleaved(self) -> bool:
        return self.layout.interleaved

    @property
    def group_size(self) -> int:
        """The interleaving group size in effect (megatron-core's default p)."""
        return self.layout.microbatch_group_size


__all__ = ["COMM_KINDS", "COMPUTE_KINDS", "STEP_KINDS", "Action", "ActionKind", "ScheduleConfig", "action_step",
           "layer_offload_fractions", "offloaded_layers", "step_action"]
