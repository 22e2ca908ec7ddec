"""``--auto-plan`` and ``--offload-alpha auto|balanced``: the planner fills what the user left out.

The cost model prices plans for a GPU system (``--gpu NAME``, default: the CUDA device's name
when it is known, else ``h800``) under ``--memory-budget`` (default: the system's). Flags the
user gave are constraints of the search; the best plan's values fill the rest, and the chosen
plan is printed (rank 0) as the Megatron flags that launch it.
"""
from __future__ import annotations

import re

from h3t_ext.ckpt import combined_ckpt, split_ckpt
from h3t_ext.offload_alpha import OffloadAlpha
from h3t_ext.planner.translate import MEGATRON_FSDP_CKPT_FORMAT
from h3t_training.errors import ArgumentError
from h3t_training.config.feature_checks import megatron_fsdp_refusal, uses_gpu
from h3t_training.config.megatron_fields import sixteen_bit_grads_of, spec_backend
from h3t_training.config.run_spec import model_spec, run_plan, stack_fields

DEFAULT_SYSTEM = "h800"
_CUDA_NAMES = ((r"\bH800\b", "h800"), (r"\bH100\b", "h100-sxm"), (r"\bH200\b", "h200"), (r"\bB200\b", "b200"),
               (r"\bGB200\b", "gb200"), (r"\bGB300\b", "gb300"), (r"\bA800\b", "a800"),
               (r"\bA100\b.*\b40GB\b", "a100-40g"), (r"\bA100\b", "a100-80g"))
"""CUDA device names (patterns, first match wins) and their system files; a model name matches as a whole word
("NVIDIA B200" is b200, "NVIDIA GB200", whose chip runs at another power and peak in an NVL72 rack, gb200, "NVIDIA
GB300" gb300; an HGX B300, which no file describes, is none of them)."""


def cuda_system_name(device_name: str):
    """The system file of a CUDA device name (``torch.cuda.get_device_name()``), or None when none is shipped."""
    for pattern, name in _CUDA_NAMES:
        if re.search(pattern, device_name):
            return name
    return None


def system_choice(args) -> tuple[str, str]:
    """(system name, why it was taken where the user did not name it): ``--gpu``, else the CUDA device's system
    file, else the default system, saying which device had none."""
    if args.gpu:
        return args.gpu, ""
    import torch
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
        name = cuda_system_name(device)
        if name is not None:
            return name, f"the CUDA device {device!r}"
        return DEFAULT_SYSTEM, f"the default: no system file for the CUDA device {device!r}; give --gpu"
    return DEFAULT_SYSTEM, ""


def system_name(args) -> str:
    """``--gpu``, else the CUDA device's system file, else the default system (:func:`system_choice`)."""
    return system_choice(args)[0]


def _model_spec(args):
    return model_spec(args, args.tokenizer_vocab_size)


def _system_and_budget(args):
    from h3t_ext.costmodel import get_system
    from h3t_ext.costmodel.errors import UnknownNameError
    from h3t_ext.planner.units import parse_bytes
    try:
        system = get_system(system_name(args))
    except UnknownNameError as e:
        raise ArgumentError(f"--gpu {args.gpu}: {e}") from None
    budget = None
    if args.memory_budget is not None:
        try:
            budget = parse_bytes(args.memory_budget)
        except ValueError as e:
            raise ArgumentError(f"--memory-budget {e}") from None
    return system, budget


def _alpha_mode(alpha: OffloadAlpha):
    if alpha.is_mode:
        return alpha.mode
    if isinstance(alpha.alpha, tuple):
        raise ArgumentError("--auto-plan takes one --offload-alpha value, 'auto' or 'balanced'")
    return alpha.alpha


def _recompute_args(plan) -> dict:
    """Megatron's --recompute-* values of ``plan`` as the config holds them: the planner's one rule
    (:func:`h3t_ext.ckpt.recompute_fields`), with argparse's None for no --recompute-modules where the
    rule (megatron-core's ``TransformerConfig``) says []."""
    from h3t_ext.ckpt import recompute_fields
    fields = recompute_fields(plan.ckpt, plan.recompute)
    return {**fields, "recompute_modules": fields["recompute_modules"] or None}


