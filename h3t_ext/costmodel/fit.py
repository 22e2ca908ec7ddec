"""Fit a system's efficiencies to measured runs, and say which efficiencies the runs can identify.

The model is structural: only the named efficiencies of ``fitted_efficiencies.json`` are free, each inside
its plausible range. A run identifies an efficiency when its predicted time moves with it
(|d log time / d log efficiency| >= ``MIN_SENSITIVITY``); two efficiencies whose sensitivities are parallel
over the runs (|cos| >= ``MAX_COLLINEARITY``) cannot be told apart and only the more sensitive one is fitted;
never more efficiencies than runs. The fit minimises the mean absolute relative error of tokens/s per GPU by
coordinate-wise golden-section search inside the ranges (the error is unimodal in each efficiency: time
is monotonic in every one). The fit prices the closed form, ``estimate(..., timeline=False)``'s time without the
memory terms that no efficiency changes (:func:`~h3t_ext.costmodel.estimate.closed_form_terms`): thousands of
estimates, and the timeline of the schedule's lists takes milliseconds to a second per plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

from h3t_ext.costmodel.estimate import closed_form_terms
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.efficiency_sets import OPTIONAL_EFFICIENCIES, plausible_ranges
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec

FITTABLE = ("gemm_peak_fraction", "gemm_fp8_peak_fraction", "attention_peak_fraction", "gemm_tile_overhead_k",
            "tp_comm_overlap_exposed", "network_fraction", "hbm_fraction", "fused_attention_gemm_ratio")
"""Efficiencies a calibration may fit, in the order of their usual influence on tokens/s (the fused attention's
ratio only where the system has it: elsewhere the fused kernel is priced as FlashAttention)."""
MIN_SENSITIVITY = 0.01
"""Smallest |d log time / d log efficiency| (over the runs) for a run set to identify an efficiency."""
MAX_COLLINEARITY = 0.995
"""|cos| of two sensitivity vectors above which the runs cannot separate the two efficiencies."""
BOUND_TOLERANCE = 0.01
"""A fitted value within this fraction of its plausible range of a bound is taken as on the bound."""
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
    return [_tokens_per_s_per_gpu(r, _on(r, system)) / r.tokens_per_s_per_gpu - 1 for r in runs]


def _tokens_per_s_per_gpu(run: MeasuredRun, system: SystemSpec) -> float:
    """``estimate(run.model, run.plan, system, timeline=False).tokens_per_second_per_gpu``, priced without the
    memory terms (:func:`~h3t_ext.costmodel.estimate.closed_form_terms`)."""
    seconds = closed_form_terms(run.model, run.plan, system).total
    return run.plan.tokens_per_iteration / seconds / run.plan.num_gpus


def mean_abs(errors: Sequence[float]) -> float:
    return sum(abs(e) for e in errors) / len(errors) if errors else 0.0


Param = tuple[str, str]
"""(scope, efficiency): scope is a family (efficiency set) or ``SHARED``."""
SHARED = "shared"
FAMILY_KEYS = ("gemm_peak_fraction", "gemm_fp8_peak_fraction", "attention_peak_fraction", "hbm_fraction")
"""Efficiencies of one GPU family (its tensor cores at bf16 and at fp8 (no fp8 run: not identified), clocks under its power limit, its attention kernels, its
memory system: HBM2e on Ampere, HBM3 on Hopper)."""
SHARED_KEYS = ("gemm_tile_overhead_k", "network_fraction", "tp_comm_overlap_exposed")
"""Efficiencies of the kernels' structure and the software stack, common to the GPU families."""

Groups = Mapping[str, tuple[SystemSpec, Sequence[MeasuredRun]]]


def _systems(groups: Groups, values: Mapping[Param, float]) -> dict[str, SystemSpec]:
    return {fam: with_efficiencies(base, {k: v for (scope, k), v in values.items() if scope in (fam, SHARED)})
            for fam, (base, _) in groups.items()}


def _errors(groups: Groups, values: Mapping[Param, float]) -> list[float]:
    systems = _systems(groups, values)
    return [e for fam, (_, runs) in groups.items() for e in relative_errors(runs, systems[fam])]


def _times(groups: Groups, values: Mapping[Param, float]) -> list[float]:
    systems = _systems(groups, values)
    return [closed_form_terms(r.model, r.plan, _on(r, systems[fam])).total
            for fam, (_, runs) in groups.items() for r in runs]


def _sensitivity(groups: Groups, values: Mapping[Param, float], param: Param) -> list[float]:
    lo, hi = plausible_ranges()[param[1]]
    x = values[param]
    dx = max(abs(x) * _STEP, (hi - lo) * 0.01)
    up, down = min(hi, x + dx), max(lo, x - dx)
    t_up = _times(groups, {**values, param: up})
    t_down = _times(groups, {**values, param: down})
    span = math.log(up / down) if down > 0 else up - down
    return [math.log(a / b) / span for a, b in zip(t_up, t_down)]


def _cos(a: Sequence[float], b: Sequence[float]) -> float:
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
    return abs(sum(x * y for x, y in zip(a, b))) / (na * nb) if na and nb else 0.0


def _strength(v: Sequence[float]) -> float:
    """How strongly the runs' times depend on an efficiency: its largest |d log t / d log e| over them."""
    return max(abs(x) for x in v)


