"""Argument parsing of ``h3t-plan``: Megatron's flag names, their types and ranges (the namespace becomes typed specs
in :mod:`h3t_ext.planner.from_args`).

Every parse error is one line, ``h3t-plan: error: <flag>: <problem and valid range>``, exit 2.
"""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional, Union

from h3t_ext.costmodel.specs import NORMALIZATIONS, POSITION_EMBEDDING_TYPES
from h3t_ext.costmodel.elementwise import CROSS_ENTROPY_FUSION_IMPLS
from h3t_ext.costmodel.fp8 import FP8_FORMATS, FP8_RECIPES, PRECISIONS
from h3t_ext.costmodel.plan import FSDP_SHARDING_STRATEGIES, OPTIMIZER_IMPLS, TRANSFORMER_IMPLS
from h3t_ext.costmodel.te_version import parse_te_version
from h3t_ext.ckpt import CKPT_CHOICES
from h3t_ext.offload_alpha import OffloadAlpha
from h3t_ext.planner import cli_flags, translate
from h3t_ext.layer_pattern import evaluate_pattern
from h3t_ext.planner.units import parse_bytes
from h3t_ext.planner.unpriced_flags import unpriced_reason

PROG = "h3t-plan"
DEFAULT_GPU = "h800"
"""GPU of the published tables; ``--gpu`` overrides it."""

AlphaArg = Union[float, tuple[float, ...], str]

CUSTOM_MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                      "ffn_hidden_size", "vocab_size", "kv_channels", "num_experts", "moe_router_topk",
                      "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")


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


SEARCH_ALPHA_REFUSAL = ("search takes one number in [0, 1], auto or balanced (p varies between plans, so a per-stage "
                        "list does not apply)")
"""Why ``search`` refuses a per-stage ``--offload-alpha`` list (the CLI and ``scripts/bench_planner.py``)."""


def search_alpha(text: str) -> AlphaArg:
    """``--offload-alpha`` of a search: :func:`_alpha` without a per-stage list (:data:`SEARCH_ALPHA_REFUSAL`)."""
    value = _alpha(text)
    if isinstance(value, tuple):
        raise argparse.ArgumentTypeError(SEARCH_ALPHA_REFUSAL)
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
    for name in CUSTOM_MODEL_FLAGS:
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
