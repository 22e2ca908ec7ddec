"""Is a predicted MFU above anything published for that GPU family and precision?

The cost model is checked on the published runs of ``data/reference`` (those it is fitted on, ``published.py``, and
the held-out ones: Megatron-Bridge's and NeMo's long-sequence tables); a plan it prices above the best MFU any of those
runs reached on the same GPU family (``SystemSpec.efficiency_set``: A100 and A800 share a chip, H100/H800/H200
another, B200 a third) and precision lies where the model was never checked. Such a plan
is not refused (a better stack may get there), it is flagged: ``search`` and ``estimate`` print the ceiling
and the run that set it. The ceilings are computed from the same reference files with the one FLOPs formula
(:func:`h3t_ext.costmodel.mfu.mfu`, dense bf16 peak), so they cannot drift from the data.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from h3t_ext.costmodel.mfu import mfu
from h3t_ext.costmodel.published import published_runs
from h3t_ext.costmodel.published_bridge import FILES as BRIDGE_FILES, bridge_runs
from h3t_ext.costmodel.published_long_sequence import TABLES as LONG_SEQUENCE_TABLES, long_sequence_runs
from h3t_ext.costmodel.specs import get_system


@dataclass(frozen=True)
class MfuCeiling:
    """The best published MFU of one GPU family and precision, and the run that reached it."""

    efficiency_set: str
    precision: str
    mfu: float
    source: str
    """Published source (``published.py`` name)."""
    run: str
    """The run's label in that source."""
    gpu: str

    def describe(self) -> str:
        return f"{100 * self.mfu:.1f}% ({self.source}: {self.run}, {self.gpu})"


@dataclass(frozen=True)
class Plausibility:
    """A predicted MFU against the published ceiling of its GPU family and precision."""

    mfu: float
    ceiling: Optional[MfuCeiling]
    """None when no published run of that family and precision is in the reference data."""

    @property
    def above_ceiling(self) -> bool:
        return self.ceiling is not None and self.mfu > self.ceiling.mfu

    @property
    def verdict(self) -> str:
        """'above published ceiling', 'within published range' or 'no published run to compare'."""
        if self.ceiling is None:
            return "no published run to compare"
        return "above published ceiling" if self.above_ceiling else "within published range"

    def line(self) -> str:
        """One line for the CLI."""
        if self.ceiling is None:
            return f"MFU {100 * self.mfu:.1f}%: no published run of this GPU family and precision to compare with"
        if self.above_ceiling:
            return (f"MFU {100 * self.mfu:.1f}% is ABOVE the best published MFU for this GPU family and precision, "
                    f"{self.ceiling.describe()}: the cost model was never checked there")
        return f"MFU {100 * self.mfu:.1f}% is within the published range (best {self.ceiling.describe()})"

    def to_dict(self) -> dict:
        c = self.ceiling
        return {"verdict": self.verdict, "above_ceiling": self.above_ceiling,
                "published_mfu_ceiling": None if c is None else c.mfu,
                "ceiling_run": None if c is None else {"source": c.source, "run": c.run, "gpu": c.gpu,
                                                       "precision": c.precision}}


def _reference_runs():
    """(source, label, model, plan, system, tokens/s per GPU) of every published run in ``data/reference``: the
    fitted sources (``published.py``) and the held-out ones (Megatron-Bridge's and NeMo's long-sequence tables, each
    GPU's file)."""
    for r in published_runs():
        yield r.source, r.label, r.model, r.plan, r.system, r.tokens_per_s_per_gpu
    held_out = [(name, bridge_runs(gpu)) for gpu, name in BRIDGE_FILES.items()]
    held_out += [(name, long_sequence_runs(table)) for table, name in LONG_SEQUENCE_TABLES.items()]
    for name, runs in held_out:
        for r in runs:
            yield name.removesuffix(".json"), r.label, r.model, r.plan, get_system(r.system_name), r.tokens_per_s_per_gpu


@functools.lru_cache(maxsize=1)
def published_mfu_ceilings() -> dict[tuple[str, str], MfuCeiling]:
    """(efficiency set, precision) -> best published MFU, over every published run of ``data/reference``, fitted on
    or held out."""
    best: dict[tuple[str, str], MfuCeiling] = {}
    for source, label, model, plan, system, tokens in _reference_runs():
        key = (system.efficiency_set, plan.precision)
        value = mfu(model, plan.seq_length, tokens, system.peak_bf16_flops)
        if key not in best or value > best[key].mfu:
            best[key] = MfuCeiling(key[0], key[1], value, source, label, system.name)
    return best


def plausibility(predicted_mfu: float, efficiency_set: str, precision: str) -> Plausibility:
    """``predicted_mfu`` against the published ceiling of ``efficiency_set`` and ``precision``."""
    return Plausibility(predicted_mfu, published_mfu_ceilings().get((efficiency_set, precision)))


__all__ = ["MfuCeiling", "Plausibility", "plausibility", "published_mfu_ceilings"]
