"""The global batch size of every iteration: constant, Megatron's step schedule, or its ramp-up.

* constant: ``--global-batch-size``;
* ``--step-batch-size-schedule "THRESHOLD:BS ..."`` (Megatron-LM): the batch size is that of the
  largest threshold not above the samples consumed so far; thresholds take K/M/B/T suffixes and
  count tokens (divided by ``--seq-length`` into samples), the first is 0;
* ``--rampup-batch-size START INCREMENT SAMPLES`` (megatron-core 0.16's ramp-up calculator): from
  START up to ``--global-batch-size`` in steps of INCREMENT, each step after SAMPLES / steps
  consumed samples.

The schedule is a list of segments (first consumed sample, batch size); an iteration's batch size
depends on the samples consumed before it, so iterations are walked segment by segment in closed
form, from an origin (iteration, consumed samples): (0, 0), or a resumed checkpoint's where it
consumed other than this schedule reaches there (:meth:`BatchSchedule.resumed_at`: Megatron-LM continues
from the checkpoint's consumed samples whatever the batch size was before). Every problem is one
:class:`~h3t_training.errors.ArgumentError` line.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from h3t_training.errors import ArgumentError

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


@dataclass(frozen=True)
class BatchSchedule:
    """Segments ``(first consumed sample, global batch size)``, thresholds strictly increasing from 0."""

    segments: tuple[tuple[int, int], ...]
    origin: tuple[int, int] = (0, 0)
    """(iteration, samples consumed before it) the walk starts from; iterations before it are extrapolated with
    the first batch size walked (no caller asks for them)."""

    def __post_init__(self) -> None:
        assert self.segments and self.segments[0][0] == 0, self.segments
        assert all(a[0] < b[0] for a, b in zip(self.segments, self.segments[1:])), self.segments
        assert all(b > 0 for _, b in self.segments), self.segments

    @classmethod
    def constant(cls, global_batch_size: int) -> "BatchSchedule":
        return cls(((0, global_batch_size),))

    def resumed_at(self, iteration: int, consumed_samples: int) -> "BatchSchedule":
        """This schedule continued from a checkpoint of ``iteration`` that had consumed ``consumed_samples``: the
        batch sizes by consumed samples are this schedule's, the count starts from the checkpoint's."""
        return BatchSchedule(self.segments, (iteration, consumed_samples))

    @property
    def is_constant(self) -> bool:
        return len(self.segments) == 1

    @property
    def final_batch_size(self) -> int:
        return self.segments[-1][1]

    def _walk(self):
        """(first iteration, consumed samples before it, batch size, iterations in the segment or None)."""
        it, consumed = self.origin
        for k, (_, batch) in enumerate(self.segments):
            end = self.segments[k + 1][0] if k + 1 < len(self.segments) else None
            if end is not None and consumed >= end:
                continue  # a larger batch stepped over this segment
            n = None if end is None else -(-(end - consumed) // batch)
            yield it, consumed, batch, n
            if n is None:
                return
            it, consumed = it + n, consumed + n * batch

    def consumed_samples(self, iteration: int) -> int:
        """Samples consumed by the iterations before ``iteration`` (0-based)."""
        for first, consumed, batch, n in self._walk():
            if n is None or iteration < first + n:
                return consumed + (iteration - first) * batch
        raise AssertionError("the last segment is unbounded")

    def batch_size(self, iteration: int) -> int:
        """The global batch size of iteration ``iteration`` (0-based)."""
        for first, _, batch, n in self._walk():
            if n is None or iteration < first + n:
                return batch
        raise AssertionError("the last segment is unbounded")

    def iterations_for_samples(self, samples: int) -> int:
        """Iterations until at least ``samples`` are consumed (Megatron's sample-based stop with a schedule)."""
        for first, consumed, batch, n in self._walk():
            if n is None or consumed + n * batch >= samples:
                return first + max(0, -(-(samples - consumed) // batch))
        raise AssertionError("the last segment is unbounded")

    def batch_sizes(self, iterations: int) -> tuple[int, ...]:
        """The distinct batch sizes of iterations ``0 .. iterations - 1``, in order."""
        return tuple(batch for first, _, batch, _ in self._walk() if first < iterations)


def _number(text: str, flag: str) -> int:
    t = text.strip().upper()
    scale = _SUFFIXES.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale != 1 else t) * scale
    except ValueError:
        raise ArgumentError(f"{flag}: {text!r} is not a number (suffixes K, M, B, T)") from None
    if not math.isfinite(value) or value < 0:
        raise ArgumentError(f"{flag}: {text!r} is outside [0, inf)")
    return int(value)


def parse_step_schedule(text: str, seq_length: int) -> BatchSchedule:
    """``"0:16 2.4B:320 ..."`` (thresholds in tokens) -> the schedule in samples."""
    flag = "--step-batch-size-schedule"
    steps = []
    for entry in text.replace(",", " ").split():
        if ":" not in entry:
            raise ArgumentError(f"{flag}: entry {entry!r} is not THRESHOLD:BATCH_SIZE")
        threshold, batch = entry.split(":", 1)
        steps.append((_number(threshold, flag) // seq_length, _number(batch, flag)))
    steps.sort()
    if not steps or steps[0][0] != 0:
        raise ArgumentError(f"{flag}: the first threshold must be 0, got {text!r}")
    for (a, _), (b, _) in zip(steps, steps[1:]):
        if a == b:
            raise ArgumentError(f"{flag}: two thresholds fall on sample {a} (thresholds are tokens: at least "
                                f"--seq-length {seq_length} apart)")
    if any(batch < 1 for _, batch in steps):
        raise ArgumentError(f"{flag}: batch sizes must be >= 1, got {text!r}")
    return BatchSchedule(tuple(steps))


def rampup_schedule(start: int, increment: int, samples: int, global_batch_size: int) -> BatchSchedule:
    """megatron-core 0.16's ramp-up: batch ``start + k * increment`` from ``k * samples / steps`` consumed
    samples (the first integer where ``int(consumed / per_step) >= k``), ``global_batch_size`` past ``samples``."""
    flag = "--rampup-batch-size"
    if start < 1 or increment < 1 or samples < 0:
        raise ArgumentError(f"{flag} {start} {increment} {samples}: start and increment must be >= 1, samples >= 0")
    diff = global_batch_size - start
    if diff < 0 or diff % increment:
        raise ArgumentError(f"{flag} {start} {increment} {samples}: --global-batch-size {global_batch_size} minus "
                            f"the start batch size must be a non-negative multiple of the increment")
    steps = diff // increment
    if steps == 0:
        return BatchSchedule.constant(global_batch_size)
    per_step = samples / steps
    segments = [(0, start)]
    for k in range(1, steps + 1):
        at = math.ceil(k * per_step)
        while at > 0 and int((at - 1) / per_step) >= k:
            at -= 1
        while int(at / per_step) < k:
            at += 1
        if at > segments[-1][0]:
            segments.append((at, start + k * increment))
        else:  # two steps on one sample: the later batch size wins
            segments[-1] = (segments[-1][0], start + k * increment)
    return BatchSchedule(tuple(segments))


def schedule_of(config) -> BatchSchedule:
    """The run's schedule (``config.batch_schedule``, else constant ``--global-batch-size``)."""
    schedule = config.batch_schedule
    return schedule if schedule is not None else BatchSchedule.constant(config.global_batch_size)


__all__ = ["BatchSchedule", "parse_step_schedule", "rampup_schedule", "schedule_of"]
