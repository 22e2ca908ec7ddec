"""The megatron-core config fields of the table flags a GPU run implements (the "implemented" rows of
:mod:`h3t_training.config.gpu_flags`): ``TransformerConfig`` (FP8, fusions, attention backend), the
``DistributedDataParallelConfig`` and the ``OptimizerConfig`` the driver builds, and the layer spec
(``--transformer-impl``). Values are checked as Megatron-LM's parser and megatron-core check them; a bad one is a
ValueError naming the flag, turned into one line before any process group by :func:`check_gpu_flags`.
"""
from __future__ import annotations

from typing import Any, Optional

from h3t_ext.costmodel.fp8 import bf16_layer_counts_refusal, fp8_device_refusal, fp8_switches_refusal
from h3t_ext.planner.translate import sixteen_bit_grads
from h3t_training.config import feature_checks
from h3t_training.config.flag_table import table_int, table_value
from h3t_training.config.fp8_flags import AMAX_COMPUTE_ALGOS, FP8_FLAGS, FP8_FORMATS, FP8_RECIPES, Fp8Flag
from h3t_training.errors import ArgumentError

ATTENTION_BACKENDS = ("flash", "fused", "unfused", "auto")
"""megatron-core's AttnBackend names a GPU run with TransformerEngine's spec takes (:func:`attention_backend`)."""
ATTENTION_BACKEND_NAMES = (*ATTENTION_BACKENDS, "local")
"""Every name Megatron-LM's ``--attention-backend`` takes (the CPU run checks the GPU job's against them)."""
OPTIMIZER_DTYPES = {"--main-grads-dtype": ("main_grads_dtype", ("fp32", "bf16")),
                    "--main-params-dtype": ("main_params_dtype", ("fp32", "fp16")),
                    "--exp-avg-dtype": ("exp_avg_dtype", ("fp32", "fp16", "bf16", "fp8")),
                    "--exp-avg-sq-dtype": ("exp_avg_sq_dtype", ("fp32", "fp16", "bf16", "fp8"))}
"""Megatron-LM's precision-aware optimizer dtype flags: ``OptimizerConfig`` field and choices."""


def _given(args, flag: str) -> bool:
    return table_value(args, flag) is not None


def _choice(args, flag: str, choices: tuple[str, ...], default: Optional[str] = None) -> Optional[str]:
    value = table_value(args, flag, default)
    if value is not None and value not in choices:
        raise ValueError(f"{flag} {value} is not one of {', '.join(choices)}")
    return value


def _fp8_value(args, f: Fp8Flag):
    """The value ``f``'s flag gives its field (:data:`~h3t_training.config.fp8_flags.Fp8Read`)."""
    if f.read == "choice":
        return _choice(args, f.flag, f.choices, f.default)
    if f.read == "int":
        return table_int(args, f.flag, f.default, f.low)
    if f.read in ("switch", "off_switch"):
        return _given(args, f.flag) == (f.read == "switch")
    return table_value(args, f.flag)


def fp8_fields(args) -> dict[str, Any]:
    """``TransformerConfig``'s FP8 fields (megatron-core runs its TransformerEngine layers in FP8 with them), one per
    flag of :data:`~h3t_training.config.fp8_flags.FP8_FLAGS`; empty without ``--fp8-format``."""
    fmt = FP8_FLAGS[0]
    if _fp8_value(args, fmt) is None:
        fp8_only = [f.flag for f in FP8_FLAGS if f.needs_format and _given(args, f.flag)]
        if fp8_only:
            raise ValueError(f"{fp8_only[0]} needs {fmt.flag} ({' or '.join(fmt.choices)})")
        return {}
    fields: dict[str, Any] = {}
    for f in FP8_FLAGS:
        value = _fp8_value(args, f)
        if f.read == "off_switch":
            fields[f.field] = fields.get(f.field, True) and value
        elif f.read != "value" or value is not None:
            fields[f.field] = value
    if fields["fp8_recipe"] == "custom" and "fp8_quantizer_factory" not in fields:
        raise ValueError("--fp8-recipe custom needs --fp8-quantizer-factory")
    refusal = fp8_switches_refusal(fields["fp8_recipe"], first_last_layers_bf16=fields["first_last_layers_bf16"],
                                   fp8_param_gather=fields["fp8_param"],
                                   optimizer_cpu_offload=args.optimizer_cpu_offload,
                                   use_distributed_optimizer=args.use_distributed_optimizer,
                                   fsdp=args.use_megatron_fsdp or args.use_torch_fsdp2)
    if not refusal and fields["first_last_layers_bf16"]:  # TransformerConfig's bound on the counts
        refusal = bf16_layer_counts_refusal(fields["num_layers_at_start_in_bf16"], fields["num_layers_at_end_in_bf16"],
                                            args.num_layers, args.pipeline_model_parallel_size)
    if refusal:
        raise ValueError(refusal)
    return fields


