"""The schedule builder, the posting order and the timeline's compile step as they were before they ran on
integer steps (commit 0b4048e), kept as a test oracle: the library's action lists and timeline programs must
stay equal to these element for element (tests/unit/test_schedule_oracle.py; the programs in the timeline's
present form, :func:`timeline_program`). Not library code."""
from __future__ import annotations

from typing import NamedTuple, Sequence

from h3t_ext.costmodel.timeline import _Program
from h3t_ext.schedule.actions import COMM_KINDS, Action, ActionKind, ScheduleConfig
from h3t_ext.schedule.posting import AT_LABEL_TIMES, EARLY_TIMES, PostingTimes

_F, _B = ActionKind.FORWARD, ActionKind.BACKWARD
_SENDS = (ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD)


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


def _compute_order(cfg: ScheduleConfig, rank: int) -> list[Action]:
    """Forward/backward actions of one rank in Megatron's order."""
    v = cfg.virtual_pipeline_model_parallel_size
    table = schedule_table(cfg.num_microbatches, v, cfg.group_size)
    fwd = [Action(ActionKind.FORWARD, mb, c) for mb, c in table]
    if cfg.forward_only:
        return fwd
    bwd = [Action(ActionKind.BACKWARD, mb, v - 1 - c) for mb, c in table]
    warm = _num_warmup(cfg, rank)
    order = fwd[:warm]
    for k in range(len(fwd) - warm):
        order.append(fwd[warm + k])
        order.append(bwd[k])
    order.extend(bwd[len(fwd) - warm:])
    return order


def _with_offload(compute: list[Action], actions: list[Action]) -> list[Action]:
    """Insert OFFLOAD after each forward and RELOAD before the compute preceding its backward."""
    pos = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(compute)}
    offload_after: set[Action] = set()
    reload_before: dict[Action, Action] = {}
    for i, a in enumerate(compute):
        if a.kind is not ActionKind.FORWARD:
            continue
        j = pos.get((ActionKind.BACKWARD, a.microbatch, a.chunk))
        if j is None or j - i - 1 < 2:
            continue
        offload_after.add(a)
        reload_before[compute[j - 1]] = Action(ActionKind.RELOAD, a.microbatch, a.chunk)
    out: list[Action] = []
    for a in actions:
        if a in reload_before:
            # The reload goes before the batch of transfers posted ahead of this compute action,
            # so the copy is in flight while the rank waits for its input.
            k = len(out)
            while k > 0 and out[k - 1].kind in COMM_KINDS:
                k -= 1
            out.insert(k, reload_before[a])
        out.append(a)
        if a in offload_after:
            out.append(Action(ActionKind.OFFLOAD, a.microbatch, a.chunk))
    return out


def _with_layer_offload(actions: list[Action], layers: int) -> list[Action]:
    """Layer-granular offload (pipeline size 1): OFFLOAD of layers 0..layers-1 inside each forward, their
    RELOAD from the last to the first inside each backward."""
    out: list[Action] = []
    for a in actions:
        out.append(a)
        if a.kind is ActionKind.FORWARD:
            out.extend(Action(ActionKind.OFFLOAD, a.microbatch, a.chunk, layer=l) for l in range(layers))
        elif a.kind is ActionKind.BACKWARD:
            out.extend(Action(ActionKind.RELOAD, a.microbatch, a.chunk, layer=l) for l in reversed(range(layers)))
    return out


def _rank_list(cfg: ScheduleConfig, rank: int, compute: list[Action], placed: list[Action]) -> list[Action]:
    if not cfg.rank_offloads(rank):
        return placed
    if cfg.layer_granular:
        layers = cfg.rank_offloaded_layers(rank)
        return _with_layer_offload(placed, layers) if layers else placed
    return _with_offload(compute, placed)


def rank_actions(cfg: ScheduleConfig, early_receives: bool = True) -> tuple[tuple[Action, ...], ...]:
    """Every rank's action list (the old ``_all_rank_actions``, without its caches)."""
    import dataclasses
    shape = dataclasses.replace(cfg, offload=False, offload_stages=None, offload_alphas=None, num_layers_per_chunk=None)
    p = cfg.pipeline_model_parallel_size
    compute = tuple(_compute_order(shape, r) for r in range(p))
    lists = place_comms(shape, compute, early_receives=early_receives)
    return tuple(tuple(_rank_list(cfg, r, compute[r], lists[r])) for r in range(p))


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


