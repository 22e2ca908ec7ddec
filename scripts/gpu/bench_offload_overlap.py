#!/usr/bin/env python3
"""Offload overlap on one GPU: forward and backward of a stack of layers through the activation
manager with alpha in {0, 0.5, 1}, as the 1F1B steady state runs them (the offload of one
microbatch overlaps the next microbatch's forward, its reload the backward before its own).
Prints step time, peak memory and the time ratio against alpha 0 (``--json``: one object).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _step(mgr, layers, xs):
    import torch

    outs = []
    for i, x in enumerate(xs):  # forwards, each offloaded while the next one computes
        with mgr.forward_scope(i, 0):
            y = x
            for layer in layers:
                y = layer(y)
            outs.append(y.float().pow(2).mean())
        mgr.offload(i, 0)
    for i in reversed(range(len(xs))):  # backwards, each reload overlapping the backward before it
        if i > 0:
            mgr.reload(i - 1, 0)
        mgr.reload(i, 0)
        with mgr.backward_scope(i, 0):
            outs[i].backward()
        mgr.release(i, 0)
    mgr.end_iteration()
    torch.cuda.synchronize()


def run(alpha: float, *, hidden: int, layers: int, tokens: int, microbatches: int, repeats: int) -> dict:
    import torch

    from h3t_ext.runtime.memory.activations import ActivationManager
    from h3t_ext.runtime.memory.device import make_device_layer

    torch.manual_seed(0)
    stack = [torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                 torch.nn.Linear(4 * hidden, hidden)).cuda().to(torch.bfloat16) for _ in range(layers)]
    xs = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
          for _ in range(microbatches)]
    mgr = ActivationManager(alpha, make_device_layer("cuda", "cuda"), min_offload_bytes=0)
    _step(mgr, stack, xs)
    torch.cuda.reset_peak_memory_stats()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _step(mgr, stack, xs)
        best = min(best, time.perf_counter() - t0)
    return {"alpha": alpha, "step_s": best, "peak_bytes": torch.cuda.max_memory_allocated(),
            "offloaded_bytes": mgr.stats.offloaded_bytes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.stderr.write("bench_offload_overlap.py: error: no CUDA device\n")
        return 1
    rows = [run(a, hidden=args.hidden, layers=args.layers, tokens=args.tokens, microbatches=args.microbatches,
                repeats=args.repeats) for a in (0.0, 0.5, 1.0)]
    for r in rows:
        r["step_time_ratio"] = r["step_s"] / rows[0]["step_s"]
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(f"alpha {r['alpha']:.1f}: step {1e3 * r['step_s']:.1f} ms ({r['step_time_ratio']:.3f}x alpha 0), "
                  f"peak {r['peak_bytes'] / 2**30:.2f} GiB, offloaded {r['offloaded_bytes'] / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
