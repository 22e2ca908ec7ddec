"""BatchSchedule.resumed_at: a schedule continued from a checkpoint's (iteration, consumed samples), as Megatron-LM
continues a resumed run's data and batch size from the samples it consumed."""
from __future__ import annotations

from h3t_training.data.batch_schedule import BatchSchedule, parse_step_schedule


def test_a_constant_batch_continues_from_the_consumed_samples():
    s = BatchSchedule.constant(8).resumed_at(2, 8)  # two iterations of 4 were saved, the run goes on at 8
    assert [s.consumed_samples(i) for i in (2, 3, 4)] == [8, 16, 24]
    assert s.batch_size(2) == 8 and s.iterations_for_samples(24) == 4
    assert s.is_constant and s.segments == BatchSchedule.constant(8).segments


def test_a_step_schedule_takes_its_batch_size_from_the_consumed_samples():
    """Batch 4 below 10 samples, 8 from there: resumed at iteration 1 after 6 samples, iteration 1 runs 4 (6 < 10),
    iteration 2 runs 8 (10 consumed), as the samples say, not as iterations from 0 would (4, 4, 4, 8)."""
    step = parse_step_schedule("0:4 10:8", seq_length=1)
    s = step.resumed_at(1, 6)
    assert [s.batch_size(i) for i in (1, 2, 3)] == [4, 8, 8]
    assert [s.consumed_samples(i) for i in (1, 2, 3, 4)] == [6, 10, 18, 26]
    assert [step.batch_size(i) for i in (1, 2, 3)] == [4, 4, 8]  # the schedule itself is unchanged
    assert s.iterations_for_samples(26) == 4 and s.batch_sizes(4) == (4, 8)


def test_resuming_where_the_schedule_already_is_changes_nothing():
    step = parse_step_schedule("0:4 10:8", seq_length=1)
    same = step.resumed_at(3, step.consumed_samples(3))
    assert all(same.consumed_samples(i) == step.consumed_samples(i) for i in range(3, 12))
