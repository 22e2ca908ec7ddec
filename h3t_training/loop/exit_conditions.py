"""Megatron's ways to end a run early and cleanly: ``--exit-duration-in-mins`` and ``--exit-signal-handler``.

Both are checked after each iteration and agreed on by every rank (one MAX all-reduce), so all ranks
save the same checkpoint (with ``--save``) and stop at the same iteration, as Megatron-LM does.
"""
from __future__ import annotations

import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from h3t_training.loop.collectives import all_reduce_host


class ExitSignalHandler:
    """Records that ``--exit-signal`` or SIGINT arrived (the run then saves and exits after the iteration; after
    SIGINT the driver ends as interrupted, :mod:`h3t_training.launch.failures`)."""

    def __init__(self, signame: str = "SIGTERM"):
        self.sigs = tuple(dict.fromkeys((getattr(signal, signame), signal.SIGINT)))
        self.received: Optional[int] = None
        """The first signal that arrived (None: none yet)."""
        self._previous: dict = {}

    def __enter__(self) -> "ExitSignalHandler":
        self._previous = {s: signal.signal(s, self._handle) for s in self.sigs}
        return self

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal API
        if self.received is None:
            self.received = signum

    @property
    def interrupted(self) -> bool:
        return self.received == signal.SIGINT

    def __exit__(self, *exc) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)


class ExitConditions:
    """``should_exit()`` after each iteration: True on every rank once any rank's condition holds."""

    def __init__(self, args, start_time: float, handler: Optional[ExitSignalHandler]):
        self.minutes = args.exit_duration_in_mins or None  # 0 sets no limit: Megatron-LM tests the flag's truth
        self.start_time, self.handler = start_time, handler
        self.reason = ""
        self.interrupted = False
        """Every rank stops because some rank got SIGINT (the driver then ends as interrupted)."""

    @property
    def active(self) -> bool:
        return self.minutes is not None or self.handler is not None

    def should_exit(self) -> bool:
        if not self.active:
            return False
        code = 0
        if self.handler is not None and self.handler.received is not None:
            code = 3 if self.handler.interrupted else 2
        elif self.minutes is not None and (time.time() - self.start_time) / 60 > self.minutes:
            code = 1
        flag = all_reduce_host(torch.tensor([code]), op=dist.ReduceOp.MAX)
        self.reason = {0: "", 1: f"--exit-duration-in-mins {self.minutes} reached", 2: "exit signal received",
                       3: "SIGINT received"}[int(flag.item())]
        self.interrupted = int(flag.item()) == 3
        return bool(flag.item())
