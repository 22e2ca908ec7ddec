"""The one translation of Megatron's argument names into the cost model's :class:`~h3t_ext.costmodel.Plan`
and the planner's :class:`~h3t_ext.planner.space.SearchConstraints`.

Every caller that prices a run described by Megatron-LM's flags goes through here: ``h3t-plan estimate`` and
``search``, ``h3t-plan calibrate`` (run files), the round trip of :func:`h3t_ext.planner.flags.megatron_flags`,
and the training driver (``--auto-plan``, ``--offload-alpha auto|balanced`` and its logged predictions).

``args`` is anything that names Megatron's fields: an ``argparse.Namespace``, the driver's config, or a mapping
(a run file's ``config``, a CSV row already converted to numbers). A field the arguments do not name takes
**Megatron-LM's** default (:data:`MEGATRON_DEFAULTS`), never the ``Plan`` dataclass's own: Megatron runs
without sequence parallelism or the distributed optimizer unless told, and a translation that fell back to
``Plan``'s defaults (both on) would price another run than the one launched.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Sequence

from h3t_ext.ckpt import Ckpt, Recompute, normal_form
from h3t_ext.costmodel.fp8 import DEFAULT_FP8_RECIPE, FP8_FORMATS, PRECISIONS
from h3t_ext.costmodel.megatron_offload import MIN_OFFLOADED_TENSOR_SIZE, MegatronOffload, MegatronOffloadMapping, \
    megatron_offload_alpha
from h3t_ext.costmodel.plan import FSDP_SHARDING_STRATEGIES, LAYER_SPEC, Plan
from h3t_ext.costmodel.specs import ModelSpec
from h3t_ext.dtypes import BF16, BOOL
from h3t_ext.offload_alpha import Alpha
from h3t_ext.planner.space import MEMORY_LADDER, MemoryOption, SearchConstraints

MEGATRON_ARGUMENTS_SOURCE = ("https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/"
                             "megatron/training/arguments.py")
MEGATRON_DEFAULTS: dict[str, Any] = {
    "micro_batch_size": 1,
    "tensor_model_parallel_size": 1,
    "context_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "num_layers_per_virtual_pipeline_stage": None,
    "recompute_granularity": None,
    "recompute_activations": False,
    "recompute_method": None,
    "recompute_num_layers": None,
    "recompute_modules": None,
    "sequence_parallel": False,
    "use_distributed_optimizer": False,
    "overlap_grad_reduce": False,
    "overlap_param_gather": False,
    "tp_comm_overlap": False,
    "overlap_p2p_comm": True,  # --no-overlap-p2p-communication stores False
    "use_megatron_fsdp": False,
    "data_parallel_sharding_strategy": "optim_grads_params",  # no_shard in Megatron-LM 0.16 and 0.17
    "use_torch_fsdp2": False,
    "torch_fsdp2_reshard_after_forward": True,  # --torch-fsdp2-no-reshard-after-forward stores False
    "attention_backend": "auto",
    "transformer_impl": "transformer_engine",
    "optimizer_impl": "fused",  # not Megatron's: TransformerEngine's FusedAdam, which a Megatron-LM GPU job imports
    "transformer_engine_version": None,  # not Megatron's: the newest TransformerEngine's rules
    "decoder_first_pipeline_num_layers": None,
    "decoder_last_pipeline_num_layers": None,
    "num_virtual_stages_per_pipeline_rank": None,
    "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False,
    "pipeline_model_parallel_layout": None,
    "microbatch_group_size_per_vp_stage": None,  # megatron-core's default: p
    "fp8": None,  # --fp8-format (dest fp8): BF16 unless given
    "fp8_recipe": DEFAULT_FP8_RECIPE,
    "fp8_param_gather": False,
    "first_last_layers_bf16": False,
    "num_layers_at_start_in_bf16": 1,
    "num_layers_at_end_in_bf16": 1,
    "grad_reduce_in_bf16": False,
    "fp16": False,
    "accumulate_allreduce_grads_in_fp32": False,  # Megatron-LM turns it on for --bf16 (sixteen_bit_grads)
    "optimizer_cpu_offload": False,
    "optimizer_offload_fraction": 1.0,
    "overlap_cpu_optimizer_d2h_h2d": False,
    "fine_grained_activation_offloading": False,
    "offload_modules": None,
    "activation_offload_fraction": 1.0,
    "min_offloaded_tensor_size": MIN_OFFLOADED_TENSOR_SIZE,
    "delta_offload_bytes_across_pp_ranks": 0,
    "cpu_offloading_num_layers": 0,
    "even_pipeline_split": False,  # not Megatron's: h3t-plan search --even-pipeline-split
    "num_experts": None,
    "expert_model_parallel_size": 1,
    "expert_tensor_parallel_size": None,  # Megatron-LM: t
    "moe_token_dispatcher_type": "allgather",
    "moe_grouped_gemm": False,
    "moe_shared_expert_overlap": False,
    "overlap_moe_expert_parallel_comm": False,
    "bias_swiglu_fusion": True,  # --no-bias-swiglu-fusion stores False (Plan.bias_activation_fusion)
    "cross_entropy_loss_fusion": False,
    "cross_entropy_fusion_impl": "native",
}
"""Megatron-LM's defaults (``MEGATRON_ARGUMENTS_SOURCE``) of the fields a plan reads, for arguments that do
not name them. ``micro_batch_size`` has none in Megatron (it is required); 1 is what a run file without it ran."""

_REQUIRED = ("seq_length", "global_batch_size")
_COPIED = ("micro_batch_size", "tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
           "num_layers_per_virtual_pipeline_stage", "sequence_parallel", "use_distributed_optimizer",
           "overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "overlap_p2p_comm",
           "transformer_impl", "optimizer_impl", "transformer_engine_version", "decoder_first_pipeline_num_layers",
           "decoder_last_pipeline_num_layers",
           "num_virtual_stages_per_pipeline_rank", "account_for_embedding_in_pipeline_split",
           "account_for_loss_in_pipeline_split", "pipeline_model_parallel_layout",
           "microbatch_group_size_per_vp_stage", "fp8",
           "fp8_recipe", "fp8_param_gather", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
           "num_layers_at_end_in_bf16", "fp16", "optimizer_cpu_offload", "optimizer_offload_fraction",
           "overlap_cpu_optimizer_d2h_h2d", "use_torch_fsdp2", "torch_fsdp2_reshard_after_forward",
           "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_token_dispatcher_type",
           "moe_grouped_gemm", "moe_shared_expert_overlap", "overlap_moe_expert_parallel_comm",
           "cross_entropy_loss_fusion", "cross_entropy_fusion_impl")
_ATTENTION_BACKENDS = {"auto": "auto", "flash": "flash", "fused": "fused", "local": "unfused", "unfused": "unfused"}
"""Megatron's --attention-backend -> the cost model's attention (``Plan.attention_backend``): FlashAttention, cuDNN's
fused attention and TransformerEngine's choice between them ('auto') save no s^2 scores; the local (unfused) core
attention does ('unfused')."""
ATTENTION_BACKEND_CHOICES = tuple(_ATTENTION_BACKENDS)
"""Megatron's --attention-backend values (its AttnBackend names)."""
_MISSING = object()


