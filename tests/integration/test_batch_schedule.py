"""Batch-size schedules: Megatron's --step-batch-size-schedule and megatron-core's --rampup-batch-size.

The segment walk of :class:`BatchSchedule` is checked against an iteration-by-iteration simulation of
Megatron's rule (batch size from the samples consumed so far) and against the installed megatron-core's own
calculators: 0.16's ramp-up (0.19 removed it) and 0.19's step schedule (0.16 has none); the driver is checked on the
flags, the data order and a short run.
"""
from __future__ import annotations

import pytest

from driver_harness import check_ok, metrics, run_pretrain
from h3t_training.data.batch_schedule import BatchSchedule, parse_step_schedule, rampup_schedule
from h3t_training.config.sections import parse_args
from h3t_training.data.datasets import MicrobatchIterator
from h3t_training.errors import ArgumentError


def _simulate(batch_at_consumed, iterations: int) -> list[tuple[int, int]]:
    """(consumed before, batch size) of each iteration, one at a time, as Megatron's loop updates them."""
    out, consumed = [], 0
    for _ in range(iterations):
        batch = batch_at_consumed(consumed)
        out.append((consumed, batch))
        consumed += batch
    return out


def _step_rule(steps):
    def batch(consumed):
        return [b for threshold, b in steps if threshold <= consumed][-1]
    return batch


@pytest.mark.parametrize("steps", [((0, 16), (100, 32), (150, 48)),  # 48 starts mid-way through a 32-batch
                                   ((0, 64), (10, 8), (20, 4)),  # the first batch steps over two thresholds
                                   ((0, 3),)])
def test_the_segment_walk_follows_megatrons_rule(steps):
    schedule = BatchSchedule(steps)
    expected = _simulate(_step_rule(steps), 40)
    assert [(schedule.consumed_samples(i), schedule.batch_size(i)) for i in range(40)] == expected
    for samples in (1, 99, 100, 101, 500, 1000):
        iterations = next(i for i in range(1, 1000) if sum(b for _, b in _simulate(_step_rule(steps), i)) >= samples)
        assert schedule.iterations_for_samples(samples) == iterations
    assert schedule.batch_sizes(40) == tuple(dict.fromkeys(b for _, b in expected))


