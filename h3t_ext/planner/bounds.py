"""The best-first search's candidates: the plan of one (layout, recompute mode, micro batch) and upper bounds on
the tokens/s of candidates and of groups of them (:class:`Bounds`), from the cost model's own terms."""
from __future__ import annotations

from typing import Optional, Union

from h3t_ext.costmodel import Plan
from h3t_ext.costmodel.errors import InvalidPlanError
from h3t_ext.costmodel.estimate import closed_form_offload_seconds
from h3t_ext.costmodel.plan_checks import applicable_switches, validate_plan
from h3t_ext.costmodel.timing import dp_seconds_lower_bound, optimizer_seconds, pipeline_p2p_seconds_by_micro_batch, \
    shape_times
from h3t_ext.layout import pipeline_split
from h3t_ext.planner.recompute_modes import RecomputeMode
from h3t_ext.planner.space import Layout


def candidate_plan(run: tuple, layout: Layout, mb: int, mode, block_layers: Optional[int] = None) -> Plan:
    """The plan of one candidate: ``mode`` a :class:`RecomputeMode` (or a ckpt value), a block mode with its N
    (None: its base alone)."""
    num_gpus, seq_length, global_batch_size, switches = run
    mode = RecomputeMode.of(mode)
    switches = applicable_switches(switches, layout.tensor_model_parallel_size)
    return Plan(
        num_gpus=num_gpus,
        seq_length=seq_length,
        global_batch_size=global_batch_size,
        micro_batch_size=mb,
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        context_parallel_size=layout.context_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        num_layers_per_virtual_pipeline_stage=layout.num_layers_per_virtual_pipeline_stage,
        pipeline_model_parallel_layout=layout.pipeline_model_parallel_layout,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        ckpt=mode.ckpt,
        recompute=mode.recompute_of(block_layers),
        **{**switches, **({"expert_tensor_parallel_size": layout.expert_tensor_parallel_size}
                          if layout.expert_tensor_parallel_size is not None else {})},
    )


LAYOUT_ENTRY, GROUP_ENTRY = -2, -1
"""Mode index of a best-first queue entry that stands for every candidate of a layout / of a (layout, micro batch)."""


