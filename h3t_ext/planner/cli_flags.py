"""Megatron-LM's layout, sliding-window, recompute and activation-offload flags, defined once for both command lines that take
them: ``h3t-plan`` (:mod:`h3t_ext.planner.args`) and the training driver (``h3t_training/config/arguments.py``); and a
MoE model's expert flags (:func:`add_expert_flags`: ``h3t-plan`` only, the driver refuses MoE layers).

Each function adds one family of flags to an argparse group with Megatron-LM's names, destinations, choices and
help. What differs between the two command lines is passed in, not copied: the type that parses a count (the
planner checks ranges as it parses, with its own one-line message; the driver parses ``int`` and checks every size
after resolving Megatron's aliases, :func:`h3t_training.config.arguments.check_positive`), the default of the
parallel sizes (the planner's ``estimate`` prices 1, its ``search`` and the driver leave them to be chosen), and
which members of a family a command line takes (``h3t-plan search`` chooses the layout, so it takes no uneven split
and no full-recompute method). The planner's and the driver's defaults of sequence parallelism and the distributed
optimizer differ on purpose and stay in their own modules.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from h3t_ext.ckpt import DENSE_RECOMPUTE_MODULES, RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS
from h3t_ext.costmodel.megatron_offload import DENSE_OFFLOAD_MODULES, MIN_OFFLOADED_TENSOR_SIZE
from h3t_ext.costmodel.moe import MOE_TOKEN_DISPATCHERS

Parse = Callable[[str], Any]

PARALLEL_SIZE_FLAGS = {
    "--tensor-model-parallel-size": "t: ranks that split every layer's weights (and, with sequence parallelism, its "
                                    "norm-side activations)",
    "--pipeline-model-parallel-size": "p: pipeline stages, each a consecutive share of the layers",
    "--context-parallel-size": "c: ranks that split the sequence (ring attention over c)",
}


def add_parallel_size_flags(g, *, count: Parse, default: Optional[int]) -> None:
    """t, p and c (``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``, ``--context-parallel-size``)."""
    for flag, text in PARALLEL_SIZE_FLAGS.items():
        g.add_argument(flag, type=count, default=default, help=text)


def add_virtual_pipeline_flags(g, *, count: Parse, uneven: bool) -> None:
    """Interleaving (``--num-layers-per-virtual-pipeline-stage``) and, with ``uneven``, Megatron's uneven first and
    last stages, the second way to interleave them and megatron-core's layout string."""
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=count, default=None,
                   help="layers of each model chunk (interleaved 1F1B)")
    if not uneven:
        return
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=count, default=None,
                   help="model chunks per pipeline rank (interleaving; the way to interleave uneven stages)")
    g.add_argument("--decoder-first-pipeline-num-layers", type=count, default=None,
                   help="transformer layers of the first pipeline stage (the rest split evenly over the others)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=count, default=None,
                   help="transformer layers of the last pipeline stage")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="the embedding counts as one layer of the first stage when the layers are split")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="the loss counts as one layer of the last stage when the layers are split")
    g.add_argument("--pipeline-model-parallel-layout", default=None, metavar="LAYOUT",
                   help="every model chunk's layers as megatron-core reads them: p x v stages separated by |, "
                        "E the embedding, t a transformer layer, L the loss, (..)*N and c*N repeats, e.g. "
                        "Ett|(tt|)*2tL (excludes the other split and interleaving flags)")
    g.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=count, default=None, metavar="G",
                   dest="microbatch_group_size_per_vp_stage",
                   help="interleaved 1F1B: microbatches each model chunk runs before the next chunk takes over "
                        "(default --pipeline-model-parallel-size; p <= G <= microbatches, and microbatches mod G is 0 "
                        "or >= p); a larger G holds (v - 1) G + 2 (p - 1) microbatch-chunks in the warm-up")


