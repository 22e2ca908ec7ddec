"""The iteration priced as a simulated timeline of the schedule builder's per-rank action lists.

:func:`h3t_ext.schedule.builder.build_schedule` makes, for every pipeline rank, the ordered list of actions
the runtime executes (``h3t_ext/runtime/schedules.py``); this module runs those lists on a clock. Every
action gets its price from the cost model's per-layer terms (:class:`~h3t_ext.costmodel.timing.LayerTime`,
:class:`~h3t_ext.costmodel.timing.HeadTime`) and waits for what the runtime makes it wait for:

* ``FORWARD`` / ``BACKWARD`` of a model chunk run on the rank's compute stream, one after the other:
  ``layers * LayerTime.forward_action`` (``backward_action``: backward kernels, recompute, exposed tensor-
  and context-parallel communication), plus the output layer's ``HeadTime.fwd`` / ``bwd`` on the last
  stage's last chunk. A chunk holds ``stage_layers / v`` layers.
* Sends and receives: every run of them between two compute actions is one ``batch_isend_irecv`` batch
  (:func:`h3t_ext.schedule.posting.posting_batches`). A batch is posted when the compute before it ends and
  runs after the rank's previous batch (NCCL runs a rank's batches in order on one stream); a transfer runs
  once both ends' batches run, for one hop (``timing.pipeline_hop_seconds``: 1/t of the activation over the
  pipeline link); a batch ends with its last transfer. A compute that consumes a receive waits for the batch
  that carries it (NCCL's batch returns one work for the whole batch); with blocking exchanges (plain 1F1B,
  and interleaved 1F1B without --overlap-p2p-communication, as Megatron runs them and as the closed form
  prices them) the lists are posted in the order of those exchanges (``build_rank_actions(...,
  early_receives=False)``: each receive right before its consumer) and every compute waits for the batch
  posted just before it. The rank's iteration ends when its last compute and its last batch have ended
  (``wait_all``).
* ``OFFLOAD`` (right after its chunk's forward) copies alpha of the chunk's saved bytes to host memory on
  the rank's device-to-host copy stream: it starts when the forward has ended and the stream is free.
  ``RELOAD`` copies them back on the host-to-device stream (the opposite direction has its own stream, as
  ``h3t_ext/runtime/activations.py``): it starts when the compute enqueued before it has ended (the runtime
  records the compute stream), the chunk's offload has ended and the stream is free. The chunk's backward
  cannot start before its reload has ended: that wait is the rank's *stall*. A copy takes
  ``alpha * chunk bytes / (PCIe bandwidth * pcie_fraction)``. Ranks whose alpha is 0 carry no copies
  (the builder is told which stages offload).
* At pipeline size 1 the offload is layer-granular: the layer OFFLOAD/RELOAD actions run inside the forward
  and backward they follow. A backward carrying layer reloads waits ``layer_stall[r]`` seconds for them
  (:func:`h3t_ext.costmodel.layer_offload.exposed_seconds_per_microbatch`: each layer's copy against the
  next layer's forward and backward), counted as stall.

Per rank the result has compute busy time, bubble (waiting for peers' compute), exposed transfer time and
stall. The iteration is the latest rank's end, then the tied-embedding gradient all-reduce and the
data-parallel reduce and optimizer step as the closed form prices them (``timing.dp_exposed_seconds``,
``timing.optimizer_seconds``). The iteration's :class:`~h3t_ext.costmodel.timing.TimeTerms` are those of
the rank that ends last: its busy time split by the per-layer record's fields, its stall as
``offload_exposed``, its waits for a transfer on the wire (at most one hop per wait) as ``pp_p2p``, the
rest of its waiting as ``bubble``.

A new schedule action gets its price here (:func:`_compile` and :func:`simulate`) and nowhere else.
"""
from __future__ import annotations

import contextlib
import functools
import gc
from dataclasses import dataclass
from typing import Optional, Sequence

from h3t_ext.costmodel.collectives import host_copy_seconds
from h3t_ext.costmodel.layer_offload import layers_per_chunk, p1_exposed_seconds
from h3t_ext.costmodel.memory import chunk_activation_bytes
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec
from h3t_ext.costmodel.timing import (
    TimeTerms,
    dp_exposed_seconds,
    optimizer_seconds,
    pipeline_hop_seconds,
    shape_times,
    tied_embedding_seconds,
)
from h3t_ext.schedule.actions import S_B, S_F, S_OFF, S_RB, S_RF, S_RL, S_SB, S_SF, ScheduleConfig, step_action
from h3t_ext.schedule.builder import PipelineSchedule, build_rank_steps


