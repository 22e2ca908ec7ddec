"""``--auto-plan`` and ``--offload-alpha auto|balanced``: the planner fills what the user left out.

The cost model prices plans for a GPU system (``--gpu NAME``, default: the CUDA device's name
when it is known, else ``h800``) under ``--memory-budget`` (default: the system's). Flags the
user gave are constraints of the search; the best plan's values fill the rest, and the chosen
plan is printed (rank 0) as the Megatron flags that launch it.
"""
from __future__ import annotations

import os

from h3t_training.errors import ArgumentError
from h3t_training.offload_alpha import parse_alpha_values
from h3t_training.tokenizer import tokenizer_from_args

DEFAULT_SYSTEM = "h800"
_CUDA_NAMES = (("H800", "h800"), ("H100", "h100-sxm"), ("H200", "h200"), ("A800", "a800"), ("A100", "a100-80g"))


def system_name(args) -> str:
    """``--gpu``, else the CUDA device's system file, else the default system."""
    if args.gpu:
        return args.gpu
    import torch
    if torch.cuda.is_available():
        dev = torch.cuda.get_device_name()
        for key, name in _CUDA_NAMES:
            if key in dev:
                return name
    return DEFAULT_SYSTEM


def model_spec(args, vocab_size: int, name: str = "custom"):
    """The cost model's description of the model these arguments build: its shape, MLP (--swiglu),
    output layer (--untie-embeddings-and-output-weights), linear biases (--disable-bias-linear) and dropout."""
    from h3t_ext.costmodel import ModelSpec
    return ModelSpec(name=name, num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                     ffn_hidden_size=args.ffn_hidden_size, vocab_size=vocab_size, swiglu=bool(args.swiglu),
                     untie_embeddings_and_output_weights=bool(args.untie_embeddings_and_output_weights),
                     add_bias_linear=not args.disable_bias_linear,
                     attention_dropout=args.attention_dropout, hidden_dropout=args.hidden_dropout)


def _model_spec(args):
    return model_spec(args, tokenizer_from_args(args).vocab_size)


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


def _alpha_mode(args):
    a = args.offload_alpha
    if a is None or a in ("auto", "balanced"):
        return a or "auto"
    values = parse_alpha_values(a)
    if len(values) != 1:
        raise ArgumentError("--auto-plan takes one --offload-alpha value, 'auto' or 'balanced'")
    return values[0]


def _alpha_text(plan) -> str:
    """``--offload-alpha`` of a resolved plan: one value, or one per pipeline stage comma-separated."""
    if isinstance(plan.offload_alpha, tuple):
        return ",".join(str(a) for a in plan.alphas())
    return str(plan.offload_alpha)


def _print_rank0(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


def plan_config(args):
    """A new config: plans searched under the user's fixed flags, the others taken from the best one."""
    from h3t_ext.planner.search import search
    from h3t_ext.planner.space import SearchConstraints
    system, budget = _system_and_budget(args)
    constraints = SearchConstraints(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
        micro_batch_size=args.micro_batch_size,
        ckpt=args.ckpt,
    )
    result = search(_model_spec(args), system, num_gpus=args.world_size, seq_length=args.seq_length,
                    global_batch_size=args.global_batch_size, constraints=constraints,
                    alpha_mode=_alpha_mode(args), memory_budget_bytes=budget)
    best = result.best
    if best is None:
        closest = result.closest_infeasible
        why = closest.reason if closest else "no valid layout for these flags and world size"
        raise ArgumentError(f"--auto-plan found no plan for {args.world_size} ranks on {system.name}: {why}")
    plan = best.plan
    planned = args.replace(
        tensor_model_parallel_size=plan.tensor_model_parallel_size,
        context_parallel_size=plan.context_parallel_size,
        pipeline_model_parallel_size=plan.pipeline_model_parallel_size,
        num_layers_per_virtual_pipeline_stage=plan.num_layers_per_virtual_pipeline_stage,
        micro_batch_size=plan.micro_batch_size,
        ckpt=plan.ckpt,
        offload_alpha=_alpha_text(plan),
        sequence_parallel=plan.sequence_parallel and plan.tensor_model_parallel_size > 1,
        use_distributed_optimizer=plan.use_distributed_optimizer,
        overlap_grad_reduce=plan.overlap_grad_reduce,
        overlap_param_gather=plan.overlap_param_gather,
        auto_plan_flags=tuple(best.megatron_flags),
    )
    est = best.evaluation.estimate
    _print_rank0(f"auto-plan ({system.name}, {result.considered} plans priced): {' '.join(best.megatron_flags)} | "
                 f"predicted {est.tokens_per_second / args.world_size:.1f} tokens/s/GPU, "
                 f"peak memory {est.peak_memory_bytes / 2**30:.2f} GiB")
    return planned


def resolve_alpha(args):
    """A new config whose ``--offload-alpha auto|balanced`` is the cost model's smallest alpha that
    fits the fixed plan."""
    from h3t_ext.costmodel import Plan
    from h3t_ext.costmodel.errors import PlanError
    from h3t_ext.planner.evaluate import evaluate
    system, budget = _system_and_budget(args)
    plan = Plan(num_gpus=args.world_size, seq_length=args.seq_length, global_batch_size=args.global_batch_size,
                micro_batch_size=args.micro_batch_size, tensor_model_parallel_size=args.tensor_model_parallel_size,
                context_parallel_size=args.context_parallel_size,
                pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage, ckpt=args.ckpt)
    try:
        ev = evaluate(_model_spec(args), plan, system, alpha_mode=args.offload_alpha, memory_budget_bytes=budget)
    except PlanError as e:
        raise ArgumentError(f"--offload-alpha {args.offload_alpha}: {e}") from None
    resolved = _alpha_text(ev.plan)
    _print_rank0(f"--offload-alpha {args.offload_alpha} resolved by the cost model ({system.name}): {resolved}")
    return args.replace(offload_alpha=resolved)
