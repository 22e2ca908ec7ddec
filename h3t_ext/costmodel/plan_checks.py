"""The rules a :class:`~h3t_ext.costmodel.plan.Plan` meets to be built and priced, each refusal an
:class:`~h3t_ext.costmodel.errors.InvalidPlanError` with a one-line reason: the plan's own switches and their ranges,
the parallel layout on the model and system (:func:`plan_layout`, :mod:`h3t_ext.layout`'s rules), recompute,
FP8 and the mixture-of-experts switches (:func:`validate_moe`). :func:`validate_plan` runs them all; its verdict is
kept per (model, plan, system)."""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

from h3t_ext.costmodel.activations import rank_offloads
from h3t_ext.costmodel.elementwise import CROSS_ENTROPY_FUSION_IMPLS
from h3t_ext.costmodel.errors import InvalidPlanError
from h3t_ext.costmodel.fp8 import validate_bf16_layers, validate_fp8
from h3t_ext.costmodel.layer_offload import layers_per_chunk
from h3t_ext.costmodel.moe import MOE_TOKEN_DISPATCHERS
from h3t_ext.costmodel.plan import (ATTENTION_BACKENDS, FSDP_SHARDING_STRATEGIES, OPTIMIZER_IMPLS, PRICED_CKPT,
                                    TRANSFORMER_IMPLS, Ckpt, Plan)
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec
from h3t_ext.costmodel.te_version import parse_te_version
from h3t_ext.layout import LayoutError, ParallelLayout
from h3t_ext.offload_alpha import check_alpha
from h3t_ext.schedule.offload_overlap import overlap_refusal


def _check(cond: bool, reason: str) -> None:
    if not cond:
        raise InvalidPlanError(reason)


