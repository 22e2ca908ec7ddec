"""A run's hold on its processes and its checkpoint directory.

* **Workers die with their launcher.** Under torchrun (or mpirun) every worker asks the kernel for
  SIGKILL when its parent process dies (``prctl(PR_SET_PDEATHSIG)``), so a launcher killed with
  ``kill -9`` leaves no orphan training on and writing checkpoints.
* **One run per checkpoint directory.** Rank 0 holds an exclusive ``flock`` on
  ``--save/.h3t_run.lock`` for the whole run and writes the run's identity into it (run id, host,
  pid, start time). A second run on the same directory is refused in one line naming the first;
  the lock goes away with the process that held it, however it ended.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import socket
import sys
import time
import uuid
from typing import Optional

PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal this process gets when its parent dies (Linux)."""
LOCK_NAME = ".h3t_run.lock"
LAUNCHER_ENV = ("TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
"""Variables that a launcher sets in its workers (torchrun, Open MPI, Slurm's srun)."""


class RunLockError(Exception):
    """Another run holds the checkpoint directory; one line naming it."""


def die_with_launcher() -> bool:
    """Under a launcher, SIGKILL this process when its parent dies. Returns True when armed."""
    if not sys.platform.startswith("linux") or not any(k in os.environ for k in LAUNCHER_ENV):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return True


class RunLock:
    """Rank 0's exclusive hold on ``--save`` for the lifetime of the run (see module doc)."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_NAME)
        self.run_id = uuid.uuid4().hex[:12]
        self._fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunLockError(f"--save {os.path.dirname(self.path)} is in use by another run ({holder}); "
                               f"stop it or save elsewhere") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"run_id": self.run_id, "host": socket.gethostname(), "pid": os.getpid(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"run {info['run_id']}, pid {info['pid']} on {info['host']} since {info['started']}"
    except (OSError, ValueError, KeyError):
        return "holder unknown"


__all__ = ["RunLock", "RunLockError", "die_with_launcher"]
