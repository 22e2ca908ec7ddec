"""What :class:`~h3t_ext.runtime.memory.activations.ActivationManager` keeps of each saved tensor: the record of a
saved storage (:class:`Record`), the handle autograd holds in its place (:class:`Saved`), ckpt=ours's recompute recipe
(:class:`Recipe`) and the state of a microbatch-chunk or one of its layer segments (:class:`ChunkState`), with the
storage helpers the pack hook and the offload use. Plain bookkeeping: no copies start here."""
from __future__ import annotations

from typing import Optional

import torch

from h3t_ext.runtime.memory.device import Event

ALIGN = 64
"""Byte alignment of every record inside host buffers and reload slots."""


def align(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


class Record:
    """One storage saved by a microbatch-chunk's forward."""

    __slots__ = ("flat", "nbytes", "off_bytes", "host_offset", "slot_offset", "tail", "storage_ref", "leaves",
                 "ptr", "group", "released")

    def __init__(self, flat: torch.Tensor, ptr: int, group: "ChunkState"):
        self.flat: Optional[torch.Tensor] = flat  # uint8 over the whole storage, None once offloaded
        self.ptr, self.group = ptr, group  # storage address; what moves it (the chunk, or its layer segment)
        self.nbytes = flat.numel()
        self.off_bytes = 0  # leading bytes that go to host memory
        self.host_offset = 0
        self.slot_offset = 0
        self.tail: Optional[torch.Tensor] = None  # device copy of the kept bytes of a split record
        self.storage_ref = None  # StorageWeakRef, kept when the manager tracks storages
        self.leaves: list = []  # weakrefs to grad-requiring leaves (received stage inputs) on this storage
        self.released = False  # layer segment: its backward is over and the manager let go of its bytes


class Saved:
    __slots__ = ("state", "rec", "dtype", "size", "stride", "offset", "segment")

    def __init__(self, state: "ChunkState", rec: Record, t: torch.Tensor, segment: Optional["ChunkState"] = None):
        self.state, self.rec, self.dtype = state, rec, t.dtype
        self.segment = segment  # layer-granular: the layer segment that saved it (its first unpack: that layer's backward)
        self.size, self.stride, self.offset = tuple(t.size()), tuple(t.stride()), t.storage_offset()


class Recipe:
    __slots__ = ("fn", "inputs")

    def __init__(self, fn, inputs: tuple):
        self.fn, self.inputs = fn, inputs


class ChunkState:
    """A microbatch-chunk, or (``layer`` set) one layer segment of it: the bytes one OFFLOAD/RELOAD moves."""

    def __init__(self, key: tuple[int, int], layer: Optional[int] = None):
        self.key, self.layer = key, layer
        self.records: list[Record] = []
        self.by_storage: dict[int, Record] = {}
        self.small: dict[int, tuple[torch.Tensor, int]] = {}
        self.saved_bytes = 0
        self.small_bytes = 0
        self.recomputed = 0
        self.host: Optional[torch.Tensor] = None
        self.off_event: Optional[Event] = None
        self.offloaded = False  # offload issued
        self.dropped = False  # device bytes of the offloaded part released
        self.reload_event: Optional[Event] = None
        self.reload_waited = False
        self.slot: Optional[int] = None
        self.slot_bytes = 0
        self.slot_given_back = False  # layer segment: its slot went to another segment
        # layer-granular (chunk states only): segments, their planned offload fractions and reloads
        self.segments: list[ChunkState] = []
        self.layer_starts = 0
        self.offload_fractions: dict[int, float] = {}
        self.reload_layers: set[int] = set()
        self.read_segments: set[int] = set()

    @property
    def layer_granular(self) -> bool:
        return bool(self.offload_fractions)

    @property
    def current_segment(self) -> "ChunkState":
        return self.segments[-1]


def is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def release_leaves(rec: Record) -> None:
    """Detach grad-requiring leaves (a stage's received input, which the schedule and the leaf's
    AccumulateGrad node keep for its ``.grad``) from an offloaded storage, so that it is really
    freed: their data becomes a one-element tensor expanded to their shape (the same thing
    Megatron does to sent outputs). Autograd reads the saved copy through the manager instead."""
    ptr = rec.flat.untyped_storage().data_ptr()
    for ref in rec.leaves:
        leaf = ref()
        if leaf is not None and leaf.untyped_storage().data_ptr() == ptr:
            leaf.data = torch.empty((1,), dtype=leaf.dtype, device=leaf.device).expand(leaf.shape)
    rec.leaves = []


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


__all__ = ["ALIGN", "ChunkState", "Recipe", "Record", "Saved", "align", "flat_bytes", "is_parameter",
           "release_leaves"]
