"""Leave-one-source-out check of the cost model on the published runs (``published.py``).

For each held-out source: the efficiencies of every GPU family are fitted (``fit.fit_system``) on the runs of
the other sources (and the training-only 7B demo), the held-out runs are predicted with no calibration on
them, and then ``calibrate`` is run on one row of the held-out source and the other rows are predicted. The
calibration is pooled as ``h3t-plan calibrate`` pools it (``pooling``), with a prior estimated from the other
sources alone: each of them predicted by fits that saw neither it nor the held-out source.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Sequence

from h3t_ext.costmodel.fit import FitResult, MeasuredRun, fit_joint, fit_system, mean_abs, relative_errors, \
    with_efficiencies
from h3t_ext.costmodel.pooling import PRIOR_KEY, CalibrationPrior, pooled, prior_from_errors
from h3t_ext.costmodel.published import SOURCES, PublishedRun, published_runs
from h3t_ext.costmodel import held_out
from h3t_ext.costmodel.published_moe import held_out_errors
from h3t_ext.costmodel.efficiency_sets import prior_efficiencies, transferred_source
from h3t_ext.costmodel.specs import SystemSpec
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


def uncalibrated_errors(source: str, also_excluded: Sequence[str] = ()) -> list[float]:
    """Relative tokens/s errors of ``source``'s runs priced with efficiencies fitted on every run of the other
    sources (less ``also_excluded``), from the priors; a family no training run identifies stays at its
    priors."""
    fits = _fits_without(frozenset({source, *also_excluded}))
    return _priced(published_runs(source), {fam: f.system for fam, f in fits.items()})


@functools.lru_cache(maxsize=None)
def _fits_without(excluded: frozenset[str]) -> Mapping[str, FitResult]:
    """The family fits on every published run outside the ``excluded`` sources (a few seconds each; the
    nested held-out fits share them: leaving out a and b is leaving out b and a)."""
    return fit_families([r for r in published_runs() if r.source not in excluded], neutral=True)


def _priced(test: Sequence[PublishedRun], systems: Mapping[str, SystemSpec]) -> list[float]:
    """``errors_with`` where a family without a fit is priced at its priors (never the data file's values,
    which were fitted on every source)."""
    return errors_with(test, {r.system.efficiency_set: systems.get(r.system.efficiency_set, neutral_start(r.system))
                              for r in test})


def prior_without(source: str, sources: Sequence[str] = SOURCES) -> CalibrationPrior:
    """The calibration prior ``source``'s held-out calibration uses: the held-out errors of the other sources,
    each fitted without it and without ``source``."""
    others = [s for s in sources if s != source]
    return prior_from_errors({s: uncalibrated_errors(s, (source,)) for s in others},
                             f"held-out errors of {', '.join(others)} (fits without {source})")


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
    """For each row used alone to calibrate (pooled, as ``h3t-plan calibrate`` does): MAE on the other rows."""
    one_row_weight: float
    """The pooling weight of one row, from the prior of the other sources."""
    mae_after_one_row_full_weight: tuple[float, ...]
    """The same with the one row's fit taken whole (weight 1)."""
    errors_after_one_row: tuple[float, ...]
    """Every pooled prediction's relative error, each calibration row in turn (rows x (rows - 1))."""

    @property
    def mae_after_one_row_mean(self) -> float:
        return sum(self.mae_after_one_row) / len(self.mae_after_one_row)

    @property
    def mae_after_one_row_worst(self) -> float:
        return max(self.mae_after_one_row)

    @property
    def mae_after_one_row_full_weight_mean(self) -> float:
        return sum(self.mae_after_one_row_full_weight) / len(self.mae_after_one_row_full_weight)

    def to_dict(self) -> dict:
        return {"source": self.source, "rows": self.rows, "training_rows": self.training_rows,
                "fitted_on_other_sources": {k: dict(v) for k, v in self.fitted.items()},
                "mae_uncalibrated": self.mae_uncalibrated, "errors_uncalibrated": list(self.errors_uncalibrated),
                "mae_after_calibrating_on_one_row": list(self.mae_after_one_row),
                "mae_after_one_row_mean": self.mae_after_one_row_mean,
                "mae_after_one_row_worst": self.mae_after_one_row_worst,
                "one_row_weight": self.one_row_weight,
                "mae_after_one_row_full_weight": list(self.mae_after_one_row_full_weight),
                "mae_after_one_row_full_weight_mean": self.mae_after_one_row_full_weight_mean}


