"""The native tensor front end of batched_copy_ (``_copy_torch.batched_copy_tensors``).

It reads each tensor through torch's C++ API and must decide exactly as the specification
below: copy when every pair is an exact torch.Tensor (or Parameter) on the CPU, strided and contiguous, of
one non-quantized dtype and equal shape, not a lazily conjugated or negated view, whose
storages hold the bytes, with a destination that is not an inference tensor; otherwise
return None having written nothing, so that batched_copy_ takes its fully validated path.
"""
import pytest
import torch

from h3t_ext import kernels
from h3t_ext.kernels import _backend

pytestmark = pytest.mark.skipif(_backend.tensor_module() is None, reason="native tensor front end not built")


def _front():
    return _backend.tensor_module()


_EXACT = (torch.Tensor, torch.nn.Parameter)  # torch's THPVariable_CheckExact: no Python overrides


def _spec_is_fast(dsts, srcs) -> bool:
    """Reference decision: True when the fast path applies."""
    if not isinstance(dsts, (list, tuple)) or not isinstance(srcs, (list, tuple)) or len(dsts) != len(srcs):
        return False
    for d, s in zip(dsts, srcs):
        if type(d) not in _EXACT or type(s) not in _EXACT:
            return False
        if (d.dtype is not s.dtype or d.is_quantized or d.layout != torch.strided or s.layout != torch.strided
                or not (d.is_cpu and s.is_cpu) or d.is_inference()
                or not (d.is_contiguous() and s.is_contiguous())
                or d.is_conj() or s.is_conj() or d.is_neg() or s.is_neg() or d.shape != s.shape):
            return False
        for t in (d, s):
            if t.nbytes and t.storage_offset() * t.element_size() + t.nbytes > t.untyped_storage().nbytes():
                return False
    return True


class _Sub(torch.Tensor):
    pass


def _shrunk(n: int) -> torch.Tensor:
    """A tensor whose storage was resized below its extent (torch's own copy_ would crash)."""
    t = torch.zeros(n)
    t.untyped_storage().resize_(4)
    return t


def _unusual_cases():
    """(name, dsts, srcs) that the fast path must hand back to the checked path."""
    z = torch.zeros
    with torch.inference_mode():
        inference = z(4)
    quantized = [torch.quantize_per_tensor(torch.rand(4), scale, 0, torch.quint8) for scale in (0.1, 0.5)]
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
        ("sparse src", [z(4)], [z(4).to_sparse()]),
        ("subclass src", [z(4)], [z(4).as_subclass(_Sub)]),
        ("conjugate view src", [z(4, dtype=torch.complex64)], [torch.ones(4, dtype=torch.complex64).conj()]),
        ("negative view src", [z(4)], [torch._neg_view(torch.ones(4))]),
        ("quantized", [quantized[1]], [quantized[0]]),
        ("inference dst", [inference], [z(4)]),
        ("storage shrunk under src", [z(8)], [_shrunk(8)]),
    ]


@pytest.mark.parametrize("name,dsts,srcs", _unusual_cases(), ids=[c[0] for c in _unusual_cases()])
def test_unusual_inputs_fall_back_and_write_nothing(name, dsts, srcs):
    first = torch.full((64,), 5.0)
    # A good pair first: it must stay unwritten when a later pair sends the batch back.
    if isinstance(dsts, list) and isinstance(srcs, list):
        dsts, srcs = [first, *dsts], [torch.ones(64), *srcs]
    version = first._version
    assert not _spec_is_fast(dsts, srcs)
    assert _front().batched_copy_tensors(dsts, srcs) is None
    assert bool((first == 5).all()) and first._version == version


