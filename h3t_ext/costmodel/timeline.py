"""The iteration priced as a simulated timeline of the schedule builder's per-rank action lists.

:func:`h3t_ext.schedule.builder.build_schedule` makes, for every pipeline rank, the ordered list of actions
the runtime executes (``h3t_ext/runtime/schedules.py``); this module runs those lists on a clock. Every
action gets its price from the cost model's per-layer terms (:class:`~h3t_ext.costmodel.timing.LayerTime`,
:class:`~h3t_ext.costmodel.timing.HeadTime`) and waits for what the runtime makes it wait for:

* ``FORWARD`` / ``BACKWARD`` of a model chunk run on the rank's compute stream, one after the other:
  ``layers * LayerTime.forward_action`` (``backward_action``: backward kernels, recompute, exposed tensor-
  and context-parallel communication), plus the output layer's ``HeadTime.fwd`` / ``bwd`` on the last
  stage's last chunk. A chunk holds its own layers (``PipelineSplit.chunk_layers``: an --account-for-* slot or a layout makes them differ).
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
* With --overlap-moe-expert-parallel-comm a compute that megatron-core's combined 1F1B merges with the one before
  it (a forward and a backward of different microbatches, up to the rank's steady-state steps) takes what the
  merged layer pairs hide off its duration (``ShapeTimes.merge_hidden`` per layer), counted as the rank's ``hidden``.

Per rank the result has compute busy time, bubble (waiting for peers' compute), exposed transfer time and
stall. The iteration is the latest rank's end, then the tied-embedding gradient all-reduce and the
data-parallel reduce and optimizer step as the closed form prices them (``timing.dp_exposed_seconds``,
``timing.optimizer_seconds``). The iteration's :class:`~h3t_ext.costmodel.timing.TimeTerms` are those of
the rank that ends last: its busy time split by the per-layer record's fields, its stall as
``offload_exposed``, its waits for a transfer on the wire (at most one hop per wait) as ``pp_p2p``, the
rest of its waiting as ``bubble``.

A schedule of many microbatches is simulated for fewer and extended by its steady state where that is checked
periodic (:func:`simulate_steady`, :mod:`h3t_ext.costmodel.timeline_steady`), equal to simulating it whole.

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
from h3t_ext.costmodel.timeline_steady import extrapolate, steady_runs
from h3t_ext.costmodel.timing import (
    TimeTerms,
    dp_exposed_seconds,
    merged_pairs,
    optimizer_seconds,
    pipeline_hop_seconds,
    shape_times,
    tied_embedding_seconds,
)
from h3t_ext.schedule.actions import (S_B, S_F, S_OFF, S_RB, S_RF, S_RL, S_SB, S_SF, STEP_KINDS, ScheduleConfig,
                                      step_action)
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
    hidden: float = 0.0
    """Token exchange its merged forward-backward pairs hid (--overlap-moe-expert-parallel-comm): compute time the
    per-layer records count that the merged pairs did not take."""

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


_NOT_STARTED = float("inf")
"""A batch's start before its rank posts it (above every time, so a batch that needs it has not ended)."""


@dataclass(frozen=True)
class _Program:
    """Every rank's list as the simulator reads it (built once per schedule shape and posting order).

    ``ranks[r][i]`` (i < the rank's compute count): ``(batch, offload, reload, slot, wait, reload_wait,
    layer_stall, partner)``: the batch posted (``-1``: none), the OFFLOAD and the RELOAD issued (their copy slots,
    ``-1``: none) in the run of steps before compute i (every one of them once compute i - 1 has ended), then compute
    i: its duration slot (``(2 rank + is_backward) v + chunk``), the batch it waits for (the one carrying its input,
    or with blocking exchanges the one posted just before it; ``-1``: none), the copy slot of its reload
    (``-1``: none), whether it waits for layer reloads, and the chunk of the compute before it that it merges with
    (``-1``: none; :func:`_compile`'s ``merge``). ``ranks[r][-1]``: the run after the last compute, ``slot = -1``.
    Batches are numbered over all ranks; a copy slot is ``rank * m v + microbatch * v + chunk``."""

    ranks: tuple
    batches: tuple
    """Per batch: its own number, then the batch on the other end of each of its transfers."""


