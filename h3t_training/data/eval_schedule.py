"""When Megatron-LM evaluates and which validation samples each evaluation reads, as pure functions of the flags.

Megatron-LM evaluates after every ``--eval-interval``-th iteration that is at least ``--start-eval-at-iter`` (every one
without it), and once more at the end; each evaluation reads ``--eval-iters`` batches of ``--eval-global-batch-size``
samples (default ``--global-batch-size``) in ``--eval-micro-batch-size`` microbatches (default ``--micro-batch-size``),
and the next one continues where it stopped (Megatron's ``consumed_valid_samples``). ``--skip-train`` evaluates once.

The validation split is built for exactly the samples the run reads, as Megatron-LM sizes it
(``get_train_valid_test_num_samples``): megatron-core's GPT dataset shuffles by the number of samples asked for, so
another size would be other samples. One case is counted as the run needs it rather than as Megatron-LM counts it:
a ``--start-eval-at-iter`` that is a multiple of ``--eval-interval`` evaluates at that iteration, which Megatron-LM's
count leaves out (its split is one evaluation short, and a resume starts one evaluation early).
"""
from __future__ import annotations


def evaluations_before(iteration: int, eval_interval: int, start_eval_at_iter: int | None) -> int:
    """Evaluations during training at iterations 1..``iteration`` (the one at the end not counted)."""
    first_skipped = 0 if not start_eval_at_iter else (start_eval_at_iter - 1) // eval_interval
    return max(0, iteration // eval_interval - first_skipped)


def evaluation_due(iteration: int, eval_interval: int, start_eval_at_iter: int | None) -> bool:
    """Whether an evaluation follows training iteration ``iteration`` (1-based)."""
    return iteration % eval_interval == 0 and (start_eval_at_iter is None or iteration >= start_eval_at_iter)


def validation_samples(*, train_iters: int, eval_interval: int, eval_iters: int, eval_global_batch_size: int,
                       start_eval_at_iter: int | None, skip_train: bool) -> int:
    """Samples of the validation split the run reads: every evaluation's, the one at the end included."""
    evaluations = 1 if skip_train else evaluations_before(train_iters, eval_interval, start_eval_at_iter) + 1
    return evaluations * eval_iters * eval_global_batch_size