def sixteen_bit_grads(*, grad_reduce_in_bf16: bool, fp16: bool, accumulate_allreduce_grads_in_fp32: bool) -> bool:
    """Whether Megatron-LM keeps the gradient buffer (and reduces it) in 16 bits: with --grad-reduce-in-bf16, and in
    an --fp16 run unless --accumulate-allreduce-grads-in-fp32 (``validate_args`` forces fp32 accumulation for
    --bf16 only; the DDP config's ``grad_reduce_in_fp32`` is ``accumulate_allreduce_grads_in_fp32``, so an fp16 run
    holds fp16 gradients: ``MEGATRON_ARGUMENTS_SOURCE``). ValueError (one line) for the two flags that contradict."""
    if grad_reduce_in_bf16 and accumulate_allreduce_grads_in_fp32:
        raise ValueError("--grad-reduce-in-bf16 contradicts --accumulate-allreduce-grads-in-fp32; give one")
    return bool(grad_reduce_in_bf16 or (fp16 and not accumulate_allreduce_grads_in_fp32))


def _grads_16bit(read, fixed: Mapping[str, Any]) -> bool:
    """The plan's ``grad_reduce_in_bf16`` (16-bit gradients): what the caller fixed, else :func:`sixteen_bit_grads`."""
    if "grad_reduce_in_bf16" in fixed:
        return bool(fixed["grad_reduce_in_bf16"])
    return sixteen_bit_grads(grad_reduce_in_bf16=bool(_value(read, "grad_reduce_in_bf16", fixed)),
                             fp16=bool(_value(read, "fp16", fixed)),
                             accumulate_allreduce_grads_in_fp32=bool(_value(read, "accumulate_allreduce_grads_in_fp32",
                                                                            fixed)))


