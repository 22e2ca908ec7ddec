"""CPU gloo worlds for the tests and benchmarks: run a function in N spawned processes and
collect what each returns.

Usage from a test or a benchmark script::

    results = run_distributed(_worker, world_size=4, args=(cfg,), timeout_s=300)

``_worker(rank, world_size, *args)`` must be a module-level function (it is pickled by name).
The default process group is initialised with gloo on a free localhost port before it runs and
destroyed after. An exception in any rank is re-raised in the caller with that rank's
traceback; a world that does not finish within ``timeout_s`` is killed and reported.
"""
from __future__ import annotations

import datetime
import io
import multiprocessing as mp
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


def run_distributed(fn: Callable, world_size: int, args: Sequence[Any] = (), *, timeout_s: float = 300.0,
                    pg_timeout_s: float = 120.0, threads: int = 1) -> list[Any]:
    """Spawn ``world_size`` gloo ranks running ``fn(rank, world_size, *args)``; return results by rank."""
    ctx = mp.get_context("spawn")
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


__all__ = ["DistributedTestError", "free_port", "run_distributed"]
