"""One plan -> per-stage memory, iteration time, throughput and MFU (pure arithmetic)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional

from h3t_ext.costmodel.activations import ReloadCounts, rank_offloads, rank_reload_counts, residency_lines
from h3t_ext.costmodel.layer_offload import OffloadTraffic, layer_offload, layers_per_chunk, p1_traffic
from h3t_ext.costmodel.errors import InfeasiblePlanError, InvalidPlanError
from h3t_ext.costmodel.memory import StageMemory, chunk_activation_bytes, stage_host_bytes, stage_memory
from h3t_ext.costmodel.mfu import model_flops_per_token
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.plan_checks import validate_plan
from h3t_ext.costmodel.reserve import ALLOCATOR_GAP_RANGE, allocator_gap_left, default_memory_budget_bytes, \
    memory_reserve
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec
from h3t_ext.costmodel.timeline import Timeline, plan_timeline, timeline_terms, timeline_too_large
from h3t_ext.costmodel.timing import TimeTerms, offload_exposed_seconds, shape_times, time_terms
from h3t_ext.costmodel.plausibility import Plausibility, plausibility
from h3t_ext.costmodel.uncertainty import ThroughputUncertainty, throughput_uncertainty

GB = 1e9
HOST_MEMORY_USABLE_FRACTION = 0.8
"""Share of a node's host DRAM (system file ``host_memory_bytes``) the default host budget gives the training
ranks' offloaded state: the operating system, the page cache of the dataset, the data-loader workers and the
ranks' own Python heaps keep the rest (an assumption, stated; ``--host-memory-budget`` replaces it)."""


def default_host_memory_budget_bytes(system: SystemSpec) -> Optional[int]:
    """Host bytes per node offloaded state may take by default; None when the system file states no host memory."""
    return int(system.host_memory_bytes * HOST_MEMORY_USABLE_FRACTION) if system.host_memory_bytes else None


