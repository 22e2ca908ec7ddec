"""Row-strided (2D) descriptions of torch tensors for the native copy kernels.

A tensor is *row-strided* when, after dropping size-1 dims and merging dims that are
laid out contiguously, it is at most two levels deep: ``rows`` rows of ``row_elems``
elements, consecutive rows ``pitch`` elements apart (a contiguous tensor is one row).
Other layouts return None and are copied by torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowLayout:
    """Layout of one tensor in elements."""

    rows: int
    """Number of rows (1 for a contiguous tensor)."""
    row_elems: int
    """Elements per row; the elements of a row are adjacent."""
    pitch: int
    """Distance between the starts of consecutive rows, in elements."""


@dataclass(frozen=True)
class PairCopy:
    """One row-strided copy in bytes (cudaMemcpy2D terms)."""

    rows: int
    row_bytes: int
    dst_pitch: int
    src_pitch: int


def row_layout(t: torch.Tensor) -> RowLayout | None:
    """The row-strided layout of ``t``, or None when it needs more than two levels."""
    numel = t.numel()
    if t.is_contiguous():
        return RowLayout(1, numel, numel)
    dims: list[list[int]] = []  # [size, stride], innermost last, contiguous runs merged
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if size == 1:
            continue
        if dims and stride == dims[0][1] * dims[0][0]:
            dims[0][0] *= size
        else:
            dims.insert(0, [size, stride])
    if len(dims) == 1:
        size, stride = dims[0]
        return RowLayout(1, numel, numel) if stride == 1 else RowLayout(size, 1, stride)
    if len(dims) == 2 and dims[1][1] == 1:
        return RowLayout(dims[0][0], dims[1][0], dims[0][1])
    return None


def pair_copy(dst: torch.Tensor, src: torch.Tensor) -> PairCopy | None:
    """The single row-strided copy moving ``src`` into ``dst`` (same shape and dtype), or None."""
    ld, ls = row_layout(dst), row_layout(src)
    if ld is None or ls is None:
        return None
    size = dst.element_size()
    if ld.rows == 1 and ls.rows == 1:
        nbytes = dst.numel() * size
        return PairCopy(1, nbytes, nbytes, nbytes)
    if ld.rows == 1:
        ld = RowLayout(ls.rows, ls.row_elems, ls.row_elems)
    elif ls.rows == 1:
        ls = RowLayout(ld.rows, ld.row_elems, ld.row_elems)
    if (ld.rows, ld.row_elems) != (ls.rows, ls.row_elems):
        return None
    return PairCopy(ld.rows, ld.row_elems * size, ld.pitch * size, ls.pitch * size)


def has_internal_overlap(t: torch.Tensor) -> bool:
    """True when two elements of ``t`` share memory (expanded views, overlapping rows)."""
    if any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride())):
        return True
    layout = row_layout(t)
    return layout is not None and layout.rows > 1 and layout.pitch < layout.row_elems
