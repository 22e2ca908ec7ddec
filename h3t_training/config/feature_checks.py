"""Resolve steps of the driver's optional run features: the flags' ranges and the combinations Megatron-LM allows,
each problem one :class:`~h3t_training.errors.ArgumentError` line. The features themselves run in
``loop/``: optimizer CPU offload (``loop/optimizer_offload.py``), FSDP2 (``loop/fsdp.py``), the weight-hash check
across data-parallel replicas (``loop/sdc_guards.py``), the TensorBoard and W&B writers (``telemetry/loggers.py``)."""
from __future__ import annotations

import functools
import importlib.util
import os
from typing import Optional

from h3t_ext.planner.translate import MEGATRON_FSDP_CKPT_FORMAT
from h3t_ext.planner.launch_env import CONNECTIONS_VAR, connections_refusal
from h3t_training.config.flag_table import TE_MISSING, given_table_flags
from h3t_training.errors import ArgumentError, NodeArgumentError


def cuda_available() -> bool:
    """A CUDA device is present (the one probe of the driver's flag checks; tests replace it to act as a GPU host)."""
    import torch

    return torch.cuda.is_available()


def transformer_engine_available() -> bool:
    """TransformerEngine is importable (the one probe of the driver's layer spec and GPU flag checks; tests
    replace it): :func:`transformer_engine_problem` finds nothing."""
    return transformer_engine_problem() is None


@functools.lru_cache(maxsize=1)
def transformer_engine_problem() -> Optional[str]:
    """Why this process cannot use TransformerEngine, in words that follow :data:`TE_MISSING`'s place in a line, or
    None. Read once, and only by GPU runs: not installed (:data:`TE_MISSING`), or installed with a PyTorch module
    that fails to import (an extension built for another torch or CUDA is the common case), which megatron-core would
    meet later in a traceback, so the failure's first line is named."""
    if importlib.util.find_spec("transformer_engine") is None:
        return TE_MISSING
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as e:  # noqa: BLE001 - an extension's import fails in many ways (ImportError, OSError, ...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return (f"TransformerEngine is installed here but does not import ({type(e).__name__}"
                f"{': ' + first if first else ''})")
    return None


def transformer_engine_reason() -> str:
    """Why a GPU run goes without TransformerEngine, for its refusals: :func:`transformer_engine_problem`, or
    :data:`TE_MISSING` where the availability probe was replaced (tests)."""
    return transformer_engine_problem() or TE_MISSING


def uses_gpu(args) -> bool:
    """True when this run trains on CUDA devices (a GPU is present and the backend is not gloo)."""
    return cuda_available() and args.distributed_backend != "gloo"


def cuda_compute_capability() -> float:
    """This process's GPU's compute capability as ``major.minor`` (9.0 for Hopper, 8.9 for Ada; the driver's third
    probe, which the FP8 and launch-environment rules read; tests replace it)."""
    import torch

    major, minor = torch.cuda.get_device_capability()
    return major + minor / 10


def cuda_device_count() -> int:
    """The CUDA devices this process sees (the driver's fourth probe; tests replace it)."""
    import torch

    return torch.cuda.device_count()


def gpu_slots_refusal(ranks_per_node: int, device_count: int) -> Optional[str]:
    """Why ``ranks_per_node`` ranks of a GPU run cannot start on a node that shows ``device_count`` CUDA devices, or
    None: each rank takes the device of its local rank, and NCCL refuses two ranks on one device (the rank past the
    last device would stop in a traceback at ``torch.cuda.set_device``, Megatron-LM's too)."""
    if ranks_per_node <= device_count:
        return None
    return (f"the launcher starts {ranks_per_node} ranks on this node but it shows {device_count} CUDA device"
            f"{'s' if device_count != 1 else ''} (NCCL takes one GPU per rank): start at most {device_count} per node "
            f"(torchrun --nproc-per-node {device_count}, mpirun --npernode {device_count}) or make more GPUs "
            f"visible (CUDA_VISIBLE_DEVICES)")


def check_gpu_slots(args):
    """:func:`gpu_slots_refusal` of a GPU run (a resolve step; a CPU run's gloo ranks share the host, and one rank
    needs only the device that made ``uses_gpu`` true)."""
    if uses_gpu(args) and args.ranks_per_node > 1:
        refusal = gpu_slots_refusal(args.ranks_per_node, cuda_device_count())
        if refusal:
            raise NodeArgumentError(refusal)  # nodes may differ
    return args


