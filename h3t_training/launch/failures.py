"""How a driver run that does not finish ends: every known failure, and Ctrl-C, as one line and an exit status.

The entry point hands the whole run to :func:`run_reported` (``pretrain_llama.py``'s ``main``, which
``pretrain_gpt.py``'s driver path runs too), so this is the one place that turns an exception into a line:

* a bad checkpoint, layout, second run on one ``--save`` (:class:`CheckpointError`, ``RuntimeConfigError``,
  :class:`RunLockError`): ``prog: error: ...``, status 2; a non-finite loss (raised on every rank alike):
  said by rank 0 only, status 2;
* out of memory, on CPU (``MemoryError``, or the ``RuntimeError`` of torch's CPU allocator) or GPU
  (``torch.OutOfMemoryError``): the rank and its pipeline stage, the cost model's largest memory terms of that
  stage for this run's plan (:func:`h3t_training.config.run_spec.run_plan`, :func:`h3t_ext.costmodel.memory.stage_memory`)
  and the flags that relieve them; status :data:`EXIT_OUT_OF_MEMORY`;
* data-parallel replicas whose weights differ (``--check-weight-hash-across-dp-replicas-interval``,
  :mod:`h3t_training.loop.sdc_guards`; raised on every rank alike): said by rank 0, status
  :data:`EXIT_SILENT_DATA_CORRUPTION`;
* a collective that failed because a peer died or a wait timed out: status 3 (the heartbeat's);
* SIGINT (Ctrl-C at a terminal reaches the launcher and every rank; torchrun forwards it too): rank 0 says
  ``interrupted at iteration N; last complete checkpoint: iteration M`` (N iterations complete, M from the
  tracker under ``--save``, or ``--load``), no rank prints a traceback, status 130. The first SIGINT stops the
  rank where it is (KeyboardInterrupt), later ones are ignored, so the unwinding is not interrupted again. With
  ``--exit-signal-handler`` SIGINT is an exit signal like ``--exit-signal``: the run saves after the iteration
  and stops (:class:`Interrupted`), then ends the same way.

Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

EXIT_ERROR = 2
"""Bad input: a flag, a file, a checkpoint (Megatron's argparse status)."""
EXIT_PEER_FAILED = 3
"""A peer died or froze (h3t_training.loop.heartbeat.EXIT_STATUS)."""
EXIT_OUT_OF_MEMORY = 4
"""The plan does not fit this rank's memory (distinct from bad input: the flags are valid)."""
EXIT_SILENT_DATA_CORRUPTION = 5
"""Data-parallel replicas hold different weights (--check-weight-hash-across-dp-replicas-interval): neither bad
input nor a dead peer, but a fault of some device's memory or arithmetic."""
EXIT_INTERRUPTED = 128 + int(signal.SIGINT)
"""130: what a shell reports for a program ended by Ctrl-C."""
CPU_ALLOCATION_FAILURES = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")
"""The text of the RuntimeError torch's CPU allocator (c10/core/impl/alloc_cpu.cpp) raises when malloc fails."""
PEER_FAILURES = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "Broken pipe")
"""gloo's and the store's words for a collective whose peer died or did not answer in time."""
LARGEST_TERMS_SHOWN = 3


class Interrupted(Exception):
    """SIGINT arrived under ``--exit-signal-handler``; the run saved and stopped at a clean point."""


@dataclass
class RunProgress:
    """What the interrupt line reports, kept up to date by the training loop (the one mutable record)."""

    iteration: int = 0
    """Iterations complete (those of a loaded checkpoint included)."""
    args: Optional[object] = None
    """The run's TrainConfig once parsed (None before: an interrupt then names no checkpoint)."""


class InterruptGuard:
    """SIGINT for the lifetime of a run: the first raises KeyboardInterrupt where the rank is, later ones are
    ignored (the launcher forwards the one the terminal already sent), :attr:`interrupted` says it came."""

    def __init__(self) -> None:
        self.interrupted = False
        self._previous = None

    def __enter__(self) -> "InterruptGuard":
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal API
        if not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:  # after an interrupt the process is ending: a late SIGINT changes nothing
        signal.signal(signal.SIGINT, signal.SIG_IGN if self.interrupted else self._previous)


