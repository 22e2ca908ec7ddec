"""The data of a schedule: action kinds, one action, and the shape of one iteration's schedule.

:mod:`h3t_ext.schedule.builder` makes per-rank lists of :class:`Action`; :mod:`h3t_ext.schedule.posting`
orders their transfers; both read these types from here.
"""
from __future__ import annotations

import enum
import functools
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

    def __str__(self) -> str:  # compact form used in tests and --explain output
        s = f"{self.kind.value}{self.microbatch}"
        if self.chunk:
            s += f".{self.chunk}"
        return s


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

    def __post_init__(self) -> None:
        _ = self.layout  # the sizes and megatron-core's interleaving rules: h3t_ext.layout raises LayoutError
        if self.offload_stages is not None and len(self.offload_stages) != self.pipeline_model_parallel_size:
            raise ValueError(f"offload_stages has {len(self.offload_stages)} entries for "
                             f"{self.pipeline_model_parallel_size} pipeline ranks")

    def rank_offloads(self, rank: int) -> bool:
        """Whether ``rank``'s list carries OFFLOAD/RELOAD actions (where a microbatch-chunk can hide them)."""
        if not self.offload or self.forward_only:
            return False
        return True if self.offload_stages is None else bool(self.offload_stages[rank])

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


__all__ = ["COMM_KINDS", "COMPUTE_KINDS", "Action", "ActionKind", "ScheduleConfig"]
