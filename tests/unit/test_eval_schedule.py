"""When Megatron-LM evaluates and how many validation samples a run reads (h3t_training/data/eval_schedule.py), against
an enumeration of the iterations it evaluates at, and against Megatron-LM's own count
(``get_train_valid_test_num_samples``) wherever that count is the run's."""
from __future__ import annotations

import pytest

from h3t_training.data.eval_schedule import evaluation_due, evaluations_before, validation_samples


def _megatron_valid_samples(train_iters, eval_interval, eval_iters, gbs, start):
    """megatron/training/training.py's validation size (0.19.2), without --full-validation or --skip-train."""
    points = train_iters // eval_interval + 1
    if start is not None:
        points = max(0, points - start // eval_interval)
    return points * eval_iters * gbs


@pytest.mark.parametrize("interval", [1, 2, 3, 5])
@pytest.mark.parametrize("start", [None, 0, 1, 2, 3, 4, 7, 30])
def test_the_counts_are_those_of_the_iterations_megatron_evaluates_at(interval, start):
    train_iters = 20
    due = [i for i in range(1, train_iters + 1) if evaluation_due(i, interval, start)]
    assert due == [i for i in range(interval, train_iters + 1, interval) if start is None or i >= start]
    for s in range(train_iters + 1):
        assert evaluations_before(s, interval, start) == sum(1 for i in due if i <= s)
    total = validation_samples(train_iters=train_iters, eval_interval=interval, eval_iters=3,
                               eval_global_batch_size=8, start_eval_at_iter=start, skip_train=False)
    assert total == (len(due) + 1) * 3 * 8  # every evaluation and the one at the end
    if not start or start % interval:  # Megatron-LM's count is one evaluation short at a multiple of the interval
        assert total == _megatron_valid_samples(train_iters, interval, 3, 8, start)
    else:
        assert total == _megatron_valid_samples(train_iters, interval, 3, 8, start) + 3 * 8


def test_skip_train_reads_one_evaluation():
    assert validation_samples(train_iters=100, eval_interval=10, eval_iters=4, eval_global_batch_size=16,
                              start_eval_at_iter=None, skip_train=True) == 64