def _reader(args: Any):
    if isinstance(args, Mapping):
        return lambda name: args.get(name, _MISSING)
    return lambda name: getattr(args, name, _MISSING)


def _named(read, name: str, fixed: Mapping[str, Any]) -> Any:
    """What the caller fixed, else what the arguments name, else ``_MISSING``."""
    return fixed[name] if name in fixed else read(name)


_NONE_IS_UNSET = frozenset({"fp8_recipe", "optimizer_offload_fraction", "fine_grained_activation_offloading",
                            "offload_modules", "activation_offload_fraction", "min_offloaded_tensor_size",
                            "delta_offload_bytes_across_pp_ranks", "cpu_offloading_num_layers",
                            "moe_token_dispatcher_type", "expert_model_parallel_size", "cross_entropy_fusion_impl"})
"""Fields whose None (an argparse default) means "not given": Megatron's default applies."""


def _value(read, name: str, fixed: Mapping[str, Any]) -> Any:
    """:func:`_named`, with Megatron's default for a field the arguments do not name."""
    v = _named(read, name, fixed)
    if v is _MISSING or (v is None and name in _NONE_IS_UNSET):
        if name not in MEGATRON_DEFAULTS:
            raise ValueError(f"the run does not name {name} (needed to price it)")
        return MEGATRON_DEFAULTS[name]
    return v


def _recompute(read, fixed: Mapping[str, Any]) -> Recompute:
    """Megatron's --recompute-granularity/-method/-num-layers/-modules (--recompute-activations: selective)."""
    granularity = _value(read, "recompute_granularity", fixed)
    if _value(read, "recompute_activations", fixed) and granularity is None:
        granularity = "selective"
    return Recompute.parse(granularity, _value(read, "recompute_method", fixed),
                           _value(read, "recompute_num_layers", fixed), _value(read, "recompute_modules", fixed),
                           moe=_value(read, "num_experts", fixed) is not None)


def _ckpt(read, fixed: Mapping[str, Any]) -> tuple[Optional[Ckpt], Recompute]:
    """(``ckpt``, Megatron's recompute) in their normal form (:func:`h3t_ext.ckpt.normal_form`): ``ckpt`` when
    the arguments name it (h3t-ext's flag), else ``no``, with Megatron's ``--recompute-*`` flags on top
    (``full``/uniform/1 is ``ckpt`` full, selective ``core_attn`` is ``ckpt`` selective). ``ckpt`` None when the
    arguments leave it to a search. ValueError (one line) where they contradict."""
    recompute = _recompute(read, fixed)
    ckpt = _named(read, "ckpt", fixed)
    if ckpt is None:
        return None, recompute
    return normal_form(Ckpt.NO if ckpt is _MISSING else Ckpt.parse(ckpt), recompute)


def _sharding(read, fixed: Mapping[str, Any]) -> Optional[str]:
    strategy = _value(read, "data_parallel_sharding_strategy", fixed)
    if "data_parallel_sharding_strategy" in fixed:
        return strategy
    if not _value(read, "use_megatron_fsdp", fixed):
        return None
    return strategy if strategy in FSDP_SHARDING_STRATEGIES else None  # 'optim' prices as the distributed optimizer


