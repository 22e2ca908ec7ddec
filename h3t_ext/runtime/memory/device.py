"""Device layer of the activation runtime: copy streams, events, host buffers, batched copies.

The activation manager talks only to this interface, so the CUDA path and the CPU paths are the
same code with a different layer:

* ``cuda``: ``torch.cuda.Stream`` copy streams, ``torch.cuda.Event`` events, pinned host memory,
  and the native batched copy of :mod:`h3t_ext.kernels` when it is importable.
* ``cpu-sync``: every copy runs at once on the calling thread; events are born complete.
* ``cpu-thread``: every stream is a worker thread running its copies in order, after a short
  delay; an event is set when the copy has landed. Destination buffers are poisoned (all bytes
  0xFF, a NaN in every float dtype) from the moment the copy may start (its stream's earlier work
  and its ``after`` events done, as on CUDA) until it lands, and a destination read through
  :meth:`DeviceLayer.check_ready` before the reader waited for its event raises
  :class:`MissingWaitError`. So an ordering bug fails a CPU test instead of corrupting a run.

All copies are between flat ``uint8`` tensors of equal length.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Optional, Sequence

import torch

from h3t_ext.runtime.config import resolve_device_mode

POISON_BYTE = 0xFF
"""Fill value of a destination in cpu-thread mode until its copy lands (NaN in fp32/bf16/fp16)."""


class MissingWaitError(RuntimeError):
    """A copy destination was read before the reader waited for the copy's event."""


def _resolve_copy_fn(device: torch.device) -> tuple[Callable[..., None], bool]:
    """(copy function, native?): :func:`h3t_ext.kernels.batched_copy_` when the kernels package
    imports (it runs the native batched kernel where built), else per-tensor torch copies."""
    try:
        from h3t_ext import kernels  # noqa: PLC0415  (optional package; never its .so directly)

        return kernels.batched_copy_, bool(kernels.native_available(device))
    except ImportError:
        return _torch_copy, False


def _torch_copy(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    for d, s in zip(dsts, srcs):
        d.copy_(s, non_blocking=True)


class Event:
    """Completion of one submitted copy (or of compute up to a point)."""

    def __init__(self, done: bool = False):
        self._flag = threading.Event()
        self.error: Optional[BaseException] = None
        if done:
            self._flag.set()

    def set(self) -> None:
        self._flag.set()

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self, timeout_s: float = 600.0) -> None:
        if not self._flag.wait(timeout_s):
            raise TimeoutError(f"copy did not complete within {timeout_s}s")
        if self.error is not None:
            raise RuntimeError("asynchronous copy failed") from self.error


class _CudaEvent(Event):
    """A CUDA event. It keeps no tensors alive: device tensors used by a side stream are protected
    by ``record_stream`` and host buffers by the pool, so dropping a source really frees it."""

    def __init__(self, stream):
        super().__init__()
        self.cuda_event = torch.cuda.Event()
        self.cuda_event.record(stream)

    def query(self) -> bool:
        return self.cuda_event.query()

    def synchronize(self, timeout_s: float = 600.0) -> None:
        """Wait on the host for the event, at most ``timeout_s`` (``cudaEventSynchronize`` has no
        deadline, so this polls ``query`` with a growing sleep of at most 1 ms)."""
        poll_until(self.query, timeout_s, "CUDA copy")


