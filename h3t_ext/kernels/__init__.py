"""Batched tensor copies for activation offload, native where built, torch otherwise.

Offload moves many tensors of different sizes each microbatch. A Python loop of
``Tensor.copy_`` pays interpreter and dispatch overhead per tensor; these functions move
a whole group in one native call (``csrc/``, pybind11; the kernels use no torch headers, an
optional front end that reads tensor metadata in C++ does):

- :func:`batched_copy_`: ``dsts[i].copy_(srcs[i])`` for all i.
- :func:`gather` / :func:`scatter`: pack tensors into one contiguous (pinned) byte buffer
  at offsets and back; :func:`packed_offsets` computes aligned offsets.
- :func:`alloc_host` / :func:`alloc_pinned`: page-aligned, NUMA-placed (pinned) buffers.

On CPU the native kernel splits the bytes of the batch evenly over the cores (threads
only above a size threshold, see :func:`set_parallel_threshold`) with the GIL released.
With CUDA the same calls enqueue asynchronous copies on a stream. When the extension is
not built every function falls back to torch copies; :func:`active_backend` says which
path a device uses and :func:`native_unavailable_reason` why the native one is missing;
:func:`tensor_front_end` says whether CPU tensor batches are read in C++ or in Python.
"""
from h3t_ext.kernels._backend import (
    active_backend,
    describe,
    native_available,
    native_unavailable_reason,
    set_num_threads,
    set_parallel_threshold,
    tensor_front_end,
    threads_for,
)
from h3t_ext.kernels._layout import RowLayout, row_layout
from h3t_ext.kernels.copy import batched_copy_
from h3t_ext.kernels.host import alloc_host, alloc_pinned
from h3t_ext.kernels.pack import gather, packed_offsets, scatter

__all__ = [
    "RowLayout",
    "active_backend",
    "alloc_host",
    "alloc_pinned",
    "batched_copy_",
    "describe",
    "gather",
    "native_available",
    "native_unavailable_reason",
    "packed_offsets",
    "row_layout",
    "scatter",
    "set_num_threads",
    "set_parallel_threshold",
    "tensor_front_end",
    "threads_for",
]