_TRANSFER_SHIFT = {S_SF: (True, 0, 1), S_SB: (True, 1, -1), S_RF: (False, 0, 0), S_RB: (False, 1, 0)}
"""Per transfer step code: (is a send, direction, receiving stage minus the step's own stage)."""


@functools.lru_cache(maxsize=64)
def _compile(cfg: ScheduleConfig, early_receives: bool, merge: bool = False) -> _Program:
    """The builder's lists of ``cfg`` (posted with ``early_receives`` or not) as a program: batches numbered,
    every transfer tied to the peer's batch, every compute tied to the batch it waits for (with blocking
    exchanges, ``early_receives=False``, the batch just before it when there is one). Reads the builder's steps
    (``build_rank_steps``: the lists, element for element); a transfer is numbered
    ``(direction * m + microbatch) * p v + receiving stage`` on both ends. ``merge``
    (--overlap-moe-expert-parallel-comm): a compute merges with the compute before it when one is a forward and the
    other a backward of another microbatch and that one merged with none (1F1B's steady-state pairs; at pipeline
    size 1 each backward with the next forward, as megatron-core's combined 1F1B schedules them), up to the rank's
    steady-state steps (``timing.merged_pairs``: a rank whose warm-up holds every forward merges none)."""
    p, v, m = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size, cfg.num_microbatches
    pv, mv = p * v, m * v
    blocking = not early_receives
    first_end = [-1] * (2 * m * pv)  # per transfer: the batch of the end met first
    recv_at = [-1] * (2 * m * pv)  # per transfer: the batch of its receive (-1: none, as the first forward's input)
    batches: list[list[int]] = []  # _Program.batches
    reloaded = [False] * (p * mv)  # per copy slot: reloaded before the step at hand
    ranks = []
    for r, steps in enumerate(build_rank_steps(cfg, early_receives)):
        number = [0] * len(STEP_KINDS)  # per transfer step code: its transfer's number less mb p v + chunk p
        receive = [False] * len(STEP_KINDS)
        for code, (send, direction, to) in _TRANSFER_SHIFT.items():
            number[code], receive[code] = direction * m * pv + to + r, not send
        forward_slot, backward_slot, copy_slot = 2 * r * v, (2 * r + 1) * v, r * mv
        out: list[tuple] = []
        batch = offload = reload = -1  # of the run since the last compute
        peers: list[int] = []  # the run's batch
        after_batch = False  # the step before is a transfer
        before = None  # (code, microbatch, chunk) of the compute before, None when it merged (or there is none)
        merges_left = merged_pairs(p, m, v, r, cfg.microbatch_group_size_per_vp_stage) if merge else 0
        for code, mb, chunk, _peer, layer in steps:  # step codes (STEP_KINDS): computes, transfers, copies
            if code <= S_B:
                if code == S_F:
                    inp = recv_at[mb * pv + chunk * p + r]
                    slot, wait_reload = forward_slot + chunk, -1
                else:
                    inp = recv_at[(m + mb) * pv + chunk * p + r]
                    slot, wait_reload = backward_slot + chunk, copy_slot + mb * v + chunk
                    if not reloaded[wait_reload]:
                        wait_reload = -1
                partner = -1
                if merges_left and before is not None and before[0] != code and before[1] != mb:
                    partner = before[2]
                    merges_left -= 1
                before = None if partner >= 0 else (code, mb, chunk)
                out.append((batch, offload, reload, slot, batch if blocking and after_batch else inp, wait_reload,
                            False, partner))
                batch = offload = reload = -1
                after_batch = False
            elif code <= S_SB:
                if batch < 0:
                    batch = len(batches)
                    peers = [batch]
                    batches.append(peers)
                tid = number[code] + mb * pv + chunk * p
                if receive[code]:
                    recv_at[tid] = batch
                other = first_end[tid]
                if other < 0:
                    first_end[tid] = batch
                else:
                    peers.append(other)
                    batches[other].append(batch)
                after_batch = True
            elif layer is not None:  # runs inside the compute action before it (layer-granular, p = 1)
                if code == S_RL:
                    out[-1] = out[-1][:6] + (True,) + out[-1][7:]  # this backward waits for its layers' reloads
            elif code == S_OFF and offload < 0:
                offload = copy_slot + mb * v + chunk
                after_batch = False
            elif code == S_RL and reload < 0:
                reload = copy_slot + mb * v + chunk
                reloaded[reload] = True
                after_batch = False
            else:  # pragma: no cover - the builder emits nothing else (one offload and one reload a run at most)
                raise AssertionError(f"no price for action {step_action((code, mb, chunk, _peer, layer))}")
        out.append((batch, offload, reload, -1, -1, -1, False, -1))
        ranks.append(tuple(out))
    return _Program(tuple(ranks), tuple(batches))


