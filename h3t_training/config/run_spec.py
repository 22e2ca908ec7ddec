"""The cost model's description of the run this driver launches: its ``ModelSpec`` and ``Plan``, built here
and nowhere else in the driver.

The flags go through the library's one translation (:func:`h3t_ext.planner.translate.plan_from_args`); the
switches this driver does not run are fixed here whatever the command line says (``docs/flags.md`` lists them as
noticed), so ``--auto-plan``, ``--offload-alpha auto|balanced``, the logged predictions and the MFU price the run
that is launched: its sequence parallelism and distributed optimizer as given, no TransformerEngine
userbuffers (``--tp-comm-overlap``), no Megatron FSDP. The layer split (uneven first/last stages,
``--account-for-*``, ``--num-virtual-stages-per-pipeline-rank``) is priced as given: the driver builds it.
"""
from __future__ import annotations

from typing import Optional

from h3t_ext.attention_window import SkipFreq
from h3t_ext.costmodel import ModelSpec, Plan
from h3t_ext.costmodel.mfu import model_flops_per_token
from h3t_ext.dtypes import BOOL, DtypeName, bytes_per_element
from h3t_ext.offload_alpha import Alpha
from h3t_ext.planner.translate import plan_from_args
from h3t_training.config.flag_table import table_value
from h3t_training.config.fp8_flags import fp8_flag
from h3t_training.config.megatron_fields import attention_backend, bias_swiglu_fusion, cross_entropy_fusion, \
    given_attention_backend, optimizer_impl, sixteen_bit_grads_of, spec_backend, transformer_engine_version


def uses_transformer_engine(on_gpu: bool, config) -> bool:
    """The layer spec the model provider builds for ``config``: TransformerEngine's on a GPU where it is importable,
    unless ``--transformer-impl local`` (:func:`~h3t_training.config.megatron_fields.spec_backend`)."""
    return spec_backend(config, on_gpu=on_gpu) == "te"


def compute_dtype(config, *, on_gpu: bool) -> DtypeName:
    """The torch dtype (its name) the model's parameters and activations are in: --bf16 / --fp16 on a GPU (else
    float32); on CPU float32, or float64 with --h3t-float64 (CPU has no fast half-precision GEMMs, and the
    equivalence checks want float64)."""
    if on_gpu:
        return "bfloat16" if config.bf16 else "float16" if config.fp16 else "float32"
    return "float64" if config.h3t_float64 else "float32"


def activation_spec(config, *, on_gpu: bool) -> dict:
    """How this run's saved activations are priced (the keywords of the cost model's activation terms): the layer
    spec the model provider builds, the bytes of :func:`compute_dtype` per element (:mod:`h3t_ext.dtypes`), and a
    hidden-dropout mask of one byte on a GPU (PyTorch's CPU dropout keeps its noise in the activation dtype)."""
    dtype_bytes = bytes_per_element(compute_dtype(config, on_gpu=on_gpu))
    return {"layer_spec": "te" if uses_transformer_engine(on_gpu, config) else "local", "dtype_bytes": dtype_bytes,
            "dropout_mask_bytes": BOOL if on_gpu else dtype_bytes}


def gpu_plan_fields(config) -> dict:
    """The Plan fields of the table flags a GPU run with TransformerEngine passes to megatron-core
    (:mod:`h3t_training.config.megatron_fields`): FP8 (format, recipe, parameter all-gather) and the attention
    backend, so the plan prices what runs."""
    fields = {"fp8": table_value(config, "--fp8-format"), "fp8_param_gather": table_value(config, "--fp8-param-gather",
                                                                                          False) is not False,
              "attention_backend": attention_backend(config) or "auto"}
    if fields["fp8"] is not None:
        fields["fp8_recipe"] = table_value(config, "--fp8-recipe", fp8_flag("--fp8-recipe").default)
    return fields


