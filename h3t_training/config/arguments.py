"""Command line of ``pretrain_llama.py``: Megatron-LM's flag names plus the h3t-ext flags.

Every check that needs no process group runs here, so a bad flag ends the program with one
Megatron-style line (``pretrain_llama.py: error: --offload-alpha 1.5 is outside [0, 1]``, exit
status 2) before any rank is started.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Optional

from h3t_ext.ckpt import Ckpt, Recompute, combined_ckpt, split_ckpt
from h3t_ext.layout import LayoutError, pipeline_split
from h3t_ext.planner import cli_flags
from h3t_training import megatron_release
from h3t_training.errors import ArgumentError, node_line
from h3t_training.config.flag_table import add_table_flags
from h3t_training.config.h3t_flags import add_h3t_flags
from h3t_training.data.samplers import DATALOADER_TYPES
from h3t_training.data.tokenizer import add_tokenizer_flags


SILENT_RANK_EXIT_DELAY_S = 10.0
"""How long a rank that does not write the error waits before its exit 2. torchrun stops the whole worker group
(SIGTERM) as soon as one worker exits; a silent rank that finished parsing first would have rank 0 stopped before
it wrote the line (seen with 2-8 ranks on a loaded 2-core machine in tests/integration/test_megatron_ci_recipes.py).
Rank 0 parses the same command line in the same time give or take the scheduler's delays (seconds at worst), so
10 s lets it write and exit first; its exit then stops the waiting ranks."""


class OneLineParser(argparse.ArgumentParser):
    """argparse without the usage block on error: one line ``prog: error: message``, exit 2; written only where
    ``report`` is true (rank 0 of a launcher's job: every rank parses the same command line); the other ranks wait
    :data:`SILENT_RANK_EXIT_DELAY_S` before their exit so that the launcher does not stop rank 0 before it has
    written the line."""

    def __init__(self, *args, report: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.report = report

    def error(self, message: str):  # noqa: D401 - argparse API
        if self.report:
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        else:
            time.sleep(SILENT_RANK_EXIT_DELAY_S)
        sys.exit(2)

    def node_error(self, message: str, rank: int):
        """The error of a problem of this node (:class:`~h3t_training.errors.NodeArgumentError`) on a node's first
        rank other than rank 0: written with the host and rank (rank 0's node may not share it), then the silent
        ranks' wait and exit 2."""
        sys.stderr.write(f"{self.prog}: error: {node_line(message, rank)}\n")
        time.sleep(SILENT_RANK_EXIT_DELAY_S)
        sys.exit(2)


def _add_model(p: argparse.ArgumentParser, shape_required: bool) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=shape_required)
    g.add_argument("--hidden-size", type=int, required=shape_required)
    g.add_argument("--num-attention-heads", type=int, required=shape_required)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, required=shape_required)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--padded-vocab-size", type=int, default=None,
                   help="the model's vocabulary rows, in place of the tokenizer's padded to a multiple of "
                        "--make-vocab-size-divisible-by x t (Megatron-LM's; a multiple of t, at least the tokenizer's)")
    g.add_argument("--kv-channels", type=int, default=None, help="head dim (default hidden / heads)")
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    g.add_argument("--rms-norm", dest="normalization", action="store_const", const="RMSNorm",
                   help="Megatron-Kwai's name for --normalization RMSNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--apply-layernorm-1p", action="store_true", help="norm weight stored as (weight - 1), zero-init")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="a norm (--normalization's) over each head's query and key after the QKV projection")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--squared-relu", action="store_true",
                   help="MLP activation relu(x)^2 instead of GeLU (Nemotron); excludes --swiglu")
    g.add_argument("--glu-linear-offset", type=float, default=0.0)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope", "none"), default="learned_absolute",
                   help="none: no positions at all (NoPE; megatron-core's GPTModel adds no embedding and no rotation)")
    g.add_argument("--use-rotary-position-embeddings", dest="position_embedding_type", action="store_const",
                   const="rope", help="older Megatron name for --position-embedding-type rope")
    g.add_argument("--no-position-embedding", action="store_true",
                   help="no learned absolute positions (older Megatron; with --use-rotary-position-embeddings)")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-interleaved", action="store_true")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.x's RoPE frequency scaling (megatron-core's RotaryEmbedding rope_scaling)")
    g.add_argument("--rope-scaling-factor", type=float, default=None,
                   help="its factor (Megatron-LM's default 8.0); needs --use-rope-scaling")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                   help="RoPE linear position interpolation: positions divided by this factor")
    cli_flags.add_window_flags(g)
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--data-parallel-random-init", action="store_true",
                   help="seed each data-parallel replica's generators apart (dropout); weights from the first")
    g.add_argument("--embedding-init-method-std", type=float, default=None,
                   help="std of the word (and learned position) embeddings' normal init (default --init-method-std)")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true", help="float16 on a GPU, with dynamic loss scaling")
    g.add_argument("--h3t-float64", action="store_true",
                   help="CPU only: parameters, activations, gradients, pipeline transfers and the loss in float64 "
                        "(equivalence checks that must tell roundoff from a bug)")
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (fp16); default dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)


