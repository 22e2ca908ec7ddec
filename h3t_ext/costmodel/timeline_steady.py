"""A timeline of many microbatches from one run of fewer: its steady state, checked periodic, then extended.

Every duration the timeline simulates (:func:`h3t_ext.costmodel.timeline.simulate`) is fixed and every start is the
latest end of what it waits for: a max-plus linear system. Once its state repeats, translated in time, from one
period of microbatches to the next (one for plain 1F1B; one group, ``microbatch_group_size_per_vp_stage`` or p, for
interleaved 1F1B), every later period repeats it, and what follows (the last steady microbatches, which feel the
cool-down of the ranks after them, and the cool-down) is the same, later. So a schedule of m microbatches is priced
from one run of m' < m with m's remainder modulo the period S, where over one window:

* every rank's list repeats from one period to the next (each compute's duration slot, merge partner and
  layer-reload wait the same, its batch, copies and waits present alike, each id one fixed step on): the window lies
  in the longest such part of the list, its steady state;
* every rank's state at each compute (its start, the free times of its copy streams, its last batch's start: all the
  times its future depends on) is the one a period before plus one Delta common to all ranks, and its running totals
  (busy, bubble, waits on the wire, reload stalls, merged exchange) grow by the same amounts each period;
* the window spans ``WINDOW_PERIODS`` periods and the longest reach of a dependency (``4 p v`` computes: an offload's
  reload, a peer's transfer), and lies the same number of periods before the end of every rank's steady state
  (concurrent on all ranks: together the state of the whole pipeline), the latest place where the above holds;

then the m-microbatch timeline is the run's with k = (m - m') / S more periods: each rank's end + k Delta and each
total + k times its per-period growth. Where no window passes (a transient longer than the run: two stages' cycles
within a few percent of each other can take tens of periods to settle) a run ``LONGER`` times as long is tried, then
m is simulated whole. Agreement of the outputs alone over a few periods is not enough: such a transient kept the
iteration's increment the same from 31 to 77 microbatches and then changed it (docs/DESIGN.md, "Search speed").
``tests/unit/test_timeline_steady.py`` compares the result with the whole simulation on random schedules."""
from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Optional, Sequence

from h3t_ext.schedule.actions import ScheduleConfig

WINDOW_PERIODS = 2
"""Periods the checked window spans at least (beside the dependencies' reach)."""
MIN_SAVING = 3
"""A shorter run is tried only where m is at least this many times its microbatches."""
TRIES, LONGER = 2, 4
"""Runs tried before m is simulated whole, each this many times the one before: a schedule whose state never
repeats (a copy stream or an in-order batch chain that falls further behind every period) costs at most
1/3 + 1/12 of its whole simulation more."""
AGREE_RELATIVE = 1e-9
"""Largest difference, relative to the run's iteration, between two values that must be equal (float sums over a
few thousand actions round at ~1e-13)."""
ID_FIELDS = (0, 1, 2, 4, 5)
"""Fields of a compiled record (``timeline._Program``) that are ids (batch, offload, reload, wait, reload wait; -1:
none): a period on, present alike and each one fixed step on."""
SAME_FIELDS = (3, 6, 7)
"""Fields of a compiled record that a period on are equal (duration slot, layer-reload wait, merge partner)."""
TIMES = 4
"""The first fields of a trace entry (``timeline.simulate(..., trace=)``) that are times; the rest are running
totals."""


def period(cfg: ScheduleConfig) -> int:
    """Microbatches after which the lists repeat: 1 for plain 1F1B, the group size for interleaved 1F1B."""
    if cfg.virtual_pipeline_model_parallel_size == 1:
        return 1
    return cfg.microbatch_group_size_per_vp_stage or cfg.pipeline_model_parallel_size


def steady_runs(cfg: ScheduleConfig) -> Iterator[ScheduleConfig]:
    """The shorter schedules to try for ``cfg``, shortest first (none where m is too small to gain)."""
    p, v, m, s = (cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size, cfg.num_microbatches,
                  period(cfg))
    if cfg.forward_only:
        return
    warmup = 2 * (p - 1) + (v - 1) * s  # most forwards before a rank's steady state (rank 0's)
    # steady computes 2 (m' v - warmup) cover the window, its reach and two periods past it (the last steady
    # microbatches feel the cool-down)
    need = math.ceil((warmup + (WINDOW_PERIODS + 2) * s * v + 2 * p * v) / v)
    run = max(need, s if v > 1 else 1)
    for _ in range(TRIES):
        run += (m - run) % s  # m's remainder modulo s: the same last group
        if MIN_SAVING * run > m:
            return
        yield dataclasses.replace(cfg, num_microbatches=run)
        run *= LONGER


