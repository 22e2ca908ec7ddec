"""Typed errors of the cost model: one exception per kind of infeasibility, each with a one-line reason."""
from __future__ import annotations

from typing import Iterable, Optional


class UnknownNameError(ValueError):
    """A model or system name that is not in the data files; the message lists the valid names."""

    def __init__(self, kind: str, name: str, valid: Iterable[str]) -> None:
        self.kind = kind
        self.name = name
        self.valid = tuple(sorted(valid))
        super().__init__(f"unknown {kind} {name!r}; valid: {', '.join(self.valid)}")


class PlanError(ValueError):
    """A plan that cannot run; ``reason`` is one human-readable line."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class InvalidPlanError(PlanError):
    """A plan that cannot be built at all (divisibility, ranges, names)."""


class InfeasiblePlanError(PlanError):
    """A plan that can be built but does not fit the memory budget."""

    def __init__(self, reason: str, *, term: str, excess_bytes: int, stage: Optional[int] = None) -> None:
        self.term = term
        """Name of the largest memory term of the stage that is over budget."""
        self.excess_bytes = excess_bytes
        """Bytes by which the stage exceeds the budget."""
        self.stage = stage
        """Pipeline rank that is over budget (None when not stage-specific)."""
        super().__init__(reason)
