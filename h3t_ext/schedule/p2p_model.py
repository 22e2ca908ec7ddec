"""A model of NCCL's point-to-point semantics that decides whether a posting order completes
(pure; no torch).

Gloo buffers sends, so any posting order of matching sends and receives completes on CPU. NCCL
does not, and a posting order that passes every gloo test can hang on a GPU cluster. This module
executes the per-rank posting sequences (batches of sends/receives, and the compute actions
between them with the receives each one needs) under NCCL's rules:

* a rank's batches (``ncclGroupStart/End`` groups) run in posting order on one stream; with
  ``comm="group"`` (one communicator per process group) all of a rank's transfers share that
  stream, with ``comm="pair"`` (one communicator per rank pair) the transfers of a batch to each
  peer form a group on that pair's stream, and only groups of one pair are ordered;
* a group starts when the groups before it on its stream have completed and every compute
  posted before it has finished (the NCCL stream waits for the compute stream at posting);
* a transfer completes once its group has started and the group holding the matching transfer
  has started on the peer (a large send needs the receive running, and vice versa);
  sends from ``a`` to ``b`` are matched with receives at ``b`` from ``a`` by order, not by tag;
* a group completes when all its transfers have; a compute runs after the compute before it and
  after every batch holding a receive it needs (``work.wait()`` waits for the whole batch).

:func:`simulate` returns whether everything completes, and otherwise which ranks are stuck on
which operations; order mismatches (a send that NCCL would pair with another transfer's
receive) are reported too. :func:`programs_from_schedule` turns the builder's action lists into
the posting sequences the runtime executor posts (:func:`h3t_ext.schedule.posting.posting_batches`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence, Union

COMM_MAPPINGS = ("group", "pair")


@dataclass(frozen=True)
class Transfer:
    """One send or receive in a batch."""

    send: bool
    peer: int
    message: Hashable
    """Identifies the transfer; the send and its receive carry the same value."""
    what: str = ""


@dataclass(frozen=True)
class Batch:
    """Transfers posted together (one ``batch_isend_irecv``)."""

    ops: tuple[Transfer, ...]


@dataclass(frozen=True)
class Compute:
    """A compute action and the messages it receives (it waits for their batches)."""

    what: str
    needs: tuple[Hashable, ...] = ()


Item = Union[Batch, Compute]


@dataclass(frozen=True)
class StuckRank:
    rank: int
    pending: tuple[str, ...]
    """Operations of this rank that never complete, each with what it waits for."""


@dataclass(frozen=True)
class ModelResult:
    """Outcome of :func:`simulate`."""

    completed: bool
    stuck: tuple[StuckRank, ...] = ()
    mismatches: tuple[str, ...] = ()
    """Transfers NCCL's order matching would pair with a different transfer."""

    @property
    def ok(self) -> bool:
        return self.completed and not self.mismatches

    def __str__(self) -> str:
        if self.ok:
            return "completes"
        parts = [f"rank {s.rank}: " + ", ".join(s.pending) for s in self.stuck]
        head = "completes" if self.completed else "deadlocks"
        return "; ".join([head] + parts + list(self.mismatches))


@dataclass
class _Group:
    rank: int
    stream: int
    batch: int
    ops: list
    computes_before: int
    started: bool = False
    done: bool = False


