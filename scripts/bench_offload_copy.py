#!/usr/bin/env python
"""Benchmark the offload copy kernels against torch on this machine's CPU.

Cases (override with --cases): 2,000 tensors of 64 KiB and 16 tensors of 64 MiB. For each,
times (best and median of --repeats, the three methods interleaved so that machine load
hits them alike):
  native   h3t_ext.kernels.batched_copy_ over all tensors (one native call)
  loop     a Python loop of torch Tensor.copy_
  foreach  torch._foreach_copy_ (torch's own fused multi-tensor copy), for reference
  single   one copy of a single tensor of the same total bytes, by torch and by the
           native kernel; the faster is the machine's memory-bandwidth reference, and
           loop / single ("ceiling") bounds the speedup any batched copy can have here

Tensors are --dtype (default bfloat16, the activation dtype). Note that torch splits one
copy over its intra-op threads above 32768 elements, so with uint8 each 64 KiB copy_ of
the loop is itself multithreaded (and slower under load).

Usage: python scripts/bench_offload_copy.py [--json] [--repeats 7] [--threads 0] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from h3t_ext import kernels

CASES = {"many_small": (2000, 64 << 10), "few_large": (16, 64 << 20)}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _summary(times: list[float], nbytes: int) -> dict:
    best, median = min(times), statistics.median(times)
    return {"best_s": best, "median_s": median, "best_GBps": nbytes / best / 1e9, "median_GBps": nbytes / median / 1e9}


DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "uint8": torch.uint8}


def run_case(name: str, count: int, size: int, repeats: int, dtype: torch.dtype) -> dict:
    numel = size // torch.tensor([], dtype=dtype).element_size()
    srcs = [torch.randint(0, 100, (numel,)).to(dtype) for _ in range(count)]
    dsts = [torch.zeros(numel, dtype=dtype) for _ in range(count)]
    total = count * size
    big_src = torch.randint(0, 100, (count * numel,)).to(dtype)
    big_dst = torch.zeros(count * numel, dtype=dtype)

    def loop():
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    methods = {
        "native": lambda: kernels.batched_copy_(dsts, srcs),
        "loop": loop,
        "foreach": lambda: torch._foreach_copy_(dsts, srcs),
        "single_torch": lambda: big_dst.copy_(big_src),
        "single_native": lambda: kernels.batched_copy_([big_dst], [big_src]),
    }
    for fn in methods.values():  # warm-up: first-touch page faults, thread start-up
        fn()
    times = {k: [] for k in methods}
    for _ in range(repeats):
        for key, fn in methods.items():
            times[key].append(_timed(fn))
    kernels.batched_copy_(dsts, srcs)
    correct = all(torch.equal(d, s) for d, s in zip(dsts, srcs))
    res = {key: _summary(t, total) for key, t in times.items()}
    single_best = min(res["single_torch"]["best_s"], res["single_native"]["best_s"])
    single_median = min(res["single_torch"]["median_s"], res["single_native"]["median_s"])
    return {
        "case": name, "dtype": str(dtype).removeprefix("torch."), "tensors": count, "tensor_bytes": size, "total_bytes": total, "correct": correct,
        "native_threads": kernels.threads_for(total), **res,
        "speedup_vs_loop_best": res["loop"]["best_s"] / res["native"]["best_s"],
        "speedup_vs_loop_median": res["loop"]["median_s"] / res["native"]["median_s"],
        "fraction_of_single_best": single_best / res["native"]["best_s"],
        # The bound on any speedup over the loop here: a copy at the single-copy bandwidth.
        "single_vs_loop_best": res["loop"]["best_s"] / single_best,
        "single_vs_loop_median": res["loop"]["median_s"] / single_median,
        "fraction_of_single_median": single_median / res["native"]["median_s"],
    }


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--repeats", type=int, default=7, help="timed repetitions per method (>= 1)")
    p.add_argument("--threads", type=int, default=0, help="native copy threads (0: all cores)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="tensor dtype")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    args = p.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads < 0:
        p.error(f"--threads must be >= 0, got {args.threads}")
    if unknown:
        p.error(f"--cases: unknown {unknown}; valid: {list(CASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    kernels.set_num_threads(args.threads)
    results = [run_case(c, *CASES[c], args.repeats, DTYPES[args.dtype]) for c in args.cases.split(",")]
    out = {"backend": kernels.active_backend("cpu"), "tensor_front_end": kernels.tensor_front_end(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "loadavg_1min_after": os.getloadavg()[0], "repeats": args.repeats, "cases": results}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"backend {out['backend']} (tensor front end: {out['tensor_front_end']}), {out['cpus']} cpus, load {out['loadavg_1min_after']:.2f}")
    for r in results:
        print(f"{r['case']}: {r['tensors']} x {r['tensor_bytes'] >> 10} KiB {r['dtype']},"
              f" native threads {r['native_threads']}")
        for key in ("native", "loop", "foreach", "single_torch", "single_native"):
            print(f"  {key:14s} best {r[key]['best_GBps']:6.2f} GB/s  median {r[key]['median_GBps']:6.2f} GB/s")
        print(f"  native vs loop: {r['speedup_vs_loop_best']:.2f}x best, {r['speedup_vs_loop_median']:.2f}x median;"
              f" of single-copy bandwidth: {r['fraction_of_single_best']:.0%} best,"
              f" {r['fraction_of_single_median']:.0%} median")
        print(f"  ceiling (single copy vs loop): {r['single_vs_loop_best']:.2f}x best,"
              f" {r['single_vs_loop_median']:.2f}x median")
    return 0


if __name__ == "__main__":
    sys.exit(main())
