"""The cost model on the published runs held out from every fit: Megatron-Bridge's tables (``published_bridge``) and
NeMo's long-sequence tables (``published_long_sequence``), one file per GPU. The records stay in those modules, which
the MFU ceilings (``plausibility``) read without pricing anything; the pricing is here."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from h3t_ext.costmodel.estimate import Estimate, estimate
from h3t_ext.costmodel.published_bridge import BridgeRun, bridge_runs
from h3t_ext.costmodel.published_long_sequence import LongSequenceRun, long_sequence_runs
from h3t_ext.costmodel.specs import SystemSpec, get_system


def _errors(runs, system: Optional[SystemSpec], attention_backend: Optional[str] = None) -> list:
    """(run, estimate, predicted / published tokens/s - 1) of each of ``runs`` on ``system`` (default the GPU they ran
    on, with its shipped efficiencies), with their own plans or with ``attention_backend`` in them."""
    system = get_system(runs[0].system_name) if system is None else system
    out = []
    for run in runs:
        plan = run.plan if attention_backend is None else replace(run.plan, attention_backend=attention_backend)
        est = estimate(run.model, plan, system)
        out.append((run, est, est.tokens_per_second_per_gpu / run.tokens_per_s_per_gpu - 1))
    return out


def bridge_errors(system: Optional[SystemSpec] = None, gpu: str = "h100") -> list[tuple[BridgeRun, Estimate, float]]:
    """(run, estimate, predicted / published tokens/s - 1) of every Megatron-Bridge row of ``gpu``'s file, on
    ``system`` (default the GPU the rows ran on, with its shipped efficiencies)."""
    return _errors(bridge_runs(gpu), system)


def long_sequence_errors(system: Optional[SystemSpec] = None, *, attention_backend: Optional[str] = None,
                         table: str = "h100") -> list[tuple[LongSequenceRun, Estimate, float]]:
    """(run, estimate, predicted / published tokens/s - 1) of every row of NeMo's long-sequence ``table``, on
    ``system`` (default the GPU the rows ran on, with its shipped efficiencies), with the rows' own
    ``--attention-backend`` (auto: cuDNN's fused attention on Hopper and Blackwell) or the one given (``flash``:
    priced at FlashAttention's rate)."""
    return _errors(long_sequence_runs(table), system, attention_backend)


BLACKWELL_SYSTEMS = ("b200", "gb200", "gb300")
"""The systems :func:`blackwell_sources` has sources for."""


def blackwell_sources(gpu: str) -> dict[str, list[tuple]]:
    """The held-out sources of a Blackwell system (``b200``: Megatron-Bridge's DGX-B200 rows and NeMo's B200
    long-sequence table; ``gb200`` and ``gb300``: Megatron-Bridge's DGX-GB200 and DGX-GB300 rows), by source name, each
    as :func:`bridge_errors` or :func:`long_sequence_errors` gives it: what the family's interval and prior
    (``validation``) and scripts/blackwell_validation.py read."""
    if gpu == "b200":
        return {"megatron_bridge_b200": bridge_errors(gpu="b200"),
                "nemo_long_sequence_b200": long_sequence_errors(table="b200")}
    if gpu in ("gb200", "gb300"):
        return {f"megatron_bridge_{gpu}": bridge_errors(gpu=gpu)}
    raise ValueError(f"no Blackwell held-out sources for {gpu!r}; valid: {', '.join(BLACKWELL_SYSTEMS)}")


__all__ = ["BLACKWELL_SYSTEMS", "blackwell_sources", "bridge_errors", "long_sequence_errors"]