def megatron_offload_from_args(args: Any, **fixed: Any) -> MegatronOffload:
    """Megatron-LM's activation offload flags (``--fine-grained-activation-offloading``, ``--offload-modules``,
    ``--activation-offload-fraction``, ``--min-offloaded-tensor-size``, ``--delta-offload-bytes-across-pp-ranks``,
    ``--cpu-offloading-num-layers``) as one :class:`~h3t_ext.costmodel.megatron_offload.MegatronOffload`."""
    read = _reader(args)

    def value(name: str) -> Any:
        return _value(read, name, fixed)

    return MegatronOffload(
        fine_grained_activation_offloading=bool(value("fine_grained_activation_offloading")),
        offload_modules=tuple(value("offload_modules") or ()),
        activation_offload_fraction=float(value("activation_offload_fraction")),
        min_offloaded_tensor_size=int(value("min_offloaded_tensor_size")),
        delta_offload_bytes_across_pp_ranks=int(value("delta_offload_bytes_across_pp_ranks")),
        cpu_offloading_num_layers=int(value("cpu_offloading_num_layers")))


def megatron_offload_mapping(args: Any, model: ModelSpec, plan: Plan, **spec: Any) -> Optional[MegatronOffloadMapping]:
    """The alpha of the arguments' Megatron offload request on ``plan``
    (:func:`~h3t_ext.costmodel.megatron_offload.megatron_offload_alpha`), or None when they ask for none. ``spec``:
    the layer spec keywords (``layer_spec``, ``dtype_bytes``, ``dropout_mask_bytes``, ``fp8``); by default the
    plan's own, as the cost model prices it (its ``transformer_impl``, bf16, its FP8)."""
    spec = {"layer_spec": LAYER_SPEC[plan.transformer_impl], "dtype_bytes": BF16, "dropout_mask_bytes": BOOL,
            "fp8": plan.fp8 is not None, **spec}
    return megatron_offload_alpha(model, plan, megatron_offload_from_args(args), **spec)


def plan_from_args(args: Any, *, num_gpus: int, offload_alpha: Alpha = 0.0, model: Optional[ModelSpec] = None,
                   **fixed: Any) -> Plan:
    """The :class:`Plan` of a run described by Megatron's field names.

    ``fixed`` gives fields the caller knows better than the arguments (the driver: the switches it does not
    run, whatever the flags say). With ``model``, Megatron's activation offload flags set the plan's alpha
    (:func:`megatron_offload_mapping`; a nonzero ``offload_alpha`` with them is two offload requests). ValueError
    (one line) when ``seq_length`` or ``global_batch_size`` is missing or ``ckpt`` is not a mode; the plan's own
    checks are :func:`~h3t_ext.costmodel.validate_plan`'s."""
    if model is not None and model.is_moe:  # the model's experts admit Megatron's MoE recompute modules
        fixed.setdefault("num_experts", model.num_experts)
    plan = _plan(args, num_gpus=num_gpus, offload_alpha=offload_alpha, **fixed)
    if model is None:
        return plan
    mapping = megatron_offload_mapping(args, model, plan)
    if mapping is None:
        return plan
    if any(plan.alphas()):
        raise ValueError(f"{megatron_offload_from_args(args).flags()} and --offload-alpha "
                         f"{offload_alpha} are two offload requests; give one")
    return plan.with_alpha(mapping.alpha)


def _plan(args: Any, *, num_gpus: int, offload_alpha: Alpha = 0.0, **fixed: Any) -> Plan:
    read = _reader(args)
    values = {name: _value(read, name, fixed) for name in _COPIED}
    values["grad_reduce_in_bf16"] = _grads_16bit(read, fixed)
    values["bias_activation_fusion"] = bool(_value(read, "bias_swiglu_fusion", fixed))
    for name in _REQUIRED:  # no Megatron default: _value raises when they are missing
        values[name] = _value(read, name, fixed)
        if values[name] is None:
            raise ValueError(f"the run does not name {name} (needed to price it)")
    ckpt, recompute = _ckpt(read, fixed)
    if ckpt is None:
        raise ValueError("ckpt is not set (give --ckpt no|full|ours)")
    return Plan(num_gpus=num_gpus, offload_alpha=offload_alpha, ckpt=ckpt, recompute=recompute,
                attention_backend=_attention(read, fixed),
                data_parallel_sharding_strategy=_sharding(read, fixed), **values)


