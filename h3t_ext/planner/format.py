"""Rendering of planner results: JSON-ready dicts and rich tables (no printing here; the CLI prints)."""
from __future__ import annotations

from typing import Optional, Sequence

from rich.table import Table

from h3t_ext.ckpt import FULL_UNIFORM_1, Ckpt, recompute_fields as ckpt_recompute_fields, split_ckpt
from h3t_ext.costmodel import ModelSpec, SystemSpec, moe
from h3t_ext.costmodel.efficiency_sets import efficiency_set, efficiency_set_names, transferred_source
from h3t_ext.costmodel.kernels import kernel_rates, priced_attention_kernel
from h3t_ext.costmodel.measured_local_steps import local_stack_steps
from h3t_ext.costmodel.published_moe import dropless_slowdowns
from h3t_ext.costmodel.reserve import ALLOCATOR_GAP_RANGE
from h3t_ext.costmodel.uncertainty import throughput_uncertainty
from h3t_ext.layout import layout_stage_count
from h3t_ext.planner.evaluate import Evaluation, flash_rate_tokens_per_second
from h3t_ext.offload_alpha import format_alpha
from h3t_ext.planner.flags import megatron_flags
from h3t_ext.planner.launch_env import describe_launch_env, launch_env_words
from h3t_ext.planner.results import SearchResult
from h3t_ext.planner.units import format_bytes

PLAN_KEYS = ("num_gpus", "seq_length", "global_batch_size", "micro_batch_size", "tensor_model_parallel_size",
             "context_parallel_size", "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
             "pipeline_model_parallel_layout", "microbatch_group_size_per_vp_stage", "ckpt", "precision", "fp8", "fp8_recipe", "fp8_param_gather",
             "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
             "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_token_dispatcher_type", "moe_grouped_gemm",
             "moe_shared_expert_overlap", "overlap_moe_expert_parallel_comm", "use_distributed_optimizer",
             "data_parallel_sharding_strategy",
             "use_torch_fsdp2", "optimizer_cpu_offload", "optimizer_offload_fraction")


def recompute_label(plan) -> str:
    """The plan's recompute choice in a word: ``no``, ``ours``, ``full``, ``selective`` (Megatron's selective
    ``core_attn`` on ckpt no), ``ours+core_attn``, ``ours+block(3)`` (Megatron's block recompute of the first 3
    layers of every model chunk on top of ckpt ours), ``no+uniform(2)``."""
    base, recompute = split_ckpt(plan.ckpt, plan.recompute)
    if recompute.granularity is None:
        return str(base)
    if plan.ckpt in (Ckpt.FULL, Ckpt.SELECTIVE) or recompute == FULL_UNIFORM_1:
        return str(plan.ckpt if plan.ckpt is not base else Ckpt.FULL)
    if recompute.full:
        return f"{base}+{recompute.method}({recompute.num_layers})"
    return f"{base}+{'+'.join(recompute.modules)}"


def recompute_fields(plan) -> dict:
    """Megatron's recompute fields of the plan (:func:`h3t_ext.ckpt.recompute_fields`)."""
    return ckpt_recompute_fields(plan.ckpt, plan.recompute)


def _alpha_value(alphas: tuple[float, ...]):
    """One number when every stage has the same alpha, else the per-stage list."""
    return alphas[0] if len(set(alphas)) == 1 else list(alphas)


