"""The native fast path of batched_copy_ (``_copy_cpu.batched_copy_tensors``).

It reads each tensor's dtype, is_cpu, is_contiguous(), is_conj(), is_neg(), shape, nbytes and
data_ptr() in C++ and must decide exactly as the specification below: copy when every pair is
CPU, contiguous, not a lazily conjugated or negated view, of one dtype object and equal shape;
otherwise return None, so that batched_copy_ takes its fully validated path.

Batches of at least the parallel threshold are copied while they are scanned: pairs read
before the one that decides may already be copied (whole pairs only, never a byte outside a
destination). Smaller batches are copied after the scan, so a None from them wrote nothing.
"""
import threading
import time

import pytest
import torch

from h3t_ext import kernels
from h3t_ext.kernels import _backend

pytestmark = pytest.mark.skipif(not kernels.native_available("cpu"), reason="native CPU kernels not built")


def _spec_is_fast(dsts, srcs) -> bool:
    """Reference decision: True when the fast path applies (same checks, same order)."""
    if not isinstance(dsts, (list, tuple)) or not isinstance(srcs, (list, tuple)):
        return False
    try:
        for d, s in zip(dsts, srcs, strict=True):
            if (d.dtype is not s.dtype or not (d.is_cpu and s.is_cpu and d.is_contiguous() and s.is_contiguous())
                    or d.is_conj() or s.is_conj() or d.is_neg() or s.is_neg() or d.shape != s.shape):
                return False
            if d.nbytes:
                d.data_ptr(), s.data_ptr()
    except (AttributeError, TypeError, ValueError):
        return False
    return True


class _NoShape:
    """Tensor-like up to ``shape``, which raises AttributeError."""

    def __init__(self, t):
        self.dtype, self.is_cpu, self._t = t.dtype, True, t

    def is_contiguous(self):
        return True

    def is_conj(self):
        return False

    def is_neg(self):
        return False


class _BrokenDtype:
    """``dtype`` raises an error the fast path must not swallow."""

    @property
    def dtype(self):
        raise RuntimeError("broken dtype")


class _Sub(torch.Tensor):
    pass


def _unusual_cases():
    """(name, dsts, srcs) that the fast path must hand back to the checked path."""
    z = torch.zeros
    return [
        ("tensor not list", z(4), [z(4)]),
        ("generator", (t for t in [z(4)]), [z(4)]),
        ("length mismatch", [z(4)], [z(4), z(4)]),
        ("dtype mismatch", [z(4)], [z(4, dtype=torch.float64)]),
        ("same bytes other shape", [z(2, 3)], [z(3, 2)]),
        ("non-contiguous src", [z(4)], [z(8)[::2]]),
        ("non-contiguous dst", [z(8)[::2]], [z(4)]),
        ("expanded dst", [z(1, 3).expand(4, 3)], [z(4, 3)]),
        ("non-tensor src", [z(3)], [[1.0, 2.0, 3.0]]),
        ("None dst", [None], [z(3)]),
        ("meta src", [z(4)], [torch.empty(4, device="meta")]),
        ("conjugate view src", [z(4, dtype=torch.complex64)], [torch.ones(4, dtype=torch.complex64).conj()]),
        ("negative view src", [z(4)], [torch._neg_view(torch.ones(4))]),
        ("attribute error", [_NoShape(z(4))], [_NoShape(z(4))]),
    ]


@pytest.mark.parametrize("name,dsts,srcs", _unusual_cases(), ids=[c[0] for c in _unusual_cases()])
def test_unusual_inputs_fall_back_and_write_nothing(name, dsts, srcs):
    native = _backend.cpu_module()
    first = torch.full((64,), 5.0)
    # A good pair first: it must stay unwritten when a later pair sends the batch back.
    if isinstance(dsts, list) and isinstance(srcs, list):
        dsts, srcs = [first, *dsts], [torch.ones(64), *srcs]
    assert not _spec_is_fast(dsts, srcs)
    assert native.batched_copy_tensors(dsts, srcs) is None
    assert bool((first == 5).all())


def test_usual_inputs_copy_like_torch():
    native = _backend.cpu_module()
    gen = torch.Generator().manual_seed(7)
    shapes = [(0,), (1,), (3, 5), (4099,), (2, 3, 70), (), (70_001,)]
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.complex64, torch.float64, torch.uint8]
    srcs = [torch.randint(0, 2, sh, generator=gen).to(dt) if dt == torch.bool
            else torch.randn(sh, generator=gen, dtype=torch.float64).to(dt) for sh, dt in zip(shapes, dtypes)]
    srcs.append(torch.arange(12, dtype=torch.float32).as_subclass(_Sub))  # subclasses read attributes the same way
    for container in (list, tuple):
        dsts = [torch.zeros_like(s) for s in srcs]
        assert _spec_is_fast(container(dsts), container(srcs))
        threads = native.batched_copy_tensors(container(dsts), container(srcs))
        assert isinstance(threads, int) and threads >= 1
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_zero_byte_and_empty_batches_copy_nothing():
    native = _backend.cpu_module()
    assert native.batched_copy_tensors([], []) == 0
    assert native.batched_copy_tensors((torch.zeros(0),), (torch.zeros(0),)) == 0


