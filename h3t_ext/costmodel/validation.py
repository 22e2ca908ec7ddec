"""Leave-one-source-out check of the cost model on the published runs (``published.py``).

For each held-out source: the efficiencies of every GPU family are fitted (``fit.fit_system``) on the runs of
the other sources (and the training-only 7B demo), the held-out runs are predicted with no calibration on
them, and then ``calibrate`` is run on one row of the held-out source and the other rows are predicted.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Sequence

from h3t_ext.costmodel.fit import FitResult, MeasuredRun, fit_joint, fit_system, mean_abs, relative_errors, \
    with_efficiencies
from h3t_ext.costmodel.published import SOURCES, PublishedRun, published_runs
from h3t_ext.costmodel.specs import SystemSpec, prior_efficiencies
from h3t_ext.costmodel.uncertainty import COVERAGE, half_width_from_errors


def measured(runs: Sequence[PublishedRun]) -> list[MeasuredRun]:
    return [MeasuredRun(r.model, r.plan, r.tokens_per_s_per_gpu, r.label, r.system) for r in runs]


def neutral_start(system: SystemSpec) -> SystemSpec:
    """``system`` with every fittable efficiency at its prior (public benchmarks, ``priors`` of
    ``fitted_efficiencies.json``): the starting point of the leave-one-source-out fits, so that the data
    file's values (fitted on every source, the held-out one included) cannot leak into them."""
    return with_efficiencies(system, prior_efficiencies(system.efficiency_set))


def fit_families(runs: Sequence[PublishedRun], *, neutral: bool = False) -> dict[str, FitResult]:
    """One fit per efficiency set (GPU family) on its runs (from the data file's values, or from the middle
    of the plausible ranges with ``neutral``)."""
    groups: dict[str, list[PublishedRun]] = defaultdict(list)
    for r in runs:
        groups[r.system.efficiency_set].append(r)
    start = neutral_start if neutral else (lambda s: s)
    return fit_joint({fam: (start(rs[0].system), measured(rs)) for fam, rs in groups.items()})


def errors_with(runs: Sequence[PublishedRun], systems: Mapping[str, SystemSpec]) -> list[float]:
    """Relative tokens/s errors of ``runs`` priced with the efficiencies of ``systems`` (by family; a family
    without a fit keeps the data file's efficiencies)."""
    out = []
    for r in runs:
        fam = systems.get(r.system.efficiency_set, r.system)
        out.extend(relative_errors(measured([r]), fam))
    return out


@dataclass(frozen=True)
class HeldOut:
    """The figures of one held-out source."""

    source: str
    rows: int
    training_rows: int
    fitted: Mapping[str, Mapping[str, float]]
    """Efficiencies fitted on the other sources, by family."""
    mae_uncalibrated: float
    errors_uncalibrated: tuple[float, ...]
    mae_after_one_row: tuple[float, ...]
    """For each row used alone to calibrate: MAE on the other rows of the source."""

    @property
    def mae_after_one_row_mean(self) -> float:
        return sum(self.mae_after_one_row) / len(self.mae_after_one_row)

    @property
    def mae_after_one_row_worst(self) -> float:
        return max(self.mae_after_one_row)

    def to_dict(self) -> dict:
        return {"source": self.source, "rows": self.rows, "training_rows": self.training_rows,
                "fitted_on_other_sources": {k: dict(v) for k, v in self.fitted.items()},
                "mae_uncalibrated": self.mae_uncalibrated, "errors_uncalibrated": list(self.errors_uncalibrated),
                "mae_after_calibrating_on_one_row": list(self.mae_after_one_row),
                "mae_after_one_row_mean": self.mae_after_one_row_mean,
                "mae_after_one_row_worst": self.mae_after_one_row_worst}


def hold_out(source: str) -> HeldOut:
    """Fit on every other source, predict ``source``, then calibrate on each of its rows in turn."""
    train = [r for r in published_runs() if r.source != source]
    test = published_runs(source)
    fits = fit_families(train, neutral=True)
    systems = {fam: f.system for fam, f in fits.items()}
    errs = errors_with(test, systems)
    after = []
    for i, row in enumerate(test):
        base = systems.get(row.system.efficiency_set, neutral_start(row.system))
        one = fit_system(base, measured([row]))
        rest = [r for j, r in enumerate(test) if j != i]
        after.append(mean_abs(errors_with(rest, {row.system.efficiency_set: one.system})))
    return HeldOut(source, len(test), len(train), {fam: dict(f.fitted) for fam, f in fits.items()},
                   mean_abs(errs), tuple(errs), tuple(after))


def leave_one_source_out(sources: Sequence[str] = SOURCES) -> list[HeldOut]:
    return [hold_out(s) for s in sources]


def computed_uncertainty() -> dict:
    """What validation gives now (the content of ``data/uncertainty.json``, ``uncertainty.COVERAGE`` quantile of
    the held-out errors); runs the held-out fits."""
    held = leave_one_source_out()
    errors = [e for h in held for e in h.errors_uncalibrated]
    return {
        "relative_half_width": round(half_width_from_errors(errors), 6),
        "coverage": COVERAGE,
        "held_out_rows": len(errors),
        "computed_from": ("validation.leave_one_source_out(): pooled |relative tokens/s error| of every run of "
                          + ", ".join(h.source for h in held) + " predicted with efficiencies fitted on the other "
                          "sources (no calibration on the held-out one); nearest-rank quantile at the coverage"),
        "per_source_mae_uncalibrated": {h.source: round(h.mae_uncalibrated, 6) for h in held},
    }