def _add_parallel(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (left-out values are filled by --auto-plan)")
    cli_flags.add_parallel_size_flags(g, count=int, default=None)
    cli_flags.add_virtual_pipeline_flags(g, count=int, uneven=True)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="overlap the data-parallel gradient reduce with backward (megatron-core DDP buckets, GPU)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="overlap the distributed optimizer's parameter all-gather with forward (GPU)")
    g.add_argument("--overlap-p2p-communication", dest="overlap_p2p_comm", action="store_true", default=True,
                   help="Megatron-Kwai's switch for what Megatron-LM and this driver do by default: an interleaved "
                        "pipeline posts each receive one compute before the compute that needs it "
                        "(megatron-core's overlap_p2p_comm)")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="shard parameters, gradients and optimizer states over the data-parallel group with torch "
                        "FSDP2 (megatron-core's TorchFullyShardedDataParallel; p=1, no distributed optimizer)")
    g.add_argument("--torch-fsdp2-no-reshard-after-forward", action="store_false",
                   dest="torch_fsdp2_reshard_after_forward",
                   help="FSDP2 keeps each layer's gathered parameters from its forward to its backward")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="Megatron FSDP (megatron-core's FullyShardedDataParallel; GPU only, with "
                        "--use-distributed-optimizer)")
    g.add_argument("--data-parallel-sharding-strategy", default=None,
                   choices=("no_shard", "optim", "optim_grads", "optim_grads_params"),
                   help="Megatron FSDP's sharding (with --use-megatron-fsdp): optimizer state, also gradients, also "
                        "parameters (default: the installed megatron-core's Megatron-LM's, optim_grads_params from "
                        "0.18, no_shard before)")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None)
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--strict-p2p", action="store_true",
                   help="pipeline sends/receives on gloo follow NCCL's semantics (batches in order, a send waits "
                        "for the peer's receive), so a posting order that would deadlock on GPUs fails here too")
    g.add_argument("--strict-p2p-comm", choices=("group", "pair"), default="group",
                   help="NCCL communicator mapping --strict-p2p emulates: one per process group (stricter) or one "
                        "per rank pair")


LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
"""Megatron-LM's --lr-decay-style choices (h3t_training.loop.param_schedule runs each)."""
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
"""... its --lr-wsd-decay-style choices (the annealing of WSD; exponential is Megatron-LM's default)."""
WD_INCR_STYLES = ("constant", "linear", "cosine")
"""... its --weight-decay-incr-style choices."""


