#!/usr/bin/env python3
"""Offload copies on a GPU: device -> pinned host and back, native batched copy against a loop of
``copy_(non_blocking=True)`` and against one large copy of the same bytes (the bandwidth ceiling).

Cases: 2,000 x 64 KiB (many small) and 16 x 64 MiB (few large). Prints a table, or one JSON object
with ``--json``. Every copy is enqueued on one side stream, as the offload runtime enqueues its copies. ``methods``
times each way the native module can enqueue the same batch: auto (what ``batched_copy_`` does: the SM copy kernel
for copies of at most 1 MiB, one ``cudaMemcpyBatchAsync`` for the rest), loop (one ``cudaMemcpyAsync`` per copy),
kernel (the SM copy kernel for all), and auto told which pointers are device memory (``auto_on_device``).
``beside_gemm`` enqueues each method's batch beside a run of bf16 GEMMs and gives the GEMMs' slowdown and the
copies' rate (the SM kernel shares the SMs, the copy engines do not). Needs CUDA and the native CUDA kernels
(``h3t_ext.kernels``); says so in one line otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CASES = {"many_small": (2000, 64 << 10), "few_large": (16, 64 << 20)}


def _time(fn, repeats: int, stream) -> float:
    """Best of ``repeats`` runs of ``fn`` enqueued on ``stream`` (host time until the stream is done)."""
    import torch

    def once():
        with torch.cuda.stream(stream):
            fn()
        stream.synchronize()

    once()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - t0)
    return best


METHODS = {0: "auto", 1: "loop", 2: "kernel"}
"""The native module's enqueue methods (csrc/copy_cuda.h); ``batched_copy_`` uses auto."""
HINTED = "auto_on_device"
"""Auto told which pointers are the device's memory (``on_device``, as ``batched_copy_`` tells it from the tensors),
so that it asks the driver about none of them: the host side lies in ``alloc_pinned`` buffers, which it knows."""


def run_case(count: int, nbytes: int, repeats: int) -> dict:
    """Every timing on one side stream, as the offload runtime enqueues its copies (the legacy default stream
    serialises with all other work and refuses the batch API)."""
    import torch

    from h3t_ext import kernels
    from h3t_ext.kernels import _backend

    stream, mod = torch.cuda.Stream(), _backend.cuda_module()
    dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(count)]
    host = [kernels.alloc_pinned(nbytes) for _ in range(count)]
    big_dev = torch.empty(count * nbytes, dtype=torch.uint8, device="cuda")
    big_host = kernels.alloc_pinned(count * nbytes)
    total = count * nbytes

    def loop(dsts, srcs):
        for d, s in zip(dsts, srcs):
            d.copy_(s, non_blocking=True)

    out = {}
    for direction, (dsts, srcs, bd, bs) in {"d2h": (host, dev, big_host, big_dev),
                                             "h2d": (dev, host, big_dev, big_host)}.items():
        t_native = _time(lambda: kernels.batched_copy_(dsts, srcs, stream=stream), repeats, stream)
        t_loop = _time(lambda: loop(dsts, srcs), repeats, stream)
        t_one = _time(lambda: bd.copy_(bs, non_blocking=True), repeats, stream)
        ptrs = ([t.data_ptr() for t in dsts], [t.data_ptr() for t in srcs], [t.nbytes for t in dsts])
        hints = bytes(int(d.is_cuda) | 2 * int(s.is_cuda) for d, s in zip(dsts, srcs))
        methods = {}
        for name, (m, on_device) in {**{n: (m, None) for m, n in METHODS.items()}, HINTED: (0, hints)}.items():
            t = _time(lambda: mod.batched_copy(*ptrs, stream=stream.cuda_stream, method=m, on_device=on_device),
                      repeats, stream)
            methods[name] = {"s": t, "speedup_over_loop": t_loop / t, "share_of_one_copy": t_one / t,
                             "gb_per_s": total / t / 1e9}
        out[direction] = {"native_s": t_native, "loop_s": t_loop, "one_copy_s": t_one,
                          "speedup_over_loop": t_loop / t_native, "share_of_one_copy": t_one / t_native,
                          "native_gb_per_s": total / t_native / 1e9, "methods": methods}
    return out


