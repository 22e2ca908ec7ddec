"""Search: every valid plan for a model, GPU count and global batch, priced and ranked.

The structural enumeration (``space.py``) gives the layouts (t, c, p, l, micro batch); for each,
every recompute mode (``recompute_modes.py``: ckpt ``full``, ``ours``, ``no``; Megatron's block recompute with
the smallest ``--recompute-num-layers`` that fits without activation offload, on ``ours`` and on ``no``; with
unfused attention Megatron's selective ``core_attn`` on ``no`` and on ``ours``) is priced with its offload
ratio resolved (``evaluate.py``), plans that cannot fit the budget even with alpha = 1 are rejected with the
memory term that is over, and the rest are ranked by predicted tokens/s (ties: less peak memory first).

Memory grows with the micro batch and from ``full`` to ``ours`` to ``no`` (block on ``ours`` to block on
``no``), so once a (layout, mode, micro batch) does not fit, the larger micro batches and the modes that keep
more are rejected without pricing them (counted under ``R_PRUNED``; ``RecomputeMode.fails_where``); micro
batches past the one where throughput starts to fall are skipped (``R_SLOWER``). ``exhaustive=True`` turns
both off.

With ``top`` (the CLI's ``--top``) the search is best-first instead: every candidate gets an exact upper bound
on its tokens/s from the cost model itself (the iteration time at alpha = 0 is at least its compute,
recompute, tensor- and context-parallel terms and bubble priced with the last stage as the slowest, plus
pp_p2p and the data-parallel traffic with unbounded overlap; the other terms are >= 0 and offloading only adds
time), candidates are priced from the highest bound down, and pricing stops once the bound falls below the
``top``-th best plan found (``R_BOUND``). The first ``top`` plans are then exactly those of an exhaustive
search (the memory pruning above still applies; the micro-batch heuristic does not). Bounds are computed as the
queue reaches them: a layout first enters with one bound for all its candidates (no pp_p2p, dp_exposed), then
each micro batch with ckpt ``no``'s bound (the smallest layer time), then each candidate with its own; the
candidates come out in the same order as if all had been bounded and sorted. A candidate that needs activation
offload or does not fit is priced again with each option of the memory ladder; each variant has its own bound (its
data-parallel term with an FSDP sharding's traffic, its optimizer step) and is left unpriced when that bound cannot
enter the top. After a candidate fits nowhere on a rung of the ladder (the plan as it is, or one option), its
layout's least-memory candidate is checked on that rung on memory alone, and, while the candidate fits nowhere yet, on
each later rung before the candidate is priced there; where it fits nowhere either, no candidate of the layout is
priced on that rung again (its verdict is the layout's closest to fitting there), and where that holds on every rung,
the layout's other candidates are pruned as above. A candidate that fits nowhere on one rung leaves unpriced there the
layout's candidates that keep at least as much (``_Tried``). With a fixed alpha a plan's device memory is checked
before its time is priced: most plans of a tight search do not fit.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping, Optional

from h3t_ext.costmodel import InfeasiblePlanError, InvalidPlanError, ModelSpec, Plan, SystemSpec, estimate, \
    solve_offload_alpha
from h3t_ext.costmodel.estimate import device_infeasibility
from h3t_ext.costmodel.reserve import default_memory_budget_bytes
from h3t_ext.costmodel.fp8 import validate_fp8
from h3t_ext.costmodel.plan_checks import MOE_OURS_REASON, applicable_switches, validate_dense_experts, validate_moe, \
    validate_switches
from h3t_ext.costmodel.memory import stage_fixed_terms, stage_memory, stage_static_terms
from h3t_ext.planner.bounds import LAYOUT_ENTRY, Bounds, candidate_plan
from h3t_ext.planner.evaluate import AlphaMode, evaluate, with_fixed_alpha
from h3t_ext.planner.flags import megatron_flags
from h3t_ext.planner.launch_env import launch_env_words
from h3t_ext.planner.results import R_BOUND, R_PRUNED, R_SLOWER, ClosestInfeasible, Collector, RankedPlan, \
    SearchResult, reason_category
from h3t_ext.planner.recompute_modes import R_BLOCK_NONE, RecomputeMode, search_modes, smallest_block_layers
from h3t_ext.planner.space import Layout, MemoryOption, SearchConstraints, enumerate_layouts

TIMELINE_TOP = 3
"""Plans a search prices on the timeline of the schedule's action lists (the best of the closed form's ranking,
re-ranked by the timeline): building and simulating the lists takes 10-400 ms per plan shape at the sizes of
``scripts/bench_planner.py``, so only the kept plans get it."""
TIMELINE_CAP = 10
"""Most plans one search prices on the timeline: when the timeline keeps pricing the closed form's next plans
below it (offloads whose reloads stall, near-ties), the plans after the cap keep their closed-form estimates
and follow the timeline-priced ones (each row says which it carries: ``estimate.timeline``)."""
OFFLOAD_FRACTION_STEP = 0.05
"""Granularity of the --optimizer-offload-fraction a search picks (the smallest multiple that fits)."""
STATIC_TERMS = ("weights", "grads", "optimizer_states")
"""The cost model's memory terms that depend on neither l, micro batch, ckpt nor alpha."""


