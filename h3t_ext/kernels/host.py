"""Host buffers for offload: page-aligned, NUMA-placed, pinned when CUDA is present."""
from __future__ import annotations

import torch

from h3t_ext.kernels import _backend


def _validate_nbytes(fn: str, nbytes: object) -> int:
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"{fn}: nbytes must be an int >= 0, got {nbytes!r}")
    return nbytes


def alloc_host(nbytes: int, *, numa_node: int | None = None) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of ``nbytes``, page-aligned, its pages bound to ``numa_node``.

    Uses the native allocator (mmap + mbind) when built; otherwise ``torch.empty`` (and
    ``numa_node`` is ignored). The memory lives as long as the returned tensor.
    """
    fn = "alloc_host"
    _validate_nbytes(fn, nbytes)
    if numa_node is not None and (not isinstance(numa_node, int) or numa_node < 0):
        raise ValueError(f"{fn}: numa_node must be None or an int >= 0, got {numa_node!r}")
    native = _backend.cpu_module()
    if native is None or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    node = -1 if numa_node is None else numa_node
    try:
        buf = native.alloc_host(nbytes, node)
    except RuntimeError as exc:
        raise ValueError(f"{fn}: {exc}") from None
    return torch.frombuffer(buf, dtype=torch.uint8)  # the tensor keeps buf (and its pages) alive


def alloc_pinned(nbytes: int, *, device: int | torch.device | None = None, numa_local: bool = True) -> torch.Tensor:
    """A 1-D uint8 pinned host tensor of ``nbytes`` for copies to and from ``device``.

    With the native CUDA module and ``numa_local``, its pages are placed on the NUMA node
    of the GPU's PCI slot (when the platform reports one) and then registered with CUDA.
    Without the module it is ``torch.empty(..., pin_memory=True)``; without CUDA it is
    ordinary (pageable) host memory from :func:`alloc_host`.
    """
    fn = "alloc_pinned"
    _validate_nbytes(fn, nbytes)
    if not torch.cuda.is_available():
        return alloc_host(nbytes)
    index = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if index.type != "cuda":
        raise ValueError(f"{fn}: device must be a CUDA device, got {index}")
    native = _backend.cuda_module()
    if native is None or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    buf = native.alloc_pinned(nbytes, index.index or 0, bool(numa_local))
    return torch.frombuffer(buf, dtype=torch.uint8)