class Bounds:
    """Upper bounds on the tokens/s of the best-first candidates (layout index, mode index, micro batch index), and
    of groups of them, each computed when first asked for.

    The cost model's time terms compute + recompute + tp_comm + cp_comm add up to m times the slowest stage's
    per-microbatch time T and the bubble is (sum over stages - T)/v, so together (m - 1/v) T + (sum over
    stages)/v; T is the largest of the stages' layers times the layer's time plus, on the last, the output layer's
    (an even split's last stage; under a layout any stage). With an FP8 plan's BF16 first / last layers each stage
    is its FP8 layers' time plus its BF16 layers' (the bound walks every rank). pp_p2p is exact, dp_exposed at least
    its value with unbounded overlap windows, optimizer >= 0, and offload_exposed exact at a fixed alpha (the
    search's ``--offload-alpha``) once :meth:`count_offload` has counted it, else >= 0: a candidate's own term (its
    saved bytes and windows depend on its mode, micro batch and block N), so a group's and a layout's bounds leave it
    out. With
    --overlap-moe-expert-parallel-comm a layer's time is less what a merged pair of it hides (``merge_hidden``; at
    most one pair per layer and microbatch).

    A layer's time with ckpt ``no`` is its time with any other mode without the recompute terms (>= 0; nothing
    else in it depends on the mode; a BF16 layer's likewise), and the bound only falls as the layer's time grows, so
    the bound of ckpt ``no`` at a micro batch is also one for every mode at that micro batch (:meth:`group`); leaving
    out pp_p2p and
    dp_exposed (>= 0) bounds a whole layout (:meth:`layout`). A block mode's candidate is bounded by its base's
    bound (block recompute only adds time) until its N is known (:attr:`block_layers`), then by its own.
    """

    def __init__(self, model, system, layouts: list[tuple[tuple, Layout]], modes,
                 alpha: Optional[Union[float, tuple[float, ...]]] = None) -> None:
        self.model, self.system, self.layouts = model, system, layouts
        alphas = () if alpha is None else alpha if isinstance(alpha, tuple) else (float(alpha),)
        self.alpha = (alpha if isinstance(alpha, tuple) else alphas[0]) if any(a > 0 for a in alphas) else None
        """The search's fixed offload alpha (one, or one per stage) when some is above 0, else None."""
        self._offload: dict[tuple[int, int, int], float] = {}  # candidate -> its offload_exposed at self.alpha, once
        #                                                           counted (count_offload)
        self.modes = tuple(RecomputeMode.of(c) for c in modes)
        no = RecomputeMode.of("no")
        self.grouped = len(self.modes) > 1 and no in self.modes
        """Whether candidates are grouped by (layout, micro batch) under ckpt ``no``'s bound."""
        self._floor = (self.modes.index(no),) if no in self.modes else tuple(range(len(self.modes)))
        """The mode indices whose bounds bound every mode's."""
        self._plain = tuple(RecomputeMode(m.ckpt, m.recompute) for m in self.modes)
        """Each mode without block recompute (an unresolved block candidate's bound is its base's)."""
        self.block_layers: dict[tuple[int, int, int], int] = {}
        """The N of the block candidates (layout, mode, micro batch indices) resolved so far."""
        unique = list(dict.fromkeys(self.modes + self._plain))
        self._mode_id = tuple(unique.index(m) for m in self.modes)
        self._plain_id = tuple(unique.index(m) for m in self._plain)
        """Each mode's / each plain mode's index among the distinct modes (a cheap key for :attr:`_shapes`)."""
        self._shapes: dict[tuple, tuple[float, float, float]] = {}  # (t, c, mb, mode id, N, chunk, fp8, ep) ->
        #                                                           (layer, output, a BF16 layer's extra) s
        self._per_layout: dict[int, tuple] = {}  # layout -> (t, c, (most layers of a stage but the last, the last's,
        #                                                      all), v, p, replicas, fp8, (layers, BF16 layers) per rank)
        self._traffic: dict[int, tuple[list[float], float]] = {}  # layout -> (pp_p2p by micro batch, dp lower bound)

    def _layout_sizes(self, li: int) -> tuple:
        """(t, c, (most layers of a stage but the last, the last stage's, all), v, p, data-parallel replicas, fp8, and
        with BF16 first / last layers (layers, BF16 layers) of every rank, else ()) of layout ``li``."""
        sizes = self._per_layout.get(li)
        if sizes is None:
            (num_gpus, _, _, switches), layout = self.layouts[li]
            L, t, c, p = (self.model.num_layers, layout.tensor_model_parallel_size, layout.context_parallel_size,
                          layout.pipeline_model_parallel_size)
            l = layout.num_layers_per_virtual_pipeline_stage
            if layout.pipeline_model_parallel_layout is None:
                stages = (L // p, L // p, L // p * p)
                v = 1 if l is None else L // p // l
            else:  # a layout string: its ranks' totals, and its chunks per rank (interleaved when > 1)
                split = pipeline_split(L, p, pipeline_model_parallel_layout=layout.pipeline_model_parallel_layout)
                counts = [split.stage_layers(r) for r in range(p)]
                stages = (max(counts[:-1], default=0), counts[-1], L)
                v = split.virtual_pipeline_model_parallel_size
            bf16 = ()
            if switches.get("fp8") and switches.get("first_last_layers_bf16"):  # (layers, BF16 layers) of every rank
                probe = candidate_plan(*self.layouts[li], layout.micro_batch_sizes[0], self.modes[0])
                bf16 = tuple((probe.stage_layers(L, r), probe.stage_bf16_layers(L, r)) for r in range(p))
            sizes = self._per_layout[li] = (t, c, stages, v, p, num_gpus // (t * p) // c, switches.get("fp8"), bf16)
        return sizes

    def _pipelined(self, li: int, ci: int, i: int) -> float:
        """Lower bound on compute + recompute + tp_comm + cp_comm + bubble of candidate (``li``, ``ci``, ``i``)."""
        t, c, (others, last_layers, layers), v, p, replicas, fp8, bf16 = self._layout_sizes(li)
        per_stage = max(others, last_layers)
        run, layout = self.layouts[li]
        mb = layout.micro_batch_sizes[i]
        n = self.block_layers.get((li, ci, i)) if self.modes[ci].block else None
        key = (t, c, mb, self._plain_id[ci] if n is None else self._mode_id[ci], n,
               (per_stage // v, layout.pipeline_model_parallel_layout) if n else None, fp8,
               layout.expert_model_parallel_size, layout.expert_tensor_parallel_size)
        times = self._shapes.get(key)
        if times is None:
            mode = self._plain[ci] if n is None else self.modes[ci]
            st = shape_times(self.model, candidate_plan(run, layout, mb, mode, n), self.system)
            # a merged forward-backward layer pair (--overlap-moe-expert-parallel-comm) hides up to merge_hidden of
            # the exchange: at most one pair per layer and microbatch
            times = self._shapes[key] = (st.layer.total - st.merge_hidden, st.head.total, st.extra(1))
        per_layer, head, extra = times
        m = run[2] // (mb * replicas)
        if bf16:  # each rank with its own BF16 layers (their extra may be either sign: a bound must count it)
            stage = [n * per_layer + b * extra for n, b in bf16]
            stage[-1] += head
            slowest, everyone = max(stage), sum(stage)
        else:
            slowest, everyone = max(others * per_layer, last_layers * per_layer + head), layers * per_layer + head
        return (m - 1 / v) * slowest + everyone / v if p > 1 else m * slowest

    def _tokens(self, li: int) -> int:
        _, seq_length, global_batch, _ = self.layouts[li][0]
        return global_batch * seq_length

    def _seconds(self, li: int, ci: int, i: int) -> float:
        """Lower bound on the closed-form iteration time of candidate (``li``, ``ci``, ``i``) without its
        offload_exposed."""
        traffic = self._traffic.get(li)
        if traffic is None:
            run, layout = self.layouts[li]
            first = candidate_plan(run, layout, layout.micro_batch_sizes[0], self.modes[0])
            traffic = self._traffic[li] = (
                pipeline_p2p_seconds_by_micro_batch(self.model, first, self.system, layout.micro_batch_sizes),
                dp_seconds_lower_bound(self.model, first, self.system))
        pp, dp = traffic
        return self._pipelined(li, ci, i) + pp[i] + dp

    def bound(self, li: int, ci: int, i: int) -> float:
        """Upper bound on the tokens/s of candidate (``li``, ``ci``, ``i``); with its offload_exposed once
        :meth:`count_offload` has counted it."""
        return self._tokens(li) / (self._seconds(li, ci, i) + self._offload.get((li, ci, i), 0.0))

    def count_offload(self, li: int, ci: int, i: int) -> bool:
        """Count candidate (``li``, ``ci``, ``i``)'s closed-form offload_exposed at the fixed alpha in its
        :meth:`bound` from now on (asked when the candidate comes out of the queue, so that only those that reach the
        top of it pay for the term); True when that lowers the bound. Nothing without a fixed alpha, for an unresolved
        block candidate (its N lowers its saved bytes) or one counted already."""
        key = (li, ci, i)
        if self.alpha is None or key in self._offload or (self.modes[ci].block and key not in self.block_layers):
            return False
        run, layout = self.layouts[li]
        plan = candidate_plan(run, layout, layout.micro_batch_sizes[i], self.modes[ci],
                              self.block_layers.get(key)).with_alpha(self.alpha)
        try:
            validate_plan(self.model, plan, self.system)
        except InvalidPlanError:  # its pricing counts why
            self._offload[key] = 0.0
            return False
        self._offload[key] = closed_form_offload_seconds(self.model, plan, self.system)
        return self._offload[key] > 0

    def variant(self, li: int, ci: int, i: int, plan: Plan) -> float:
        """Upper bound on the tokens/s of ``plan``, candidate (``li``, ``ci``, ``i``) with a memory option of the
        ladder (optimizer offload, a Megatron FSDP sharding): :meth:`bound` with the variant's own ``dp_exposed``
        lower bound, which an FSDP sharding raises by its parameter all-gathers and gradient reduce-scatters, and its
        ``optimizer`` term (exact, whatever alpha: the CPU step of an optimizer offload), and the candidate's
        offload_exposed where counted; the option changes no other term the bound counts (nor the saved bytes and the
        layer times offload_exposed reads). Asked after :meth:`bound` of the same candidate."""
        return self._tokens(li) / (self._pipelined(li, ci, i) + self._traffic[li][0][i]
                                   + dp_seconds_lower_bound(self.model, plan, self.system)
                                   + optimizer_seconds(self.model, plan, self.system)
                                   + self._offload.get((li, ci, i), 0.0))

    def group(self, li: int, i: int) -> float:
        """Upper bound on the tokens/s of every mode of layout ``li`` at micro batch index ``i`` (with
        :attr:`grouped`)."""
        return self._tokens(li) / self._seconds(li, self._floor[0], i)  # no candidate's offload: it depends on the mode

    def layout(self, li: int) -> float:
        """Upper bound on the tokens/s of every candidate of layout ``li``."""
        return self._tokens(li) / min(self._pipelined(li, ci, i) for ci in self._floor
                                      for i in range(len(self.layouts[li][1].micro_batch_sizes)))

    def expand(self, li: int, ci: int, i: int) -> list[tuple[float, int, int, int]]:
        """The queue entries of what the entry (``li``, ``ci``, ``i``) stands for (a layout or a group)."""
        if ci == LAYOUT_ENTRY and self.grouped:
            return [(-self.group(li, j), li, GROUP_ENTRY, j) for j in range(len(self.layouts[li][1].micro_batch_sizes))]
        mbs = range(len(self.layouts[li][1].micro_batch_sizes)) if ci == LAYOUT_ENTRY else (i,)
        return [(-self.bound(li, cj, j), li, cj, j) for cj in range(len(self.modes)) for j in mbs]