def simulate(schedule_or_config, forward: Sequence[Sequence[float]], backward: Sequence[Sequence[float]], *,
             hop: float, blocking: bool, copy: Sequence[float] = (), in_order_batches: bool = False,
             layer_stall: Sequence[float] = (), merge_hidden: Sequence[Sequence[float]] = (),
             trace: Optional[list] = None) -> tuple[RankTimeline, ...]:
    """Run every rank's action list on a clock.

    ``forward[r][c]`` / ``backward[r][c]``: seconds of the FORWARD / BACKWARD of model chunk c on rank r;
    ``hop``: seconds of one pipeline transfer; ``blocking``: Megatron's blocking exchanges, the lists posted
    in their order (``early_receives=False``) with every compute waiting for the batch just before it (else
    the builder's lists, as the runtime posts them); ``copy[r]``: seconds of one OFFLOAD or RELOAD on rank r (0 or absent where the rank copies nothing);
    ``layer_stall[r]``: seconds a backward with layer-granular reloads waits for them on rank r;
    ``merge_hidden[r][c]``: seconds of exchange a merged pair hides per its chunk c on rank r (given: the
    forward-backward pairs merge, --overlap-moe-expert-parallel-comm; a pair of two chunks hides the smaller).

    A rank runs its list in order. The steps between two computes all start when the first compute has ended
    (a batch, with ``in_order_batches``, once the rank's previous batch has ended too); a compute waits for its
    batch, whose transfers run once the batches on both ends have started.

    ``trace`` (a list): filled with one list per rank holding, per compute, its start, the rank's copy streams'
    free times and its last batch's start (every time the rank's future depends on), then its busy, bubble, p2p,
    stall and hidden so far (``timeline_steady.TIMES`` of them times): the steady-state check of
    :func:`simulate_steady`.
    """
    cfg = schedule_or_config.config if isinstance(schedule_or_config, PipelineSchedule) else schedule_or_config
    prog = _compile(cfg, not blocking, bool(merge_hidden))
    p, v = len(prog.ranks), cfg.virtual_pipeline_model_parallel_size
    copy = list(copy) + [0.0] * (p - len(copy))
    layer_stall = list(layer_stall) + [0.0] * (p - len(layer_stall))
    durations = [row[c] for r in range(p) for row in (forward[r], backward[r]) for c in range(v)]  # per slot
    slots = p * cfg.num_microbatches * v
    off_end = [0.0] * slots  # per copy slot: end of its offload / its reload (0 until then)
    rl_end = [0.0] * slots
    members = prog.batches
    start_of = [_NOT_STARTED] * len(members)  # per batch: when it started
    end_of: list[Optional[float]] = [None] * len(members)
    started = start_of.__getitem__

    def batch_end(b: int) -> Optional[float]:
        """When batch b ends (its last transfer), None while a batch it needs has not started."""
        e = end_of[b]
        if e is None:
            e = max(map(started, members[b]))
            if e == _NOT_STARTED:
                return None
            e = end_of[b] = e + hop
        return e

    # per rank: next record, whether its run of steps has run, compute stream and copy streams free at,
    # busy, bubble, p2p, stall, last batch started, hidden
    state = [[0, False, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1, 0.0] for _ in range(p)]
    out: list[Optional[RankTimeline]] = [None] * p
    if trace is not None:
        trace[:] = [[] for _ in range(p)]
    remaining = p
    while remaining:
        progress = False
        for r in range(p):
            if out[r] is not None:
                continue
            records, cp, ls = prog.ranks[r], copy[r], layer_stall[r]
            tr = None if trace is None else trace[r]
            i, ran, now, d2h, h2d, busy, bubble, p2p, stall, last, hidden = state[r]
            while True:
                batch, offload, reload, slot, wait, wait_reload, layers, partner = records[i]
                if not ran:
                    if batch >= 0:
                        s = now
                        if in_order_batches and last >= 0:
                            e = batch_end(last)
                            if e is None:
                                break
                            if e > s:
                                s = e
                        start_of[batch] = s
                        last = batch
                    if offload >= 0:
                        s = now if now > d2h else d2h
                        d2h = off_end[offload] = s + cp
                    if reload >= 0:
                        s = max(now, off_end[reload], h2d)
                        h2d = rl_end[reload] = s + cp
                    ran = progress = True  # (every compute that runs is followed by the next record's run)
                if slot < 0:  # the end: wait_all
                    if last >= 0:
                        e = batch_end(last)
                        if e is None:
                            break
                        if e > now:  # the last sends
                            w = e - now
                            on_wire = hop if hop < w else w
                            p2p += on_wire
                            bubble += w - on_wire
                            now = e
                    out[r] = RankTimeline(r, now, busy, bubble, p2p, stall, hidden)
                    remaining -= 1
                    progress = True
                    break
                start = now
                if wait >= 0:
                    e = end_of[wait]
                    if e is None:
                        e = max(map(started, members[wait]))
                        if e == _NOT_STARTED:
                            break
                        e = end_of[wait] = e + hop
                    if e > now:
                        w = e - now
                        on_wire = hop if hop < w else w
                        p2p += on_wire
                        bubble += w - on_wire
                        start = e
                if wait_reload >= 0 and rl_end[wait_reload] > start:
                    stall += rl_end[wait_reload] - start
                    start = rl_end[wait_reload]
                if layers:
                    stall += ls
                    start += ls
                d = durations[slot]
                if partner >= 0:
                    h = merge_hidden[r]
                    saved = min(h[partner], h[slot % v])
                    d -= saved
                    hidden += saved
                busy += d
                now = start + d
                if tr is not None:
                    tr.append((start, d2h, h2d, start_of[last] if last >= 0 else 0.0, busy, bubble, p2p, stall, hidden))
                i += 1
                ran = False
            state[r] = [i, ran, now, d2h, h2d, busy, bubble, p2p, stall, last, hidden]
        if not progress:  # pragma: no cover - the builder's posting order cannot deadlock (posting.py)
            raise AssertionError(f"timeline stuck at {[s[0] for s in state]}")
    return tuple(out)


