"""Where a training step's GPU time goes: one driver run under ``torch.profiler``, its kernels totalled by kind.

Why: the driver's 1-GPU steps on the H200 of 2026-11-28 took 1.7x the cost model's estimate (916 against 520 ms
for the ~1B Llama with ckpt=no, the local layer spec); the step time alone cannot say which term is mispriced.
This module runs one driver command (``pretrain_llama.py`` / ``pretrain_gpt.py`` and its flags) in this process
under the profiler (CUDA activity only), then sums every kernel's device time into the kinds the cost model
prices: GEMMs, attention, element-wise work (norms, activations, residual adds, RoPE, dropout), the loss, the
optimizer, host<->device copies and NCCL, per iteration (the run's iterations, warm-up included, so the figure is
a little above a steady step's).

    python scripts/gpu/groundtruth/kernel_profile.py --iterations N --json OUT -- ENTRY.py FLAGS...

``kind_of`` (a kernel name -> its kind) and ``summarize`` (device times -> the per-iteration table) are pure and
tested on CPU; the profiling needs a GPU.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
from typing import Iterable, Sequence

KINDS = ("gemm", "attention", "loss", "optimizer", "copy", "nccl", "elementwise")
"""The kinds, in the order ``kind_of`` tests them (the first match wins; element-wise is the rest)."""
_MARKERS = (
    ("copy", ("memcpy", "memset", "h3t_batched_copy", "h3t_copy")),
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attn", "sdpa", "mha_")),
    ("gemm", ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "ampere_", "wgrad", "dgrad")),
    ("loss", ("cross_entropy", "nll_loss", "log_softmax", "logsoftmax", "softmax_warp")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
)
TOP = 25
"""Kernels listed one by one (the longest by total device time)."""


def kind_of(name: str) -> str:
    """The kind (one of :data:`KINDS`) of a kernel or activity called ``name``."""
    low = name.lower()
    for kind, markers in _MARKERS:
        if any(m in low for m in markers):
            return kind
    return "elementwise"


def summarize(device_us: Iterable[tuple], iterations: int) -> dict:
    """Per-iteration milliseconds and kernel launches by kind, and the longest kernels, from (name, total device
    microseconds[, launches]) tuples: the launches tell a step bound by the host's dispatch (each launch costs the
    host some microseconds whatever the kernel's size) from one bound by the kernels."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    by_kind = {k: 0.0 for k in KINDS}
    launches = {k: 0 for k in KINDS}
    per_name: dict[str, float] = {}
    for name, us, *count in device_us:
        if us <= 0:
            continue
        by_kind[kind_of(name)] += us
        launches[kind_of(name)] += int(count[0]) if count else 0
        per_name[name] = per_name.get(name, 0.0) + us
    scale = 1e-3 / iterations
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:TOP]
    return {"iterations": iterations,
            "by_kind_ms_per_iteration": {k: v * scale for k, v in by_kind.items()},
            "total_ms_per_iteration": sum(by_kind.values()) * scale,
            "launches_per_iteration": {k: v / iterations for k, v in launches.items()},
            "top_ms_per_iteration": [[name, us * scale, kind_of(name)] for name, us in top]}


def _device_us(event) -> float:
    """An aggregated profiler event's own device time, microseconds (the attribute's name changed in torch 2.4)."""
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def profile(entry: str, argv: Sequence[str], iterations: int) -> dict:
    """Run ``entry`` with ``argv`` under the profiler; its kernels by kind (:func:`summarize`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    if not torch.cuda.is_available():
        raise SystemExit("kernel_profile.py: error: no CUDA GPU (the profile times GPU kernels)")
    saved = sys.argv
    sys.argv = [entry, *argv]
    code = 0
    try:
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            try:
                runpy.run_path(entry, run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            torch.cuda.synchronize()
    finally:
        sys.argv = saved
    if code:
        raise SystemExit(f"kernel_profile.py: error: {os.path.basename(entry)} exited {code}")
    return summarize(((e.key, _device_us(e), e.count) for e in prof.key_averages()), iterations)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("kernel_profile.py: error: give the run after -- (ENTRY.py FLAGS...)")
    cut = argv.index("--")
    own, run = argv[:cut], argv[cut + 1:]
    import argparse

    p = argparse.ArgumentParser(prog="kernel_profile.py", description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, required=True, help="the run's --train-iters (the totals' divisor)")
    p.add_argument("--json", required=True, metavar="PATH")
    args = p.parse_args(own)
    if not run:
        p.error("no run after --")
    out = profile(run[0], run[1:], args.iterations)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