@dataclass(frozen=True)
class _Budgets:
    """What one search checks every plan against (None: the plan's default on the system)."""

    device: Optional[int]
    """Bytes per GPU (``memory_budget_bytes``)."""
    host: Optional[int]
    """Host bytes per node (``host_memory_budget_bytes``)."""
    ladder: tuple[MemoryOption, ...] = ()
    """Memory options tried on a plan that needs activation offload or does not fit."""

    def ladder_for(self, plan: Plan) -> Iterator[MemoryOption]:
        """The options of :attr:`ladder` Megatron-LM takes on ``plan`` (:meth:`MemoryOption.refusal`), in order."""
        return (o for o in self.ladder if o.refusal(plan) is None)


class _Unpriced:
    """What :func:`_price` returns for a candidate none of whose priced plans fits while a variant was left unpriced
    by its bound: it may fit, but it cannot enter the top (falsy like a plan that fits nowhere, yet not a memory
    verdict, so nothing is pruned after it)."""

    def __bool__(self) -> bool:
        return False


UNPRICED = _Unpriced()


def _price(col: Collector, model, system, plan: Plan, alpha_mode: AlphaMode, budget: _Budgets,
           can_enter: Optional[Callable[[Plan], bool]] = None, rungs: Optional["_DeadRungs"] = None,
           tried: Optional["_Tried"] = None):
    """Price one plan and, when it fits only by offloading activations or not at all, the same plan with each
    option of the memory ladder (every one that fits is a feasible plan of its own: a later option, which saves
    more memory, may still be the faster plan). The fastest RankedPlan, None when none fits (even at the largest
    alpha allowed), False when the cost model finds the plan invalid. ``can_enter`` (the best-first search's):
    whether a variant's upper bound (``Bounds.variant``) lets it enter the top plans; one that cannot is not priced
    (``R_BOUND``), and where nothing priced fits then, :data:`UNPRICED`. ``rungs`` (the best-first search's): its
    layout's rungs where no candidate fits; the plan is not priced on them (``R_PRUNED``), and where it fits nowhere
    on a rung, that rung is checked for the layout. ``tried`` (the best-first search's): the rungs where a candidate
    of the layout that keeps no more than this one fits nowhere; the plan is not priced on them either."""
    def price(rung: Optional[MemoryOption], variant: Plan):
        r = _price_one(col, model, system, variant, alpha_mode, budget)
        if r is None and rungs is not None:  # a candidate fits nowhere on the rung: is the layout's least one?
            rungs.dead_on(col, rung)
        if r is None and tried is not None:
            tried.failed(rung, variant)
        return r

    def pruned(rung: Optional[MemoryOption]) -> bool:
        if (rungs is not None and rung in rungs.dead) or (tried is not None and tried.covered(rung)):
            col.rejected[R_PRUNED] += 1
            return True
        return False

    ranked = None if pruned(BASE_RUNG) else price(BASE_RUNG, plan)
    if ranked is False or not budget.ladder or (ranked is not None and not any(ranked.plan.alphas())):
        return ranked
    best, unpriced = ranked, False
    for option in budget.ladder_for(plan):
        if pruned(option):
            continue
        variant = _with_option(model, system, plan, option, budget)
        if can_enter is not None and not can_enter(variant):
            col.rejected[R_BOUND] += 1
            unpriced = True
            continue
        # a plan that fits nowhere yet is tight: the layout's rung is checked on memory alone before pricing it there
        if rungs is not None and best is None and rungs.dead_on(col, option):
            col.rejected[R_PRUNED] += 1
            continue
        r = price(option, variant)
        if r and (best is None or r.tokens_per_second > best.tokens_per_second):
            best = r
    return UNPRICED if best is None and unpriced else best


