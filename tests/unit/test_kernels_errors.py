"""Bad arguments raise one clear error naming the argument, and nothing is written (these
batches are below the parallel threshold; larger ones are in test_kernels_fast.py).

The Python wrapper validates first; the native module validates again (bounds, overlap,
overflow), so its checks are exercised directly with raw pointers as well.
"""
import pytest
import torch

from h3t_ext import kernels


def _inference_zeros(n):
    with torch.inference_mode():
        return torch.zeros(n)


def _untouched(*tensors):
    return [t.clone() for t in tensors]


@pytest.mark.parametrize("dsts,srcs,exc,match", [
    ([torch.zeros(3)], [torch.zeros(3), torch.zeros(3)], ValueError, r"dsts has 1 tensors but srcs has 2"),
    ([torch.zeros(3)], [torch.zeros(3, dtype=torch.float16)], TypeError, r"dsts\[0\] has dtype torch.float32"),
    ([torch.zeros(3)], [torch.zeros(4)], ValueError, r"dsts\[0\] has shape \(3,\) but srcs\[0\]"),
    ([torch.zeros(2, 3)], [torch.zeros(3)], ValueError, r"shape"),
    ([torch.zeros(3)], [[1.0, 2.0, 3.0]], TypeError, r"srcs\[0\] must be a torch.Tensor"),
    (torch.zeros(3), [torch.zeros(3)], TypeError, r"dsts must be a list or tuple"),
    ([torch.zeros(1, 3).expand(4, 3)], [torch.zeros(4, 3)], ValueError, r"dsts\[0\] has overlapping elements"),
    ([_inference_zeros(3)], [torch.zeros(3)], ValueError, r"dsts\[0\] is an inference tensor"),
])
def test_batched_copy_rejects_bad_arguments(dsts, srcs, exc, match):
    before = _untouched(*[d for d in dsts if isinstance(d, torch.Tensor)]) if isinstance(dsts, list) else None
    with pytest.raises(exc, match=match):
        kernels.batched_copy_(dsts, srcs)
    if before is not None:
        assert all(torch.equal(a, b) for a, b in zip(before, dsts))


def test_error_messages_are_one_line():
    with pytest.raises(ValueError) as info:
        kernels.batched_copy_([torch.zeros(3)], [torch.zeros(4)])
    assert "\n" not in str(info.value) and str(info.value).startswith("batched_copy_:")


def test_bad_backend_name():
    with pytest.raises(ValueError, match=r"backend must be one of"):
        kernels.batched_copy_([torch.zeros(1)], [torch.zeros(1)], backend="fast")


def test_destination_overlapping_its_source_is_rejected_natively():
    if not kernels.native_available("cpu"):
        pytest.skip("native CPU kernels not built")
    x = torch.arange(100, dtype=torch.float32)
    before = x.clone()
    with pytest.raises(ValueError, match=r"dsts\[0\] overlaps srcs\[0\]"):
        kernels.batched_copy_([x[10:60]], [x[:50]])
    assert torch.equal(x, before)


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"out": torch.zeros(10, dtype=torch.uint8)}, ValueError, r"out holds 10 bytes but the tensors need 96"),
    ({"out": torch.zeros(64)}, ValueError, r"out must be a 1-D contiguous torch.uint8"),
    ({"out": torch.zeros(64, 2, dtype=torch.uint8)[:, 0]}, ValueError, r"out must be a 1-D contiguous"),
    ({"offsets": [0, 8]}, ValueError, r"offsets\[1\] overlaps the region of offsets\[0\]"),
    ({"offsets": [0]}, ValueError, r"offsets has 1 entries but tensors has 2"),
    ({"offsets": [0, -16]}, ValueError, r"offsets\[1\] must be an int >= 0"),
    ({"offsets": (0, 2.5)}, ValueError, r"offsets\[1\] must be an int"),
    ({"alignment": 0}, ValueError, r"alignment must be an int >= 1"),
])
def test_gather_rejects_bad_arguments(kwargs, exc, match):
    tensors = [torch.ones(4), torch.ones(2, 4)]
    out = kwargs.get("out")
    before = out.clone() if isinstance(out, torch.Tensor) else None
    with pytest.raises(exc, match=match):
        kernels.gather(tensors, **kwargs)
    if before is not None:
        assert torch.equal(out, before)


def test_scatter_rejects_a_buffer_too_small():
    tensors = [torch.zeros(4), torch.zeros(8)]
    with pytest.raises(ValueError, match=r"buffer holds 40 bytes but the tensors need 48"):
        kernels.scatter(torch.zeros(40, dtype=torch.uint8), tensors, [0, 16])
    assert all(bool((t == 0).all()) for t in tensors)


def test_scatter_rejects_an_expanded_destination():
    with pytest.raises(ValueError, match=r"tensors\[0\] has overlapping elements"):
        kernels.scatter(torch.zeros(64, dtype=torch.uint8), [torch.zeros(1, 4).expand(2, 4)], [0])


# --- the native module's own guards (raw pointers; callers never do this) --------------


@pytest.fixture
def native():
    if not kernels.native_available("cpu"):
        pytest.skip("native CPU kernels not built")
    return kernels._backend.cpu_module()


def test_native_gather_refuses_to_write_past_the_buffer(native):
    buf = torch.zeros(128, dtype=torch.uint8)
    src = torch.ones(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"offsets\[0\] = 100 with 64 bytes runs past the buffer of 100"):
        native.gather(buf.data_ptr(), 100, [src.data_ptr()], [100], [64])
    with pytest.raises(ValueError, match=r"runs past the buffer"):
        native.gather(buf.data_ptr(), 128, [src.data_ptr()], [2**64 - 8], [64])  # offset + size wraps
    with pytest.raises(ValueError, match=r"runs past the buffer"):
        native.scatter(buf.data_ptr(), 128, [src.data_ptr()], [65], [64])
    assert bool((buf == 0).all()) and bool((src == 1).all())


def test_native_rejects_overflow_null_and_length_mismatch(native):
    a, b = torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"overflows"):
        native.copy_2d([a.data_ptr()], [2**63], [b.data_ptr()], [16], [16], [4])
    with pytest.raises(ValueError, match=r"rows \* row_bytes overflows"):
        native.copy_2d([a.data_ptr()], [2**40], [b.data_ptr()], [2**40], [2**40], [2**40])
    with pytest.raises(ValueError, match=r"null pointer"):
        native.batched_copy([0], [b.data_ptr()], [16])
    with pytest.raises(ValueError, match=r"nbytes has 2 entries, expected 1"):
        native.batched_copy([a.data_ptr()], [b.data_ptr()], [16, 16])
    with pytest.raises(ValueError, match=r"smaller than the row width"):
        native.copy_2d([a.data_ptr()], [2], [b.data_ptr()], [4], [4], [3])
    with pytest.raises(ValueError, match=r"overlaps the region"):
        native.gather(a.data_ptr(), 16, [b.data_ptr(), b.data_ptr()], [0, 4], [8, 8])
    assert bool((a == 0).all())
    native.batched_copy([0], [0], [0])  # zero bytes: null pointers are fine
