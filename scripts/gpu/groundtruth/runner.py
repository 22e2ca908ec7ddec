"""One ground-truth run: the selected cases measured in order (or only listed, ``--dry-run``), each made a row
with the model's prediction beside it; the budget is also enforced while running (cases after it are
``skipped``)."""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

from groundtruth.cases import CopyCase, GemmCase, Selection
from groundtruth.table import make_row
from h3t_ext.costmodel.specs import SystemSpec


def planned_rows(selection: Selection, system: SystemSpec) -> list[dict]:
    """``--dry-run``: every selected case as ``planned``, the others as ``left_out``, with the predictions."""
    return ([make_row(c, system, "planned") for c in selection.selected]
            + [make_row(c, system, "left_out") for c in selection.left_out])


def measured_rows(selection: Selection, system: SystemSpec, device: str, *, warmup: int, repeats: int,
                  budget_s: float, progress: Optional[Callable[[str], None]] = None) -> tuple[list[dict], dict]:
    """Measure the selected cases on ``device``; returns the rows and what the probe found."""
    from groundtruth.clocks import Sampler

    sampler = Sampler() if device == "cuda" else None
    with sampler if sampler is not None else contextlib.nullcontext():
        rows, meta = _measure_all(selection, system, device, warmup, repeats, budget_s, progress)
    if sampler is not None:  # the clocks the kernels ran at (short bursts between synchronizations)
        meta["clocks"] = sampler.record(with_samples=False)
    return rows, meta


def _measure_all(selection: Selection, system: SystemSpec, device: str, warmup: int, repeats: int, budget_s: float,
                 progress: Optional[Callable[[str], None]]) -> tuple[list[dict], dict]:
    from groundtruth.measure import Device, measure, probe

    start = time.monotonic()
    dev = Device(device)
    caps = probe(dev)
    partner = next((c for c in selection.selected if isinstance(c, GemmCase) and c.during_copy), None)
    rows = []
    for i, case in enumerate(selection.selected):
        if time.monotonic() - start > budget_s:
            rows.append(make_row(case, system, "skipped", why=f"--budget-s {budget_s:g} spent"))
            continue
        out = measure(dev, case, caps, system, warmup, repeats,
                      partner=partner if isinstance(case, CopyCase) else None)
        rows.append(make_row(out.case, system, out.status, out.samples, out.why, out.median_s))
        if progress is not None and (i % 50 == 0 or out.status == "failed"):
            progress(f"[{time.monotonic() - start:6.1f} s] {i + 1}/{len(selection.selected)} {out.case.name}: "
                     f"{out.status} {out.why}")
    rows += [make_row(c, system, "left_out") for c in selection.left_out]
    meta = {"fp8": caps.fp8 or "ran", "wgrad_fp32_accumulate": caps.fp32_accumulate,
            "wall_s": time.monotonic() - start}
    return rows, meta