@dataclass(frozen=True)
class RankTimeline:
    """What one pipeline rank did during the pipelined part of the iteration (seconds)."""

    rank: int
    end: float
    """When its last compute and its last transfer ended (the iteration starts at 0)."""
    busy: float
    """Compute actions (forward, backward, recompute and their exposed tensor/context-parallel traffic)."""
    bubble: float
    """Waiting for other ranks' compute (warm-up, cool-down, uneven stages)."""
    p2p: float
    """Waiting for a transfer on the wire (at most one hop per wait)."""
    stall: float
    """Waiting for reloads: a backward whose reload had not ended."""

    @property
    def idle(self) -> float:
        return self.bubble + self.p2p + self.stall


@dataclass(frozen=True)
class Timeline:
    """The simulated pipeline of one iteration."""

    ranks: tuple[RankTimeline, ...]
    pipeline_s: float
    """The latest rank's end."""
    tied_embedding_s: float
    """Word-embedding gradient all-reduce between the first and the last stage after the pipeline."""
    dp_exposed_s: float
    optimizer_s: float

    @property
    def critical_rank(self) -> int:
        return max(self.ranks, key=lambda r: (r.end, -r.rank)).rank

    @property
    def iteration_time_s(self) -> float:
        return self.pipeline_s + self.tied_embedding_s + self.dp_exposed_s + self.optimizer_s

    def to_dict(self) -> dict:
        return {"iteration_time_s": self.iteration_time_s, "pipeline_s": self.pipeline_s,
                "critical_rank": self.critical_rank,
                "ranks": [{"rank": r.rank, "end_s": r.end, "busy_s": r.busy, "bubble_s": r.bubble, "p2p_s": r.p2p,
                           "stall_s": r.stall} for r in self.ranks]}


@dataclass(frozen=True)
class _Program:
    """One rank's list as the simulator reads it (built once per schedule shape)."""

    items: tuple
    """("C", is_forward, chunk, input_batch, previous_batch, copy_key) | ("T", batch) | ("O", key) | ("R", key)."""
    batches: tuple
    """Per batch: tuple of (peer rank, peer's batch index) of its transfers."""


_TRANSFER_SHIFT = {S_SF: (True, 0, 1), S_SB: (True, 1, -1), S_RF: (False, 0, 0), S_RB: (False, 1, 0)}
"""Per transfer step code: (is a send, direction, receiving stage minus the step's own stage)."""


@functools.lru_cache(maxsize=64)
def _compile(cfg: ScheduleConfig, early_receives: bool) -> tuple[_Program, ...]:
    """The builder's lists of ``cfg`` (posted with ``early_receives`` or not) as per-rank programs: batches
    numbered, every transfer tied to the peer's batch, every compute tied to the batch carrying its input and
    to the batch just before it. Reads the builder's steps (``build_rank_steps``: the lists, element for element);
    a transfer is numbered ``(direction * m + microbatch) * p v + receiving stage`` on both ends."""
    p, v, m = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size, cfg.num_microbatches
    pv = p * v
    at = ([None] * (2 * m * pv), [None] * (2 * m * pv))  # [is_send][transfer] -> (rank, batch)
    recv_at = at[0]
    raw = []
    for r, steps in enumerate(build_rank_steps(cfg, early_receives)):
        items: list = []
        batches: list[list[tuple]] = []
        batch: list = []
        open_run = False  # a transfer since the last compute (an offload or a reload does not end a batch)
        where = (r, -1)  # (rank, index) of the open batch
        after_batch = False  # the item before is a batch
        for code, mb, chunk, _peer, layer in steps:
            shift = _TRANSFER_SHIFT.get(code)
            if shift is not None:  # (is_send, direction, stage shift to the receiving stage)
                if not open_run:
                    batch = []
                    where = (r, len(batches))
                    items.append(("T", len(batches)))
                    batches.append(batch)
                    open_run = after_batch = True
                tid = (shift[1] * m + mb) * pv + chunk * p + r + shift[2]
                batch.append(tid * 2 + shift[0])
                at[shift[0]][tid] = where
                continue
            if code <= S_B:
                open_run = False
                s = chunk * p + r
                if code == S_F:
                    inp = recv_at[mb * pv + s][1] if s > 0 else -1
                    items.append(("C", True, chunk, inp, len(batches) - 1 if after_batch else -1, mb * v + chunk,
                                  False))
                else:
                    inp = recv_at[(m + mb) * pv + s][1] if s < pv - 1 else -1
                    items.append(("C", False, chunk, inp, len(batches) - 1 if after_batch else -1, mb * v + chunk,
                                  False))
            elif layer is not None:  # runs inside the compute action before it (layer-granular, p = 1)
                if code == S_RL:
                    items[-1] = items[-1][:6] + (True,)  # this backward waits for its layers' reloads
                continue
            elif code == S_OFF:
                items.append(("O", mb * v + chunk))
            elif code == S_RL:
                items.append(("R", mb * v + chunk))
            else:  # pragma: no cover - the builder emits nothing else
                raise AssertionError(f"no price for action {step_action((code, mb, chunk, _peer, layer))}")
            after_batch = False
        raw.append((items, batches))
    send_at = at[1]  # a batch entry is 2 * transfer id + is_send: its peer is the other end
    return tuple(_Program(tuple(items), tuple(tuple(send_at[e >> 1] if e & 1 == 0 else recv_at[e >> 1] for e in b)
                                              for b in batches)) for items, batches in raw)


