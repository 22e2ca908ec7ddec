"""Batched copies (h3t_ext.kernels.batched_copy_) equal torch's own copies.

Every case runs with and without the native tensor front end, and on the active backend
(native CPU when built) in two modes: the default
thresholds, and thresholds forced to 0 with odd-sized 4099-byte chunks, so that even tiny
batches take the threaded and non-temporal-store paths and chunk boundaries fall inside
tensors and rows. Tensors sit inside guard bytes that must stay untouched.
"""
import pytest
import torch

from h3t_ext import kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.uint8,
          torch.bool, torch.complex64]
SIZES = [0, 1, 3, 7, 17, 255, 4095, 4097, 65537, 300_001]
GUARD = 64


@pytest.fixture(params=["front-end", "python-checked"], autouse=True)
def tensor_front_end(request, monkeypatch):
    """Run each test through the native tensor front end (when built) and without it, where
    batched_copy_ validates tensors in Python and hands pointers to the kernels."""
    if request.param == "front-end" and kernels._backend.tensor_module() is None:
        pytest.skip("native tensor front end not built")
    if request.param == "python-checked":
        monkeypatch.setattr(kernels._backend, "_TENSOR", None)
    return request.param


@pytest.fixture(params=["default", "forced"], autouse=True)
def thresholds(request):
    """Run each test with default thresholds and with threading/streaming forced on."""
    if request.param == "forced":
        if not kernels.native_available("cpu"):
            pytest.skip("native CPU kernels not built")
        kernels.set_parallel_threshold(0)
        kernels._backend._CPU.set_streaming_threshold(0)
        kernels._backend._CPU.set_num_threads(2)
        kernels._backend._CPU.set_chunk_bytes(4099)
    yield request.param
    if kernels.native_available("cpu"):
        kernels.set_parallel_threshold(1 << 20)
        kernels._backend._CPU.set_streaming_threshold(32 << 20)
        kernels._backend._CPU.set_chunk_bytes(1 << 20)
        kernels.set_num_threads(0)