BASE_RUNG = None
"""The bottom rung of the memory ladder for :class:`_DeadRungs`: the plan with none of its options."""


class _DeadRungs:
    """The rungs of one layout (:data:`BASE_RUNG`, or a :class:`MemoryOption` of the ladder) on which its least-memory
    candidate (ckpt full, its smallest micro batch) does not fit the device at any alpha (``mode`` ``auto`` or
    ``balanced``), or at the search's fixed alpha (``mode`` a number or one per stage). Every candidate of the layout
    holds at least its bytes on each rung, so none fits there either. A rung is checked after a candidate of the layout
    first fits nowhere on it, on memory alone: the verdict of :func:`_price_one`'s None (``solve_offload_alpha``'s
    InfeasiblePlanError, as ``evaluate`` meets it, or ``device_infeasibility`` at the fixed alpha) without pricing any
    time. The optimizer offload is checked at fraction 1, its least memory (a larger candidate gets a larger fraction).
    A rung the cost model refuses is not dead."""

    def __init__(self, model, system, least: Plan, mode: AlphaMode, budget: _Budgets) -> None:
        self._model, self._system, self._mode, self._budget = model, system, mode, budget
        self.least = least
        self.dead: set[Optional[MemoryOption]] = set()
        self._checked: set[Optional[MemoryOption]] = set()

    def dead_on(self, col: Collector, rung: Optional[MemoryOption]) -> bool:
        """Whether no candidate of the layout fits on ``rung``, checked once. The least-memory candidate's verdict on
        a dead rung is offered to ``col`` as the closest to fitting (no other candidate of the layout is closer there);
        it counts no plan."""
        if rung not in self._checked:
            self._checked.add(rung)
            try:
                err, shown, priced = self._verdict(self.least if rung is None else rung.on(self.least))
            except InvalidPlanError:
                err = None
            if err is not None:
                self.dead.add(rung)
                col.nearer(shown, err.term, err.excess_bytes, err.stage, err.reason,
                           _stage_terms(self._model, self._system, priced, err.stage))
        return rung in self.dead

    def _verdict(self, least: Plan) -> tuple[Optional[InfeasiblePlanError], Plan, Plan]:
        """(why ``least`` fits at no alpha, or not at the fixed one, else None; the plan the verdict names, as
        :func:`_price_one` names it; the plan its terms are priced at). Raises InvalidPlanError."""
        if isinstance(self._mode, str):
            try:
                solve_offload_alpha(self._model, least, self._system, memory_budget_bytes=self._budget.device,
                                    mode=self._mode)
            except InfeasiblePlanError as e:
                return e, least, least.with_alpha(1.0)
            return None, least, least
        fixed = with_fixed_alpha(least, self._mode)
        return device_infeasibility(self._model, fixed, self._system, memory_budget_bytes=self._budget.device), \
            fixed, fixed

    def everywhere(self) -> bool:
        """Whether no candidate of the layout fits on any rung."""
        return len(self.dead) == 1 + sum(1 for _ in self._budget.ladder_for(self.least))


class _Tried:
    """One candidate (mode index ``ci``, micro batch index ``i``) of a layout whose candidates' failures are kept per
    rung of the memory ladder in ``failures`` (rung -> (mode, micro batch) indices): on a rung where a candidate that
    keeps no more fits nowhere (a micro batch as small or smaller, a mode this one fails where it fails:
    :meth:`RecomputeMode.fails_where`, the rule that prunes a layout's candidates that fit nowhere at all), this one
    fits nowhere either. A failure is kept only where it is the candidate's least memory on the rung (its optimizer
    offload fraction 1: a larger candidate may offload a larger fraction) and for a plain mode (a block mode's N is
    chosen per candidate)."""

    def __init__(self, failures: dict, modes: tuple[RecomputeMode, ...], ci: int, i: int) -> None:
        self._failures, self._modes, self._ci, self._i = failures, modes, ci, i

    def covered(self, rung: Optional[MemoryOption]) -> bool:
        mode = self._modes[self._ci]
        return any(self._i >= fi and mode.fails_where(self._modes[fc]) for fc, fi in self._failures.get(rung, ()))

    def failed(self, rung: Optional[MemoryOption], variant: Plan) -> None:
        if self._modes[self._ci].block or (variant.optimizer_cpu_offload and variant.optimizer_offload_fraction < 1):
            return
        self._failures.setdefault(rung, []).append((self._ci, self._i))


