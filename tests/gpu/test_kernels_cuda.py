"""CUDA copy kernels: compile check with nvcc (no GPU needed), and GPU behaviour behind a skip."""
import os
import shutil
import subprocess
import sysconfig

import pybind11
import pytest
import torch

from h3t_ext import kernels

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(REPO, "csrc")
NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if os.path.exists("/usr/local/bin/nvcc") else None)
# Compilers must not inherit a sanitizer preload (scripts/run_kernel_tests_asan.sh sets one).
ENV = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def _cuda_include():
    out = subprocess.run([NVCC, "--version"], capture_output=True, text=True, check=True, env=ENV).stdout
    roots = [os.environ.get("CUDA_HOME"), os.path.dirname(os.path.dirname(os.path.realpath(NVCC))), "/usr/local/cuda"]
    roots += sorted((os.path.join("/usr/local", d) for d in os.listdir("/usr/local") if d.startswith("cuda-")),
                    reverse=True)
    for root in roots:
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
            return os.path.join(root, "include")
    pytest.skip(f"nvcc found ({out.splitlines()[-1]}) but no cuda_runtime.h")


@pytest.fixture(scope="module")
def copy_cuda_object(tmp_path_factory):
    """csrc/copy_cuda.cu compiled by nvcc as setup.py compiles it (warnings on): the object file."""
    if NVCC is None:
        pytest.skip("nvcc not found")
    obj = tmp_path_factory.mktemp("copy_cuda") / "copy_cuda.o"
    res = subprocess.run([NVCC, "-c", os.path.join(CSRC, "copy_cuda.cu"), "-o", str(obj), "-O1", "-std=c++17",
                          "-Xcompiler", "-fPIC,-Wall", f"-I{CSRC}"], capture_output=True, text=True, timeout=300,
                         env=ENV)
    assert res.returncode == 0, res.stderr
    return obj


def test_cuda_kernels_compile_with_nvcc(copy_cuda_object):
    assert copy_cuda_object.stat().st_size > 0
    syms = subprocess.run(["nm", "-C", str(copy_cuda_object)], capture_output=True, text=True, env=ENV).stdout
    for name in ("h3t::cuda::enqueue_tasks", "h3t::cuda::kernel_routes", "batched_copy_kernel"):
        assert name in syms, name


