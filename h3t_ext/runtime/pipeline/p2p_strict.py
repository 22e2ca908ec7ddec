"""NCCL's point-to-point semantics on gloo: strict P2P mode (``H3TConfig(strict_p2p=True)``).

Gloo buffers sends and runs every transfer on its own, so a posting order that deadlocks under
NCCL passes every CPU test. :class:`StrictP2P` executes the batches of
:class:`~h3t_ext.runtime.pipeline.p2p.PipelineP2P` the way NCCL does (the rules modelled in
:mod:`h3t_ext.schedule.p2p_model`):

* A rank's batches run strictly in posting order on one *stream*: all of them for
  ``comm="group"`` (one NCCL communicator per process group), or the part of each batch going to
  one peer on that pair's stream for ``comm="pair"`` (one communicator per rank pair). A group
  starts only when the group before it on its stream has completed.
* A send does not complete before the peer has *started* the group holding the matching
  receive: when a group starts, it posts its data receives and sends the peer a small *ready*
  token per receive (tag 0, which no data transfer uses); a send's data ``isend`` is posted only
  once the peer's token for it has arrived. The token carries the data transfer's tag, so a send
  that NCCL would match (by order, ignoring tags) with another transfer's receive is an error.
* A group completes when all its transfers have; a receive's tensor is handed out only after its
  whole batch completed (NCCL's ``work.wait()`` waits for the group).

Progress is made by the host whenever it waits (and at every posting): all streams are advanced
as far as they go without blocking. Gloo requests only complete inside a blocking ``wait()``
(``is_completed()`` stays False until then, and a timed-out wait breaks the connection), so every
request in flight is waited for by a short-lived watcher thread that flags its completion and
wakes the host; the host never blocks on one request while another stream could move. A wait that
does not finish within ``p2p_timeout_s`` raises :class:`~h3t_ext.runtime.pipeline.errors.P2PTimeoutError`
with one line naming this rank, the peer ranks and every pending operation with what it waits
for; under a deadlock every rank involved reports its side within the timeout.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .errors import P2PTimeoutError

READY_TAG = 0
"""Tag of the ready tokens (data tags from :func:`~h3t_ext.runtime.pipeline.p2p.p2p_tag` start at 1)."""
STRICT_COMM_CHOICES = ("group", "pair")


class P2POrderError(RuntimeError):
    """Sends and receives between two ranks are posted in different orders (NCCL would mix them up)."""


class _Watch:
    """Waits for one gloo request on a daemon thread; ``done()`` without blocking."""

    def __init__(self, work, timeout_s: float, wake: threading.Event):
        self.work, self.error = work, None
        self._done = threading.Event()
        self._wake = wake
        threading.Thread(target=self._run, args=(timeout_s,), daemon=True, name="h3t-strict-p2p").start()

    def _run(self, timeout_s: float) -> None:
        import datetime

        try:
            self.work.wait(datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # reported by result() on the host thread
            self.error = exc
        finally:
            self._done.set()
            self._wake.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, rank: int, what: str) -> None:
        """Raise a failed request's error as one :class:`~h3t_ext.runtime.pipeline.errors.P2PTimeoutError` line."""
        if self.error is not None:
            text = str(self.error).strip()
            first = text.splitlines()[0] if text else type(self.error).__name__
            raise P2PTimeoutError(f"pipeline rank {rank}: {what} failed under strict P2P: {first}") from self.error


@dataclass
class _Op:
    send: bool
    tensor: torch.Tensor
    peer: int
    tag: int
    what: str
    token: Optional[torch.Tensor] = None
    ready: Optional[object] = None
    """Work of the ready token: its receive (sends) or its send (receives)."""
    data: Optional[object] = None

    def done(self) -> bool:
        return self.data is not None and self.data.done() and (self.ready is None or self.ready.done())

    def state(self) -> str:
        if self.send:
            if self.data is None:
                return f"send {self.what} to pipeline rank {self.peer} (waits for its receive to start)"
            return f"send {self.what} to pipeline rank {self.peer} (in flight)"
        return f"recv {self.what} from pipeline rank {self.peer} (waits for its send)"


@dataclass
class _Group:
    batch: int
    ops: list = field(default_factory=list)
    started: bool = False
    done: bool = False