def _repeating(records: Sequence[tuple], step: int) -> tuple[int, int]:
    """The longest repeating part of a rank's list (its steady state; the warm-up and the cool-down repeat in short
    runs of their own), as (first, end) indices: every record i in [first, end) is the one a period (``step``
    computes) on, each id present alike and one fixed step (per field, over the part) on; (0, 0) where there is
    none."""
    best, first, shift = (0, 0), 0, [None] * len(ID_FIELDS)
    for i in range(len(records) - step):
        a, b = records[i], records[i + step]
        if any(a[f] != b[f] for f in SAME_FIELDS) or any((a[f] < 0) != (b[f] < 0) for f in ID_FIELDS):
            first, shift = i + 1, [None] * len(ID_FIELDS)
            continue
        for j, f in enumerate(ID_FIELDS):
            if a[f] >= 0:
                if shift[j] is None:
                    shift[j] = b[f] - a[f]
                elif b[f] - a[f] != shift[j]:  # a new part starts here
                    first, shift = i, [None if a[g] < 0 else b[g] - a[g] for g in ID_FIELDS]
                    break
        if i + 1 - first > best[1] - best[0]:
            best = (first, i + 1)
    return best


def _window_growth(tr: Sequence[tuple], last: int, step: int, window: int, tol: float
                   ) -> Optional[tuple[float, list[float]]]:
    """(Delta, per-period growth of the running totals) where every trace entry i in [last - window, last) is the
    one a period on less Delta in its times and less the growth in its totals, else None."""
    a, b = tr[last - 1], tr[last - 1 + step]
    delta = b[0] - a[0]
    grow = [b[q] - a[q] for q in range(TIMES, len(a))]
    for i in range(last - window, last):
        a, b = tr[i], tr[i + step]
        for q in range(TIMES):
            if abs(b[q] - a[q] - delta) > tol and not (a[q] == b[q] == 0.0):  # 0.0: a stream never used
                return None
        if any(abs(b[q] - a[q] - g) > tol for q, g in zip(range(TIMES, len(a)), grow)):
            return None
    return delta, grow


def extrapolate(cfg: ScheduleConfig, run: ScheduleConfig, records: Sequence[Sequence[tuple]],
                trace: Sequence[Sequence[tuple]], ranks: Sequence, rank_timeline) -> Optional[tuple]:
    """The rank timelines of ``cfg`` from the run of ``run`` (its compiled ``records`` per rank, one per compute, its
    ``trace`` and its ``ranks``), or None where the run's steady state is not checked periodic. ``rank_timeline``:
    the record type to build (``RankTimeline``).

    The window is taken the same number of periods before the end of every rank's repeating part (the ranks' steady
    states end at the same microbatches, so the windows are concurrent: together the state of the whole pipeline),
    first right at its end, then a period earlier at a time, up to 2 p v computes and a period earlier: the last
    steady microbatches of a rank feel the cool-down of the ranks after it (a backward that waits for a cool-down
    backward), which is the same for every m, so a window before them proves as much (on 445 random schedules that
    passed the window lay at most 2 p v computes and a period before the end)."""
    s, v, p = period(cfg), cfg.virtual_pipeline_model_parallel_size, cfg.pipeline_model_parallel_size
    k, rest = divmod(cfg.num_microbatches - run.num_microbatches, s)
    if rest or k < 1:
        return None
    step, window = 2 * s * v, WINDOW_PERIODS * 2 * s * v + 4 * p * v
    tol = AGREE_RELATIVE * max(r.end for r in ranks)
    parts = [_repeating(recs, step) for recs in records]
    if any(len(recs) != len(tr) for recs, tr in zip(records, trace)):  # pragma: no cover - one entry per compute
        return None
    back = 0  # computes before the end of the repeating parts: the cool-down reaches back at most 2 p v of them
    while back <= 2 * p * v + step and all(end - back - start >= window for start, end in parts):
        found = []
        for tr, (_, end) in zip(trace, parts):  # stops at the first rank whose window does not repeat
            found.append(_window_growth(tr, end - back, step, window, tol))
            if found[-1] is None:
                break
        if found[-1] is not None and max(f[0] for f in found) - min(f[0] for f in found) <= tol:
            delta = found[0][0]
            return tuple(rank_timeline(r.rank, r.end + k * delta, *(x + k * g for x, g in zip(
                (r.busy, r.bubble, r.p2p, r.stall, r.hidden), grow))) for r, (_, grow) in zip(ranks, found))
        back += step
    return None


__all__ = ["AGREE_RELATIVE", "MIN_SAVING", "WINDOW_PERIODS", "extrapolate", "period", "steady_runs"]