def _attention(read, fixed: Mapping[str, Any]) -> str:
    """The cost model's attention of Megatron's --attention-backend (megatron-core's models ignore the older
    --use-flash-attn, which only Megatron-LM's legacy model reads)."""
    backend = _value(read, "attention_backend", fixed)
    backend = getattr(backend, "name", backend)  # Megatron's AttnBackend enum or its name
    if backend not in _ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {backend!r} is not one of {{{','.join(_ATTENTION_BACKENDS)}}}")
    return _ATTENTION_BACKENDS[backend]


class FixedRecomputeError(ValueError):
    """Recompute flags the search cannot keep (a method, a layer count or modules beside the granularity): it
    searches the ckpt modes, or a granularity given alone."""

    def __init__(self, flags: Sequence[str]):
        self.flags = " ".join(flags)
        super().__init__(f"search does not choose {self.flags} (price it with estimate; search takes --ckpt "
                         "no|full|ours or --recompute-granularity alone)")


def constraints_from_args(args: Any, *, max_micro_batch_size: Optional[int] = None,
                          memory_ladder: Optional[tuple[MemoryOption, ...]] = None, **fixed: Any) -> SearchConstraints:
    """The search dimensions the arguments fix (None: searched) and the switches every searched plan keeps.
    ``memory_ladder`` replaces the ladder the arguments allow (the driver passes () for what it does not run)."""
    read = _reader(args)

    def given(name: str) -> Any:
        v = _named(read, name, fixed)
        return None if v is _MISSING else v

    ckpt, recompute = _ckpt(read, fixed)
    if recompute.granularity is not None:
        raise FixedRecomputeError(recompute.flags())
    switches = {name: _value(read, name, fixed) for name in (
        "overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "overlap_p2p_comm", "sequence_parallel",
        "use_distributed_optimizer", "fp16", "optimizer_cpu_offload",
        "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d")}
    switches["grad_reduce_in_bf16"] = _grads_16bit(read, fixed)
    switches["bias_activation_fusion"] = _value(read, "bias_swiglu_fusion", fixed)
    switches["cross_entropy_loss_fusion"] = _value(read, "cross_entropy_loss_fusion", fixed)
    return SearchConstraints(
        cross_entropy_fusion_impl=_value(read, "cross_entropy_fusion_impl", fixed),
        tensor_model_parallel_size=given("tensor_model_parallel_size"),
        context_parallel_size=given("context_parallel_size"),
        pipeline_model_parallel_size=given("pipeline_model_parallel_size"),
        num_layers_per_virtual_pipeline_stage=given("num_layers_per_virtual_pipeline_stage"),
        micro_batch_size=given("micro_batch_size"),
        max_micro_batch_size=max_micro_batch_size,
        pipeline_layouts=not _value(read, "even_pipeline_split", fixed),
        ckpt=ckpt,
        data_parallel_sharding_strategy=_sharding(read, fixed),
        attention_backend=_attention(read, fixed),
        transformer_impl=_value(read, "transformer_impl", fixed),
        optimizer_impl=_value(read, "optimizer_impl", fixed),
        transformer_engine_version=_value(read, "transformer_engine_version", fixed),
        expert_model_parallel_size=given("expert_model_parallel_size"),
        expert_tensor_parallel_size=given("expert_tensor_parallel_size"),
        moe_token_dispatcher_type=given("moe_token_dispatcher_type"),
        moe_grouped_gemm=bool(given("moe_grouped_gemm")),
        moe_shared_expert_overlap=bool(given("moe_shared_expert_overlap")),
        overlap_moe_expert_parallel_comm=bool(given("overlap_moe_expert_parallel_comm")),
        **_precision(read, fixed),
        memory_ladder=_ladder(read, fixed, switches) if memory_ladder is None else memory_ladder,
        **{k: (v if k == "optimizer_offload_fraction" else bool(v)) for k, v in switches.items()},
    )