class StrictP2P:
    """Batches of tagged transfers on ``group`` executed with NCCL's ordering (module docstring)."""

    def __init__(self, group, rank: int, comm: str, timeout_s: float):
        if comm not in STRICT_COMM_CHOICES:
            raise ValueError(f"strict_p2p_comm must be one of {{{','.join(STRICT_COMM_CHOICES)}}}, got {comm!r}")
        self.group, self.rank, self.comm, self.timeout_s = group, rank, comm, timeout_s
        self._streams: dict[int, collections.deque] = {}
        self._batches: dict[int, list[_Group]] = {}
        self._next_batch = 0
        self._wake = threading.Event()
        # watcher threads outlive a deadlocked wait by a margin, then give up
        self._watch_s = 2 * timeout_s + 10.0

    def _watch(self, work) -> _Watch:
        return _Watch(work, self._watch_s, self._wake)

    # -- posting ---------------------------------------------------------------------------
    def post(self, ops: list[tuple[bool, torch.Tensor, int, int, str]]) -> int:
        """Queue one batch of ``(is_send, tensor, peer, tag, what)``; returns its batch number."""
        b = self._next_batch
        self._next_batch += 1
        groups: dict[int, _Group] = {}
        for send, tensor, peer, tag, what in ops:
            key = 0 if self.comm == "group" else peer
            g = groups.get(key)
            if g is None:
                g = groups[key] = _Group(b)
                self._streams.setdefault(key, collections.deque()).append(g)
            g.ops.append(_Op(send, tensor, peer, tag, what))
        self._batches[b] = list(groups.values())
        self.progress()
        return b

    # -- progress --------------------------------------------------------------------------
    def _start(self, g: _Group) -> None:
        for op in g.ops:
            if op.send:
                op.token = torch.zeros(1, dtype=torch.int64)
                op.ready = self._watch(dist.irecv(op.token, group=self.group, group_src=op.peer, tag=READY_TAG))
            else:
                op.data = self._watch(dist.irecv(op.tensor, group=self.group, group_src=op.peer, tag=op.tag))
                op.token = torch.tensor([op.tag], dtype=torch.int64)
                op.ready = self._watch(dist.isend(op.token, group=self.group, group_dst=op.peer, tag=READY_TAG))
        g.started = True

    def _advance(self, g: _Group) -> bool:
        """Post the sends whose ready token arrived; True when every transfer of ``g`` completed.

        Sends to one peer are checked in posting order: their tokens are matched by gloo in that
        order, but their watcher threads may flag them in any order, and a later send's token must
        not be judged (or its data posted) before an earlier send's to the same peer."""
        waiting: set[int] = set()  # peers with an earlier send still waiting for its token
        for op in g.ops:
            if not op.send or op.data is not None:
                continue
            if op.peer in waiting or not op.ready.done():
                waiting.add(op.peer)
                continue
            op.ready.result(self.rank, op.what)
            if int(op.token[0]) != op.tag:
                raise P2POrderError(
                    f"pipeline rank {self.rank}: send {op.what} to pipeline rank {op.peer} would be matched "
                    f"with the peer's receive of tag {int(op.token[0])} (tag {op.tag} expected): the two ranks "
                    "post their transfers in different orders, which NCCL matches by order"
                )
            op.data = self._watch(dist.isend(op.tensor, group=self.group, group_dst=op.peer, tag=op.tag))
        return all(op.done() for op in g.ops)

    def progress(self) -> None:
        """Advance every stream as far as it goes without blocking."""
        for queue in self._streams.values():
            while queue:
                g = queue[0]
                if not g.started:
                    self._start(g)
                if not self._advance(g):
                    break
                for op in g.ops:  # completed: raise a failed transfer's error here
                    op.data.result(self.rank, op.what)
                    op.ready.result(self.rank, op.what)
                g.done = True
                queue.popleft()

    # -- waiting ---------------------------------------------------------------------------
    def wait_batch(self, batch: int, what: str) -> None:
        """Block until every transfer of ``batch`` has completed (and with it all batches before
        it on its streams)."""
        self._wait(lambda: all(g.done for g in self._batches[batch]), what)

    def wait_all(self) -> None:
        """Block until every posted batch has completed."""
        self._wait(lambda: not any(self._streams.values()), "the iteration's remaining transfers")
        self._batches.clear()

    def _wait(self, finished, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._wake.clear()  # a completion from here on wakes the wait below
            self.progress()
            if finished():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise P2PTimeoutError(self.describe(what))
            self._wake.wait(left)

    def describe(self, what: str) -> str:
        """One line: this rank, what it waited for, its peers and every pending operation."""
        pending, peers, more = [], set(), 0
        for queue in self._streams.values():
            for k, g in enumerate(queue):
                if k >= 3:
                    more += 1
                    continue
                ops = [op for op in g.ops if not (g.started and op.done())]
                peers.update(op.peer for op in ops)
                state = "running" if g.started else "not started"
                pending.append(f"batch {g.batch} ({state}): " + ", ".join(
                    op.state() if g.started else f"{'send' if op.send else 'recv'} {op.what}" for op in ops))
        if more:
            pending.append(f"{more} later batch(es)")
        return (f"pipeline rank {self.rank}: {what} did not complete within {self.timeout_s:g}s (p2p_timeout_s) "
                f"under strict P2P ({self.comm} communicators); peers {sorted(peers)}; pending: "
                + "; ".join(pending))


__all__ = ["P2POrderError", "READY_TAG", "STRICT_COMM_CHOICES", "StrictP2P"]