def test_megatron_step_schedule_text_counts_tokens():
    schedule = parse_step_schedule("0:16 2.4B:320 4.8B:624", seq_length=2048)
    assert schedule.segments == ((0, 16), (2_400_000_000 // 2048, 320), (4_800_000_000 // 2048, 624))
    assert parse_step_schedule("0:8,1K:16", seq_length=100).segments == ((0, 8), (10, 16))


@pytest.mark.parametrize("text, message", [
    ("640:8 1K:16", "the first threshold must be 0"),  # 640 tokens = 10 samples of 64
    ("0:8 x:16", "'x' is not a number"),
    ("0:8 1000", "entry '1000' is not THRESHOLD:BATCH_SIZE"),
    ("0:8 10:16", "two thresholds fall on sample 0"),
    ("0:0", "batch sizes must be >= 1"),
])
def test_bad_step_schedules_are_one_line(text, message):
    with pytest.raises(ArgumentError, match=message):
        parse_step_schedule(text, seq_length=64)


def _core_calculator(name: str):
    """megatron-core's calculator class ``name``; a skip naming the version where it has none (0.19 replaced
    the ramp-up calculator with the step schedule's)."""
    from importlib.metadata import version

    from megatron.core import num_microbatches_calculator as calculators
    if not hasattr(calculators, name):
        pytest.skip(f"megatron-core {version('megatron-core')} has no {name}")
    return getattr(calculators, name)


def _core_batch(core):
    def batch(consumed):
        core.update(consumed, consistency_check=False)
        return core.get_current_global_batch_size()
    return batch


@pytest.mark.parametrize("start, increment, samples, final", [(16, 8, 300, 64), (4, 4, 1000, 40), (2, 2, 7, 8)])
def test_rampup_equals_megatron_cores_calculator(start, increment, samples, final):
    core = _core_calculator("RampupBatchsizeNumMicroBatchesCalculator")(
        global_batch_size=final, micro_batch_size=1, data_parallel_size=1, decrease_batch_size_if_needed=False,
        rank=1, start_global_batch_size=start, batch_size_increment=increment, ramup_samples=samples)
    schedule = rampup_schedule(start, increment, samples, final)
    assert [(schedule.consumed_samples(i), schedule.batch_size(i)) for i in range(60)] == _simulate(_core_batch(core), 60)


@pytest.mark.parametrize("text, seq_length", [("0:16 100:32 150:48", None), ("0:8 1K:16 2.5K:4", 64),
                                              ("0:64,640:8,1280:4", 64)])
def test_step_schedule_equals_megatron_cores_calculator(text, seq_length):
    """--step-batch-size-schedule as megatron-core 0.19's calculator reads it (thresholds in tokens with
    --seq-length, as Megatron-LM passes it; in samples without)."""
    core = _core_calculator("StepBatchsizeNumMicroBatchesCalculator")(
        micro_batch_size=1, data_parallel_size=1, decrease_batch_size_if_needed=False, rank=1, schedule=text,
        seq_length=seq_length)
    schedule = parse_step_schedule(text, seq_length=seq_length or 1)
    assert [(schedule.consumed_samples(i), schedule.batch_size(i)) for i in range(60)] == _simulate(_core_batch(core), 60)


def test_the_data_order_follows_the_schedule():
    """Consecutive samples, iteration after iteration, each split over micro batches and data-parallel ranks."""
    schedule = BatchSchedule(((0, 4), (8, 8)))
    seen: dict[int, list[int]] = {}
    for dp_rank in range(2):
        it = MicrobatchIterator(list(range(100)), start_iteration=1, global_batch_size=schedule, micro_batch_size=1,
                                data_parallel_rank=dp_rank, data_parallel_size=2, device="cpu")
        it.dataset = [{"tokens": [i], "labels": [i], "loss_mask": [1], "position_ids": [0]} for i in range(100)]
        seen[dp_rank] = [int(next(it)["tokens"][0, 0]) for _ in range(2 + 4 + 4)]
    # iteration 1: samples 4..7 (2 microbatches per rank); iterations 2 and 3: 8..15 and 16..23 (4 each)
    assert sorted(seen[0] + seen[1]) == list(range(4, 24))
    assert seen[0][:2] == [4, 6] and seen[1][:2] == [5, 7] and seen[0][2:6] == [8, 10, 12, 14]


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "1", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "200", "--no-progress-bar", "--eval-iters", "0"]


def test_flags_resolve_to_one_schedule(capsys):
    config = parse_args([*BASE, "--step-batch-size-schedule", "0:2 256:4", "--train-iters", "5"], world_size=2)
    assert config.batch_schedule.segments == ((0, 2), (8, 4)) and config.global_batch_size == 4
    assert config.num_microbatches == 2  # of the final batch size, over 2 data-parallel ranks
    config = parse_args([*BASE, "--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12",
                         "--train-samples", "40"], world_size=1)
    assert config.batch_schedule.batch_sizes(config.train_iters) == (2, 4, 6, 8)
    assert config.train_iters == config.batch_schedule.iterations_for_samples(40)
    config = parse_args([*BASE, "--global-batch-size", "7", "--decrease-batch-size-if-needed", "--train-iters", "2"],
                        world_size=2)
    assert config.global_batch_size == 6 and "runs as 6" in " ".join(config.flag_notices)
    assert config.samples_left_out_per_iteration == 1


@pytest.mark.parametrize("flags, message", [
    (["--step-batch-size-schedule", "0:3 256:4", "--train-iters", "5"],
     "--step-batch-size-schedule: its batch size 3 is not a multiple of --micro-batch-size 1 x data-parallel size 2"),
    (["--step-batch-size-schedule", "0:2", "--global-batch-size", "4", "--train-iters", "5"],
     "--global-batch-size 4 contradicts --step-batch-size-schedule, whose last batch size is 2"),
    (["--train-iters", "5"], "--global-batch-size is required (or --step-batch-size-schedule)"),
])
def test_schedule_flag_errors(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*BASE, *flags], world_size=2)
    assert message in capsys.readouterr().err


def test_a_run_with_a_step_schedule_logs_each_iterations_batch(tmp_path):
    out = tmp_path / "m.json"
    check_ok(run_pretrain([*BASE, "--step-batch-size-schedule", "0:2 256:4", "--train-iters", "6",
                           "--max-position-embeddings", "64", "--metrics-json", str(out)], entry="pretrain_gpt.py"))
    batches = [r["global_batch_size"] for r in metrics(out)["iterations"]]
    assert batches == [2, 2, 2, 2, 4, 4]  # 256 tokens = 8 samples of 32: after four iterations of 2


def test_decreased_batches_count_their_left_out_samples_as_megatron_lm_does(tmp_path):
    """--decrease-batch-size-if-needed: Megatron-LM adds each iteration's requested minus running batch to its
    skipped samples (the log line's 'skipped samples', checkpoints' skipped_train_samples)."""
    out = tmp_path / "m.json"
    proc = run_pretrain([*BASE, "--micro-batch-size", "2", "--global-batch-size", "3", "--decrease-batch-size-if-needed",
                         "--train-iters", "3", "--log-interval", "1", "--metrics-json", str(out)])
    check_ok(proc)
    records = metrics(out)["iterations"]
    assert [(r["global_batch_size"], r["skipped_train_samples"]) for r in records] == [(2, 1), (2, 2), (2, 3)]
    assert "| consumed samples:            6 | skipped samples:            3 |" in proc.stdout
