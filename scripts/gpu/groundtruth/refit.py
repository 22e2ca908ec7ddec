"""``--refit REPORT.json``: the efficiency each measured row implies, next to the value the cost model uses now.

Per measured row: the efficiency it identifies (``cases.efficiency_key``), the value of it with which the
model's own prediction equals the measurement (``cases.implied_efficiency``: bisection, so the tile and wave
quantization, the thin-K overhead and the launch cost stay the model's), and the achieved fraction of the
datasheet peak (each row inverts one efficiency with the others at their current values: an FP8 tile's
prologue and epilogue run at the bf16 rate, so the FP8 rows' implied rate assumes the current bf16 one;
measured rate / peak: FLOP/s over the bf16 or FP8 peak, bytes/s over the HBM or PCIe
bandwidth). Rows are summarised by group (GEMM bf16 / FP8, attention by backend, element-wise, copies) and
efficiency: count, median and range of the implied values, against the current value (and where it comes
from: the family's set or ``shared`` in ``h3t_ext/data/fitted_efficiencies.json``), its prior and plausible
range. Below it, the GEMM rows' own form (``gemm_form``: call cost, rate and exposed output traffic). Nothing
is written: the refit itself (``scripts/costmodel_calibration.py --fit``, kept
cross-validated on the published sources) is the lead's decision.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Optional

from groundtruth.cases import case_from_dict, efficiency_key, implied_efficiency
from groundtruth.gemm_form import format_forms
from groundtruth.table import SCHEMA
from h3t_ext.costmodel.efficiency_sets import FITTED_EFFICIENCIES_FILE, plausible_ranges, prior_efficiencies
from h3t_ext.costmodel.specs import SystemSpec, get_system


@dataclass(frozen=True)
class Implied:
    """What one group of measured rows says about one efficiency."""

    group: str
    efficiency: str
    rows: int
    implied: tuple[float, ...]
    """The implied values of the rows where one exists (launch-bound rows have none)."""
    achieved_fraction: float
    """Median of measured rate / the datasheet peak the efficiency is a fraction of (1 for the non-fractions)."""
    current: float
    origin: str
    prior: Optional[float]
    plausible: Optional[tuple[float, float]]

    @property
    def median(self) -> Optional[float]:
        return statistics.median(self.implied) if self.implied else None


def _peak(key: str, system: SystemSpec) -> Optional[float]:
    return {"gemm_peak_fraction": system.peak_bf16_flops, "gemm_fp8_peak_fraction": system.peak_fp8_flops,
            "attention_peak_fraction": system.peak_bf16_flops, "hbm_fraction": system.hbm_bandwidth,
            "pcie_fraction": system.pcie_bandwidth}.get(key)


def _origin(key: str, system: SystemSpec) -> str:
    with open(FITTED_EFFICIENCIES_FILE, encoding="utf-8") as f:
        sets = json.load(f)["efficiencies"]
    own = system.efficiency_set
    return f"fitted_efficiencies.json '{own}'" if key in sets.get(own, {}) else "fitted_efficiencies.json 'shared'"


def load_report(path: str, flag: str = "--refit") -> dict:
    """A ground-truth report; ValueError naming ``flag``, the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{flag} {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"{flag} {path}: field 'schema' must be {SCHEMA!r} (a report of scripts/gpu/ground_truth.py)")
    for k in ("system", "rows"):
        if k not in doc:
            raise ValueError(f"{flag} {path}: missing field {k!r}")
    return doc


def refit(doc: dict) -> list[Implied]:
    """The summary of every (group, efficiency) with measured rows, in the report's order."""
    system = get_system(doc["system"])
    priors, ranges = prior_efficiencies(system.efficiency_set), plausible_ranges()
    groups: dict[tuple[str, str], list[tuple[Optional[float], Optional[float]]]] = {}
    for r in doc["rows"]:
        if r.get("status") != "measured" or not r.get("measured_s"):
            continue
        case = case_from_dict(r["case"])
        key = efficiency_key(case, system)
        value = implied_efficiency(case, system, key, float(r["measured_s"]))
        peak = _peak(key, system)
        achieved = case.work / float(r["measured_s"]) / peak if peak else None
        groups.setdefault((case.group(), key), []).append((value, achieved))
    out = []
    for (group, key), vals in groups.items():
        implied = tuple(v for v, _ in vals if v is not None)
        achieved = [a for _, a in vals if a is not None]
        out.append(Implied(group, key, len(vals), implied, statistics.median(achieved) if achieved else 1.0,
                           system.efficiency(key), _origin(key, system), priors.get(key), ranges.get(key)))
    return out


def format_refit(doc: dict, summary: list[Implied]) -> str:
    lines = [f"efficiencies implied by {sum(s.rows for s in summary)} measured rows on {doc.get('device', '?')} "
             f"(cost model: {doc['system']}, set {get_system(doc['system']).efficiency_set}); nothing written",
             f"{'group':24s} {'efficiency':24s} {'rows':>4s} {'implied median':>14s} {'range':>15s} "
             f"{'of peak':>7s} {'current':>8s} {'prior':>6s} {'plausible':>11s}  source"]
    for s in summary:
        rng = f"{min(s.implied):.3f}-{max(s.implied):.3f}" if s.implied else "-"
        med = "-" if s.median is None else f"{s.median:.4f}"
        flag = ""
        if s.median is not None and s.plausible and not s.plausible[0] <= s.median <= s.plausible[1]:
            flag = "  OUTSIDE the plausible range"
        undetermined = s.rows - len(s.implied)
        if undetermined:
            flag += f"  ({undetermined} row(s) launch-bound or out of reach: no implied value)"
        prior = "-" if s.prior is None else f"{s.prior:.3f}"
        plaus = "-" if s.plausible is None else f"[{s.plausible[0]:g}, {s.plausible[1]:g}]"
        lines.append(f"{s.group:24s} {s.efficiency:24s} {s.rows:4d} {med:>14s} {rng:>15s} "
                     f"{s.achieved_fraction:7.3f} {s.current:8.4f} {prior:>6s} {plaus:>11s}  {s.origin}{flag}")
    system = get_system(doc["system"])
    form = format_forms(doc, system.peak_bf16_flops, system.peak_fp8_flops)
    return "\n".join(lines + ([form] if "\n" in form else []))
