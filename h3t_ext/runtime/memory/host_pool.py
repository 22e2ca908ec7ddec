"""Reusable pinned host buffers for offloaded activations.

Requests are rounded up to a size class (1/8 of the power of two below them, at least 4 KiB) and
served only from free buffers of exactly that class. An iteration that makes the same sequence of
requests and releases as the one before therefore needs, per class, no more buffers than that one
did: the pool never grows after the first iteration of a given shape.

The pool never blocks the host. A released buffer comes back with the event of its last copy
(e.g. the reload that read it). :meth:`HostPool.acquire` prefers, oldest first, a free buffer
whose event has completed; when none has, it hands out the oldest one together with its event,
and the caller orders its copy after that event on the copy stream (``copy_async(after=...)``)
instead of waiting on the CPU. First-in-first-out order makes the oldest release, the one most
likely to have landed, the first choice.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional

import torch

from h3t_ext.runtime.memory.device import Event

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
        self._free: dict[int, deque[tuple[torch.Tensor, Optional[Event]]]] = {}
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

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, Optional[Event]]:
        """A flat uint8 buffer of at least ``nbytes`` (its size class), and the event that must
        complete before the buffer is written (None when it is free now). Never blocks."""
        cls = size_class(nbytes)
        free = self._free.get(cls)
        if free:
            pick = next((i for i, (_, e) in enumerate(free) if e is None or e.query()), 0)
            buf, event = free[pick]
            del free[pick]
            if event is not None and event.query():
                event = None
        else:
            buf, event = self._allocate(cls), None
            self._capacity += cls
            self.allocations += 1
        self._in_use += cls
        return buf, event

    def release(self, buf: torch.Tensor, after: Optional[Event] = None) -> None:
        """Give ``buf`` back; it is reused only once ``after`` (its last copy) is complete."""
        cls = buf.numel()
        assert cls == size_class(cls), "released a buffer the pool did not hand out"
        self._in_use -= cls
        self._free.setdefault(cls, deque()).append((buf, after))


__all__ = ["HostPool", "MIN_CLASS_BYTES", "size_class"]
