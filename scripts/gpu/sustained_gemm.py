#!/usr/bin/env python3
"""A large GEMM run back to back for seconds, its TFLOP/s per window beside the SM clock and power: the rate a
training step sustains against the rate of a short burst (issue 21's missing term).

The ground truth's isolated GEMMs (short bursts, the GPU idle between them) reached 0.72 of the datasheet bf16
peak on an H200; the published end-to-end runs imply 0.59. Part of that gap may be the clock a GPU held at its
power limit runs at; this measures it: the first window's rate (the burst), the rate of the last quarter of the
run (sustained), their ratio, and the SM clock, power and throttle reasons over the run
(``groundtruth/clocks.py``, ``nvidia-smi``). The cost model's prediction for one GEMM of the shape is printed
beside it.

  python scripts/gpu/sustained_gemm.py [--seconds 20] [--size 8192] [--precision bf16|fp8] [--json PATH]
  python scripts/gpu/sustained_gemm.py --dry-run        # the plan and the model's rate; needs no GPU
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROG = "sustained_gemm.py"
SUSTAINED_SHARE = 0.25
"""The sustained rate is the median over the last quarter of the windows (after the clock has settled)."""


def model_seconds(size: int, precision: str, system_name: str) -> float:
    """The cost model's time of one [size, size] x [size, size] GEMM (bf16 output) on ``system_name``."""
    from h3t_ext.costmodel.kernels import gemm_seconds, kernel_rates
    from h3t_ext.costmodel.specs import get_system

    return gemm_seconds(size, size, size, kernel_rates(get_system(system_name)), fp8=precision == "fp8")


def summarize(windows: list[tuple[float, float]], peak_flops: float) -> dict:
    """``windows``: (seconds since the start, achieved FLOP/s) per window, in order. Returns the burst (first
    window) and sustained (median of the last ``SUSTAINED_SHARE``) rates, their ratio and shares of ``peak``."""
    if not windows:
        return {}
    rates = [r for _, r in windows]
    tail = rates[-max(1, math.ceil(len(rates) * SUSTAINED_SHARE)):]
    burst, sustained = rates[0], statistics.median(tail)
    return {"windows": len(rates), "burst_tflops": burst / 1e12, "sustained_tflops": sustained / 1e12,
            "sustained_over_burst": sustained / burst, "burst_share_of_peak": burst / peak_flops,
            "sustained_share_of_peak": sustained / peak_flops}


def _parser():
    from h3t_training.config.arguments import OneLineParser

    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0, help="how long the GEMMs run back to back (1-300)")
    p.add_argument("--window-s", type=float, default=0.25, help="GPU time per timed window (0.01-5)")
    p.add_argument("--size", type=int, default=8192, help="M = N = K of the GEMM (256-32768)")
    p.add_argument("--precision", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--system", default="h100-sxm", help="the cost model's system file (the prediction, the peak)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--dry-run", action="store_true")
    return p


def _run(args, per_gemm_s: float) -> tuple[list[tuple[float, float]], dict]:
    import torch
    from groundtruth.clocks import Sampler

    n = args.size
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if args.precision == "fp8":
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")

        def gemm():
            return torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)
    else:
        def gemm():
            return a @ b
    for _ in range(3):
        gemm()
    torch.cuda.synchronize()
    per_window = max(1, round(args.window_s / per_gemm_s))
    flops = 2.0 * n * n * n * per_window
    windows, marks = [], []
    with Sampler() as clocks:
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.seconds:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_window):
                gemm()
            end.record()
            marks.append((time.monotonic() - t0, start, end))
            if len(marks) >= 4:  # keep the queue a few windows deep: the GPU never waits for the host
                t, s, e = marks.pop(0)
                e.synchronize()
                windows.append((t, flops / (s.elapsed_time(e) / 1e3)))
        for t, s, e in marks:
            e.synchronize()
            windows.append((t, flops / (s.elapsed_time(e) / 1e3)))
    return windows, clocks.record()


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    for name, lo, hi in (("seconds", 1, 300), ("window_s", 0.01, 5), ("size", 256, 32768)):
        v = getattr(args, name)
        if not lo <= v <= hi:
            p.error(f"--{name.replace('_', '-')} must be in [{lo:g}, {hi:g}], got {v:g}")
    from h3t_ext.costmodel.errors import UnknownNameError
    from h3t_ext.costmodel.specs import get_system

    try:
        system = get_system(args.system)
    except UnknownNameError as e:
        p.error(f"--system: {e}")
    peak = system.peak_fp8_flops if args.precision == "fp8" else system.peak_bf16_flops
    if peak <= 0:
        p.error(f"--precision {args.precision}: the {args.system} system file states no {args.precision} peak")
    predicted = model_seconds(args.size, args.precision, args.system)
    model_rate = 2.0 * args.size ** 3 / predicted
    plan = (f"{args.precision} GEMM {args.size}^3 back to back for {args.seconds:g} s in windows of "
            f"~{args.window_s:g} s; the model ({args.system}): {predicted * 1e3:.3f} ms per GEMM, "
            f"{model_rate / 1e12:.0f} TFLOP/s ({model_rate / peak:.2f} of the {peak / 1e12:.0f} TFLOP/s peak)")
    if args.dry_run:
        print(plan)
        return 0
    import torch

    if not torch.cuda.is_available():
        print(f"{PROG}: error: no CUDA GPU (use --dry-run to print the plan)", file=sys.stderr)
        return 1
    print(plan, flush=True)
    windows, clocks = _run(args, predicted)
    result = summarize(windows, peak)
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "precision": args.precision,
           "size": args.size, "seconds": args.seconds, "system": args.system, "peak_tflops": peak / 1e12,
           "model_tflops": model_rate / 1e12, **result, "clocks": clocks,
           "rate_by_window": [{"t_s": t, "tflops": r / 1e12} for t, r in windows]}
    s = clocks.get("summary", {})
    print(f"burst {result['burst_tflops']:.0f} TFLOP/s, sustained {result['sustained_tflops']:.0f} "
          f"({result['sustained_over_burst']:.3f} of the burst, {result['sustained_share_of_peak']:.3f} of peak); "
          + (f"SM clock median {s['sm_clock_mhz_median']:.0f} of {s['sm_clock_max_mhz']:.0f} MHz, power "
             f"{s.get('power_w_median', float('nan')):.0f} W, power-capped {s['power_cap_throttled_share']:.0%} "
             f"of samples" if s else clocks.get("why", "no clock samples")))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