def _with_option(model, system, plan: Plan, option: MemoryOption, budget: _Budgets) -> Plan:
    """``plan`` with one memory option; with optimizer offload, the smallest --optimizer-offload-fraction (in
    steps of ``OFFLOAD_FRACTION_STEP``) that brings the stage over budget at alpha 0 within it, else 1."""
    if not option.optimizer_cpu_offload:
        return option.on(plan)
    base = plan.with_alpha(0.0)
    device = default_memory_budget_bytes(model, base, system) if budget.device is None else budget.device
    fraction = 0.0
    for k in sorted({0, plan.pipeline_model_parallel_size - 1}):
        terms = stage_fixed_terms(model, base, k, system)
        excess = stage_memory(model, base, k, 0.0, system).peak_bytes - device
        if excess > 0 and terms["optimizer_states"] > 0:
            fraction = max(fraction, excess / terms["optimizer_states"])
    fraction = min(1.0, math.ceil(fraction / OFFLOAD_FRACTION_STEP) * OFFLOAD_FRACTION_STEP) if fraction else 1.0
    return option.on(plan, round(fraction, 2))


def _stage_terms(model, system, plan: Plan, stage: Optional[int], alpha: Optional[float] = None
                 ) -> Callable[[], Mapping[str, int]]:
    """The memory terms of ``plan``'s ``stage`` (0 where None) at ``alpha`` (None: the plan's own), when asked: a memory
    verdict's terms, which :class:`Collector` reads only for the closest to fitting."""
    k = stage or 0

    def terms() -> Mapping[str, int]:
        priced = plan if alpha is None else plan.with_alpha(alpha)
        return stage_memory(model, priced, k, priced.alphas()[k], system).terms
    return terms


def _price_one(col: Collector, model, system, plan: Plan, alpha_mode: AlphaMode, budget: _Budgets):
    """Price one plan: the RankedPlan, None when it does not fit (even at the largest alpha allowed),
    False when the cost model finds it invalid."""
    col.considered += 1
    if not isinstance(alpha_mode, str):  # a fixed alpha: the device's verdict first, without the time terms
        resolved = with_fixed_alpha(plan, alpha_mode)
        try:
            err = device_infeasibility(model, resolved, system, memory_budget_bytes=budget.device)
        except InvalidPlanError as e:
            col.rejected[reason_category(e.reason)] += 1
            return False
        if err is not None:
            col.infeasible(resolved, err.term, err.excess_bytes, err.stage, err.reason,
                           _stage_terms(model, system, resolved, err.stage))
            return None
    try:
        ev = evaluate(model, plan, system, alpha_mode=alpha_mode, memory_budget_bytes=budget.device, timeline=False,
                      host_memory_budget_bytes=budget.host)
    except InvalidPlanError as e:
        col.rejected[reason_category(e.reason)] += 1
        return False  # not a memory verdict: no pruning
    except InfeasiblePlanError as e:
        col.infeasible(plan, e.term, e.excess_bytes, e.stage, e.reason, _stage_terms(model, system, plan, e.stage, 1.0))
        return None
    est = ev.estimate
    err = est.infeasibility()
    if err is not None:
        col.infeasible(ev.plan, err.term, err.excess_bytes, err.stage, err.reason,
                       lambda: est.stages[est.peak_stage].terms if err.stage is not None else dict(est.host_terms))
        return None
    ranked = RankedPlan(ev, tuple(megatron_flags(ev.plan, moe=model.is_moe)), launch_env_words(ev.plan, system))
    col.feasible.append(ranked)
    return ranked


def _static_infeasibility(model, system, plan: Plan, budgets: _Budgets) -> Optional[ClosestInfeasible]:
    """Weights, gradients and optimizer states alone (independent of l, micro batch, ckpt and alpha)
    over the budget on some stage, with the plan's switches and with every option of the memory ladder Megatron-LM
    takes on it: the whole (t, c, p) subtree is infeasible (the verdict closest to fitting)."""
    verdicts = [_static_verdict(model, system, plan, budgets.device)]
    for option in budgets.ladder_for(plan):
        if verdicts[-1] is None:
            return None
        verdicts.append(_static_verdict(model, system, option.on(plan), budgets.device))
    if verdicts[-1] is None:
        return None
    return min(verdicts, key=lambda v: v.excess_bytes)