def _ladder(read, fixed: Mapping[str, Any], switches: Mapping[str, Any]) -> tuple[MemoryOption, ...]:
    """The memory options a search may add (:data:`~h3t_ext.planner.space.MEMORY_LADDER`): none that the
    arguments fix. Sharding and optimizer offload both need the distributed optimizer; a fixed
    --data-parallel-sharding-strategy or --optimizer-cpu-offload keeps every plan to it; a --ckpt-format other than
    Megatron FSDP's leaves out its shardings (Megatron-LM runs them with fsdp_dtensor only)."""
    if not switches["use_distributed_optimizer"] or switches["optimizer_cpu_offload"] \
            or _sharding(read, fixed) is not None or _value(read, "use_megatron_fsdp", fixed):
        return ()
    if _named(read, "ckpt_format", fixed) not in (_MISSING, None, MEGATRON_FSDP_CKPT_FORMAT):
        return tuple(o for o in MEMORY_LADDER if o.data_parallel_sharding_strategy is None)
    return MEMORY_LADDER


MEGATRON_CKPT_FORMATS = ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")
"""Megatron-LM 0.16-0.19's --ckpt-format values (``training_config.ckpt_format``)."""
MEGATRON_FSDP_CKPT_FORMAT = "fsdp_dtensor"
"""The --ckpt-format Megatron-LM 0.16-0.19 require with --use-megatron-fsdp (``validate_args`` asserts it); not a
field of the plan (nothing priced depends on it): a search told another format leaves Megatron FSDP out
(:func:`_ladder`), and :func:`~h3t_ext.planner.flags.plan_from_megatron_flags` reads past it."""


DEFAULT_SEARCH_FP8_FORMAT = "hybrid"
"""--fp8-format of the FP8 plans of ``search --precision fp8|auto`` when none is given: E4M3 forward, E5M2
gradients, the format of NVIDIA's published FP8 recipes (NeMo / Megatron-Bridge)."""


def _precision(read, fixed: Mapping[str, Any]) -> dict[str, Any]:
    """The precisions a search prices (h3t-ext's ``precision``: bf16, fp8 or auto = both; default fp8 when
    --fp8-format is given, else bf16) and the FP8 settings of its FP8 plans."""
    fmt, precision = _value(read, "fp8", fixed), _named(read, "precision", fixed)
    if precision is _MISSING or precision is None:
        precision = "bf16" if fmt is None else "fp8"
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if fmt is not None and fmt not in FP8_FORMATS:
        raise ValueError(f"--fp8-format must be one of {', '.join(FP8_FORMATS)}, got {fmt!r}")
    fp8_only = {name: _value(read, name, fixed) for name in _FP8_PLAN_SETTINGS}
    if precision == "bf16" and (fmt is not None or fp8_only["fp8_param_gather"] or fp8_only["first_last_layers_bf16"]):
        raise ValueError("--fp8-format / --fp8-param-gather / --first-last-layers-bf16 need --precision fp8 or auto "
                         "(bf16 plans have no FP8)")
    return {"precisions": ("bf16", "fp8") if precision == "auto" else (precision,),
            "fp8": fmt or DEFAULT_SEARCH_FP8_FORMAT, "fp8_recipe": _value(read, "fp8_recipe", fixed), **fp8_only}


_FP8_PLAN_SETTINGS = ("fp8_param_gather", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
                      "num_layers_at_end_in_bf16")
"""The settings a search gives its FP8 plans only (its BF16 plans, with ``--precision auto``, have no FP8)."""


__all__ = ["ATTENTION_BACKEND_CHOICES", "FixedRecomputeError", "MEGATRON_CKPT_FORMATS", "MEGATRON_DEFAULTS",
           "MEGATRON_FSDP_CKPT_FORMAT", "constraints_from_args",
           "megatron_offload_from_args", "megatron_offload_mapping", "plan_from_args"]
