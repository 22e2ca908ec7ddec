"""Small host-side values (flags, loss sums, norms) reduced over a process group on the device its backend takes.

NCCL reduces CUDA tensors only ("No backend type associated with device type cpu"); gloo takes CPU tensors. The
driver's own bookkeeping (a non-finite loss, an exit signal, the logged loss, the finite-weights check before a
save) holds CPU values, so every such reduction goes through :func:`all_reduce_host`, which moves the value to
:func:`collective_device` of its group and back. The CPU tier cannot see NCCL's rule, so a unit test keeps every
reduction of the driver's loop in this module (tests/unit/test_collectives.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device a tensor must be on for a collective over ``group``: the current CUDA device under NCCL, else CPU."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_host(t: torch.Tensor, op=dist.ReduceOp.SUM, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """``t`` (a CPU tensor) reduced over ``group`` with ``op``; returns a CPU tensor (``t`` itself under gloo)."""
    device = collective_device(group)
    if device.type == "cpu":
        dist.all_reduce(t, op=op, group=group)
        return t
    moved = t.to(device)
    dist.all_reduce(moved, op=op, group=group)
    return moved.cpu()