def add_window_flags(g) -> None:
    """Megatron's sliding-window attention, ``--window-size`` and ``--window-attn-skip-freq``, as text: each command
    line reads them with :mod:`h3t_ext.attention_window` and says a bad value in its own one-line error."""
    g.add_argument("--window-size", default=None, metavar="LEFT,RIGHT",
                   help="sliding-window attention (Mistral, Gemma): each token attends to the LEFT tokens before it "
                        "and itself (RIGHT is 0 in a causal GPT), e.g. 4096,0; flash attention computes only that band")
    g.add_argument("--window-attn-skip-freq", default=None, metavar="N|PATTERN",
                   help="which layers --window-size windows: N windows all but every N-th layer; a pattern such as "
                        "[1,1,1,0]*3 gives one 0/1 per layer (1 windowed); default every layer")


def add_recompute_flags(g, *, count: Parse, full_method: bool) -> None:
    """Megatron's activation recompute: ``--recompute-granularity`` and, with ``full_method``, how full recompute
    picks its layers and which modules selective recompute reruns."""
    g.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default=None,
                   help="full: whole layers rerun in backward (see --recompute-method); selective: the "
                        "--recompute-modules of every layer (default core_attn)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="Megatron's shorthand of --recompute-granularity selective")
    if not full_method:
        return
    g.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, default=None,
                   help="full recompute: uniform (units of --recompute-num-layers layers, the default) or block "
                        "(the first --recompute-num-layers layers of each model chunk)")
    g.add_argument("--recompute-num-layers", type=count, default=None, help="full recompute's N (default 1)")
    g.add_argument("--recompute-modules", nargs="*", default=None, metavar="MODULE",
                   help=f"selective recompute: any of {', '.join(DENSE_RECOMPUTE_MODULES)} (default core_attn)")


def recompute_granularity_of(recompute_granularity: Optional[str], recompute_activations: bool) -> Optional[str]:
    """Megatron's granularity with its shorthand folded in (``--recompute-activations`` is ``--recompute-granularity
    selective``); ValueError (one line) where the two contradict (Megatron-LM would let the shorthand win)."""
    if not recompute_activations:
        return recompute_granularity
    if recompute_granularity not in (None, "selective"):
        raise ValueError(f"--recompute-activations (selective) contradicts --recompute-granularity "
                         f"{recompute_granularity}; give one of them")
    return "selective"


def add_megatron_offload_flags(g, *, nonnegative: Parse, fraction: Parse) -> None:
    """Megatron-LM's activation CPU offload, which runs (and is priced) as the ``--offload-alpha`` that moves the
    same saved bytes (:mod:`h3t_ext.costmodel.megatron_offload`)."""
    g.add_argument("--fine-grained-activation-offloading", action="store_true",
                   help="Megatron-LM's module-level activation offload (with --offload-modules): runs as the "
                        "--offload-alpha that moves the same saved bytes (one notice states it)")
    g.add_argument("--offload-modules", nargs="+", default=None, metavar="MODULE",
                   help=f"any of {', '.join(DENSE_OFFLOAD_MODULES)} (attn_proj needs core_attn)")
    g.add_argument("--activation-offload-fraction", type=fraction, default=None, metavar="F",
                   help="fraction in [0, 1] of the eligible module groups offloaded (default 1.0, as Megatron-LM)")
    g.add_argument("--min-offloaded-tensor-size", type=nonnegative, default=None, metavar="N",
                   help=f"saved tensors with fewer elements stay on the device (default {MIN_OFFLOADED_TENSOR_SIZE}, "
                        "as Megatron-LM)")
    g.add_argument("--delta-offload-bytes-across-pp-ranks", type=nonnegative, default=None, metavar="BYTES",
                   help="only 0 (Megatron-LM's default; a nonzero delta has no per-stage alpha that reproduces it)")
    g.add_argument("--cpu-offloading-num-layers", type=nonnegative, default=None, metavar="N",
                   help="Megatron-LM's layer offload of the first N layers (p=1): runs as --offload-alpha N/L")