def simulate_steady(cfg: ScheduleConfig, forward: Sequence[Sequence[float]], backward: Sequence[Sequence[float]], *,
                    blocking: bool, merge_hidden: Sequence[Sequence[float]] = (), whole: bool = True, **kwargs
                    ) -> Optional[tuple[RankTimeline, ...]]:
    """:func:`simulate` of ``cfg`` (keywords as its own); with many microbatches, from one shorter run whose steady
    state is checked periodic (:mod:`h3t_ext.costmodel.timeline_steady`), else whole (``whole=False``: else None,
    and no run larger than the timeline simulates is tried)."""
    for run in steady_runs(cfg):
        if not whole and _too_large(run) is not None:
            break
        trace: list = []
        ranks = simulate(run, forward, backward, blocking=blocking, merge_hidden=merge_hidden, trace=trace, **kwargs)
        program = _compile(run, not blocking, bool(merge_hidden))
        out = extrapolate(cfg, run, [records[:-1] for records in program.ranks], trace, ranks, RankTimeline)
        if out is not None:
            return out
    if not whole:
        return None
    return simulate(cfg, forward, backward, blocking=blocking, merge_hidden=merge_hidden, **kwargs)


def schedule_config(model: ModelSpec, plan: Plan, alphas: Sequence[float]) -> ScheduleConfig:
    """The builder's shape for ``plan``: its p, m, v, which stages offload (alpha > 0) and, at pipeline size 1,
    the layers of its chunk (layer-granular offload)."""
    offload = tuple(a > 0 for a in alphas)
    layers = layers_per_chunk(model, plan)
    return ScheduleConfig(pipeline_model_parallel_size=plan.pipeline_model_parallel_size,
                          num_microbatches=plan.num_microbatches,
                          virtual_pipeline_model_parallel_size=plan.virtual_size(model.num_layers),
                          microbatch_group_size_per_vp_stage=plan.microbatch_group_size_per_vp_stage,
                          offload=any(offload), offload_stages=offload if any(offload) else None,
                          offload_alphas=tuple(alphas) if layers is not None and any(offload) else None,
                          num_layers_per_chunk=layers if any(offload) else None)


