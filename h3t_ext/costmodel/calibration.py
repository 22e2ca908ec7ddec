"""Figures of the cost model against the published reference (h3t_ext/data/reference/atc24_calibration.json).

Used by tests/integration/test_calibration.py and scripts/costmodel_calibration.py; pure arithmetic.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from typing import Mapping, Optional

from h3t_ext.costmodel.estimate import estimate
from h3t_ext.costmodel.mfu import mfu
from h3t_ext.costmodel.offload import solve_offload_alpha
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.published import atc24_memory_budget_bytes, settings, stated_switches
from h3t_ext.costmodel.specs import DATA_DIR, ModelSpec, SystemSpec, get_system

REFERENCE = DATA_DIR / "reference" / "atc24_calibration.json"


@functools.lru_cache(maxsize=1)
def reference() -> dict:
    """The published measurements."""
    with open(REFERENCE, encoding="utf-8") as f:
        return json.load(f)


def reference_model(name: str) -> ModelSpec:
    """A model of the reference file (its own shape, e.g. vocabulary 32004)."""
    return ModelSpec(name=name.lower(), **reference()["models"][name.lower()])


@dataclass(frozen=True)
class ThroughputRow:
    """One row of the throughput table as a plan (alpha as published) and its measurement."""

    plan: Plan
    published_alpha: float
    tokens_per_s: float


def throughput_rows() -> list[ThroughputRow]:
    rows = []
    for r in reference()["throughput_table"]:
        plan = Plan(
            num_gpus=int(r["num_gpus"]), seq_length=int(r["seq_length"]), global_batch_size=int(r["global_batch"]),
            tensor_model_parallel_size=int(r["t"]), context_parallel_size=int(r["c"]),
            pipeline_model_parallel_size=int(r["p"]), num_layers_per_virtual_pipeline_stage=int(r["l"]),
            ckpt=r["ckpt"], offload_alpha=float(r["alpha"]), **settings()["sources"]["atc24_65b"]["plan"],
        )
        rows.append(ThroughputRow(plan, float(r["alpha"]), float(r["tokens_per_s"])))
    return rows


def memory_points() -> list[tuple[Plan, Optional[int]]]:
    """(plan, measured max_memory_allocated or None for out-of-memory) of the memory-vs-alpha figure."""
    ref = reference()["memory_vs_alpha"]
    cfg = {k: v for k, v in ref["config"].items() if k not in ("model", "gpu")}
    run = settings()["sources"]["atc24_65b"]["plan"]
    return [(Plan(**{**stated_switches(run, cfg["tensor_model_parallel_size"]), **cfg}, ckpt=pt["ckpt"], offload_alpha=float(pt["alpha"])), pt["bytes"])
            for pt in ref["points"]]


def with_efficiencies(system: SystemSpec, overrides: Mapping[str, float]) -> SystemSpec:
    """Copy of ``system`` with some efficiencies replaced (for fitting)."""
    return replace(system, efficiencies={**system.efficiencies, **overrides})


@dataclass(frozen=True)
class CalibrationReport:
    alpha_errors: tuple[float, ...]
    """solve_offload_alpha(mode='auto') minus published alpha, per throughput row."""
    memory_errors: tuple[float, ...]
    """Relative error of the predicted peak (max over stages) for the measured memory points."""
    oom_predicted: tuple[bool, ...]
    """For the out-of-memory points: predicted over the memory budget."""
    tokens_errors: tuple[float, ...]
    """Relative error of tokens/s per throughput row (at the published alpha)."""
    demo_mfu: tuple[tuple[float, float], ...]
    """(computed, published) MFU of the 7B demo rows."""

    @property
    def alpha_max_error(self) -> float:
        return max(abs(e) for e in self.alpha_errors)

    @property
    def memory_max_error(self) -> float:
        return max(abs(e) for e in self.memory_errors)

    @property
    def tokens_mae(self) -> float:
        return sum(abs(e) for e in self.tokens_errors) / len(self.tokens_errors)


def calibration_report(system: Optional[SystemSpec] = None) -> CalibrationReport:
    """Compare the model with every published number of the reference file."""
    h800 = get_system("h800") if system is None else system
    m65 = reference_model("llama-65b")
    budget = atc24_memory_budget_bytes()
    alpha_err, tok_err = [], []
    for row in throughput_rows():
        alpha = solve_offload_alpha(m65, row.plan, h800, memory_budget_bytes=budget, mode="auto")
        alpha_err.append(alpha - row.published_alpha)
        est = estimate(m65, row.plan, h800, memory_budget_bytes=budget, timeline=False)
        tok_err.append(est.tokens_per_second / row.tokens_per_s - 1.0)
    mem_err, oom = [], []
    for plan, measured in memory_points():
        peak = estimate(m65, plan, h800).peak_memory_bytes
        if measured is None:
            oom.append(peak > budget)
        else:
            mem_err.append(peak / measured - 1.0)
    demo = []
    m7 = reference_model("llama-7b")
    for r in reference()["demo7b"]:
        peak = get_system(r["gpu"]).peak_bf16_flops
        demo.append((mfu(m7, int(r["seq_length"]), float(r["tokens_per_s_per_gpu"]), peak), float(r["mfu"])))
    return CalibrationReport(tuple(alpha_err), tuple(mem_err), tuple(oom), tuple(tok_err), tuple(demo))


@functools.lru_cache(maxsize=1)
def _memory_reference() -> dict:
    with open(DATA_DIR / "reference" / "atc24_memory.json", encoding="utf-8") as f:
        return json.load(f)


@dataclass(frozen=True)
class MemoryRun:
    """One published run with its memory verdict: measured max_memory_allocated, or None when the source
    reports out of memory (or states no peak: ``ran`` tells which)."""

    label: str
    model: ModelSpec
    plan: Plan
    system: SystemSpec
    ran: bool
    measured_bytes: Optional[int] = None


def memory_verdict_runs() -> list[MemoryRun]:
    """Figure 7's 22 points and Table 8's rows (``data/reference/atc24_memory.json``) as plans on the H800."""
    ref = _memory_reference()
    fig7 = ref["fig7_memory_vs_alpha"]
    cfg = {k: v for k, v in fig7["config"].items() if k not in ("model", "gpu")}
    run = settings()["sources"]["atc24_65b"]["plan"]
    h800, m65 = get_system(fig7["config"]["gpu"]), reference_model(fig7["config"]["model"])
    out = []
    for ckpt in ("ours", "no"):
        for alpha, measured in fig7[ckpt].items():
            plan = Plan(**{**stated_switches(run, cfg["tensor_model_parallel_size"]), **cfg}, ckpt=ckpt,
                        offload_alpha=float(alpha))
            out.append(MemoryRun(f"Figure 7 ckpt={ckpt} alpha={alpha}", m65, plan, h800, measured is not None, measured))
    for r in ref["table8"]["rows"]:
        if r["method"] == "origin-megatron":  # stock Megatron's recompute, no alpha: not a plan of this runtime
            continue
        plan = Plan(num_gpus=r["num_gpus"], seq_length=r["seq_length"], global_batch_size=r["global_batch_size"],
                    tensor_model_parallel_size=r["t"], context_parallel_size=r["c"], pipeline_model_parallel_size=r["p"],
                    num_layers_per_virtual_pipeline_stage=r["l"], ckpt=r["ckpt"], offload_alpha=float(r["alpha"]),
                    **stated_switches(run, r["t"]))
        out.append(MemoryRun(f"Table 8 {r['method']}", reference_model(r["model"]), plan, h800,
                             r["tokens_per_s_per_gpu"] is not None))
    return out
