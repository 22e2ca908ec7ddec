"""What a search returns (its ranked plans, the plan closest to fitting, its rejections by reason) and the state
that gathers them while it runs (:class:`Collector`)."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from h3t_ext.costmodel import Plan
from h3t_ext.planner.evaluate import Evaluation

R_PRUNED = "memory: does not fit (a smaller micro batch or more recompute already did not)"
R_SLOWER = "slower: a larger micro batch only adds pipeline bubble (throughput already fell with micro batch)"
R_BOUND = "slower: cannot beat the top plans (upper bound on tokens/s below the last of them)"
SEARCH_CUTS = (R_PRUNED, R_SLOWER, R_BOUND)
"""The search's own cuts among its rejection reasons (every other reason is a rule a plan broke)."""


@dataclass(frozen=True)
class RankedPlan:
    """One feasible plan of a search."""

    evaluation: Evaluation
    """Plan with resolved alpha and its estimate."""
    megatron_flags: tuple[str, ...]
    """Flags that launch it (see :func:`h3t_ext.planner.flags.megatron_flags`)."""
    launch_env: tuple[str, ...] = ()
    """The ``env`` arguments of the launch environment Megatron-LM asserts for it
    (:func:`h3t_ext.planner.launch_env.launch_env_words`)."""

    @property
    def plan(self) -> Plan:
        return self.evaluation.plan

    @property
    def tokens_per_second(self) -> float:
        return self.evaluation.estimate.tokens_per_second


@dataclass(frozen=True)
class ClosestInfeasible:
    """The rejected plan that misses the budget by the fewest bytes."""

    plan: Plan
    """The plan (at the largest alpha tried)."""
    term: str
    """Memory term reported as over budget."""
    excess_bytes: int
    """Bytes over the budget."""
    stage: Optional[int]
    """Pipeline rank over budget, when known."""
    reason: str
    """The cost model's one-line reason."""
    terms: tuple[tuple[str, int], ...] = ()
    """Memory terms (bytes) of the stage over budget, largest first, at the largest alpha tried."""


@dataclass(frozen=True)
class SearchResult:
    """Ranked feasible plans, and why the others were rejected."""

    plans: tuple[RankedPlan, ...]
    """Feasible plans, best (highest predicted tokens/s) first."""
    rejected: Mapping[str, int] = field(default_factory=dict)
    """Rejected (partial) plans by reason."""
    considered: int = 0
    """Plans the cost model priced."""
    closest_infeasible: Optional[ClosestInfeasible] = None
    """Among plans rejected for memory, the one closest to fitting."""

    @property
    def best(self) -> Optional[RankedPlan]:
        return self.plans[0] if self.plans else None

    @property
    def broken_rules(self) -> tuple[str, ...]:
        """The rules the rejected plans broke (divisibility, memory, ...; Megatron's field names), without the
        search's own cuts: where no plan was valid, why none was."""
        return tuple(r for r in self.rejected if r not in SEARCH_CUTS)

    def tied_with_best(self, relative_half_width: Optional[float] = None) -> tuple[int, ...]:
        """Indices (0 = the best) of the plans whose predicted tokens/s lie within the best's prediction
        interval (default half-width: the best estimate's ``uncertainty``): the cost model cannot tell them apart."""
        if not self.plans:
            return ()
        best = self.plans[0].evaluation.estimate
        w = best.uncertainty.relative_half_width if relative_half_width is None else relative_half_width
        floor = best.tokens_per_second * (1.0 - w)
        return tuple(i for i, r in enumerate(self.plans) if r.evaluation.estimate.tokens_per_second >= floor)


_NUMBERS = re.compile(r"\s*\([^)]*\)|-?\d+(\.\d+)?")


def reason_category(reason: str) -> str:
    """A reason with its numbers removed, so that rejections can be counted by kind."""
    return " ".join(_NUMBERS.sub("", reason).split())


class Collector:
    """Mutable state of one search while it runs (kept out of the public result types)."""

    def __init__(self, rejected: Counter) -> None:
        self.rejected = rejected
        self.feasible: list[RankedPlan] = []
        self.closest: Optional[ClosestInfeasible] = None
        self.considered = 0

    def reject_memory(self, verdict: ClosestInfeasible, count: int = 1) -> None:
        """Count ``count`` plans rejected for memory; keep the verdict closest to fitting."""
        self.rejected[f"memory: {verdict.term} over budget"] += count
        if self.closest is None or verdict.excess_bytes < self.closest.excess_bytes:
            self.closest = verdict

    def infeasible(self, plan: Plan, term: str, excess: int, stage: Optional[int], reason: str,
                   terms: Callable[[], Mapping[str, int]] = dict) -> None:
        """Count one plan rejected for memory; ``terms`` (the stage's memory terms) is called only when it is
        the closest to fitting so far."""
        self.reject_memory(self._verdict(plan, term, excess, stage, reason, terms))

    def nearer(self, plan: Plan, term: str, excess: int, stage: Optional[int], reason: str,
               terms: Callable[[], Mapping[str, int]] = dict) -> None:
        """Keep a memory verdict if it is the closest to fitting so far, without counting a plan (a plan the search
        checked on memory alone, not one of the candidates it counts)."""
        if self.closest is None or int(excess) < self.closest.excess_bytes:
            self.closest = self._verdict(plan, term, excess, stage, reason, terms)

    def _verdict(self, plan: Plan, term: str, excess: int, stage: Optional[int], reason: str,
                 terms: Callable[[], Mapping[str, int]]) -> ClosestInfeasible:
        closest = self.closest is None or int(excess) < self.closest.excess_bytes
        listed = tuple(sorted(((k, int(b)) for k, b in terms().items() if b > 0), key=lambda kv: -kv[1])) \
            if closest else ()
        return ClosestInfeasible(plan, term, int(excess), stage, reason, listed)


__all__ = ["ClosestInfeasible", "Collector", "RankedPlan", "SearchResult", "reason_category"]