def poll_until(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Return once ``done()`` is true; raise TimeoutError (one line) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pause = 1e-5
    while not done():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not complete within {timeout_s:g}s")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


class DeviceLayer:
    """cpu-sync device layer; the base of the other two."""

    mode = "cpu-sync"

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._copy, self.native_copies = _resolve_copy_fn(self.device)
        """``native_copies``: True when copies run the native batched kernel of :mod:`h3t_ext.kernels`."""

    def new_stream(self, name: str):
        """A copy stream (a name on CPU)."""
        return name

    def empty_host(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 host buffer (pinned when the device is a GPU)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def empty_device(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer on the compute device."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def compute_event(self) -> Event:
        """An event marking the compute issued so far (complete at once on CPU)."""
        return Event(done=True)

    def copy_async(self, stream, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor],
                   after: Sequence[Event] = ()) -> Event:
        """Copy ``srcs[i]`` into ``dsts[i]`` on ``stream`` once every event of ``after`` is complete."""
        _validate_pairs(dsts, srcs)
        for e in after:
            e.synchronize()
        self._copy(dsts, srcs)
        return Event(done=True)

    def wait(self, event: Event) -> None:
        """Make the compute (the caller) wait for ``event``; its destinations become readable."""
        event.synchronize()

    def check_ready(self, tensor: torch.Tensor) -> None:
        """Raise :class:`MissingWaitError` if ``tensor`` is the destination of a copy not waited for."""

    def synchronize(self) -> None:
        """Wait for every copy submitted so far."""

    def close(self) -> None:
        """Stop worker threads (no-op here)."""


class ThreadDeviceLayer(DeviceLayer):
    """cpu-thread device layer: each stream is a worker thread; destinations poisoned until waited."""

    mode = "cpu-thread"

    def __init__(self, device: torch.device, *, copy_delay_s: float = 0.002):
        super().__init__(device)
        self.copy_delay_s = copy_delay_s
        self._streams: dict[str, "_WorkerStream"] = {}
        self._pending: dict[int, tuple[int, int, Event]] = {}  # id -> (start ptr, end ptr, event)
        self._lock = threading.Lock()
        self._next_id = 0

    def new_stream(self, name: str):
        if name not in self._streams:
            self._streams[name] = _WorkerStream(name)
        return name

    def copy_async(self, stream, dsts, srcs, after=()) -> Event:
        _validate_pairs(dsts, srcs)
        event = Event()
        dsts, srcs, after = tuple(dsts), tuple(srcs), tuple(after)
        worker = self._streams[self.new_stream(stream)]
        for d in dsts:
            self._mark_pending(d, event)
        # A destination may be written only once the copy may start, as on a CUDA stream: after
        # the earlier work of its stream and the events in ``after`` (e.g. a pooled host buffer
        # that a reload is still reading). Poison it now only when that is already the case.
        if worker.idle() and all(e.query() for e in after):
            _poison(dsts)
        delay, copy = self.copy_delay_s, self._copy

        def task() -> None:
            for e in after:
                e.synchronize()
            _poison(dsts)
            time.sleep(delay)
            copy(dsts, srcs)

        worker.submit(task, event)
        return event

    def _mark_pending(self, t: torch.Tensor, event: Event) -> None:
        start = t.data_ptr()
        with self._lock:
            self._pending[self._next_id] = (start, start + t.numel() * t.element_size(), event)
            self._next_id += 1

    def wait(self, event: Event) -> None:
        event.synchronize()
        with self._lock:
            for key in [k for k, (_, _, e) in self._pending.items() if e is event]:
                del self._pending[key]

    def check_ready(self, tensor: torch.Tensor) -> None:
        lo = tensor.data_ptr()
        hi = lo + max(tensor.numel(), 1) * tensor.element_size()
        with self._lock:
            hits = [(s, e) for s, e, _ in self._pending.values() if s < hi and lo < e]
        if hits:
            raise MissingWaitError(
                f"read of {hi - lo} bytes at {lo:#x} that are the destination of a copy nobody waited for"
            )

    def synchronize(self) -> None:
        for s in self._streams.values():
            s.drain()

    def close(self) -> None:
        for s in self._streams.values():
            s.stop()
        self._streams.clear()


def _poison(dsts: Sequence[torch.Tensor]) -> None:
    for d in dsts:
        d.fill_(POISON_BYTE)


class _WorkerStream:
    """One worker thread that runs submitted tasks in order."""

    def __init__(self, name: str):
        self._queue: "queue.Queue" = queue.Queue()
        self._unfinished = 0  # tasks submitted and not yet finished
        self._count_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"h3t-stream-{name}", daemon=True)
        self._thread.start()

    def submit(self, task: Callable[[], None], event: Event) -> None:
        with self._count_lock:
            self._unfinished += 1
        self._queue.put((task, event))

    def idle(self) -> bool:
        """No submitted task is queued or running."""
        with self._count_lock:
            return self._unfinished == 0

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            task, event = item
            try:
                task()
            except BaseException as exc:  # surfaced by Event.synchronize in the reader
                event.error = exc
            del item, task  # the copy's tensors must not outlive it
            with self._count_lock:
                self._unfinished -= 1
            event.set()

    def drain(self) -> None:
        done = Event()
        self.submit(lambda: None, done)
        done.synchronize()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10.0)


class CudaDeviceLayer(DeviceLayer):
    """CUDA device layer: side streams, CUDA events, pinned host buffers."""

    mode = "cuda"

    def __init__(self, device: torch.device):
        super().__init__(device)
        self._streams: dict[str, "torch.cuda.Stream"] = {}

    def new_stream(self, name: str):
        if name not in self._streams:
            self._streams[name] = torch.cuda.Stream(device=self.device)
        return name

    def empty_host(self, nbytes: int) -> torch.Tensor:
        try:  # NUMA-local pinned pages from the kernels package when it is there
            from h3t_ext.kernels import alloc_pinned  # noqa: PLC0415

            return alloc_pinned(nbytes, device=self.device)
        except ImportError:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def compute_event(self) -> Event:
        return _CudaEvent(torch.cuda.current_stream(self.device))

    def copy_async(self, stream, dsts, srcs, after=()) -> Event:
        _validate_pairs(dsts, srcs)
        s = self._streams[self.new_stream(stream)]
        for e in after:  # host-side events (another layer's, or born complete) are waited on the host
            if not isinstance(e, _CudaEvent):
                e.synchronize()
        with torch.cuda.stream(s):
            for e in after:
                if isinstance(e, _CudaEvent):  # any device's event: cudaStreamWaitEvent orders across devices
                    s.wait_event(e.cuda_event)
            self._copy(dsts, srcs)
            for t in (*dsts, *srcs):
                if t.is_cuda:
                    t.record_stream(s)  # the caching allocator must not reuse it before the copy ends
            return _CudaEvent(s)

    def wait(self, event: Event) -> None:
        if isinstance(event, _CudaEvent):
            torch.cuda.current_stream(self.device).wait_event(event.cuda_event)
        else:
            event.synchronize()

    def synchronize(self) -> None:
        for s in self._streams.values():
            s.synchronize()


def _validate_pairs(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    assert len(dsts) == len(srcs), "copy needs as many destinations as sources"
    for d, s in zip(dsts, srcs):
        assert d.dtype == s.dtype == torch.uint8 and d.numel() == s.numel(), "copies are between equal uint8 ranges"


def make_device_layer(mode: str, device: torch.device, **kwargs) -> DeviceLayer:
    """The device layer for ``mode`` (``auto`` resolves from the device type)."""
    device = torch.device(device)
    mode = resolve_device_mode(mode, device.type)
    if mode == "cuda":
        return CudaDeviceLayer(device)
    if mode == "cpu-thread":
        return ThreadDeviceLayer(device, **kwargs)
    return DeviceLayer(device)


__all__ = ["CudaDeviceLayer", "DeviceLayer", "Event", "MissingWaitError", "POISON_BYTE", "ThreadDeviceLayer",
           "make_device_layer"]