GEMMS, BATCHES = 12, 4
"""Beside the copies: twelve bf16 8192^3 products (~20 ms on an H200) on the compute stream, and the copy batch
enqueued four times on the side stream (~512 MiB for the small case, ~10-15 ms through the link)."""


def beside_gemm(count: int, nbytes: int, repeats: int) -> dict:
    """Each method's device -> pinned host batch, enqueued on a side stream beside a run of bf16 GEMMs on the compute
    stream, both started together behind a short GPU sleep: the GEMMs' time over the same GEMMs alone (the SM copy
    kernel takes SMs they would use; the copy engines take none, which is what the offload runtime's auto method
    trades when its copies overlap compute), and the copies' rate beside them; medians of ``repeats``."""
    import statistics

    import torch

    from h3t_ext import kernels
    from h3t_ext.kernels import _backend

    mod, side, compute = _backend.cuda_module(), torch.cuda.Stream(), torch.cuda.current_stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(count)]
    host = [kernels.alloc_pinned(nbytes) for _ in range(count)]
    ptrs = ([t.data_ptr() for t in host], [t.data_ptr() for t in dev], [nbytes] * count)

    def once(method):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)  # ~1 ms: the host enqueues both streams' work before either starts
        events[0].record(compute)
        for _ in range(GEMMS):
            torch.mm(a, b)
        events[1].record(compute)
        if method is not None:
            side.wait_event(events[0])
            events[2].record(side)
            for _ in range(BATCHES):
                mod.batched_copy(*ptrs, stream=side.cuda_stream, method=method)
            events[3].record(side)
        torch.cuda.synchronize()
        gemm_s = events[0].elapsed_time(events[1]) / 1e3
        return gemm_s, (events[2].elapsed_time(events[3]) / 1e3 if method is not None else None)

    once(None)
    alone = statistics.median(once(None)[0] for _ in range(repeats))
    out = {"gemm_alone_s": alone}
    for m, name in METHODS.items():
        once(m)
        runs = [once(m) for _ in range(repeats)]
        gemm, copy = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        out[name] = {"gemm_s": gemm, "gemm_slowdown": gemm / alone, "copy_s": copy,
                     "copy_gb_per_s": BATCHES * count * nbytes / copy / 1e9}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.stderr.write("bench_copy_cuda.py: error: no CUDA device\n")
        return 1
    from h3t_ext import kernels

    if not kernels.native_available(torch.device("cuda")):
        sys.stderr.write(f"bench_copy_cuda.py: error: native CUDA kernels not built "
                         f"({kernels.native_unavailable_reason(torch.device('cuda'))})\n")
        return 1
    results = {name: run_case(c, n, args.repeats) for name, (c, n) in CASES.items()}
    results["beside_gemm"] = {name: beside_gemm(c, n, max(3, args.repeats // 2)) for name, (c, n) in CASES.items()}
    if args.json:
        print(json.dumps(results))
    else:
        for name, r in results.items():
            if name == "beside_gemm":
                for case, by in r.items():
                    for m in METHODS.values():
                        print(f"{case:10s} d2h beside GEMMs, {m}: GEMMs {by[m]['gemm_slowdown']:.3f}x alone, "
                              f"copies {by[m]['copy_gb_per_s']:.1f} GB/s")
                continue
            for d, x in r.items():
                print(f"{name:10s} {d}: native {x['native_gb_per_s']:.1f} GB/s, {x['speedup_over_loop']:.2f}x the "
                      f"copy_ loop, {100 * x['share_of_one_copy']:.0f}% of one large copy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