def runnable_ladder(args) -> tuple:
    """The memory options (:data:`~h3t_ext.planner.space.MEMORY_LADDER`) ``--auto-plan`` may add, as this run can
    run them: none where the user fixed one (``--optimizer-cpu-offload``, Megatron FSDP); megatron-core's
    optimizer CPU offload everywhere (a host partition on CPU, its HybridDeviceOptimizer on a GPU); Megatron FSDP
    where the run could take it with the distributed optimizer the plan switches on (the driver's one rule,
    :func:`~h3t_training.config.feature_checks.megatron_fsdp_refusal`: a GPU, no --save/--load, no FSDP tuning
    flags)."""
    from h3t_ext.planner.space import MEMORY_LADDER
    if args.optimizer_cpu_offload or args.use_megatron_fsdp or args.data_parallel_sharding_strategy != "no_shard":
        return ()
    fsdp = megatron_fsdp_refusal(args.replace(use_megatron_fsdp=True, use_distributed_optimizer=True,
                                              ckpt_format=MEGATRON_FSDP_CKPT_FORMAT)) is None
    return tuple(o for o in MEMORY_LADDER if o.optimizer_cpu_offload or fsdp)


def _memory_fields(args, plan) -> dict:
    """The config fields of the memory options ``plan`` chose (Megatron's flags: --use-megatron-fsdp and
    --data-parallel-sharding-strategy, with the --ckpt-format fsdp_dtensor Megatron-LM runs it with;
    --optimizer-cpu-offload with --use-precision-aware-optimizer, which it needs, and --optimizer-offload-fraction)."""
    out = {}
    if plan.data_parallel_sharding_strategy is not None:
        out.update(use_megatron_fsdp=True, data_parallel_sharding_strategy=plan.data_parallel_sharding_strategy,
                   ckpt_format=MEGATRON_FSDP_CKPT_FORMAT)
    if plan.optimizer_cpu_offload and not args.optimizer_cpu_offload:
        out.update(optimizer_cpu_offload=True, use_precision_aware_optimizer=True,
                   optimizer_offload_fraction=plan.optimizer_offload_fraction)
    return out


def _local_attention_sizes(args) -> dict:
    """The context parallel size fixed at 1 where the run's GPU builds megatron-core's local attention, which takes
    no other (validation refuses c > 1 there), unless the flags give one; else nothing fixed."""
    if args.context_parallel_size is not None or not uses_gpu(args):
        return {}
    return {"context_parallel_size": 1} if spec_backend(args, on_gpu=True) == "local" else {}


def _no_layout_reason(rules, world_size: int) -> str:
    """Why no layout was valid, in the driver's terms: the divisibility rules the search's layouts broke, with
    Megatron's flag names and the world size for the search's GPU count."""
    from h3t_ext.planner.from_args import flagify
    text = flagify("; ".join(rules)).replace("--num-gpus", f"the world size ({world_size})") if rules else \
        "no layout of these flags divides the world size"
    return f"no valid layout ({text})"


