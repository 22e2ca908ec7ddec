"""Evaluation on the validation and test splits, as Megatron-LM's ``evaluate`` / ``evaluate_and_print_results``.

An evaluation runs ``--eval-iters`` forward-only iterations of ``--eval-global-batch-size`` samples (default
``--global-batch-size``) in microbatches of ``--eval-micro-batch-size`` (default ``--micro-batch-size``) through
the training loop's h3t-ext runtime (its forward-backward function for the layout, forward only: no backward, no
activation offload) with every model chunk in eval mode (dropout off) and back in train mode afterwards,
under ``torch.no_grad``. Its loss is the token-weighted mean over all its microbatches and
data-parallel replicas, computed on the last pipeline stage; the perplexity is ``exp(min(20, loss))``.

Data positions follow Megatron-LM: one validation iterator serves every evaluation of a run and
continues where the previous one stopped (Megatron keeps ``consumed_valid_samples``), which is why
the validation split holds every evaluation's batches (:mod:`h3t_training.data.eval_schedule`). Here the
position is a pure function of the iteration, like the training data's: a run starting (or
resuming) at iteration ``s`` starts the validation data after the batches of the evaluations before ``s``
(``--start-eval-at-iter`` skips the earlier ones), exactly where an uninterrupted run would be; ``--skip-train``
starts it at 0, as Megatron does.
The test iterator starts at 0 and serves the one test evaluation at the end.

The evaluation reads its own iterators, runs no optimizer step and draws no random numbers (eval
mode), so the training samples, RNG streams and training losses are the same with and without it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from h3t_ext.runtime.pipeline.schedules import H3TSchedules
from h3t_training.config.memory_hygiene import MemoryHygiene
from h3t_training.data.datasets import build_data_iterators
from h3t_training.data.eval_schedule import evaluation_due, evaluations_before
from h3t_training.loop.collectives import all_reduce_host


@dataclass
class EvalResult:
    """One evaluation: the iteration it follows, ``valid`` or ``test``, the loss and its perplexity."""

    iteration: int
    split: str
    loss: float
    ppl: float
    at_end: bool

    def as_dict(self) -> dict:
        return {"iteration": self.iteration, "split": self.split, "loss": self.loss, "ppl": self.ppl,
                "at_end": self.at_end}


def perplexity(loss: float) -> float:
    """Megatron's reported PPL: ``exp(min(20, loss))``."""
    return math.exp(min(20.0, loss))


def boxed_line(result: EvalResult) -> str:
    """Megatron's three-line report of an evaluation."""
    what = "validation" if result.split == "valid" else "test"
    prefix = (f"the end of training for {'val' if result.split == 'valid' else 'test'} data" if result.at_end
              else f"iteration {result.iteration}")
    line = f" {what} loss at {prefix} | lm loss value: {result.loss:.6E} | lm loss PPL: {result.ppl:.6E} | "
    rule = "-" * (len(line) + 1)
    return f"{rule}\n{line}\n{rule}"


class Evaluator:
    """Holds the validation and test iterators of this rank and runs evaluations on them."""

    def __init__(self, args, chunks, forward_step_func: Callable, runtime: H3TSchedules, *, valid_dataset, test_dataset,
                 start_iteration: int, device: torch.device, print_fn: Callable[[str], None],
                 is_logging_rank: bool, hygiene: MemoryHygiene = MemoryHygiene()):
        self.args, self.chunks, self.forward_step_func, self.runtime = args, chunks, forward_step_func, runtime
        self.hygiene = hygiene
        self.print_fn, self.is_logging_rank = print_fn, is_logging_rank
        self.results: list[EvalResult] = []
        first_valid = 0 if args.skip_train else evaluations_before(
            start_iteration, args.eval_interval, args.start_eval_at_iter) * args.eval_iters
        self.valid = self._iterators(valid_dataset, first_valid, device)
        self.test = self._iterators(test_dataset, 0, device)

    def _iterators(self, dataset, first_batch: int, device) -> Optional[list]:
        if dataset is None:
            return None
        return build_data_iterators(self.args, dataset, start_iteration=first_batch, num_chunks=len(self.chunks),
                                    data_parallel_rank=ps.get_data_parallel_rank(), device=device,
                                    cp_group=ps.get_context_parallel_group(),
                                    global_batch_size=self.args.eval_global_batch_size,
                                    micro_batch_size=self.args.eval_micro_batch_size)

    @property
    def do_valid(self) -> bool:
        return self.valid is not None

    @property
    def do_test(self) -> bool:
        return self.test is not None

    def due(self, iteration: int) -> bool:
        """An evaluation follows training iteration ``iteration`` (1-based), as in Megatron's loop."""
        return self.do_valid and evaluation_due(iteration, self.args.eval_interval, self.args.start_eval_at_iter)

    def evaluate(self, iteration: int, split: str, *, at_end: bool = False) -> Optional[EvalResult]:
        """Run one evaluation on every rank; the result (and the printed box) on the logging rank."""
        iterators = self.valid if split == "valid" else self.test
        loss = self._run(iterators)
        if not self.is_logging_rank:
            return None
        result = EvalResult(iteration, split, loss, perplexity(loss), at_end)
        self.results.append(result)
        self.print_fn(boxed_line(result))
        return result

    def _run(self, iterators) -> float:
        a = self.args
        fb = self.runtime.forward_backward_func(a.pipeline_model_parallel_size, len(self.chunks))
        total = torch.zeros(2, dtype=torch.float64)
        hooks_off = a.overlap_param_gather and all(hasattr(m, "disable_forward_pre_hook") for m in self.chunks)
        for m in self.chunks:
            if hooks_off:
                m.disable_forward_pre_hook()
            m.eval()
        try:
            with torch.no_grad():
                for _ in range(a.eval_iters):
                    losses = fb(forward_step_func=self.forward_step_func, data_iterator=iterators, model=self.chunks,
                                num_microbatches=a.eval_global_batch_size // (a.eval_micro_batch_size
                                                                              * a.data_parallel_size),
                                seq_length=a.seq_length, micro_batch_size=a.eval_micro_batch_size, forward_only=True)
                    self.hygiene.after_eval_step()
                    for d in losses or ():
                        total += d["lm loss"].detach().double().cpu()
        finally:
            for m in self.chunks:
                m.train()
                if hooks_off:
                    m.enable_forward_pre_hook()
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            return float("nan")
        dp = ps.get_data_parallel_group(with_context_parallel=True)
        if dist.get_world_size(dp) > 1:
            total = all_reduce_host(total, group=dp)
        return float(total[0] / total[1].clamp(min=1))