def simulate(programs: Sequence[Sequence[Item]], comm: str = "group") -> ModelResult:
    """Execute per-rank posting sequences under NCCL's point-to-point rules (module docstring)."""
    if comm not in COMM_MAPPINGS:
        raise ValueError(f"comm must be one of {COMM_MAPPINGS}, got {comm!r}")
    n = len(programs)
    streams: list[dict[int, list[_Group]]] = [{} for _ in range(n)]
    batch_groups: list[list[list[_Group]]] = [[] for _ in range(n)]
    computes: list[list[tuple[Compute, list]]] = [[] for _ in range(n)]
    op_group: dict[tuple[int, int], _Group] = {}  # (rank, op number) -> group
    sends: dict[tuple[int, int], list] = {}  # (src, dst) -> [(op id, message)] in posting order
    recvs: dict[tuple[int, int], list] = {}
    recv_batch: list[dict] = [{} for _ in range(n)]  # message -> batch index
    ops_info: dict[tuple[int, int], Transfer] = {}
    for r, prog in enumerate(programs):
        opn = 0
        for item in prog:
            if isinstance(item, Compute):
                missing = [m for m in item.needs if m not in recv_batch[r]]
                deps = [recv_batch[r][m] for m in item.needs if m in recv_batch[r]]
                computes[r].append((item, deps if not missing else None))
                continue
            b = len(batch_groups[r])
            groups: dict[int, _Group] = {}
            for t in item.ops:
                key = 0 if comm == "group" else t.peer
                g = groups.get(key)
                if g is None:
                    g = groups[key] = _Group(r, key, b, [], len(computes[r]))
                    streams[r].setdefault(key, []).append(g)
                op_id = (r, opn)
                opn += 1
                g.ops.append(op_id)
                op_group[op_id] = g
                ops_info[op_id] = t
                if t.send:
                    sends.setdefault((r, t.peer), []).append((op_id, t.message))
                else:
                    recvs.setdefault((t.peer, r), []).append((op_id, t.message))
                    recv_batch[r][t.message] = b
            batch_groups[r].append(list(groups.values()))
    partner: dict[tuple[int, int], tuple[int, int]] = {}
    mismatches = []
    for pair in set(sends) | set(recvs):
        s, rv = sends.get(pair, []), recvs.get(pair, [])
        for (so, sm), (ro, rm) in zip(s, rv):
            partner[so], partner[ro] = ro, so
            if sm != rm:
                mismatches.append(f"rank {pair[0]} sends {ops_info[so].what or sm} to rank {pair[1]}, which "
                                  f"receives it as {ops_info[ro].what or rm}")

    def op_done(op) -> bool:
        other = partner.get(op)
        return other is not None and op_group[op].started and op_group[other].started

    heads = [{k: 0 for k in streams[r]} for r in range(n)]
    cptr = [0] * n
    changed = True
    while changed:
        changed = False
        for r in range(n):
            while cptr[r] < len(computes[r]):
                _, deps = computes[r][cptr[r]]
                if deps is None or not all(g.done for b in deps for g in batch_groups[r][b]):
                    break
                cptr[r] += 1
                changed = True
            for key, groups in streams[r].items():
                while heads[r][key] < len(groups):
                    g = groups[heads[r][key]]
                    if not g.started:
                        if cptr[r] < g.computes_before:
                            break
                        g.started = changed = True
                    if not all(op_done(o) for o in g.ops):
                        break
                    g.done = changed = True
                    heads[r][key] += 1
    stuck = []
    for r in range(n):
        pending = []
        for key, groups in streams[r].items():
            if heads[r][key] < len(groups):
                g = groups[heads[r][key]]
                for o in g.ops:
                    if op_done(o):
                        continue
                    t = ops_info[o]
                    desc = f"{'send' if t.send else 'recv'} {t.what or t.message} {'to' if t.send else 'from'} rank " \
                           f"{t.peer} (batch {g.batch}"
                    pending.append(desc + (")" if g.started else ", not started)"))
        if cptr[r] < len(computes[r]):
            c, deps = computes[r][cptr[r]]
            pending.append(f"compute {c.what} waits for " + (
                "a receive posted after it" if deps is None else
                "batch " + ",".join(str(b) for b in deps if not all(g.done for g in batch_groups[r][b]))))
            # (a compute stuck behind completed batches cannot happen: the loop above would run it)
        if pending:
            stuck.append(StuckRank(r, tuple(pending)))
    return ModelResult(not stuck, tuple(stuck), tuple(sorted(mismatches)))


def _message(kind_value: str, microbatch: int, sender_stage: int) -> tuple:
    return ("F" if kind_value in ("F", "SF", "RF") else "B", microbatch, sender_stage)


def programs_from_schedule(schedule) -> list[list[Item]]:
    """The posting sequences the runtime posts for a :class:`~h3t_ext.schedule.builder.PipelineSchedule`
    (or anything with ``config`` and per-rank action lists ``ranks``)."""
    from h3t_ext.schedule.builder import COMM_KINDS, ActionKind as K

    cfg = schedule.config
    p, v = cfg.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size
    last = p * v - 1
    out = []
    for r, actions in enumerate(schedule.ranks):
        prog: list[Item] = []
        run: list[Transfer] = []
        for a in actions:
            stage = a.chunk * p + r
            if a.kind in COMM_KINDS:
                sender = {K.SEND_FORWARD: stage, K.SEND_BACKWARD: stage, K.RECV_FORWARD: stage - 1,
                          K.RECV_BACKWARD: stage + 1}[a.kind]
                run.append(Transfer(a.kind in (K.SEND_FORWARD, K.SEND_BACKWARD), a.peer,
                                    _message(a.kind.value, a.microbatch, sender), str(a) if a.kind.value in "FB"
                                    else f"{a.kind.value}{a.microbatch}.{a.chunk}"))
                continue
            if a.kind not in (K.FORWARD, K.BACKWARD):
                continue
            if run:
                prog.append(Batch(tuple(run)))
                run = []
            fwd = a.kind is K.FORWARD
            needs = ()
            if fwd and stage > 0:
                needs = (_message("F", a.microbatch, stage - 1),)
            elif not fwd and stage < last:
                needs = (_message("B", a.microbatch, stage + 1),)
            prog.append(Compute(f"{a.kind.value}{a.microbatch}.{a.chunk}", needs))
        if run:
            prog.append(Batch(tuple(run)))
        out.append(prog)
    return out


def check_schedule(schedule, comm: str = "group") -> ModelResult:
    """:func:`simulate` on the posting sequences of ``schedule``."""
    return simulate(programs_from_schedule(schedule), comm)


__all__ = ["COMM_MAPPINGS", "Batch", "Compute", "ModelResult", "StuckRank", "Transfer", "check_schedule",
           "programs_from_schedule", "simulate"]
