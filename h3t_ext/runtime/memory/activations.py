"""Fractional activation offload of pipeline microbatch-chunks (and the hooks of ckpt=ours).

Each microbatch-chunk's forward runs under ``torch.autograd.graph.saved_tensors_hooks``. The pack
hook leaves parameters alone, keeps tensors whose storage is smaller than ``min_offload_bytes`` as
they are (counted as small), and turns every other saved tensor into a handle on a per-storage
record, so views of one storage are counted and moved once. A tensor that ckpt=ours marked as
recomputable (see :mod:`h3t_ext.runtime.modules.recompute_ours`) becomes a recipe instead.

Timeline, following the schedule builder's OFFLOAD/RELOAD semantics:

* ``offload(mb, chunk)`` (right after its forward) copies the first ``alpha`` of the chunk's saved
  bytes (records in save order, the boundary record split) into one pinned host buffer on the
  ``d2h`` stream. The device bytes are dropped when the next compute scope ends; the kept tail of
  a split record is cloned then, after the whole records have been dropped.
* ``reload(mb, chunk)`` copies them back into one slot of a reusable two-slot device buffer on the
  ``h2d`` stream (the opposite PCIe direction). The slot is free again after ``release``; the two slots exist from
  the first offload of an iteration to its end (``end_iteration`` frees them, before the optimizer step).
* In ``backward_scope`` the first unpack waits for the reload (and reloads first if the schedule
  had no RELOAD for it); a chunk that was never offloaded is read in place.

Layer-granular offload (pipeline size 1; the schedule's OFFLOAD/RELOAD actions with a ``layer``, handed to
``forward_scope`` / ``backward_scope`` with the compute action they run in): the layers of the h3t layer spec
tell the manager where each layer's forward starts (:func:`h3t_ext.runtime.modules.layer_boundary.layer_starts`),
so the chunk's records are split into *layer segments* (segment l: what is saved from layer l's start to layer
l+1's; the embedding's saves are in segment 0, the output layer's in the last). When layer l+1's forward
starts, segment l-1's offloaded bytes are dropped (its copy overlapped layer l's forward) and the copy of
``layer_offload_fractions(alpha, L)[l]`` of segment l's bytes starts. In backward the first unpack of a tensor
saved in segment l+1 is where layer l+1's backward starts: the slots of the later segments are free again,
and segment l's reload starts (into one of two reload slots, each the size of the largest offloaded
segment); the first unpack of segment l waits for it, and the manager lets go of the later segments' bytes (their
backward is over), as autograd without the manager frees saved tensors when their backward has used them. The slots
are allocated at a microbatch's first reload and freed when its backward ends (``release``), as TransformerEngine's
layer offload allocates its reloads in the backward: they never sit through a forward's peak, where the layers after
the last offloaded one are still saved (the first reload starts once their backward has freed them). A segment's
records are forgotten by storage once dropped, so a freed storage whose address comes back later in the forward is a
new record.

A grad-requiring leaf among the saved tensors is a received stage input, which the schedule (and
the leaf's ``AccumulateGrad`` node) keeps for its ``.grad``; when its storage is offloaded its
data is replaced by a one-element expanded tensor, so the device bytes are really freed.

Resident bytes (``ActivationStats.peak_resident_bytes``) are the saved bytes the manager holds on
the device (records, small tensors, split tails) plus the reload slots while they exist, sampled at every pack,
at every slot allocation and at the end of every compute scope.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence, Union

import torch

from h3t_ext.runtime.config import H3TConfig, RuntimeConfigError
from h3t_ext.runtime.memory.device import DeviceLayer, Event, make_device_layer
from h3t_ext.runtime.memory.host_pool import HostPool
from h3t_ext.runtime.memory.saved_records import (ChunkState, Recipe, Record, Saved, align, flat_bytes,
                                                    is_parameter, release_leaves)
from h3t_ext.runtime.modules.layer_boundary import listening
from h3t_ext.runtime.modules.recompute import recording_under
from h3t_ext.runtime.modules.recompute_ours import lookup_recipe
from h3t_ext.schedule.actions import Action, ActionKind, layer_offload_fractions

@dataclass
class ActivationStats:
    """What the manager measured since the last :meth:`ActivationManager.reset_stats`."""

    peak_resident_bytes: int = 0
    """Saved activation bytes on the device at the peak (records, small tensors, reload slots)."""
    offloaded_bytes: int = 0
    """Bytes copied to host memory."""
    saved_bytes: dict = field(default_factory=dict)
    """(microbatch, chunk) -> bytes of the storages its forward saved (offloadable ones)."""
    small_bytes: dict = field(default_factory=dict)
    """(microbatch, chunk) -> bytes of saved storages below ``min_offload_bytes`` (never moved)."""
    recomputed: dict = field(default_factory=dict)
    """(microbatch, chunk) -> saved tensors replaced by a recompute recipe (ckpt=ours)."""
    host_pool_bytes: int = 0
    """Bytes of host buffers the pool owns."""
    host_pool_allocations: int = 0
    """Host buffers the pool has allocated since it was created."""
    reload_buffer_bytes: int = 0
    """Most bytes of reload slots held at once (two slots; more only when a backward read a segment out of order)."""


class ActivationManager:
    """Saved-tensor hooks, offload/reload and resident-byte accounting of one pipeline stage."""

    def __init__(self, offload_alpha: float, device_layer: DeviceLayer, *, min_offload_bytes: int = 4096,
                 track_storages: bool = False):
        if not 0.0 <= float(offload_alpha) <= 1.0:
            raise ValueError(f"offload_alpha must be in [0, 1], got {offload_alpha}")
        self.alpha = float(offload_alpha)
        self.device = device_layer
        self.min_offload_bytes = int(min_offload_bytes)
        self.track_storages = track_storages
        self._d2h = device_layer.new_stream("d2h")
        self._h2d = device_layer.new_stream("h2d")
        self.pool = HostPool(device_layer.empty_host)
        self._states: dict[tuple[int, int], ChunkState] = {}
        self._to_drop: list[ChunkState] = []
        self._slots: list[Optional[torch.Tensor]] = [None, None]
        self._slot_owner: list[Optional[ChunkState]] = [None, None]
        self._slot_free: list[Optional[Event]] = [None, None]
        self._resident = 0
        self._suspended = 0
        self._in_forward: Optional[ChunkState] = None
        self.stats = ActivationStats()
        self._new_iteration = False

    # ------------------------------------------------------------------ scopes
    @contextlib.contextmanager
    def forward_scope(self, microbatch: int, chunk: int, layer_actions: Sequence[Action] = (),
                      num_layers: Optional[int] = None) -> Iterator[None]:
        """Run the forward of one microbatch-chunk with its saved tensors managed. ``layer_actions``: the
        schedule's layer-granular OFFLOADs of this forward (the chunk has ``num_layers`` layers); each runs when
        the forward of the layer after it starts."""
        key = (microbatch, chunk)
        assert self._in_forward is None, "forward scopes do not nest"
        assert key not in self._states, f"microbatch-chunk {key} is still held (no release after its backward)"
        if self._new_iteration:
            self.reset_stats()
        st = self._states[key] = ChunkState(key)
        if layer_actions:
            if num_layers is None:
                raise ValueError("layer-granular offload needs the number of layers of the chunk")
            fractions = layer_offload_fractions(self.alpha, num_layers)
            for a in layer_actions:
                assert a.kind is ActionKind.OFFLOAD and (a.microbatch, a.chunk) == key and a.layer is not None, a
                st.offload_fractions[a.layer] = fractions[a.layer]
            st.segments.append(ChunkState(key, 0))
        self._in_forward = st
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), listening(self._layer_starts), \
                    recording_under(self.suspended):
                yield
        finally:
            self._in_forward = None
            self.stats.saved_bytes[key] = st.saved_bytes
            self.stats.small_bytes[key] = st.small_bytes
            self.stats.recomputed[key] = st.recomputed
            self._compute_ended()
        missed = [l for l in st.offload_fractions if l >= len(st.segments) - 1]
        if missed:
            raise RuntimeConfigError(
                f"layer-granular offload: the forward of microbatch {microbatch} saw {st.layer_starts} layer starts, "
                f"too few to offload layer(s) {missed}; build the model with the h3t layer spec "
                "(h3t_ext.runtime.modules.layer_specs), whose layers mark their starts")

    @contextlib.contextmanager
    def backward_scope(self, microbatch: int, chunk: int, layer_actions: Sequence[Action] = ()) -> Iterator[None]:
        """Run the backward of one microbatch-chunk; its first unpack waits for its reload. ``layer_actions``:
        the schedule's layer-granular RELOADs of this backward; each runs when the backward of the layer after
        it starts (the first unpack of what that layer saved)."""
        st = self._states.get((microbatch, chunk))
        assert st is not None, f"backward of {(microbatch, chunk)} without its forward"
        for a in layer_actions:
            assert a.kind is ActionKind.RELOAD and (a.microbatch, a.chunk) == st.key and a.layer is not None, a
            st.reload_layers.add(a.layer)
        try:
            yield
        finally:
            self._compute_ended()

    def _layer_starts(self) -> None:
        """A transformer layer's forward starts (the h3t layer spec's layers call this): a new layer segment;
        segment l-1's offloaded bytes are dropped and segment l's offload starts (l: the segment that ends)."""
        st = self._in_forward
        if st is None or self._suspended or not st.layer_granular:
            return
        st.layer_starts += 1
        if st.layer_starts == 1:  # layer 0: segment 0 (with what the embedding saved) goes on
            return
        k = len(st.segments)  # the segment that starts now
        if k >= 2 and st.segments[k - 2] in self._to_drop:  # its copy overlapped layer k-1's forward
            self._drop_device_bytes(st.segments[k - 2])
        ending = st.segments[k - 1]
        fraction = st.offload_fractions.get(k - 1)
        if fraction:
            self._offload(ending, int(fraction * ending.saved_bytes))
        st.segments.append(ChunkState(st.key, k))

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Saved tensors are left alone inside (e.g. a full-recompute forward run in backward)."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    # ------------------------------------------------------------------ pack / unpack
    def _pack(self, t: torch.Tensor):
        st = self._in_forward
        if self._suspended or st is None or t.layout != torch.strided or is_parameter(t):
            return t
        recipe = lookup_recipe(t)
        if recipe is not None:
            fn, inputs = recipe
            st.recomputed += 1
            return Recipe(fn, tuple(self._pack_plain(st, x) for x in inputs))
        return self._pack_plain(st, t)

    def _pack_plain(self, st: ChunkState, t: torch.Tensor):
        if is_parameter(t) or not isinstance(t, torch.Tensor):
            return t
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes < self.min_offload_bytes:
            if ptr not in st.small:
                st.small[ptr] = (t, nbytes)
                st.small_bytes += nbytes
                self._add_resident(nbytes)
            return t
        segment = st.current_segment if st.layer_granular else None
        rec = st.by_storage.get(ptr)
        if rec is None:
            group = segment or st
            with torch.no_grad():
                rec = Record(flat_bytes(t), ptr, group)
            if self.track_storages:
                from torch.multiprocessing.reductions import StorageWeakRef  # noqa: PLC0415

                rec.storage_ref = StorageWeakRef(storage)
            st.by_storage[ptr] = rec
            st.records.append(rec)
            st.saved_bytes += nbytes
            if segment is not None:
                segment.records.append(rec)
                segment.saved_bytes += nbytes
            self._add_resident(nbytes)
        if t.is_leaf and t.requires_grad:
            rec.leaves.append(weakref.ref(t))
        return Saved(rec.group, rec, t, segment)

    def _unpack(self, packed):
        if isinstance(packed, Saved):
            return self._materialize(packed)
        if isinstance(packed, Recipe):
            inputs = [self._unpack(x) for x in packed.inputs]
            with torch.no_grad(), self.suspended():
                return packed.fn(*inputs)
        return packed

    def _materialize(self, s: Saved) -> torch.Tensor:
        rec, st = s.rec, s.state
        seg = s.segment
        if seg is not None and seg.layer not in self._states[seg.key].read_segments:
            self._segment_backward_starts(self._states[seg.key], seg.layer)
        if rec.released:
            raise AssertionError(f"a tensor saved in layer {rec.group.layer} of microbatch-chunk {rec.group.key} was "
                                 "read after the backward of an earlier layer had started (its bytes were let go)")
        if rec.flat is not None:
            flat = rec.flat
        else:
            if st.slot_given_back:
                raise AssertionError(f"layer {st.layer} of microbatch-chunk {st.key} was read after the backward of "
                                     "an earlier layer had started (its reload slot is reused)")
            self._ensure_reloaded(st)
            flat = self._slots[st.slot][rec.slot_offset:rec.slot_offset + rec.nbytes]
            self.device.check_ready(flat)
        base = flat.view(s.dtype)
        return base.as_strided(s.size, s.stride, base.storage_offset() + s.offset)

    def _ensure_reloaded(self, st: ChunkState) -> None:
        if st.reload_event is None:  # the schedule had no RELOAD for it: reload now
            self._start_reload(st)
        if not st.reload_waited:
            self._wait_for_reload(st)

    def _wait_for_reload(self, st: ChunkState) -> None:
        self.device.wait(st.reload_event)
        st.reload_waited = True

    def _segment_backward_starts(self, st: ChunkState, k: int) -> None:
        """The first unpack of layer segment ``k``: the later segments' backward is over (their slots are
        free again) and segment k-1's RELOAD starts, to overlap layer k's backward."""
        st.read_segments.add(k)
        for seg in st.segments[k + 1:]:
            self._give_back_slot(seg)
            self._let_go(seg)
        for l in sorted(st.reload_layers, reverse=True):
            if l >= k - 1:
                self._start_reload(st.segments[l])
        if k == 0:  # nothing left to reload: the slot segment 1 gave back goes before the embedding's backward
            self._free_slots()

    def _let_go(self, seg: ChunkState) -> None:
        """Layer segment ``seg``'s backward is over (autograd has read what it saved): the manager stops holding its
        device bytes, so they go when autograd frees its last use, as without the manager, and the next reload's
        slot takes their place rather than adding to them."""
        for rec in seg.records:
            if rec.released:
                continue
            self._resident -= self._device_bytes(rec)
            rec.flat = rec.tail = None
            rec.released = True

    def _give_back_slot(self, st: ChunkState) -> None:
        if st.slot is None:
            return
        self._slot_owner[st.slot] = None
        self._slot_free[st.slot] = self.device.compute_event()
        st.slot, st.slot_given_back = None, True

    # ------------------------------------------------------------------ offload / reload / release
    def offload(self, microbatch: int, chunk: int) -> None:
        """Start copying alpha of this microbatch-chunk's saved bytes to host memory (async)."""
        st = self._states[(microbatch, chunk)]
        self._offload(st, int(self.alpha * st.saved_bytes))

    def _offload(self, st: ChunkState, target: int) -> None:
        """Start copying the first ``target`` saved bytes of ``st`` (a chunk or a layer segment) to the host."""
        assert not st.offloaded, f"microbatch-chunk {st.key} (layer {st.layer}) offloaded twice"
        if target <= 0:
            return
        plan: list[Record] = []
        left = target
        for rec in st.records:
            if left <= 0:
                break
            rec.off_bytes = min(rec.nbytes, left)
            left -= rec.off_bytes
            plan.append(rec)
        host_bytes = slot_bytes = 0
        for rec in plan:
            rec.host_offset, rec.slot_offset = host_bytes, slot_bytes
            host_bytes += align(rec.off_bytes)
            slot_bytes += align(rec.nbytes)
        st.host, host_ready = self.pool.acquire(host_bytes)
        dsts = [st.host[r.host_offset:r.host_offset + r.off_bytes] for r in plan]
        srcs = [r.flat[:r.off_bytes] for r in plan]
        after = (self.device.compute_event(),) if host_ready is None else (self.device.compute_event(), host_ready)
        st.off_event = self.device.copy_async(self._d2h, dsts, srcs, after=after)
        st.offloaded, st.slot_bytes = True, slot_bytes
        self.stats.offloaded_bytes += sum(r.off_bytes for r in plan)
        if st.layer is None:  # a pipeline's chunk: the double buffer exists from the first offload on
            for i in (0, 1):
                self._ensure_slot(i, slot_bytes)
        self._to_drop.append(st)

    def reload(self, microbatch: int, chunk: int) -> None:
        """Start copying this microbatch-chunk's offloaded bytes back into a reload slot (async)."""
        self._start_reload(self._states[(microbatch, chunk)])

    def _start_reload(self, st: ChunkState) -> None:
        if not st.offloaded or st.reload_event is not None:
            return
        if not st.dropped:
            self._drop_device_bytes(st)
        free = [i for i, owner in enumerate(self._slot_owner) if owner is None]
        assert free or st.layer is not None, "both reload slots are in use: more than two reloads outstanding"
        if not free:  # a layer segment read out of order (on demand): one more slot
            self._slots.append(None)
            self._slot_owner.append(None)
            self._slot_free.append(None)
            free = [len(self._slots) - 1]
        i = free[0]
        self._ensure_slot(i, st.slot_bytes)
        self._slot_owner[i], st.slot = st, i
        slot = self._slots[i]
        dsts, srcs = [], []
        for rec in (r for r in st.records if r.off_bytes):
            dsts.append(slot[rec.slot_offset:rec.slot_offset + rec.off_bytes])
            srcs.append(st.host[rec.host_offset:rec.host_offset + rec.off_bytes])
            if rec.tail is not None:
                dsts.append(slot[rec.slot_offset + rec.off_bytes:rec.slot_offset + rec.nbytes])
                srcs.append(rec.tail)
        after = tuple(e for e in (st.off_event, self._slot_free[i], self.device.compute_event()) if e is not None)
        st.reload_event = self.device.copy_async(self._h2d, dsts, srcs, after=after)
        self.pool.release(st.host, after=st.reload_event)
        st.host = None

    def release(self, microbatch: int, chunk: int) -> None:
        """Forget a microbatch-chunk after its backward; its reload slot(s) become free."""
        st = self._states.pop((microbatch, chunk))
        for group in st.segments or [st]:
            if group in self._to_drop:
                self._to_drop.remove(group)
            if group.host is not None:  # offloaded but never reloaded (no backward read it)
                self.pool.release(group.host, after=group.off_event)
            if group.slot is not None:
                self._slot_owner[group.slot] = None
                self._slot_free[group.slot] = self.device.compute_event()
        if st.layer_granular:  # pipeline size 1: the next microbatch's forward runs without them
            self._free_slots()
        freed = st.small_bytes
        for rec in st.records:
            freed += self._device_bytes(rec)
            rec.flat = rec.tail = None
        self._resident -= freed

    def end_iteration(self) -> None:
        """Close the iteration: forget what is left and publish pool figures in ``stats``."""
        self._compute_ended()
        for key in list(self._states):
            self.release(*key)
        self.device.synchronize()
        self._free_slots()
        self.stats.host_pool_bytes = self.pool.capacity_bytes
        self.stats.host_pool_allocations = self.pool.allocations
        self._new_iteration = True

    def reset_stats(self) -> None:
        """Start a new measurement (the peak restarts from what is resident now); the first forward
        after :meth:`end_iteration` does this, so ``stats`` read after it describe that iteration."""
        self.stats = ActivationStats(peak_resident_bytes=self._resident)
        self._new_iteration = False

    # ------------------------------------------------------------------ accounting
    @property
    def resident_bytes(self) -> int:
        """Saved bytes the manager holds on the device now (with the reload slots)."""
        return self._resident

    def _add_resident(self, n: int) -> None:
        self._resident += n
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, self._resident)

    @staticmethod
    def _device_bytes(rec: Record) -> int:
        return (rec.nbytes if rec.flat is not None else 0) + (rec.tail.numel() if rec.tail is not None else 0)

    def _ensure_slot(self, i: int, nbytes: int) -> None:
        cur = self._slots[i]
        if cur is not None and cur.numel() >= nbytes:
            return
        assert self._slot_owner[i] is None, "a reload slot in use cannot grow"
        # No host wait for the old slot's last reader: the backward that read it ran on the compute
        # stream the slot was allocated on, and reload copies into it are ordered by record_stream,
        # so the caching allocator reuses its memory only after both (on CPU the copy task holds it).
        old = 0 if cur is None else cur.numel()
        self._slots[i] = None
        self._resident -= old
        self._slots[i] = self.device.empty_device(nbytes)
        self._add_resident(nbytes)
        held = sum(s.numel() for s in self._slots if s is not None)
        self.stats.reload_buffer_bytes = max(self.stats.reload_buffer_bytes, held)

    def _free_slots(self) -> None:
        """Give the reload slots that no segment or chunk holds back to the allocator (no wait: the backward that
        read a slot ran on the compute stream it was allocated on, after the copy into it, see
        :meth:`_ensure_slot`); the extra slots of an out-of-order read go too."""
        for i, slot in enumerate(self._slots):
            if slot is not None and self._slot_owner[i] is None:
                self._resident -= slot.numel()
                self._slots[i] = None
        while len(self._slots) > 2 and self._slots[-1] is None and self._slot_owner[-1] is None:
            self._slots.pop()
            self._slot_owner.pop()
            self._slot_free.pop()

    def _compute_ended(self) -> None:
        """End of a compute action: offloads issued before it have overlapped it; drop their bytes."""
        pending = [st for st in self._to_drop if st is not self._in_forward]
        self._to_drop = [st for st in self._to_drop if st not in pending]
        for st in pending:
            self._drop_device_bytes(st)

    def _drop_device_bytes(self, st: ChunkState) -> None:
        if st in self._to_drop:
            self._to_drop.remove(st)
        offloaded = [r for r in st.records if r.off_bytes]
        chunk = self._states.get(st.key)
        if chunk is not None:  # a storage freed now may come back at the same address: that is a new record
            for rec in offloaded:
                if chunk.by_storage.get(rec.ptr) is rec:
                    del chunk.by_storage[rec.ptr]
        for rec in offloaded:  # whole records first, so a split tail never raises the peak
            if rec.off_bytes == rec.nbytes:
                release_leaves(rec)
                rec.flat = None
                self._resident -= rec.nbytes
        for rec in offloaded:
            if rec.flat is not None:
                with torch.no_grad():
                    rec.tail = rec.flat[rec.off_bytes:].clone()
                self._add_resident(rec.tail.numel())
                release_leaves(rec)
                rec.flat = None
                self._resident -= rec.nbytes
        st.dropped = True

    def live_storage_bytes(self) -> int:
        """Bytes of saved storages still alive in the allocator (``track_storages=True``), plus the
        manager's own device buffers: what :attr:`resident_bytes` claims, checked against reality."""
        assert self.track_storages, "construct the manager with track_storages=True"
        total = sum(s.numel() for s in self._slots if s is not None)
        for st in self._states.values():
            total += st.small_bytes
            for rec in st.records:
                if rec.storage_ref is not None and not rec.storage_ref.expired():
                    total += rec.nbytes
                if rec.tail is not None:
                    total += rec.tail.numel()
        return total


def build_activation_manager(config: H3TConfig, pipeline_rank: int, pipeline_size: int,
                             device: Union[str, torch.device]) -> Optional[ActivationManager]:
    """The manager of one pipeline stage, or None when there is nothing to manage."""
    alpha = config.stage_alpha(pipeline_rank, pipeline_size)
    if config.ckpt != "ours" and alpha == 0.0:
        return None
    layer = make_device_layer(config.device_mode, torch.device(device))
    return ActivationManager(alpha, layer, min_offload_bytes=config.min_offload_bytes)


__all__ = ["ActivationManager", "ActivationStats", "build_activation_manager"]
