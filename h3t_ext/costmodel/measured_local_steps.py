"""The driver's measured training steps with the local (eager) layer spec beside the cost model's estimates
(``data/reference/local_stack_steps.json``): what ``h3t-plan estimate`` says of a plan with ``--transformer-impl
local``, whose time it prices GPU-bound with TransformerEngine's fused element-wise kernels while the eager stack's
steps at ~1B are bound by the host's dispatch and run unfused kernels."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache

LOCAL_STACK_STEPS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                                      "reference", "local_stack_steps.json")


@dataclass(frozen=True)
class LocalStackStep:
    """One measured case: its ``h3t-plan estimate`` arguments (without ``--gpu``), the measured step and peak, and
    the estimate's when the file was written."""

    case: str
    estimate_args: tuple[str, ...]
    step_ms: float
    peak_gib: float
    estimate_ms: float
    estimate_gib: float
    reload_slots_gib: float = 0.0
    """The offload's two reload slots the runtime of the measurement kept to the optimizer step (until 2026-12-01;
    the model's two layers, 2 A / L), which the current runtime frees before it: 0 for a run without offload."""

    @property
    def time_ratio(self) -> float:
        return self.step_ms / self.estimate_ms

    @property
    def memory_ratio(self) -> float:
        """Measured over estimated peak, the estimate with the slots the measured runtime kept."""
        return self.peak_gib / (self.estimate_gib + self.reload_slots_gib)


@dataclass(frozen=True)
class LocalStackSteps:
    gpu: str
    source: str
    rows: tuple[LocalStackStep, ...]


@lru_cache(maxsize=1)
def local_stack_steps() -> LocalStackSteps:
    with open(LOCAL_STACK_STEPS_FILE) as f:
        doc = json.load(f)
    rows = tuple(LocalStackStep(case=r["case"], estimate_args=tuple(r["estimate_args"]), step_ms=r["step_ms"],
                                peak_gib=r["peak_gib"], estimate_ms=r["estimate_ms"], estimate_gib=r["estimate_gib"],
                                reload_slots_gib=r.get("reload_slots_gib", 0.0))
                 for r in doc["rows"])
    return LocalStackSteps(gpu=doc["gpu"], source=doc["source"], rows=rows)


__all__ = ["LOCAL_STACK_STEPS_FILE", "LocalStackStep", "LocalStackSteps", "local_stack_steps"]