def _add_training(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batch and optimizer")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per iteration (required unless --step-batch-size-schedule gives them)")
    g.add_argument("--step-batch-size-schedule", default=None,
                   help="Megatron's 'THRESHOLD:BATCH_SIZE ...' (thresholds in tokens, K/M/B/T suffixes)")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="ramp the batch size from START to --global-batch-size (megatron-core 0.16)")
    g.add_argument("--decrease-batch-size-if-needed", action="store_true",
                   help="round --global-batch-size down to a multiple of micro batch x data-parallel size")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None, help="train for this many samples (not --train-iters)")
    g.add_argument("--optimizer", choices=("adam",), default="adam")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="peak learning rate of the embedding and output layer (their own group, as Megatron)")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="minimum learning rate of that group (default --min-lr)")
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="linear")
    g.add_argument("--lr-wsd-decay-style", choices=WSD_DECAY_STYLES, default="exponential",
                   help="the annealing of --lr-decay-style WSD")
    g.add_argument("--lr-wsd-decay-iters", type=int, default=None,
                   help="iterations of the WSD annealing (the last of the decay span)")
    g.add_argument("--lr-wsd-decay-samples", type=int, default=None,
                   help="samples of the WSD annealing (with --train-samples)")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None, help="warm-up as a fraction of the decay span")
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="gradients of the token-weighted mean loss over the global batch (Megatron's default weighs "
                        "each microbatch's mean loss alike); the logged loss is token-weighted either way")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None,
                   help="weight decay at the start (with a non-constant --weight-decay-incr-style)")
    g.add_argument("--end-weight-decay", type=float, default=None,
                   help="weight decay at the end of training (with a non-constant --weight-decay-incr-style)")
    g.add_argument("--weight-decay-incr-style", choices=WD_INCR_STYLES, default="constant",
                   help="constant --weight-decay, or from --start- to --end-weight-decay over the training")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="megatron-core's precision-aware optimizer (GPU: TransformerEngine's FusedAdam; needs "
                        "--use-distributed-optimizer)")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="keep the optimizer's fp32 master weights and Adam states of --optimizer-offload-fraction "
                        "of the parameters in host memory and step them there (needs --use-precision-aware-optimizer)")
    g.add_argument("--optimizer-offload-fraction", type=float, default=None, metavar="F",
                   help="fraction in [0, 1] of the optimizer's elements offloaded (default 1.0, as Megatron-LM)")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true",
                   help="offloaded parameters copied in, stepped and copied back one at a time (overlapped on GPU)")
    g.add_argument("--use-torch-optimizer-for-cpu-offload", action="store_true",
                   help="megatron-core's option of that name (GPU); on CPU both partitions use torch's AdamW")
    g.add_argument("--no-pin-cpu-grads", action="store_false", dest="pin_cpu_grads",
                   help="host gradient copies in pageable memory (GPU)")
    g.add_argument("--no-pin-cpu-params", action="store_false", dest="pin_cpu_params",
                   help="host parameter copies in pageable memory (GPU)")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=True,
                   help="stop with one line at a non-finite loss or gradient norm (the default)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false",
                   dest="check_for_nan_in_loss_and_grad", help="go on past non-finite values")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--check-weight-hash-across-dp-replicas-interval", type=int, default=None, metavar="N",
                   help="every N iterations, stop with one line when data-parallel replicas hold different weights")
    g.add_argument("--rerun-mode", choices=("disabled", "validate_results", "report_stats"), default=None,
                   help="Megatron-LM's rerun state machine (its default: validate_results, which re-runs an iteration "
                        "whose loss check fails); this driver has none and stops at a non-finite loss instead, the "
                        "same run without a fault: validate_results and report_stats given are a notice")
    g = p.add_argument_group("activation memory")
    cli_flags.add_recompute_flags(g, count=int, full_method=True)
    add_h3t_flags(g)
    cli_flags.add_megatron_offload_flags(g, nonnegative=int, fraction=float)
    g.add_argument("--auto-plan", action="store_true",
                   help="let the planner fill every parallel and memory flag left out, and print its plan")
    g.add_argument("--gpu", default=None, help="system name of the cost model (auto-plan, MFU peak)")
    g.add_argument("--memory-budget", default=None, help="bytes per GPU for --auto-plan / --offload-alpha auto")