def _static_verdict(model, system, plan: Plan, budget: Optional[int]) -> Optional[ClosestInfeasible]:
    budget = default_memory_budget_bytes(model, plan, system) if budget is None else budget
    stages = range(plan.pipeline_model_parallel_size) if model.mixed_moe else \
        plan.representative_stages(model.num_layers)  # one rank per class (PipelineSplit.stage_class)
    for k in stages:
        terms = stage_static_terms(model, plan, k)
        static = {name: terms.get(name, 0) for name in STATIC_TERMS}
        need = sum(static.values())
        if need > budget:
            term = max(static, key=lambda n: static[n])
            reason = (f"stage {k}: weights, grads and optimizer states alone need {need / 1e9:.1f} GB > budget "
                      f"{budget / 1e9:.1f} GB ({term} {static[term] / 1e9:.1f} GB is the largest), over by at least "
                      f"{(need - budget) / 1e9:.1f} GB")
            return ClosestInfeasible(plan, term, need - budget, k, reason,
                                     tuple(sorted(static.items(), key=lambda kv: -kv[1])))
    return None


def search(
    model: ModelSpec,
    system: SystemSpec,
    *,
    num_gpus: int,
    seq_length: int,
    global_batch_size: int,
    constraints: SearchConstraints = SearchConstraints(),
    alpha_mode: AlphaMode = "auto",
    memory_budget_bytes: Optional[int] = None,
    exhaustive: bool = False,
    top: Optional[int] = None,
    host_memory_budget_bytes: Optional[int] = None,
) -> SearchResult:
    """Enumerate, price and rank every valid plan (pure; no printing).

    The space: layouts x micro batches x recompute modes (``constraints.ckpt`` fixes one; else ckpt ``full``,
    Megatron's block recompute of the smallest N that fits without offload on ``ours`` and on ``no``, selective
    ``core_attn`` on ``ours`` and ``no`` with unfused attention, ckpt ``ours`` and ``no``) x activation offload
    alpha (``alpha_mode``) x the memory ladder's options x precisions.

    By default two shortcuts skip pricing: memory grows with the micro batch and from ckpt ``full``
    to ``ours`` to ``no`` (so what does not fit prunes what keeps more), and for one layout and mode
    the micro batches after the first one that is slower than the previous are skipped (throughput
    is unimodal in the micro batch: per-microbatch work scales with it, the bubble grows as the
    microbatch count falls). ``exhaustive`` prices every valid plan; only the exact check that
    weights, gradients and optimizer states alone exceed the budget still prunes.

    ``top`` (ignored with ``exhaustive``): only the best ``top`` plans are needed; the search runs
    best-first on an upper bound of tokens/s and prices no plan that cannot enter them (the best
    ``max(top, TIMELINE_TOP)``: the timeline re-ranks that many, whatever ``top``). ``plans`` then
    holds every plan priced that fits, of which the first ``top`` are exact.
    """
    if top is not None and top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    if isinstance(alpha_mode, tuple) and constraints.pipeline_model_parallel_size != len(alpha_mode):
        raise ValueError(f"alpha_mode {alpha_mode} (one per stage) needs constraints.pipeline_model_parallel_size = "
                         f"{len(alpha_mode)} (got {constraints.pipeline_model_parallel_size}); else one number or a mode")
    layouts, rejected = enumerate_layouts(
        model, num_gpus=num_gpus, seq_length=seq_length, global_batch_size=global_batch_size,
        gpus_per_node=system.gpus_per_node, constraints=constraints)
    col = Collector(rejected)
    modes = search_modes(constraints.ckpt, constraints.attention_backend, moe=model.is_moe)
    if model.is_moe:  # h3t-ext's activation offload and ckpt=ours run in its runtime, which has no MoE layers
        if constraints.ckpt is not None and str(constraints.ckpt) == "ours":
            raise InvalidPlanError(MOE_OURS_REASON)
        if alpha_mode not in ("auto", 0, 0.0):
            raise InvalidPlanError(f"offload_alpha {alpha_mode} with a mixture-of-experts model: h3t-ext's activation "
                                   f"offload runs in its runtime, which has no MoE layers; valid: leave it out")
        alpha_mode = 0.0
    static: dict[tuple, Optional[ClosestInfeasible]] = {}
    switches = {k: getattr(constraints, k) for k in ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap",
                                                      "overlap_p2p_comm", "sequence_parallel",
                                                      "use_distributed_optimizer", "data_parallel_sharding_strategy",
                                                      "attention_backend", "transformer_impl", "optimizer_impl",
                                                      "transformer_engine_version",
                                                      "optimizer_cpu_offload",
                                                      "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
                                                      "grad_reduce_in_bf16", "fp16", "bias_activation_fusion",
                                                      "use_legacy_models", "cross_entropy_loss_fusion",
                                                      "cross_entropy_fusion_impl")}
    if not model.is_moe:  # the expert switches asked for, as a dense model's plans refuse them
        validate_dense_experts(constraints)
    else:  # the experts' switches; the memory ladder's options are not priced with experts
        if constraints.overlap_cpu_optimizer_d2h_h2d and not constraints.optimizer_cpu_offload:
            raise InvalidPlanError("overlap_cpu_optimizer_d2h_h2d with a mixture-of-experts model: it overlaps the "
                                   "copies of the optimizer offload the memory ladder tries, which is not priced with "
                                   "experts; valid: leave it off")
        dispatcher = constraints.moe_token_dispatcher_type or "alltoall"
        if constraints.moe_shared_expert_overlap and not model.moe_shared_expert_intermediate_size:
            raise InvalidPlanError("moe_shared_expert_overlap needs a shared expert (moe_shared_expert_intermediate_size)")
        if constraints.moe_shared_expert_overlap and dispatcher != "alltoall":
            raise InvalidPlanError(f"moe_shared_expert_overlap only works with moe_token_dispatcher_type alltoall "
                                   f"(megatron-core raises), got {dispatcher!r}")
        a2a = constraints.overlap_moe_expert_parallel_comm  # exclusive with the shared expert's overlap
        switches.update(moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=True,
                        moe_shared_expert_overlap=bool(model.moe_shared_expert_intermediate_size)
                        and dispatcher == "alltoall" and not a2a, overlap_moe_expert_parallel_comm=a2a)
    best_first = top is not None and not exhaustive
    budgets = _Budgets(memory_budget_bytes, host_memory_budget_bytes,
                       () if model.is_moe else constraints.memory_ladder)
    live: list[tuple[tuple, Layout]] = []
    runs = _runs(num_gpus, seq_length, global_batch_size, switches, constraints)
    refusals = [_run_refusal(run, system, model) for run in runs]
    if all(refusals):  # every precision searched is refused whatever the layout: say why, not the layout rules
        raise InvalidPlanError("; ".join(dict.fromkeys(refusals)))
    for run, reason in zip(runs, refusals):
        if reason:  # e.g. FP8 on a GPU without it: no plan of that precision
            col.rejected[reason] += sum(len(modes) * len(x.micro_batch_sizes) for x in layouts)
            continue
        for layout in layouts:
            key = (run[3].get("fp8"), layout.tensor_model_parallel_size, layout.context_parallel_size,
                   layout.pipeline_model_parallel_size, layout.pipeline_model_parallel_layout,
                   layout.expert_model_parallel_size, layout.expert_tensor_parallel_size)
            if key not in static:
                probe = candidate_plan(run, layout, layout.micro_batch_sizes[0], modes[0])
                static[key] = _static_infeasibility(model, system, probe, budgets)
            if static[key] is not None:
                col.reject_memory(static[key], len(modes) * len(layout.micro_batch_sizes))
                continue
            if best_first:
                live.append((run, layout))
            else:
                _search_layout(col, model, system, layout, modes, alpha_mode, budgets, run, exhaustive)
    if best_first:  # at least every plan the timeline may re-rank, so that --top does not change the plans it shows
        _search_best_first(col, model, system, live, modes, alpha_mode, budgets, max(top, TIMELINE_CAP))
    ranked = sorted(col.feasible, key=lambda r: (-r.tokens_per_second, r.evaluation.estimate.peak_memory_bytes))
    ranked = _with_timeline(model, system, ranked, TIMELINE_TOP, alpha_mode, budgets)
    return SearchResult(tuple(ranked), dict(col.rejected), col.considered, col.closest)