@dataclass(frozen=True)
class Estimate:
    """Predicted memory and speed of one plan."""

    plan: Plan
    """The plan that was priced."""
    offload_alpha: tuple[float, ...]
    """Resolved offload ratio, one per pipeline stage."""
    stages: tuple[StageMemory, ...]
    """Peak memory terms of every pipeline rank."""
    memory_budget_bytes: int
    """Budget the plan was checked against (given, or the plan's default on the system:
    ``reserve.default_memory_budget_bytes``)."""
    time_terms: TimeTerms
    """Seconds per iteration by term; they add up to ``iteration_time_s``: the timeline's (the rank that
    ends last) when it was run, else the closed form's."""
    closed_form: TimeTerms
    """The closed form's terms (what the planner prunes with; without a timeline the same as ``time_terms``)."""
    timeline: Optional[Timeline] = None
    """The simulated timeline of the schedule builder's action lists (None: closed form only)."""
    tokens_per_iteration: int = 0
    """global_batch_size * seq_length."""
    num_gpus: int = 1
    """GPUs of the plan."""
    model_flops_per_token: float = 0.0
    """FLOPs per token of the MFU convention."""
    peak_flops: float = 0.0
    """Peak bf16 FLOP/s of one GPU."""
    pcie_bytes_per_iteration: int = 0
    """Host<->device bytes per iteration per GPU (both directions, the worst stage)."""
    efficiency_set: str = ""
    """GPU family of the system it was priced on (what :attr:`plausibility` compares within)."""
    host_terms: tuple[tuple[str, int], ...] = ()
    """Host bytes of the rank that holds most, by term (offloaded optimizer share, offloaded activations)."""
    ranks_per_host: int = 1
    """Ranks sharing one host, its DRAM and the host memory budget (the system's ``gpus_per_host``, at most the plan's
    GPUs; a DGX node's 8, a GB200 compute tray's 4)."""
    host_memory_budget_bytes: Optional[int] = None
    """Host bytes per node offloaded state may take (None: not checked)."""
    offload_traffic: Optional[OffloadTraffic] = None
    """Pipeline size 1 with alpha > 0: the layer-granular offload's PCIe traffic and what it hides behind."""
    timeline_note: str = ""
    """Why a timeline was asked for and not run (the schedule is too large to simulate: the closed form prices
    it), else empty."""
    moe: bool = False
    """The model has mixture-of-experts layers: its prediction interval is the published MoE runs' and its routing
    is priced balanced (``h3t_ext.costmodel.moe``)."""
    device_free_bytes: Optional[int] = None
    """HBM less the CUDA context and a rank's NCCL buffers (the budget before the allocator's reserve); None when the
    budget was given (``--memory-budget``)."""

    @property
    def allocator_gap_left(self) -> Optional[float]:
        """The most the caching allocator may reserve beyond the peak, as a fraction of it, for the plan to fit the
        GPU (None with a given budget): the verdict is marginal when this lies in ``reserve.ALLOCATOR_GAP_RANGE``."""
        return None if self.device_free_bytes is None else allocator_gap_left(self.device_free_bytes,
                                                                               self.peak_memory_bytes)

    @property
    def memory_marginal(self) -> bool:
        """The device verdict would change inside the allocator's usual reserve (3-8% above the peak)."""
        gap = self.allocator_gap_left
        return gap is not None and ALLOCATOR_GAP_RANGE[0] <= gap < ALLOCATOR_GAP_RANGE[1]

    @property
    def host_bytes_per_rank(self) -> int:
        return sum(b for _, b in self.host_terms)

    @property
    def host_bytes_per_node(self) -> int:
        """Every rank of a node taken as the one that holds most."""
        return self.host_bytes_per_rank * self.ranks_per_host

    @property
    def host_fits(self) -> bool:
        return self.host_memory_budget_bytes is None or self.host_bytes_per_node <= self.host_memory_budget_bytes

    @property
    def peak_memory_bytes(self) -> int:
        return max(s.peak_bytes for s in self.stages)

    @property
    def peak_stage(self) -> int:
        return max(self.stages, key=lambda s: s.peak_bytes).stage

    @property
    def fits(self) -> bool:
        """Device memory within its budget and the node's offloaded state within the host budget."""
        return self.peak_memory_bytes <= self.memory_budget_bytes and self.host_fits

    @property
    def iteration_time_s(self) -> float:
        return self.time_terms.total

    @property
    def closed_form_time_s(self) -> float:
        """The closed form's iteration time."""
        return self.closed_form.total

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_iteration / self.iteration_time_s

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.tokens_per_second / self.num_gpus

    @property
    def uncertainty(self) -> ThroughputUncertainty:
        """The prediction interval that applies to this estimate (``uncertainty.throughput_uncertainty``): the
        fitted sources' held-out spread, the MoE runs' for an MoE model, a carried-over GPU family's own held-out
        runs' where wider."""
        return throughput_uncertainty(self.moe, self.efficiency_set)

    @property
    def tokens_per_second_interval(self) -> tuple[float, float]:
        """(low, high) tokens/s of :attr:`uncertainty`."""
        return self.uncertainty.interval(self.tokens_per_second)

    @property
    def mfu(self) -> float:
        return self.tokens_per_second_per_gpu * self.model_flops_per_token / self.peak_flops

    @property
    def plausibility(self) -> Plausibility:
        """The predicted MFU against the best published MFU of this GPU family and precision."""
        return plausibility(self.mfu, self.efficiency_set, self.plan.precision)

    def infeasibility(self) -> Optional[InfeasiblePlanError]:
        """The error describing why the plan does not fit, or None when it fits."""
        if self.fits:
            return None
        if self.peak_memory_bytes <= self.memory_budget_bytes:  # the host is what does not fit
            excess = self.host_bytes_per_node - self.host_memory_budget_bytes
            terms = ", ".join(f"{k} {b / GB:.1f} GB" for k, b in self.host_terms if b)
            return InfeasiblePlanError(
                f"host memory: {self.ranks_per_host} ranks x {self.host_bytes_per_rank / GB:.1f} GB ({terms}) = "
                f"{self.host_bytes_per_node / GB:.1f} GB per node > host budget "
                f"{self.host_memory_budget_bytes / GB:.1f} GB, over by {excess / GB:.1f} GB",
                term="host_memory", excess_bytes=int(excess), stage=None)
        return over_budget_error(self.stages[self.peak_stage], self.memory_budget_bytes)

    def raise_if_infeasible(self) -> None:
        err = self.infeasibility()
        if err is not None:
            raise err

    def explain_lines(self) -> list[str]:
        """Human-readable breakdown (memory of the peak stage, time terms) for ``--explain``."""
        peak = self.stages[self.peak_stage]
        a = self.offload_alpha
        alpha = f"{a[0]:.3f}" if len(set(a)) == 1 else "(" + ", ".join(f"{x:.3f}" for x in a) + ")"
        lines = [f"memory: peak {self.peak_memory_bytes / GB:.2f} GB on stage {peak.stage} "
                 f"(budget {self.memory_budget_bytes / GB:.2f} GB, {'fits' if self.fits else 'DOES NOT FIT'}), "
                 f"offload_alpha {alpha}"]
        for k, b in sorted(peak.terms.items(), key=lambda kv: -kv[1]):
            if b:
                lines.append(f"  {k:<26} {b / GB:8.2f} GB")
        lines.append("  per stage: " + " ".join(f"{s.peak_bytes / GB:.1f}" for s in self.stages) + " GB")
        total = self.iteration_time_s
        lines.append(f"time: {total:.3f} s/iteration, {self.tokens_per_second:,.0f} tokens/s, "
                     f"{self.tokens_per_second_per_gpu:,.0f} tokens/s/GPU, MFU {self.mfu:.3f}")
        for k, t in sorted(self.time_terms.as_dict().items(), key=lambda kv: -kv[1]):
            if t:
                lines.append(f"  {k:<26} {t:8.3f} s  {t / total:6.1%}")
        if self.timeline is not None:
            tl = self.timeline
            lines.append(f"  timeline of the schedule's action lists (critical rank {tl.critical_rank}); closed form "
                         f"{self.closed_form_time_s:.3f} s ({self.closed_form_time_s / total - 1:+.2%})")
            lines.append("  per rank busy/bubble/p2p/stall s: " + " ".join(
                f"{r.busy:.2f}/{r.bubble:.2f}/{r.p2p:.2f}/{r.stall:.2f}" for r in tl.ranks))
        if self.timeline_note:
            lines.append(f"  {self.timeline_note}")
        if self.pcie_bytes_per_iteration:
            lines.append(f"pcie: {self.pcie_bytes_per_iteration / GB:.1f} GB per iteration per GPU")
        tr = self.offload_traffic
        if tr is not None:
            lines.append(f"  layer-granular offload: layers 0-{tr.offloaded_layers - 1} of {tr.num_layers}, "
                         f"{tr.bytes_per_microbatch / GB:.2f} GB each way per microbatch; a layer's copy "
                         f"({tr.layer_copy_bytes / GB:.3f} GB, {tr.layer_copy_s * 1e3:.2f} ms) hides behind the next "
                         f"layer's forward ({tr.next_forward_s * 1e3:.2f} ms) and backward "
                         f"({tr.next_backward_s * 1e3:.2f} ms); exposed {tr.exposed_per_microbatch_s * 1e3:.2f} ms "
                         "per microbatch")
        return lines

    def to_dict(self) -> dict:
        """JSON-ready summary (bytes, seconds)."""
        p = self.plan
        return {
            "plan": {
                "num_gpus": p.num_gpus, "seq_length": p.seq_length, "global_batch_size": p.global_batch_size,
                "micro_batch_size": p.micro_batch_size, "tensor_model_parallel_size": p.tensor_model_parallel_size,
                "context_parallel_size": p.context_parallel_size,
                "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
                "num_layers_per_virtual_pipeline_stage": p.num_layers_per_virtual_pipeline_stage,
                "data_parallel_size": p.data_parallel_size, "num_microbatches": p.num_microbatches,
                "ckpt": p.ckpt,
            },
            "offload_alpha": list(self.offload_alpha),
            "memory_budget_bytes": self.memory_budget_bytes,
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_stage": self.peak_stage,
            "fits": self.fits,
            "allocator_gap_left": self.allocator_gap_left,
            "memory_marginal": self.memory_marginal,
            "stages": [s.to_dict() for s in self.stages],
            "time_terms_s": self.time_terms.as_dict(),
            "iteration_time_s": self.iteration_time_s,
            "closed_form_iteration_time_s": self.closed_form_time_s,
            "timeline": None if self.timeline is None else self.timeline.to_dict(),
            **({"timeline_note": self.timeline_note} if self.timeline_note else {}),
            "tokens_per_second": self.tokens_per_second,
            "tokens_per_second_per_gpu": self.tokens_per_second_per_gpu,
            "tokens_per_second_interval": list(self.tokens_per_second_interval),
            "tokens_per_second_relative_half_width": self.uncertainty.relative_half_width,
            "mfu": self.mfu,
            "plausibility": self.plausibility.to_dict(),
            "pcie_bytes_per_iteration": self.pcie_bytes_per_iteration,
            "offload_traffic": None if self.offload_traffic is None else self.offload_traffic.to_dict(),
            "host_memory": {"terms_per_rank": dict(self.host_terms), "bytes_per_node": self.host_bytes_per_node,
                            "budget_bytes_per_node": self.host_memory_budget_bytes, "fits": self.host_fits},
        }