def simulate(schedule_or_config, forward: Sequence[Sequence[float]], backward: Sequence[Sequence[float]], *,
             hop: float, blocking: bool, copy: Sequence[float] = (), in_order_batches: bool = False,
             layer_stall: Sequence[float] = ()) -> tuple[RankTimeline, ...]:
    """Run every rank's action list on a clock.

    ``forward[r][c]`` / ``backward[r][c]``: seconds of the FORWARD / BACKWARD of model chunk c on rank r;
    ``hop``: seconds of one pipeline transfer; ``blocking``: Megatron's blocking exchanges, the lists posted
    in their order (``early_receives=False``) with every compute waiting for the batch just before it (else
    the builder's lists, as the runtime posts them); ``copy[r]``: seconds of one OFFLOAD or RELOAD on rank r (0 or absent where the rank copies nothing);
    ``layer_stall[r]``: seconds a backward with layer-granular reloads waits for them on rank r.
    """
    cfg = schedule_or_config.config if isinstance(schedule_or_config, PipelineSchedule) else schedule_or_config
    progs = _compile(cfg, not blocking)
    p = len(progs)
    copy = list(copy) + [0.0] * (p - len(copy))
    layer_stall = list(layer_stall) + [0.0] * (p - len(layer_stall))
    ptr = [0] * p
    cs = [0.0] * p  # compute stream: end of the last compute
    d2h = [0.0] * p
    h2d = [0.0] * p
    busy = [0.0] * p
    bubble = [0.0] * p
    p2p = [0.0] * p
    stall = [0.0] * p
    bstart: list[list[Optional[float]]] = [[None] * len(pr.batches) for pr in progs]
    bend: list[list[Optional[float]]] = [[None] * len(pr.batches) for pr in progs]
    last_batch = [-1] * p  # index of the last batch started on the rank
    off_end: list[dict] = [{} for _ in range(p)]
    rl_end: list[dict] = [{} for _ in range(p)]

    def batch_end(r: int, b: int) -> Optional[float]:
        e = bend[r][b]
        if e is not None:
            return e
        s = bstart[r][b]
        if s is None:
            return None
        for pr_, pb in progs[r].batches[b]:
            o = bstart[pr_][pb]
            if o is None:
                return None
            if o > s:
                s = o
        e = bend[r][b] = s + hop
        return e

    remaining = p
    done = [False] * p
    while remaining:
        progress = False
        for r in range(p):
            if done[r]:
                continue
            items = progs[r].items
            i, n = ptr[r], len(items)
            fwd_r, bwd_r = forward[r], backward[r]
            while i < n:
                it = items[i]
                tag = it[0]
                if tag == "C":
                    wait_b = it[4] if blocking and it[4] >= 0 else it[3]
                    ready = cs[r]
                    comm = ready
                    if wait_b >= 0:
                        e = batch_end(r, wait_b)
                        if e is None:
                            break
                        if e > ready:
                            comm = e
                            w = e - ready
                            on_wire = hop if hop < w else w
                            p2p[r] += on_wire
                            bubble[r] += w - on_wire
                    start = comm
                    if not it[1]:
                        rl = rl_end[r].get(it[5])
                        if rl is not None and rl > start:
                            stall[r] += rl - start
                            start = rl
                        if it[6]:
                            stall[r] += layer_stall[r]
                            start += layer_stall[r]
                    dur = fwd_r[it[2]] if it[1] else bwd_r[it[2]]
                    busy[r] += dur
                    cs[r] = start + dur
                elif tag == "T":
                    b = it[1]
                    s = cs[r]
                    if in_order_batches and last_batch[r] >= 0:
                        e = batch_end(r, last_batch[r])
                        if e is None:
                            break
                        if e > s:
                            s = e
                    bstart[r][b] = s
                    last_batch[r] = b
                elif tag == "O":
                    s = cs[r] if cs[r] > d2h[r] else d2h[r]
                    d2h[r] = off_end[r][it[1]] = s + copy[r]
                else:  # reload
                    s = max(cs[r], off_end[r][it[1]], h2d[r])
                    h2d[r] = rl_end[r][it[1]] = s + copy[r]
                i += 1
                progress = True
            ptr[r] = i
            if i == n:
                if last_batch[r] >= 0:
                    e = batch_end(r, last_batch[r])
                    if e is None:
                        continue
                    if e > cs[r]:  # wait_all: the last sends
                        w = e - cs[r]
                        on_wire = hop if hop < w else w
                        p2p[r] += on_wire
                        bubble[r] += w - on_wire
                        cs[r] = e
                done[r] = True
                remaining -= 1
                progress = True
        if not progress:  # pragma: no cover - the builder's posting order cannot deadlock (posting.py)
            raise AssertionError(f"timeline stuck at {ptr}")
    return tuple(RankTimeline(r, cs[r], busy[r], bubble[r], p2p[r], stall[r]) for r in range(p))