def evaluation_dict(ev: Evaluation, flags: Optional[Sequence[str]] = None,
                    launch_env: Optional[Sequence[str]] = None) -> dict:
    """Flat JSON object of one evaluated plan: the headline numbers, the plan fields, the launch flags and (given)
    the ``env`` arguments of the launch environment Megatron-LM asserts for it (``launch_env``, empty for none)."""
    est = ev.estimate
    plan = ev.plan
    out = {
        "peak_memory_bytes": est.peak_memory_bytes,
        "memory_budget_bytes": est.memory_budget_bytes,
        "fits": est.fits,
        "memory_marginal": est.memory_marginal,
        "allocator_gap_left": est.allocator_gap_left,
        "offload_alpha": _alpha_value(est.offload_alpha),
        "offload_alpha_mode": ev.alpha_mode if isinstance(ev.alpha_mode, str) else "fixed",
        "tokens_per_second": est.tokens_per_second,
        "tokens_per_second_per_gpu": est.tokens_per_second_per_gpu,
        "tokens_per_second_interval": list(est.tokens_per_second_interval),
        "mfu": est.mfu,
        "plausibility": est.plausibility.to_dict(),
        "iteration_time_s": est.iteration_time_s,
        "closed_form_iteration_time_s": est.closed_form_time_s,
        "priced_on_timeline": est.timeline is not None,
        "pcie_bytes_per_iteration": est.pcie_bytes_per_iteration,
    }
    if est.timeline_note:
        out["timeline_note"] = est.timeline_note
    out.update({k: getattr(plan, k) for k in PLAN_KEYS})
    out["recompute"] = recompute_label(plan)
    out.update(recompute_fields(plan))
    out["data_parallel_size"] = plan.data_parallel_size
    out["num_microbatches"] = plan.num_microbatches
    if ev.auto_estimate is not None:
        out["auto_offload_alpha"] = _alpha_value(ev.auto_estimate.offload_alpha)
        out["pcie_bytes_saved_vs_auto"] = ev.pcie_bytes_saved_vs_auto
    err = est.infeasibility()
    if err is not None:
        out["over_budget"] = {"term": err.term, "excess_bytes": err.excess_bytes, "stage": err.stage}
    out["megatron_flags"] = list(flags) if flags is not None else megatron_flags(plan)
    if launch_env is not None:
        out["launch_env"] = list(launch_env)
    return out


def describe_plan(ev: Evaluation, model: ModelSpec) -> str:
    """``t=2 c=1 p=8 l=2 (v=5) ckpt=no recompute=no+block(3) alpha=0.355 mb=1 m=16``."""
    p = ev.plan
    l = p.num_layers_per_virtual_pipeline_stage
    v = p.virtual_size(model.num_layers)
    inter = f" l={l} (v={v})" if l is not None else ""
    if p.pipeline_model_parallel_layout is not None:
        inter += f" layout={p.pipeline_model_parallel_layout}" + (f" (v={v})" if v > 1 else "")
    if p.microbatch_group_size_per_vp_stage is not None:
        inter += f" g={p.microbatch_group_size_per_vp_stage}"
    if model.is_moe:
        inter += (f" ep={p.expert_model_parallel_size} etp={moe.expert_tensor_parallel_size(p)} "
                  f"dispatcher={p.moe_token_dispatcher_type}")
        if p.overlap_moe_expert_parallel_comm:
            inter += " a2a-overlap"
    te = f" te={p.transformer_engine_version}" if p.transformer_engine_version is not None else ""
    return (f"t={p.tensor_model_parallel_size} c={p.context_parallel_size} p={p.pipeline_model_parallel_size}"
            f"{inter} d={p.data_parallel_size} ckpt={p.ckpt} recompute={recompute_label(p)} alpha={format_alpha(_alpha_value(ev.estimate.offload_alpha))}"
            f" micro_batch={p.micro_batch_size} m={p.num_microbatches} precision={_precision(p)} states={states_label(p)}"
            f"{te}")


def states_label(plan) -> str:
    """Where the weights, gradients and optimizer states live: ``fsdp=optim_grads_params`` (Megatron FSDP's
    sharding strategy), ``torch-fsdp2``, ``dist-opt`` (the distributed optimizer) or ``ddp``, with
    ``+cpu-adam=F`` for --optimizer-cpu-offload with --optimizer-offload-fraction F."""
    if plan.use_torch_fsdp2:
        label = "torch-fsdp2"
    elif plan.data_parallel_sharding_strategy is not None:
        label = f"fsdp={plan.data_parallel_sharding_strategy}"
    else:
        label = "dist-opt" if plan.use_distributed_optimizer else "ddp"
    return label + (f"+cpu-adam={plan.optimizer_offload_fraction:g}" if plan.optimizer_cpu_offload else "")


def _precision(plan) -> str:
    """``bf16``, or ``fp8 (hybrid, delayed)`` with the FP8 settings."""
    if plan.fp8 is None:
        return "bf16"
    bf16 = (f", bf16 first {plan.num_layers_at_start_in_bf16} last {plan.num_layers_at_end_in_bf16}"
            if plan.first_last_layers_bf16 else "")
    return f"fp8 ({plan.fp8}, {plan.fp8_recipe}{', fp8 params' if plan.fp8_param_gather else ''}{bf16})"


