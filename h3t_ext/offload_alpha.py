"""The one ``--offload-alpha`` value type: parsed, range-checked and formatted here and nowhere else.

Two forms:

* :data:`Alpha`, the numbers a plan runs with: one float for every pipeline stage, or a tuple of one
  per stage (what :class:`~h3t_ext.costmodel.Plan` and the runtime's ``H3TConfig`` hold);
* :class:`OffloadAlpha`, the flag's value: those numbers, or a mode the planner resolves (``auto``: the
  smallest alpha that fits the memory budget; ``balanced``: one smallest alpha per stage).

Every error is one line naming the flag and the valid range (``ValueError``; the callers turn it into
their own one-line error type).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

Alpha = Union[float, tuple[float, ...]]
"""Resolved offload fraction(s): one value, or one per pipeline stage, each in [0, 1]."""
MODES = ("auto", "balanced")
FLAG = "--offload-alpha"
VALID = "a number in [0, 1], a comma-separated list of one per pipeline stage, auto or balanced"


def _check_one(a: object, shown: str, flag: str) -> None:
    """The one range check: a finite number in [0, 1] (``shown`` is how the message spells the value)."""
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not (math.isfinite(a) and 0.0 <= a <= 1.0):
        raise ValueError(f"{flag} {shown} is outside [0, 1] (valid: {VALID})")


def _one(text: str, whole: str, flag: str) -> float:
    try:
        a = float(text)
    except ValueError:
        raise ValueError(f"{flag} {whole!r} is not a number (valid: {VALID})") from None
    _check_one(a, text.strip(), flag)
    return a


def check_alpha(alpha: Alpha, *, flag: str = FLAG) -> Alpha:
    """``alpha`` itself when every value is a finite number in [0, 1] (a tuple needs at least one)."""
    values = alpha if isinstance(alpha, tuple) else (alpha,)
    if not values:
        raise ValueError(f"{flag} needs at least one value (valid: {VALID})")
    for a in values:
        _check_one(a, repr(a), flag)
    return alpha


def per_stage(alpha: Alpha, pipeline_model_parallel_size: int, *, flag: str = FLAG) -> tuple[float, ...]:
    """One value per pipeline stage; a tuple of another length is an error naming the pipeline size."""
    p = pipeline_model_parallel_size
    if not isinstance(alpha, tuple):
        return (float(alpha),) * p
    if len(alpha) != p:
        raise ValueError(f"{flag} has {len(alpha)} values; give 1 or one per pipeline stage "
                         f"(--pipeline-model-parallel-size {p})")
    return tuple(float(a) for a in alpha)


def format_alpha(alpha: Alpha) -> str:
    """The flag text: ``0.162`` (3 decimals when exact), ``0.1,0.2,0.3`` for one value per stage."""
    if isinstance(alpha, (tuple, list)):
        return ",".join(_format_one(a) for a in alpha)
    return _format_one(alpha)


def _format_one(a: float) -> str:
    a = float(a)
    if abs(a - round(a, 3)) < 1e-12:
        return f"{a:.3f}"
    return repr(a)


@dataclass(frozen=True)
class OffloadAlpha:
    """The value of ``--offload-alpha``: numbers (:attr:`values`) or a planner mode (:attr:`mode`)."""

    values: Optional[Alpha] = 0.0
    """The fraction(s), or None when :attr:`mode` is set."""
    mode: Optional[str] = None
    """``auto`` or ``balanced``, or None for numbers."""

    def __post_init__(self) -> None:
        if self.mode is not None:
            if self.mode not in MODES or self.values is not None:
                raise ValueError(f"{FLAG} mode {self.mode!r} is not one of {{{','.join(MODES)}}}")
        elif self.values is None:
            raise ValueError(f"{FLAG} needs a value (valid: {VALID})")
        else:
            check_alpha(self.values)

    @classmethod
    def parse(cls, text: Union[str, float, Sequence[float], "OffloadAlpha"], *, flag: str = FLAG) -> "OffloadAlpha":
        """``0.5``, ``0.1,0.2``, ``auto``, ``balanced`` (or numbers already parsed)."""
        if isinstance(text, OffloadAlpha):
            return text
        if isinstance(text, (int, float)) and not isinstance(text, bool):
            return cls(values=check_alpha(float(text), flag=flag))
        if isinstance(text, (tuple, list)):
            values = tuple(float(a) for a in text)
            return cls(values=check_alpha(values[0] if len(values) == 1 else values, flag=flag))
        s = str(text).strip()
        if s in MODES:
            return cls(values=None, mode=s)
        parts = tuple(_one(part, s, flag) for part in s.split(","))
        return cls(values=parts[0] if len(parts) == 1 else parts)

    @property
    def is_mode(self) -> bool:
        return self.mode is not None

    @property
    def alpha(self) -> Alpha:
        """The numbers; ValueError for a mode (resolve it with the planner first)."""
        if self.values is None:
            raise ValueError(f"{FLAG} {self.mode} is resolved by the cost model; it has no numbers yet")
        return self.values

    def per_stage(self, pipeline_model_parallel_size: int) -> tuple[float, ...]:
        return per_stage(self.alpha, pipeline_model_parallel_size)

    def for_pipeline(self, pipeline_model_parallel_size: int) -> Alpha:
        """The numbers as a plan takes them: one float, or a checked tuple of one per stage."""
        alpha = self.alpha
        if isinstance(alpha, tuple):
            per_stage(alpha, pipeline_model_parallel_size)
        return alpha

    def __str__(self) -> str:
        return self.mode if self.mode is not None else format_alpha(self.values)


__all__ = ["Alpha", "MODES", "OffloadAlpha", "check_alpha", "format_alpha", "per_stage"]
