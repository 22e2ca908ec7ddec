"""Which copy implementation is active: the native extension modules or torch copies.

The native modules are optional (built by ``setup.py`` when pybind11 and a compiler are
present); this module imports them once and records why one is missing.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

NATIVE_CPU = "native-cpu"
NATIVE_CUDA = "native-cuda"
TORCH = "torch"


def _try_import(name: str) -> tuple[ModuleType | None, str | None]:
    try:
        return importlib.import_module(f"h3t_ext.kernels.{name}"), None
    except ImportError as exc:
        return None, f"{name} not importable: {exc}"


_CPU, _CPU_ERROR = _try_import("_copy_cpu")
_CUDA, _CUDA_ERROR = _try_import("_copy_cuda")
# The tensor front end of the CPU kernels (built against torch's headers; optional).
_TENSOR, _TENSOR_ERROR = _try_import("_copy_torch") if _CPU is not None else (None, _CPU_ERROR)


def cpu_module() -> ModuleType | None:
    """The native CPU module, or None when it was not built."""
    return _CPU


def tensor_module() -> ModuleType | None:
    """The native tensor front end (reads tensor metadata in C++), or None when not built."""
    return _TENSOR


def tensor_front_end() -> str:
    """How CPU batches of tensors reach the native kernels: ``"native"`` (the front end
    reads them in C++), ``"python"`` (validated in Python, then one native call) or
    ``"torch"`` (no native kernels)."""
    if _CPU is None:
        return TORCH
    return "native" if _TENSOR is not None else "python"


def tensor_front_end_reason() -> str | None:
    """Why the native tensor front end is not active, or None when it is."""
    return _TENSOR_ERROR if _TENSOR is None else None


def cuda_module() -> ModuleType | None:
    """The native CUDA module when it was built and torch sees a GPU, else None."""
    return _CUDA if _CUDA is not None and torch.cuda.is_available() else None


def native_available(device: str | torch.device = "cpu") -> bool:
    """True when copies between tensors of this device type use the native kernels."""
    kind = torch.device(device).type
    if kind == "cpu":
        return _CPU is not None
    if kind == "cuda":
        return cuda_module() is not None
    return False


def active_backend(device: str | torch.device = "cpu") -> str:
    """``"native-cpu"``, ``"native-cuda"`` or ``"torch"``: the path copies on ``device`` take."""
    kind = torch.device(device).type
    if not native_available(kind):
        return TORCH
    return NATIVE_CPU if kind == "cpu" else NATIVE_CUDA


def native_unavailable_reason(device: str | torch.device = "cpu") -> str | None:
    """Why the native path for ``device`` is not active, or None when it is."""
    kind = torch.device(device).type
    if native_available(kind):
        return None
    if kind == "cpu":
        return _CPU_ERROR
    if kind == "cuda":
        return _CUDA_ERROR or "torch.cuda.is_available() is False"
    return f"no native kernels for device type {kind!r}"


def describe(device: str | torch.device = "cpu") -> str:
    """One line naming the copy path of ``device`` and, when it is not native, why."""
    kind = torch.device(device).type
    backend = active_backend(kind)
    if backend == TORCH:
        return f"torch copies ({native_unavailable_reason(kind)})"
    if kind != "cpu":
        return f"{backend} kernels"
    front = tensor_front_end()
    why = "" if front == "native" else f": {tensor_front_end_reason()}"
    return f"{backend} kernels (tensor batches read in {'C++' if front == 'native' else 'Python'}{why})"


def set_num_threads(n: int) -> None:
    """Maximum threads of the native CPU copies (0: all cores). No-op without the extension."""
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"set_num_threads: n must be an int >= 0, got {n!r}")
    if _CPU is not None:
        _CPU.set_num_threads(n)


def set_parallel_threshold(nbytes: int) -> None:
    """Batches smaller than ``nbytes`` are copied by the calling thread alone."""
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"set_parallel_threshold: nbytes must be an int >= 0, got {nbytes!r}")
    if _CPU is not None:
        _CPU.set_parallel_threshold(nbytes)


def threads_for(total_bytes: int) -> int:
    """Threads the native CPU path uses for a batch of ``total_bytes`` (1 without it)."""
    return int(_CPU.plan_threads(total_bytes)) if _CPU is not None else 1
