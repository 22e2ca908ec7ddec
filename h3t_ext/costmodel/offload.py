"""Smallest offload ratio alpha that makes a plan fit: one for all stages ('auto') or one per stage
('balanced'). Each stage's peak is a convex piecewise-linear function of its alpha (a maximum over the
schedule's timeline of lines), so the smallest feasible alpha is found by bisection on exact values."""
from __future__ import annotations

from typing import Optional, Union

from h3t_ext.costmodel.estimate import over_budget_error
from h3t_ext.costmodel.memory import chunk_activation_bytes, stage_memory, stage_peak_function
from h3t_ext.costmodel.activations import rank_offloads
from h3t_ext.costmodel.layer_offload import layer_offload, layers_per_chunk
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.plan_checks import validate_plan
from h3t_ext.costmodel.reserve import default_memory_budget_bytes
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec

ALPHA_DECIMALS = 3
_STEPS = 1000  # alpha grid 0.001


def _stage_min_alpha(model: ModelSpec, plan: Plan, stage: int, budget: int, system: SystemSpec) -> int:
    """Smallest k in [0, 1000] with stage peak(k/1000) <= budget; raises when even k=1000 does not fit."""
    f = stage_peak_function(model, plan, stage, system)
    peak = lambda k: f(k / _STEPS)  # noqa: E731
    if peak(0) <= budget:
        return 0
    if peak(_STEPS) > budget:
        raise over_budget_error(stage_memory(model, plan, stage, 1.0, system), budget, " even with offload_alpha=1")
    lo, hi = 0, _STEPS  # peak(lo) > budget >= peak(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak(mid) <= budget:
            hi = mid
        else:
            lo = mid
    return hi


def _budget(model: ModelSpec, plan: Plan, system: SystemSpec, memory_budget_bytes: Optional[int]) -> int:
    return default_memory_budget_bytes(model, plan, system) if memory_budget_bytes is None else int(memory_budget_bytes)


def solve_offload_alpha(model: ModelSpec, plan: Plan, system: SystemSpec, memory_budget_bytes: Optional[int] = None,
                        mode: str = "auto") -> Union[float, tuple[float, ...]]:
    """alpha for ``plan`` (its own offload_alpha is ignored), rounded up to 3 decimals.

    ``auto``: one alpha for every stage, the smallest with which every stage fits.
    ``balanced``: one alpha per stage, each the smallest with which that stage fits.
    Raises InfeasiblePlanError (the term and excess at alpha=1) when alpha=1 does not fit.
    """
    if mode not in ("auto", "balanced"):
        raise ValueError(f"mode must be 'auto' or 'balanced', got {mode!r}")
    validate_plan(model, plan.with_alpha(0.0), system)
    budget = _budget(model, plan, system, memory_budget_bytes)
    ks = [_stage_min_alpha(model, plan, s, budget, system) for s in range(plan.pipeline_model_parallel_size)]
    if mode == "balanced":
        return tuple(k / _STEPS for k in ks)
    k = max(ks)
    # a stage whose peak rises with alpha (reload buffer larger than what it frees) must still fit
    for s in range(plan.pipeline_model_parallel_size):
        f = stage_peak_function(model, plan, s, system)
        while f(k / _STEPS) > budget and k < _STEPS:
            k += 1
        if f(k / _STEPS) > budget:
            raise over_budget_error(stage_memory(model, plan, s, k / _STEPS, system), budget,
                                    f" with one offload_alpha={k / _STEPS} for all stages")
    return round(k / _STEPS, ALPHA_DECIMALS)


def pcie_bytes_per_iteration(model: ModelSpec, plan: Plan, alphas: tuple[float, ...]) -> tuple[int, ...]:
    """Host<->device bytes per iteration of every stage (offload + reload); at pipeline size 1 layer by layer
    (:mod:`h3t_ext.costmodel.layer_offload`)."""
    p, m = plan.pipeline_model_parallel_size, plan.num_microbatches
    v = plan.virtual_size(model.num_layers)
    chunk = chunk_activation_bytes(model, plan)
    layers = layers_per_chunk(model, plan)
    if layers is not None:
        return tuple(int(2 * m * layer_offload(a, layers).offloaded * chunk) for a in alphas)
    return tuple(int(2 * a * chunk * rank_offloads(p, m, v, s, plan.microbatch_group_size_per_vp_stage))
                 for s, a in enumerate(alphas))


def balanced_pcie_savings(model: ModelSpec, plan: Plan, system: SystemSpec,
                          memory_budget_bytes: Optional[int] = None) -> int:
    """PCIe bytes per iteration (summed over the pipeline stages of one model replica) that balanced
    per-stage alphas save compared with one auto alpha."""
    auto = solve_offload_alpha(model, plan, system, memory_budget_bytes, "auto")
    bal = solve_offload_alpha(model, plan, system, memory_budget_bytes, "balanced")
    p = plan.pipeline_model_parallel_size
    return sum(pcie_bytes_per_iteration(model, plan, (auto,) * p)) - sum(pcie_bytes_per_iteration(model, plan, bal))
