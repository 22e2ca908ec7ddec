"""Gather many tensors into one contiguous byte buffer at given offsets, and scatter back.

This is the offload layout: one (pinned) host buffer per microbatch-chunk, each saved
tensor at an aligned offset, moved in one native call each way.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import increment_version

from h3t_ext.kernels._checks import (
    Backend,
    mark_native_writes,
    route,
    select_native,
    stream_context,
    stream_handle,
    validate_buffer,
    validate_offsets,
    validate_tensors,
)
from h3t_ext.kernels._layout import row_layout


def packed_offsets(tensors: Sequence[torch.Tensor], alignment: int = 64) -> tuple[list[int], int]:
    """Offsets placing ``tensors`` back to back, each start a multiple of ``alignment`` bytes.

    Returns (offsets, total bytes needed).
    """
    validate_tensors("packed_offsets", tensors, writable=False)
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"packed_offsets: alignment must be an int >= 1, got {alignment!r}")
    offsets, end = [], 0
    for t in tensors:
        start = -(-end // alignment) * alignment
        offsets.append(start)
        end = start + t.nbytes
    return offsets, end


def _native_args(tensors: Sequence[torch.Tensor], offsets: Sequence[int]):
    """(ptrs, offsets, row_bytes, rows|None, pitches|None, rest) for the native pack calls."""
    ptrs, offs, row_bytes, rows, pitches, rest = [], [], [], [], [], []
    strided = False
    for t, off in zip(tensors, offsets):
        n = t.nbytes
        if n == 0:
            continue
        if t.is_contiguous():
            ptrs.append(t.data_ptr()), offs.append(off), row_bytes.append(n), rows.append(1), pitches.append(n)
            continue
        layout = row_layout(t)
        if layout is None:
            rest.append((t, off))
            continue
        size = t.element_size()
        strided = True
        ptrs.append(t.data_ptr()), offs.append(off), rows.append(layout.rows)
        row_bytes.append(layout.row_elems * size), pitches.append(layout.pitch * size)
    if not strided:
        rows, pitches = None, None
    return ptrs, offs, row_bytes, rows, pitches, rest


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _torch_gather(pairs, buffer: torch.Tensor, kind: str, stream: object) -> None:
    non_blocking = kind == "cuda"
    with stream_context(kind, stream), torch.no_grad():
        for t, off in pairs:
            if t.nbytes:
                buffer[off:off + t.nbytes].copy_(_bytes_of(t), non_blocking=non_blocking)


def _torch_scatter(pairs, buffer: torch.Tensor, kind: str, stream: object) -> None:
    non_blocking = kind == "cuda"
    with stream_context(kind, stream), torch.no_grad():
        for t, off in pairs:
            if not t.nbytes:
                continue
            src = buffer[off:off + t.nbytes]
            if t.is_contiguous():
                t.view(-1).view(torch.uint8).copy_(src, non_blocking=non_blocking)
            else:  # clone: a fresh, aligned storage that can be viewed as t.dtype
                t.copy_(src.clone().view(t.dtype).view(t.shape), non_blocking=non_blocking)


def _needed(tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> int:
    return max((off + t.nbytes for t, off in zip(tensors, offsets)), default=0)


def gather(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
    offsets: Sequence[int] | None = None,
    *,
    alignment: int = 64,
    backend: Backend = "auto",
    stream: "torch.cuda.Stream | None" = None,
) -> tuple[torch.Tensor, list[int]]:
    """Copy the bytes of every tensor into one 1-D uint8 buffer, tensor i at ``offsets[i]``.

    Args:
        tensors: tensors of any dtype and shape; contiguous or row-strided layouts use the
            native kernel, other layouts are copied by torch.
        out: destination buffer (1-D contiguous uint8, e.g. pinned host memory from
            :func:`alloc_pinned`); allocated on the first tensor's device when None.
        offsets: byte offset of each tensor in ``out``; regions must not overlap. Default:
            :func:`packed_offsets` with ``alignment``.
        backend, stream: as in :func:`batched_copy_`.

    Returns:
        (out, offsets): pass both to :func:`scatter` to copy the bytes back.
    """
    fn = "gather"
    tensors = validate_tensors(fn, tensors, writable=False)
    if offsets is None:
        offsets, needed = packed_offsets(tensors, alignment)
    else:
        offsets = validate_offsets(fn, offsets, tensors, disjoint=True)
        needed = _needed(tensors, offsets)
    if out is None:
        out = torch.empty(needed, dtype=torch.uint8, device=tensors[0].device if tensors else "cpu")
    out = validate_buffer(fn, "out", out, needed)
    kind = route(fn, [*tensors, out])
    native = select_native(fn, kind, backend)
    if native is None:
        _torch_gather(list(zip(tensors, offsets)), out, kind, stream)
        return out, list(offsets)
    ptrs, offs, row_bytes, rows, pitches, rest = _native_args(tensors, offsets)
    extra = {"stream": stream_handle(stream, [*tensors, out])} if kind == "cuda" else {}
    if ptrs:
        native.gather(out.data_ptr(), out.numel(), ptrs, offs, row_bytes, rows, pitches, **extra)
        increment_version(out)  # an in-place write for autograd, as with copy_
    if rest:
        _torch_gather(rest, out, kind, stream)
    return out, list(offsets)


def scatter(
    buffer: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    offsets: Sequence[int],
    *,
    backend: Backend = "auto",
    stream: "torch.cuda.Stream | None" = None,
) -> None:
    """Copy bytes ``buffer[offsets[i] : offsets[i] + tensors[i].nbytes]`` into ``tensors[i]``.

    The inverse of :func:`gather`; ``tensors`` are written in place and must not overlap.
    Arguments as in :func:`gather`.
    """
    fn = "scatter"
    tensors = validate_tensors(fn, tensors, writable=True)
    offsets = validate_offsets(fn, offsets, tensors, disjoint=False)
    buffer = validate_buffer(fn, "buffer", buffer, _needed(tensors, offsets))
    kind = route(fn, [*tensors, buffer])
    native = select_native(fn, kind, backend)
    if native is None:
        _torch_scatter(list(zip(tensors, offsets)), buffer, kind, stream)
        return
    ptrs, offs, row_bytes, rows, pitches, rest = _native_args(tensors, offsets)
    extra = {"stream": stream_handle(stream, [*tensors, buffer])} if kind == "cuda" else {}
    if ptrs:
        native.scatter(buffer.data_ptr(), buffer.numel(), ptrs, offs, row_bytes, rows, pitches, **extra)
        mark_native_writes(tensors, rest)
    if rest:
        _torch_scatter(rest, buffer, kind, stream)
