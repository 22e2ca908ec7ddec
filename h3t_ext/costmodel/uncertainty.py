"""Prediction interval of the cost model's throughput, from its leave-one-source-out errors.

``validation.leave_one_source_out`` predicts every run of each published source with efficiencies fitted
on the other sources only. The pooled absolute relative errors of those held-out predictions are the
honest error of an uncalibrated estimate; the interval half-width is their nearest-rank ``COVERAGE``
quantile. It is stored in ``data/uncertainty.json`` (computed by ``validation.computed_uncertainty``, written
by ``scripts/costmodel_calibration.py --write-uncertainty``, with what it was computed from) so that estimates need not re-run the fits;
tests/integration/test_calibration.py checks that the stored value equals what validation computes now.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Sequence

from h3t_ext.costmodel.specs import DATA_DIR

UNCERTAINTY_FILE = DATA_DIR / "uncertainty.json"
COVERAGE = 0.9
"""Fraction of the held-out predictions the interval covers (nearest rank over the pooled errors)."""


@dataclass(frozen=True)
class ThroughputUncertainty:
    """Relative half-width of the tokens/s (and so iteration time) prediction interval."""

    relative_half_width: float
    coverage: float
    held_out_rows: int
    computed_from: str
    newer_stacks_underprediction: float = 0.0
    """How much faster than predicted the newest published stacks ran, at most (dense: ``validation.newer_stacks``;
    0.0 where not measured, as for MoE models)."""
    transferred_from: str = ""
    """Where the interval is that of a GPU family priced with another family's efficiencies carried over
    (``efficiency_sets.transferred_efficiencies``): that other family; empty otherwise."""
    held_out_runs: str = ""
    """What the held-out runs of a carried-over family are (empty otherwise)."""

    def interval(self, value: float) -> tuple[float, float]:
        """(low, high) of a predicted value."""
        return value * (1.0 - self.relative_half_width), value * (1.0 + self.relative_half_width)

    def to_dict(self) -> dict:
        return {"relative_half_width": self.relative_half_width, "coverage": self.coverage,
                "held_out_rows": self.held_out_rows, "computed_from": self.computed_from}


def half_width_from_errors(errors: Sequence[float], coverage: float = COVERAGE) -> float:
    """Nearest-rank ``coverage`` quantile of |errors|."""
    if not errors:
        raise ValueError("no held-out errors")
    ranked = sorted(abs(e) for e in errors)
    return ranked[max(0, math.ceil(coverage * len(ranked)) - 1)]


@functools.lru_cache(maxsize=None)
def throughput_uncertainty(moe: bool = False, efficiency_set: str = "") -> ThroughputUncertainty:
    """The stored interval (``data/uncertainty.json``); ``moe``: that of mixture-of-experts models, from the published
    MoE runs nothing was fitted to (its ``moe`` entry, written by ``scripts/moe_validation.py --write-uncertainty``).
    For a GPU family priced with another family's efficiencies carried over (its ``transferred`` entry, from that
    family's held-out published runs), the wider of the two."""
    with open(UNCERTAINTY_FILE, encoding="utf-8") as f:
        d = json.load(f)
    newer = 0.0 if moe else float(d["newer_stacks"]["max_underprediction"])
    entry = d["moe"] if moe else d
    base = ThroughputUncertainty(float(entry["relative_half_width"]), float(entry["coverage"]),
                                 int(entry["held_out_rows"]), str(entry["computed_from"]), newer)
    t = d.get("transferred", {}).get(efficiency_set)
    if t is None:
        return base
    carried = ThroughputUncertainty(float(t["relative_half_width"]), float(t["coverage"]), int(t["held_out_rows"]),
                                    str(t["computed_from"]), 0.0, str(t["from"]), str(t["runs"]))
    return carried if carried.relative_half_width >= base.relative_half_width else base