@pytest.mark.skipif(NVCC is None or shutil.which("g++") is None, reason="nvcc or g++ not found")
def test_cuda_bindings_compile_with_host_compiler():
    cmd = ["g++", "-fsyntax-only", "-std=c++17", "-Wall", f"-I{CSRC}", f"-I{_cuda_include()}",
           f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
           os.path.join(CSRC, "bindings_cuda.cpp")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr


def _toolkit_lib(include: str) -> str:
    root = os.path.dirname(include)
    for lib in (os.path.join(root, "lib64"), os.path.join(root, "lib")):  # a toolkit's, the wheels'
        if os.path.isdir(lib) and any(n.startswith("libcudart.so") for n in os.listdir(lib)):
            return lib
    pytest.skip(f"no libcudart.so under {root}")


@pytest.fixture(scope="module")
def cuda_module_built_here(copy_cuda_object, tmp_path_factory):
    """The CUDA module built as setup.py builds it (nvcc for copy_cuda.cu, the host compiler for the rest, linked
    with cudart) and imported on this machine, which may have no GPU: its Python surface and its checks, which run
    before any CUDA call, are tested without one."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    import importlib.util

    include = _cuda_include()
    lib = _toolkit_lib(include)
    so = tmp_path_factory.mktemp("cuda_module") / ("_copy_cuda" + sysconfig.get_config_var("EXT_SUFFIX"))
    cudart = sorted(n for n in os.listdir(lib) if n.startswith("libcudart.so"))[-1]
    res = subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-std=c++17", "-pthread", f"-I{CSRC}", f"-I{include}",
                          f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
                          *(os.path.join(CSRC, f) for f in ("bindings_cuda.cpp", "copy_plan.cpp", "host_alloc.cpp")),
                          str(copy_cuda_object), f"-L{lib}", f"-l:{cudart}", f"-Wl,-rpath,{lib}", "-o", str(so)],
                         capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-3000:]
    spec = importlib.util.spec_from_file_location("_copy_cuda", so)  # top level, beside any installed one
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _packed_tasks(layout, tasks) -> bytes:
    """CopyTask records as bytes at the offsets ``layout`` (TASK_LAYOUT) gives: (dst, src, rows, row_bytes,
    dst_pitch, src_pitch, on_device) each."""
    size, *offsets = layout
    out = bytearray()
    for task in tasks:
        rec = bytearray(size)
        for i, (off, value) in enumerate(zip(offsets, task)):
            width = 1 if i == len(offsets) - 1 else 8
            rec[off:off + width] = int(value).to_bytes(width, "little")
        out += rec
    return bytes(out)


def test_the_cuda_module_reads_the_tensor_front_ends_plans_and_checks_them_before_any_cuda_call(
        cuda_module_built_here):
    """The tensor front end packs a CUDA batch's tasks as bytes (cuda_copy_plan) and the CUDA module reads them
    (batched_copy_planned): both report the same task layout (batched_copy_ takes that path only then), and a plan
    that is no whole number of tasks, marks a pointer other than 0-3, or holds an invalid task is a ValueError naming
    it, raised before anything is enqueued; so is an on_device of batched_copy's that does not fit its copies."""
    from h3t_ext.kernels import _backend

    mod = cuda_module_built_here
    front = _backend.tensor_module()
    assert front is not None and tuple(front.TASK_LAYOUT) == tuple(mod.TASK_LAYOUT)
    layout = tuple(mod.TASK_LAYOUT)
    assert layout[0] >= 7 * 8 and len(layout) == 8
    assert mod.batched_copy_planned(b"", stream=0) == 0  # nothing to copy: no CUDA call
    with pytest.raises(ValueError, match=rf"tasks has {layout[0] + 1} bytes, not a multiple of a task's {layout[0]}"):
        mod.batched_copy_planned(b"\0" * (layout[0] + 1), stream=0)
    good = (0x10000, 0x20000, 1, 64, 64, 64, 1)
    with pytest.raises(ValueError, match=r"tasks\[1\]\.on_device must be 0-3 \(bit 0: dst, bit 1: src on the device\), "
                                         r"got 4$"):
        mod.batched_copy_planned(_packed_tasks(layout, [good, (*good[:6], 4)]), stream=0)
    with pytest.raises(ValueError, match=r"dsts\[0\] overlaps srcs\[0\]"):
        mod.batched_copy_planned(_packed_tasks(layout, [(0x10000, 0x10020, 1, 64, 64, 64, 0)]), stream=0)
    with pytest.raises(ValueError, match=r"srcs\[0\] is a null pointer"):
        mod.batched_copy_planned(_packed_tasks(layout, [(0x10000, 0, 1, 64, 64, 64, 0)]), stream=0)
    with pytest.raises(ValueError, match="on_device has 1 bytes for 2 copies"):
        mod.batched_copy([0x10000, 0x30000], [0x20000, 0x40000], [64, 64], stream=0, on_device=b"\x01")
    with pytest.raises(ValueError, match=r"on_device\[1\] must be 0-3 \(bit 0: dst, bit 1: src on the device\), "
                                         r"got 7$"):
        mod.batched_copy([0x10000, 0x30000], [0x20000, 0x40000], [64, 64], stream=0, on_device=b"\x01\x07")


def test_cpu_sources_do_not_include_torch_or_cuda():
    """Only the optional tensor front end includes torch; the kernels build without it."""
    for name in os.listdir(CSRC):
        if not name.endswith((".h", ".cpp", ".cu")):
            continue
        text = open(os.path.join(CSRC, name)).read()
        if name != "bindings_torch.cpp":
            assert "torch/" not in text and "ATen" not in text, name
        if not name.endswith(".cu"):
            assert "cuda_runtime" not in text, name


gpu = pytest.mark.skipif(not kernels.native_available("cuda"), reason="needs a GPU and the built CUDA module")


@gpu
@pytest.mark.parametrize("method", [0, 1, 2])
def test_gpu_roundtrip_through_pinned_buffer(method):
    gen = torch.Generator().manual_seed(0)
    host = [torch.randn(n, generator=gen) for n in (1, 17, 4096, 1 << 20)]
    dev = [h.cuda() for h in host]
    _, total = kernels.packed_offsets(dev)
    pinned = kernels.alloc_pinned(total)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    buf, offsets = kernels.gather(dev, pinned, stream=stream)
    back = [torch.empty_like(d) for d in dev]
    kernels.scatter(buf, back, offsets, stream=stream)
    stream.synchronize()
    assert all(torch.equal(b.cpu(), h) for b, h in zip(back, host))


@gpu
def test_gpu_batched_copy_strided_and_host_to_device():
    src = torch.randn(64, 48)
    dst = torch.zeros(64, 64, device="cuda")
    kernels.batched_copy_([dst[:, 8:56], dst[:, :4]], [src, src[:, :4]])
    torch.cuda.synchronize()
    assert torch.equal(dst[:, 8:56].cpu(), src)
    assert torch.equal(dst[:, :4].cpu(), src[:, :4])


@gpu
def test_gpu_contiguous_batch_takes_the_tensor_front_end_and_copies_both_ways():
    """The offload runtime's batch (many contiguous pairs between one GPU and pinned host memory) is read by the
    tensor front end in C++ and enqueued in one native call; the bytes equal torch's copy and every destination's
    version is bumped, as copy_ bumps it. Pairs on two GPUs, or an odd layout, take the checked path."""
    from h3t_ext.kernels import _backend

    front = _backend.tensor_module()
    assert front is not None
    gen = torch.Generator().manual_seed(1)
    host = [torch.randn(n, generator=gen) for n in (0, 1, 300, 16384, 1 << 18)]
    dev = [torch.empty_like(h, device="cuda") for h in host]
    pinned = [kernels.alloc_pinned(h.nbytes).view(h.dtype)[:h.numel()] if h.numel() else torch.empty(0)
              for h in host]
    for p, h in zip(pinned, host):
        p.copy_(h)
    device, tasks = front.cuda_copy_plan(dev, pinned)
    size, *offsets = front.TASK_LAYOUT
    fields = [[int.from_bytes(tasks[k * size + off:k * size + off + (1 if i == 6 else 8)], "little")
               for i, off in enumerate(offsets)] for k in range(len(tasks) // size)]
    assert device == torch.cuda.current_device() and len(tasks) == 4 * size  # no 0-byte pair
    assert [f[:2] for f in fields] == [[d.data_ptr(), p.data_ptr()] for d, p in zip(dev[1:], pinned[1:])]
    assert [f[2] * f[3] for f in fields] == [h.nbytes for h in host if h.numel()]
    assert [f[6] for f in fields] == [1] * 4  # every destination is a CUDA tensor, no source is
    _, back_tasks = front.cuda_copy_plan(pinned[1:], dev[1:])
    assert [back_tasks[k * size + offsets[6]] for k in range(4)] == [2] * 4
    versions = [d._version for d in dev]
    stream = torch.cuda.Stream()
    kernels.batched_copy_(dev, pinned, stream=stream)
    back = [torch.empty_like(p) for p in pinned]
    stream.synchronize()
    kernels.batched_copy_(back, dev, stream=stream)
    stream.synchronize()
    assert all(torch.equal(b, h) for b, h in zip(back, host))
    assert all(d._version > v for d, v in zip(dev, versions))
    assert front.cuda_copy_plan([dev[2][::2]], [pinned[2][::2]]) is None  # strided: the checked path
    assert front.cuda_copy_plan([host[2]], [pinned[2]]) is None  # no CUDA tensor: not a CUDA batch


@gpu
def test_gpu_auto_routes_the_same_with_and_without_the_callers_hints():
    """The auto method gives a small copy to the SM kernel when both pointers are kernel-accessible. It asks the
    driver unless the caller marked a pointer as this device's memory (on_device) or the pointer lies in a buffer of
    alloc_pinned (read when the buffer was made); the answers are the driver's: device <-> alloc_pinned and torch's
    pinned memory go to the kernel, pageable host memory and copies over 1 MiB do not."""
    native = kernels._backend.cuda_module()
    n = 64 << 10
    dev = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(3)]
    ours = kernels.alloc_pinned(2 * n)  # one buffer, two slices: the registry covers the whole range
    theirs = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.uint8)
    big_dev = torch.empty(2 << 20, dtype=torch.uint8, device="cuda")
    big_host = kernels.alloc_pinned(2 << 20)
    pairs = [(dev[0], ours[:n]), (ours[n:], dev[1]), (dev[2], theirs), (pageable, dev[0]), (big_host, big_dev),
             (dev[1], dev[2])]
    dsts = [d.data_ptr() for d, _ in pairs]
    srcs = [s.data_ptr() for _, s in pairs]
    nbytes = [d.nbytes for d, _ in pairs]
    hints = bytes(int(d.is_cuda) | 2 * int(s.is_cuda) for d, s in pairs)
    want = [True, True, True, False, False, True]
    assert native.kernel_routes(dsts, srcs, nbytes) == want
    assert native.kernel_routes(dsts, srcs, nbytes, on_device=hints) == want
    with pytest.raises(ValueError, match=r"on_device\[0\] must be 0-3 \(bit 0: dst, bit 1: src on the device\), "
                                         r"got 4$"):
        native.kernel_routes(dsts, srcs, nbytes, on_device=bytes([4] * len(pairs)))
    with pytest.raises(ValueError, match="on_device has 1 bytes for 6 copies"):
        native.kernel_routes(dsts, srcs, nbytes, on_device=b"\x01")
