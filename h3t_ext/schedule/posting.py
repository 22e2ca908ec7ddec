"""Where the sends and receives go in the action lists: a posting order that cannot deadlock
under NCCL's point-to-point semantics (pure; no torch).

The runtime posts the comm actions of a rank in *batches*: every maximal run of
send/receive actions with no FORWARD/BACKWARD between them is one ``batch_isend_irecv``
(OFFLOAD/RELOAD do not split a run); :func:`posting_batches` derives those runs and the
executor posts exactly them. NCCL runs a rank's batches in order on one stream (or, with one
communicator per rank pair, in order per pair), a large send completes only while the matching
receive's batch is running on the peer, and sends and receives between two ranks are matched by
order, not by tag. A receive posted just before the compute that needs it, in a batch of its
own order, can therefore close a cycle (interleaved 1F1B, p=2, m=4: each rank's first batch
sends what the other receives in its second batch).

The order built here: number the compute actions of all ranks with *as-soon-as-possible unit
times* ``T``: ``T`` of a rank's compute is one more than the larger of the rank's previous
compute's ``T`` and the ``T`` of the compute on the neighbouring rank that produces its input.
Every transfer gets the label ``L = T(producer)``. On the sending rank the send goes right
after its producer; on the receiving rank the receive goes right after the rank's last
compute with ``T <= L`` (so before its consumer, whose ``T`` is larger than ``L``). Within the
run between two computes the transfers are ordered by ``(L, direction, microbatch, sending
stage)``, the same key on both ends, so every rank pair posts its sends and the matching
receives in the same order (what NCCL's order matching needs).

Why this cannot deadlock (under either communicator mapping). On every rank, labels never
decrease along the posting order and differ between runs (a run lies between two computes
with times ``T_i <= L < T_{i+1}``); a compute's receives all sit in earlier runs, with labels
smaller than any label of a later run. Suppose some transfer never completes and take one,
``o``, with the smallest label ``t``, in the earliest stuck run on its rank ``r``. Take the
first item (batch or compute) of ``r``'s posting order (of ``o``'s stream, per-pair mapping)
that never completes. A compute only waits for earlier computes and for receives in earlier
runs, whose labels are ``< t`` and which therefore complete; so the first stuck item is a batch,
and it is ``o``'s: an earlier batch on the stream would hold a stuck transfer with a label
``< t``. Everything before ``o``'s batch completes, so that batch starts. ``o`` then waits only
for the peer's batch ``B'`` holding the matching transfer (label ``t`` too) to start; for
``B'`` never to start, something before it on the peer never completes, and by the same
argument that is a started batch with a stuck transfer of label ``< t``, which contradicts the
choice of ``t``. So every transfer completes and every compute runs. The argument uses only
the per-rank orders, so it holds for any compute durations.
"""
from __future__ import annotations

from typing import Sequence

from h3t_ext.schedule.actions import COMM_KINDS, COMPUTE_KINDS, Action, ActionKind, ScheduleConfig


def _producer(cfg: ScheduleConfig, rank: int, a: Action) -> tuple[int, Action] | None:
    """(rank, compute action) whose output ``a`` consumes from another stage, or None."""
    p, v = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size
    stage = a.chunk * p + rank
    if a.kind is ActionKind.FORWARD:
        if stage == 0:
            return None
        src = stage - 1
    else:
        if stage == p * v - 1:
            return None
        src = stage + 1
    return src % p, Action(a.kind, a.microbatch, src // p)


def asap_times(cfg: ScheduleConfig, compute: Sequence[Sequence[Action]]) -> list[list[int]]:
    """As-soon-as-possible unit times of every rank's compute actions (see the module docstring)."""
    p = cfg.pipeline_model_parallel_size
    index = [{a: i for i, a in enumerate(c)} for c in compute]
    times: list[list[int]] = [[-1] * len(c) for c in compute]
    nxt = [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while nxt[r] < len(compute[r]):
                i, a = nxt[r], compute[r][nxt[r]]
                t = times[r][i - 1] + 1 if i else 0
                prod = _producer(cfg, r, a)
                if prod is not None:
                    tp = times[prod[0]][index[prod[0]][prod[1]]]
                    if tp < 0:
                        break
                    t = max(t, tp + 1)
                times[r][i] = t
                nxt[r] += 1
                progress = True
    if any(nxt[r] < len(compute[r]) for r in range(p)):  # pragma: no cover - Megatron's orders are acyclic
        raise AssertionError(f"compute orders wait on each other in a cycle: stuck at {nxt}")
    return times


def place_comms(cfg: ScheduleConfig, compute: Sequence[Sequence[Action]]) -> list[list[Action]]:
    """Every rank's compute actions with its sends and receives placed in the deadlock-free order."""
    p, v = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size
    last_stage = p * v - 1
    times = asap_times(cfg, compute)
    # gaps[r][i]: (sort key, action) of the transfers posted right after compute i (gap -1: before all)
    gaps: list[dict[int, list]] = [{} for _ in range(p)]

    def gap_of(r: int, label: int) -> int:
        ts = times[r]
        lo, hi = 0, len(ts)  # index of the last compute with T <= label, -1 if none
        while lo < hi:
            mid = (lo + hi) // 2
            if ts[mid] <= label:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    for r in range(p):
        for i, a in enumerate(compute[r]):
            stage = a.chunk * p + r
            fwd = a.kind is ActionKind.FORWARD
            if (fwd and stage == last_stage) or (not fwd and stage == 0):
                continue
            dst_stage = stage + 1 if fwd else stage - 1
            dst = dst_stage % p
            label = times[r][i]
            key = (label, 0 if fwd else 1, a.microbatch, stage)
            send = Action(ActionKind.SEND_FORWARD if fwd else ActionKind.SEND_BACKWARD, a.microbatch, a.chunk, dst)
            recv = Action(ActionKind.RECV_FORWARD if fwd else ActionKind.RECV_BACKWARD, a.microbatch,
                          dst_stage // p, r)
            gaps[r].setdefault(i, []).append((key, send))
            gaps[dst].setdefault(gap_of(dst, label), []).append((key, recv))
    out = []
    for r in range(p):
        acts: list[Action] = [a for _, a in sorted(gaps[r].get(-1, []), key=lambda e: e[0])]
        for i, a in enumerate(compute[r]):
            acts.append(a)
            acts.extend(c for _, c in sorted(gaps[r].get(i, []), key=lambda e: e[0]))
        out.append(acts)
    return out


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


__all__ = ["asap_times", "place_comms", "posting_batches"]