def bias_swiglu_fusion(args) -> bool:
    """Megatron-LM's fused bias-SwiGLU (its default; --no-bias-swiglu-fusion turns it off): the plan's
    ``bias_activation_fusion``, which the cost model reads for a SwiGLU MLP only (:func:`transformer_fields` sets
    megatron-core's field by the same flag)."""
    return not _given(args, "--no-bias-swiglu-fusion")


def cross_entropy_fusion(args) -> dict[str, Any]:
    """Megatron-LM's --cross-entropy-loss-fusion and --cross-entropy-fusion-impl as the plan's fields (and
    megatron-core's: :func:`transformer_fields` reads the same flags)."""
    return {"cross_entropy_loss_fusion": _given(args, "--cross-entropy-loss-fusion"),
            "cross_entropy_fusion_impl": _choice(args, "--cross-entropy-fusion-impl", ("native", "te"), "native")}


def given_attention_backend(args) -> Optional[str]:
    """The AttnBackend name a run's flags give (``--attention-backend``, else ``--use-flash-attn``: flash; 'local'
    kept), or None when neither is given."""
    backend = table_value(args, "--attention-backend")
    if backend is None:
        return "flash" if _given(args, "--use-flash-attn") else None
    return backend


def attention_backend(args) -> Optional[str]:
    """The AttnBackend name of ``--attention-backend`` (``--use-flash-attn``: flash) a GPU run passes to megatron-core,
    or None when neither is given. ValueError for a backend the run's layer spec (:func:`spec_backend`) does not run:
    'local' with TransformerEngine's spec (the driver's has no local attention, as Megatron-LM's asserts), and
    anything but flash or auto with the local spec, whose core attention is PyTorch's scaled_dot_product_attention
    (FlashAttention on a GPU; fused, unfused or local would be accepted and not run)."""
    given = table_value(args, "--attention-backend")
    if given is None:
        return given_attention_backend(args)  # --use-flash-attn's flash, or None
    backend = _choice(args, "--attention-backend", ATTENTION_BACKEND_NAMES)
    if spec_backend(args, on_gpu=True) == "te":
        if backend == "local":
            raise ValueError("--attention-backend local on a GPU is megatron-core's local attention, and the driver's "
                             "TransformerEngine spec has none (Megatron-LM asserts --spec local for it); use flash, "
                             "fused, unfused or auto")
    elif backend not in ("flash", "auto"):
        raise ValueError(f"--attention-backend {backend} with the local layer spec (--transformer-impl local): its "
                         "core attention is PyTorch's scaled_dot_product_attention, FlashAttention on a GPU; use "
                         "flash or auto, or TransformerEngine's spec for the others")
    return backend


def transformer_fields(args) -> dict[str, Any]:
    """The ``TransformerConfig`` fields the GPU run takes from the table flags (beyond the architecture and layout
    the model provider sets)."""
    from megatron.core.transformer.enums import AttnBackend

    fields: dict[str, Any] = dict(
        bias_activation_fusion=bias_swiglu_fusion(args) if args.swiglu else (
            not args.disable_bias_linear and not _given(args, "--no-bias-gelu-fusion")),
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=_given(args, "--use-fast-rope") and not _given(args, "--no-rope-fusion"),
        gradient_accumulation_fusion=False,  # the driver's: each --no-*-fusion flag asks for what it runs
        **cross_entropy_fusion(args),
        attention_softmax_in_fp32=True, apply_query_key_layer_scaling=False,
        fp32_residual_connection=_given(args, "--fp32-residual-connection"),
        disable_bf16_reduced_precision_matmul=_given(args, "--disable-bf16-reduced-precision-matmul"),
        **fp8_fields(args))
    backend = attention_backend(args)
    if backend is not None:
        fields["attention_backend"] = AttnBackend[backend]
    return fields


def sixteen_bit_grads_of(args) -> bool:
    """Whether this run holds and reduces its gradients in 16 bits (:func:`h3t_ext.planner.translate.sixteen_bit_grads`
    on the driver's flags): what its DDP config builds and what its plan prices."""
    return sixteen_bit_grads(grad_reduce_in_bf16=_given(args, "--grad-reduce-in-bf16"),
                             fp16=bool(args.fp16),
                             accumulate_allreduce_grads_in_fp32=_given(args, "--accumulate-allreduce-grads-in-fp32"))


def optimizer_impl() -> str:
    """The Adam megatron-core steps with here (``Plan.optimizer_impl``): 'torch' where it fell back to
    ``torch.optim.AdamW`` (neither TransformerEngine's nor apex's FusedAdam importable), else 'fused'."""
    import torch  # noqa: PLC0415
    from megatron.core import optimizer  # noqa: PLC0415

    return "torch" if getattr(optimizer, "Adam", None) is torch.optim.AdamW else "fused"