__all__ = ["PARALLEL_SIZE_FLAGS", "add_megatron_offload_flags", "add_parallel_size_flags", "add_recompute_flags",
           "add_virtual_pipeline_flags", "recompute_granularity_of"]


MOE_ROUTING_SPELLINGS: tuple[tuple[str, dict], ...] = (
    ("--moe-router-load-balancing-type", dict(choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                                                        "none"))),
    ("--moe-aux-loss-coeff", dict(type=float)),
    ("--moe-z-loss-coeff", dict(type=float)),
    ("--moe-router-topk-scaling-factor", dict(type=float)),
    ("--moe-router-score-function", dict(choices=("softmax", "sigmoid"))),
    ("--moe-router-dtype", dict(choices=("fp32", "fp64"))),
    ("--moe-router-bias-update-rate", dict(type=float)),
    ("--moe-router-pre-softmax", dict(action="store_true")),
    ("--moe-router-enable-expert-bias", dict(action="store_true")),
    ("--moe-permute-fusion", dict(action="store_true")),
    ("--moe-router-fusion", dict(action="store_true")),
    ("--moe-router-force-load-balancing", dict(action="store_true")),
)
"""Megatron's MoE routing flags a training script carries that change what the router computes, not what a step
costs: the planner accepts them as written and prices alike (routing is priced balanced, as
--moe-router-force-load-balancing makes it; the router's scores in fp32, as --moe-router-dtype fp32 keeps them; the
permute's and the router's bytes fused or not). Capacity factors and token dropping change the cost and are refused as
not priced; the all-to-all's overlap with the other microbatch (--overlap-moe-expert-parallel-comm) is priced."""


def add_expert_flags(g, *, count: Parse, search: bool) -> None:
    """A MoE model's expert layout (``--expert-model-parallel-size``, ``--expert-tensor-parallel-size``,
    ``--moe-token-dispatcher-type``, ``--moe-grouped-gemm``, ``--moe-shared-expert-overlap``,
    ``--overlap-moe-expert-parallel-comm``) and the routing flags
    priced alike (:data:`MOE_ROUTING_SPELLINGS`); ``search``: the sizes left to be chosen unless given."""
    g.add_argument("--expert-model-parallel-size", type=count, default=None if search else 1,
                   help="ep: ranks that split the experts (E / ep each); it divides --num-experts and, times "
                        "--expert-tensor-parallel-size, the ranks of a pipeline stage")
    g.add_argument("--expert-tensor-parallel-size", type=count, default=None,
                   help="etp: ranks that split each expert's weights (default: " + (
                       "1, and with t > 1 also t, in the plans searched" if search
                       else "--tensor-model-parallel-size, as Megatron-LM") + ")")
    g.add_argument("--moe-token-dispatcher-type", choices=MOE_TOKEN_DISPATCHERS, default=None,
                   help="how tokens reach their experts: allgather (Megatron-LM's default), alltoall, or flex (DeepEP: "
                        "each token crosses the network once per node its experts lie in)" + (
                            " (default alltoall in the plans searched)" if search else ""))
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="one grouped GEMM per expert FC instead of one GEMM per expert" + (
                       " (always on in the plans searched)" if search else ""))
    g.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="the shared expert runs beside the token exchange (alltoall dispatcher), hiding it up to the "
                        "shared expert's compute" + (" (on in the plans searched where it applies)" if search else ""))
    g.add_argument("--overlap-moe-expert-parallel-comm", action="store_true",
                   help="one microbatch's forward merged with another's backward, each token exchange beside the "
                        "other's compute (alltoall or flex, ep > 1; with a pipeline, interleaved)")
    for flag, kw in MOE_ROUTING_SPELLINGS:
        name = flag[2:].replace("-", "_")
        shown = {"metavar": name.upper()} if kw.get("type") is not None else {}  # not the hidden dest's name
        g.add_argument(flag, default=None, dest="_spelling_" + name,
                       help="Megatron's routing flag, accepted as written in a training script: priced alike",
                       **shown, **kw)
