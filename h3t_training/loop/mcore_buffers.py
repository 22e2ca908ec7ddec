"""The persistent parameter and gradient buffers megatron-core's data-parallel wrappers hold for a model chunk: its
DistributedDataParallel's ``buffers`` (and ``expert_parallel_buffers``), or the parameter groups of Megatron FSDP
behind its FullyShardedDataParallel adapter (what ``MegatronOptimizerAdapter.state_tensors`` counts in the measured
``state_bytes``)."""
from __future__ import annotations

from typing import Iterator

import torch


def ddp_buffers(chunk, name: str) -> list:
    """megatron-core DDP's parameter-and-gradient buffers of a chunk (its ``buffers`` list); none for a wrapper that
    has no such list (Megatron FSDP's adapter: ``buffers`` is then ``nn.Module.buffers``, a method)."""
    found = getattr(chunk, name, ())
    return list(found) if isinstance(found, (list, tuple)) else []


FSDP_BUFFERS = (("model_weight_buffer", "params"), ("transpose_weight_buffer", "params"), ("hsdp_wbuf", "params"),
                ("hfsdp_helper_wbuf", "params"), ("hfsdp_helper_wtbuf", "params"),
                ("main_grad_buffer", "grads"), ("hsdp_gbuf", "grads"), ("hfsdp_helper_gbuf", "grads"),
                ("hsdp_comm_gbuf", "grads"), ("main_weight_buffer", "optimizer"))
"""The persistent buffers of one Megatron FSDP parameter group (``megatron_fsdp``'s ``ParameterGroup``) and what
each holds: the (sharded) bf16 weights and their FP8 transpose, the hybrid-sharding weight copies (0.16.1's
``hsdp_wbuf``; 0.19's ``hfsdp_helper_wbuf`` and its transpose ``hfsdp_helper_wtbuf``), the fp32 main gradients and
their hybrid-sharding copies (0.16.1's ``hsdp_gbuf``; 0.19's ``hfsdp_helper_gbuf`` and ``hsdp_comm_gbuf``, the
gradient-communication buffer of a custom ``grad_comm_dtype``), and the fp32 main weights, which the cost model
counts with the optimizer state as it does the distributed optimizer's. A name the installed megatron-core lacks is
skipped. The all-gathered weights live in temporary buckets that are freed after use, so they are no state."""


def fsdp_buffers(chunk) -> Iterator[tuple[str, torch.Tensor]]:
    """(category, tensor) of Megatron FSDP's persistent buffers of a chunk wrapped by megatron-core's
    FullyShardedDataParallel adapter (``param_and_grad_buffer.parameter_groups``); nothing for any other wrapper."""
    for group in getattr(getattr(chunk, "param_and_grad_buffer", None), "parameter_groups", None) or ():
        for name, category in FSDP_BUFFERS:
            data = getattr(getattr(group, name, None), "data", None)
            if isinstance(data, torch.Tensor):
                yield category, data


__all__ = ["FSDP_BUFFERS", "ddp_buffers", "fsdp_buffers"]