_KERNEL_NAMES = {"flash": "FlashAttention", "fused": "cuDNN's fused attention through TransformerEngine",
                 "unfused": "unfused attention, s^2 scores saved"}


def attention_line(plan, system: SystemSpec) -> str:
    """The attention kernel the plan is priced with, and why (``Plan.attention_kernel``)."""
    kernel = plan.attention_kernel(system)
    why = f"--attention-backend {plan.attention_backend}"
    if plan.attention_backend == "auto":
        why += (f": TransformerEngine's choice on compute capability {system.compute_capability:.1f}"
                if plan.transformer_impl == "transformer_engine" else ": the local layers' FlashAttention")
    line = f"{_KERNEL_NAMES[kernel]} ({why})"
    if priced_attention_kernel(kernel, kernel_rates(system)) != kernel:
        line += f", priced as FlashAttention: no measurement of it for the {system.efficiency_set or system.name} family"
    return line


def attention_stack_clause(ev: Evaluation, model: ModelSpec, system: SystemSpec) -> str:
    """What the measured fused attention's rate stands for, where it moves this plan by 0.5% or more: a 2026 cuDNN's,
    against the FlashAttention-2 rate a 2024 stack's fused attention ran at (``flash_rate_tokens_per_second``)."""
    flash = flash_rate_tokens_per_second(model, ev, system)
    if flash is None:
        return ""
    fewer = 1 - flash / ev.estimate.tokens_per_second
    if fewer < 0.005:
        return ""
    r = kernel_rates(system)
    ratio = system.efficiency("fused_attention_gemm_ratio")
    shipped = (efficiency_set(system.efficiency_set).get("fused_attention_gemm_ratio")
               if system.efficiency_set in efficiency_set_names() else None)
    if shipped == ratio:
        whose = "a 2026 cuDNN's rate"
    elif shipped:
        whose = f"this system's rate (a fused_attention_gemm_ratio of {ratio:g} against the 2026 cuDNN's {shipped:g})"
    else:  # a calibrated or hand-written system file naming no shipped set
        whose = "this system's rate"
    return (f"; priced at {whose}, {r.fused_attention_flops / r.attention_flops:.1f}x FlashAttention-2's: "
            f"on a 2024 stack it ran at FlashAttention-2's (NeMo 24.03's long-sequence runs), {100 * fewer:.0f}% fewer "
            "tokens/s for this plan")


def local_stack_line() -> str:
    """What the measured driver steps say of an estimate with the local (eager) layers
    (:mod:`h3t_ext.costmodel.measured_local_steps`)."""
    steps = local_stack_steps()
    times = [r.time_ratio for r in steps.rows]
    memory = max(abs(r.memory_ratio - 1) for r in steps.rows)
    return (f"the local (eager) layers: time priced GPU-bound with fused element-wise kernels; the driver's "
            f"{len(steps.rows)} measured steps on an {steps.gpu.upper()} ran {min(times):.2f}-{max(times):.2f}x their "
            f"estimate (host dispatch, unfused kernels), their peak memory within {100 * memory:.1f}%")


def _family_name(efficiency_set: str) -> str:
    """An efficiency family as the interval line names it: ``grace-blackwell`` is Grace Blackwell."""
    return " ".join(word.capitalize() for word in efficiency_set.split("-"))


def interval_line(est) -> str:
    """The estimate's prediction interval and what it is: the fitted sources' held-out spread (dense), with how much
    faster the newest published stacks ran than predicted; the published MoE runs' spread (MoE)."""
    u = est.uncertainty
    lo, hi = est.tokens_per_second_interval
    if u.transferred_from:
        source, root = u.transferred_from, transferred_source(u.transferred_from)
        whose = (f"{_family_name(source)}'s efficiencies carried over (themselves {_family_name(root)}'s fitted ones)"
                 if root else f"{_family_name(source)}'s fitted efficiencies carried over")
        what = f"the held-out {u.held_out_runs}: this GPU family is priced with {whose}, none fitted on its own runs"
    elif est.moe:
        what = "the held-out published MoE runs"
    else:
        what = ("the fitted sources' published runs, each predicted without its source; the newest published stacks "
                f"ran up to {100 * u.newer_stacks_underprediction:.0f}% faster than predicted")
    return f"interval    {lo:,.0f} - {hi:,.0f} tokens/s (+-{100 * u.relative_half_width:.1f}%: " \
           f"{100 * u.coverage:.0f}% of {what})"