def model_spec(config, vocab_size: int, name: str = "custom") -> ModelSpec:
    """The model these flags build: its shape (with --kv-channels), q/k norms (--qk-layernorm), MLP (--swiglu; GeLU and
    --squared-relu priced alike: the same shape and traffic), output layer
    (--untie-embeddings-and-output-weights), linear biases (--disable-bias-linear) and dropout."""
    return ModelSpec(name=name, num_layers=config.num_layers, hidden_size=config.hidden_size,
                     num_attention_heads=config.num_attention_heads, num_query_groups=config.num_query_groups,
                     ffn_hidden_size=config.ffn_hidden_size, vocab_size=vocab_size, swiglu=bool(config.swiglu),
                     untie_embeddings_and_output_weights=bool(config.untie_embeddings_and_output_weights),
                     add_bias_linear=not config.disable_bias_linear,
                     attention_dropout=config.attention_dropout, hidden_dropout=config.hidden_dropout,
                     normalization=config.normalization, position_embedding_type=config.position_embedding_type,
                     max_position_embeddings=config.max_position_embeddings,
                     make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
                     kv_channels=config.kv_channels, qk_layernorm=bool(config.qk_layernorm),
                     window_size=window_left(config),
                     window_attn_skip_freq=_skip_freq(config))


def _skip_freq(config) -> Optional[SkipFreq]:
    """--window-attn-skip-freq of a windowed run, as ``model_flags.resolve_window`` read it (an int or a tuple; None
    without a window: Megatron-LM's no-op)."""
    return None if config.window_size is None else config.window_attn_skip_freq


def window_left(config) -> Optional[int]:
    """The left window of --window-size (resolved to megatron-core's (LEFT, 0)), None without one."""
    return None if config.window_size is None else int(config.window_size[0])


def stack_fields(config, *, on_gpu: bool) -> dict:
    """The Plan fields of the software this run's GPU has (none off a GPU: the plan is then the GPU job's, with
    TransformerEngine): the local layer spec where TransformerEngine is not used, else the TransformerEngine version
    it imports, and the Adam megatron-core imported (:func:`~h3t_training.config.megatron_fields.optimizer_impl`)."""
    if not on_gpu:
        return {}
    out = {"optimizer_impl": optimizer_impl()}
    if not uses_transformer_engine(on_gpu, config):
        out["transformer_impl"] = "local"
    else:
        out["transformer_engine_version"] = transformer_engine_version()
    return out


def run_plan(config, *, offload_alpha: Alpha = 0.0, on_gpu: bool = False, **fixed) -> Plan:
    """The plan of this run (``fixed``: fields a caller decides). On a GPU without TransformerEngine the model
    provider builds the local spec; elsewhere the plan is the GPU job's (``--transformer-impl``, Megatron's
    default TransformerEngine), which is what ``--gpu``'s budget and ``h3t-plan`` price. On a GPU with
    TransformerEngine the plan has the FP8 and attention backend the run passes to megatron-core
    (:func:`gpu_plan_fields`), and off a GPU the attention backend its flags give. On a GPU the plan's Adam is the
    one megatron-core imported (:func:`~h3t_training.config.megatron_fields.optimizer_impl`); elsewhere the GPU
    job's, TransformerEngine's."""
    # off a GPU the GPU job's attention as its flags give it (local: the translation's unfused); on a GPU without
    # TransformerEngine the local spec's core attention ('auto' prices FlashAttention there)
    job_attention = "auto" if on_gpu else given_attention_backend(config) or "auto"
    runs = dict(tp_comm_overlap=False, attention_backend=job_attention, bias_swiglu_fusion=bias_swiglu_fusion(config),
                **cross_entropy_fusion(config),
                grad_reduce_in_bf16=sixteen_bit_grads_of(config), **stack_fields(config, on_gpu=on_gpu))
    if on_gpu and uses_transformer_engine(on_gpu, config):
        runs.update(gpu_plan_fields(config), transformer_impl="transformer_engine")
    # on CPU the plan is for the GPU job: --transformer-impl (Megatron's TE) and TransformerEngine's FusedAdam
    return plan_from_args(config, num_gpus=config.world_size, offload_alpha=offload_alpha, **{**runs, **fixed})


def model_flops_per_iteration_token(config, vocab_size: int) -> float:
    """Forward + backward model FLOPs per token: the cost model's one formula
    (:func:`h3t_ext.costmodel.mfu.model_flops_per_token`) on this run's model."""
    return model_flops_per_token(model_spec(config, vocab_size), config.seq_length)


__all__ = ["activation_spec", "compute_dtype", "gpu_plan_fields", "model_flops_per_iteration_token", "model_spec", "run_plan",
           "uses_transformer_engine", "window_left"]