def over_budget_error(stage: StageMemory, budget: int, suffix: str = "") -> InfeasiblePlanError:
    """InfeasiblePlanError naming the stage's largest term and the excess."""
    excess = stage.peak_bytes - budget
    term = stage.largest_term()
    reason = (f"stage {stage.stage} needs {stage.peak_bytes / GB:.1f} GB > budget {budget / GB:.1f} GB: "
              f"{term} {stage.terms[term] / GB:.1f} GB is the largest term, over by {excess / GB:.1f} GB{suffix}")
    return InfeasiblePlanError(reason, term=term, excess_bytes=int(excess), stage=stage.stage)


def estimate(model: ModelSpec, plan: Plan, system: SystemSpec, *,
             memory_budget_bytes: Optional[int] = None, timeline: bool = True,
             host_memory_budget_bytes: Optional[int] = None) -> Estimate:
    """Price ``plan``; raises InvalidPlanError for plans that cannot be built. Does not raise when the plan
    does not fit memory: check ``fits`` or call ``raise_if_infeasible()``.

    The time is the simulated timeline of the schedule builder's action lists (:mod:`timeline`);
    ``timeline=False`` prices the closed form only (the planner's pruning), which ``closed_form`` always holds.
    ``host_memory_budget_bytes`` (per node) replaces :func:`default_host_memory_budget_bytes`."""
    validate_plan(model, plan, system)
    reserve = memory_reserve(model, plan, system) if memory_budget_bytes is None else None
    budget = reserve.budget_bytes if reserve is not None else int(memory_budget_bytes)
    p, m = plan.pipeline_model_parallel_size, plan.num_microbatches
    alphas, v, chunks, offloaded = _closed_form_inputs(model, plan)
    stages = tuple(stage_memory(model, plan, k, alphas[k], system) for k in range(p))
    closed = _closed_form(model, plan, system, alphas, chunks)
    too_large = timeline_too_large(model, plan, alphas) if timeline else None
    tl = plan_timeline(model, plan, system, alphas, whole=too_large is None) if timeline else None
    terms = closed if tl is None else _checked(timeline_terms(model, plan, system, tl), system)
    layers = layers_per_chunk(model, plan)
    traffic = None
    if layers is not None:  # pipeline size 1: layer-granular, every microbatch
        pcie = int(2 * m * layer_offload(alphas[0], layers).offloaded * chunks[0])
        if alphas[0] > 0:
            st = shape_times(model, plan, system)
            traffic = p1_traffic(st.mean_layer(layers, plan.stage_bf16_layers(model.num_layers, 0)), st.head.total,
                                 chunks[0], layers, alphas[0], system)
    else:
        pcie = max(int(2 * a * chunk * n) for a, chunk, n in zip(alphas, chunks, offloaded))
    host = max((_host_terms(model, plan, k, alphas[k], v, offloaded[k]) for k in range(p)),
               key=lambda terms: sum(b for _, b in terms))
    return Estimate(
        plan=plan, offload_alpha=alphas, stages=stages, memory_budget_bytes=budget, time_terms=terms,
        closed_form=closed, timeline=tl,
        tokens_per_iteration=plan.tokens_per_iteration, num_gpus=plan.num_gpus,
        model_flops_per_token=model_flops_per_token(model, plan.seq_length), peak_flops=system.peak_bf16_flops,
        pcie_bytes_per_iteration=pcie, efficiency_set=system.efficiency_set, host_terms=host,
        ranks_per_host=min(system.gpus_per_host, plan.num_gpus),
        host_memory_budget_bytes=(default_host_memory_budget_bytes(system) if host_memory_budget_bytes is None
                                  else int(host_memory_budget_bytes)),
        offload_traffic=traffic,
        timeline_note="" if tl is not None or too_large is None else f"priced by the closed form: {too_large}",
        moe=model.is_moe,
        device_free_bytes=None if reserve is None else reserve.free_bytes,
    )