def _runs(num_gpus: int, seq_length: int, global_batch_size: int, switches: dict,
          k: SearchConstraints) -> list[tuple]:
    """One (GPUs, sequence, batch, switches) per precision searched; FP8 plans carry the FP8 settings."""
    fp8 = {"fp8": k.fp8, "fp8_recipe": k.fp8_recipe, "fp8_param_gather": k.fp8_param_gather,
           "first_last_layers_bf16": k.first_last_layers_bf16,
           "num_layers_at_start_in_bf16": k.num_layers_at_start_in_bf16,
           "num_layers_at_end_in_bf16": k.num_layers_at_end_in_bf16}
    return [(num_gpus, seq_length, global_batch_size, {**switches, **(fp8 if precision == "fp8" else {})})
            for precision in k.precisions]


def _run_refusal(run: tuple, system: SystemSpec, model: Optional[ModelSpec] = None) -> Optional[str]:
    """Why no plan of this run can be built: its switches contradict each other (Megatron-LM's rules of the Plan,
    e.g. a sharding strategy without the distributed optimizer) or its precision cannot run on ``system`` (the FP8
    rules); None when its plans can be. --tp-comm-overlap is left out of the probe: it applies where t > 1."""
    num_gpus, seq_length, global_batch_size, switches = run
    try:
        probe = Plan(num_gpus=num_gpus, seq_length=seq_length, global_batch_size=global_batch_size,
                     **applicable_switches(switches, 1))
        validate_switches(probe)
        validate_fp8(probe, system)
        if model is not None and model.is_moe:  # the switches the cost model refuses with experts (FP8 among them)
            validate_moe(model, probe, layout=False)
    except InvalidPlanError as e:
        return e.reason
    return None


