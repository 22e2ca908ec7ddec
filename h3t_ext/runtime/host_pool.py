"""Reusable pinned host buffers for offloaded activations.

Requests are rounded up to a size class (1/8 of the power of two below them, at least 4 KiB) and
served only from free buffers of exactly that class. An iteration that makes the same sequence of
requests and releases as the one before therefore needs, per class, no more buffers than that one
did: the pool never grows after the first iteration of a given shape.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from h3t_ext.runtime.device import Event

MIN_CLASS_BYTES = 4096


def size_class(nbytes: int) -> int:
    """The buffer size that serves a request of ``nbytes``."""
    assert nbytes >= 0
    if nbytes <= MIN_CLASS_BYTES:
        return MIN_CLASS_BYTES
    step = max(MIN_CLASS_BYTES, 1 << (nbytes.bit_length() - 4))
    return -(-nbytes // step) * step


class HostPool:
    """Free lists of host buffers by size class; a buffer returns with the event of its last reader."""

    def __init__(self, allocate: Callable[[int], torch.Tensor]):
        self._allocate = allocate
        self._free: dict[int, list[tuple[torch.Tensor, Optional[Event]]]] = {}
        self._capacity = 0
        self._in_use = 0
        self.allocations = 0
        """Buffers allocated so far (grows only when no free buffer of the class exists)."""

    @property
    def capacity_bytes(self) -> int:
        """Bytes of every buffer the pool owns."""
        return self._capacity

    @property
    def in_use_bytes(self) -> int:
        """Bytes of buffers handed out and not yet returned."""
        return self._in_use

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of at least ``nbytes`` (its size class)."""
        cls = size_class(nbytes)
        free = self._free.get(cls)
        if free:
            buf, event = free.pop()
            if event is not None:
                event.synchronize()  # its last copy must have landed before it is overwritten
        else:
            buf = self._allocate(cls)
            self._capacity += cls
            self.allocations += 1
        self._in_use += cls
        return buf

    def release(self, buf: torch.Tensor, after: Optional[Event] = None) -> None:
        """Give ``buf`` back; it is reused only once ``after`` (its last copy) is complete."""
        cls = buf.numel()
        assert cls == size_class(cls), "released a buffer the pool did not hand out"
        self._in_use -= cls
        self._free.setdefault(cls, []).append((buf, after))


__all__ = ["HostPool", "MIN_CLASS_BYTES", "size_class"]
