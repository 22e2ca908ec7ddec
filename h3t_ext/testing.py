"""CPU gloo worlds for the tests and benchmarks: run a function in N processes and
collect what each returns.

Usage from a test or a benchmark script::

    results = run_distributed(_worker, world_size=4, args=(cfg,), timeout_s=300)

``_worker(rank, world_size, *args)`` must be a module-level function (it is pickled by name).
The default process group is initialised with gloo on a free localhost port before it runs and
destroyed after. An exception in any rank is re-raised in the caller with that rank's
traceback; a world that does not finish within ``timeout_s`` is killed and reported.

Ranks are started by multiprocessing's forkserver, whose server imports torch, megatron-core and the runtime once
(:data:`PRELOAD`, on a machine without a GPU: see :func:`_context`): each rank is a fork of that server (a tenth of
a second) instead of a fresh interpreter importing them again (about 6 s on 2 cores, per rank and per world). The
server only imports, so every rank starts with no process group, no parallel state and no seed set, as a spawned
one does; like a spawned rank it gets the caller's ``sys.path`` and imports the worker's module by name. Its
environment is the caller's when the first world started.
"""
from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import socket
import traceback
from typing import Any, Callable, Sequence


class DistributedTestError(RuntimeError):
    """A spawned rank failed or the world timed out."""


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, port: int, args: Sequence[Any], out: "mp.Queue",
           pg_timeout_s: float, threads: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # plain bytes: tensors must not travel as shared-memory handles
        out.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, including assertion errors, to the parent
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


PRELOAD = ("torch", "torch.distributed", "megatron.core.parallel_state", "megatron.core.tensor_parallel",
           "megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer",
           "h3t_ext.runtime.pipeline.schedules", "h3t_ext.runtime.modules.gpt")
"""What the forkserver imports before it forks a rank (a module that fails to import is skipped by multiprocessing)."""


def _context():
    """The forkserver context; its server preloads :data:`PRELOAD` only on a machine without a CUDA device: on a GPU
    machine some of those imports initialise CUDA in the server, and CUDA cannot be used again in a process forked
    after that ("Cannot re-initialize CUDA in forked subprocess"), so there every rank imports what it needs itself,
    as a spawned rank does. (``torch.cuda.is_available()`` asks the driver without initialising CUDA.)"""
    import torch

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([] if torch.cuda.is_available() else list(PRELOAD))
    return ctx