def transformer_engine_version():
    """The installed TransformerEngine's version (``Plan.transformer_engine_version``), None where it is not
    importable."""
    try:
        import transformer_engine  # noqa: PLC0415
    except ImportError:
        return None
    return getattr(transformer_engine, "__version__", None)


def ddp_fields(args) -> dict[str, Any]:
    """The ``DistributedDataParallelConfig`` fields of the table flags (gradients in fp32 unless
    ``--grad-reduce-in-bf16``, or ``--fp16`` without ``--accumulate-allreduce-grads-in-fp32``: Megatron-LM's rule,
    :func:`h3t_ext.planner.translate.sixteen_bit_grads`, which the run's plan reads too)."""
    fields: dict[str, Any] = dict(grad_reduce_in_fp32=not sixteen_bit_grads_of(args),
                                  fp8_param_gather=_given(args, "--fp8-param-gather"),
                                  gradient_reduce_div_fusion=not _given(args, "--no-gradient-reduce-div-fusion"),
                                  average_in_collective=_given(args, "--ddp-average-in-collective"),
                                  pad_buckets_for_high_nccl_busbw=_given(args, "--ddp-pad-buckets-for-high-nccl-busbw"))
    if _given(args, "--ddp-bucket-size"):
        fields["bucket_size"] = table_int(args, "--ddp-bucket-size", 0, 1)
    return fields


def optimizer_dtype_fields(args) -> dict[str, Any]:
    """``OptimizerConfig``'s precision-aware dtypes (Megatron-LM's mapping; fp8 states are stored as uint8)."""
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}
    fields = {}
    for flag, (field, choices) in OPTIMIZER_DTYPES.items():
        value = _choice(args, flag, choices, "fp32")
        if value != "fp32" and not args.use_precision_aware_optimizer:
            raise ValueError(f"{flag} {value} needs --use-precision-aware-optimizer (as in Megatron-LM)")
        fields[field] = dtypes[value]
    return fields


def spec_backend(args, *, on_gpu: bool) -> str:
    """The layer spec: 'te' on a GPU with TransformerEngine importable unless ``--transformer-impl local``, else
    'local'. ValueError for ``--transformer-impl transformer_engine`` on a GPU without it."""
    impl = _choice(args, "--transformer-impl", ("transformer_engine", "local"))
    if not on_gpu or impl == "local":
        return "local"
    if not feature_checks.transformer_engine_available():
        if impl == "transformer_engine":
            raise ValueError(f"--transformer-impl transformer_engine needs TransformerEngine, and "
                             f"{feature_checks.transformer_engine_reason()}")
        return "local"
    return "te"


def check_layer_spec(args):
    """A resolve step ahead of every step that prices the run (the offload mapping, ``--auto-plan``): the layer spec
    ``--transformer-impl`` asks for is one this run can build (:func:`spec_backend`), with an attention backend it
    runs (:func:`attention_backend`; on CPU the GPU job's, any of megatron-core's names), or one line."""
    on_gpu = feature_checks.uses_gpu(args)
    try:
        spec_backend(args, on_gpu=on_gpu)
        if on_gpu:
            attention_backend(args)
        else:
            _choice(args, "--attention-backend", ATTENTION_BACKEND_NAMES)  # the CPU spec is local
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    return args


def check_gpu_flags(args):
    """A resolve step: every megatron-core field of the table flags is computed once, so a bad value or combination
    is one line before any process group. On CPU too (the CPU stand-in is as strict as a GPU run): the FP8, DDP,
    optimizer-dtype and cross-entropy fields (``--fp8-format e5m2`` or
    ``--fp8-param-gather`` without a format is refused there as on a GPU, not noticed and dropped); only what needs a
    GPU's TransformerEngine is left to the GPU. ``--transformer-impl`` and ``--attention-backend`` are
    :func:`check_layer_spec`'s, an earlier step."""
    on_gpu = feature_checks.uses_gpu(args)
    try:
        ddp_fields(args)
        optimizer_dtype_fields(args)
        fp8 = fp8_fields(args)
        _choice(args, "--cross-entropy-fusion-impl", ("native", "te"), "native")
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    if on_gpu and fp8:  # the GPU's FP8 support (TransformerEngine's check, at its first FP8 forward otherwise)
        refusal = fp8_device_refusal(fp8["fp8_recipe"], feature_checks.cuda_compute_capability(), "this GPU")
        if refusal:
            raise ArgumentError(refusal)
    return args


__all__ = ["AMAX_COMPUTE_ALGOS", "ATTENTION_BACKEND_NAMES", "ATTENTION_BACKENDS", "FP8_FORMATS", "FP8_RECIPES",
           "OPTIMIZER_DTYPES", "attention_backend", "check_gpu_flags", "check_layer_spec", "ddp_fields", "fp8_fields",
           "given_attention_backend", "optimizer_dtype_fields", "optimizer_impl", "spec_backend",
           "transformer_engine_version", "transformer_fields"]