def test_other_errors_propagate():
    native = _backend.cpu_module()
    with pytest.raises(RuntimeError, match="broken dtype"):
        native.batched_copy_tensors([_BrokenDtype()], [torch.zeros(1)])


def test_overlap_is_still_rejected_before_any_write():
    native = _backend.cpu_module()
    x = torch.arange(100, dtype=torch.float32)
    other = torch.zeros(10)
    before = x.clone()
    with pytest.raises(ValueError, match=r"dsts\[1\] overlaps srcs\[1\]"):
        native.batched_copy_tensors([other, x[10:60]], [torch.ones(10), x[:50]])
    assert torch.equal(x, before) and bool((other == 0).all())


@pytest.fixture
def two_threads():
    """Two copy threads whatever the machine, restored afterwards."""
    kernels.set_num_threads(2)
    yield
    kernels.set_num_threads(0)


class _Probe(torch.Tensor):
    """A tensor whose is_contiguous() waits (up to 10 s) until ``watch`` equals ``want``."""

    watch: torch.Tensor
    want: torch.Tensor

    def is_contiguous(self, *args, **kwargs):
        deadline = time.monotonic() + 10
        while not torch.equal(self.watch, self.want) and time.monotonic() < deadline:
            time.sleep(0.001)
        return True


def test_copies_start_while_the_batch_is_still_scanned(two_threads):
    """The last pair's attribute read blocks until the first pair has landed: only a copy
    that overlaps the scan lets it see that (else the probe times out and the pair stays 0)."""
    srcs = [torch.full((64 << 10,), float(i + 1)) for i in range(8)]  # 8 x 256 KiB: above the thresholds
    dsts = [torch.zeros_like(s) for s in srcs]
    probe = torch.ones(16).as_subclass(_Probe)
    probe.watch, probe.want = dsts[0], srcs[0]
    start = time.monotonic()
    assert _backend.cpu_module().batched_copy_tensors([*dsts, torch.zeros(16)], [*srcs, probe]) == 2
    assert time.monotonic() - start < 10, "the first pair was not copied until the scan ended"
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_large_batch_sent_back_late_wrote_whole_pairs_only(two_threads):
    """An unusual pair at the end of a batch above the parallel threshold: earlier pairs are
    either untouched or fully copied, guard bytes between destinations stay intact, and
    batched_copy_ then copies everything through the checked path."""
    count, numel, guard = 24, 32 << 10, 64
    gen = torch.Generator().manual_seed(11)
    srcs = [torch.randn(numel, generator=gen) for _ in range(count)]
    arena = torch.full((count * (numel + guard),), -7.0)
    dsts = [arena[i * (numel + guard):i * (numel + guard) + numel] for i in range(count)]
    srcs.append(torch.randn(40, generator=gen)[::2])  # non-contiguous: sends the batch back
    dsts.append(torch.zeros(20))
    assert _backend.cpu_module().batched_copy_tensors(dsts, srcs) is None
    for d, s in zip(dsts[:-1], srcs[:-1]):
        assert bool((d == -7.0).all()) or torch.equal(d, s)
    guards = torch.cat([arena[i * (numel + guard) + numel:(i + 1) * (numel + guard)] for i in range(count)])
    assert bool((guards == -7.0).all())
    kernels.batched_copy_(dsts, srcs)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_batched_copy_uses_checked_path_for_mixed_layouts():
    """A batch the fast path declines is still copied (contiguous and strided pairs together)."""
    gen = torch.Generator().manual_seed(8)
    srcs = [torch.randn(6, 9, generator=gen), torch.randn(20, generator=gen)[::2]]
    dsts = [torch.zeros(6, 9), torch.zeros(10)]
    assert _backend.cpu_module().batched_copy_tensors(dsts, srcs) is None
    kernels.batched_copy_(dsts, srcs)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_conjugate_and_negative_views_copy_their_values():
    c = torch.complex(torch.arange(4.0), torch.arange(4.0) + 1)
    srcs = [c.conj(), torch._neg_view(torch.arange(5.0))]
    dsts = [torch.zeros(4, dtype=torch.complex64), torch.zeros(5)]
    kernels.batched_copy_(dsts, srcs)
    assert torch.equal(dsts[0], c.conj().resolve_conj())
    assert torch.equal(dsts[1], -torch.arange(5.0))