def cuda_connections_refusal(args, value: Optional[str], arch_major: Optional[int]) -> Optional[str]:
    """Why Megatron-LM would not start this GPU run with ``CUDA_DEVICE_MAX_CONNECTIONS`` at ``value`` (None: unset)
    on a GPU of compute capability ``arch_major``.x (None: not read, the run has neither tensor nor context
    parallelism), or None: :func:`h3t_ext.planner.launch_env.connections_refusal` (the rule the planner prints)."""
    fsdp = "--use-megatron-fsdp" if args.use_megatron_fsdp else "--use-torch-fsdp2" if args.use_torch_fsdp2 else None
    sizes = (("--tensor-model-parallel-size", args.tensor_model_parallel_size),  # None: not filled yet (--auto-plan's
             ("--context-parallel-size", args.context_parallel_size))            # ladder asks before the sizes are)
    return connections_refusal(value, sizes=sizes, fsdp_flag=fsdp, arch_major=arch_major)


def check_cuda_connections(args):
    """:func:`cuda_connections_refusal` of a GPU run's launch environment (a resolve step, after the parallel sizes
    are filled; the CPU path has no such setting)."""
    if uses_gpu(args):
        parallel = args.tensor_model_parallel_size > 1 or args.context_parallel_size > 1
        refusal = cuda_connections_refusal(args, os.environ.get(CONNECTIONS_VAR),
                                           int(cuda_compute_capability()) if parallel else None)
        if refusal and args.auto_plan_flags is not None and not args.use_megatron_fsdp:
            refusal += (" (the sizes of the plan --auto-plan chose; or give --tensor-model-parallel-size 1 "
                        "--context-parallel-size 1 to keep its search to plans without)")
        if refusal:
            raise NodeArgumentError(refusal)  # a multi-node torchrun sets the variable node by node
    return args


def check_optimizer_offload(args):
    """The flags' range and Megatron-LM's rules for combining them (a resolve step; one line per problem).

    ``--optimizer-cpu-offload`` needs ``--use-precision-aware-optimizer`` (Megatron-LM's arguments.py: "the
    hybrid device optimizer reuses the code path of this flag"), which needs ``--use-distributed-optimizer``
    (megatron-core's ``OptimizerConfig``). The other offload flags without ``--optimizer-cpu-offload`` have no
    effect in Megatron-LM; here they get a notice saying so."""
    f = args.optimizer_offload_fraction
    if f is not None and not (isinstance(f, float) and 0.0 <= f <= 1.0):  # nan fails the comparison too
        raise ArgumentError(f"--optimizer-offload-fraction {f} is outside [0, 1]")
    if args.use_precision_aware_optimizer and not args.use_distributed_optimizer:
        raise ArgumentError("--use-precision-aware-optimizer needs --use-distributed-optimizer "
                            "(megatron-core's OptimizerConfig)")
    if args.optimizer_cpu_offload and not args.use_precision_aware_optimizer:
        raise ArgumentError("--optimizer-cpu-offload needs --use-precision-aware-optimizer (as Megatron-LM: the "
                            "hybrid device optimizer reuses that flag's code path) and --use-distributed-optimizer")
    if args.optimizer_cpu_offload:
        return args
    idle = [flag for flag, on in (("--optimizer-offload-fraction", f is not None),
                                  ("--overlap-cpu-optimizer-d2h-h2d", args.overlap_cpu_optimizer_d2h_h2d),
                                  ("--use-torch-optimizer-for-cpu-offload", args.use_torch_optimizer_for_cpu_offload),
                                  ("--no-pin-cpu-grads", not args.pin_cpu_grads),
                                  ("--no-pin-cpu-params", not args.pin_cpu_params)) if on]
    if not idle:
        return args
    return args.replace(flag_notices=(*args.flag_notices, f"note: {', '.join(idle)}: no effect without "
                                                          "--optimizer-cpu-offload (as in Megatron-LM)"))


MEGATRON_FSDP_CPU_REASON = ("megatron-core 0.16.1's MegatronFSDP needs CUDA (its adapter takes torch.cuda.current_device() "
                            "and a 'cuda' device mesh, MegatronFSDP creates torch.cuda streams)")
"""Why Megatron FSDP cannot run on the CPU path (gloo)."""


