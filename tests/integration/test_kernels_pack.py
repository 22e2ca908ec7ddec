"""gather / scatter into one byte buffer, host allocation, and the torch fallback path."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from h3t_ext import kernels

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tensors(gen):
    a = torch.randn(33, 17, generator=gen)
    wide = torch.randn(40, 24, generator=gen, dtype=torch.float64)
    return [
        torch.randn(1000, generator=gen).half(),
        torch.randint(-100, 100, (7, 3), generator=gen),
        a[:, 2:9],                                   # row-strided
        wide.t()[:5],                                # not row-strided: torch path
        torch.zeros(0, 4),                           # empty
        torch.randint(0, 2, (123,), generator=gen).bool(),
        torch.tensor(3.5, dtype=torch.bfloat16),     # 0-dim
        torch.randn(70_001, generator=gen),
    ]


def _bytes(t):
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("alignment", [1, 64, 4096])
def test_gather_layout_and_scatter_roundtrip(backend, alignment):
    gen = torch.Generator().manual_seed(7)
    tensors = _tensors(gen)
    buf, offsets = kernels.gather(tensors, alignment=alignment, backend=backend)
    expected_offsets, total = kernels.packed_offsets(tensors, alignment)
    assert offsets == expected_offsets and buf.numel() == total
    assert all(o % alignment == 0 for o in offsets)
    for t, off in zip(tensors, offsets):
        assert torch.equal(buf[off:off + t.nbytes], _bytes(t))
    restored = [torch.full_like(t, 0) if t.dtype != torch.bool else torch.zeros_like(t) for t in tensors]
    restored[2] = torch.zeros(33, 20)[:, 5:12]        # strided destination as well
    restored[3] = torch.zeros(40, 24, dtype=torch.float64).t()[:5]
    kernels.scatter(buf, restored, offsets, backend=backend)
    for t, r in zip(tensors, restored):
        assert torch.equal(t, r)


def test_gather_into_given_buffer_at_given_offsets_leaves_rest():
    gen = torch.Generator().manual_seed(8)
    tensors = [torch.randn(100, generator=gen), torch.randn(3, 5, generator=gen)[:, 1:4]]
    out = torch.full((1000,), 0xAB, dtype=torch.uint8)
    offsets = [500, 13]                                # unaligned, out of order
    _, got = kernels.gather(tensors, out, offsets)
    assert got == offsets
    assert torch.equal(out[500:900], _bytes(tensors[0]))
    assert torch.equal(out[13:49], _bytes(tensors[1].contiguous()))
    mask = torch.ones(1000, dtype=torch.bool)
    mask[500:900] = False
    mask[13:49] = False
    assert bool((out[mask] == 0xAB).all())


def test_native_matches_torch_backend_byte_for_byte():
    gen = torch.Generator().manual_seed(9)
    tensors = _tensors(gen)
    _, total = kernels.packed_offsets(tensors)
    a, _ = kernels.gather(tensors, torch.zeros(total, dtype=torch.uint8), backend="auto")
    b, _ = kernels.gather(tensors, torch.zeros(total, dtype=torch.uint8), backend="torch")
    assert torch.equal(a, b)


def test_alloc_host_is_page_aligned_and_usable():
    t = kernels.alloc_host(3 * 4096 + 5, numa_node=0 if os.path.exists("/sys/devices/system/node/node0") else None)
    assert t.dtype == torch.uint8 and t.numel() == 3 * 4096 + 5 and t.device.type == "cpu"
    if kernels.native_available("cpu"):
        assert t.data_ptr() % 4096 == 0
        node = kernels._backend._CPU.numa_node_of(t.data_ptr())
        assert node in (-1, 0)
    t.fill_(5)
    assert int(t.sum()) == 5 * t.numel()
    assert kernels.alloc_host(0).numel() == 0


def test_alloc_pinned_without_cuda_is_host_memory():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by the GPU tests")
    t = kernels.alloc_pinned(10_000)
    assert t.numel() == 10_000 and t.device.type == "cpu"


def test_package_works_without_the_extension():
    """Block the native module: everything falls back to torch and says so."""
    code = textwrap.dedent("""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.startswith("h3t_ext.kernels._copy_"):
                    raise ImportError("blocked for the test")
        sys.meta_path.insert(0, Block())
        import torch
        from h3t_ext import kernels
        assert kernels.active_backend("cpu") == "torch", kernels.active_backend("cpu")
        assert "blocked" in kernels.native_unavailable_reason("cpu")
        src = [torch.randn(5, 7), torch.randn(9, 4)[:, 1:3]]
        dst = [torch.zeros(5, 7), torch.zeros(9, 2)]
        kernels.batched_copy_(dst, src)
        assert all(torch.equal(d, s) for d, s in zip(dst, src))
        buf, off = kernels.gather(src)
        back = [torch.zeros(5, 7), torch.zeros(9, 2)]
        kernels.scatter(buf, back, off)
        assert all(torch.equal(b, s) for b, s in zip(back, src))
        try:
            kernels.batched_copy_(dst, src, backend="native")
        except RuntimeError as exc:
            assert "backend='native'" in str(exc)
        else:
            raise AssertionError("backend='native' without the extension must raise")
        print("OK")
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("OK")