def identifiable(sens: Mapping[Param, Sequence[float]], rows: int) -> tuple[list[Param], dict[Param, str]]:
    """(parameters ``rows`` runs identify, most sensitive first; {other: reason}), from each parameter's sensitivity
    over the runs (:func:`_sensitivity`)."""
    strength = {p: _strength(v) for p, v in sens.items()}
    chosen: list[Param] = []
    reasons: dict[Param, str] = {}
    for p in sorted(sens, key=lambda p: -strength[p]):
        if strength[p] < MIN_SENSITIVITY:
            reasons[p] = f"no run's time depends on it (|d log t / d log {p[1]}| < {MIN_SENSITIVITY})"
        elif len(chosen) >= rows:
            reasons[p] = f"{rows} run(s) identify at most {rows} efficiencies"
        elif (twin := next((c for c in chosen if _cos(sens[c], sens[p]) >= MAX_COLLINEARITY), None)) is not None:
            reasons[p] = f"not separable from {twin[1]} on these runs"
        else:
            chosen.append(p)
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


def _fit_chosen(groups: Groups, values: dict[Param, float], chosen: Sequence[Param], sweeps: int, iters: int) -> None:
    """Coordinate-wise golden-section search of ``chosen`` inside their plausible ranges (``values`` in place)."""
    ranges = plausible_ranges()
    for _ in range(sweeps if len(chosen) > 1 else 1):
        for p in chosen:
            lo, hi = ranges[p[1]]
            values[p] = _golden(lambda x: mean_abs(_errors(groups, {**values, p: x})), lo, hi, iters)


def _at_bound(p: Param, x: float) -> bool:
    lo, hi = plausible_ranges()[p[1]]
    return min(x - lo, hi - x) <= BOUND_TOLERANCE * (hi - lo)


def _twins_for_bounds(groups: Groups, values: dict[Param, float], prior: Mapping[Param, float],
                      sens: Mapping[Param, Sequence[float]], chosen: list[Param], reasons: dict[Param, str],
                      sweeps: int, iters: int) -> tuple[list[Param], dict[Param, str]]:
    """A chosen efficiency that the fit drove onto its plausible bound is asked for a value no plausible stack has. An
    efficiency left out whose sensitivity over the runs is parallel to it (with one run, any the run's time depends on)
    may explain the runs inside its own range: an FP8 run's attention-bound time moves gemm_peak_fraction, which scales
    the fused attention's rate, and fused_attention_gemm_ratio alike. The most sensitive such twin is fitted instead,
    the bound one back at its prior, and kept when it stays inside its range and fits the runs better."""
    for p in list(chosen):
        if not _at_bound(p, values[p]):
            continue
        twins = sorted((q for q in reasons if _strength(sens[q]) >= MIN_SENSITIVITY
                        and _cos(sens[q], sens[p]) >= MAX_COLLINEARITY), key=lambda q: -_strength(sens[q]))
        for q in twins:
            swapped = [q if c == p else c for c in chosen]
            trial = {**values, p: prior[p]}
            _fit_chosen(groups, trial, swapped, sweeps, iters)
            if not _at_bound(q, trial[q]) and mean_abs(_errors(groups, trial)) < mean_abs(_errors(groups, values)):
                values.update(trial)
                chosen = swapped
                reasons = {**{k: v for k, v in reasons.items() if k != q},
                           p: f"its fit reached its plausible bound; {q[1]}, which these runs cannot tell from it, "
                              f"explains them inside its range"}
                break
    return chosen, reasons


def fit_joint(groups: Groups, family_keys: Sequence[str] = FAMILY_KEYS, shared_keys: Sequence[str] = SHARED_KEYS,
              *, sweeps: int = 3, iters: int = 18) -> dict[str, FitResult]:
    """Fit per-family efficiencies (``family_keys``, one value per family) and shared ones (``shared_keys``,
    one value for all families) jointly to every family's runs."""
    if not any(runs for _, runs in groups.values()):
        raise ValueError("calibration needs at least one measured run")
    first = next(iter(groups.values()))[0]
    values: dict[Param, float] = {(SHARED, k): first.efficiency(k) for k in shared_keys}
    for fam, (base, _) in groups.items():
        values.update({(fam, k): base.efficiency(k) for k in family_keys})
    before = _errors(groups, values)
    sens = {p: _sensitivity(groups, values, p) for p in values}  # at the priors, once
    chosen, reasons = identifiable(sens, sum(len(runs) for _, runs in groups.values()))
    prior = dict(values)
    _fit_chosen(groups, values, chosen, sweeps, iters)
    chosen, reasons = _twins_for_bounds(groups, values, prior, sens, chosen, reasons, sweeps, iters)
    systems = _systems(groups, values)
    after = _errors(groups, values)
    out, offset = {}, 0
    for fam, (_, runs) in groups.items():
        n = len(runs)
        mine = lambda p: p[0] in (fam, SHARED)  # noqa: E731
        out[fam] = FitResult(systems[fam], {p[1]: values[p] for p in chosen if mine(p)},
                             {p[1]: why for p, why in reasons.items() if mine(p)}, n,
                             mean_abs(before[offset:offset + n]), mean_abs(after[offset:offset + n]))
        offset += n
    return out


def fit_system(system: SystemSpec, runs: Sequence[MeasuredRun], keys: Optional[Sequence[str]] = None, *,
               sweeps: int = 3, iters: int = 18) -> FitResult:
    """Fit the identifiable efficiencies of ``system`` (among ``keys``) to ``runs`` (what ``h3t-plan
    calibrate`` runs: one system, every fittable efficiency its own)."""
    keys = FITTABLE if keys is None else tuple(keys)
    keys = tuple(k for k in keys if k in system.efficiencies or k not in OPTIONAL_EFFICIENCIES)
    return fit_joint({system.efficiency_set or system.name: (system, runs)}, keys, (), sweeps=sweeps,
                     iters=iters)[system.efficiency_set or system.name]
