"""Planner: enumerate, price and rank Megatron parallel plans with the cost model (no printing here)."""
from h3t_ext.planner.evaluate import Evaluation, evaluate
from h3t_ext.offload_alpha import OffloadAlpha, format_alpha
from h3t_ext.planner.flags import megatron_flags, plan_from_megatron_flags
from h3t_ext.planner.results import ClosestInfeasible, RankedPlan, SearchResult, reason_category
from h3t_ext.planner.search import search
from h3t_ext.planner.space import Layout, SearchConstraints, enumerate_layouts
from h3t_ext.planner.units import parse_bytes

__all__ = [
    "ClosestInfeasible", "Evaluation", "Layout", "RankedPlan", "SearchConstraints", "SearchResult",
    "enumerate_layouts", "evaluate", "format_alpha", "megatron_flags", "OffloadAlpha", "parse_bytes",
    "plan_from_megatron_flags", "reason_category", "search",
]