def _validate_ranges(plan: Plan) -> None:
    """The plan's own switches (the ranges of the sizes are layout rules, checked by :func:`plan_layout`)."""
    _check(plan.ckpt in PRICED_CKPT, f"ckpt must be one of {', '.join(PRICED_CKPT)}, got {plan.ckpt!r}")
    _check(plan.transformer_impl in TRANSFORMER_IMPLS,
           f"transformer_impl must be one of {', '.join(TRANSFORMER_IMPLS)}, got {plan.transformer_impl!r}")
    _check(plan.cross_entropy_fusion_impl in CROSS_ENTROPY_FUSION_IMPLS,
           f"cross_entropy_fusion_impl must be one of {', '.join(CROSS_ENTROPY_FUSION_IMPLS)}, "
           f"got {plan.cross_entropy_fusion_impl!r}")
    if plan.transformer_engine_version is not None:
        try:
            parse_te_version(plan.transformer_engine_version)
        except ValueError as e:
            raise InvalidPlanError(str(e)) from None
    _check(plan.optimizer_impl in OPTIMIZER_IMPLS,
           f"optimizer_impl must be one of {', '.join(OPTIMIZER_IMPLS)}, got {plan.optimizer_impl!r}")
    strategy = plan.data_parallel_sharding_strategy
    _check(strategy is None or strategy in FSDP_SHARDING_STRATEGIES,
           f"data_parallel_sharding_strategy must be one of {', '.join(FSDP_SHARDING_STRATEGIES)}, got {strategy!r}")
    _check(strategy is None or plan.use_distributed_optimizer,
           "data_parallel_sharding_strategy shards the optimizer states too: it needs use_distributed_optimizer")
    # Megatron-LM's rules for --use-torch-fsdp2 (training/arguments.py), as the driver refuses them
    _check(not plan.use_torch_fsdp2 or (strategy is None and not plan.use_distributed_optimizer
                                        and not plan.optimizer_cpu_offload),
           "use_torch_fsdp2 shards the optimizer states itself: it runs without use_distributed_optimizer, Megatron "
           "FSDP and optimizer_cpu_offload (Megatron-LM refuses them together)")
    _check(not plan.use_torch_fsdp2 or plan.pipeline_model_parallel_size == 1,
           "use_torch_fsdp2 needs pipeline_model_parallel_size 1 (Megatron-LM refuses FSDP2 with pipelines)")
    _check(plan.use_torch_fsdp2 or plan.torch_fsdp2_reshard_after_forward,
           "torch_fsdp2_reshard_after_forward off needs use_torch_fsdp2")
    f = plan.optimizer_offload_fraction
    _check(isinstance(f, (int, float)) and 0.0 <= f <= 1.0,
           f"optimizer_offload_fraction must be a number in [0, 1], got {f!r}")
    _check(not plan.optimizer_cpu_offload or (plan.use_distributed_optimizer and strategy is None),
           "optimizer_cpu_offload needs use_distributed_optimizer (Megatron-LM: --use-precision-aware-optimizer, "
           "which needs the distributed optimizer) and Megatron's DDP, not Megatron FSDP")
    # Megatron-LM's validate_args asserts these two (training/arguments.py): the userbuffer overlap splits the
    # sequence-parallel all-gathers and reduce-scatters, which exist only with t > 1; the parameter all-gather
    # belongs to the distributed optimizer and is issued by the gradient reduce's buckets
    _check(not plan.tp_comm_overlap or (plan.tensor_model_parallel_size > 1 and plan.sequence_parallel),
           "tp_comm_overlap needs sequence_parallel with tensor_model_parallel_size > 1 (Megatron-LM asserts it)")
    _check(not plan.overlap_param_gather or (plan.use_distributed_optimizer and plan.overlap_grad_reduce),
           "overlap_param_gather needs use_distributed_optimizer and overlap_grad_reduce (Megatron-LM asserts it)")
    _check(plan.moe_token_dispatcher_type in MOE_TOKEN_DISPATCHERS,
           f"moe_token_dispatcher_type must be one of {', '.join(MOE_TOKEN_DISPATCHERS)}, got "
           f"{plan.moe_token_dispatcher_type!r}")
    _check(plan.attention_backend in ATTENTION_BACKENDS,
           f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {plan.attention_backend!r}")
    validate_fp8(plan)


def applicable_switches(switches: dict, tensor_model_parallel_size: int) -> dict:
    """``switches`` (Plan fields) as they apply to a plan of tensor-parallel size t: ``tp_comm_overlap`` only where
    t > 1 (Megatron-LM refuses --tp-comm-overlap without sequence parallelism, which it turns off at t = 1; a
    search's or a published source's switch means its tensor-parallel plans)."""
    if switches.get("tp_comm_overlap") and tensor_model_parallel_size == 1:
        return {**switches, "tp_comm_overlap": False}
    return switches


def validate_switches(plan: Plan) -> None:
    """The plan's switches alone (no model or system): what a search checks once for all its plans."""
    _validate_ranges(plan)


def _validate_alphas(plan: Plan) -> None:
    a = plan.offload_alpha
    if not isinstance(a, (int, float)):
        _check(len(a) == plan.pipeline_model_parallel_size,
               f"offload_alpha has {len(a)} values but pipeline_model_parallel_size is "
               f"{plan.pipeline_model_parallel_size}")
    try:
        check_alpha(a if not isinstance(a, list) else tuple(a), flag="offload_alpha")
    except ValueError as e:
        raise InvalidPlanError(str(e)) from None


def plan_layout(model: ModelSpec, plan: Plan, system: Optional[SystemSpec] = None) -> ParallelLayout:
    """The plan's :class:`~h3t_ext.layout.ParallelLayout` with every layout rule checked (the model's heads,
    query groups, MLP columns, sequence and layers against t, c, p, v; then world size, batch and
    interleaving); raises InvalidPlanError with :class:`~h3t_ext.layout.LayoutError`'s one-line reason.
    With ``system``, the cost model's own rule that t stays within a node is checked after the tensor split."""
    t, c = plan.tensor_model_parallel_size, plan.context_parallel_size
    try:
        split = ParallelLayout(tensor_model_parallel_size=t, context_parallel_size=c)  # model-shape rules first
        split.check_tensor_split(num_attention_heads=model.num_attention_heads,
                                 num_query_groups=model.num_query_groups, ffn_hidden_size=model.dense_ffn_hidden_size)
        if model.mixed_moe:  # its dense layers' MLP too
            split.check_tensor_split(num_attention_heads=model.num_attention_heads,
                                     ffn_hidden_size=model.ffn_hidden_size)
        if system is not None:
            _validate_node(plan, system)
        split.check_seq_length(plan.seq_length, sequence_parallel=plan.sequence_parallel)
        layout = ParallelLayout.from_sizes(
            world_size=plan.num_gpus, global_batch_size=plan.global_batch_size, micro_batch_size=plan.micro_batch_size,
            tensor_model_parallel_size=t, context_parallel_size=c,
            pipeline_model_parallel_size=plan.pipeline_model_parallel_size, num_layers=model.num_layers,
            num_layers_per_virtual_pipeline_stage=plan.num_layers_per_virtual_pipeline_stage,
            num_virtual_stages_per_pipeline_rank=plan.num_virtual_stages_per_pipeline_rank,
            decoder_first_pipeline_num_layers=plan.decoder_first_pipeline_num_layers,
            decoder_last_pipeline_num_layers=plan.decoder_last_pipeline_num_layers,
            account_for_embedding_in_pipeline_split=plan.account_for_embedding_in_pipeline_split,
            account_for_loss_in_pipeline_split=plan.account_for_loss_in_pipeline_split,
            pipeline_model_parallel_layout=plan.pipeline_model_parallel_layout,
            microbatch_group_size_per_vp_stage=plan.microbatch_group_size_per_vp_stage,
            expert_model_parallel_size=plan.expert_model_parallel_size,
            expert_tensor_parallel_size=plan.expert_tensor_parallel_size)
        layout.check_experts(num_experts=model.num_experts,
                             expert_ffn_hidden_size=model.expert_ffn_hidden_size if model.is_moe else None)
        return layout
    except LayoutError as e:
        raise InvalidPlanError(e.reason) from None


def _validate_offload_overlap(model: ModelSpec, plan: Plan) -> None:
    """The runtime's rule (:func:`h3t_ext.schedule.offload_overlap.overlap_refusal`): an alpha > 0 where the
    schedule has no place to hide an offload moves nothing, so it is refused rather than priced as alpha 0. Which
    ranks have one comes from the closed form of the builder's lists (:func:`~h3t_ext.costmodel.activations.
    rank_offloads`), at pipeline size 1 from the layers of the chunk (layer-granular offload)."""
    if not any(a > 0 for a in plan.alphas()):
        return
    p, m = plan.pipeline_model_parallel_size, plan.num_microbatches
    v = plan.virtual_size(model.num_layers)
    layers = layers_per_chunk(model, plan)
    can = (layers >= 2,) if layers is not None else tuple(
        rank_offloads(p, m, v, r, plan.microbatch_group_size_per_vp_stage) > 0 for r in range(p))
    reason = overlap_refusal(plan.offload_alpha, can, pipeline_model_parallel_size=p,
                             virtual_pipeline_model_parallel_size=v, num_microbatches=m,
                             layer_granular=layers is not None, num_layers_per_chunk=layers)
    if reason is not None:
        raise InvalidPlanError(reason)


def _validate_node(plan: Plan, system: SystemSpec) -> None:
    """The cost model's own assumption (not a Megatron rule): tensor parallelism stays within one node."""
    t = plan.tensor_model_parallel_size
    _check(t <= system.gpus_per_node and system.gpus_per_node % t == 0,
           f"tensor_model_parallel_size ({t}) must divide gpus_per_node ({system.gpus_per_node}) of {system.name}")


def validate_plan(model: ModelSpec, plan: Plan, system: SystemSpec) -> None:
    """Raise InvalidPlanError (one-line reason) when the plan cannot be built.

    The parallel layout rules are :mod:`h3t_ext.layout`'s (:func:`plan_layout`), so the cost model, the
    schedule builder, the runtime and the driver refuse a layout with the same reason. The verdict is kept per
    (model, plan, system): a search asks it of one plan several times (its memory test, the offload solver and the
    estimate each validate what they price)."""
    try:
        reason = _plan_problem(model, plan, system)
    except TypeError:  # an unhashable field (a list where a tuple belongs): checked without the cache
        reason = _plan_problem.__wrapped__(model, plan, system)
    if reason is not None:
        raise InvalidPlanError(reason)


@lru_cache(maxsize=8192)
def _plan_problem(model: ModelSpec, plan: Plan, system: SystemSpec) -> Optional[str]:
    """:func:`validate_plan`'s verdict: None, or the InvalidPlanError's reason."""
    try:
        _validate(model, plan, system)
    except InvalidPlanError as e:
        return e.reason
    return None


def _validate(model: ModelSpec, plan: Plan, system: SystemSpec) -> None:
    _validate_ranges(plan)
    validate_fp8(plan, system)
    validate_bf16_layers(plan, model.num_layers)
    _validate_alphas(plan)
    plan_layout(model, plan, system)
    _validate_offload_overlap(model, plan)
    _validate_recompute(model, plan)
    _check(plan.context_parallel_size == 1 or model.windowed_layers == 0,
           f"context_parallel_size {plan.context_parallel_size} with sliding-window attention (window_size "
           f"{model.window_size}): the cost model prices context parallelism as the causal ring, which has no window; "
           f"valid: context_parallel_size 1")
    _check(not plan.use_torch_fsdp2 or model.untie_embeddings_and_output_weights,
           "use_torch_fsdp2 needs untied embedding and output weights (Megatron-LM refuses FSDP2 with tied ones)")
    if model.is_moe:
        validate_moe(model, plan)
    else:
        validate_dense_experts(plan)


DENSE_EXPERT_DEFAULTS = (("expert_model_parallel_size", 1), ("expert_tensor_parallel_size", None),
                         ("moe_token_dispatcher_type", "allgather"), ("moe_grouped_gemm", False),
                         ("moe_shared_expert_overlap", False), ("overlap_moe_expert_parallel_comm", False))
"""The expert switches of a plan and their Megatron-LM defaults, which a dense model's plans keep (a plan's sizes meet
the layout's rule for ep first: :meth:`~h3t_ext.layout.ParallelLayout.check_experts`)."""


def validate_dense_experts(switches: object) -> None:
    """A dense model's expert switches at their defaults (:data:`DENSE_EXPERT_DEFAULTS`): a plan's, or the ones a
    search is asked to keep (``switches``: a Plan or SearchConstraints, whose fields carry those names; None is not
    given). InvalidPlanError naming the first that is not: it needs num_experts."""
    for name, default in DENSE_EXPERT_DEFAULTS:
        value = getattr(switches, name)
        _check(value is None or value == default,
               f"{name}{'' if isinstance(value, bool) else f' {value!r}'} needs num_experts (a mixture-of-experts "
               f"model); the model is dense")


MOE_UNPRICED = (("fp8", "FP8 expert GEMMs"), ("sharding_strategy", "Megatron FSDP / torch FSDP2 over experts"),
                ("optimizer_cpu_offload", "the CPU optimizer over expert states"))
"""Plan switches the cost model does not yet price with MoE layers, and what they would need priced."""


MOE_OURS_REASON = ("ckpt ours with a mixture-of-experts model: it runs in h3t-ext's runtime, which has no MoE layers; "
                   "Megatron's --recompute-granularity selective --recompute-modules layernorm moe_act drops the same "
                   "tensors")


def validate_moe(model: ModelSpec, plan: Plan, *, layout: bool = True) -> None:
    """A MoE model's plan: megatron-core's rule that tensor parallelism with experts runs sequence parallel, and
    the switches not priced with experts (:data:`MOE_UNPRICED`); ``layout`` False: only the rules of the switches,
    not those of the sizes (a search's probe of its switches, before it has a layout)."""
    _check(plan.tensor_model_parallel_size == 1 or plan.sequence_parallel,
           "a mixture-of-experts model with tensor_model_parallel_size > 1 needs sequence_parallel (megatron-core "
           "asserts it)")
    for name, what in MOE_UNPRICED:
        value = getattr(plan, name)
        _check(not value, f"{name} {value!r} with a mixture-of-experts model: the cost model does not price {what}; "
                          f"valid: leave it off")
    _check(not plan.recompute.recomputes("mlp"),
           "recompute module mlp reruns dense MLPs; a mixture-of-experts model's are moe, moe_act and "
           "shared_experts")
    _check(plan.ckpt is not Ckpt.OURS, MOE_OURS_REASON)
    _check(not plan.recompute.recomputes("shared_experts") or model.moe_shared_expert_intermediate_size,
           "recompute module shared_experts: the model has no shared expert (moe_shared_expert_intermediate_size); "
           "valid: moe, moe_act, layernorm, core_attn")
    if plan.moe_shared_expert_overlap:  # megatron-core's TransformerConfig rules
        _check(bool(model.moe_shared_expert_intermediate_size),
               "moe_shared_expert_overlap needs a shared expert (moe_shared_expert_intermediate_size)")
        _check(plan.moe_token_dispatcher_type == "alltoall",
               f"moe_shared_expert_overlap only works with moe_token_dispatcher_type alltoall (megatron-core raises), "
               f"got {plan.moe_token_dispatcher_type!r}")
        _check(not plan.recompute.recomputes("shared_experts"),
               "recompute module shared_experts cannot work with moe_shared_expert_overlap (megatron-core raises)")
    if plan.overlap_moe_expert_parallel_comm:  # megatron-core's TransformerConfig rules
        _check(not layout or plan.expert_model_parallel_size > 1,
               "overlap_moe_expert_parallel_comm needs expert_model_parallel_size > 1 (megatron-core asserts it)")
        _check(plan.moe_token_dispatcher_type in ("alltoall", "flex"),
               f"overlap_moe_expert_parallel_comm works with moe_token_dispatcher_type alltoall or flex (megatron-core "
               f"asserts it), got {plan.moe_token_dispatcher_type!r}")
        _check(not layout or plan.pipeline_model_parallel_size == 1 or plan.virtual_size(model.num_layers) > 1,
               "overlap_moe_expert_parallel_comm with pipeline_model_parallel_size > 1 needs a virtual pipeline "
               "(megatron-core asserts it)")
        _check(not plan.recompute.full and plan.recompute.method is None and not plan.recompute.recomputes("moe"),
               "overlap_moe_expert_parallel_comm runs without full recompute, a recompute method or recompute module "
               "moe (megatron-core asserts it)")
        _check(not plan.moe_shared_expert_overlap,
               "overlap_moe_expert_parallel_comm and moe_shared_expert_overlap are exclusive (megatron-core asserts it)")
    _check(not any(plan.alphas()), f"offload_alpha {plan.offload_alpha} with a mixture-of-experts model: h3t-ext's "
                                   f"activation offload runs in its runtime, which has no MoE layers; valid: 0")


def _validate_recompute(model: ModelSpec, plan: Plan) -> None:
    """Megatron's uniform recompute needs its N to divide every model chunk's layers."""
    sizes = plan.pipeline_split(model.num_layers).distinct_chunk_layers()
    for layers in sorted(sizes - {0}):
        try:
            plan.recompute.unit_shape(layers)
        except ValueError as e:
            raise InvalidPlanError(str(e)) from None


__all__ = ["DENSE_EXPERT_DEFAULTS", "MOE_OURS_REASON", "MOE_UNPRICED", "applicable_switches", "plan_layout",
           "validate_dense_experts", "validate_moe", "validate_plan", "validate_switches"]