def last_checkpoint(args) -> Optional[int]:
    """The iteration of the newest complete checkpoint under --save (else --load): its tracker, written last."""
    from h3t_training.loop.checkpointing import TRACKER

    for root in (args.save, args.load) if args is not None else ():
        if root:
            try:
                with open(os.path.join(root, TRACKER)) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit():
                return int(text)
    return None


def interrupted_line(progress: RunProgress) -> str:
    m = last_checkpoint(progress.args)
    return (f"interrupted at iteration {progress.iteration}; last complete checkpoint: "
            + ("none" if m is None else f"iteration {m}"))


def is_out_of_memory(e: BaseException) -> bool:
    """torch's GPU allocator failure, Python's MemoryError, or torch's CPU allocator failure."""
    import torch

    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e) for s in CPU_ALLOCATION_FAILURES)


def pipeline_rank(args, rank: int) -> int:
    """This rank's pipeline stage: megatron-core's, or from its default rank order (tp-cp-ep-dp-pp) before
    the groups exist."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return ps.get_pipeline_model_parallel_rank()
    return rank // max(1, args.world_size // args.pipeline_model_parallel_size)


def _format_bytes(n: float) -> str:
    from h3t_ext.planner.units import format_bytes
    return format_bytes(n)


def stage_memory_terms(args, stage: int, *, on_gpu: bool) -> list[tuple[str, int]]:
    """The cost model's memory terms of ``stage`` for this run's plan, largest first (empty when it cannot
    price the plan)."""
    from h3t_ext.costmodel.errors import PlanError
    from h3t_ext.costmodel.memory import stage_memory
    from h3t_training.config.run_spec import model_spec, run_plan
    from h3t_training.data.tokenizer import run_padded_vocab_size

    try:
        vocab = run_padded_vocab_size(args)
        plan = run_plan(args, offload_alpha=args.offload_alpha, on_gpu=on_gpu)
        memory = stage_memory(model_spec(args, vocab, name="run"), plan, stage, plan.alphas()[stage])
    except (PlanError, ValueError, OSError):
        return []
    return sorted(((k, v) for k, v in memory.terms.items() if v > 0), key=lambda kv: -kv[1])


ACTIVATION_TERMS = ("activations", "offload_reload_buffer", "recompute_workspace", "layer_backward_workspace",
                    "output_layer_activations")
"""The terms that --offload-alpha and --ckpt shrink (saved activations and what is kept beside them)."""


def relief(args, largest: list[str]) -> list[str]:
    """The flags that shrink this stage's largest terms, those of the largest term first."""
    alpha = args.offload_alpha
    alphas = [float(a) for a in (alpha if isinstance(alpha, (list, tuple)) else [alpha])]
    for_activations = []
    if max(alphas) < 1:
        for_activations.append(f"--offload-alpha (now {alpha}) moves activations to host memory")
    if args.ckpt != "full":
        better = "ours" if args.ckpt == "no" else "full"
        for_activations.append(f"--ckpt {better} (now {args.ckpt}) keeps fewer activations")
    for_state = [f"more pipeline stages (--pipeline-model-parallel-size, now {args.pipeline_model_parallel_size}) "
                 f"split the layers' weights, gradients and optimizer states"]
    if not args.use_distributed_optimizer and args.data_parallel_size > 1:
        for_state.append("--use-distributed-optimizer shards the optimizer states")
    activations_first = bool(largest) and largest[0] in ACTIVATION_TERMS
    return for_activations + for_state if activations_first else for_state + for_activations