def _add_data_io(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None, help="[weight] prefix ... of indexed .bin/.idx")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--train-data-path", nargs="+", default=None, help="[weight] prefix ... of the training split")
    g.add_argument("--valid-data-path", nargs="+", default=None, help="[weight] prefix ... of the validation split")
    g.add_argument("--test-data-path", nargs="+", default=None, help="[weight] prefix ... of the test split")
    g.add_argument("--data-args-path", default=None,
                   help="a file whose whitespace-separated words are the --data-path list (Megatron-LM's; needs "
                        "--split)")
    g.add_argument("--per-split-data-args-path", default=None,
                   help="a JSON file {\"train\": ..., \"valid\": ..., \"test\": ...} holding the --train-data-path, "
                        "--valid-data-path and --test-data-path lists (each a list, one string, or null)")
    g.add_argument("--split", default=None,
                   help="train,valid,test shares of --data-path (default as Megatron-LM: 969,30,1 with --data-path, "
                        "1,1,1 with --mock-data)")
    add_tokenizer_flags(g)
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="position ids restart after each end of document (learned absolute positions read them; "
                        "RoPE does not, as in Megatron-LM)")
    g.add_argument("--dataloader-type", default="single", choices=(*DATALOADER_TYPES, "external"),
                   help="single: the split in order; cyclic: each data-parallel rank's bucket of it in a fresh random "
                        "order every epoch (Megatron-LM's samplers)")
    g.add_argument("--no-data-sharding", action="store_false", dest="data_sharding",
                   help="with cyclic: one permutation over all ranks (not implemented; refused)")
    g = p.add_argument_group("checkpointing and logging")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--pretrained-checkpoint", default=None,
                   help="where --load holds no checkpoint, finetune from this one (as --finetune: its weights, "
                        "iteration 0); once --load holds one, runs resume from it")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--ckpt-format", default="torch_dist",
                   help="checkpoint format: torch_dist (megatron-core dist_checkpointing, resharding on load) or "
                        "torch (Megatron-LM's legacy mp_rank_XX[_YYY] files, loaded at the same t/p/v)")
    g.add_argument("--ckpt-step", type=int, default=None, help="load this iteration instead of the tracker's")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's flags from the args saved with the checkpoint in --pretrained-checkpoint, "
                        "then --load, as Megatron-LM does (the shape flags may then be left out)")
    g.add_argument("--use-mp-args-from-checkpoint-args", action="store_true",
                   help="with --use-checkpoint-args: the tensor- and pipeline-parallel sizes too")
    g.add_argument("--no-use-tokenizer-model-from-checkpoint-args",
                   "--disable-use-tokenizer-model-from-checkpoint-args", action="store_false",
                   dest="use_tokenizer_model_from_checkpoint_args",
                   help="with --use-checkpoint-args: keep this command line's --tokenizer-type and --tokenizer-model")
    g.add_argument("--finetune", action="store_true",
                   help="load the model only; start at iteration 0 with a fresh optimizer and RNG")
    g.add_argument("--no-load-optim", action="store_true", help="do not load the optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load the RNG states")
    g.add_argument("--no-save-optim", action="store_true",
                   help="checkpoints without the optimizer state (a resume then needs --no-load-optim)")
    g.add_argument("--no-save-rng", action="store_true",
                   help="checkpoints without the RNG states (a resume then needs --no-load-rng)")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: exit (status 0, as Megatron-LM) instead of training from scratch when it holds "
                        "no checkpoint")
    g.add_argument("--async-save", action="store_true", help="accepted; this driver saves synchronously")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on resume, use this command line's learning-rate schedule over the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="on resume, use the checkpoint's learning-rate schedule over this command line's")
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--iterations-to-skip", nargs="+", type=int, default=[],
                   help="iterations to skip entirely: their batches are read past, nothing is trained and the "
                        "learning-rate schedule does not advance (Megatron-LM's; 0.17+ count them as logged, 1-based, "
                        "0.16 by the iterations done before them)")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and exit after this many minutes")
    g.add_argument("--exit-signal-handler", action="store_true", help="on --exit-signal: save and exit")
    g.add_argument("--exit-signal", default="SIGTERM", choices=("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"))
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--log-throughput", action="store_true", help="the log line always shows throughput")
    g.add_argument("--log-params-norm", action="store_true",
                   help="log the L2 norm of the parameters after each step (Megatron-LM's params norm)")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="log the zero elements of each step's gradients (Megatron-LM's num zeros)")
    g.add_argument("--metrics-json", default=None, metavar="PATH")
    g.add_argument("--no-progress-bar", action="store_true")


