"""Which elements of which parameters each data-parallel rank's distributed optimizer owns: megatron-core's
flat-buffer rule, for the CPU path's :class:`~h3t_training.loop.optimizer.DataParallelAdamW`.

megatron-core 0.16.1 (``distributed/param_and_grad_buffer.py``, ``optimizer/distrib_optimizer.py``): each model
chunk's DDP lays its parameters (those that need a gradient, in ``named_parameters`` order) into one gradient
buffer in reverse order (roughly the order the backward produces them); with the distributed optimizer every
parameter starts at a multiple of ``PARAM_ALIGNMENT`` elements, and the buffer is cut into buckets, each padded
to a multiple of lcm(d, ``BUCKET_ALIGNMENT``). A bucket closes once it holds ``bucket_size`` elements (None: one
bucket for the whole chunk) and around a shared (tied) embedding, which gets a bucket of its own. Each bucket is
split into d equal contiguous ranges, rank r owning the r-th: its optimizer steps the parts of the parameters
that fall in its ranges, whatever their boundaries, so a rank's share is 1/d of the buffer up to the padding.
Which bucket size applies (DDP's ``bucket_size``: ``--ddp-bucket-size``, else max(40M, 1M x d), None without
``--overlap-grad-reduce``, on pipeline ranks after the first and on model chunks after the first) is the
caller's (:func:`bucket_size`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from h3t_ext.costmodel.data_parallel import default_bucket_params

PARAM_ALIGNMENT = 64
"""Elements a parameter's start is padded to (128-byte aligned addresses for >= 16-bit values)."""
BUCKET_ALIGNMENT = 128
"""Elements a bucket's end is padded to, with d (256-byte aligned bucket starts; an even split over d)."""


@dataclass(frozen=True)
class OwnedSlice:
    """Elements [start, end) of parameter ``param`` (flattened), owned by data-parallel rank ``rank``."""

    param: int
    rank: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def bucket_size(dp_size: int, *, ddp_bucket_size: Optional[int], overlap_grad_reduce: bool, pipeline_rank: int,
                chunk: int) -> Optional[int]:
    """The bucket size megatron-core's DDP (and Megatron-LM's ``get_model``) gives model chunk ``chunk`` on
    pipeline rank ``pipeline_rank`` (None: one bucket)."""
    if not overlap_grad_reduce or pipeline_rank > 0 or chunk > 0:
        return None
    return ddp_bucket_size if ddp_bucket_size is not None else default_bucket_params(dp_size)


def buffer_layout(numels: Sequence[int], dp_size: int, size: Optional[int],
                  shared: Sequence[bool] = ()) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """One chunk's gradient buffer: ([start, end) of each parameter, in the chunk's order; [start, end) of each
    bucket, padded), parameters of ``numels`` elements laid out in reverse order; ``shared[i]``: parameter i is a
    shared embedding (its own bucket)."""
    shared = list(shared) or [False] * len(numels)
    divisor = math.lcm(dp_size, BUCKET_ALIGNMENT)
    spans: list[Optional[tuple[int, int]]] = [None] * len(numels)
    buckets: list[tuple[int, int]] = []
    start = bucket_start = 0
    in_bucket = 0

    def close(end: int) -> int:
        nonlocal bucket_start, in_bucket
        padded = _pad(end, divisor)
        buckets.append((bucket_start, padded))
        bucket_start, in_bucket = padded, 0
        return padded

    end = 0
    for i in reversed(range(len(numels))):
        start = _pad(start, PARAM_ALIGNMENT)
        if shared[i] and in_bucket:
            start = close(start)
        end = start + numels[i]
        spans[i] = (start, end)
        in_bucket += 1
        if (size is not None and end - bucket_start >= size) or shared[i]:
            start = close(end)
        else:
            start = end
    if in_bucket:
        close(end)
    return [s for s in spans if s is not None], buckets


def owned_slices(chunks: Sequence[Sequence[int]], dp_size: int, sizes: Sequence[Optional[int]],
                 shared: Sequence[Sequence[bool]] = ()) -> list[OwnedSlice]:
    """Every rank's slices of every parameter; parameters are numbered across the chunks in order (chunk 0's
    first), ``sizes[c]`` is chunk c's bucket size. Sorted by parameter, then rank."""
    out: list[OwnedSlice] = []
    base = 0
    for c, numels in enumerate(chunks):
        spans, buckets = buffer_layout(numels, dp_size, sizes[c], shared[c] if shared else ())
        for i, (p_start, p_end) in enumerate(spans):
            for b_start, b_end in buckets:
                if not b_start <= p_start < b_end:
                    continue
                width = (b_end - b_start) // dp_size
                for r in range(dp_size):
                    lo, hi = max(p_start, b_start + r * width), min(p_end, b_start + (r + 1) * width)
                    if hi > lo:
                        out.append(OwnedSlice(base + i, r, lo - p_start, hi - p_start))
        base += len(numels)
    return out
