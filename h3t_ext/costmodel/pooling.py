"""How far a calibration on a few measured runs should move the cost model: partial pooling.

A run's error against the model is two things: the offset of its cluster and software stack, common to all its
runs (clocks under the power limit, the kernels' versions, the network), and the run's own deviation (the shape
terms the model misprices, run-to-run noise). The published sources show both: each source's held-out errors
(``validation``: efficiencies fitted on the other sources) have a mean of their own and a spread about it. One
run cannot tell its cluster's offset from its own deviation, so fitting the efficiencies until that run is
matched exactly carries its deviation into every other prediction: on the published sources, a calibration on
one row moved the other rows further from their measurements than no calibration did on two sources of four.

The standard answer is the random-effects model: a source's error is ``e = b + eps`` with the offset ``b`` drawn
with variance ``tau^2`` across sources and the deviation ``eps`` with variance ``sigma^2`` within one. The best
linear predictor of ``b`` from the mean error of ``n`` runs weighs it by ``w_n = tau^2 / (tau^2 + sigma^2 / n)``
(so one run counts about a third, ten runs nearly fully). ``tau`` and ``sigma`` are estimated by moments from the
held-out errors of the published sources (``prior_from_errors``) and stored with the prediction interval in
``data/uncertainty.json``; ``pooled`` moves each fitted efficiency from its prior value by ``w_n`` of the way
in log space (the time is close to a power of each efficiency, so this moves the log time by ``w_n`` of the
fit's move).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from h3t_ext.costmodel.specs import SystemSpec
from h3t_ext.costmodel.uncertainty import UNCERTAINTY_FILE

PRIOR_KEY = "calibration_prior"
"""The prior's key in ``uncertainty.UNCERTAINTY_FILE``, beside the prediction interval."""


@dataclass(frozen=True)
class CalibrationPrior:
    """The spread of the model's errors across clusters (``between_source_sd``) and within one
    (``within_source_sd``), as relative tokens/s errors."""

    between_source_sd: float
    within_source_sd: float
    sources: int
    rows: int
    computed_from: str = ""

    def weight(self, runs: int) -> float:
        """Share of ``runs`` measured runs' fit that a calibration keeps: ``tau^2 / (tau^2 + sigma^2 / runs)``."""
        if runs < 1:
            raise ValueError(f"a calibration needs at least one run, got {runs}")
        tau2, sigma2 = self.between_source_sd ** 2, self.within_source_sd ** 2
        if tau2 + sigma2 == 0.0:
            return 1.0
        return tau2 / (tau2 + sigma2 / runs)

    def to_dict(self) -> dict:
        return {"between_source_sd": self.between_source_sd, "within_source_sd": self.within_source_sd,
                "sources": self.sources, "rows": self.rows, "computed_from": self.computed_from}


def prior_from_errors(errors_by_source: Mapping[str, Sequence[float]], computed_from: str = "") -> CalibrationPrior:
    """Moment estimates of the random-effects model from held-out errors, one list per source.

    ``sigma^2`` is the pooled within-source variance (each source about its own mean, ``n - 1`` degrees of
    freedom each). A source's mean error has expectation 0 (the model was fitted elsewhere) and variance
    ``tau^2 + sigma^2 / n``, so ``tau^2`` is the mean of the squared source means less the mean of
    ``sigma^2 / n`` (at least 0)."""
    groups = {s: list(e) for s, e in errors_by_source.items() if e}
    if len(groups) < 2 or not any(len(e) >= 2 for e in groups.values()):
        raise ValueError("a calibration prior needs the errors of at least two sources, one with two rows or more")
    dof = sum(len(e) - 1 for e in groups.values())
    means = {s: sum(e) / len(e) for s, e in groups.items()}
    sigma2 = sum((x - means[s]) ** 2 for s, e in groups.items() for x in e) / dof
    tau2 = sum(m * m - sigma2 / len(groups[s]) for s, m in means.items()) / len(groups)
    return CalibrationPrior(round(math.sqrt(max(0.0, tau2)), 6), round(math.sqrt(sigma2), 6), len(groups),
                            sum(len(e) for e in groups.values()), computed_from)


def _between(prior: float, fitted: float, weight: float) -> float:
    if prior > 0.0 and fitted > 0.0:
        return math.exp((1.0 - weight) * math.log(prior) + weight * math.log(fitted))
    return prior + weight * (fitted - prior)


def pooled(system: SystemSpec, fitted: Mapping[str, float], weight: float) -> dict[str, float]:
    """The efficiencies a calibration applies: each fitted one moved from ``system``'s value by ``weight`` of
    the way in log space (linearly where either value is 0)."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"calibration weight must be in [0, 1], got {weight}")
    return {k: _between(system.efficiency(k), v, weight) for k, v in fitted.items()}


@functools.lru_cache(maxsize=None)
def calibration_prior(efficiency_set: str = "") -> CalibrationPrior:
    """The stored prior (``data/uncertainty.json``, written by ``scripts/costmodel_calibration.py
    --write-uncertainty`` from ``validation.computed_uncertainty``): the fitted sources' spread, or for a GPU family
    priced with another family's efficiencies carried over, the spread of its own held-out published runs (its
    ``transferred`` entry), which is wider, so that its measured runs move it further."""
    with open(UNCERTAINTY_FILE, encoding="utf-8") as f:
        stored = json.load(f)
    d = stored.get("transferred", {}).get(efficiency_set, stored)[PRIOR_KEY]
    return CalibrationPrior(float(d["between_source_sd"]), float(d["within_source_sd"]), int(d["sources"]),
                            int(d["rows"]), str(d["computed_from"]))
