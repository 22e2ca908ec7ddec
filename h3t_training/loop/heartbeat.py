"""Who is still alive: per-rank heartbeats in the job's key-value store, and a watchdog.

Every rank runs one daemon thread that, every ``interval_s``, bumps its own counter in the
launcher's TCP store (the one ``init_process_group`` rendezvoused through; a client of its own,
whose requests time out after ``stale_after_s`` as a peer's silence does: a store that cannot answer one
request in that long is gone, while a short timeout failed the connection itself when dozens of ranks
share a few busy cores) and reads its two ring neighbours' (ranks r-1 and r+1: every rank is
watched by two others, and the store sees O(world size) requests per interval, not its square).
A counter that has not moved for
``stale_after_s`` (half of ``--distributed-timeout-minutes``) by this rank's own clock means that
rank is frozen (e.g. SIGSTOP) or unreachable: the watchdog prints one line naming it and ends this
process, before the collective it is stuck in times out with a traceback. The thread keeps
running while the main thread waits inside gloo or NCCL, so a busy rank (long GEMMs) is never
mistaken for a frozen one. A store that stops answering is reported as such (its host is the
launcher, or rank 0 for a plain ``python`` start).
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from typing import Callable, Optional

KEY = "h3t_heartbeat/{rank}"
EXIT_STATUS = 3
"""Exit status of a rank that stops because a peer is frozen (distinct from a flag error's 2)."""


class Heartbeat:
    """This rank's heartbeat and watchdog (see module doc)."""

    def __init__(self, rank: int, world_size: int, *, stale_after_s: float, interval_s: float = 1.0,
                 store=None, on_stale: Optional[Callable[[str], None]] = None):
        assert world_size > 1 and 0 <= rank < world_size and stale_after_s > interval_s > 0
        self.rank, self.world_size = rank, world_size
        self.stale_after_s, self.interval_s = stale_after_s, interval_s
        self.store = store if store is not None else _client_store(timeout_s=stale_after_s)
        self.on_stale = on_stale or _stop_process
        self._beats = 0
        watched = {(rank - 1) % world_size, (rank + 1) % world_size} - {rank}
        self._seen = {r: (None, time.monotonic()) for r in sorted(watched)}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="h3t-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.interval_s + 5)

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(KEY.format(rank=self.rank), str(self._beats))

    def check(self) -> Optional[str]:
        """One heartbeat and one look at the others; the verdict line when a peer went quiet."""
        try:
            self._beat()
            now = time.monotonic()
            for r, (last, since) in list(self._seen.items()):
                key = KEY.format(rank=r)
                value = self.store.get(key) if self.store.check([key]) else None
                if value != last:
                    self._seen[r] = (value, now)
                elif now - since > self.stale_after_s:
                    state = "never started" if last is None else "stopped responding"
                    return (f"rank {self.rank}: rank {r} {state} {now - since:.0f}s ago (frozen, stopped or "
                            f"unreachable); ending the run")
        except Exception as e:  # the store itself is gone or frozen
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return f"rank {self.rank}: the job's store stopped answering ({first}); ending the run"
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            verdict = self.check()
            if verdict is not None and not self._stop.is_set():
                self.on_stale(verdict)
                return


def _client_store(timeout_s: float):
    import torch.distributed as dist

    from h3t_training.loop.initialize import attempt_store

    timeout = datetime.timedelta(seconds=timeout_s)
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timeout, wait_for_workers=False)
    return attempt_store(timeout, client)  # this start's keys only (a restarted group's peers start afresh)


def _stop_process(verdict: str) -> None:
    sys.stderr.write(f"{os.path.basename(sys.argv[0]) or 'pretrain'}: error: {verdict}\n")
    sys.stderr.flush()
    os._exit(EXIT_STATUS)


def start_heartbeat(distributed_timeout_minutes: float) -> Optional[Heartbeat]:
    """This rank's heartbeat when the job has several ranks (None for one)."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return None
    stale = max(10.0, distributed_timeout_minutes * 60 / 2)
    return Heartbeat(dist.get_rank(), dist.get_world_size(), stale_after_s=stale).start()


__all__ = ["EXIT_STATUS", "Heartbeat", "start_heartbeat"]