def _add_eval_and_logging(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-interval", type=int, default=1000, help="evaluate on the validation split every N iterations")
    g.add_argument("--eval-iters", type=int, default=100, help="iterations per evaluation (0: no evaluation)")
    g.add_argument("--skip-train", action="store_true", help="evaluate only (validation, then test)")
    g.add_argument("--eval-global-batch-size", type=int, default=None,
                   help="samples per evaluation iteration (default --global-batch-size)")
    g.add_argument("--eval-micro-batch-size", type=int, default=None,
                   help="samples per evaluation microbatch (default --micro-batch-size)")
    g.add_argument("--start-eval-at-iter", type=int, default=None,
                   help="evaluate at the interval only from this iteration on")
    g = p.add_argument_group("TensorBoard and wandb (written by the last rank)")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true")
    g.add_argument("--no-log-loss-scale-to-tensorboard", "--disable-log-loss-scale-to-tensorboard", action="store_false",
                   dest="log_loss_scale_to_tensorboard")
    g.add_argument("--no-log-learnig-rate-to-tensorboard", "--no-log-learning-rate-to-tensorboard",
                   action="store_false", dest="log_learning_rate_to_tensorboard")
    g.add_argument("--wandb-project", default=None)
    g.add_argument("--wandb-exp-name", default=None)
    g.add_argument("--wandb-save-dir", default=None)
    g.add_argument("--wandb-entity", default=None)


LLAMA_DEFAULTS = dict(normalization="RMSNorm", swiglu=True, untie_embeddings_and_output_weights=True,
                      position_embedding_type="rope", disable_bias_linear=True, hidden_dropout=0.0,
                      attention_dropout=0.0, lr_decay_style="cosine")
"""pretrain_llama.py's defaults (a Llama); pretrain_gpt.py keeps Megatron-LM's (the parser's own)."""
MEGATRON_GPT_DEFAULTS = dict(tokenizer_type="GPT2BPETokenizer")
"""What Megatron-LM's pretrain_gpt.py sets beyond its parser's defaults (``args_defaults``)."""
MEGATRON_REQUIRED = ("max_position_embeddings",)
"""Required by Megatron-LM's ``validate_args`` beyond the flags this parser requires (its ``required_args``, checked
with ``_check_arg_is_not_none`` in core_v0.16.1 and core_v0.19.0, and in Megatron-Kwai's): pretrain_gpt.py asks for
them as Megatron-LM does, so a script that would stop there stops here too; pretrain_llama.py, this project's Llama
entry point, fills ``--max-position-embeddings`` with ``--seq-length``."""


def missing_megatron_required(args) -> Optional[str]:
    """The one-line error for pretrain_gpt.py's command line without a flag Megatron-LM requires, else None."""
    missing = ["--" + k.replace("_", "-") for k in MEGATRON_REQUIRED if getattr(args, k) is None]
    if not missing:
        return None
    return (f"the following arguments are required: {', '.join(missing)} (Megatron-LM's pretrain_gpt.py requires "
            f"{'it' if len(missing) == 1 else 'them'}; pretrain_llama.py fills --max-position-embeddings with "
            f"--seq-length)")


def build_parser(prog: str = "pretrain_llama.py", defaults: Optional[dict] = None, *,
                 report: bool = True, shape_required: bool = True) -> OneLineParser:
    """The parser with every flag the driver accepts (and every other flag of the flag table); ``report``: whether
    its one-line error is written here (rank 0) or only the exit status is given (other ranks);
    ``shape_required``: whether the model's shape flags must be given (not under ``--use-checkpoint-args``)."""
    p = OneLineParser(prog=prog, description="Pretrain a GPT model with Megatron-core and h3t-ext.",
                      allow_abbrev=False, report=report)
    _add_model(p, shape_required)
    _add_parallel(p)
    _add_training(p)
    _add_data_io(p)
    _add_eval_and_logging(p)
    if defaults:
        p.set_defaults(**defaults)
    add_table_flags(p)
    return p


def fill_model_defaults(args):
    """Megatron's derived model sizes where the flags leave them open."""
    changes = {}
    if args.num_query_groups is None or not args.group_query_attention:
        if args.num_query_groups is not None and not args.group_query_attention:
            raise ArgumentError("--num-query-groups needs --group-query-attention")
        changes["num_query_groups"] = args.num_attention_heads
    if args.ffn_hidden_size is None:  # Megatron's: a SwiGLU MLP keeps about the parameters of a 4h GeLU one
        changes["ffn_hidden_size"] = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu \
            else 4 * args.hidden_size
    if args.kv_channels is None:
        changes["kv_channels"] = args.hidden_size // args.num_attention_heads
    if args.max_position_embeddings is None:
        changes["max_position_embeddings"] = args.seq_length
    return args.replace(**changes)


def check_finite(args):
    """Every number a flag took is finite (float() accepts 'inf' and 'nan')."""
    for name, v in sorted(args.as_dict().items()):
        if isinstance(v, float) and not math.isfinite(v):
            raise ArgumentError(f"--{name.replace('_', '-')} {v} is not a finite number")
    return args


SEED_MAX = 2**32 - 1
"""Largest ``--seed``: NumPy's generators (Megatron's dataset shuffles) take seeds in [0, 2**32 - 1]; torch's
would overflow above 2**64."""


def check_positive(args):
    """Sizes, rates and probabilities in their ranges."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                 "seq_length", "max_position_embeddings", "global_batch_size", "train_iters", "log_interval",
                 "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "context_parallel_size", "micro_batch_size",
                 "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                 "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "save_interval",
                 "exit_interval",
                 "make_vocab_size_divisible_by", "padded_vocab_size", "recompute_num_layers", "vocab_size", "kv_channels",
                 "eval_interval",
                 "eval_global_batch_size", "eval_micro_batch_size",
                 "tensorboard_log_interval", "tensorboard_queue_size", "lr_decay_iters", "lr_decay_samples",
                 "rotary_seq_len_interpolation_factor"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} {v} is outside [1, inf)")
    if args.decoupled_lr is not None and not args.decoupled_lr > 0:
        raise ArgumentError(f"--decoupled-lr {args.decoupled_lr} is outside (0, inf)")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        raise ArgumentError("--decoupled-min-lr needs --decoupled-lr (it is the floor of that group's schedule)")
    if args.decoupled_min_lr is not None and args.decoupled_min_lr < 0:
        raise ArgumentError(f"--decoupled-min-lr {args.decoupled_min_lr} is outside [0, inf)")
    for name in ("lr", "adam_eps", "distributed_timeout_minutes"):
        v = getattr(args, name)
        if not v > 0:
            raise ArgumentError(f"--{name.replace('_', '-')} {v} is outside (0, inf)")
    if args.exit_duration_in_mins is not None and not args.exit_duration_in_mins >= 0:
        raise ArgumentError(f"--exit-duration-in-mins {args.exit_duration_in_mins} is outside [0, inf) (0: no "
                            f"limit, as in Megatron-LM)")
    for name in ("min_lr", "weight_decay", "clip_grad", "init_method_std", "lr_warmup_iters", "lr_warmup_samples",
                 "eval_iters", "start_eval_at_iter", "embedding_init_method_std"):
        v = getattr(args, name)
        if v is not None and v < 0:
            raise ArgumentError(f"--{name.replace('_', '-')} {v} is outside [0, inf)")
    for name in ("min_lr", "lr_warmup_init"):  # megatron-core's scheduler asserts min_lr <= lr and init_lr <= lr
        v = getattr(args, name)
        if not 0 <= v <= args.lr:
            raise ArgumentError(f"--{name.replace('_', '-')} {v} is outside [0, --lr {args.lr}]")
    if not 0 <= args.seed <= SEED_MAX:
        raise ArgumentError(f"--seed {args.seed} is outside [0, {SEED_MAX}]")
    for name in ("norm_epsilon", "rotary_base"):
        v = getattr(args, name)
        if not v > 0:
            raise ArgumentError(f"--{name.replace('_', '-')} {v} is outside (0, inf)")
    if not 0 < args.rotary_percent <= 1:
        raise ArgumentError(f"--rotary-percent {args.rotary_percent} is outside (0, 1]")
    for name in ("adam_beta1", "adam_beta2", "hidden_dropout", "attention_dropout"):
        v = getattr(args, name)
        if not 0 <= v < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} {v} is outside [0, 1)")
    return args


def recompute_of(args) -> Recompute:
    """Megatron's --recompute-* flags as one :class:`~h3t_ext.ckpt.Recompute` (ArgumentError, one line, on bad
    values); ``--recompute-activations`` is ``--recompute-granularity selective``."""
    try:
        granularity = cli_flags.recompute_granularity_of(args.recompute_granularity, args.recompute_activations)
        return Recompute.parse(granularity, args.recompute_method, args.recompute_num_layers, args.recompute_modules)
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def resolve_ckpt(args):
    """Megatron's --recompute-* flags and --ckpt: ``ckpt`` becomes the one :class:`Ckpt` that names both (``full``
    for full/uniform/1 without --ckpt ours) and ``recompute`` Megatron's record; one line where they contradict
    (--ckpt full with other recompute flags, --ckpt ours with full uniform or with full block over every layer
    of a model chunk), or where uniform's N does not divide a model chunk's layers."""
    recompute = recompute_of(args)
    try:
        base, recompute = split_ckpt(args.ckpt or "no", recompute)
        chunks = _chunk_layers(args)
        for chunk in chunks:
            recompute.units(chunk)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    whole = [chunk for chunk in chunks if recompute.full and recompute.num_layers >= chunk]
    if base is Ckpt.OURS and whole:
        raise ArgumentError(f"--ckpt ours contradicts --recompute-method block --recompute-num-layers "
                            f"{recompute.num_layers} (every one of the {whole[0]} layers of a model chunk is "
                            "recomputed whole); use fewer layers or leave --ckpt ours out")
    ckpt = combined_ckpt(base, recompute) if (args.ckpt is not None or recompute.granularity) else None
    return args.replace(ckpt=ckpt, recompute=recompute)


def _chunk_layers(args) -> tuple[int, ...]:
    """The layer counts of the model chunks (Megatron's split: uneven first/last stages and --account-for-* make
    several) when the flags fix them, else none (--auto-plan picks later; a bad split is refused by validation)."""
    p = args.pipeline_model_parallel_size
    if p is None or args.num_layers is None:
        return ()
    try:
        split = pipeline_split(args.num_layers, p, args.num_layers_per_virtual_pipeline_stage, **split_flags(args))
    except LayoutError:
        return ()
    v = split.virtual_pipeline_model_parallel_size
    return tuple(sorted({n for r in range(p) for c in range(v) if (n := split.chunk_layers(r, c)) > 0}))


def split_flags(args) -> dict:
    """Megatron's flags of the layer split beyond --num-layers-per-virtual-pipeline-stage, as
    :func:`h3t_ext.layout.pipeline_split` takes them."""
    return dict(num_virtual_stages_per_pipeline_rank=args.num_virtual_stages_per_pipeline_rank,
                decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
                decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
                account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
                account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
                pipeline_model_parallel_layout=args.pipeline_model_parallel_layout)


def apply_padded_vocab_size(args):
    """``--padded-vocab-size P``: the model has P vocabulary rows, as Megatron-LM builds it (its ``build_tokenizer``
    pads only where P is None). Said as the padding that gives exactly P at this run's tensor-parallel size t
    (``--make-vocab-size-divisible-by P / t``: the tokenizer's V rounds up to P when V <= P), so every reader of the
    padding (model, checkpoints, the cost model) has P. A P below V would leave tokens without a row, a P that t
    does not divide has no equal vocabulary shards (megatron-core asserts): one line each."""
    p = args.padded_vocab_size
    if p is None:
        return args
    v, t = args.tokenizer_vocab_size, args.tensor_model_parallel_size
    if p < v:
        raise ArgumentError(f"--padded-vocab-size {p} is below the tokenizer's {v} tokens; valid: a multiple of "
                            f"--tensor-model-parallel-size {t} in [{v}, inf)")
    if p % t:
        raise ArgumentError(f"--padded-vocab-size {p} is not a multiple of --tensor-model-parallel-size {t} (the "
                            f"vocabulary is split into t equal shards)")
    return args.replace(make_vocab_size_divisible_by=p // t)


def resolve_iterations_to_skip(args):
    """``--iterations-to-skip`` as the logged iterations it skips in the installed megatron-core's Megatron-LM
    (:func:`h3t_training.megatron_release.skipped_iterations`); a value no iteration can have is one line."""
    release = megatron_release.installed_megatron_core()
    low = megatron_release.first_skippable(release)
    for v in args.iterations_to_skip:
        if v < low:
            raise ArgumentError(f"--iterations-to-skip {v} is outside [{low}, inf) (Megatron-LM "
                                f"{release[0]}.{release[1]} counts iterations from {low})")
    return args.replace(skipped_iterations=megatron_release.skipped_iterations(args.iterations_to_skip, release))


def fill_parallel_defaults(args):
    """The layout's defaults where neither the flags nor ``--auto-plan`` set it."""
    defaults = (("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1), ("context_parallel_size", 1),
                ("micro_batch_size", 1), ("ckpt", "no"), ("offload_alpha", "0"))
    args = args.replace(**{name: default for name, default in defaults if getattr(args, name) is None})
    return args.replace(ckpt=Ckpt.parse(args.ckpt))
