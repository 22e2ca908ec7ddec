"""Measured bytes of the training state one rank holds: parameters, gradients and optimizer state, on the
device and on the host (``state_bytes`` of ``--metrics-json``).

Counted from the tensors the run holds, not from a formula: the model chunks' parameters, then what the
optimizer reports (:meth:`state_tensors` of :class:`~h3t_training.loop.optimizer.DataParallelAdamW` and
:class:`~h3t_training.loop.optimizer.MegatronOptimizerAdapter`). Each storage is counted once, whole
(``untyped_storage().nbytes()``), in the first category that holds it in the order params, grads, optimizer
(a view of a buffer counts as the buffer; an optimizer parameter that is the model parameter itself, as the
float32 weights Adam updates in place, counts as params). A DTensor (torch FSDP2's parameters, gradients and Adam
moments, ``--use-torch-fsdp2``) counts as the local shard this rank holds.
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


def measure(tensors: Iterable[tuple[str, str, torch.Tensor]]) -> StateBytes:
    """Sum ``(category, placement, tensor)`` triples, each storage once, in the first category (params,
    grads, optimizer) that lists it."""
    ordered = sorted(tensors, key=lambda x: CATEGORIES.index(x[0]))
    seen: set[tuple[str, int]] = set()
    totals = {(c, p): 0 for c in CATEGORIES for p in PLACEMENTS}
    for category, placement, t in ordered:
        storage = local(t).untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        totals[(category, placement)] += storage.nbytes()
    return StateBytes(*(PlacementBytes(*(totals[(c, p)] for c in CATEGORIES)) for p in PLACEMENTS))


def rank_state_bytes(chunks, optimizer, *, on_gpu: bool) -> StateBytes:
    """This rank's state: the chunks' parameters (on the device; a CPU parameter of a GPU run on the host)
    and the optimizer's gradients and state."""
    params = [("params", "host" if on_gpu and not p.is_cuda else "device", p)
              for c in chunks for p in c.parameters()]
    return measure([*params, *optimizer.state_tensors()])


__all__ = ["CATEGORIES", "PLACEMENTS", "PlacementBytes", "StateBytes", "measure", "rank_state_bytes"]
