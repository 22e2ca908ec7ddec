"""Rows of the ground-truth report (one per case: measured, predicted, ratio, rates), the JSON document and the
side-by-side table."""
from __future__ import annotations

import math
from typing import Optional

from groundtruth.cases import Case, Selection, case_to_dict, efficiency_key
from h3t_ext.costmodel.specs import SystemSpec

SCHEMA = "h3t-ground-truth/1"
ROW_KEYS = ("kind", "name", "group", "status", "why", "efficiency", "predicted_s", "measured_s", "ratio", "work",
            "work_unit", "predicted_rate", "measured_rate", "samples_s", "case")
"""Every row has these keys; ``measured_s``, ``ratio`` and ``measured_rate`` are null unless measured."""
STATUSES = ("planned", "measured", "skipped", "failed", "left_out")


def make_row(case: Case, system: SystemSpec, status: str, samples: tuple[float, ...] = (), why: str = "",
             measured_s: Optional[float] = None) -> dict:
    predicted = case.predict(system)
    work = case.work
    return {"kind": case.kind, "name": case.name, "group": case.group(), "status": status, "why": why,
            "efficiency": efficiency_key(case, system), "predicted_s": predicted, "measured_s": measured_s,
            "ratio": None if measured_s is None else measured_s / predicted, "work": work,
            "work_unit": case.work_unit, "predicted_rate": work / predicted,
            "measured_rate": None if not measured_s else work / measured_s, "samples_s": list(samples),
            "case": case_to_dict(case)}


def document(rows: list[dict], selection: Selection, system: SystemSpec, *, mode: str, device: str, warmup: int,
             repeats: int, meta: dict) -> dict:
    return {"schema": SCHEMA, "mode": mode, "device": device, "system": system.name,
            "efficiency_set": system.efficiency_set, "budget_s": selection.budget_s,
            "estimate_s": selection.estimate_s, "selection": selection.description,
            "gemm_pairs": [list(p) for p in selection.gemm_pairs],
            "timing": {"warmup": warmup, "repeats": repeats, "statistic": "median",
                       "clock": "wall clock (CPU)" if device == "cpu" else "CUDA events"},
            **meta, "rows": rows}


def _time(s: Optional[float]) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def _rate(x: Optional[float], unit: str) -> str:
    if x is None:
        return "-"
    return f"{x / 1e12:.4g} TFLOP/s" if unit == "flop" else f"{x / 1e9:.4g} GB/s"


def format_table(doc: dict) -> str:
    """The rows side by side (measured, predicted, ratio; achieved and predicted rate), then what was left out."""
    lines = [f"ground truth on {doc['device']} against the cost model's {doc['system']} ({doc['efficiency_set']} "
             f"efficiencies), {doc['mode']}; median of {doc['timing']['repeats']} after {doc['timing']['warmup']} "
             f"warm-up ({doc['timing']['clock']})",
             f"subset: {doc['selection']}",
             f"{'measurement':58s} {'measured':>11s} {'predicted':>11s} {'ratio':>6s} {'meas. rate':>14s} "
             f"{'pred. rate':>14s}  status"]
    left = 0
    for r in doc["rows"]:
        if r["status"] == "left_out":
            left += 1
            continue
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        note = r["status"] + (f" ({r['why']})" if r["why"] else "")
        lines.append(f"{r['name']:58s} {_time(r['measured_s']):>11s} {_time(r['predicted_s']):>11s} {ratio:>6s} "
                     f"{_rate(r['measured_rate'], r['work_unit']):>14s} {_rate(r['predicted_rate'], r['work_unit']):>14s}"
                     f"  {note}")
    measured = [r for r in doc["rows"] if r["status"] == "measured"]
    within = sum(abs(r["ratio"] - 1) <= 0.10 for r in measured)
    lines.append(f"{len(measured)} measured, {within} within 10% of the model; {left} left out by the budget "
                 f"(listed in --json with status left_out)")
    return "\n".join(lines)


def check_row(r: dict) -> None:
    """A row of a report as ``make_row`` writes it (ValueError naming the key otherwise)."""
    for k in ROW_KEYS:
        if k not in r:
            raise ValueError(f"row {r.get('name', '?')!r}: missing key {k!r}")
    if r["status"] not in STATUSES:
        raise ValueError(f"row {r['name']!r}: status must be one of {', '.join(STATUSES)}, got {r['status']!r}")
    if not (isinstance(r["predicted_s"], float) and math.isfinite(r["predicted_s"]) and r["predicted_s"] > 0):
        raise ValueError(f"row {r['name']!r}: predicted_s must be a positive finite number, got {r['predicted_s']!r}")