def marginal_clause(est) -> str:
    """The memory line's note on a verdict the caching allocator's reserve decides (``Estimate.memory_marginal``)."""
    if not est.memory_marginal:
        return ""
    lo, hi = ALLOCATOR_GAP_RANGE
    return (f", marginal: it fits while PyTorch's caching allocator reserves at most {100 * est.allocator_gap_left:.1f}% "
            f"above the peak ({100 * lo:.0f}-{100 * hi:.0f}% in steady-state training loops; the budget assumes "
            f"{100 * (est.device_free_bytes / est.memory_budget_bytes - 1):.0f}%)")


def estimate_lines(ev: Evaluation, model: ModelSpec, system: SystemSpec) -> list[str]:
    """Short human summary of one evaluated plan."""
    est = ev.estimate
    verdict = "fits" if est.fits else "DOES NOT FIT"
    lines = [
        f"model       {model.name} ({model.num_parameters / 1e9:.1f}B params"
        f"{f', {model.moe_layers} of {model.num_layers} layers MoE' if model.mixed_moe else ''}) on {est.num_gpus} x "
        f"{system.name}, "
        f"seq {ev.plan.seq_length}, global batch {ev.plan.global_batch_size}",
        f"plan        {describe_plan(ev, model)}",
        f"attention   {attention_line(ev.plan, system)}{attention_stack_clause(ev, model, system)}",
        f"memory      peak {format_bytes(est.peak_memory_bytes)} on stage {est.peak_stage} "
        f"(budget {format_bytes(est.memory_budget_bytes)}): {verdict}{marginal_clause(est)}",
        f"time        {est.iteration_time_s:.3f} s per iteration"
        + (f" ({est.timeline_note})" if est.timeline_note else ""),
        f"throughput  {est.tokens_per_second:,.0f} tokens/s ({est.tokens_per_second_per_gpu:,.1f} tokens/s/GPU), "
        f"MFU {100 * est.mfu:.1f}%",
        interval_line(est),
        f"plausible   {est.plausibility.line()}",
    ]
    if ev.plan.transformer_impl == "local":
        lines.append(f"stack       {local_stack_line()}")
    if model.is_moe:
        slow = dropless_slowdowns()
        lines.append(f"routing     priced balanced (as --moe-router-force-load-balancing); a trained router's dropless "
                     f"routing runs slower by its imbalance ({100 * min(slow):.0f}-{100 * max(slow):.0f}% in the "
                     f"published runs that give both)")
    err = est.infeasibility()
    if err is not None:
        lines.append(f"over budget {err.reason}")
    if ev.auto_estimate is not None:
        auto = format_alpha(_alpha_value(ev.auto_estimate.offload_alpha))
        lines.append(f"balanced    per-stage alpha saves {format_bytes(ev.pcie_bytes_saved_vs_auto or 0)} of PCIe "
                     f"traffic per iteration (summed over stages) vs auto alpha {auto}")
    lines.append("flags       " + " ".join(megatron_flags(ev.plan, moe=model.is_moe)))
    env = describe_launch_env(launch_env_words(ev.plan, system))
    if env:
        lines.append(f"launch      {env}")
    return lines


