"""NVIDIA's published long-sequence runs with context parallelism (NeMo's ``performance_long_sequence.md``), as typed
records with the Plan each ran, one table per file of ``data/reference``:

* ``h100``: Llama 2 7B (FP8) on DGX-H100, 4K to 1M tokens a sequence (``nemo_long_sequence_h100.json``, the NeMo 24.03
  container): the evidence that cuDNN's fused attention was as fast as FlashAttention-2 on that stack
  (``held_out.long_sequence_errors(attention_backend="flash")``; docs/DESIGN.md, "Reference numbers");
* ``b200``: Llama 3 8B (FP8) on DGX-B200, 8K to 1M tokens (``nemo_long_sequence_b200.json``, NeMo 25.04): the check of
  the Blackwell efficiencies carried over from Hopper (``efficiency_sets.transferred_efficiencies``).

Nothing is fitted on them: they are the held-out check of the attention and context-parallel pricing where attention is
most of the step (priced by ``held_out.long_sequence_errors``)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.specs import REFERENCE_DIR, ModelSpec, get_model, reference_json

TABLES = {"h100": "nemo_long_sequence_h100.json", "b200": "nemo_long_sequence_b200.json"}
"""Each published table's file in ``data/reference`` (its ``system`` names the GPU every row ran on)."""
PATH = REFERENCE_DIR / TABLES["h100"]
_NOT_PLAN = ("label", "model_tflops_per_s_per_gpu", "without_cp_model_tflops_per_s_per_gpu", "data_parallel_size",
             "published_num_gpus")


def nemo_llama_flops_per_token(model: ModelSpec, seq_length: int) -> float:
    """NeMo's training FLOPs per token of a Llama model (its ``flops_formulas.llama2`` and ``llama3``): 6 L h^2 (2 +
    2 g/a + 3 f/h + 2 s/h + V / (L h)), causal attention counted as a full s x s score matrix and the vocabulary
    unpadded; the count behind NVIDIA's NeMo tables' model TFLOP/s (its 24.07 FP8 table's Llama rows within 0.05%)."""
    L, h = model.num_layers, model.hidden_size
    groups = model.num_query_groups / model.num_attention_heads
    return 6 * L * h * h * (2 + 2 * groups + 3 * model.ffn_hidden_size / h + 2 * seq_length / h
                            + model.vocab_size / (L * h))


@dataclass(frozen=True)
class LongSequenceRun:
    """One published row and the plan it ran (the file's ``plan`` settings with the row's sizes, in Plan's field
    names, which are Megatron's)."""

    label: str
    model: ModelSpec
    plan: Plan
    model_tflops_per_s_per_gpu: float
    without_cp_model_tflops_per_s_per_gpu: Optional[float]
    """The fastest layout without context parallelism that fit, as published (that layout is not given; None where
    none fit)."""
    system_name: str = "h100-sxm"
    """The GPU the row ran on (its file's ``system``)."""

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """The published TFLOP/s per GPU in tokens, by the publisher's own count (:func:`nemo_llama_flops_per_token`)."""
        return self.model_tflops_per_s_per_gpu * 1e12 / nemo_llama_flops_per_token(self.model, self.plan.seq_length)


@functools.lru_cache(maxsize=None)
def long_sequence_runs(table: str = "h100") -> tuple[LongSequenceRun, ...]:
    """Every row of one table (:data:`TABLES`), shortest sequence first."""
    data = reference_json(TABLES[table])
    model = replace(get_model(data["model"]), vocab_size=int(data["vocab_size"]))
    out = []
    for row in data["rows"]:
        t = row["tensor_model_parallel_size"]
        plan = Plan(**{**data["plan"], **{k: v for k, v in row.items() if k not in _NOT_PLAN},
                       "sequence_parallel": t > 1, "tp_comm_overlap": t > 1})
        without = row["without_cp_model_tflops_per_s_per_gpu"]
        out.append(LongSequenceRun(row["label"], model, plan, float(row["model_tflops_per_s_per_gpu"]),
                                   None if without is None else float(without), data["system"]))
    return tuple(out)


__all__ = ["LongSequenceRun", "PATH", "TABLES", "long_sequence_runs", "nemo_llama_flops_per_token"]