def check_megatron_fsdp(args) -> None:
    """``--use-megatron-fsdp`` and ``--data-parallel-sharding-strategy`` as Megatron-LM takes them, one line per
    problem (:func:`megatron_fsdp_refusal`). A sharding strategy other than ``no_shard`` without
    ``--use-megatron-fsdp`` is refused (Megatron-LM ignores it there: a user who asks for sharding must not get a
    run without it)."""
    strategy = args.data_parallel_sharding_strategy
    if not args.use_megatron_fsdp:
        if strategy != "no_shard":
            raise ArgumentError(f"--data-parallel-sharding-strategy {strategy} is Megatron FSDP's and needs "
                                "--use-megatron-fsdp (without it Megatron-LM shards nothing; "
                                "--use-distributed-optimizer shards the optimizer state, as optim does)")
        return
    refusal = megatron_fsdp_refusal(args)
    if refusal is not None:
        raise ArgumentError(refusal)


def megatron_fsdp_refusal(args) -> Optional[str]:
    """Why this run cannot take ``--use-megatron-fsdp`` (one line), or None: refused on the CPU path
    (:data:`MEGATRON_FSDP_CPU_REASON`); on a GPU run through megatron-core's ``FullyShardedDataParallel`` adapter
    (``loop/gpu_wrap.py``) under the combinations that adapter and Megatron-LM allow. The one rule of
    :func:`check_megatron_fsdp` and of the options ``--auto-plan`` may choose (``auto_plan.runnable_ladder``)."""
    if not uses_gpu(args):
        return (f"--use-megatron-fsdp is not supported: {MEGATRON_FSDP_CPU_REASON}, and this run has no GPU (on a GPU "
                "it runs through megatron-core's FullyShardedDataParallel; on CPU use --use-torch-fsdp2, or "
                "--use-distributed-optimizer for optim)")
    tuning = sorted(e.flag for e in given_table_flags(args) if e.key == "fsdp" and e.flag.startswith(
        ("--megatron-fsdp-", "--fsdp-", "--enable-full-sharding-in-hsdp", "--outer-dp-sharding-strategy",
         "--no-use-layer-wise-param-layout")))
    clashes = [(args.use_torch_fsdp2, "--use-torch-fsdp2 (one sharded data parallelism at a time)"),
               (not args.use_distributed_optimizer,
                "no --use-distributed-optimizer (megatron-core steps Megatron FSDP's sharded buffers only with its "
                "DistributedOptimizer; give --use-distributed-optimizer)"),
               (args.optimizer_cpu_offload, "--optimizer-cpu-offload (megatron-core's HybridDeviceOptimizer steps the "
                                            "distributed optimizer's buffers, not Megatron FSDP's)"),
               (args.save is not None, "--save (Megatron-LM saves Megatron FSDP only as --ckpt-format fsdp_dtensor, "
                                       "which this driver does not write; train without --save)"),
               *((path is not None, f"{flag} (Megatron FSDP's parameters load only from --ckpt-format fsdp_dtensor, "
                                     "which this driver does not read)")
                 for flag, path in (("--load", args.load), ("--pretrained-checkpoint", args.pretrained_checkpoint))),
               (bool(tuning), f"{', '.join(tuning)} (a Megatron FSDP tuning setting this driver does not pass to "
                              "megatron-core; leave it out)")]
    clash = next((f"--use-megatron-fsdp is not supported with {what}" for clash, what in clashes if clash), None)
    if clash is None:  # the launch environment (what --auto-plan's ladder reads too)
        clash = cuda_connections_refusal(args, os.environ.get(CONNECTIONS_VAR), None)
    if clash is None and args.ckpt_format != MEGATRON_FSDP_CKPT_FORMAT:
        return (f"--use-megatron-fsdp needs --ckpt-format {MEGATRON_FSDP_CKPT_FORMAT} (got {args.ckpt_format}): "
                "Megatron-LM runs Megatron FSDP with no other checkpoint format, and this driver keeps the same "
                "command line valid (it writes no checkpoint of such a run, so the format changes nothing here)")
    return clash