def run_distributed(fn: Callable, world_size: int, args: Sequence[Any] = (), *, timeout_s: float = 300.0,
                    pg_timeout_s: float = 120.0, threads: int = 1) -> list[Any]:
    """Spawn ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``; return results by rank."""
    ctx = _context()
    out = ctx.Queue()
    port = free_port()
    procs = [
        # Not daemonic, as torchrun's workers are not: megatron-core's checkpoint writer starts a
        # process of its own. The finally block below joins or kills every rank.
        ctx.Process(target=_entry, args=(fn, r, world_size, port, tuple(args), out, pg_timeout_s, threads),
                    daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
    try:
        while len(results) + len(errors) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                raise DistributedTestError(
                    f"world of {world_size} did not finish in {timeout_s}s; finished ranks: "
                    f"{sorted(results)}, failed ranks: {sorted(errors)}"
                    + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                )
            try:
                rank, ok, payload = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and i not in results and i not in errors]
                if dead:
                    errors.update({i: f"process exited with code {procs[i].exitcode}" for i in dead})
                continue
            if ok:
                import torch

                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors[rank] = payload
            if errors:
                # One rank failed: the others may now block on it; give them a short grace period.
                deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=20))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise DistributedTestError(
            "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        )
    return [results[r] for r in range(world_size)]


def _run_entry(path: str, argv: list, env: dict, cwd: str, out: str, err: str) -> None:
    """In a forked rank: ``python path *argv`` with ``env`` and ``cwd``, stdout and stderr into files, then exit with
    the script's code (as the interpreter would: SystemExit's code, 1 and the traceback for an exception)."""
    import atexit
    import runpy
    import sys
    import warnings

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(name, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)
    if env.get("PYTHONWARNINGS") == "ignore":  # the interpreter reads it at start; this one started long ago
        warnings.simplefilter("ignore")
    if env.get("OMP_NUM_THREADS"):  # OpenMP read it when the server loaded torch
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [path, *argv]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 (what the interpreter does with an uncaught exception)
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _read_output(name: str) -> str:
    """A forked entry's captured stdout or stderr ("" when it never started)."""
    if not os.path.exists(name):
        return ""
    with open(name, encoding="utf-8", errors="replace") as f:
        return f.read()


def run_entry(path: str, argv: Sequence[str], *, env: dict, cwd: str,
              timeout_s: float) -> "subprocess.CompletedProcess[str]":
    """``python path *argv`` run as a fork of the forkserver's server (torch and megatron-core already imported):
    the exit code, stdout and stderr a subprocess would give, without the interpreter start and imports (about 6 s
    on 2 cores). A run past ``timeout_s`` is killed and raises ``subprocess.TimeoutExpired``."""
    import subprocess
    import sys
    import tempfile

    cmd = [sys.executable, path, *argv]
    with tempfile.TemporaryDirectory(prefix="h3t-entry-") as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        proc = _context().Process(target=_run_entry, args=(path, list(argv), dict(env), cwd, out, err),
                                  daemon=False)
        proc.start()
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
            raise subprocess.TimeoutExpired(cmd, timeout_s)

        return subprocess.CompletedProcess(cmd, proc.exitcode, _read_output(out), _read_output(err))


def run_entry_world(path: str, argv: Sequence[str], *, nproc: int, env: dict, cwd: str,
                    timeout_s: float, stop_grace_s: float = 30.0) -> "subprocess.CompletedProcess[str]":
    """``python path *argv`` on ``nproc`` local ranks, each a fork of the forkserver's server (as :func:`run_entry`),
    started as a launcher without an agent store starts them (mpirun, srun): ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and a free ``MASTER_PORT`` in each rank's environment, rank 0
    hosting the store. Like torchrun it stops the others when one rank fails (SIGTERM, SIGKILL after
    ``stop_grace_s``); the exit status is 0 when every rank ends 0, else the status of the rank that failed first
    (torchrun exits 1 and names that status in its report). stdout and stderr are each rank's in rank order. A world past ``timeout_s`` is killed and raises
    ``subprocess.TimeoutExpired``. It saves the launcher's and every rank's interpreter start and imports (about 6 s
    on 2 cores per world); torchrun's own behaviour (restarts, its agent store, its report) is not in it."""
    import subprocess
    import sys
    import tempfile
    import time

    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    cmd = [sys.executable, path, *argv]
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="h3t-world-") as d:
        procs, files = [], []
        for rank in range(nproc):
            rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                            LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            out, err = os.path.join(d, f"{rank}.out"), os.path.join(d, f"{rank}.err")
            files.append((out, err))
            procs.append(_context().Process(target=_run_entry, args=(path, list(argv), rank_env, cwd, out, err),
                                            daemon=False))
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        stop_at, first_failure = None, None
        try:
            while any(p.exitcode is None for p in procs):
                now = time.monotonic()
                if now > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout_s)
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if stop_at is None and failed:
                    first_failure = failed[0]
                    for p in procs:  # one rank failed: the others may wait on it forever
                        if p.exitcode is None:
                            # SIGTERM; terminate() passes over a rank that ended (and was reaped by the
                            # forkserver) since exitcode was read, where os.kill raised ProcessLookupError
                            p.terminate()
                    stop_at = now + stop_grace_s
                if stop_at is not None and now > stop_at:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
                p.join(5)

        if all(p.exitcode == 0 for p in procs):
            code = 0
        else:
            code = first_failure if first_failure is not None else next(
                p.exitcode for p in procs if p.exitcode != 0)
        return subprocess.CompletedProcess(cmd, code, "".join(_read_output(o) for o, _ in files),
                                           "".join(_read_output(e) for _, e in files))


__all__ = ["DistributedTestError", "free_port", "run_distributed", "run_entry", "run_entry_world"]
