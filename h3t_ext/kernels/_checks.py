"""Argument validation, routing and write bookkeeping shared by the copy wrappers.

Every error is one line naming the function and the offending argument (with index).
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from types import ModuleType
from typing import Literal

import torch
from torch.autograd.graph import increment_version

from h3t_ext.kernels import _backend
from h3t_ext.kernels._layout import has_internal_overlap

Backend = Literal["auto", "native", "torch"]
_BACKENDS = ("auto", "native", "torch")


def _validate_backend(fn: str, backend: str) -> None:
    if backend not in _BACKENDS:
        raise ValueError(f"{fn}: backend must be one of {_BACKENDS}, got {backend!r}")


def _validate_tensor_list(fn: str, name: str, tensors: object) -> tuple[torch.Tensor, ...]:
    """The tensors as a tuple: it keeps them alive while a native copy runs without the GIL."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{fn}: {name} must be a list or tuple of torch.Tensor, got {type(tensors).__name__}")
    tensors = tuple(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return tensors


def _validate_writable(fn: str, name: str, i: int, t: torch.Tensor) -> None:
    if not t.is_contiguous() and has_internal_overlap(t):
        raise ValueError(f"{fn}: {name}[{i}] has overlapping elements (an expanded view); it cannot be written")
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(f"{fn}: {name}[{i}] is an inference tensor; it can be written only inside torch.inference_mode()")


def mark_native_writes(written: Sequence[torch.Tensor], by_torch: Sequence[tuple[torch.Tensor, object]]) -> None:
    """Bump the version counter of every tensor in ``written`` a native kernel wrote, i.e. all
    but the first elements of ``by_torch`` (whose ``copy_`` bumps them itself): for autograd
    the write is an in-place change, as with ``copy_``."""
    skip = {id(t) for t, _ in by_torch}
    increment_version([t for t in written if id(t) not in skip])


def validate_pairs(fn: str, dsts: object, srcs: object) -> None:
    """dsts and srcs: equal-length lists of tensors with equal dtype and shape, dsts writable."""
    dsts = _validate_tensor_list(fn, "dsts", dsts)
    srcs = _validate_tensor_list(fn, "srcs", srcs)
    if len(dsts) != len(srcs):
        raise ValueError(f"{fn}: dsts has {len(dsts)} tensors but srcs has {len(srcs)}")
    for i, (d, s) in enumerate(zip(dsts, srcs)):
        if d.dtype != s.dtype:
            raise TypeError(f"{fn}: dsts[{i}] has dtype {d.dtype} but srcs[{i}] has dtype {s.dtype}")
        if d.shape != s.shape:
            raise ValueError(f"{fn}: dsts[{i}] has shape {tuple(d.shape)} but srcs[{i}] has shape {tuple(s.shape)}")
        _validate_writable(fn, "dsts", i, d)


def validate_tensors(fn: str, tensors: object, *, writable: bool) -> Sequence[torch.Tensor]:
    """A list of tensors (to be written when ``writable``)."""
    tensors = _validate_tensor_list(fn, "tensors", tensors)
    if writable:
        for i, t in enumerate(tensors):
            _validate_writable(fn, "tensors", i, t)
    return tensors


def validate_buffer(fn: str, name: str, buffer: object, needed: int) -> torch.Tensor:
    """A 1-D contiguous uint8 tensor of at least ``needed`` bytes."""
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(buffer).__name__}")
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"{fn}: {name} must be a 1-D contiguous torch.uint8 tensor, got dtype {buffer.dtype} "
                         f"shape {tuple(buffer.shape)}")
    if buffer.numel() < needed:
        raise ValueError(f"{fn}: {name} holds {buffer.numel()} bytes but the tensors need {needed}")
    return buffer


def validate_offsets(fn: str, offsets: object, tensors: Sequence[torch.Tensor], *, disjoint: bool) -> list[int]:
    """One int offset >= 0 per tensor; regions pairwise disjoint when ``disjoint``."""
    if not isinstance(offsets, (list, tuple)):
        raise TypeError(f"{fn}: offsets must be a list or tuple of int, got {type(offsets).__name__}")
    if len(offsets) != len(tensors):
        raise ValueError(f"{fn}: offsets has {len(offsets)} entries but tensors has {len(tensors)}")
    for i, off in enumerate(offsets):
        if not isinstance(off, int) or isinstance(off, bool) or off < 0:
            raise ValueError(f"{fn}: offsets[{i}] must be an int >= 0, got {off!r}")
    if disjoint:
        regions = sorted((off, off + t.nbytes, i) for i, (off, t) in enumerate(zip(offsets, tensors)) if t.nbytes)
        for (_, end, i), (start, _, j) in zip(regions, regions[1:]):
            if start < end:
                raise ValueError(f"{fn}: the region of offsets[{j}] overlaps the region of offsets[{i}]")
    return list(offsets)


def route(fn: str, tensors: Sequence[torch.Tensor]) -> str:
    """Device type of a copy group: "cpu", "cuda" (cuda tensors, maybe with host ones) or "other"."""
    if all(t.is_cpu for t in tensors):  # t.is_cpu is much cheaper than t.device.type
        return "cpu"
    if all(t.is_cpu or t.is_cuda for t in tensors):
        return "cuda"
    return "other"


def select_native(fn: str, kind: str, backend: str) -> ModuleType | None:
    """The native module to use for this group, or None for torch copies."""
    _validate_backend(fn, backend)
    if backend == "torch":
        return None
    module = {"cpu": _backend.cpu_module, "cuda": _backend.cuda_module}.get(kind, lambda: None)()
    if module is None and backend == "native":
        raise RuntimeError(f"{fn}: backend='native' but {_backend.native_unavailable_reason(kind)}")
    return module


def stream_handle(stream: object, tensors: Sequence[torch.Tensor]) -> int:
    """Integer cudaStream_t of ``stream`` (default: the current stream of the first CUDA tensor)."""
    if stream is None:
        device = next(t.device for t in tensors if t.device.type == "cuda")
        return int(torch.cuda.current_stream(device).cuda_stream)
    handle = getattr(stream, "cuda_stream", None)
    if handle is None:
        raise TypeError(f"stream must be a torch.cuda.Stream, got {type(stream).__name__}")
    return int(handle)


def stream_context(kind: str, stream: object) -> contextlib.AbstractContextManager:
    """``torch.cuda.stream(stream)`` for CUDA groups with an explicit stream, else a no-op."""
    if kind == "cuda" and stream is not None:
        return torch.cuda.stream(stream)
    return contextlib.nullcontext()