MAX_TIMELINE_ACTIONS = 2**19
"""Most compute actions (2 x microbatches x pipeline stages x model chunks) a timeline builds and simulates:
about 5 s at the ~10 us each costs (a million microbatches on eight stages took minutes, and thousands of stages
with hundreds of chunks each ran out of memory building the lists). A larger schedule is priced from a shorter run of
its steady state within this size (:func:`simulate_steady`), else by the closed form, and the estimate says so
(:func:`timeline_too_large`)."""
MAX_TIMELINE_LAYER_COPIES = 2**22
"""Most layer offloads and reloads (2 x microbatches x layers of the chunk, pipeline size 1 with alpha > 0) a
timeline builds: about 3 s (each is one step of the rank's list; tens of millions of them took gigabytes)."""


def timeline_too_large(model: ModelSpec, plan: Plan, alphas: Optional[Sequence[float]] = None) -> Optional[str]:
    """Why ``plan``'s action lists are too many to simulate whole (one line), or None when they are not (the
    timeline may still price it from a shorter run of its steady state: ``plan_timeline(..., whole=False)``)."""
    return _too_large(schedule_config(model, plan, tuple(plan.alphas() if alphas is None else alphas)))


def _too_large(cfg: ScheduleConfig) -> Optional[str]:
    """Why the lists of ``cfg`` are too large to simulate (its computes, and its layer copies where the offload is
    layer-granular), or None."""
    p, m, v = cfg.pipeline_model_parallel_size, cfg.num_microbatches, cfg.virtual_pipeline_model_parallel_size
    actions = 2 * m * p * v
    if actions > MAX_TIMELINE_ACTIONS:
        return (f"its schedule has 2 x {m} microbatches x {p} pipeline stages x {v} model chunks = {actions} compute "
                f"actions, more than the {MAX_TIMELINE_ACTIONS} the timeline simulates")
    layers = cfg.num_layers_per_chunk if cfg.offload_alphas is not None else None  # layer-granular (schedule_config)
    copies = 2 * m * layers if layers else 0
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