def out_of_memory_line(args, e: BaseException, rank: int, *, on_gpu: bool) -> str:
    stage = pipeline_rank(args, rank)
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    where = "GPU" if on_gpu else "CPU"
    terms = stage_memory_terms(args, stage, on_gpu=on_gpu)[:LARGEST_TERMS_SHOWN]
    shown = ", ".join(f"{k} {_format_bytes(v)}" for k, v in terms)
    line = (f"rank {rank} (pipeline stage {stage} of {args.pipeline_model_parallel_size}): out of {where} memory "
            f"({type(e).__name__}{': ' + text if text else ''})")
    if shown:
        line += f"; the cost model's largest terms for this stage: {shown}"
    return line + "; to relieve them: " + "; ".join(relief(args, [k for k, _ in terms]))


def _describe(e: BaseException, args, rank: int, prog: str) -> tuple[Optional[str], int]:
    """(line or None for no line on this rank, exit status) for a known failure; raises ``e`` otherwise."""
    from h3t_ext.runtime.config import RuntimeConfigError
    from h3t_training.loop.checkpointing import CheckpointError
    from h3t_training.config.arguments import SILENT_RANK_EXIT_DELAY_S
    from h3t_training.config.feature_checks import uses_gpu
    from h3t_training.loop.optimizer import NonFiniteError
    from h3t_training.launch.run_guard import RunLockError
    from h3t_training.loop.sdc_guards import WeightHashMismatchError

    if isinstance(e, NonFiniteError):  # raised on every rank alike: said once
        return (f"{prog}: error: {e}" if rank == 0 else None), EXIT_ERROR
    if isinstance(e, WeightHashMismatchError):  # every rank gathered every digest: said once
        return (f"{prog}: error: {e}" if rank == 0 else None), EXIT_SILENT_DATA_CORRUPTION
    if isinstance(e, CheckpointError) and e.alike and rank != 0:  # found alike on every rank: said once
        time.sleep(SILENT_RANK_EXIT_DELAY_S)  # rank 0 writes its line before the launcher stops the group
        return None, EXIT_ERROR
    if isinstance(e, (CheckpointError, RuntimeConfigError, RunLockError)):
        return f"{prog}: error: {e}", EXIT_ERROR
    if is_out_of_memory(e) and args is not None:
        return f"{prog}: error: {out_of_memory_line(args, e, rank, on_gpu=uses_gpu(args))}", EXIT_OUT_OF_MEMORY
    if isinstance(e, RuntimeError):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if any(k in first for k in PEER_FAILURES):
            return f"{prog}: error: rank {rank}: a distributed operation failed: {first}", EXIT_PEER_FAILED
    raise e


def run_reported(body: Callable[[RunProgress], int], *, prog: str, rank: int) -> int:
    """``body(progress)``'s exit status, or the status of the way it failed after its one line on stderr (see
    module doc). ``body`` parses the flags into ``progress.args`` first and keeps ``progress.iteration`` current;
    SIGINT is guarded from the first line on."""
    progress = RunProgress()
    line: Optional[str] = None
    with InterruptGuard() as guard:
        try:
            try:
                status = body(progress)
            except (Interrupted, KeyboardInterrupt):
                status = EXIT_INTERRUPTED
            except Exception as e:  # noqa: BLE001 - _describe re-raises what it does not know
                line, status = _describe(e, progress.args, rank, prog)
        except KeyboardInterrupt:  # the first SIGINT arrived while a failure was being described
            line, status = None, EXIT_INTERRUPTED
        except Exception:  # unknown: a bug, unless the peer it talked to was interrupted (then so was this rank)
            if not guard.interrupted:
                raise
        if guard.interrupted or status == EXIT_INTERRUPTED:  # a failure caused by an interrupted peer is too
            line, status = (f"{prog}: {interrupted_line(progress)}" if rank == 0 else None), EXIT_INTERRUPTED
    if line is not None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    return status


__all__ = ["CPU_ALLOCATION_FAILURES", "EXIT_INTERRUPTED", "EXIT_OUT_OF_MEMORY", "EXIT_SILENT_DATA_CORRUPTION", "InterruptGuard", "Interrupted",
           "RunProgress", "interrupted_line", "is_out_of_memory", "out_of_memory_line", "run_reported"]