def check_sharding_flags(args):
    """Megatron FSDP's flags and ``--use-torch-fsdp2``'s combinations checked (a resolve step; one line naming the
    flags). Runs after the parallel sizes are filled."""
    check_megatron_fsdp(args)
    if not args.torch_fsdp2_reshard_after_forward and not args.use_torch_fsdp2:
        raise ArgumentError("--torch-fsdp2-no-reshard-after-forward needs --use-torch-fsdp2")
    if not args.use_torch_fsdp2:
        return args
    clashes = [(args.pipeline_model_parallel_size > 1,
                f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size} (pipeline parallelism)"),
               (args.use_distributed_optimizer, "--use-distributed-optimizer (megatron-core's distributed optimizer)"),
               (args.optimizer_cpu_offload, "--optimizer-cpu-offload (it needs the distributed optimizer)"),
               (not args.untie_embeddings_and_output_weights,
                "tied embedding and output weights (give --untie-embeddings-and-output-weights)"),
               (args.fp16, "--fp16"),
               (args.calculate_per_token_loss,
                "--calculate-per-token-loss (megatron-core's torch FSDP2 does not scale its gradients by the token "
                "count: its scale_gradients is a no-op, so the gradients would be sums)"),
               (uses_gpu(args) and args.save is not None,
                "--save on a GPU (megatron-core's optimizer there maps its Adam state to one ShardedTensor per "
                "parameter, not to the row pieces of FSDP2's shards that the CPU path saves; train without --save)")]
    clashes.append((uses_gpu(args) and args.load is not None and not (args.finetune or args.no_load_optim),
                    "--load of the optimizer state on a GPU (the whole-parameter Adam state is sharded into the CPU "
                    "path's optimizer only; give --no-load-optim or --finetune)"))
    for clash, what in clashes:
        if clash:
            raise ArgumentError(f"--use-torch-fsdp2 is not supported with {what}")
    return args


RERUN_MODES = ("disabled", "validate_results", "report_stats")
"""Megatron-LM's --rerun-mode choices (megatron/training/arguments.py)."""
RERUN_NOTICE = ("Megatron-LM's rerun state machine (it re-executes an iteration's forward and backward when a result "
                "check fails, to tell a transient hardware fault from a persistent one) is not part of this driver; "
                "without a fault every iteration is the same, and --check-for-nan-in-loss-and-grad (on by default) "
                "stops at a non-finite loss")


def check_sdc_flags(args):
    """A resolve step: the interval's range, its clash with FSDP2, and a notice for a rerun mode other than disabled
    given on the command line (it changes nothing in a run without a fault, so the flag rule accepts it; left out, it
    is Megatron-LM's default validate_results, which the flag table states)."""
    interval = args.check_weight_hash_across_dp_replicas_interval
    if interval is not None and interval < 1:
        raise ArgumentError(f"--check-weight-hash-across-dp-replicas-interval {interval} is outside [1, inf)")
    if interval is not None and args.use_torch_fsdp2:
        raise ArgumentError("--check-weight-hash-across-dp-replicas-interval is not supported with --use-torch-fsdp2: "
                            "FSDP2 shards the parameters over the data-parallel group, so no two ranks hold a "
                            "replica to compare")
    if args.rerun_mode not in (None, "disabled"):
        return args.replace(flag_notices=(*args.flag_notices, f"note: --rerun-mode {args.rerun_mode}: {RERUN_NOTICE}"))
    return args


def check_writer_packages(args, find_spec=importlib.util.find_spec) -> None:
    """One line naming the missing package when a writer is asked for (before any process group)."""
    if args.tensorboard_dir is not None and find_spec("tensorboard") is None:
        raise ArgumentError(f"--tensorboard-dir {args.tensorboard_dir} needs the tensorboard package "
                            "(pip install 'tensorboard>=2.14,<3')")
    if args.wandb_project is not None and find_spec("wandb") is None:
        raise ArgumentError(f"--wandb-project {args.wandb_project} needs the wandb package (pip install wandb)")


__all__ = ["CONNECTIONS_VAR", "MEGATRON_FSDP_CPU_REASON", "RERUN_MODES", "RERUN_NOTICE", "check_cuda_connections",
           "check_gpu_slots", "check_optimizer_offload", "check_sdc_flags", "check_sharding_flags",
           "check_writer_packages", "cuda_available", "cuda_compute_capability",
           "cuda_connections_refusal",
           "cuda_device_count", "gpu_slots_refusal", "transformer_engine_available", "transformer_engine_problem",
           "transformer_engine_reason", "uses_gpu"]
