"""Where the sends and receives go in the action lists: posting orders that cannot deadlock
under NCCL's point-to-point semantics (pure; no torch).

The runtime posts the comm actions of a rank in *batches*: every maximal run of
send/receive actions with no FORWARD/BACKWARD between them is one ``batch_isend_irecv``
(OFFLOAD/RELOAD do not split a run); :func:`posting_batches` derives those runs and the
executor posts exactly them. NCCL runs a rank's batches in order on one stream (or, with one
communicator per rank pair, in order per pair), a large send completes only while the matching
receive's batch is running on the peer, and sends and receives between two ranks are matched by
order, not by tag; a compute that needs a received tensor waits for the whole batch that carries
it (one work per batch). A receive posted just before the compute that needs it, in a batch of its
own order, can therefore close a cycle (interleaved 1F1B, p=2, m=4: each rank's first batch
sends what the other receives in its second batch).

Both orders built here number the compute actions of all ranks with *as-soon-as-possible times*
``T``: the end of the compute on a clock where the rank's computes run one after the other and a
compute starts once the compute on the neighbouring rank that produces its input has ended and
the transfer has taken ``hop``: ``T = max(T(previous compute), T(producer) + hop) + duration``.
Every transfer gets the label ``L = T(producer)``. On the sending rank the send goes right after
its producer; on the receiving rank the receive goes right after the rank's last compute with
``T <= L`` (the last one that ends, on that clock, before the send is posted), so before its
consumer, whose ``T`` is larger than ``L``. Within the run between two computes the transfers are
ordered by a *key* that starts with ``L``, the same key on both ends, so every rank pair posts its
sends and the matching receives in the same order (what NCCL's order matching needs).

* ``early_receives=False``, the order Megatron's blocking exchanges post (the timeline prices
  plain 1F1B and interleaved 1F1B without --overlap-p2p-communication on it): unit durations and
  ``hop = 0``, key ``(L, direction, microbatch, sending stage)``. In the busy steady state the
  producer ends exactly when the consumer's predecessor does, so the receive lands in the batch
  right before its consumer and the transfer starts only when that predecessor ends: a compute
  that waits for it waits a hop, once per microbatch-chunk.
* ``early_receives=True`` (:data:`EARLY`, what the builder's lists and the runtime post): forward
  2, backward 4 and ``hop = 1`` (:data:`EARLY_TIMES`), key ``(L, T(consumer), direction,
  microbatch, sending stage)``. The clock now has the hop in it, so in the steady state the
  consumer's predecessor ends a hop after the producer, and the receive is posted one compute
  earlier, with the send of the compute before (as Megatron's --overlap-p2p-communication
  schedule posts the receive of the next forward with the current send): a hop shorter than the
  compute between hides behind it. A receive posted that early can share a run with the receive
  the next compute needs, and that compute would wait for both; so, walking a rank's runs in
  order, when the compute after a run needs a receive of the run, the receives whose keys are
  larger than every key that stays (the needed receives and the sends) move to the next run. A
  receive never moves past its consumer (in the run right before it, it is needed).

Why neither order can deadlock (under either communicator mapping). Keys increase from batch to
batch along every rank's posting order: every key of a batch is smaller than every key of a later
batch. Before any move, the run between computes ``i`` and ``i + 1`` holds labels in
``[T_i, T_{i+1})`` (its sends ``T_i``, its receives ``T_i <= L < T_{i+1}``); a move takes keys
above every key that stays in the run to the next run, whose own labels are ``>= T_{i+1}``, larger
than the label of any receive placed at or before run ``i``. Suppose some transfer never completes
and take the one, ``o``, with the smallest key ``t``. Every batch posted before ``o``'s on its
rank holds only keys ``< t``, so it completes, and so does every compute before ``o``'s batch (it
waits for earlier computes and for batches before it). So ``o``'s batch starts, whichever stream
it is on. On the peer, the batch holding the matching transfer (key ``t`` too) starts by the same
argument, so ``o`` completes: a contradiction. So every transfer completes and every compute
runs. The argument uses only the per-rank orders, so it holds for any compute durations; the
clock above only decides how early a receive is posted.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Sequence

from h3t_ext.schedule.actions import (COMM_KINDS, COMPUTE_KINDS, S_B, S_F, S_RB, S_RF, S_SB, S_SF, Action,
                                      ScheduleConfig, action_step, step_action)


@dataclass(frozen=True)
class PostingTimes:
    """The clock of :func:`asap_times` (integers, so the labels compare exactly)."""

    forward: int
    backward: int
    hop: int


AT_LABEL_TIMES = PostingTimes(forward=1, backward=1, hop=0)
"""Unit computes, no hop: the order of Megatron's blocking exchanges (``early_receives=False``)."""

