"""``h3t-plan``'s parsed flags into the cost model's typed specs: the model, the system, the plan of ``estimate`` and
the constraints of ``search`` (through the one translation, :mod:`h3t_ext.planner.translate`), and the refusals of
flags that would be accepted and ignored. Every problem is a :class:`UsageError`, one line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
from typing import Optional

from h3t_ext.costmodel import ModelSpec, Plan, SystemSpec, UnknownNameError, get_model, get_system
from h3t_ext.costmodel.specs import load_system_file, system_file_dict
from h3t_ext.ckpt import DENSE_RECOMPUTE_MODULES
from h3t_ext.attention_window import WindowFlagError, parse_skip_freq, parse_window_size
from h3t_ext.planner import cli_flags, translate
from h3t_ext.planner.args import CUSTOM_MODEL_FLAGS, DEFAULT_GPU
from h3t_ext.planner.space import SearchConstraints

_REQUIRED_CUSTOM = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")


_FIELD = re.compile(r"\b(num_gpus|seq_length|global_batch_size|micro_batch_size|tensor_model_parallel_size|"
                    r"context_parallel_size|pipeline_model_parallel_size|num_layers_per_virtual_pipeline_stage|"
                    r"offload_alpha|ckpt|num_layers|hidden_size|num_attention_heads|num_query_groups|ffn_hidden_size|"
                    r"vocab_size|kv_channels|optimizer_cpu_offload|use_distributed_optimizer|"
                    r"data_parallel_sharding_strategy|tp_comm_overlap|sequence_parallel|overlap_param_gather|"
                    r"overlap_grad_reduce|use_torch_fsdp2|window_size|window_attn_skip_freq|num_experts|moe_router_topk|"
                    r"moe_ffn_hidden_size|moe_shared_expert_intermediate_size|expert_model_parallel_size|"
                    r"expert_tensor_parallel_size|moe_token_dispatcher_type|moe_grouped_gemm|moe_layer_freq|"
                    r"moe_shared_expert_overlap|overlap_moe_expert_parallel_comm|overlap_cpu_optimizer_d2h_h2d)\b")


def flagify(reason: str) -> str:
    """Name the command-line flags instead of the Plan fields in a cost-model reason."""
    return _FIELD.sub(lambda m: "--" + m.group(1).replace("_", "-"), reason)


class UsageError(Exception):
    """Bad command-line input; the message is the one line printed after ``h3t-plan: error:``."""


def model_from_args(ns: argparse.Namespace) -> ModelSpec:
    """The model of ``--model`` (with shape flags overriding its fields) or of the shape flags alone."""
    given = {k: getattr(ns, k) for k in CUSTOM_MODEL_FLAGS if getattr(ns, k) is not None}
    switches = {k: v for k, v in (("swiglu", ns.swiglu), ("untie_embeddings_and_output_weights", ns.untie),
                                  ("add_bias_linear", ns.add_bias_linear),
                                  ("attention_dropout", ns.attention_dropout), ("hidden_dropout", ns.hidden_dropout),
                                  ("normalization", ns.normalization), ("qk_layernorm", ns.qk_layernorm),
                                  ("position_embedding_type", ns.position_embedding_type),
                                  ("max_position_embeddings", ns.max_position_embeddings),
                                  ("make_vocab_size_divisible_by", ns.make_vocab_size_divisible_by),
                                  ("moe_layer_freq", ns.moe_layer_freq))
                if v is not None}
    switches.update(_window_switches(ns))
    seq_length = getattr(ns, "seq_length", None)
    if ns.max_position_embeddings is not None and seq_length is not None and ns.max_position_embeddings < seq_length:
        raise UsageError(f"argument --max-position-embeddings: {ns.max_position_embeddings} is below --seq-length "
                         f"{seq_length} (Megatron-LM asserts it; valid: >= {seq_length})")
    try:
        if ns.model is not None:
            try:
                base = get_model(ns.model)
            except UnknownNameError as e:
                raise UsageError(f"argument --model: {e}") from None
            return dataclasses.replace(base, **given, **switches) if (given or switches) else base
        if ns.group_query_attention and "num_query_groups" not in given:
            raise UsageError("argument --group-query-attention: needs --num-query-groups for a custom shape "
                             "(Megatron-LM's default is 1 group: give it, e.g. --num-query-groups 8)")
        missing = [k for k in _REQUIRED_CUSTOM if k not in given]
        if missing:
            flags = ", ".join("--" + k.replace("_", "-") for k in missing)
            raise UsageError(f"give --model NAME or a custom model shape (missing {flags})")
        given.setdefault("num_query_groups", given["num_attention_heads"])
        return ModelSpec(name="custom", **given, **switches)
    except ValueError as e:
        raise UsageError(f"model: {flagify(str(e))}") from None


def _window_switches(ns: argparse.Namespace) -> dict:
    """The ModelSpec fields of --window-size and --window-attn-skip-freq (UsageError, one line, on a bad value)."""
    try:
        out = {}
        if ns.window_size is not None:
            out["window_size"] = parse_window_size(ns.window_size)
        if ns.window_attn_skip_freq is not None:
            out["window_attn_skip_freq"] = parse_skip_freq(ns.window_attn_skip_freq)
        return out
    except WindowFlagError as e:
        raise UsageError(str(e)) from None


def _gpu_name(ns: argparse.Namespace) -> str:
    """``--gpu``, or :data:`DEFAULT_GPU` when it is not given (an empty name stays one: an unknown system)."""
    return DEFAULT_GPU if ns.gpu is None else ns.gpu


def system_from_args(ns: argparse.Namespace) -> SystemSpec:
    """The system of ``--system-file`` or ``--gpu`` (one of them; neither: :data:`DEFAULT_GPU`)."""
    if getattr(ns, "system_file", None) is not None:
        if ns.gpu is not None:
            raise UsageError(f"argument --gpu: give one of --gpu {ns.gpu} and --system-file {ns.system_file} (the "
                             "system file describes the GPU)")
        try:
            return load_system_file(ns.system_file)
        except (OSError, ValueError, KeyError) as e:
            raise UsageError(f"argument --system-file: {e}") from None
    try:
        return get_system(_gpu_name(ns))
    except UnknownNameError as e:
        raise UsageError(f"argument --gpu: {e}") from None


def system_file_from_args(ns: argparse.Namespace) -> dict:
    """The raw system file calibrate starts from (``--system-file`` or ``--gpu``'s, efficiencies inline)."""
    if ns.system_file is not None:
        with open(ns.system_file, encoding="utf-8") as f:
            return json.load(f)
    return system_file_dict(_gpu_name(ns))


def _needs(flag: str, what: str) -> UsageError:
    return UsageError(f"argument {flag}: needs {what}")


def _check_ckpt_format(ns: argparse.Namespace, *, search: bool) -> None:
    """--ckpt-format against the FSDP switches, as Megatron-LM 0.16-0.19's ``validate_args`` asserts: Megatron FSDP
    only with fsdp_dtensor and fsdp_dtensor only with it; torch FSDP2 with torch_dist or torch_dcp, and torch_dcp only
    with it, at tensor- and pipeline-parallel size 1."""
    fmt = ns.ckpt_format
    if fmt is None:
        return
    megatron_fsdp = ns.use_megatron_fsdp or ns.data_parallel_sharding_strategy is not None
    fsdp2 = getattr(ns, "use_torch_fsdp2", False)
    if megatron_fsdp and fmt != translate.MEGATRON_FSDP_CKPT_FORMAT:
        raise UsageError(f"argument --ckpt-format: Megatron FSDP needs --ckpt-format "
                         f"{translate.MEGATRON_FSDP_CKPT_FORMAT} (Megatron-LM asserts it), got {fmt}")
    if fmt == translate.MEGATRON_FSDP_CKPT_FORMAT and not megatron_fsdp:
        raise _needs("--ckpt-format fsdp_dtensor", "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads "
                     "or optim_grads_params (Megatron-LM asserts it)")
    if fsdp2 and fmt not in ("torch_dist", "torch_dcp"):
        raise UsageError(f"argument --ckpt-format: --use-torch-fsdp2 needs --ckpt-format torch_dist or torch_dcp "
                         f"(Megatron-LM asserts it), got {fmt}")
    if fmt == "torch_dcp" and search:
        raise _needs("--ckpt-format torch_dcp", "--use-torch-fsdp2 (Megatron-LM asserts it), which search does not "
                     "search: price that plan with estimate")
    if fmt == "torch_dcp" and (not fsdp2 or ns.tensor_model_parallel_size not in (None, 1)
                               or ns.pipeline_model_parallel_size not in (None, 1)):
        raise _needs("--ckpt-format torch_dcp", "--use-torch-fsdp2 at --tensor-model-parallel-size 1 and "
                     "--pipeline-model-parallel-size 1 (Megatron-LM asserts it)")


def check_flags_apply(ns: argparse.Namespace, *, search: bool) -> None:
    """Refuse a flag that changes memory, time or numerics where the other flags leave it nothing to act on (it
    would be accepted and ignored): one line naming it and what it needs."""
    cpu_optimizer = ns.optimizer_cpu_offload
    if ns.use_flash_attn and ns.attention_backend in ("unfused", "local"):
        raise UsageError(f"argument --use-flash-attn: contradicts --attention-backend {ns.attention_backend}; give one")
    if ns.use_megatron_fsdp and ns.data_parallel_sharding_strategy is None:
        raise _needs("--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads or optim_grads_params (the "
                     "shardings priced; Megatron-LM's default is no_shard, which shards nothing, in 0.16 and 0.17, "
                     "and optim_grads_params from 0.18)")
    if ns.optimizer_offload_fraction is not None and not cpu_optimizer:
        raise _needs("--optimizer-offload-fraction", "--optimizer-cpu-offload (without it no optimizer state is "
                     "stepped on the CPU" + ("; search picks the fraction of the plans it offloads itself)"
                                             if search else ")"))
    ladder = search and ns.use_distributed_optimizer and ns.data_parallel_sharding_strategy is None
    if ns.overlap_cpu_optimizer_d2h_h2d and not cpu_optimizer and not ladder:
        raise _needs("--overlap-cpu-optimizer-d2h-h2d", "--optimizer-cpu-offload (without it there are no CPU "
                     "optimizer copies to overlap)")
    _check_ckpt_format(ns, search=search)
    if search:
        bf16_only = ns.precision == "bf16" or (ns.precision is None and ns.fp8 is None)
        if ns.fp8_recipe is not None and bf16_only:
            raise _needs("--fp8-recipe", "--precision fp8 or auto, or --fp8-format (bf16 plans have no FP8 recipe)")
        if ns.tp_comm_overlap and (ns.tensor_model_parallel_size == 1 or not ns.sequence_parallel):
            raise _needs("--tp-comm-overlap", "--sequence-parallel with --tensor-model-parallel-size > 1 (Megatron-LM "
                         "asserts it; no plan of this search could overlap)")
        return
    if ns.fp8_recipe is not None and ns.fp8 is None:
        raise _needs("--fp8-recipe", "--fp8-format (e4m3 or hybrid); a BF16 plan has no FP8 recipe")
    granularity = _granularity(ns)
    if ns.recompute_method is not None and granularity != "full":
        raise _needs("--recompute-method", "--recompute-granularity full (it picks the layers full recompute reruns)")
    if ns.recompute_num_layers is not None and granularity is None:
        raise _needs("--recompute-num-layers", "--recompute-granularity full (without a granularity Megatron-LM "
                     "recomputes nothing)")
    if ns.recompute_modules is not None and granularity is None:
        raise _needs("--recompute-modules", "--recompute-granularity selective (without a granularity Megatron-LM "
                     "recomputes nothing)")
    if ns.recompute_modules == [] and granularity == "selective":
        raise _needs("--recompute-modules", f"one or more of {', '.join(DENSE_RECOMPUTE_MODULES)}")
    if not ns.fine_grained_activation_offloading:
        for flag in ("activation_offload_fraction", "min_offloaded_tensor_size", "delta_offload_bytes_across_pp_ranks"):
            if getattr(ns, flag) is not None:
                raise _needs("--" + flag.replace("_", "-"), "--fine-grained-activation-offloading (without it "
                             "Megatron-LM offloads nothing)")


def _granularity(ns: argparse.Namespace) -> Optional[str]:
    """Megatron's recompute granularity with ``--recompute-activations`` (its shorthand of selective) folded in."""
    try:
        return cli_flags.recompute_granularity_of(ns.recompute_granularity, ns.recompute_activations)
    except ValueError as e:
        raise UsageError(f"argument --recompute-activations: {e}") from None


def _ckpt_of(ns: argparse.Namespace, *, search: bool) -> Optional[str]:
    """search: --ckpt or Megatron's --recompute-granularity (one of them), else None (searched). estimate: --ckpt
    (default 'no'); Megatron's --recompute-* flags go on top of it through the one translation, which says where
    they contradict."""
    if not search:
        return ns.ckpt or "no"
    granularity = _granularity(ns)
    if granularity is not None and ns.ckpt is not None and ns.ckpt != granularity:
        raise UsageError(f"argument --recompute-granularity: {granularity} contradicts --ckpt {ns.ckpt} "
                         "(give one of them)")
    return ns.ckpt or granularity or (None if search else "no")


def megatron_offload_requested(ns: argparse.Namespace) -> bool:
    """Whether ``estimate``'s flags ask for Megatron's activation offload (its alpha is then the mapping's)."""
    try:
        return translate.megatron_offload_from_args(ns).requested
    except (TypeError, ValueError):
        return False


def plan_from_args(ns: argparse.Namespace, alpha: Optional[float] = None,
                   model: Optional[ModelSpec] = None) -> Plan:
    """The plan of ``estimate``'s flags (the one translation, :mod:`h3t_ext.planner.translate`); ``alpha``
    replaces a symbolic ``--offload-alpha``; with ``model``, Megatron's activation offload flags set the alpha."""
    if model is not None and model.is_moe and (megatron_offload_requested(ns) or ns.offload_alpha not in (0, 0.0)):
        given = "Megatron's activation offload flags" if megatron_offload_requested(ns) else \
            f"--offload-alpha {ns.offload_alpha}"
        raise UsageError(f"argument {given}: activation offload is not priced with mixture-of-experts layers (h3t-ext's "
                         "offload runs in its runtime, which has no MoE layers; Megatron's module groups of experts "
                         "are not mapped); valid: leave it out")
    if model is not None and isinstance(ns.offload_alpha, str) and megatron_offload_requested(ns):
        raise UsageError(f"argument --offload-alpha: {ns.offload_alpha} and Megatron's activation offload flags are "
                         "two offload requests; give one")
    check_flags_apply(ns, search=False)
    if alpha is None:
        alpha = 0.0 if isinstance(ns.offload_alpha, str) else ns.offload_alpha
    try:
        return translate.plan_from_args(ns, num_gpus=ns.num_gpus, offload_alpha=alpha, model=model,
                                        ckpt=_ckpt_of(ns, search=False),
                                        use_megatron_fsdp=ns.data_parallel_sharding_strategy is not None,
                                        **({"use_distributed_optimizer": False} if ns.use_torch_fsdp2 else {}))
    except ValueError as e:
        raise UsageError(str(e)) from None


def constraints_from_args(ns: argparse.Namespace) -> SearchConstraints:
    """The dimensions ``search``'s flags fix (the one translation)."""
    check_flags_apply(ns, search=True)
    if ns.max_micro_batch_size is not None and ns.micro_batch_size is not None \
            and ns.max_micro_batch_size < ns.micro_batch_size:
        raise UsageError(f"argument --max-micro-batch-size: {ns.max_micro_batch_size} is below --micro-batch-size "
                         f"{ns.micro_batch_size}")
    try:
        return translate.constraints_from_args(ns, max_micro_batch_size=ns.max_micro_batch_size,
                                               ckpt=_ckpt_of(ns, search=True),
                                               use_megatron_fsdp=ns.data_parallel_sharding_strategy is not None)
    except ValueError as e:
        raise UsageError(str(e)) from None
