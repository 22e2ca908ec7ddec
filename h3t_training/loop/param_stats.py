"""Statistics of the model's parameters and gradients that Megatron-LM logs on request: ``--log-params-norm`` (the L2
norm of every parameter after the step, ``calc_params_l2_norm``) and ``--log-num-zeros-in-grad`` (the zero elements of
the gradients the step applied, megatron-core's ``count_zeros_fp32``).

Each element of the model counts once, as Megatron counts it: a tensor-parallel parameter on every tensor-parallel rank
(each holds its own slice), a replicated one (norms, biases of row-parallel layers) on tensor rank 0 only, the last
pipeline stage's copy of a tied word embedding (``shared``) not at all, and the sums over the model-parallel group (and,
where a rank holds a shard of every tensor -- torch FSDP2's DTensors, megatron-core's distributed optimizer's main
parameters on a GPU -- over the data-parallel group first). The data-parallel replicas hold the same values, so one
replica's sum is the model's.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from h3t_training.loop.collectives import all_reduce_host
from h3t_training.loop.fsdp import is_dtensor, local


def counted(p: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank's ``p`` adds its elements to a model-wide statistic (Megatron's ``param_is_not_shared`` and
    ``param_is_not_tensor_parallel_duplicate``)."""
    return (getattr(p, "tensor_model_parallel", False) or tp_rank == 0) and not getattr(p, "shared", False)


def _host_total(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum of per-tensor figures (on the tensors' device), as one float64 host value: one transfer per statistic,
    not one per parameter."""
    if not parts:
        return torch.zeros(1, dtype=torch.float64)
    return torch.stack(parts).sum().double().cpu().reshape(1)


def _sum(whole: list[torch.Tensor], shards: list[torch.Tensor], shard_group, model_parallel_group) -> float:
    """The figures of ``whole`` tensors + those of this rank's ``shards`` (summed over ``shard_group``), summed over the
    model-parallel group."""
    local_sum, shard_sum = _host_total(whole), _host_total(shards)
    if shard_group is not None and dist.get_world_size(shard_group) > 1:
        shard_sum = all_reduce_host(shard_sum, group=shard_group)
    total = local_sum + shard_sum
    if model_parallel_group is not None and dist.get_world_size(model_parallel_group) > 1:
        total = all_reduce_host(total, group=model_parallel_group)
    return float(total)


def _param_data(p: torch.Tensor, bf16: bool) -> tuple[Optional[torch.Tensor], bool]:
    """(what Megatron takes the norm of, whether it is a data-parallel shard): with --bf16, the optimizer's fp32 main
    parameter where megatron-core keeps one (a shard of it with the distributed optimizer, None where this rank owns
    none), else the parameter; a DTensor's local shard."""
    if bf16 and hasattr(p, "main_param"):
        sharded = bool(getattr(p, "main_param_sharded", False))
        return p.main_param, sharded
    if is_dtensor(p):
        return local(p), True
    return p.data, False


def params_l2_norm(params: Iterable[torch.Tensor], *, tp_rank: int, model_parallel_group, shard_group=None,
                   bf16: bool = False) -> float:
    """The L2 norm of the model's parameters (``--log-params-norm``); ``shard_group``: the data-parallel group over which
    sharded tensors are summed (torch FSDP2, the distributed optimizer's main parameters)."""
    whole: list[torch.Tensor] = []
    shards: list[torch.Tensor] = []
    for p in params:
        if not counted(p, tp_rank):
            continue
        data, sharded = _param_data(p, bf16)
        if data is not None:
            (shards if sharded else whole).append(data.detach().double().pow(2).sum())
    return _sum(whole, shards, shard_group, model_parallel_group) ** 0.5


def zeros_in_grads(params: Iterable[torch.Tensor], *, tp_rank: int, model_parallel_group, shard_group=None) -> float:
    """Zero elements of the model's gradients (``--log-num-zeros-in-grad``), each element counted once; a float, as
    megatron-core's ``count_zeros_fp32`` returns it. ``shard_group`` sums DTensor gradients' local shards."""
    whole: list[torch.Tensor] = []
    shards: list[torch.Tensor] = []
    for p in params:
        if p.grad is None or not counted(p, tp_rank):
            continue
        g = local(p.grad).detach()
        (shards if is_dtensor(p.grad) else whole).append(g.numel() - torch.count_nonzero(g))
    return _sum(whole, shards, shard_group, model_parallel_group)