def _with_timeline(model, system, ranked: list[RankedPlan], k: int, alpha_mode, budget) -> list[RankedPlan]:
    """The first ``k`` plans (closed-form order) priced again on the timeline of their action lists and
    ranked by it; the rest keep their closed-form estimates, after them. A closed-form plan that would rank
    above the last timeline-priced one is priced on the timeline too (until none does, or ``TIMELINE_CAP``
    plans have been), so the list is best first up to that cap."""
    kept: list[RankedPlan] = []
    rest = list(ranked)
    while rest and (len(kept) < k or (rest[0].tokens_per_second > kept[-1].tokens_per_second
                                      and len(kept) < TIMELINE_CAP)):
        closed_form = rest.pop(0)
        ev = closed_form.evaluation
        est = estimate(model, ev.plan, system, memory_budget_bytes=budget.device,
                       host_memory_budget_bytes=budget.host)
        kept.append(replace(closed_form, evaluation=replace(ev, estimate=est)))
        kept.sort(key=lambda r: (-r.tokens_per_second, r.evaluation.estimate.peak_memory_bytes))
    return kept + rest


def _candidate_plan(col: Collector, model, system, run, layout: Layout, mb: int, mode: RecomputeMode, alpha_mode,
                    budget: _Budgets) -> tuple[Optional[Plan], bool]:
    """(the plan of one candidate, False); a block mode's with its smallest N that fits
    (:func:`~h3t_ext.planner.recompute_modes.smallest_block_layers`), or (None, whether that is a memory verdict
    that prunes) after counting why it has none."""
    plan = candidate_plan(run, layout, mb, mode)
    if not mode.block:
        return plan, False
    try:
        choice = smallest_block_layers(model, system, plan, alpha_mode=alpha_mode, memory_budget_bytes=budget.device)
    except InvalidPlanError as e:
        col.rejected[reason_category(e.reason)] += 1
        return None, False
    if choice.num_layers is None:
        col.rejected[choice.reason] += 1
        return None, choice.reason == R_BLOCK_NONE
    return candidate_plan(run, layout, mb, mode, choice.num_layers), False


def _search_layout(col: Collector, model, system, layout: Layout, modes, alpha_mode, budget, run,
                   exhaustive: bool) -> None:
    """Price one layout over recompute modes (least memory first) and micro batches (ascending)."""
    mbs = layout.micro_batch_sizes
    failed: list[tuple[RecomputeMode, int]] = []  # (mode, micro batch index) that did not fit
    for mode in modes:
        previous = None
        for i, mb in enumerate(mbs):
            if any(i >= fi and mode.fails_where(f) for f, fi in failed):
                col.rejected[R_PRUNED] += len(mbs) - i
                break
            plan, no_fit = _candidate_plan(col, model, system, run, layout, mb, mode, alpha_mode, budget)
            if plan is None:
                if no_fit and not exhaustive:
                    failed.append((mode, i))
                continue
            ranked = _price(col, model, system, plan, alpha_mode, budget)
            if exhaustive:
                continue
            if ranked is None:
                if not mode.block:  # a priced block candidate's failure is its N's (fails_where)
                    failed.append((mode, i))  # the next micro batch counts the rest as pruned
                continue
            if ranked and previous is not None and ranked.tokens_per_second < previous:
                col.rejected[R_SLOWER] += len(mbs) - i - 1
                break
            if ranked is not False:
                previous = ranked.tokens_per_second


