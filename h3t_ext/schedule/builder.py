"""The schedule as data: per-rank action lists for 1F1B and interleaved 1F1B.

One pure function, :func:`build_schedule`, makes for every pipeline rank the ordered list of
actions of one training iteration. The cost model prices that list (peak memory is the maximum
of resident bytes over it, time is a simulated timeline of it) and the runtime executes it, so
memory predictions and runtime behaviour cannot drift apart.

Ordering follows Megatron-core 0.16's ``forward_backward_pipelining_without_interleaving`` and
``forward_backward_pipelining_with_interleaving`` (warm-up, 1F1B steady state, cool-down, and the
microbatch grouping of ``microbatch_group_size_per_vp_stage``). The shapes it accepts are those of
:class:`h3t_ext.layout.ParallelLayout` (a bad one raises its :class:`~h3t_ext.layout.LayoutError`).

Sends and receives are placed by :mod:`h3t_ext.schedule.posting`: every run of them between
two compute actions is one posted batch, in an order that cannot deadlock under NCCL's
point-to-point semantics (the argument is in that module; :mod:`h3t_ext.schedule.p2p_model`
checks it).

Semantics of the offload actions (shared by the cost model and the runtime):

* ``OFFLOAD(mb, chunk)`` comes right after ``FORWARD(mb, chunk)``: the copy of a fraction alpha
  of that microbatch-chunk's saved activations to host memory starts there, on a copy stream.
  It overlaps the next compute action; the device bytes are released when that compute action
  ends.
* ``RELOAD(mb, chunk)`` comes right before the compute action that precedes
  ``BACKWARD(mb, chunk)``: the copy back into the reload double buffer starts there and overlaps
  that compute action; the backward waits for it.
* A microbatch-chunk is offloaded only when at least two compute actions lie between its
  forward and its backward (one to hide the offload behind, one to hide the reload behind);
  otherwise it stays on the device and the list carries no offload/reload for it.
* At pipeline size 1 no microbatch-chunk has a compute action between its forward and its backward, so
  the offload is *layer-granular* (when the config knows the layers per chunk and the alphas): right after
  ``FORWARD(mb, chunk)`` come ``OFFLOAD(mb, chunk, layer=l)`` for the layers that offload (the first ones,
  :func:`~h3t_ext.schedule.actions.offloaded_layers`; never the last), and right after ``BACKWARD(mb, chunk)``
  their ``RELOAD(mb, chunk, layer=l)`` from the last to the first. A layer action runs inside the compute
  action before it: ``OFFLOAD(layer=l)`` is issued when layer l+1's forward starts (the copy overlaps it;
  layer l's device bytes are dropped when it ends), ``RELOAD(layer=l)`` when layer l+1's backward starts
  (the copy overlaps it; layer l's backward waits for it). Every offloaded layer is reloaded after its
  offload and before its own backward.
* Only the ranks that offload (``offload_stages``: the stages whose alpha is > 0) carry OFFLOAD/RELOAD
  actions, so every rank's list is exactly what it runs, and what the cost model's timeline
  (:mod:`h3t_ext.costmodel.timeline`) prices.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Optional, Sequence

from h3t_ext.schedule.actions import (COMM_KINDS, COMPUTE_KINDS, S_B, S_F, S_OFF, S_RL, Action,
                                      ActionKind, ScheduleConfig, step_action)  # noqa: F401 (COMM_KINDS re-exported)
from h3t_ext.schedule.posting import EARLY, placed_steps


@dataclass(frozen=True)
class PipelineSchedule:
    """Per-rank action lists of one iteration."""

    config: ScheduleConfig
    ranks: tuple[tuple[Action, ...], ...] = field(repr=False)
    """``ranks[r]`` is the ordered action list of pipeline rank r."""

    def compute_actions(self, rank: int) -> list[Action]:
        """Forward and backward actions of ``rank``, in order."""
        return [a for a in self.ranks[rank] if a.kind in COMPUTE_KINDS]

    def offloaded(self, rank: int) -> set[tuple[int, int]]:
        """(microbatch, chunk) pairs that ``rank`` offloads (wholly, or some of their layers)."""
        return {(a.microbatch, a.chunk) for a in self.ranks[rank] if a.kind is ActionKind.OFFLOAD}

    def offloaded_layers(self, rank: int) -> dict[tuple[int, int], tuple[int, ...]]:
        """(microbatch, chunk) -> the layers ``rank`` offloads layer-granularly, in OFFLOAD order."""
        out: dict[tuple[int, int], tuple[int, ...]] = {}
        for a in self.ranks[rank]:
            if a.kind is ActionKind.OFFLOAD and a.layer is not None:
                out[(a.microbatch, a.chunk)] = out.get((a.microbatch, a.chunk), ()) + (a.layer,)
        return out

    def in_flight(self, rank: int) -> list[int]:
        """Microbatch-chunks whose activations are held, right after each compute action.

        A forward adds one, a backward frees one; the value during a forward includes it.
        """
        held, out = 0, []
        for a in self.compute_actions(rank):
            held += 1 if a.kind is ActionKind.FORWARD else 0
            out.append(held)
            held -= 1 if a.kind is ActionKind.BACKWARD else 0
        return out

    def peak_in_flight(self, rank: int) -> int:
        """Largest number of microbatch-chunks whose activations ``rank`` holds at once."""
        return max(self.in_flight(rank), default=0)

    def warmup_forwards(self, rank: int) -> int:
        """Forward actions ``rank`` runs before its first backward."""
        n = 0
        for a in self.compute_actions(rank):
            if a.kind is ActionKind.BACKWARD:
                break
            n += 1
        return n


def schedule_table(num_microbatches: int, num_model_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """Order of (microbatch, chunk) forwards of interleaved 1F1B (Megatron's grouping)."""
    table: list[tuple[int, int]] = []
    for start in range(0, num_microbatches, group_size):
        end = min(start + group_size, num_microbatches)
        table.extend((mb, c) for c in range(num_model_chunks) for mb in range(start, end))
    return table


def _num_warmup(cfg: ScheduleConfig, rank: int) -> int:
    p, v = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size
    total = cfg.num_microbatches * v
    if cfg.forward_only:
        return total
    if cfg.interleaved:
        warm = (p - rank - 1) * 2 + (v - 1) * cfg.group_size
    else:
        warm = p - rank - 1
    return min(warm, total)


def _compute_steps(cfg: ScheduleConfig, rank: int, table: Sequence[tuple[int, int]]) -> list[tuple]:
    """Forward/backward steps of one rank in Megatron's order (``table``: :func:`schedule_table` of ``cfg``)."""
    v = cfg.virtual_pipeline_model_parallel_size
    fwd = [(S_F, mb, c, None, None) for mb, c in table]
    if cfg.forward_only:
        return fwd
    bwd = [(S_B, mb, v - 1 - c, None, None) for mb, c in table]
    warm = _num_warmup(cfg, rank)
    order = fwd[:warm]
    for k in range(len(fwd) - warm):
        order.append(fwd[warm + k])
        order.append(bwd[k])
    order.extend(bwd[len(fwd) - warm:])
    return order


def _compute_order(cfg: ScheduleConfig, rank: int) -> list[Action]:
    """Forward/backward actions of one rank in Megatron's order."""
    table = schedule_table(cfg.num_microbatches, cfg.virtual_pipeline_model_parallel_size, cfg.group_size)
    return [step_action(s) for s in _compute_steps(cfg, rank, table)]


def _offload_pairs(v: int, compute: list[tuple]) -> list[tuple[int, int]]:
    """(forward, backward) compute indices of the microbatch-chunks whose offload can hide: at least two compute
    actions between the forward and its backward (one to copy out behind, one to copy back behind)."""
    backward_at = {s[1] * v + s[2]: i for i, s in enumerate(compute) if s[0] == S_B}
    pairs = []
    for i, s in enumerate(compute):
        if s[0] == S_F:
            j = backward_at.get(s[1] * v + s[2])
            if j is not None and j - i - 1 >= 2:
                pairs.append((i, j))
    return pairs


def offloaded_chunk_count(cfg: ScheduleConfig, rank: int) -> int:
    """Microbatch-chunks ``rank`` offloads in ``cfg``'s schedule (:func:`_offload_pairs` over its compute order),
    without building the actions: O(m v) step tuples."""
    table = schedule_table(cfg.num_microbatches, cfg.virtual_pipeline_model_parallel_size, cfg.group_size)
    return len(_offload_pairs(cfg.virtual_pipeline_model_parallel_size, _compute_steps(cfg, rank, table)))


def reload_counts(cfg: ScheduleConfig, rank: int) -> tuple[int, tuple[int, int, int, int, int]]:
    """What the closed form prices ``rank``'s copies by, from its compute order (O(m v); the cost model's closed form
    computes the same without the walk where the group size is megatron-core's default):

    * the offloaded microbatch-chunks whose RELOAD is issued before a forward (the compute before their backward is a
      forward: 1F1B's steady state); the others' reloads are issued before a backward (the cool-down). Each reload
      overlaps that one compute (:func:`_with_offload`);
    * the first offloaded backward's wait for the offload queue: (forwards and backwards up to the first offloaded
      forward, offloaded forwards up to that backward's own forward, forwards and backwards before the compute its
      reload overlaps); zeros where nothing is offloaded."""
    v = cfg.virtual_pipeline_model_parallel_size
    table = schedule_table(cfg.num_microbatches, v, cfg.group_size)
    compute = _compute_steps(cfg, rank, table)
    pairs = _offload_pairs(v, compute)
    forward_led = sum(compute[j - 1][0] == S_F for _, j in pairs)
    if not pairs:
        return forward_led, (0, 0, 0, 0, 0)
    first = min(i for i, _ in pairs)
    j, i = min((j, i) for i, j in pairs)
    upto, before = sum(s[0] == S_F for s in compute[:first + 1]), sum(s[0] == S_F for s in compute[:j - 1])
    return forward_led, (upto, first + 1 - upto, sum(f <= i for f, _ in pairs), before, j - 1 - before)


def _with_offload(v: int, compute: list[tuple], steps: list[tuple], at: list[int]) -> list[tuple]:
    """Insert OFFLOAD after each forward and RELOAD before the compute preceding its backward (``compute``: the
    rank's compute steps; ``at``: their indices in ``steps``)."""
    offload_after: dict[int, tuple] = {}  # compute index -> its OFFLOAD
    reload_after: dict[int, tuple] = {}  # compute index -> the RELOAD that follows it (and its OFFLOAD)
    for i, j in _offload_pairs(v, compute):
        s = compute[i]
        offload_after[i] = (S_OFF, s[1], s[2], None, None)
        # The reload goes before the batch of transfers posted ahead of compute j - 1, so the copy is in flight
        # while the rank waits for that compute's input.
        reload_after[j - 2] = (S_RL, s[1], s[2], None, None)
    out: list[tuple] = []
    start = 0
    for i in sorted(offload_after.keys() | reload_after.keys()):
        end = at[i] + 1
        out += steps[start:end]
        if i in offload_after:
            out.append(offload_after[i])
        if i in reload_after:
            out.append(reload_after[i])
        start = end
    out += steps[start:]
    return out


def _with_layer_offload(steps: list[tuple], layers: int) -> list[tuple]:
    """Layer-granular offload (pipeline size 1): OFFLOAD of layers 0..layers-1 inside each forward, their
    RELOAD from the last to the first inside each backward."""
    out: list[tuple] = []
    for s in steps:
        out.append(s)
        if s[0] == S_F:
            out.extend((S_OFF, s[1], s[2], None, l) for l in range(layers))
        elif s[0] == S_B:
            out.extend((S_RL, s[1], s[2], None, l) for l in reversed(range(layers)))
    return out


def _rank_steps(cfg: ScheduleConfig, rank: int, compute: list[tuple], placed: list[tuple],
                at: list[int]) -> list[tuple]:
    if not cfg.rank_offloads(rank):
        return placed
    if cfg.layer_granular:
        layers = cfg.rank_offloaded_layers(rank)
        return _with_layer_offload(placed, layers) if layers else placed
    return _with_offload(cfg.virtual_pipeline_model_parallel_size, compute, placed, at)


@functools.lru_cache(maxsize=64)
def _placed(shape: ScheduleConfig, early_receives: bool) -> tuple[tuple[list[tuple], ...], list[list[tuple]],
                                                                 list[list[int]]]:
    """(compute steps, steps with the transfers placed, the index of each compute step in them) of every rank, for
    a shape without offload (the offload actions do not move the transfers, so the lists of all offload choices
    share this)."""
    p = shape.pipeline_model_parallel_size
    table = schedule_table(shape.num_microbatches, shape.virtual_pipeline_model_parallel_size, shape.group_size)
    compute = tuple(_compute_steps(shape, r, table) for r in range(p))
    return (compute, *placed_steps(shape, compute, early_receives))


@functools.lru_cache(maxsize=256)
def build_rank_steps(cfg: ScheduleConfig, early_receives: bool = EARLY) -> tuple[tuple[tuple, ...], ...]:
    """Every rank's list as steps ``(code, microbatch, chunk, peer, layer)`` (``actions.STEP_KINDS``): the lists
    of :func:`build_rank_actions`, element for element, without making an :class:`Action` per step (the cost
    model's timeline reads these)."""
    p = cfg.pipeline_model_parallel_size
    compute, lists, at = _placed(dataclasses.replace(cfg, offload=False, offload_stages=None, offload_alphas=None,
                                                     num_layers_per_chunk=None), early_receives)
    return tuple(tuple(_rank_steps(cfg, r, compute[r], lists[r], at[r])) for r in range(p))


@functools.lru_cache(maxsize=256)
def _all_rank_actions(cfg: ScheduleConfig, early_receives: bool) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(step_action(s) for s in steps) for steps in build_rank_steps(cfg, early_receives))