def _device_stages(model: ModelSpec, plan: Plan, system: SystemSpec,
                   memory_budget_bytes: Optional[int]) -> tuple[int, Iterator[StageMemory]]:
    """(the device budget ``estimate`` checks ``plan`` against, its stages' memory as they are asked for), after
    ``validate_plan``: what :func:`device_fits` and :func:`device_infeasibility` read."""
    validate_plan(model, plan, system)
    budget = default_memory_budget_bytes(model, plan, system) if memory_budget_bytes is None \
        else int(memory_budget_bytes)
    alphas = plan.alphas()
    return budget, (stage_memory(model, plan, k, alphas[k], system) for k in range(plan.pipeline_model_parallel_size))


def device_fits(model: ModelSpec, plan: Plan, system: SystemSpec, *,
                memory_budget_bytes: Optional[int] = None) -> bool:
    """Whether every stage's device peak is within the budget: ``estimate``'s device test (its ``fits`` without the
    host's), without its time terms (stops at the first stage over). Raises InvalidPlanError as ``estimate`` does."""
    budget, stages = _device_stages(model, plan, system, memory_budget_bytes)
    return all(s.peak_bytes <= budget for s in stages)


def device_infeasibility(model: ModelSpec, plan: Plan, system: SystemSpec, *,
                         memory_budget_bytes: Optional[int] = None) -> Optional[InfeasiblePlanError]:
    """``estimate(...).infeasibility()`` where the device does not fit (the peak stage over the budget), without its
    time terms; None where the device fits (the host may still not). Raises InvalidPlanError as ``validate_plan``
    does."""
    budget, stages = _device_stages(model, plan, system, memory_budget_bytes)
    peak = max(stages, key=lambda s: s.peak_bytes)
    return over_budget_error(peak, budget) if peak.peak_bytes > budget else None