def plan_config(args):
    """A new config: plans searched under the user's fixed flags, the others taken from the best one. The chosen
    plan's line joins the config's notices (printed once, by rank 0, when training starts)."""
    from h3t_ext.planner.search import search
    from h3t_ext.planner.translate import FixedRecomputeError, constraints_from_args
    split = [flag for flag, given in (
        ("--decoder-first-pipeline-num-layers", args.decoder_first_pipeline_num_layers is not None),
        ("--decoder-last-pipeline-num-layers", args.decoder_last_pipeline_num_layers is not None),
        ("--account-for-embedding-in-pipeline-split", args.account_for_embedding_in_pipeline_split),
        ("--account-for-loss-in-pipeline-split", args.account_for_loss_in_pipeline_split),
        ("--pipeline-model-parallel-layout", args.pipeline_model_parallel_layout is not None)) if given]
    if split:
        raise ArgumentError(f"--auto-plan searches even layer splits only; it cannot keep {', '.join(split)}: give the "
                            "parallel flags yourself, or leave those out")
    if args.use_torch_fsdp2:
        raise ArgumentError("--auto-plan does not search torch FSDP2 layouts (it searches Megatron FSDP on a GPU): "
                            "give the parallel flags yourself with --use-torch-fsdp2, or leave it out")
    system, budget = _system_and_budget(args)
    try:  # the one --offload-alpha parser (validate_args's, which runs after this step)
        alpha = OffloadAlpha.parse("auto" if args.offload_alpha is None else args.offload_alpha)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    # Flags left out are the search's; sequence parallelism and the distributed optimizer are the planner's to
    # switch on (a store_true flag left out cannot say "keep it off").
    # The memory ladder: the options this run can run (runnable_ladder); a Megatron FSDP the user fixed is kept.
    try:
        constraints = constraints_from_args(args, sequence_parallel=True, use_distributed_optimizer=True,
                                            tp_comm_overlap=False, grad_reduce_in_bf16=sixteen_bit_grads_of(args),
                                            memory_ladder=runnable_ladder(args), **_local_attention_sizes(args),
                                            **stack_fields(args, on_gpu=uses_gpu(args)))
    except FixedRecomputeError as e:
        raise ArgumentError(f"--auto-plan searches --ckpt no|full|ours (or --recompute-granularity alone); it cannot "
                            f"keep {e.flags}: give the parallel flags yourself, or leave those out") from None
    # best-first, as h3t-plan search runs (its first plan whatever --top: the search goes as deep as the timeline
    # re-ranks); the exhaustive-but-pruned top=None search took ~15x as long and could miss the best
    result = search(_model_spec(args), system, num_gpus=args.world_size, seq_length=args.seq_length,
                    global_batch_size=args.global_batch_size, constraints=constraints,
                    alpha_mode=_alpha_mode(alpha), memory_budget_bytes=budget, top=1)
    best = result.best
    if best is None:
        closest = result.closest_infeasible
        why = closest.reason if closest else _no_layout_reason(result.broken_rules, args.world_size)
        raise ArgumentError(f"--auto-plan found no plan for {args.world_size} ranks on {system.name}: {why}")
    plan = best.plan
    est = best.evaluation.estimate
    why = system_choice(args)[1]
    line = (f"auto-plan ({system.name}{', ' + why if why else ''}, {result.considered} plans priced): "
            f"{' '.join(best.megatron_flags)} | "
            f"predicted {est.tokens_per_second / args.world_size:.1f} tokens/s/GPU, "
            f"peak memory {est.peak_memory_bytes / 2**30:.2f} GiB")
    base, recompute = split_ckpt(plan.ckpt, plan.recompute)  # the config's form (arguments.resolve_ckpt)
    return args.replace(
        tensor_model_parallel_size=plan.tensor_model_parallel_size,
        context_parallel_size=plan.context_parallel_size,
        pipeline_model_parallel_size=plan.pipeline_model_parallel_size,
        num_layers_per_virtual_pipeline_stage=plan.num_layers_per_virtual_pipeline_stage,
        pipeline_model_parallel_layout=plan.pipeline_model_parallel_layout,
        micro_batch_size=plan.micro_batch_size,
        ckpt=combined_ckpt(base, recompute),
        recompute=recompute,
        **_recompute_args(plan),
        recompute_activations=False,
        offload_alpha=OffloadAlpha.parse(plan.offload_alpha),
        sequence_parallel=plan.sequence_parallel and plan.tensor_model_parallel_size > 1,
        use_distributed_optimizer=plan.use_distributed_optimizer,
        overlap_grad_reduce=plan.overlap_grad_reduce,
        overlap_param_gather=plan.overlap_param_gather,
        **_memory_fields(args, plan),
        auto_plan_flags=tuple(best.megatron_flags),
        flag_notices=(*args.flag_notices, line),
    )


def resolve_alpha(args):
    """A new config whose ``--offload-alpha auto|balanced`` is the cost model's smallest alpha that fits the
    plan this driver runs (:func:`h3t_training.config.run_spec.run_plan`)."""
    from h3t_ext.costmodel.errors import PlanError
    from h3t_ext.planner.evaluate import evaluate
    system, budget = _system_and_budget(args)
    mode = args.offload_alpha.mode
    try:
        ev = evaluate(_model_spec(args), run_plan(args, on_gpu=uses_gpu(args)), system, alpha_mode=mode,
                      memory_budget_bytes=budget)
    except PlanError as e:
        raise ArgumentError(f"--offload-alpha {mode}: {e}") from None
    resolved = OffloadAlpha.parse(ev.plan.offload_alpha)
    line = f"--offload-alpha {mode} resolved by the cost model ({system.name}): {resolved}"
    return args.replace(offload_alpha=resolved, flag_notices=(*args.flag_notices, line))
