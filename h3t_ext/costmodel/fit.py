"""Fit a system's efficiencies to measured runs, and say which efficiencies the runs can identify.

The model is structural: only the named efficiencies of ``fitted_efficiencies.json`` are free, each inside
its plausible range. A run identifies an efficiency when its predicted time moves with it
(|d log time / d log efficiency| >= ``MIN_SENSITIVITY``); two efficiencies whose sensitivities are parallel
over the runs (|cos| >= ``MAX_COLLINEARITY``) cannot be told apart and only the more sensitive one is fitted;
never more efficiencies than runs. The fit minimises the mean absolute relative error of tokens/s per GPU by
coordinate-wise golden-section search inside the ranges (the error is unimodal in each efficiency: time
is monotonic in every one).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

from h3t_ext.costmodel.estimate import estimate
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec, plausible_ranges

FITTABLE = ("gemm_peak_fraction", "attention_peak_fraction", "gemm_tile_overhead_k", "tp_comm_overlap_exposed",
            "network_fraction", "hbm_fraction")
"""Efficiencies a calibration may fit, in the order of their usual influence on tokens/s."""
MIN_SENSITIVITY = 0.01
"""Smallest |d log time / d log efficiency| (over the runs) for a run set to identify an efficiency."""
MAX_COLLINEARITY = 0.995
"""|cos| of two sensitivity vectors above which the runs cannot separate the two efficiencies."""
_STEP = 0.05
_GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(frozen=True)
class MeasuredRun:
    """One measurement: the model and plan that ran and its tokens/s per GPU."""

    model: ModelSpec
    plan: Plan
    tokens_per_s_per_gpu: float
    label: str = ""
    system: Optional[SystemSpec] = None
    """The GPU it ran on when it differs from the system being fitted (same efficiency set)."""


@dataclass(frozen=True)
class FitResult:
    """Fitted system and what the runs could and could not identify."""

    system: SystemSpec
    """The input system with the fitted efficiencies."""
    fitted: Mapping[str, float]
    """Efficiencies that were fitted, by name."""
    unidentified: Mapping[str, str]
    """Efficiencies left at their prior values, with the reason."""
    rows: int
    """Runs the fit used."""
    mae_before: float
    mae_after: float


def with_efficiencies(system: SystemSpec, overrides: Mapping[str, float]) -> SystemSpec:
    """Copy of ``system`` with some efficiencies replaced."""
    return replace(system, efficiencies={**system.efficiencies, **overrides})


def _on(run: MeasuredRun, system: SystemSpec) -> SystemSpec:
    """The system ``run`` is priced on: its own GPU with ``system``'s efficiencies."""
    if run.system is None or run.system == system:
        return system
    return replace(run.system, efficiencies=system.efficiencies)


def relative_errors(runs: Sequence[MeasuredRun], system: SystemSpec) -> list[float]:
    """Predicted / measured tokens/s per GPU - 1, per run."""
    return [estimate(r.model, r.plan, _on(r, system)).tokens_per_second_per_gpu / r.tokens_per_s_per_gpu - 1
            for r in runs]


def mean_abs(errors: Sequence[float]) -> float:
    return sum(abs(e) for e in errors) / len(errors) if errors else 0.0


def _sensitivity(runs: Sequence[MeasuredRun], system: SystemSpec, key: str) -> list[float]:
    lo, hi = plausible_ranges()[key]
    x = system.efficiency(key)
    dx = max(abs(x) * _STEP, (hi - lo) * 0.01)
    up = with_efficiencies(system, {key: min(hi, x + dx)})
    down = with_efficiencies(system, {key: max(lo, x - dx)})
    span = math.log(min(hi, x + dx) / max(lo, x - dx)) if max(lo, x - dx) > 0 else (min(hi, x + dx) - max(lo, x - dx))
    out = []
    for r in runs:
        t_up = estimate(r.model, r.plan, _on(r, up)).iteration_time_s
        t_down = estimate(r.model, r.plan, _on(r, down)).iteration_time_s
        out.append(math.log(t_up / t_down) / span)
    return out


def _cos(a: Sequence[float], b: Sequence[float]) -> float:
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
    return abs(sum(x * y for x, y in zip(a, b))) / (na * nb) if na and nb else 0.0


def identifiable(runs: Sequence[MeasuredRun], system: SystemSpec, keys: Sequence[str] = FITTABLE
                 ) -> tuple[list[str], dict[str, str]]:
    """(efficiencies the runs identify, most sensitive first; {other: reason})."""
    sens = {k: _sensitivity(runs, system, k) for k in keys}
    strength = {k: max(abs(x) for x in v) for k, v in sens.items()}
    chosen: list[str] = []
    reasons: dict[str, str] = {}
    for k in sorted(keys, key=lambda k: -strength[k]):
        if strength[k] < MIN_SENSITIVITY:
            reasons[k] = f"no run's time depends on it (|d log t / d log {k}| < {MIN_SENSITIVITY})"
        elif len(chosen) >= len(runs):
            reasons[k] = f"{len(runs)} run(s) identify at most {len(runs)} efficiencies"
        elif (twin := next((c for c in chosen if _cos(sens[c], sens[k]) >= MAX_COLLINEARITY), None)) is not None:
            reasons[k] = f"not separable from {twin} on these runs"
        else:
            chosen.append(k)
    return chosen, reasons


def _golden(f, lo: float, hi: float, iters: int) -> float:
    a, b = lo, hi
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = f(d)
    return (a + b) / 2


def fit_system(system: SystemSpec, runs: Sequence[MeasuredRun], keys: Optional[Sequence[str]] = None, *,
               sweeps: int = 3, iters: int = 18) -> FitResult:
    """Fit the identifiable efficiencies of ``system`` (among ``keys``) to ``runs``."""
    if not runs:
        raise ValueError("calibration needs at least one measured run")
    keys = FITTABLE if keys is None else tuple(keys)
    ranges = plausible_ranges()
    before = mean_abs(relative_errors(runs, system))
    chosen, reasons = identifiable(runs, system, keys)
    current = system
    for _ in range(sweeps if len(chosen) > 1 else 1):
        for k in chosen:
            lo, hi = ranges[k]
            best = _golden(lambda x: mean_abs(relative_errors(runs, with_efficiencies(current, {k: x}))), lo, hi, iters)
            current = with_efficiencies(current, {k: best})
    return FitResult(current, {k: current.efficiency(k) for k in chosen}, reasons, len(runs), before,
                     mean_abs(relative_errors(runs, current)))