def build_rank_actions(cfg: ScheduleConfig, rank: int, *, early_receives: bool = EARLY) -> tuple[Action, ...]:
    """Ordered action list of one pipeline rank.

    Sends and receives are placed by :func:`h3t_ext.schedule.posting.place_comms` (a posting
    order that cannot deadlock under NCCL); it needs every rank's compute order, so the lists
    of all ranks are built (and cached per shape) together. ``early_receives=False``: the order of
    Megatron's blocking exchanges, which the cost model's timeline prices those schedules on (the
    runtime posts the default).
    """
    if not 0 <= rank < cfg.pipeline_model_parallel_size:
        raise ValueError(f"rank {rank} outside [0, {cfg.pipeline_model_parallel_size})")
    return _all_rank_actions(cfg, early_receives)[rank]


def build_schedule(
    pipeline_model_parallel_size: int,
    num_microbatches: int,
    virtual_pipeline_model_parallel_size: int = 1,
    *,
    microbatch_group_size_per_vp_stage: Optional[int] = None,
    forward_only: bool = False,
    offload: bool = True,
    offload_stages: Optional[Sequence[bool]] = None,
    offload_alphas: Optional[Sequence[float]] = None,
    num_layers_per_chunk: Optional[int] = None,
) -> PipelineSchedule:
    """Build the per-rank action lists of one iteration (pure; no torch, no process group).

    ``offload_stages`` (one flag per pipeline rank, e.g. ``alpha > 0`` of each stage) says which ranks
    offload; the others get no OFFLOAD/RELOAD actions. None: every rank (when ``offload``). ``offload_alphas``
    (one per rank) does too, and with ``num_layers_per_chunk`` makes the offload of pipeline size 1
    layer-granular (module docstring)."""
    cfg = ScheduleConfig(
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        num_microbatches=num_microbatches,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
        forward_only=forward_only,
        offload=offload,
        offload_stages=None if offload_stages is None else tuple(bool(x) for x in offload_stages),
        offload_alphas=None if offload_alphas is None else tuple(float(x) for x in offload_alphas),
        num_layers_per_chunk=num_layers_per_chunk,
    )
    return PipelineSchedule(cfg, tuple(build_rank_actions(cfg, r) for r in range(pipeline_model_parallel_size)))
