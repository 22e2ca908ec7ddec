"""Argument parsing of ``h3t-plan``: Megatron's flag names in, typed specs out.

Every parse error is one line, ``h3t-plan: error: <flag>: <problem and valid range>``, exit 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from typing import NoReturn, Optional, Union

from h3t_ext.costmodel import ModelSpec, Plan, SystemSpec, UnknownNameError, get_model, get_system
from h3t_ext.costmodel.specs import NORMALIZATIONS, POSITION_EMBEDDING_TYPES, load_system_file, system_file_dict
from h3t_ext.costmodel.elementwise import CROSS_ENTROPY_FUSION_IMPLS
from h3t_ext.costmodel.fp8 import FP8_FORMATS, FP8_RECIPES, PRECISIONS
from h3t_ext.costmodel.plan import FSDP_SHARDING_STRATEGIES, OPTIMIZER_IMPLS, TRANSFORMER_IMPLS
from h3t_ext.costmodel.te_version import parse_te_version
from h3t_ext.ckpt import CKPT_CHOICES, DENSE_RECOMPUTE_MODULES
from h3t_ext.offload_alpha import OffloadAlpha
from h3t_ext.attention_window import WindowFlagError, parse_skip_freq, parse_window_size
from h3t_ext.planner import cli_flags, translate
from h3t_ext.planner.space import SearchConstraints
from h3t_ext.layer_pattern import evaluate_pattern
from h3t_ext.planner.units import parse_bytes
from h3t_ext.planner.unpriced_flags import unpriced_reason

PROG = "h3t-plan"
DEFAULT_GPU = "h800"
"""GPU of the published tables; ``--gpu`` overrides it."""

AlphaArg = Union[float, tuple[float, ...], str]

_CUSTOM_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                       "ffn_hidden_size", "vocab_size", "kv_channels", "num_experts", "moe_router_topk",
                       "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")
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


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line with a fixed program name, and which takes flags whole, as
    Megatron-LM's parser does (``allow_abbrev=False``): an abbreviation Megatron would refuse is not priced, and
    Megatron's ``--cpu-offloading`` is not read as a prefix of ``--cpu-offloading-num-layers``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            message = unpriced_reason(message) or message
        sys.stderr.write(f"{PROG}: error: {message}\n")
        raise SystemExit(2)


MAX_COUNT = 2**20
"""Largest value of a count flag (GPUs, layers, hidden size, sequence, batch, parallel sizes): the
planning range (a million GPUs), which also bounds the search's divisor enumeration."""


MAX_LAYERS = 1024
"""Largest ``--num-layers``: eight times the deepest published dense models (Megatron's 1T: 128 layers), and a
bound on the search's work, which grows with the layers of a stage (a search of 16384 layers on 720720 GPUs
took minutes, of a million layers it did not end)."""


def _count(text: str, maximum: int = MAX_COUNT) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (valid: integer in [1, {maximum}])") from None
    if not 1 <= value <= maximum:
        raise argparse.ArgumentTypeError(f"{value} out of range (valid: integer in [1, {maximum}])")
    return value


def _positive_int(text: str) -> int:
    return _count(text)


def _layer_count(text: str) -> int:
    return _count(text, MAX_LAYERS)


def _moe_layer_freq(text: str):
    """--moe-layer-freq: an integer N (every N-th layer, from the first, a MoE layer) or Megatron's list pattern of one
    0/1 per layer (``[0]*1+[1]*45``); its length is checked against the layers with the model."""
    try:
        value = evaluate_pattern(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer N >= 1 nor a pattern of 0/1 entries such "
                                         f"as ([0]*1+[1]*45)") from None
    return tuple(value) if isinstance(value, list) else value


def _dropout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (valid: a probability in [0, 1))") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{value} out of range (valid: a probability in [0, 1))")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (valid: a fraction in [0, 1])") from None
    if not 0.0 <= value <= 1.0:  # NaN fails both
        raise argparse.ArgumentTypeError(f"{value} out of range (valid: a fraction in [0, 1])")
    return value


