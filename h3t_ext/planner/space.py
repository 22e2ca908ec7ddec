"""The space of parallel layouts for one model, GPU count and global batch, with rejection reasons.

A layout is (t, c, p, l, micro batch). The enumeration walks t, then c, then p, then l, then the
micro batch, and rejects a partial layout at the first level where a divisibility rule fails, so
one rejection stands for the whole subtree under it (the counts are of partial layouts). The
rules are Megatron's, checked by :mod:`h3t_ext.layout` (this module maps each to a counted reason),
plus the cost model's "t stays within one node":

* t divides the attention heads, the query groups and the MLP columns;
* with context parallelism the sequence splits into 2c chunks (s divisible by 2c), and with
  sequence parallelism each context shard splits over t (s/c divisible by t, with --sequence-parallel);
* p divides the layers, and p*l divides them under interleaving (which needs p > 1);
* the global batch is a whole number of micro batches per data-parallel replica
  (B divisible by micro_batch * d / c), and interleaved 1F1B needs the number of microbatches
  to be a multiple of p.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Optional

from h3t_ext.costmodel import ModelSpec
from h3t_ext.costmodel.fp8 import DEFAULT_FP8_RECIPE, cpu_offload_param_gather_refusal
from h3t_ext.layout import LayoutError, ParallelLayout, virtual_pipeline_size
from h3t_ext.planner.pipeline_balance import split_candidates, uneven_virtual_sizes

CKPT_BY_MEMORY: tuple[str, ...] = ("full", "ours", "no")
"""The plain checkpointing modes from least to most saved activation memory (the search's recompute axis adds
block and selective modes between them: :func:`h3t_ext.planner.recompute_modes.search_modes`)."""

R_T_NODE = "tensor_model_parallel_size does not divide gpus_per_node (t must stay within a node)"
R_T_HEADS = "num_attention_heads not divisible by tensor_model_parallel_size"
R_T_GROUPS = "num_query_groups not divisible by tensor_model_parallel_size"
R_T_FFN = "ffn_hidden_size not divisible by tensor_model_parallel_size"
R_C_SEQ = "seq_length not divisible by 2 * context_parallel_size"
R_C_WINDOW = "context parallelism with sliding-window attention (the cost model prices only the causal ring)"
R_T_SEQ = "seq_length / context_parallel_size not divisible by tensor_model_parallel_size"
R_P_LAYERS = "num_layers not divisible by pipeline_model_parallel_size"
R_L_LAYERS = "num_layers not divisible by pipeline_model_parallel_size * num_layers_per_virtual_pipeline_stage"
R_L_SAME = "num_layers_per_virtual_pipeline_stage = num_layers / pipeline_model_parallel_size (no interleaving)"
R_L_P1 = "interleaving needs pipeline_model_parallel_size > 1"
R_MB_BATCH = "global_batch_size not divisible by micro_batch_size * data_parallel_size / context_parallel_size"
R_MB_INTERLEAVE = "interleaved 1F1B needs num_microbatches to be a multiple of pipeline_model_parallel_size"
R_GPUS = "num_gpus not divisible by the parallel sizes"
R_EP = "num_experts not divisible by expert_model_parallel_size, the ranks of a pipeline stage by " \
       "expert_model_parallel_size x expert_tensor_parallel_size, or moe_ffn_hidden_size by expert_tensor_parallel_size"


@dataclass(frozen=True)
class MemoryOption:
    """One step of the search's memory ladder: Megatron FSDP's sharding strategy or megatron-core's optimizer CPU
    offload, applied on top of a plan that does not fit (or fits only by offloading activations)."""

    data_parallel_sharding_strategy: Optional[str] = None
    """'optim_grads' or 'optim_grads_params' (Megatron FSDP), or None (Megatron's DDP)."""
    optimizer_cpu_offload: bool = False
    """--optimizer-cpu-offload with the smallest --optimizer-offload-fraction that fits (at most 1)."""

    def refusal(self, plan) -> Optional[str]:
        """Why Megatron-LM refuses this option on ``plan``, or None: the optimizer offload with FP8 parameters runs
        with the delayed recipe only (:func:`~h3t_ext.costmodel.fp8.cpu_offload_param_gather_refusal`)."""
        return cpu_offload_param_gather_refusal(self.optimizer_cpu_offload, plan.fp8_param_gather, plan.fp8_recipe)

    def on(self, plan, optimizer_offload_fraction: float = 1.0):
        """``plan`` with this option (and, when it offloads the optimizer, that fraction)."""
        return plan.with_fields(data_parallel_sharding_strategy=self.data_parallel_sharding_strategy,
                                optimizer_cpu_offload=self.optimizer_cpu_offload,
                                optimizer_offload_fraction=optimizer_offload_fraction)


MEMORY_LADDER: tuple[MemoryOption, ...] = (
    MemoryOption(data_parallel_sharding_strategy="optim_grads"),
    MemoryOption(data_parallel_sharding_strategy="optim_grads_params"),
    MemoryOption(optimizer_cpu_offload=True),
)
"""The options ``search`` tries on a plan that needs activation offload or does not fit, each a plan of its own
(each saves more device memory than the one before it: gradient reduce-scatters per microbatch, then parameter
all-gathers, then PCIe and the CPU step; which is fastest depends on the plan), when neither is fixed on the
command line."""


@dataclass(frozen=True)
class SearchConstraints:
    """Values the user fixed on the command line; None means search over all of them."""

    tensor_model_parallel_size: Optional[int] = None
    """Fixed t, or None."""
    context_parallel_size: Optional[int] = None
    """Fixed c, or None."""
    pipeline_model_parallel_size: Optional[int] = None
    """Fixed p, or None."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Fixed l, or None (then both plain and interleaved 1F1B are searched)."""
    pipeline_layouts: bool = True
    """Whether the search may write the layer split as megatron-core's --pipeline-model-parallel-layout
    (:mod:`h3t_ext.planner.pipeline_balance`); False: Megatron's even split only (a Megatron without the flag, such
    as Megatron-Kwai's ATC '24 fork)."""
    micro_batch_size: Optional[int] = None
    """Fixed micro batch, or None."""
    max_micro_batch_size: Optional[int] = None
    """Largest micro batch searched when it is not fixed; None means no limit."""
    ckpt: Optional[str] = None
    """Fixed checkpointing mode, or None for all of ``CKPT_CHOICES``."""
    overlap_grad_reduce: bool = False
    """Megatron's --overlap-grad-reduce for every plan searched."""
    overlap_param_gather: bool = False
    """Megatron's --overlap-param-gather for every plan searched."""
    tp_comm_overlap: bool = False
    """Megatron's --tp-comm-overlap for every plan searched."""
    overlap_p2p_comm: bool = True
    """Megatron's --overlap-p2p-communication for every plan searched."""
    sequence_parallel: bool = True
    """Megatron's --sequence-parallel (with t > 1) for every plan searched."""
    use_distributed_optimizer: bool = True
    """Megatron's --use-distributed-optimizer for every plan searched."""
    optimizer_cpu_offload: bool = False
    """Megatron's --optimizer-cpu-offload for every plan searched (with ``optimizer_offload_fraction``)."""
    optimizer_offload_fraction: float = 1.0
    """Megatron's --optimizer-offload-fraction of those plans."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """Megatron's --overlap-cpu-optimizer-d2h-h2d for every plan that offloads the optimizer."""
    grad_reduce_in_bf16: bool = False
    """16-bit gradients (Megatron's --grad-reduce-in-bf16, or an --fp16 run's) for every plan searched."""
    fp16: bool = False
    """Megatron's --fp16 for every plan searched."""
    bias_activation_fusion: bool = True
    """Megatron's fused bias-SwiGLU for every plan searched (--no-bias-swiglu-fusion clears it)."""
    use_legacy_models: bool = False
    """Every plan searched runs Megatron-LM's legacy GPT model (``Plan.use_legacy_models``: the ATC '24 runs)."""
    cross_entropy_loss_fusion: bool = False
    """Megatron's --cross-entropy-loss-fusion for every plan searched."""
    cross_entropy_fusion_impl: str = "native"
    """Megatron's --cross-entropy-fusion-impl for every plan searched."""
    data_parallel_sharding_strategy: Optional[str] = None
    """Megatron FSDP's --data-parallel-sharding-strategy for every plan searched (None: Megatron's DDP)."""
    attention_backend: str = "auto"
    """The cost model's attention of every plan searched (``Plan.attention_backend``: Megatron's --attention-backend
    through the one translation)."""
    transformer_impl: str = "transformer_engine"
    """Megatron's --transformer-impl of every plan searched."""
    optimizer_impl: str = "fused"
    """The Adam of every plan searched (``Plan.optimizer_impl``)."""
    transformer_engine_version: Optional[str] = None
    """The TransformerEngine of every plan searched (``Plan.transformer_engine_version``)."""
    memory_ladder: tuple[MemoryOption, ...] = ()
    """Memory options tried on a plan that needs activation offload or does not fit (:data:`MEMORY_LADDER`; the
    CLI's default); empty: every plan keeps the switches above."""
    precisions: tuple[str, ...] = ("bf16",)
    """Precisions searched: ('bf16',), ('fp8',) or both (``search --precision auto``)."""
    fp8: str = "hybrid"
    """--fp8-format of the FP8 plans searched."""
    fp8_recipe: str = DEFAULT_FP8_RECIPE
    """--fp8-recipe of the FP8 plans searched."""
    fp8_param_gather: bool = False
    """--fp8-param-gather for the FP8 plans searched."""
    first_last_layers_bf16: bool = False
    """--first-last-layers-bf16 for the FP8 plans searched (with the two counts below)."""
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    expert_model_parallel_size: Optional[int] = None
    """Fixed ep of a MoE model, or None (every ep that divides the experts and a stage's ranks is searched)."""
    expert_tensor_parallel_size: Optional[int] = None
    """etp of a MoE model's plans (None: 1, megatron-core's recommended folding of experts)."""
    moe_token_dispatcher_type: Optional[str] = None
    """--moe-token-dispatcher-type of a MoE model's plans (None: alltoall)."""
    moe_grouped_gemm: bool = False
    """--moe-grouped-gemm given (a MoE model's plans are all searched with it; a dense model's refuse it)."""
    moe_shared_expert_overlap: bool = False
    """--moe-shared-expert-overlap given (the search turns it on wherever it applies: a shared expert, alltoall)."""
    overlap_moe_expert_parallel_comm: bool = False
    """--overlap-moe-expert-parallel-comm for every plan searched (the plans it cannot run with are refused)."""


@dataclass(frozen=True)
class Layout:
    """One structurally valid layout, before checkpointing mode and alpha are chosen."""

    tensor_model_parallel_size: int
    """t."""
    context_parallel_size: int
    """c."""
    pipeline_model_parallel_size: int
    """p."""
    num_layers_per_virtual_pipeline_stage: Optional[int]
    """l, or None for plain 1F1B."""
    micro_batch_sizes: tuple[int, ...]
    """Valid micro batch sizes, ascending (activation memory grows with it)."""
    pipeline_model_parallel_layout: Optional[str] = None
    """The layer split as megatron-core's layout string (:mod:`h3t_ext.planner.pipeline_balance`: the output layer's
    work balanced, one chunk per stage), or None for Megatron's even split."""
    expert_model_parallel_size: int = 1
    """ep of a MoE model (1 for a dense one)."""
    expert_tensor_parallel_size: Optional[int] = None
    """etp of a MoE model (None for a dense one)."""


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    small = [k for k in range(1, int(n**0.5) + 1) if n % k == 0]
    return sorted(set(small + [n // k for k in small]))


def _pick(fixed: Optional[int], options: list[int]) -> list[int]:
    return options if fixed is None else [fixed]


_BY_RULE = {"num_attention_heads": R_T_HEADS, "num_query_groups": R_T_GROUPS, "ffn_hidden_size": R_T_FFN,
            "expert_layout": R_EP,
            "seq_length_context_parallel": R_C_SEQ, "seq_length_sequence_parallel": R_T_SEQ, "num_layers": R_P_LAYERS,
            "num_layers_per_virtual_pipeline_stage": R_L_LAYERS, "virtual_needs_pipeline": R_L_P1,
            "global_batch_size": R_MB_BATCH, "interleaving": R_MB_INTERLEAVE}
"""The search's counted reason for each rule of h3t_ext.layout (the rules themselves live there)."""


def _refusal(check) -> Optional[str]:
    """None when ``check()`` passes, else the counted reason of the layout rule it broke."""
    try:
        check()
    except LayoutError as e:
        return _BY_RULE.get(e.rule, e.rule)
    return None


def _validate_tensor(model: ModelSpec, seq_length: int, t: int, gpus_per_node: int,
                     sequence_parallel: bool) -> Optional[str]:
    if t > gpus_per_node or gpus_per_node % t:  # the cost model's own rule: t within a node
        return R_T_NODE
    split = ParallelLayout(tensor_model_parallel_size=t)
    return _refusal(lambda: (split.check_tensor_split(num_attention_heads=model.num_attention_heads,
                                                      num_query_groups=model.num_query_groups,
                                                      ffn_hidden_size=model.dense_ffn_hidden_size),
                             split.check_seq_length(seq_length, sequence_parallel=sequence_parallel)))


def _validate_context(seq_length: int, t: int, c: int, sequence_parallel: bool) -> Optional[str]:
    split = ParallelLayout(tensor_model_parallel_size=t, context_parallel_size=c)
    return _refusal(lambda: split.check_seq_length(seq_length, sequence_parallel=sequence_parallel))


def _validate_virtual(num_layers: int, p: int, l: Optional[int]) -> Optional[str]:
    if l is None:
        return None
    if reason := _refusal(lambda: virtual_pipeline_size(num_layers, p, l)):
        return reason
    if l * p == num_layers:  # the search's own: the same plan as l = None
        return R_L_SAME
    return None


def _validate_micro_batch(num_gpus: int, global_batch: int, t: int, c: int, p: int, v: int, mb: int) -> Optional[str]:
    return _refusal(lambda: ParallelLayout.from_sizes(
        world_size=num_gpus, global_batch_size=global_batch, micro_batch_size=mb, tensor_model_parallel_size=t,
        context_parallel_size=c, pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=v))


def _micro_batch_refusals(num_gpus: int, global_batch: int, t: int, c: int, p: int, v: int, mbs: list[int],
                          seen: dict) -> tuple[Optional[str], ...]:
    """:func:`_validate_micro_batch` of each of ``mbs``, once per (d, p, v): t and c have passed the world-size
    rule by then, and the batch and interleaving rules read only d = gpus / (t c p), p, v and the micro batch (the
    t x c splits of one t c product, thousands on a large cluster, share the answers)."""
    key = (num_gpus // (t * c * p), p, v)
    got = seen.get(key)
    if got is None:
        got = seen[key] = tuple(_validate_micro_batch(num_gpus, global_batch, t, c, p, v, mb) for mb in mbs)
    return got


def _micro_batches(num_gpus: int, global_batch: int, t: int, c: int, p: int, v: int, mbs: list[int], seen: dict,
                   rejected: Counter) -> list[int]:
    """The micro batches of ``mbs`` that pass :func:`_micro_batch_refusals`; each refused one counted under its
    reason."""
    kept = []
    for mb, reason in zip(mbs, _micro_batch_refusals(num_gpus, global_batch, t, c, p, v, mbs, seen)):
        if reason:
            rejected[reason] += 1
        else:
            kept.append(mb)
    return kept


def enumerate_layouts(
    model: ModelSpec,
    *,
    num_gpus: int,
    seq_length: int,
    global_batch_size: int,
    gpus_per_node: int,
    constraints: SearchConstraints = SearchConstraints(),
) -> tuple[list[Layout], Counter]:
    """All structurally valid layouts and the count of rejected partial layouts by reason."""
    rejected: Counter = Counter()
    layouts = list(_walk(model, num_gpus, seq_length, global_batch_size, gpus_per_node, constraints, rejected))
    return layouts, rejected


def _walk(model, num_gpus, seq_length, global_batch, gpus_per_node, k: SearchConstraints, rejected) -> Iterator[Layout]:
    L = model.num_layers
    mb_options = divisors(global_batch)
    if k.max_micro_batch_size is not None:
        mb_options = [mb for mb in mb_options if mb <= k.max_micro_batch_size]
    mb_pick = _pick(k.micro_batch_size, mb_options)
    seen: dict = {}  # (d, p, v) -> the micro batches' refusals
    l_options: list[Optional[int]] = [None, *divisors(L)]
    if k.num_layers_per_virtual_pipeline_stage is not None:
        l_options = [k.num_layers_per_virtual_pipeline_stage]
    for t in _pick(k.tensor_model_parallel_size, divisors(num_gpus)):
        # a fixed t need not divide num_gpus (the divisors are only the free choices): that is its own reason
        if reason := R_GPUS if num_gpus % t else _validate_tensor(model, seq_length, t, gpus_per_node,
                                                                  k.sequence_parallel):
            rejected[reason] += 1
            continue
        for c in _pick(k.context_parallel_size, divisors(num_gpus // t)):
            if c > 1 and model.windowed_layers:  # the plan check's rule (costmodel.plan_checks.validate_plan), early
                rejected[R_C_WINDOW] += 1
                continue
            if reason := R_GPUS if (num_gpus // t) % c else _validate_context(seq_length, t, c, k.sequence_parallel):
                rejected[reason] += 1
                continue
            for p in _pick(k.pipeline_model_parallel_size, divisors(num_gpus // (t * c))):
                if (num_gpus // (t * c)) % p:
                    rejected[R_GPUS] += 1
                    continue
                no_even_split = _refusal(lambda: virtual_pipeline_size(L, p))  # why the even split cannot be built
                splits = split_candidates(model, seq_length, p, t) if p > 1 and k.pipeline_layouts else (None,)
                twins = _uneven_interleaved(model, seq_length, p, t, k)
                if no_even_split and not any(splits) and not twins:
                    rejected[no_even_split] += 1
                    continue
                for l in l_options:
                    if reason := no_even_split if l is not None and no_even_split else _validate_virtual(L, p, l):
                        rejected[reason] += 1
                        continue
                    v = 1 if no_even_split else virtual_pipeline_size(L, p, l)  # checked above (a layout: one chunk)
                    mbs = _micro_batches(num_gpus, global_batch, t, c, p, v, mb_pick, seen, rejected)
                    if not mbs:
                        continue
                    grids = _expert_grids(model, num_gpus // p, t, k, rejected)
                    for split in splits if l is None else (None,):
                        for ep, etp in grids:
                            yield Layout(t, c, p, l, tuple(mbs), split, ep, etp)
                    if l is not None and v > 1 and k.pipeline_layouts and k.num_layers_per_virtual_pipeline_stage is None:
                        # interleaving's balanced twin (p v stages), unless the user fixed Megatron's l
                        for split in split_candidates(model, seq_length, p, t, v):
                            if split is not None:
                                for ep, etp in grids:
                                    yield Layout(t, c, p, None, tuple(mbs), split, ep, etp)
                for v, split in twins:  # interleaving Megatron's even split cannot write (uneven_virtual_sizes)
                    if mbs := _micro_batches(num_gpus, global_batch, t, c, p, v, mb_pick, seen, rejected):
                        for ep, etp in _expert_grids(model, num_gpus // p, t, k, rejected):
                            yield Layout(t, c, p, None, tuple(mbs), split, ep, etp)


def _uneven_interleaved(model: ModelSpec, seq_length: int, p: int, t: int,
                        k: SearchConstraints) -> tuple[tuple[int, str], ...]:
    """(v, layout) of the interleaved splits Megatron's --num-layers-per-virtual-pipeline-stage cannot write for p
    stages but the embedding and the loss counted as layers can (:func:`~h3t_ext.planner.pipeline_balance.
    uneven_virtual_sizes`), balanced; none where layouts are off or the user fixed Megatron's l."""
    if p < 2 or not k.pipeline_layouts or k.num_layers_per_virtual_pipeline_stage is not None:
        return ()
    return tuple((v, split) for v in uneven_virtual_sizes(model.num_layers, p)
                 for split in split_candidates(model, seq_length, p, t, v) if split is not None)


def _expert_grids(model: ModelSpec, stage_ranks: int, t: int, k: SearchConstraints,
                  rejected: Counter) -> list[tuple[int, Optional[int]]]:
    """The (ep, etp) of a MoE model's plans on a pipeline stage of ``stage_ranks`` ranks at tensor-parallel size t: the
    fixed ones, else every divisor ep of the experts with etp 1 (megatron-core's recommended folding) and, with t > 1,
    etp = t (Megatron's default), where :meth:`h3t_ext.layout.ParallelLayout.check_experts` and the layout's own grid
    rule pass; [(1, None)] for a dense model."""
    if not model.is_moe:
        return [(1, None)]
    grids, refused = _checked_grids(model.num_experts, model.expert_ffn_hidden_size, stage_ranks, t,
                                    k.expert_model_parallel_size, k.expert_tensor_parallel_size)
    if refused:
        rejected[R_EP] += refused
    return list(grids)


@functools.lru_cache(maxsize=4096)
def _checked_grids(num_experts: int, expert_ffn_hidden_size: int, stage_ranks: int, t: int, ep: Optional[int],
                   etp: Optional[int]) -> tuple[tuple[tuple[int, int], ...], int]:
    """(the (ep, etp) pairs the layout rules pass, how many they refuse) of :func:`_expert_grids` (pure; memoised: the
    walk asks once per layer split and interleaving of a (t, c, p))."""
    out, refused = [], 0
    for e in ([etp] if etp else sorted({1, t})):
        for size in _pick(ep, divisors(num_experts)):
            reason = _refusal(lambda: ParallelLayout(
                tensor_model_parallel_size=t, data_parallel_size=stage_ranks // t, expert_model_parallel_size=size,
                expert_tensor_parallel_size=e).check_experts(num_experts=num_experts,
                                                             expert_ffn_hidden_size=expert_ffn_hidden_size))
            if reason:
                refused += 1
            else:
                out.append((size, e))
    return tuple(out), refused
