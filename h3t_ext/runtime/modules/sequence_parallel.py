"""Sequence parallelism that runs on any device (CPU gloo included).

megatron-core's sequence-parallel paths allocate their communication buffers with
``torch.cuda.current_device()`` (the global memory buffer of ``ColumnParallelLinear``, the
gather/reduce-scatter mappings), so they fail on a machine without CUDA. This module gives the
same collectives with buffers on the input's device, and the two linear layers that the h3t layer
spec (:mod:`h3t_ext.runtime.modules.layer_specs`) puts where megatron-core's local spec has
``ColumnParallelLinear`` / ``RowParallelLinear``:

* :class:`SPColumnParallelLinear`: under sequence parallelism it all-gathers its sequence-sharded
  input, saves only the local shard (as megatron-core and TransformerEngine do) and gathers it again
  in backward; its input gradient is reduce-scattered back to the shard.
* :class:`SPRowParallelLinear`: its output is reduce-scattered to the sequence shard.

Norm weights (and biases) under sequence parallelism see only this rank's tokens: their gradients
must be summed over the tensor-parallel group. Megatron marks them ``param.sequence_parallel = True``
and all-reduces them in ``finalize_model_grads``; :func:`allreduce_sequence_parallel_grads` is the
same step for the CPU optimizer and the tests.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


# --------------------------------------------------------------------------- collectives
def _gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    out = torch.empty((x.size(0) * world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    x = x.contiguous()
    assert x.size(0) % world == 0, f"first dimension {x.size(0)} is not divisible by the {world} tensor-parallel ranks"
    out = torch.empty((x.size(0) // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def _split_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    n = x.size(0) // world
    return x.narrow(0, dist.get_rank(group) * n, n).clone()  # a copy: the full tensor can be freed


class _ScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.group), None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first_dim(grad, ctx.group), None


def scatter_to_sequence_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's slice of ``x`` along dim 0 (backward: all-gather)."""
    return _ScatterToSequenceParallel.apply(x, group)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``x`` over ``group``, this rank's slice along dim 0 (backward: all-gather)."""
    return _ReduceScatterToSequenceParallel.apply(x, group)


class _SequenceParallelLinear(torch.autograd.Function):
    """``all_gather(x) @ w.T + b``, saving only the local shard ``x`` (re-gathered in backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.use_bias = group, bias is not None
        out = torch.matmul(_gather_first_dim(x, group), weight.t())
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _reduce_scatter_first_dim(grad.matmul(weight), ctx.group)
        if ctx.needs_input_grad[1]:
            total = _gather_first_dim(x, ctx.group)
            g2 = grad.reshape(-1, grad.size(-1))
            grad_w = g2.t().matmul(total.reshape(-1, total.size(-1)))
        if ctx.use_bias and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.size(-1)).sum(dim=0)
        return grad_x, grad_w, grad_b, None


# --------------------------------------------------------------------------- linear layers
class SPColumnParallelLinear(ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear whose sequence-parallel path runs on any device."""

    def _forward_impl(self, input, weight, *args, bias=None, sequence_parallel=False, tp_group=None, **kwargs):
        if not sequence_parallel:
            return super()._forward_impl(input, weight, *args, bias=bias, sequence_parallel=False,
                                         tp_group=tp_group, **kwargs)
        if kwargs.get("gradient_accumulation_fusion") or kwargs.get("grad_output_buffer") is not None:
            raise ValueError("SPColumnParallelLinear does not support --gradient-accumulation-fusion or "
                             "--defer-embedding-wgrad-compute")
        return _SequenceParallelLinear.apply(input, weight, bias, tp_group)


class SPRowParallelLinear(RowParallelLinear):
    """megatron-core's RowParallelLinear whose sequence-parallel reduce-scatter runs on any device."""

    def forward(self, input_):
        if not self.sequence_parallel or self.explicit_expert_comm:
            return super().forward(input_)
        assert self.input_is_parallel, "sequence parallelism needs input_is_parallel"
        out = self._forward_impl(input=input_, weight=self.weight, bias=None,
                                 gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                                 allreduce_dgrad=False, sequence_parallel=False, tp_group=None,
                                 grad_output_buffer=None)
        out = reduce_scatter_to_sequence_parallel(out, self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


# --------------------------------------------------------------------------- gradients, RNG
def mark_sequence_parallel(module: torch.nn.Module, sequence_parallel: bool) -> None:
    """Set Megatron's ``sequence_parallel`` attribute on a norm's own parameters (weight, bias)."""
    for p in module.parameters(recurse=False):
        setattr(p, "sequence_parallel", bool(sequence_parallel))


def sequence_parallel_params(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Parameters marked ``sequence_parallel=True`` (each once), in module order."""
    seen, out = set(), []
    for m in modules:
        for p in m.parameters():
            if getattr(p, "sequence_parallel", False) and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def allreduce_flat_(tensors: list[torch.Tensor], group) -> None:
    """Sum ``tensors`` over ``group`` in place, with one all-reduce of their concatenation."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def allreduce_sequence_parallel_grads(params: Iterable[torch.nn.Parameter], tp_group) -> int:
    """Sum the ``.grad`` of sequence-parallel parameters over ``tp_group`` (one flat all-reduce, in place); of a
    DTensor gradient (torch FSDP2) the local shard, which every tensor-parallel rank holds alike.

    Returns how many gradients were reduced (parameters without a gradient count as zeros).
    """
    params = [p for p in params if getattr(p, "sequence_parallel", False)]
    if tp_group is None or not params or dist.get_world_size(tp_group) == 1:
        return 0
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    allreduce_flat_([g.to_local() if isinstance(g, DTensor) else g for g in (p.grad for p in params)], tp_group)
    return len(params)


def ensure_host_rng_tracker() -> None:
    """Make megatron-core's RNG tracker usable without CUDA.

    Under sequence parallelism megatron-core forks its CUDA RNG tracker around the decoder and the
    embedding dropout; on a host without CUDA there is no device generator to fork. megatron-core's
    pass-through tracker (``initialize_rng_tracker(inference_rng_tracker=True)``) makes the fork a
    no-op, so dropout there draws from the CPU generator. A tracker that already holds states is kept.
    """
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    if getattr(tracker, "is_inference_rng_tracker", False) or tracker.get_states():
        return
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def host_sequence_parallel(config, device_type: str) -> bool:
    """True when sequence parallelism must use this module's collectives (the model runs on ``device_type``
    'cpu', where megatron-core's CUDA-only sequence-parallel paths cannot)."""
    return bool(config.sequence_parallel) and config.tensor_model_parallel_size > 1 and device_type == "cpu"


__all__ = [
    "SPColumnParallelLinear", "SPRowParallelLinear", "allreduce_flat_", "allreduce_sequence_parallel_grads",
    "ensure_host_rng_tracker", "host_sequence_parallel", "mark_sequence_parallel", "reduce_scatter_to_sequence_parallel",
    "scatter_to_sequence_parallel", "sequence_parallel_params",
]