def _weight(text: str) -> Optional[float]:
    """``--calibration-weight``: ``auto`` (None) or a number in (0, 1]."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (valid: auto or a weight in (0, 1])") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} out of range (valid: auto or a weight in (0, 1])")
    return value


def _alpha(text: str) -> AlphaArg:
    try:
        value = OffloadAlpha.parse(text, flag="")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).strip()) from None
    return value.mode if value.is_mode else value.alpha


def te_version_arg(text: str) -> str:
    """``--transformer-engine-version``: a version MAJOR.MINOR[.PATCH], kept as given."""
    try:
        parse_te_version(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("transformer_engine_version ", "")) from None
    return text.strip()


def _budget(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_common(sp: argparse.ArgumentParser, *, search: bool) -> None:
    _add_model(sp)
    r = sp.add_argument_group("run")
    r.add_argument("--seq-length", type=_positive_int, required=True)
    r.add_argument("--num-gpus", type=_positive_int, required=True)
    r.add_argument("--global-batch-size", type=_positive_int, required=True)
    _add_system(r)
    r.add_argument("--memory-budget", type=_budget, help="bytes per GPU, e.g. 80000000000, 78GB, 72GiB "
                   "(default: the system's budget)")
    r.add_argument("--host-memory-budget", type=_budget, default=None,
                   help="host bytes per node (one host: the system file's gpus_per_host GPUs) offloaded state "
                        "may use (default 80%% of its host_memory_bytes)")
    r.add_argument("--json", action="store_true", help="machine-readable output")
    p = sp.add_argument_group("plan" + (" (fixes that dimension of the search)" if search else ""))
    p.add_argument("--micro-batch-size", type=_positive_int, default=None if search else 1)
    cli_flags.add_parallel_size_flags(p, count=_positive_int, default=None if search else 1)
    cli_flags.add_virtual_pipeline_flags(p, count=_positive_int, uneven=not search)
    p.add_argument("--ckpt", choices=CKPT_CHOICES, default=None, help="h3t-ext's checkpointing (default no)")
    cli_flags.add_recompute_flags(p, count=_positive_int, full_method=not search)
    cli_flags.add_expert_flags(sp.add_argument_group("experts (a model with --num-experts" + (
        "; fixes that dimension of the search)" if search else ")")), count=_positive_int, search=search)
    p.add_argument("--overlap-grad-reduce", action="store_true", help="data-parallel reduce-scatter behind backward")
    p.add_argument("--overlap-param-gather", action="store_true", help="parameter all-gather behind forward")
    p.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="gradient buffer and its data-parallel reduction in bf16 (half the bytes of fp32)")
    p.add_argument("--tp-comm-overlap", action="store_true",
                   help="TransformerEngine userbuffers overlap the tensor-parallel communication with the GEMMs")
    p.add_argument("--no-overlap-p2p-communication", dest="overlap_p2p_comm", action="store_false",
                   help="interleaved pipeline exchanges not overlapped with the next chunk (every step waits)")
    sp_ = p.add_mutually_exclusive_group()
    sp_.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false", default=True,
                     help="tensor parallelism without sequence parallelism (all-reduces, replicated norms)")
    sp_.add_argument("--sequence-parallel", dest="sequence_parallel", action="store_true", default=True,
                     help="Megatron's flag, accepted as written in a training script: the planner's default (with "
                          "t > 1; a run without it is said with --no-sequence-parallel)")
    do_ = p.add_mutually_exclusive_group()
    do_.add_argument("--no-use-distributed-optimizer", dest="use_distributed_optimizer", action="store_false",
                     default=True, help="replicated optimizer states and a gradient all-reduce")
    do_.add_argument("--use-distributed-optimizer", dest="use_distributed_optimizer", action="store_true",
                     default=True, help="Megatron's flag, accepted as written in a training script: the planner's "
                                        "default (a run without it is said with --no-use-distributed-optimizer)")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true",
                           help="Megatron's flag, accepted as written in a training script: BF16 is what the planner "
                                "prices (with --fp8-format, the linear layers' GEMMs run in FP8 and the rest in BF16, "
                                "as in Megatron-LM)")
    precision.add_argument("--fp16", action="store_true",
                           help="an fp16 run: priced at the BF16 tensor-core rate (the same on Ampere and Hopper) with "
                                "Megatron-LM's fp16 gradients (2 bytes a parameter, in the buffer and its reduction) "
                                "unless --accumulate-allreduce-grads-in-fp32")
    p.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="Megatron's fp32 gradient buffer and reduction (its default with --bf16; with --fp16 it "
                        "doubles the gradients' bytes)")
    p.add_argument("--use-megatron-fsdp", action="store_true",
                   help="Megatron's switch of Megatron FSDP, accepted as written in a training script (needs "
                        "--data-parallel-sharding-strategy, which alone also selects it)")
    p.add_argument("--data-parallel-sharding-strategy", choices=FSDP_SHARDING_STRATEGIES, default=None,
                   help="Megatron FSDP (--use-megatron-fsdp): shard the gradients too (optim_grads, "
                        "reduce-scattered after every microbatch) or gradients and parameters "
                        "(optim_grads_params, all-gathered for every microbatch); default: Megatron's DDP")
    if not search:
        p.add_argument("--use-torch-fsdp2", action="store_true",
                       help="torch FSDP2 (megatron-core's TorchFullyShardedDataParallel): parameters, gradients and "
                            "optimizer states sharded over d, each layer gathered for its forward and backward "
                            "(p=1, untied embeddings; replaces the distributed optimizer)")
        p.add_argument("--torch-fsdp2-no-reshard-after-forward", dest="torch_fsdp2_reshard_after_forward",
                       action="store_false", help="FSDP2 keeps each layer's gathered parameters from its forward to "
                                                  "its backward")
    p.add_argument("--ckpt-format", choices=translate.MEGATRON_CKPT_FORMATS, default=None,
                   help="Megatron's checkpoint format, accepted as a training script gives it and as the printed "
                        "flags of a Megatron FSDP plan carry it; not priced (checkpoints are saved outside the "
                        "training step), checked as Megatron-LM checks it against the FSDP switches")
    p.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="megatron-core's HybridDeviceOptimizer: step a share of the optimizer on the CPU (needs the "
                        "distributed optimizer); search tries it by itself when nothing else fits")
    p.add_argument("--optimizer-offload-fraction", type=_fraction, default=None,
                   help="share of the optimizer shard stepped on the CPU, in [0, 1] (default 1.0)")
    p.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="Megatron's optimizer that --optimizer-cpu-offload runs on, accepted as written in a training "
                        "script: with Megatron's default state dtypes (fp32) it holds the bytes the planner prices")
    p.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true",
                   help="pipeline the gradient and parameter copies with the CPU optimizer steps")
    p.add_argument("--attention-backend", choices=translate.ATTENTION_BACKEND_CHOICES, default="auto",
                   help="Megatron's attention backend: flash (FlashAttention), fused (cuDNN's, through "
                        "TransformerEngine) and auto (TransformerEngine's choice: fused on Hopper, flash before) save "
                        "no s^2 scores and are priced at their own measured rates; unfused/local save the scores "
                        "(batched GEMMs and a softmax over them in HBM)")
    p.add_argument("--use-flash-attn", action="store_true",
                   help="Megatron's older switch of flash attention, accepted as written in a training script: "
                        "megatron-core's models ignore it (only the legacy model reads it), so the plan keeps "
                        "--attention-backend")
    p.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default="transformer_engine",
                   help="Megatron's --transformer-impl (local: no TransformerEngine; no FP8)")
    p.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false",
                   help="a SwiGLU run op by op (megatron-core's silu(gate) * (linear + offset)) instead of its fused "
                        "kernel: two more f-wide tensors saved per token and layer, three kernels' traffic for one")
    p.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="the vocabulary-parallel cross entropy in fused kernels (--cross-entropy-fusion-impl): fewer "
                        "bytes and kernels on the last pipeline stage")
    p.add_argument("--cross-entropy-fusion-impl", choices=CROSS_ENTROPY_FUSION_IMPLS, default=None,
                   help="native (megatron-core's jit-fused functions, the default) or te (TransformerEngine's kernel)")
    p.add_argument("--optimizer-impl", choices=OPTIMIZER_IMPLS, default="fused",
                   help="the Adam megatron-core finds installed: fused (TransformerEngine's or apex's FusedAdam) or "
                        "torch (torch.optim.AdamW, its fallback without both: one fp32 temporary per parameter of "
                        "the optimizer shard at the optimizer step)")
    p.add_argument("--transformer-engine-version", type=te_version_arg, default=None, metavar="MAJOR.MINOR",
                   help="the TransformerEngine the run imports (default: the newest rules this package knows); "
                        "before 2.18 the fused cross entropy keeps the logits' gradient in bf16, in place")
    p.add_argument("--fp8-format", dest="fp8", choices=FP8_FORMATS, default=None,
                   help="FP8 linear layers through TransformerEngine (Hopper or newer): e4m3, or hybrid (E5M2 "
                        "gradients); default BF16")
    p.add_argument("--fp8-recipe", choices=FP8_RECIPES, default=None,
                   help="FP8 scaling recipe (default delayed, Megatron's); mxfp8 needs Blackwell")
    p.add_argument("--fp8-param-gather", action="store_true",
                   help="parameters held and all-gathered in FP8 (needs --fp8-format)")
    p.add_argument("--first-last-layers-bf16", action="store_true",
                   help="an FP8 run's first and last layers in BF16 (not with --fp8-recipe delayed)")
    p.add_argument("--num-layers-at-start-in-bf16", type=_nonnegative_int, default=1, metavar="N",
                   help="with --first-last-layers-bf16: the model's first N layers in BF16 (default 1; at most L / p)")
    p.add_argument("--num-layers-at-end-in-bf16", type=_nonnegative_int, default=1, metavar="N",
                   help="with --first-last-layers-bf16: the model's last N layers in BF16 (default 1; at most L / p)")
    if search:
        p.add_argument("--precision", choices=PRECISIONS, default=None,
                       help="bf16, fp8 or auto (both; the best of either ranks first); default fp8 with "
                            "--fp8-format, else bf16. FP8 plans use --fp8-format (default hybrid) and --fp8-recipe")
    if not search:  # a Megatron offload request fixes alpha: estimate prices it, search chooses alpha itself
        _add_megatron_offload(p)
    p.add_argument("--offload-alpha", type=_alpha, default="auto" if search else 0.0,
                   help="FLOAT in [0, 1] (or one per stage: 0.3,0.2,...), auto (smallest alpha that fits) or "
                   "balanced (one smallest alpha per stage)")


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (valid: integer >= 0)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} out of range (valid: integer >= 0)")
    return value


def _add_megatron_offload(p) -> None:
    cli_flags.add_megatron_offload_flags(p, nonnegative=_nonnegative_int, fraction=_fraction)


def _add_system(g) -> None:
    g.add_argument("--gpu", default=None, help=f"system name (default {DEFAULT_GPU})")
    g.add_argument("--system-file", default=None, metavar="PATH",
                   help="system file (e.g. written by h3t-plan calibrate), instead of --gpu")


def _add_model(sp: argparse.ArgumentParser) -> None:
    g = sp.add_argument_group("model (--model NAME, or the Megatron shape flags for a custom model)")
    g.add_argument("--model", help="model name from the zoo, e.g. llama-65b; shape flags override its fields")
    for name in _CUSTOM_MODEL_FLAGS:
        g.add_argument("--" + name.replace("_", "-"), type=_layer_count if name == "num_layers" else _positive_int,
                       dest=name)
    g.add_argument("--group-query-attention", action="store_true",
                   help="Megatron's switch of --num-query-groups, accepted as written in a training script (the "
                        "planner reads --num-query-groups with or without it; a custom shape needs the groups given)")
    mlp = g.add_mutually_exclusive_group()
    mlp.add_argument("--swiglu", dest="swiglu", action="store_const", const=True,
                     help="SwiGLU MLP (default for custom models)")
    mlp.add_argument("--no-swiglu", dest="swiglu", action="store_const", const=False, help="GeLU MLP")
    mlp.add_argument("--squared-relu", dest="swiglu", action="store_const", const=False,
                     help="squared-ReLU MLP (Nemotron): priced as the GeLU MLP, the same shape and traffic")
    tie = g.add_mutually_exclusive_group()
    tie.add_argument("--untie-embeddings-and-output-weights", dest="untie", action="store_const", const=True,
                     help="separate output layer (default for custom models)")
    tie.add_argument("--tie-embeddings-and-output-weights", dest="untie", action="store_const", const=False)
    bias = g.add_mutually_exclusive_group()
    bias.add_argument("--add-bias-linear", dest="add_bias_linear", action="store_const", const=True,
                      help="biases on the linear layers (Megatron's default; GPT)")
    bias.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_const", const=False,
                      help="no linear biases (default for custom models; Llama)")
    g.add_argument("--normalization", choices=NORMALIZATIONS, default=None,
                   help="default: the zoo model's; for a custom shape RMSNorm with SwiGLU, else LayerNorm (priced "
                        "alike but for LayerNorm's bias: one memory-bound pass over the same bytes)")
    g.add_argument("--qk-layernorm", action="store_const", const=True, default=None,
                   help="a norm over each head's q and k after the QKV projection (OLMo 2, Qwen3): its traffic, "
                        "saved input and weights")
    g.add_argument("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES, default=None,
                   help="rope rotates q and k in every layer; learned_absolute keeps a --max-position-embeddings x "
                        "hidden table on the first stage, whole on every tensor-parallel rank (default: the zoo "
                        "model's; for a custom shape rope with SwiGLU, else learned_absolute)")
    g.add_argument("--make-vocab-size-divisible-by", type=_positive_int, default=None,
                   help="the vocabulary is padded to a multiple of this x the tensor-parallel size (Megatron's "
                        "default 128)")
    g.add_argument("--max-position-embeddings", type=_positive_int, default=None,
                   help="rows of the learned position table, >= --seq-length (default --seq-length)")
    g.add_argument("--moe-layer-freq", type=_moe_layer_freq, default=None, metavar="N|PATTERN",
                   help="which layers are mixture-of-experts layers (the others dense): N makes every N-th one, from "
                        "the first, a MoE layer; a pattern gives one 0/1 per layer, e.g. ([0]*1+[1]*45) (default 1: "
                        "all); dense and MoE layers are priced as the pattern's average layer")
    cli_flags.add_window_flags(g)  # left out: the zoo model's window (a custom shape has none)
    for flag in ("attention-dropout", "hidden-dropout"):
        g.add_argument("--" + flag, type=_dropout, default=None,
                       help="dropout probability (default: the zoo model's, 0 for a custom shape; Megatron-LM's "
                            "own default is 0.1)")


def build_parser() -> argparse.ArgumentParser:
    """The ``h3t-plan`` parser with its ``estimate`` and ``search`` subcommands."""
    parser = _Parser(prog=PROG, description="Memory, time and MFU of Megatron training plans; search for the best.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser,
                                metavar="{estimate,search,calibrate}")
    est = sub.add_parser("estimate", help="one plan -> memory, time, MFU")
    _add_common(est, search=False)
    est.add_argument("--explain", action="store_true", help="print every memory term per stage and every time term")
    srch = sub.add_parser("search", help="all valid plans, best first")
    _add_common(srch, search=True)
    srch.add_argument("--top", type=_positive_int, default=10, help="rows to print (default 10)")
    srch.add_argument("--max-micro-batch-size", type=_positive_int, default=None,
                      help="largest micro batch to search (default: no limit)")
    srch.add_argument("--even-pipeline-split", action="store_true",
                      help="search Megatron's even layer split only, never --pipeline-model-parallel-layout (for a "
                           "Megatron without that flag, such as Megatron-Kwai's ATC'24 scripts)")
    srch.add_argument("--exhaustive", action="store_true",
                      help="price every micro batch (default: stop once throughput falls with the micro batch)")
    cal = sub.add_parser("calibrate", help="fit a system file's efficiencies to measured runs")
    _add_model(cal)
    g = cal.add_argument_group("runs")
    _add_system(g)
    g.add_argument("--runs", nargs="+", required=True, metavar="FILE",
                   help="--metrics-json files of the training driver, or CSV files (one run per row)")
    g.add_argument("--output", required=True, metavar="PATH", help="system file to write")
    g.add_argument("--calibration-weight", type=_weight, default=None, metavar="{auto,W}",
                   help="share of the fit to apply, in (0, 1] (default auto: the published sources' spread across "
                        "and within clusters weighs n runs, about half for one run; 1 takes the fit whole)")
    g.add_argument("--json", action="store_true", help="machine-readable report")
    return parser


def model_from_args(ns: argparse.Namespace) -> ModelSpec:
    """The model of ``--model`` (with shape flags overriding its fields) or of the shape flags alone."""
    given = {k: getattr(ns, k) for k in _CUSTOM_MODEL_FLAGS if getattr(ns, k) is not None}
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