def hold_out(source: str, sources: Sequence[str] = SOURCES) -> HeldOut:
    """Fit on every other source, predict ``source``, then calibrate on each of its rows in turn (pooled with
    the prior of the other sources, and whole)."""
    train = [r for r in published_runs() if r.source != source]
    test = published_runs(source)
    fits = _fits_without(frozenset({source}))
    systems = {fam: f.system for fam, f in fits.items()}
    errs = _priced(test, systems)
    weight = prior_without(source, sources).weight(1)
    after, whole, errors_after = [], [], []
    for i, row in enumerate(test):
        fam = row.system.efficiency_set
        base = systems.get(fam, neutral_start(row.system))
        one = fit_system(base, measured([row]))
        rest = [r for j, r in enumerate(test) if j != i]
        errors_after.append(errors_with(rest, {fam: with_efficiencies(base, pooled(base, one.fitted, weight))}))
        after.append(mean_abs(errors_after[-1]))
        whole.append(mean_abs(errors_with(rest, {fam: one.system})))
    return HeldOut(source, len(test), len(train), {fam: dict(f.fitted) for fam, f in fits.items()},
                   mean_abs(errs), tuple(errs), tuple(after), weight, tuple(whole),
                   tuple(e for errs_i in errors_after for e in errs_i))


def leave_one_source_out(sources: Sequence[str] = SOURCES) -> list[HeldOut]:
    return [hold_out(s, sources) for s in sources]


def computed_uncertainty() -> dict:
    """What validation gives now (the content of ``data/uncertainty.json``, ``uncertainty.COVERAGE`` quantile of
    the held-out errors, and the calibration prior of ``pooling``); runs the held-out fits."""
    by_source = {s: uncalibrated_errors(s) for s in SOURCES}
    errors = [e for errs in by_source.values() for e in errs]
    prior = prior_from_errors(by_source, "validation.uncalibrated_errors() of every source: moment estimates of the "
                                         "random-effects model (pooling.prior_from_errors)")
    return {
        "relative_half_width": round(half_width_from_errors(errors), 6),
        "coverage": COVERAGE,
        "held_out_rows": len(errors),
        "computed_from": ("validation.uncalibrated_errors(): pooled |relative tokens/s error| of every run of "
                          + ", ".join(by_source) + " predicted with efficiencies fitted on the other "
                          "sources (no calibration on the held-out one); nearest-rank quantile at the coverage"),
        "per_source_mae_uncalibrated": {s: round(mean_abs(e), 6) for s, e in by_source.items()},
        PRIOR_KEY: prior.to_dict(),
        "newer_stacks": newer_stacks(),
        "moe": moe_uncertainty(),
        "transferred": transferred_uncertainty(),
    }


def newer_stacks() -> dict:
    """How much faster than predicted the newest published software stacks ran: the largest under-prediction of
    Megatron-Bridge's DGX-H100 rows (``held_out.bridge_errors``: 2025-26 containers, none fitted on), which
    the fitted sources' interval does not cover."""
    rows = held_out.bridge_errors()
    errors = [e for _, _, e in rows]
    return {"max_underprediction": round(max(0.0, -min(errors)), 6), "rows": len(errors),
            "computed_from": "held_out.bridge_errors(): predicted / published tokens/s - 1 of the "
                             "Megatron-Bridge DGX-H100 rows (data/reference/megatron_bridge_h100.json, containers "
                             + ", ".join(sorted({run.container for run, _, _ in rows}))
                             + "), with the data file's efficiencies; the most negative, as a positive fraction"}


