"""Megatron-Bridge's published dense DGX-H100 runs (``data/reference/megatron_bridge_h100.json``): the 25.11
container's Llama-3 70B and Llama-3.1 405B FP8 rows and the 2026 containers' rows of the same recipes, as typed records
with the Plan each ran. Nothing is fitted on them; they are the held-out check of the newest software stacks (the
``newer_stacks`` entry of ``data/uncertainty.json``, which ``h3t-plan estimate`` prints beside its interval)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from h3t_ext.costmodel.estimate import Estimate, estimate
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.specs import REFERENCE_DIR, ModelSpec, SystemSpec, get_model, get_system, reference_json

PATH = REFERENCE_DIR / "megatron_bridge_h100.json"
BRIDGE_SYSTEM = "h100-sxm"
"""The GPU every row ran on (DGX-H100)."""
FIRST_CONTAINER = "25.11"
"""The container of the file's ``rows`` (its ``source``); ``later_rows`` name their own."""
_NOT_PLAN = ("label", "model", "tokens_per_s_per_gpu", "model_tflops_per_s_per_gpu", "container", "archive_line",
             "note")


@dataclass(frozen=True)
class BridgeRun:
    """One published row and the plan it ran (the file's ``plan`` settings with the row's sizes, all in Plan's
    field names, which are Megatron's)."""

    label: str
    container: str
    model: ModelSpec
    plan: Plan
    tokens_per_s_per_gpu: float
    model_tflops_per_s_per_gpu: float
    note: Optional[str] = None
    """What is odd about the published row itself, where something is."""


@functools.lru_cache(maxsize=1)
def bridge_runs() -> tuple[BridgeRun, ...]:
    """Every row of the file: the 25.11 rows, then the later containers' in the file's order."""
    data = reference_json(PATH.name)
    out = []
    for row in (*data["rows"], *data["later_rows"]):
        plan = Plan(**{**data["plan"], **{k: v for k, v in row.items() if k not in _NOT_PLAN}})
        out.append(BridgeRun(row["label"], row.get("container", FIRST_CONTAINER), get_model(row["model"]), plan,
                             float(row["tokens_per_s_per_gpu"]), float(row["model_tflops_per_s_per_gpu"]),
                             row.get("note")))
    return tuple(out)


def held_out_errors(system: Optional[SystemSpec] = None) -> list[tuple[BridgeRun, Estimate, float]]:
    """(run, estimate, predicted / published tokens/s - 1) of every row, on ``system`` (default
    :data:`BRIDGE_SYSTEM` with its fitted efficiencies)."""
    system = get_system(BRIDGE_SYSTEM) if system is None else system
    out = []
    for run in bridge_runs():
        est = estimate(run.model, run.plan, system)
        out.append((run, est, est.tokens_per_second_per_gpu / run.tokens_per_s_per_gpu - 1))
    return out


__all__ = ["BRIDGE_SYSTEM", "BridgeRun", "FIRST_CONTAINER", "PATH", "bridge_runs", "held_out_errors"]