def explain_tables(ev: Evaluation) -> list[Table]:
    """Every memory term of every stage, and every time term."""
    est = ev.estimate
    mem = Table(title="memory per pipeline stage (GiB)")
    mem.add_column("term")
    for s in est.stages:
        mem.add_column(f"stage {s.stage}", justify="right")
    names: list[str] = []
    for s in est.stages:
        names.extend(n for n in s.terms if n not in names)
    for n in names:
        mem.add_row(n, *(f"{s.terms.get(n, 0) / 2**30:.3f}" for s in est.stages))
    mem.add_row("alpha", *(format_alpha(a) for a in est.offload_alpha))
    mem.add_row("[b]peak[/b]", *(f"[b]{s.peak_bytes / 2**30:.3f}[/b]" for s in est.stages))
    tim = Table(title="time per iteration")
    tim.add_column("term")
    tim.add_column("seconds", justify="right")
    tim.add_column("share", justify="right")
    total = est.iteration_time_s
    for name, sec in est.time_terms.as_dict().items():
        tim.add_row(name, f"{sec:.4f}", f"{100 * sec / total:.1f}%")
    tim.add_row("[b]total[/b]", f"[b]{total:.4f}[/b]", "100%")
    tr = est.offload_traffic
    if tr is None:
        return [mem, tim]
    off = Table(title=f"activation offload, layer by layer (pipeline size 1): layers 0-{tr.offloaded_layers - 1} "
                      f"of {tr.num_layers}")
    off.add_column("per microbatch")
    off.add_column("value", justify="right")
    off.add_row("to the host and back (GiB each way)", f"{tr.bytes_per_microbatch / 2**30:.3f}")
    off.add_row("one layer's copy (GiB)", f"{tr.layer_copy_bytes / 2**30:.3f}")
    off.add_row("one layer's copy (ms)", f"{tr.layer_copy_s * 1e3:.3f}")
    off.add_row("hides behind the next layer's forward (ms)", f"{tr.next_forward_s * 1e3:.3f}")
    off.add_row("hides behind the next layer's backward (ms)", f"{tr.next_backward_s * 1e3:.3f}")
    off.add_row("exposed (ms)", f"{tr.exposed_per_microbatch_s * 1e3:.3f}")
    return [mem, tim, off]


def _alpha_cell(alphas: tuple[float, ...]) -> str:
    """One alpha, or the range of the per-stage alphas (the flags line has them all)."""
    if len(set(alphas)) == 1:
        return format_alpha(alphas[0])
    return f"{format_alpha(min(alphas))}-{format_alpha(max(alphas))}"


def search_table(result: SearchResult, top: int) -> Table:
    """The best ``top`` plans."""
    tab = Table(title=f"best {min(top, len(result.plans))} of {len(result.plans)} feasible plans priced")
    balanced = any(r.evaluation.pcie_bytes_saved_vs_auto is not None for r in result.plans[:top])
    experts = any(r.plan.moe_grouped_gemm or r.plan.expert_model_parallel_size > 1 for r in result.plans[:top])
    states = any(states_label(r.plan) != "dist-opt" for r in result.plans[:top])
    cols = ["#", "t", "c", "p", "l", "d", *(["ep"] if experts else []), "recompute", "precision",
            *(["states"] if states else []), "alpha", "mb", "m", "peak GiB", "tokens/s", "tok/s/GPU", "MFU",
            "vs published"]
    for col in cols + (["PCIe saved vs auto"] if balanced else []):
        tab.add_column(col, justify="left" if col in ("recompute", "precision", "states") else "right")
    for i, r in enumerate(result.plans[:top], 1):
        p, est = r.plan, r.evaluation.estimate
        mark = _closed(est)
        extra = [format_bytes(r.evaluation.pcie_bytes_saved_vs_auto or 0)] if balanced else []
        tab.add_row(str(i), str(p.tensor_model_parallel_size), str(p.context_parallel_size),
                    str(p.pipeline_model_parallel_size) + ("*" if p.pipeline_model_parallel_layout else ""),
                    _layers_cell(p), str(p.data_parallel_size),
                    *([str(p.expert_model_parallel_size)] if experts else []), recompute_label(p), p.precision,
                    *([states_label(p)] if states else []), _alpha_cell(est.offload_alpha), str(p.micro_batch_size),
                    str(p.num_microbatches), f"{est.peak_memory_bytes / 2**30:.1f}",
                    f"{mark}{est.tokens_per_second:,.0f}", f"{mark}{est.tokens_per_second_per_gpu:,.1f}",
                    f"{100 * est.mfu:.1f}%", _plausibility_cell(est.plausibility), *extra)
    notes = []
    if any(r.plan.pipeline_model_parallel_layout for r in result.plans[:top]):
        notes.append("p*: the layers split as --pipeline-model-parallel-layout says (the plan's flags); v=N: its N "
                     "model chunks per rank (interleaved)")
    if any(_closed(r.evaluation.estimate) for r in result.plans[:top]):
        notes.append(f"{CLOSED_FORM_MARK}: the closed form's time (the search prices its best rows on the timeline of "
                     "the schedule's action lists, as estimate prices every plan, and the others by the closed form)")
    if notes:
        tab.caption = "\n".join(notes)
    return tab