def held_out_record(label: str, published_tokens_per_s_per_gpu: float, est, error: float) -> dict:
    """One held-out published run against its estimate, as the validation scripts print and emit it (``--json``)."""
    return {"label": label, "published_tokens_per_s_per_gpu": published_tokens_per_s_per_gpu,
            "predicted_tokens_per_s_per_gpu": est.tokens_per_second_per_gpu, "error": error,
            "peak_memory_gib": est.peak_memory_bytes / 2**30, "fits": est.fits}


def transferred_uncertainty() -> dict:
    """The prediction interval of each GPU family priced with another family's efficiencies carried over
    (``efficiency_sets.transferred_efficiencies``), from its held-out published runs (none fitted on), the
    ``COVERAGE`` quantile of their |errors|: Blackwell's (B200) from the Megatron-Bridge DGX-B200 rows and NeMo's B200
    long-sequence table, Grace Blackwell's (GB200) and Grace Blackwell Ultra's (GB300) from the Megatron-Bridge
    DGX-GB200 and DGX-GB300 rows. The calibration prior of Blackwell is its two sources' spread; each Grace family's is
    the spread of every Blackwell source up to its own (one source alone has no between-source spread: the transfer's
    offset on a new chip is what its runs measure)."""
    b200, gb200, gb300 = ({source: [e for _, _, e in rows] for source, rows in held_out.blackwell_sources(gpu).items()}
                          for gpu in held_out.BLACKWELL_SYSTEMS)
    families = {
        "blackwell": (b200, b200, "published DGX-B200 runs (Megatron-Bridge 25.09-25.11, NeMo 25.04's long-sequence "
                                  "table)",
                      "held_out.bridge_errors(gpu='b200') and held_out.long_sequence_errors(table='b200'): |relative "
                      "tokens/s error| of the published DGX-B200 runs (data/reference/megatron_bridge_b200.json, "
                      "nemo_long_sequence_b200.json), none fitted on; nearest-rank quantile at the coverage",
                      "the held-out errors of the two B200 sources"),
        "grace-blackwell": (gb200, {**b200, **gb200},
                            "published DGX-GB200 runs (Megatron-Bridge 25.09-26.06)",
                            "held_out.bridge_errors(gpu='gb200'): |relative tokens/s error| of the published "
                            "DGX-GB200 runs (data/reference/megatron_bridge_gb200.json), none fitted on; nearest-rank "
                            "quantile at the coverage",
                            "the held-out errors of the three Blackwell sources (two B200, one GB200)"),
        "grace-blackwell-ultra": (gb300, {**b200, **gb200, **gb300},
                                  "published DGX-GB300 runs (Megatron-Bridge 25.11-26.06)",
                                  "held_out.bridge_errors(gpu='gb300'): |relative tokens/s error| of the published "
                                  "DGX-GB300 runs (data/reference/megatron_bridge_gb300.json), none fitted on; "
                                  "nearest-rank quantile at the coverage",
                                  "the held-out errors of the four Blackwell sources (two B200, one GB200, one GB300)"),
    }
    out = {}
    for family, (own, pooled_sources, runs, computed_from, prior_from) in families.items():
        errors = [e for errs in own.values() for e in errs]
        prior = prior_from_errors(pooled_sources, prior_from + ": moment estimates of the random-effects model "
                                                               "(pooling.prior_from_errors)")
        out[family] = {"relative_half_width": round(half_width_from_errors(errors), 6), "coverage": COVERAGE,
                       "held_out_rows": len(errors), "from": transferred_source(family), "runs": runs,
                       "computed_from": computed_from, PRIOR_KEY: prior.to_dict()}
    return out


def moe_uncertainty() -> dict:
    """The prediction interval of mixture-of-experts models: the ``COVERAGE`` quantile of the |errors| of the
    published MoE runs (``published_moe.held_out_errors``: nothing of the MoE terms is fitted, every row is held
    out)."""
    errors = [e for _, _, e in held_out_errors()]
    return {"relative_half_width": round(half_width_from_errors(errors), 6), "coverage": COVERAGE,
            "held_out_rows": len(errors),
            "computed_from": "published_moe.held_out_errors(): |relative tokens/s error| of the published "
                             "Megatron-Core MoE runs on H100 (data/reference/moe_published.json), none fitted on; "
                             "nearest-rank quantile at the coverage"}