def test_usual_inputs_copy_like_torch():
    gen = torch.Generator().manual_seed(7)
    shapes = [(0,), (1,), (3, 5), (4099,), (2, 3, 70), (), (70_001,)]
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.complex64, torch.float64, torch.uint8]
    srcs = [torch.randint(0, 2, sh, generator=gen).to(dt) if dt == torch.bool
            else torch.randn(sh, generator=gen, dtype=torch.float64).to(dt) for sh, dt in zip(shapes, dtypes)]
    srcs.append(torch.arange(40.0)[10:22])  # a view with a storage offset
    for container in (list, tuple):
        dsts = [torch.zeros_like(s) for s in srcs]
        dsts[-1] = torch.nn.Parameter(dsts[-1])  # a parameter (requires grad) is written like copy_ under no_grad
        assert _spec_is_fast(container(dsts), container(srcs))
        threads = _front().batched_copy_tensors(container(dsts), container(srcs))
        assert isinstance(threads, int) and threads >= 1
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_destination_version_is_bumped_like_copy_():
    """Autograd must see the write: a tensor saved for backward and then overwritten by the
    batch makes backward fail exactly as after copy_."""
    x = torch.ones(4, requires_grad=True)
    saved = torch.zeros(4)
    y = (x * saved).sum()  # mul saves `saved`
    before = saved._version
    assert _front().batched_copy_tensors([saved], [torch.full((4,), 2.0)]) == 1
    assert saved._version == before + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_copy_on_write_destination_is_materialized():
    """A lazily cloned (copy-on-write) destination is split from its source before writing."""
    base = torch.arange(8.0)
    lazy = torch._lazy_clone(base)
    assert _front().batched_copy_tensors([lazy], [torch.zeros(8)]) == 1
    assert torch.equal(base, torch.arange(8.0)) and bool((lazy == 0).all())


def test_zero_byte_and_empty_batches_copy_nothing():
    assert _front().batched_copy_tensors([], []) == 0
    assert _front().batched_copy_tensors((torch.zeros(0),), (torch.zeros(0),)) == 0


def test_overlap_is_rejected_before_any_write():
    x = torch.arange(100, dtype=torch.float32)
    other = torch.zeros(10)
    before = x.clone()
    with pytest.raises(ValueError, match=r"dsts\[1\] overlaps srcs\[1\]"):
        _front().batched_copy_tensors([other, x[10:60]], [torch.ones(10), x[:50]])
    assert torch.equal(x, before) and bool((other == 0).all())


def test_shares_the_thread_options_of_the_cpu_module():
    srcs = [torch.randn(1 << 18) for _ in range(4)]  # 4 MiB: above the parallel threshold
    dsts = [torch.zeros_like(s) for s in srcs]
    try:
        kernels.set_num_threads(1)
        assert _front().batched_copy_tensors(dsts, srcs) == 1
        kernels.set_num_threads(2)
        assert _front().batched_copy_tensors(dsts, srcs) == 2
    finally:
        kernels.set_num_threads(0)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_batched_copy_uses_checked_path_for_mixed_layouts():
    """A batch the fast path declines is still copied (contiguous and strided pairs together)."""
    gen = torch.Generator().manual_seed(8)
    srcs = [torch.randn(6, 9, generator=gen), torch.randn(20, generator=gen)[::2]]
    dsts = [torch.zeros(6, 9), torch.zeros(10)]
    assert _front().batched_copy_tensors(dsts, srcs) is None
    kernels.batched_copy_(dsts, srcs)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


def test_conjugate_negative_and_quantized_copy_their_values():
    c = torch.complex(torch.arange(4.0), torch.arange(4.0) + 1)
    q_src = torch.quantize_per_tensor(torch.rand(4), 0.1, 0, torch.quint8)
    srcs = [c.conj(), torch._neg_view(torch.arange(5.0)), q_src]
    dsts = [torch.zeros(4, dtype=torch.complex64), torch.zeros(5),
            torch.quantize_per_tensor(torch.zeros(4), 0.5, 3, torch.quint8)]
    kernels.batched_copy_(dsts, srcs)
    assert torch.equal(dsts[0], c.conj().resolve_conj())
    assert torch.equal(dsts[1], -torch.arange(5.0))
    assert torch.equal(dsts[2].dequantize(), q_src.dequantize()) and dsts[2].q_scale() == q_src.q_scale()