def _random(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


def _guarded(numel, dtype, offset=0):
    """(view of numel elements, whole backing tensor) with GUARD elements of sentinel around."""
    backing = torch.full((numel + 2 * GUARD + offset,), 7, dtype=torch.int64).to(dtype)
    return backing[GUARD + offset:GUARD + offset + numel], backing


def _assert_guards_intact(backing, numel, offset=0):
    sentinel = torch.full((1,), 7, dtype=torch.int64).to(backing.dtype)
    assert torch.equal(backing[:GUARD + offset], sentinel.expand(GUARD + offset))
    assert torch.equal(backing[GUARD + offset + numel:], sentinel.expand(GUARD))


def test_backend_is_reported():
    assert kernels.active_backend("cpu") in ("native-cpu", "torch")
    assert (kernels.active_backend("cpu") == "native-cpu") == kernels.native_available("cpu")
    assert (kernels.native_unavailable_reason("cpu") is None) == kernels.native_available("cpu")
    assert kernels.active_backend("meta") == "torch"


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_copy_many_sizes_equals_torch(dtype):
    gen = torch.Generator().manual_seed(1)
    srcs = [_random((n,), dtype, gen) for n in SIZES]
    views = [_guarded(n, dtype, offset=i % 3) for i, n in enumerate(SIZES)]
    kernels.batched_copy_([v for v, _ in views], srcs)
    for i, ((view, backing), src, n) in enumerate(zip(views, srcs, SIZES)):
        assert torch.equal(view, src), f"size {n}"
        _assert_guards_intact(backing, n, offset=i % 3)


@pytest.mark.parametrize("src_off,dst_off", [(0, 0), (1, 0), (0, 3), (5, 11), (15, 1), (8, 8)])
def test_byte_misaligned_pointers(src_off, dst_off):
    gen = torch.Generator().manual_seed(2)
    sizes = [1, 15, 16, 63, 64, 4096 + 5, 70_000]
    srcs = [_random((n + src_off,), torch.uint8, gen)[src_off:] for n in sizes]
    views = [_guarded(n, torch.uint8, offset=dst_off) for n in sizes]
    kernels.batched_copy_([v for v, _ in views], srcs)
    for (view, backing), src, n in zip(views, srcs, sizes):
        assert torch.equal(view, src)
        _assert_guards_intact(backing, n, offset=dst_off)


def _noncontiguous_cases(gen):
    """(dst, src) pairs of equal shape and dtype with non-contiguous layouts."""
    base = _random((37, 29), torch.float32, gen)
    out = torch.zeros(37, 40)
    wide = _random((37, 40), torch.float32, gen)
    return [
        (torch.zeros(37, 5), base[:, 3:8]),                      # strided src, contiguous dst
        (out[:, 2:31], base),                                    # strided dst (pitch 40), contiguous src
        (torch.zeros(50, 64)[::2, 1:30], wide[:25, 3:32]),     # both strided, rows of 29
        (torch.zeros(37, 40)[:, 7:12], base[:, 10:15]),         # both strided, different pitches
        (torch.zeros(16), base.reshape(-1)[::71]),               # 1-element rows
        (torch.zeros(29, 37), base.t()),                         # transposed: torch fallback
        (torch.zeros(3, 4, 5), _random((5, 4, 3), torch.float32, gen).permute(2, 1, 0)),  # 3-level: fallback
        (torch.zeros(4, 29), base[:1].expand(4, 29)),            # broadcast source (pitch 0)
        (torch.zeros(0, 5), base[:0, :5]),                       # zero rows
        (torch.zeros(()), base[3, 4]),                           # 0-dim
    ]


def test_noncontiguous_equals_torch():
    gen = torch.Generator().manual_seed(3)
    cases = _noncontiguous_cases(gen)
    expected = [d.clone().copy_(s) for d, s in cases]
    kernels.batched_copy_([d for d, _ in cases], [s for _, s in cases])
    for i, ((d, _), e) in enumerate(zip(cases, expected)):
        assert torch.equal(d, e), f"case {i}"


def test_strided_destination_leaves_gaps_untouched():
    gen = torch.Generator().manual_seed(4)
    out = torch.full((20, 16), -1.0)
    src = _random((20, 9), torch.float32, gen)
    kernels.batched_copy_([out[:, 4:13]], [src])
    assert torch.equal(out[:, 4:13], src)
    assert bool((out[:, :4] == -1).all()) and bool((out[:, 13:] == -1).all())


def test_large_mixed_batch_matches_torch_and_torch_backend():
    gen = torch.Generator().manual_seed(5)
    sizes = torch.randint(0, 9000, (300,), generator=gen).tolist()
    dtypes = [DTYPES[i % len(DTYPES)] for i in range(len(sizes))]
    srcs = [_random((n,), dt, gen) for n, dt in zip(sizes, dtypes)]
    native = [torch.zeros(n, dtype=dt) for n, dt in zip(sizes, dtypes)]
    reference = [torch.zeros(n, dtype=dt) for n, dt in zip(sizes, dtypes)]
    kernels.batched_copy_(native, srcs)
    kernels.batched_copy_(reference, srcs, backend="torch")
    assert all(torch.equal(a, b) and torch.equal(a, s) for a, b, s in zip(native, reference, srcs))


def test_big_tensor_split_across_threads():
    gen = torch.Generator().manual_seed(6)
    src = _random((3 * (1 << 20) + 13,), torch.uint8, gen)  # above the default threshold
    dst, backing = _guarded(src.numel(), torch.uint8, offset=1)
    kernels.batched_copy_([dst], [src])
    assert torch.equal(dst, src)
    _assert_guards_intact(backing, src.numel(), offset=1)


def test_empty_batch_is_a_no_op():
    kernels.batched_copy_([], [])


def test_thread_planning():
    if not kernels.native_available("cpu"):
        pytest.skip("native CPU kernels not built")
    kernels.set_parallel_threshold(1 << 20)
    kernels.set_num_threads(2)
    assert kernels.threads_for(1000) == 1
    assert kernels.threads_for(1 << 30) == 2
    kernels.set_num_threads(1)
    assert kernels.threads_for(1 << 30) == 1


def test_native_writes_bump_the_destination_version_like_copy_():
    """Autograd sees every write: through the tensor front end, the checked path (strided
    pairs) and scatter, the destination's version counter moves as with copy_."""
    dsts = [torch.zeros(6), torch.zeros(8, 4)[:, :2]]
    srcs = [torch.ones(6), torch.ones(8, 2)]
    before = [d._version for d in dsts]
    kernels.batched_copy_(dsts, srcs)
    assert all(d._version > v for d, v in zip(dsts, before))
    buffer, offsets = kernels.gather(srcs)
    before = [d._version for d in dsts]
    kernels.scatter(buffer, dsts, offsets)
    assert all(d._version > v for d, v in zip(dsts, before))
