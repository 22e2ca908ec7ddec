"""Published mixture-of-experts runs (``data/reference/moe_published.json``) as typed records with the Plan each
ran, for checking the MoE terms (:mod:`h3t_ext.costmodel.moe`) on runs nothing was fitted to
(``scripts/moe_validation.py`` prints the comparison)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from h3t_ext.ckpt import Recompute
from h3t_ext.costmodel.mfu import model_flops_per_token
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.estimate import Estimate, estimate
from h3t_ext.costmodel.specs import REFERENCE_DIR, ModelSpec, SystemSpec, get_model, get_system, reference_json

PATH = REFERENCE_DIR / "moe_published.json"
_PLAN_FIELDS = ("num_gpus", "seq_length", "global_batch_size", "micro_batch_size", "tensor_model_parallel_size",
                "context_parallel_size", "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
                "num_virtual_stages_per_pipeline_rank", "expert_model_parallel_size", "expert_tensor_parallel_size",
                "moe_token_dispatcher_type", "overlap_moe_expert_parallel_comm",
                "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
_MODEL_FIELDS = ("make_vocab_size_divisible_by",)
RUN_SWITCHES = dict(moe_grouped_gemm=True, use_distributed_optimizer=True, overlap_grad_reduce=True,
                    overlap_param_gather=True, sequence_parallel=True)
"""What every published MoE run is priced with (each source's 'stated' and 'assumed' settings)."""


@dataclass(frozen=True)
class PublishedMoERun:
    """One published MoE run and the plan it ran."""

    source: str
    label: str
    model: ModelSpec
    plan: Plan
    model_tflops_per_s_per_gpu: float
    """As published (Megatron-LM's FLOPs count, which :func:`~h3t_ext.costmodel.mfu.model_flops_per_token` is)."""
    iteration_time_s: Optional[float] = None
    """The published step time, where the source gives one."""
    dropless_model_tflops_per_s_per_gpu: Optional[float] = None
    """The same run without --moe-router-force-load-balancing, where the source gives it."""
    not_priced: Optional[str] = None
    """What of the run the cost model does not price (such a row is listed, not compared)."""

    @property
    def tokens_per_second(self) -> float:
        """Tokens/s of the run: from its step time, else from its TFLOP/s per GPU and the FLOPs per token."""
        if self.iteration_time_s is not None:
            return self.plan.tokens_per_iteration / self.iteration_time_s
        return (self.model_tflops_per_s_per_gpu * 1e12 * self.plan.num_gpus
                / model_flops_per_token(self.model, self.plan.seq_length))


def published_moe_runs() -> tuple[PublishedMoERun, ...]:
    """Every row of the reference file, in its order."""
    data = reference_json(PATH.name)
    out = []
    for row in data["rows"]:
        row = {**data["row_settings"].get(row["source"], {}), **row}
        model = get_model(row["model"])
        model = dataclasses.replace(model, **{k: row[k] for k in _MODEL_FIELDS if k in row})
        recompute = Recompute.parse(row.get("recompute_granularity") or ("selective" if "recompute_modules" in row
                                                                         else None),
                                    modules=row.get("recompute_modules"), moe=True)
        plan = Plan(**{k: row[k] for k in _PLAN_FIELDS if k in row}, recompute=recompute, **RUN_SWITCHES)
        out.append(PublishedMoERun(row["source"], row["label"], model, plan, float(row["model_tflops_per_s_per_gpu"]),
                                   row.get("iteration_time_s"), row.get("dropless_model_tflops_per_s_per_gpu"),
                                   row.get("not_priced")))
    return tuple(out)


def dropless_slowdowns() -> tuple[float, ...]:
    """Forced-balance / dropless throughput - 1 of the published runs that give both (the cost of a trained router's
    imbalance the cost model does not price)."""
    return tuple(r.model_tflops_per_s_per_gpu / r.dropless_model_tflops_per_s_per_gpu - 1
                 for r in published_moe_runs() if r.dropless_model_tflops_per_s_per_gpu)


MOE_SYSTEM = "h100-sxm"
"""The GPU every published MoE run ran on."""


def held_out_errors(system: Optional[SystemSpec] = None) -> list[tuple[PublishedMoERun, Estimate, float]]:
    """(run, estimate, predicted / published tokens/s - 1) of every priced row (those without ``not_priced``),
    on ``system`` (default :data:`MOE_SYSTEM` with its fitted efficiencies)."""
    system = get_system(MOE_SYSTEM) if system is None else system
    out = []
    for run in published_moe_runs():
        if run.not_priced:
            continue
        est = estimate(run.model, run.plan, system)
        out.append((run, est, est.tokens_per_second / run.tokens_per_second - 1))
    return out


__all__ = ["MOE_SYSTEM", "dropless_slowdowns", "PATH", "PublishedMoERun", "RUN_SWITCHES", "held_out_errors", "published_moe_runs"]