def _checked(terms: TimeTerms, system: SystemSpec) -> TimeTerms:
    if not (math.isfinite(terms.total) and terms.total > 0):
        raise InvalidPlanError(f"system {system.name}: its rates and efficiencies price an iteration at "
                               f"{terms.total} s (a peak FLOP/s or a bandwidth times its efficiency is too small to "
                               "price); valid: rates of at least one per second and efficiencies that keep them so")
    return terms


def _closed_form_inputs(model: ModelSpec,
                        plan: Plan) -> tuple[tuple[float, ...], int, tuple[int, ...], tuple[int, ...]]:
    """What the closed form reads of ``plan`` besides the system: each stage's alpha, the virtual size, one
    microbatch-chunk's activation bytes per stage (:func:`_chunk_bytes`) and each stage's offloaded
    microbatch-chunks."""
    alphas = plan.alphas()
    p, m = plan.pipeline_model_parallel_size, plan.num_microbatches
    v = plan.virtual_size(model.num_layers)
    return alphas, v, _chunk_bytes(model, plan, alphas), tuple(
        rank_offloads(p, m, v, k, plan.microbatch_group_size_per_vp_stage) for k in range(p))


def _chunk_bytes(model: ModelSpec, plan: Plan, alphas: tuple[float, ...]) -> tuple[int, ...]:
    """One microbatch-chunk's saved bytes on each stage that offloads (its mean chunk, as the timeline copies it;
    0 where alpha is 0); at pipeline size 1 the one stage's, whatever alpha (its layer-granular copies)."""
    if plan.pipeline_model_parallel_size == 1:
        return (chunk_activation_bytes(model, plan),)
    return tuple(chunk_activation_bytes(model, plan, k) if a > 0 else 0 for k, a in enumerate(alphas))


