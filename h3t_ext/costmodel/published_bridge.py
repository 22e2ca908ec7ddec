"""Megatron-Bridge's published dense pre-training runs, as typed records with the Plan each ran, one file of
``data/reference`` per GPU:

* ``h100`` (``megatron_bridge_h100.json``): the 25.11 container's Llama-3 8B, 70B and Llama-3.1 405B FP8 rows on
  DGX-H100, and the 25.09 and 2026 containers' rows of the same recipes: the held-out check of the newest software
  stacks (the ``newer_stacks`` entry of ``data/uncertainty.json``, which ``h3t-plan estimate`` prints beside its
  interval);
* ``b200`` (``megatron_bridge_b200.json``): the 25.09 and 25.11 containers' Llama-3 8B and Llama-3.1 405B rows on
  DGX-B200, per-tensor current scaling and MXFP8: with NeMo's B200 long-sequence table, the check of the Blackwell
  efficiencies carried over from Hopper (the ``transferred`` entry of ``data/uncertainty.json``);
* ``gb200`` (``megatron_bridge_gb200.json``): the same containers' Llama-3 8B, 70B (Megatron FSDP with
  TransformerEngine's activation offload, and a pipeline) and Llama-3.1 405B rows on DGX-GB200 (NVL72), and the 2026
  containers' rows of the same recipes: the check of the Grace Blackwell efficiencies, carried over from Hopper by the
  GB200's own matmul ceilings;
* ``gb300`` (``megatron_bridge_gb300.json``): the 25.11 to 26.06 containers' Llama-3 8B, 70B and Llama-3.1 405B rows on
  DGX-GB300 (Blackwell Ultra, NVL72): the check of the GB200's efficiencies taken as they are on a GB300.

Nothing is fitted on them; ``held_out.bridge_errors`` prices them."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from h3t_ext.ckpt import Recompute
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.specs import REFERENCE_DIR, ModelSpec, get_model, reference_json

FILES = {"h100": "megatron_bridge_h100.json", "b200": "megatron_bridge_b200.json",
         "gb200": "megatron_bridge_gb200.json", "gb300": "megatron_bridge_gb300.json"}
"""Each GPU's file in ``data/reference`` (its ``system`` names the GPU every row ran on)."""
PATH = REFERENCE_DIR / FILES["h100"]
BRIDGE_SYSTEM = "h100-sxm"
"""The GPU the ``h100`` file's rows ran on (DGX-H100)."""
FIRST_CONTAINER = "25.11"
"""The container of a row that names none (the ``h100`` file's ``rows``, its ``source``'s); its ``later_rows`` and
every ``b200`` row name their own."""
_NOT_PLAN = ("label", "model", "tokens_per_s_per_gpu", "model_tflops_per_s_per_gpu", "container", "archive_line",
             "note")
_RECOMPUTE = ("recompute_granularity", "recompute_method", "recompute_num_layers")
"""A row's Megatron recompute fields, which Plan holds as one :class:`~h3t_ext.ckpt.Recompute`."""


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
    system_name: str = BRIDGE_SYSTEM
    """The GPU the row ran on (its file's ``system``)."""


@functools.lru_cache(maxsize=None)
def bridge_runs(gpu: str = "h100") -> tuple[BridgeRun, ...]:
    """Every row of one GPU's file (:data:`FILES`): its ``rows``, ``earlier_rows`` and ``later_rows`` in the file's
    order."""
    data = reference_json(FILES[gpu])
    out = []
    for row in (*data["rows"], *data.get("earlier_rows", ()), *data.get("later_rows", ())):
        fields = {**data["plan"], **{k: v for k, v in row.items() if k not in _NOT_PLAN + _RECOMPUTE}}
        if "recompute_granularity" in row:
            fields["recompute"] = Recompute.parse(*(row.get(k) for k in _RECOMPUTE))
        plan = Plan(**fields)
        out.append(BridgeRun(row["label"], row.get("container", FIRST_CONTAINER), get_model(row["model"]), plan,
                             float(row["tokens_per_s_per_gpu"]), float(row["model_tflops_per_s_per_gpu"]),
                             row.get("note"), data["system"]))
    return tuple(out)


__all__ = ["BRIDGE_SYSTEM", "BridgeRun", "FILES", "FIRST_CONTAINER", "PATH", "bridge_runs"]
