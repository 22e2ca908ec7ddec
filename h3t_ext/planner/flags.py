"""Megatron launch flags of a plan, and back.

:func:`megatron_flags` is what ``h3t-plan search`` prints per plan and what the training
driver's ``--auto-plan`` appends to its own argument list; :func:`plan_from_megatron_flags`
reads such a list back (the two round-trip).
"""
from __future__ import annotations

from typing import Sequence, Union

from h3t_ext.costmodel import Plan

Alpha = Union[float, tuple[float, ...]]


def format_alpha(alpha: Alpha) -> str:
    """``0.162`` for one value, ``0.1,0.2,0.3`` for one value per pipeline stage."""
    if isinstance(alpha, (tuple, list)):
        return ",".join(_format_one(a) for a in alpha)
    return _format_one(alpha)


def _format_one(a: float) -> str:
    a = float(a)
    if abs(a - round(a, 3)) < 1e-12:
        return f"{a:.3f}"
    return repr(a)


def parse_alpha(text: str) -> Alpha:
    """Inverse of :func:`format_alpha`; raise ValueError when a value is outside [0, 1]."""
    parts = [float(x) for x in text.split(",")]
    for a in parts:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"offload alpha {a} outside [0, 1]")
    return parts[0] if len(parts) == 1 else tuple(parts)


def megatron_flags(plan: Plan) -> list[str]:
    """The Megatron (plus h3t-ext) command-line flags that launch ``plan``.

    ``--sequence-parallel`` (with t > 1), ``--use-distributed-optimizer`` and ``--tp-comm-overlap`` follow
    the plan's switches. ``--seq-length`` and
    the GPU count are the launcher's business and are not repeated here.
    """
    flags = ["--tensor-model-parallel-size", str(plan.tensor_model_parallel_size)]
    if plan.context_parallel_size > 1:
        flags += ["--context-parallel-size", str(plan.context_parallel_size)]
    flags += ["--pipeline-model-parallel-size", str(plan.pipeline_model_parallel_size)]
    if plan.num_layers_per_virtual_pipeline_stage is not None:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(plan.num_layers_per_virtual_pipeline_stage)]
    if plan.tensor_model_parallel_size > 1 and plan.sequence_parallel:
        flags.append("--sequence-parallel")
    if plan.use_distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    if plan.data_parallel_sharding_strategy is not None:
        flags += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", plan.data_parallel_sharding_strategy]
    flags += [flag for flag, attr in _OVERLAP.items() if getattr(plan, attr, False)]
    if not plan.overlap_p2p_comm:
        flags.append("--no-overlap-p2p-communication")
    flags += ["--ckpt", plan.ckpt, "--offload-alpha", format_alpha(plan.offload_alpha)]
    flags += ["--micro-batch-size", str(plan.micro_batch_size), "--global-batch-size", str(plan.global_batch_size)]
    return flags


_INT_FLAGS = {
    "--tensor-model-parallel-size": "tensor_model_parallel_size",
    "--context-parallel-size": "context_parallel_size",
    "--pipeline-model-parallel-size": "pipeline_model_parallel_size",
    "--num-layers-per-virtual-pipeline-stage": "num_layers_per_virtual_pipeline_stage",
    "--micro-batch-size": "micro_batch_size",
    "--global-batch-size": "global_batch_size",
}
_SWITCHES = frozenset({"--sequence-parallel", "--use-distributed-optimizer", "--use-megatron-fsdp",
                       "--no-overlap-p2p-communication"})
_OVERLAP = {"--overlap-grad-reduce": "overlap_grad_reduce", "--overlap-param-gather": "overlap_param_gather",
            "--tp-comm-overlap": "tp_comm_overlap"}


def plan_from_megatron_flags(flags: Sequence[str], *, num_gpus: int, seq_length: int) -> Plan:
    """Read a flag list made by :func:`megatron_flags` back into a :class:`Plan`."""
    fields: dict[str, object] = {}
    seen = set(flags)
    fields["use_distributed_optimizer"] = "--use-distributed-optimizer" in seen
    fields["overlap_p2p_comm"] = "--no-overlap-p2p-communication" not in seen
    it = iter(flags)
    for flag in it:
        if flag in _SWITCHES:
            continue
        if flag in _OVERLAP:
            fields[_OVERLAP[flag]] = True
            continue
        if flag not in _INT_FLAGS and flag not in ("--ckpt", "--offload-alpha", "--data-parallel-sharding-strategy"):
            raise ValueError(f"unexpected flag {flag!r}")
        value = next(it, None)
        if value is None:
            raise ValueError(f"flag {flag} needs a value")
        if flag == "--ckpt":
            fields["ckpt"] = value
        elif flag == "--data-parallel-sharding-strategy":
            fields["data_parallel_sharding_strategy"] = value
        elif flag == "--offload-alpha":
            fields["offload_alpha"] = parse_alpha(value)
        else:
            fields[_INT_FLAGS[flag]] = int(value)
    if fields.get("tensor_model_parallel_size", 1) > 1:
        fields["sequence_parallel"] = "--sequence-parallel" in seen
    return Plan(num_gpus=num_gpus, seq_length=seq_length, **fields)
