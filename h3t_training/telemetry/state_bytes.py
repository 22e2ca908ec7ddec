"""Measured bytes of the training state one rank holds: parameters, gradients and optimizer state, on the
device and on the host (``state_bytes`` of ``--metrics-json``).

Counted from the tensors the run holds, not from a formula: the model chunks' parameters, then what the
optimizer reports (:meth:`state_tensors` of :class:`~h3t_training.loop.optimizer.DataParallelAdamW` and
:class:`~h3t_training.loop.optimizer.MegatronOptimizerAdapter`). Each byte of a storage is counted once, in
the first category whose tensors span it in the order params, grads, optimizer: a tensor claims the bytes from
its first element to its last (a buffer the optimizer reports counts whole, and the views of it, such as the
parameters in megatron-core's DDP buffer, add nothing); an optimizer parameter that is the model parameter
itself, as the float32 weights Adam updates in place, counts as params. Ranges, not whole storages: Megatron
FSDP allocates its main weights and main gradients as slices of one float32 storage (``buffer_all_in_one``). A
DTensor (torch FSDP2's parameters, gradients and Adam moments, ``--use-torch-fsdp2``) counts as the local shard this
rank holds.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

import torch

from h3t_training.loop.fsdp import local

CATEGORIES = ("params", "grads", "optimizer")
PLACEMENTS = ("device", "host")


@dataclass(frozen=True)
class PlacementBytes:
    """Bytes held in one place (the training device, or host memory)."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0


@dataclass(frozen=True)
class StateBytes:
    """One rank's measured state bytes."""

    device: PlacementBytes
    host: PlacementBytes

    def as_dict(self) -> dict:
        return {"device": asdict(self.device), "host": asdict(self.host)}


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` of its storage that ``t`` spans, from its first element to its last."""
    if t.numel() == 0:
        return 0, 0
    size = t.element_size()
    start = t.storage_offset() * size
    return start, start + size * (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride())))


def _claim(claimed: list[tuple[int, int]], start: int, end: int) -> int:
    """Add ``[start, end)`` to ``claimed`` (sorted, disjoint; merged in place); the bytes it adds."""
    added, lo, hi, kept = end - start, start, end, []
    for a, b in claimed:
        if b < lo or a > hi:
            kept.append((a, b))
            continue
        added -= max(0, min(b, end) - max(a, start))
        lo, hi = min(lo, a), max(hi, b)
    kept.append((lo, hi))
    claimed[:] = sorted(kept)
    return added


def measure(tensors: Iterable[tuple[str, str, torch.Tensor]]) -> StateBytes:
    """Sum ``(category, placement, tensor)`` triples, each byte of a storage once, in the first category (params,
    grads, optimizer) whose tensors span it."""
    ordered = sorted(tensors, key=lambda x: CATEGORIES.index(x[0]))
    claimed: dict[tuple[str, int], list[tuple[int, int]]] = {}
    totals = {(c, p): 0 for c in CATEGORIES for p in PLACEMENTS}
    for category, placement, t in ordered:
        t = local(t)
        key = (str(t.device), t.untyped_storage().data_ptr())
        totals[(category, placement)] += _claim(claimed.setdefault(key, []), *byte_range(t))
    return StateBytes(*(PlacementBytes(*(totals[(c, p)] for c in CATEGORIES)) for p in PLACEMENTS))


def rank_state_bytes(chunks, optimizer, *, on_gpu: bool) -> StateBytes:
    """This rank's state: the chunks' parameters (on the device; a CPU parameter of a GPU run on the host)
    and the optimizer's gradients and state."""
    params = [("params", "host" if on_gpu and not p.is_cuda else "device", p)
              for c in chunks for p in c.parameters()]
    return measure([*params, *optimizer.state_tensors()])


__all__ = ["CATEGORIES", "PLACEMENTS", "PlacementBytes", "StateBytes", "byte_range", "measure", "rank_state_bytes"]
