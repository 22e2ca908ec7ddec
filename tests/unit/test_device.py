"""Device layer: cpu-sync and cpu-thread copies, and the thread mode catching a missing wait."""
from __future__ import annotations

import time

import pytest
import torch

from h3t_ext.runtime.memory.activations import ActivationManager
from h3t_ext.runtime.config import RuntimeConfigError
from h3t_ext.runtime.memory.device import Event, MissingWaitError, make_device_layer
from h3t_ext.runtime.memory.host_pool import HostPool, size_class


def _pair(n=1 << 16):
    src = torch.randn(n // 4).view(torch.uint8)
    return src, torch.zeros(n, dtype=torch.uint8)


@pytest.mark.parametrize("mode", ["cpu-sync", "cpu-thread"])
def test_copy_lands_after_wait(mode):
    layer = make_device_layer(mode, "cpu")
    try:
        src, dst = _pair()
        ev = layer.copy_async(layer.new_stream("d2h"), [dst], [src])
        layer.wait(ev)
        layer.check_ready(dst)
        assert torch.equal(dst, src)
    finally:
        layer.close()


def test_thread_mode_catches_read_before_wait():
    layer = make_device_layer("cpu-thread", "cpu", copy_delay_s=0.05)
    try:
        src, dst = _pair()
        ev = layer.copy_async(layer.new_stream("h2d"), [dst], [src])
        with pytest.raises(MissingWaitError):
            layer.check_ready(dst[128:256])  # any overlapping read is caught
        assert torch.isnan(dst.view(torch.float32)).all()  # poisoned until the copy lands
        ev.synchronize()  # the copy has landed, but the reader still did not wait for it
        with pytest.raises(MissingWaitError):
            layer.check_ready(dst)
        layer.wait(ev)
        layer.check_ready(dst)
        assert torch.equal(dst, src)
    finally:
        layer.close()


def test_thread_streams_order_copies_after_events():
    layer = make_device_layer("cpu-thread", "cpu")
    try:
        src, mid = _pair()
        out = torch.zeros_like(mid)
        e1 = layer.copy_async("d2h", [mid], [src])
        e2 = layer.copy_async("h2d", [out], [mid], after=(e1,))  # other stream, waits for the first copy
        layer.wait(e2)
        assert torch.equal(out, src)
    finally:
        layer.close()


def test_thread_mode_writes_a_destination_only_once_its_copy_may_start():
    """As on CUDA, a copy ordered after another stream's read of its destination leaves that read
    alone (a pooled host buffer still being reloaded from, then offloaded into)."""
    layer = make_device_layer("cpu-thread", "cpu", copy_delay_s=0.05)
    try:
        original, host = _pair()
        host.copy_(original)
        reloaded = torch.zeros_like(host)
        read = layer.copy_async("h2d", [reloaded], [host])  # still reading `host` for 50 ms
        fresh = torch.randn(host.numel() // 4).view(torch.uint8)
        write = layer.copy_async("d2h", [host], [fresh], after=(read,))
        layer.wait(read)
        assert torch.equal(reloaded, original)
        layer.wait(write)
        assert torch.equal(host, fresh)
    finally:
        layer.close()


def _forward_offload_reload(mgr, w, x):
    """Forward microbatch 0 under ``mgr``, offload it, run an empty forward, reload it; return its loss."""
    with mgr.forward_scope(0, 0):
        y = torch.tanh(x @ w).sum()
    mgr.offload(0, 0)
    with mgr.forward_scope(1, 0):
        pass
    mgr.reload(0, 0)
    return y


def test_manager_with_missing_reload_wait_fails_in_thread_mode(monkeypatch):
    """A backward that reads reloaded activations without waiting for the reload is caught."""
    layer = make_device_layer("cpu-thread", "cpu", copy_delay_s=0.05)
    mgr = ActivationManager(1.0, layer)
    monkeypatch.setattr(mgr, "_wait_for_reload", lambda st: None)  # the deliberate bug
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(64, 256)
    try:
        y = _forward_offload_reload(mgr, w, x)
        with pytest.raises(MissingWaitError):
            with mgr.backward_scope(0, 0):
                y.backward()
    finally:
        layer.close()


def test_same_manager_without_the_bug_is_exact():
    layer = make_device_layer("cpu-thread", "cpu", copy_delay_s=0.01)
    mgr = ActivationManager(1.0, layer)
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(64, 256)
    (torch.tanh(x @ w).sum()).backward()
    ref, w.grad = w.grad.clone(), None
    try:
        y = _forward_offload_reload(mgr, w, x)
        with mgr.backward_scope(0, 0):
            y.backward()
        mgr.release(0, 0)
    finally:
        layer.close()
    assert mgr.stats.offloaded_bytes == mgr.stats.saved_bytes[(0, 0)] > 0
    assert torch.equal(w.grad, ref)


def test_cuda_mode_needs_a_cuda_device():
    with pytest.raises(RuntimeConfigError, match="device_mode 'cuda'"):
        make_device_layer("cuda", "cpu")
    assert make_device_layer("auto", "cpu").mode == "cpu-sync"


def test_host_pool_size_classes_and_reuse():
    assert size_class(1) == 4096 and size_class(4097) == 8192
    assert all(size_class(size_class(n)) == size_class(n) >= n for n in range(1, 300000, 997))
    pool = HostPool(lambda n: torch.empty(n, dtype=torch.uint8))
    a, ready = pool.acquire(10000)
    assert ready is None
    pool.release(a)
    b, ready = pool.acquire(9000)  # same class: reused, free at once
    assert b.data_ptr() == a.data_ptr() and pool.allocations == 1 and ready is None
    c, _ = pool.acquire(100000)
    assert pool.allocations == 2 and pool.in_use_bytes == b.numel() + c.numel()


def test_host_pool_never_blocks_and_prefers_landed_buffers():
    """FIFO over the free buffers, first one whose last copy landed; else the oldest with its event
    (the caller orders its copy after it) -- never a host wait on a pending copy."""
    pool = HostPool(lambda n: torch.empty(n, dtype=torch.uint8))
    bufs = [pool.acquire(5000)[0] for _ in range(3)]
    pending_old, landed, pending_new = Event(), Event(done=True), Event()
    for buf, ev in zip(bufs, (pending_old, landed, pending_new)):
        pool.release(buf, after=ev)
    got, ready = pool.acquire(5000)  # the landed one, although it was released second
    assert got.data_ptr() == bufs[1].data_ptr() and ready is None
    got, ready = pool.acquire(5000)  # none landed: the oldest, with its event, and no wait
    assert got.data_ptr() == bufs[0].data_ptr() and ready is pending_old and not pending_old.query()
    pending_new.set()
    got, ready = pool.acquire(5000)  # landed meanwhile: no event to order after
    assert got.data_ptr() == bufs[2].data_ptr() and ready is None and pool.allocations == 3


def _one_microbatch(mgr, w, x):
    with mgr.forward_scope(0, 0):
        y = (torch.tanh(x @ w) @ w).sum()
    mgr.offload(0, 0)
    return y


def test_offload_into_a_busy_host_buffer_waits_on_the_copy_stream_not_the_host():
    """The manager hands the pool's event to the offload copy: the d2h stream waits, the host does not."""
    layer = make_device_layer("cpu-thread", "cpu", copy_delay_s=0.01)
    try:
        mgr = ActivationManager(1.0, layer, min_offload_bytes=0)
        # w is a Parameter: the manager keeps parameters in place (a grad-requiring leaf that is not one
        # is a received stage input, whose storage the manager frees after the offload)
        w, x = torch.nn.Parameter(torch.randn(64, 64)), torch.randn(64, 64)
        for busy in (None, None, Event()):  # every iteration saves the same bytes: one host buffer class
            if busy is not None:  # the buffer the last offload used is now still read by a copy
                buf, _ = mgr.pool.acquire(host_class)
                mgr.pool.release(buf, after=busy)
            y = _one_microbatch(mgr, w, x)  # returns at once, even with `busy` pending
            st = mgr._states[(0, 0)]
            host_class = st.host.numel()
            if busy is not None:
                time.sleep(0.2)  # far longer than the copy takes: only the dependency holds it back
                assert not st.off_event.query()
                busy.set()
            mgr.reload(0, 0)
            with mgr.backward_scope(0, 0):
                y.backward()
            mgr.release(0, 0)
        # the offload took the busy buffer (no second allocation) and its copy waited on the event
        assert mgr.pool.allocations == 1 and torch.isfinite(w.grad).all()
    finally:
        layer.close()


def test_cuda_event_synchronize_honours_its_timeout():
    """_CudaEvent.synchronize polls with a deadline (cudaEventSynchronize has none)."""
    from h3t_ext.runtime.memory.device import _CudaEvent

    class NeverDone:
        def query(self):
            return False

    ev = _CudaEvent.__new__(_CudaEvent)
    Event.__init__(ev)
    ev.cuda_event = NeverDone()
    with pytest.raises(TimeoutError, match="did not complete within 0.05s"):
        ev.synchronize(timeout_s=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_manager_offload_is_exact():
    layer = make_device_layer("cuda", "cuda")
    mgr = ActivationManager(0.7, layer)
    w = torch.randn(512, 512, device="cuda", requires_grad=True)
    x = torch.randn(256, 512, device="cuda")
    (torch.tanh(x @ w) @ w).sum().backward()
    ref, w.grad = w.grad.clone(), None
    with mgr.forward_scope(0, 0):
        y = (torch.tanh(x @ w) @ w).sum()
    mgr.offload(0, 0)
    with mgr.forward_scope(1, 0):
        pass
    mgr.reload(0, 0)
    with mgr.backward_scope(0, 0):
        y.backward()
    mgr.release(0, 0)
    torch.cuda.synchronize()
    assert mgr.stats.offloaded_bytes > 0
    assert torch.equal(w.grad, ref)