def asap_times(cfg: ScheduleConfig, compute: Sequence[Sequence[Action]],
               times: PostingTimes = AT_LABEL_TIMES) -> list[list[int]]:
    """As-soon-as-possible end times of every rank's compute actions on the clock ``times`` (see the
    module docstring)."""
    p = cfg.pipeline_model_parallel_size
    index = [{a: i for i, a in enumerate(c)} for c in compute]
    out: list[list[int]] = [[-1] * len(c) for c in compute]
    nxt = [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while nxt[r] < len(compute[r]):
                i, a = nxt[r], compute[r][nxt[r]]
                t = out[r][i - 1] if i else 0
                prod = _producer(cfg, r, a)
                if prod is not None:
                    tp = out[prod[0]][index[prod[0]][prod[1]]]
                    if tp < 0:
                        break
                    t = max(t, tp + times.hop)
                out[r][i] = t + (times.forward if a.kind is ActionKind.FORWARD else times.backward)
                nxt[r] += 1
                progress = True
    if any(nxt[r] < len(compute[r]) for r in range(p)):  # pragma: no cover - Megatron's orders are acyclic
        raise AssertionError(f"compute orders wait on each other in a cycle: stuck at {nxt}")
    return out


def place_comms(cfg: ScheduleConfig, compute: Sequence[Sequence[Action]], *,
                early_receives: bool = True) -> list[list[Action]]:
    """Every rank's compute actions with its sends and receives placed in a deadlock-free order (module
    docstring): ``early_receives`` the builder's, else the order of Megatron's blocking exchanges."""
    p, v = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size
    last_stage = p * v - 1
    times = asap_times(cfg, compute, EARLY_TIMES if early_receives else AT_LABEL_TIMES)
    index = [{a: i for i, a in enumerate(c)} for c in compute]
    # gaps[r][i]: (key, action, index of the consuming compute or -1 for a send) of the transfers posted
    # right after compute i (gap -1: before all)
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
            consumer = index[dst][Action(a.kind, a.microbatch, dst_stage // p)]
            key = ((label, times[dst][consumer], 0 if fwd else 1, a.microbatch, stage) if early_receives
                   else (label, 0 if fwd else 1, a.microbatch, stage))
            send = Action(ActionKind.SEND_FORWARD if fwd else ActionKind.SEND_BACKWARD, a.microbatch, a.chunk, dst)
            recv = Action(ActionKind.RECV_FORWARD if fwd else ActionKind.RECV_BACKWARD, a.microbatch,
                          dst_stage // p, r)
            gaps[r].setdefault(i, []).append((key, send, -1))
            gaps[dst].setdefault(gap_of(dst, label), []).append((key, recv, consumer))
    out = []
    for r in range(p):
        acts: list[Action] = []
        moved: list = []
        for g in range(-1, len(compute[r])):
            if g >= 0:
                acts.append(compute[r][g])
            run = sorted(moved + gaps[r].get(g, []), key=lambda e: e[0])
            moved = []
            if early_receives and any(c == g + 1 for _, _, c in run):
                top = max(k for k, _, c in run if c in (-1, g + 1))  # the needed receives and the sends stay
                moved = [e for e in run if e[0] > top]
                run = [e for e in run if e[0] <= top]
            acts.extend(a for _, a, _ in run)
        out.append(acts)
    return out


def _stage(cfg: ScheduleConfig, rank: int, a: Action) -> int:
    return a.chunk * cfg.pipeline_model_parallel_size + rank


def _transfer_key(cfg: ScheduleConfig, rank: int, a: Action) -> tuple:
    """The same key on both ends: (direction, microbatch, receiving stage)."""
    s = _stage(cfg, rank, a)
    if a.kind is ActionKind.SEND_FORWARD:
        return (0, a.microbatch, s + 1)
    if a.kind is ActionKind.SEND_BACKWARD:
        return (1, a.microbatch, s - 1)
    return (0 if a.kind is ActionKind.RECV_FORWARD else 1, a.microbatch, s)


class RankProgram(NamedTuple):
    """One rank's list as the timeline read it at commit 0b4048e."""

    items: tuple
    """("C", is_forward, chunk, input_batch, previous_batch, copy_key, layer_stall) | ("T", batch) | ("O", key)
    | ("R", key)."""
    batches: tuple
    """Per batch: tuple of (peer rank, peer's batch index) of its transfers."""


def compile_lists(cfg: ScheduleConfig, lists: Sequence[Sequence[Action]]) -> tuple[RankProgram, ...]:
    """The builder's lists of ``cfg`` (posted with ``early_receives`` or not) as per-rank programs: batches
    numbered, every transfer tied to the peer's batch, every compute tied to the batch carrying its input and
    to the batch just before it."""
    p, v = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size
    where: dict[tuple, tuple[int, int]] = {}  # (transfer key, is_send) -> (rank, batch index)
    raw = []
    for r, actions in enumerate(lists):
        items: list = []
        batches: list[list[tuple]] = []
        recv_batch: dict[tuple, int] = {}
        open_run = False
        for a in actions:
            k = a.kind
            if k in COMM_KINDS:
                if not open_run:
                    batches.append([])
                    items.append(("T", len(batches) - 1))
                    open_run = True
                key = _transfer_key(cfg, r, a)
                send = k in _SENDS
                batches[-1].append((key, send))
                where[(key, send)] = (r, len(batches) - 1)
                if not send:
                    recv_batch[key] = len(batches) - 1
            elif k is _F or k is _B:
                open_run = False
                s = _stage(cfg, r, a)
                needs_input = s > 0 if k is _F else s < p * v - 1
                key = (0 if k is _F else 1, a.microbatch, s)
                inp = recv_batch[key] if needs_input else -1
                prev = len(batches) - 1 if items and items[-1][0] == "T" else -1
                items.append(["C", k is _F, a.chunk, inp, prev, a.microbatch * v + a.chunk])
            elif a.layer is not None:  # runs inside the compute action before it (layer-granular, p = 1)
                c = items[-1]
                if k is ActionKind.RELOAD and len(c) == 6:
                    items[-1] = c + [True]  # this backward waits for its layers' reloads
            elif k is ActionKind.OFFLOAD:
                items.append(("O", a.microbatch * v + a.chunk))
            elif k is ActionKind.RELOAD:
                items.append(("R", a.microbatch * v + a.chunk))
            else:  # pragma: no cover - the builder emits nothing else
                raise AssertionError(f"no price for action {a}")
        raw.append((items, batches))
    out = []
    for r, (items, batches) in enumerate(raw):
        # a compute waits for the batch posted right before it (blocking mode) only if it directly precedes
        last = -1
        fixed = []
        for it in items:
            if it[0] == "T":
                last = it[1]
                fixed.append(it)
            elif it[0] == "C":
                fixed.append(("C", it[1], it[2], it[3], last if it[4] >= 0 else -1, it[5], len(it) > 6))
            else:
                fixed.append(it)
        peers = tuple(tuple(where[(key, not send)] for key, send in b) for b in batches)
        out.append(RankProgram(tuple(fixed), peers))
    return tuple(out)


def timeline_program(cfg: ScheduleConfig, programs: Sequence[RankProgram], early_receives: bool) -> _Program:
    """:func:`compile_lists`'s programs in the form ``timeline._compile`` makes them (its docstring; nothing merged),
    each batch's peers sorted (:func:`canonical`)."""
    p, v, m = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size, cfg.num_microbatches
    first = [sum(len(pr.batches) for pr in programs[:r]) for r in range(p)]  # number of each rank's first batch
    ranks, batches = [], []
    for r, pr in enumerate(programs):
        for b, peers in enumerate(pr.batches):
            batches.append([first[r] + b] + sorted(first[pr_] + pb for pr_, pb in peers))
        records: list[tuple] = []
        run = [-1, -1, -1]  # batch, offload, reload of the steps since the last compute
        reloaded = set()
        for it in pr.items:
            if it[0] == "T":
                run[0] = first[r] + it[1]
            elif it[0] == "O":
                run[1] = r * m * v + it[1]
            elif it[0] == "R":
                run[2] = r * m * v + it[1]
                reloaded.add(it[1])
            else:
                _, forward, chunk, inp, prev, key, layers = it
                wait = prev if not early_receives and prev >= 0 else inp
                records.append((*run, (2 * r + (not forward)) * v + chunk, first[r] + wait if wait >= 0 else -1,
                                r * m * v + key if not forward and key in reloaded else -1, layers, -1))
                run = [-1, -1, -1]
        records.append((*run, -1, -1, -1, False, -1))
        ranks.append(tuple(records))
    return _Program(tuple(ranks), tuple(batches))


def canonical(program: _Program) -> _Program:
    """``program`` with every batch's peers sorted (the timeline lists them in the order it meets them)."""
    return _Program(program.ranks, tuple([b[0]] + sorted(b[1:]) for b in program.batches))