def plan_timeline(model: ModelSpec, plan: Plan, system: SystemSpec, alphas: Optional[Sequence[float]] = None, *,
                  whole: bool = True) -> Optional[Timeline]:
    """Price ``plan``'s action lists (``alphas``: per stage, default the plan's) on the timeline. ``whole=False``
    (lists too large to simulate whole, :func:`timeline_too_large`): only from a shorter run of its steady state,
    None where none is checked periodic or small enough."""
    with _cycle_collector_paused():
        return _plan_timeline(model, plan, system, alphas, whole)


def _plan_timeline(model: ModelSpec, plan: Plan, system: SystemSpec, alphas: Optional[Sequence[float]],
                   whole: bool = True) -> Optional[Timeline]:
    alphas = tuple(plan.alphas() if alphas is None else alphas)
    p, L = plan.pipeline_model_parallel_size, model.num_layers
    v = plan.virtual_size(L)
    st = shape_times(model, plan, system)
    fa, ba = st.layer.forward_action, st.layer.backward_action
    forward, backward = [], []
    split = plan.pipeline_split(L)
    for r in range(p):
        chunks = [split.chunk_layers(r, c) for c in range(v)]  # a layout or --account-for-* makes them differ
        f, b = [n * fa for n in chunks], [n * ba for n in chunks]
        if plan.has_bf16_layers:  # an FP8 plan's BF16 first / last layers, in the chunks that hold them
            for c, k in enumerate(plan.chunk_bf16_layers(L, r)):
                f[c] += st.extra(k, "forward_action")
                b[c] += st.extra(k, "backward_action")
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
        stalls = (p1_exposed_seconds(st.mean_layer(layers, plan.stage_bf16_layers(L, 0)), st.head.total,
                                     chunk_activation_bytes(model, plan, 0), layers, alphas[0], system),)
    blocking = v == 1 or not plan.overlap_p2p_comm
    hop = pipeline_hop_seconds(model, plan, system) if p > 1 else 0.0
    merge = ()
    if st.merge_hidden:  # --overlap-moe-expert-parallel-comm: per rank and chunk, what merging the chunk hides
        merge = [[st.merge_hidden * split.chunk_layers(r, c) for c in range(v)] for r in range(p)]
    ranks = simulate_steady(schedule_config(model, plan, alphas), forward, backward, hop=hop, blocking=blocking,
                            copy=copy, layer_stall=stalls, merge_hidden=merge, whole=whole)
    if ranks is None:
        return None
    return Timeline(ranks=ranks, pipeline_s=max(r.end for r in ranks),
                    tied_embedding_s=tied_embedding_seconds(model, plan, system),
                    dp_exposed_s=dp_exposed_seconds(model, plan, system), optimizer_s=optimizer_seconds(model, plan, system))


def timeline_terms(model: ModelSpec, plan: Plan, system: SystemSpec, timeline: Timeline) -> TimeTerms:
    """The iteration by term as the timeline ran it (they add up to ``timeline.iteration_time_s``): the rank
    that ends last, its busy time split by the per-layer record's fields (it runs m microbatches of its
    layers, and the output layer on the last stage), its stall, its waits on the wire and its bubble (with
    the time it ends before the pipeline's end, none for the rank that ends last)."""
    r = timeline.ranks[timeline.critical_rank]
    L, p = model.num_layers, plan.pipeline_model_parallel_size
    busy = shape_times(model, plan, system).busy_terms(plan.num_microbatches, plan.stage_layers(L, r.rank),
                                                       plan.stage_bf16_layers(L, r.rank), r.rank == p - 1)
    busy["ep_comm"] -= r.hidden  # the exchange its merged pairs hid
    return TimeTerms(
        **busy,
        pp_p2p=r.p2p + timeline.tied_embedding_s,
        bubble=r.bubble + (timeline.pipeline_s - r.end),
        dp_exposed=timeline.dp_exposed_s,
        optimizer=timeline.optimizer_s,
        offload_exposed=r.stall,
    )


__all__ = ["RankTimeline", "Timeline", "plan_timeline", "schedule_config", "simulate", "simulate_steady",
           "timeline_terms"]