def schedule_config(model: ModelSpec, plan: Plan, alphas: Sequence[float]) -> ScheduleConfig:
    """The builder's shape for ``plan``: its p, m, v, which stages offload (alpha > 0) and, at pipeline size 1,
    the layers of its chunk (layer-granular offload)."""
    offload = tuple(a > 0 for a in alphas)
    layers = layers_per_chunk(model, plan)
    return ScheduleConfig(pipeline_model_parallel_size=plan.pipeline_model_parallel_size,
                          num_microbatches=plan.num_microbatches,
                          virtual_pipeline_model_parallel_size=plan.virtual_size(model.num_layers),
                          offload=any(offload), offload_stages=offload if any(offload) else None,
                          offload_alphas=tuple(alphas) if layers is not None and any(offload) else None,
                          num_layers_per_chunk=layers if any(offload) else None)


MAX_TIMELINE_ACTIONS = 2**19
"""Most compute actions (2 x microbatches x pipeline stages x model chunks) a timeline builds and simulates:
about 5 s at the ~10 us each costs (a million microbatches on eight stages took minutes, and thousands of stages
with hundreds of chunks each ran out of memory building the lists). A larger schedule is priced by the closed
form, and the estimate says so (:func:`timeline_too_large`)."""
MAX_TIMELINE_LAYER_COPIES = 2**22
"""Most layer offloads and reloads (2 x microbatches x layers of the chunk, pipeline size 1 with alpha > 0) a
timeline builds: about 3 s (each is one step of the rank's list; tens of millions of them took gigabytes)."""


def timeline_too_large(model: ModelSpec, plan: Plan, alphas: Optional[Sequence[float]] = None) -> Optional[str]:
    """Why ``plan``'s action lists are too many to simulate (one line), or None when the timeline prices it."""
    alphas = tuple(plan.alphas() if alphas is None else alphas)
    p, m, v = plan.pipeline_model_parallel_size, plan.num_microbatches, plan.virtual_size(model.num_layers)
    actions = 2 * m * p * v
    if actions > MAX_TIMELINE_ACTIONS:
        return (f"its schedule has 2 x {m} microbatches x {p} pipeline stages x {v} model chunks = {actions} compute "
                f"actions, more than the {MAX_TIMELINE_ACTIONS} the timeline simulates")
    layers = layers_per_chunk(model, plan)
    copies = 2 * m * layers if layers is not None and any(a > 0 for a in alphas) else 0
    if copies > MAX_TIMELINE_LAYER_COPIES:
        return (f"its layer-granular offload has 2 x {m} microbatches x {layers} layers = {copies} layer copies, more "
                f"than the {MAX_TIMELINE_LAYER_COPIES} the timeline simulates")
    return None