EARLY_TIMES = PostingTimes(forward=2, backward=4, hop=1)
"""A forward 2, a backward 4 (Megatron's chunks: the backward takes about twice the forward) and a
transfer half a forward. Any hop > 0 posts the steady state's receives one compute early; half a
forward keeps the warm-up and cool-down receives (whose producers are late) in the batch right
before their consumers: with uniform durations and a real hop below a chunk's compute, the timeline
of these lists exposes only the fill and drain hops ``2 (p v - 1) hop`` (tests/unit/test_posting.py),
and the lists of the default group size are never slower than the unit-clock order's."""

EARLY = True
"""The order the builder's lists (and so the runtime) post."""


def _positions(v: int, m: int, compute: Sequence[Sequence[tuple]]) -> tuple[list[list[int]], list[list[int]]]:
    """(forward, backward) position of each microbatch-chunk ``mb * v + chunk`` in every rank's compute steps."""
    fpos, bpos = [], []
    for row in compute:
        f, b = [-1] * (m * v), [-1] * (m * v)
        for i, s in enumerate(row):
            (f if s[0] == S_F else b)[s[1] * v + s[2]] = i
        fpos.append(f)
        bpos.append(b)
    return fpos, bpos


def _asap(cfg: ScheduleConfig, compute: Sequence[Sequence[tuple]], times: PostingTimes, fpos, bpos) -> list[list[int]]:
    """:func:`asap_times` on compute steps, with their positions (:func:`_positions`)."""
    p, v = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size
    out: list[list[int]] = [[-1] * len(c) for c in compute]
    # per rank, step code and chunk: the compute on another stage whose output it needs, as (that rank's times,
    # its positions, its chunk), or None (the first stage's forward, the last stage's backward)
    producers = []
    for r in range(p):
        prod: list = [None] * (max(S_F, S_B) + 1)
        prod[S_F] = [(out[(s - 1) % p], fpos[(s - 1) % p], (s - 1) // p) if s > 0 else None
                     for s in range(r, p * v, p)]
        prod[S_B] = [(out[(s + 1) % p], bpos[(s + 1) % p], (s + 1) // p) if s < p * v - 1 else None
                     for s in range(r, p * v, p)]
        producers.append(prod)
    dur = [0] * (max(S_F, S_B) + 1)  # per step code
    dur[S_F], dur[S_B] = times.forward, times.backward
    hop = times.hop
    nxt = [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            row, o, prod, i, n = compute[r], out[r], producers[r], nxt[r], len(compute[r])
            t = o[i - 1] if i else 0
            start = i
            while i < n:
                code, mb, chunk, _, _ = row[i]
                q = prod[code][chunk]
                if q is not None:
                    tp = q[0][q[1][mb * v + q[2]]]
                    if tp < 0:
                        break
                    if tp + hop > t:
                        t = tp + hop
                t += dur[code]
                o[i] = t
                i += 1
            if i != start:
                nxt[r] = i
                progress = True
    if any(nxt[r] < len(compute[r]) for r in range(p)):  # pragma: no cover - Megatron's orders are acyclic
        raise AssertionError(f"compute orders wait on each other in a cycle: stuck at {nxt}")
    return out


def asap_times(cfg: ScheduleConfig, compute: Sequence[Sequence[Action]],
               times: PostingTimes = AT_LABEL_TIMES) -> list[list[int]]:
    """As-soon-as-possible end times of every rank's compute actions on the clock ``times`` (see the
    module docstring)."""
    steps = [[action_step(a) for a in c] for c in compute]
    return _asap(cfg, steps, times, *_positions(cfg.virtual_pipeline_model_parallel_size, cfg.num_microbatches, steps))


def place_steps(cfg: ScheduleConfig, compute: Sequence[Sequence[tuple]], *,
                early_receives: bool = EARLY) -> list[list[tuple]]:
    """:func:`place_comms` on steps (``actions.step_action``): what the builder runs."""
    return placed_steps(cfg, compute, early_receives)[0]


def placed_steps(cfg: ScheduleConfig, compute: Sequence[Sequence[tuple]],
                 early_receives: bool) -> tuple[list[list[tuple]], list[list[int]]]:
    """(:func:`place_steps`, the index of every rank's compute steps in its list)."""
    p, v, m = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size, cfg.num_microbatches
    pv = p * v
    fpos, bpos = _positions(v, m, compute)
    times = _asap(cfg, compute, EARLY_TIMES if early_receives else AT_LABEL_TIMES, fpos, bpos)
    # A transfer's key is the tuple of the module docstring as one even integer (mixed radix: the same order, one
    # object less); key // unit is its label L. Run g of a rank (the transfers between its computes g - 1 and g)
    # holds the labels from T(compute g - 1) up to below T(compute g), so the rank's transfers sorted by key are
    # sorted by run, and its list is all its steps sorted by key once every compute has an odd key: right below its
    # T (after its whole run) or, when it needs a receive of its run (early receives), right above that receive and
    # the run's send (the one after compute g - 1), the receives above them moving on to the next run.
    radix = 1 + max((t[-1] for t in times if t), default=0)  # above every T
    wide = 4 * m * pv  # above 2 x (direction, microbatch, sending stage)
    unit = wide * radix if early_receives else wide
    keyed: list[dict] = [{} for _ in range(p)]  # per rank: key -> step
    in_key = [[-1] * len(c) for c in compute]  # per rank and compute: key of the receive it consumes (-1: none)
    out_key = [[-1] * len(c) for c in compute]  # per rank and compute: key of the send after it (-1: none)
    for r, row in enumerate(compute):
        # per step code and chunk: where its output goes, or None (the last stage's forward, the first's backward)
        route: list = [None] * (max(S_F, S_B) + 1)
        for code, direction, send, recv, pos in ((S_F, 0, S_SF, S_RF, fpos), (S_B, 1, S_SB, S_RB, bpos)):
            route[code] = []
            for stage in range(r, pv, p):
                dst_stage = stage + 1 - 2 * direction
                dst = dst_stage % p
                route[code].append((dst, dst_stage // p, pos[dst], times[dst], keyed[dst], in_key[dst], send, recv,
                                    2 * (direction * m * pv + stage)) if 0 <= dst_stage < pv else None)
        tr, kr, sent = times[r], keyed[r], out_key[r]
        for i, (code, mb, c, _, _) in enumerate(row):
            rt = route[code][c]
            if rt is None:
                continue
            dst, dst_chunk, pos, td, kd, needs, send, recv, tid = rt
            consumer = pos[mb * v + dst_chunk]
            # 2 (((L radix + T(consumer)) 2 + direction) m + microbatch) p v + 2 sending stage (L alone: blocking)
            key = ((tr[i] * radix + td[consumer]) * wide if early_receives else tr[i] * wide) + tid + mb * 2 * pv
            kr[key] = (send, mb, c, dst, None)
            kd[key] = (recv, mb, dst_chunk, r, None)
            sent[i] = key
            needs[consumer] = key
    out, at = [], []
    for r, row in enumerate(compute):
        tr, needs, sent = times[r], in_key[r], out_key[r]
        ckeys = []
        ck = -1  # the key of the compute before
        for g in range(len(row)):
            k = needs[g]
            if early_receives and k > ck:  # a receive of its run (not placed before compute g - 1)
                s = sent[g - 1] if g else -1
                ck = (k if k > s else s) + 1
            else:
                ck = tr[g] * unit - 1
            ckeys.append(ck)
        kr = keyed[r]
        kr.update(zip(ckeys, row))
        keys = sorted(kr)
        out.append(list(map(kr.__getitem__, keys)))
        at.append(list(map(bisect.bisect_left, itertools.repeat(keys), ckeys)))
    return out, at


def place_comms(cfg: ScheduleConfig, compute: Sequence[Sequence[Action]], *,
                early_receives: bool = EARLY) -> list[list[Action]]:
    """Every rank's compute actions with its sends and receives placed in a deadlock-free order (module
    docstring): ``early_receives`` the builder's, else the order of Megatron's blocking exchanges."""
    steps = place_steps(cfg, [[action_step(a) for a in c] for c in compute], early_receives=early_receives)
    return [[step_action(s) for s in row] for row in steps]


def posting_batches(actions: Sequence[Action]) -> list[tuple[Action, ...]]:
    """The batches a rank posts: maximal runs of send/receive actions not split by a compute."""
    batches: list[tuple[Action, ...]] = []
    run: list[Action] = []
    for a in actions:
        if a.kind in COMM_KINDS:
            run.append(a)
        elif a.kind in COMPUTE_KINDS and run:
            batches.append(tuple(run))
            run = []
    if run:
        batches.append(tuple(run))
    return batches


__all__ = ["AT_LABEL_TIMES", "EARLY", "EARLY_TIMES", "PostingTimes", "asap_times", "place_comms", "place_steps",
           "placed_steps", "posting_batches"]