def _reload_counts(model: ModelSpec, plan: Plan) -> tuple[ReloadCounts, ...]:
    """How each stage's copies meet its computes (:class:`~h3t_ext.costmodel.activations.ReloadCounts`)."""
    p, m, g = plan.pipeline_model_parallel_size, plan.num_microbatches, plan.microbatch_group_size_per_vp_stage
    v = plan.virtual_size(model.num_layers)
    return tuple(rank_reload_counts(p, m, v, k, g) for k in range(p))


def _closed_form(model: ModelSpec, plan: Plan, system: SystemSpec, alphas, chunks: tuple[int, ...]) -> TimeTerms:
    return _checked(time_terms(model, plan, system, alphas=alphas, chunk_bytes=chunks,
                               reloads=_reload_counts(model, plan)), system)


def closed_form_terms(model: ModelSpec, plan: Plan, system: SystemSpec) -> TimeTerms:
    """``estimate(model, plan, system, timeline=False).time_terms`` without the memory terms, which no
    efficiency of ``system`` changes: what a fit of the efficiencies prices thousands of times
    (:mod:`~h3t_ext.costmodel.fit`). The same validation and the same closed form as :func:`estimate`."""
    validate_plan(model, plan, system)
    alphas, _, chunks, _ = _closed_form_inputs(model, plan)
    return _closed_form(model, plan, system, alphas, chunks)


def closed_form_offload_seconds(model: ModelSpec, plan: Plan, system: SystemSpec) -> float:
    """``closed_form_terms(model, plan, system).offload_exposed`` without the other terms (``plan`` valid): the
    planner's bounds add it at a fixed alpha."""
    alphas = plan.alphas()
    if not any(a > 0 for a in alphas):
        return 0.0
    return offload_exposed_seconds(model, plan, system, alphas=alphas, chunk_bytes=_chunk_bytes(model, plan, alphas),
                                   reloads=_reload_counts(model, plan))


def _host_terms(model: ModelSpec, plan: Plan, stage: int, alpha: float, v: int,
                offloads: int) -> tuple[tuple[str, int], ...]:
    """Host bytes of one rank of ``stage``: its offloaded optimizer share and, with activation offload, at most
    alpha of every microbatch-chunk it holds at its peak (the pinned copies wait on the host until reloaded)."""
    terms = dict(stage_host_bytes(model, plan, stage))
    layers = layers_per_chunk(model, plan)
    if layers is not None and alpha > 0:  # pipeline size 1: one microbatch's offloaded layers at a time
        terms["activations"] = int(layer_offload(alpha, layers).offloaded * chunk_activation_bytes(model, plan, stage))
    elif alpha > 0 and offloads:
        held = max(full + n_off for full, n_off in residency_lines(
            plan.pipeline_model_parallel_size, plan.num_microbatches, v, stage, plan.microbatch_group_size_per_vp_stage))
        terms["activations"] = int(alpha * held * chunk_activation_bytes(model, plan, stage))
    return tuple(terms.items())