@contextlib.contextmanager
def _cycle_collector_paused():
    """Python's cyclic garbage collector paused for the block, then back as it was. The builder's lists and their
    compiled programs are tens of thousands of small acyclic tuples and lists: the collector walks them (and every
    other object, once the young generations fill) while they are built and never frees any (reference counting
    does); at the sizes of ``scripts/bench_planner.py`` that walk was a third of the time of a timeline."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def plan_timeline(model: ModelSpec, plan: Plan, system: SystemSpec, alphas: Optional[Sequence[float]] = None) -> Timeline:
    """Price ``plan``'s action lists (``alphas``: per stage, default the plan's) on the timeline."""
    with _cycle_collector_paused():
        return _plan_timeline(model, plan, system, alphas)


def _plan_timeline(model: ModelSpec, plan: Plan, system: SystemSpec, alphas: Optional[Sequence[float]]) -> Timeline:
    alphas = tuple(plan.alphas() if alphas is None else alphas)
    p, L = plan.pipeline_model_parallel_size, model.num_layers
    v = plan.virtual_size(L)
    st = shape_times(model, plan, system)
    fa, ba = st.layer.forward_action, st.layer.backward_action
    forward, backward = [], []
    for r in range(p):
        chunk_layers = plan.stage_layers(L, r) / v
        f, b = [chunk_layers * fa] * v, [chunk_layers * ba] * v
        if r == p - 1:
            f[-1] += st.head.fwd
            b[-1] += st.head.bwd
        forward.append(f)
        backward.append(b)
    copy = [host_copy_seconds(a * chunk_activation_bytes(model, plan, r), system) if a > 0 else 0.0
            for r, a in enumerate(alphas)]
    layers = layers_per_chunk(model, plan)
    stalls = ()
    if layers is not None and alphas[0] > 0:  # layer-granular: the copies are priced inside the compute
        copy = [0.0]
        stalls = (p1_exposed_seconds(st.layer, st.head.total, chunk_activation_bytes(model, plan, 0), layers,
                                     alphas[0], system),)
    blocking = v == 1 or not plan.overlap_p2p_comm
    hop = pipeline_hop_seconds(model, plan, system) if p > 1 else 0.0
    ranks = simulate(schedule_config(model, plan, alphas), forward, backward, hop=hop, blocking=blocking, copy=copy,
                     layer_stall=stalls)
    return Timeline(ranks=ranks, pipeline_s=max(r.end for r in ranks),
                    tied_embedding_s=tied_embedding_seconds(model, plan, system),
                    dp_exposed_s=dp_exposed_seconds(model, plan, system), optimizer_s=optimizer_seconds(model, plan, system))


def timeline_terms(model: ModelSpec, plan: Plan, system: SystemSpec, timeline: Timeline) -> TimeTerms:
    """The iteration by term as the timeline ran it (they add up to ``timeline.iteration_time_s``): the rank
    that ends last, its busy time split by the per-layer record's fields (it runs m microbatches of its
    layers, and the output layer on the last stage), its stall, its waits on the wire and its bubble (with
    the time it ends before the pipeline's end, none for the rank that ends last)."""
    r = timeline.ranks[timeline.critical_rank]
    st = shape_times(model, plan, system)
    lt, m, p = st.layer, plan.num_microbatches, plan.pipeline_model_parallel_size
    per_mb_layers = m * plan.stage_layers(model.num_layers, r.rank)
    head = m * st.head.total if r.rank == p - 1 else 0.0
    return TimeTerms(
        compute=per_mb_layers * (lt.fwd + lt.bwd) + head,
        recompute=per_mb_layers * lt.recompute,
        tp_comm=per_mb_layers * lt.tp,
        cp_comm=per_mb_layers * lt.cp,
        pp_p2p=r.p2p + timeline.tied_embedding_s,
        bubble=r.bubble + (timeline.pipeline_s - r.end),
        dp_exposed=timeline.dp_exposed_s,
        optimizer=timeline.optimizer_s,
        offload_exposed=r.stall,
    )


__all__ = ["RankTimeline", "Timeline", "plan_timeline", "schedule_config", "simulate", "timeline_terms"]