CLOSED_FORM_MARK = "~"
"""Before a search row's tokens/s: priced by the closed form, not on the timeline (``estimate`` of its flags prices it
on the timeline: within 0.2% of the closed form on average, 5% at the 99th percentile, over the rows of 240 random
searches, ``scripts/closed_form_vs_timeline.py``)."""


def _closed(est) -> str:
    """:data:`CLOSED_FORM_MARK` for an estimate priced by the closed form, else nothing."""
    return CLOSED_FORM_MARK if est.timeline is None else ""


def _layers_cell(plan) -> str:
    """The l column: layers per virtual stage, ``v=N`` for an interleaved layout string, ``-`` for one chunk."""
    if plan.num_layers_per_virtual_pipeline_stage is not None:
        return str(plan.num_layers_per_virtual_pipeline_stage)
    if plan.pipeline_model_parallel_layout is not None:
        v = layout_stage_count(plan.pipeline_model_parallel_layout) // plan.pipeline_model_parallel_size
        return f"v={v}" if v > 1 else "-"
    return "-"


def _plausibility_cell(pl) -> str:
    return "ABOVE" if pl.above_ceiling else ("-" if pl.ceiling is None else "ok")


def plausibility_line(result: SearchResult, top: int) -> str:
    """Which of the printed rows are priced above the best published MFU of their GPU family and precision."""
    rows = [(i, r.evaluation.estimate.plausibility) for i, r in enumerate(result.plans[:top], 1)]
    above = [(i, pl) for i, pl in rows if pl.above_ceiling]
    if not above:
        known = [pl for _, pl in rows if pl.ceiling is not None]
        if not known:
            return "plausibility: no published run of this GPU family and precision to compare the MFU with"
        return f"plausibility: every row is within the published MFU range (best {known[0].ceiling.describe()})"
    ceiling = above[0][1].ceiling
    return (f"plausibility: rows {', '.join(f'#{i}' for i, _ in above)} are priced ABOVE the best published MFU for "
            f"this GPU family and precision, {ceiling.describe()}: the cost model was never checked there; treat "
            f"them as optimistic")


def search_dicts(result: SearchResult, top: int) -> list[dict]:
    """The best ``top`` plans as JSON objects, each with ``tied_with_best`` (within the best's interval)."""
    tied = set(result.tied_with_best())
    return [{**evaluation_dict(r.evaluation, r.megatron_flags, r.launch_env), "tied_with_best": i in tied}
            for i, r in enumerate(result.plans[:top])]


def tie_line(result: SearchResult) -> str:
    """Which rows the cost model cannot tell from the best."""
    tied = result.tied_with_best()
    w = (result.plans[0].evaluation.estimate.uncertainty if result.plans else throughput_uncertainty()
         ).relative_half_width
    rows = ", ".join(f"#{i + 1}" for i in tied)
    return (f"tied with the best (tokens/s within its +-{100 * w:.1f}% prediction interval): {rows} "
            f"({len(tied)} of {len(result.plans)} feasible plans)")


def rejected_lines(result: SearchResult) -> list[str]:
    """Why the other plans were rejected, most frequent reason first."""
    lines = [f"priced {result.considered} plans; rejected (partial) plans by reason:"]
    for reason, n in sorted(result.rejected.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {n:7d}  {reason}")
    return lines


def no_plan_message(result: SearchResult) -> str:
    """One line: which memory term of the closest plan is over, and by how much."""
    c = result.closest_infeasible
    if c is None:
        return "no valid plan for these sizes (see the divisibility rules: " + "; ".join(result.broken_rules) + ")"
    p = c.plan
    l = p.num_layers_per_virtual_pipeline_stage
    ep = f" ep={p.expert_model_parallel_size}" if p.expert_model_parallel_size > 1 else ""
    states = states_label(p)
    options = ep + (f" states={states}" if states != "dist-opt" else "")
    terms = "; its terms: " + ", ".join(f"{k} {format_bytes(b)}" for k, b in c.terms) if c.terms else ""
    return (f"no plan fits the memory budget; closest: t={p.tensor_model_parallel_size} "
            f"c={p.context_parallel_size} p={p.pipeline_model_parallel_size} l={l if l is not None else '-'} "
            f"recompute={recompute_label(p)} micro_batch={p.micro_batch_size}{options}: {c.term} over budget by "
            f"{format_bytes(c.excess_bytes)} on stage {c.stage} ({c.reason}){terms}")