def _search_best_first(col: Collector, model, system, layouts: list[tuple[tuple, Layout]], modes, alpha_mode,
                       budget, top: int) -> None:
    """Price candidates from the highest tokens/s bound down until no remaining one can enter the top.

    The candidates are taken in the order of (minus the bound, layout index, mode index, micro batch index). The
    queue starts with one entry per layout holding the bound of all its candidates (:meth:`~h3t_ext.planner.bounds.Bounds.layout`, mode
    index ``LAYOUT_ENTRY``: it comes out before any of them); taking it out puts in one entry per micro batch holding the
    bound of its modes (``GROUP_ENTRY``, when several are searched), and taking that out its candidates with their own
    bounds. Candidates come out in the order of sorting every candidate's bound, while only the layouts and micro
    batches that could enter the top are bounded one by one. A block candidate comes out first with its base's
    bound; its N is then chosen and it goes back in with its own (lower) bound. At a fixed alpha, once the top is
    full, a candidate that comes out goes back in with its own offload_exposed counted, where it has some."""
    bounds = Bounds(model, system, layouts, modes, None if isinstance(alpha_mode, str) else alpha_mode)
    modes = bounds.modes
    queue = [(-bounds.layout(li), li, LAYOUT_ENTRY, -1) for li in range(len(layouts))]
    heapq.heapify(queue)
    remaining = len(modes) * sum(len(layout.micro_batch_sizes) for _, layout in layouts)  # candidates not taken
    best: list[float] = []  # min-heap of the best ``top`` tokens/s found
    failed: dict[int, list[tuple[int, int]]] = {}  # layout -> (mode, micro batch) indices that did not fit
    least_prunes_all = not modes[0].block and all(m.fails_where(modes[0]) for m in modes)
    rungs: dict[int, _DeadRungs] = {}  # layout -> its rungs where no candidate fits
    check_rungs = least_prunes_all
    tried: dict[int, dict] = {}  # layout -> rung -> (mode, micro batch) indices that fit nowhere on it (_Tried)
    while queue:
        minus_bound, li, ci, i = heapq.heappop(queue)
        if len(best) >= top and -minus_bound * (1 + 1e-9) < best[0]:
            col.rejected[R_BOUND] += remaining
            break
        if ci < 0:
            for entry in bounds.expand(li, ci, i):
                heapq.heappush(queue, entry)
            continue
        mode = modes[ci]
        if any(i >= fi and mode.fails_where(modes[fc]) for fc, fi in failed.get(li, ())):
            remaining -= 1
            col.rejected[R_PRUNED] += 1
            continue
        run, layout = layouts[li]
        mb = layout.micro_batch_sizes[i]
        if mode.block and (li, ci, i) not in bounds.block_layers:
            plan, no_fit = _candidate_plan(col, model, system, run, layout, mb, mode, alpha_mode, budget)
            if plan is None:
                remaining -= 1
                if no_fit:
                    failed.setdefault(li, []).append((ci, i))
                continue
            bounds.block_layers[(li, ci, i)] = plan.recompute.num_layers
            heapq.heappush(queue, (-bounds.bound(li, ci, i), li, ci, i))
            continue
        if len(best) >= top and bounds.count_offload(li, ci, i):  # where it may prune: a fixed alpha's exposed
            #                                                            copies, back in with the lower bound
            heapq.heappush(queue, (-bounds.bound(li, ci, i), li, ci, i))
            continue
        remaining -= 1
        plan = candidate_plan(run, layout, mb, mode, bounds.block_layers.get((li, ci, i)))

        def can_enter(variant: Plan, li=li, ci=ci, i=i) -> bool:  # as the queue's test, on the variant's own bound
            return len(best) < top or bounds.variant(li, ci, i, variant) * (1 + 1e-9) >= best[0]

        if check_rungs and li not in rungs:
            rungs[li] = _DeadRungs(model, system, candidate_plan(run, layout, layout.micro_batch_sizes[0], modes[0]),
                                   alpha_mode, budget)
        ranked = _price(col, model, system, plan, alpha_mode, budget, can_enter, rungs.get(li),
                        _Tried(tried.setdefault(li, {}), modes, ci, i))
        if ranked is None:
            if not mode.block:  # a priced block candidate's failure is its N's (fails_where)
                failed.setdefault(li, []).append((ci, i))
            if li in rungs and rungs[li].everywhere():
                # its least-memory candidate fits nowhere: nor does any (the pruning rule)
                failed.setdefault(li, []).append((0, 0))
        elif ranked:
            if len(best) < top:
                heapq.heappush(best, ranked.tokens_per_second)
            elif ranked.tokens_per_second > best[0]:
                heapq.heapreplace(best, ranked.tokens_per_second)
