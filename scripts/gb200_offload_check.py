#!/usr/bin/env python3
"""The memory model on the published runs with activation offload: Megatron-Bridge's Llama-3 70B FP8-CS rows on NVL72
racks (64 GPUs, Megatron FSDP over all 64, MBS 2, sequence 8192), whose recipes offload as few layers as fit with
TransformerEngine's layer offload (``cpu_offloading_num_layers``): 40 of the 80 on a DGX-GB200 (alpha 0.5; 25.11:
4,312 tokens/s/GPU), 20 on a DGX-GB300 (alpha 0.25; 26.04.01: 5,248), priced on the ``gb200`` and ``gb300`` system
files (184.3 and 275.5 GiB of HBM as PyTorch would report it; ``h3t_ext/data/systems/``).

Printed, per system: each term at the published layer count and one layer fewer, the peak (h3t-ext's runtime and
TransformerEngine's handler both allocate their reload buffers in the backward, after the forward's peak), the budget
the reserve rule gives, where the budget's allocator reserve (3-8% in steady-state training loops, 5% assumed) would
put the verdict, and the fewest offloaded layers the model says fit.

    python scripts/gb200_offload_check.py [--gpu {gb200,gb300}] [--json]

Without --gpu the GB200 is printed (and --json gives its report, as before the GB300 was added).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from h3t_ext.costmodel import Plan, estimate, get_model, get_system  # noqa: E402

OFFLOADED_LAYERS = {"gb200": 40, "gb300": 20}
"""The recipes' cpu_offloading_num_layers (LLAMA3_70B_PRETRAIN_CONFIG_GB200_FP8_CS and _GB300_FP8_CS, V1 and V2, at
every Megatron-Bridge commit from 2025-12 to 2026-06)."""
RECIPE = dict(num_gpus=64, seq_length=8192, global_batch_size=256, micro_batch_size=2, use_distributed_optimizer=True,
              data_parallel_sharding_strategy="optim_grads_params", fp8="hybrid", fp8_recipe="tensorwise",
              fp8_param_gather=True, grad_reduce_in_bf16=True, cross_entropy_loss_fusion=True,
              cross_entropy_fusion_impl="te", transformer_engine_version="2.9")
"""The 25.11 recipe (llama3_workload_base_configs.py and llama3_llm_pretrain.py at Megatron-Bridge 00b7660be0):
use_megatron_fsdp, bf16_with_fp8_current_scaling_mixed (--fp8-param-gather; the performance scripts keep the first and
last layers in FP8), grad_reduce_in_fp32 False, TE's fused cross entropy; no recompute. TE 2.9 (25.11's container).
The GB300's is the same but for the layer count."""


def _record(est) -> dict:
    peak = est.peak_memory_bytes / 2**30
    return {"terms_gib": {k: v / 2**30 for k, v in est.stages[0].terms.items() if v},
            "peak_gib": peak, "budget_gib": est.memory_budget_bytes / 2**30, "fits": est.fits,
            "allocator_gap_left": est.allocator_gap_left, "memory_marginal": est.memory_marginal,
            # the two runtimes' peaks, one figure since h3t-ext's allocates its reload slots in the backward
            "h3t_runtime_peak_gib": peak, "te_handler_peak_gib": peak}


def fewest_fitting(gpu: str) -> int:
    """The fewest of the 80 layers offloaded with which the recipe fits the system's budget."""
    model, system = get_model("llama3-70b"), get_system(gpu)
    return next(n for n in range(model.num_layers + 1)
                if estimate(model, Plan(**RECIPE, offload_alpha=n / model.num_layers), system).fits)


def rows(gpu: str = "gb200") -> dict:
    model, system = get_model("llama3-70b"), get_system(gpu)
    layers = OFFLOADED_LAYERS[gpu]
    return {n: _record(estimate(model, Plan(**RECIPE, offload_alpha=n / model.num_layers), system))
            for n in (layers, layers - 1)}


def report(gpu: str) -> dict:
    return {"system": gpu, f"{gpu}_hbm_gib": get_system(gpu).hbm_bytes / 2**30,
            "published_offloaded_layers": OFFLOADED_LAYERS[gpu], "fewest_fitting_layers": fewest_fitting(gpu),
            "offloaded_layers": rows(gpu)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", choices=tuple(OFFLOADED_LAYERS), default="gb200")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = report(args.gpu)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{args.gpu}: the recipe offloads {out['published_offloaded_layers']} of 80 layers; the fewest that fit in "
          f"the model: {out['fewest_fitting_layers']}")
    for layers, r in out["offloaded_layers"].items():
        print(f"{layers} of 80 layers offloaded: " + ", ".join(f"{k} {v:.2f}" for k, v in r["terms_gib"].items()))
        peak, budget = r["peak_gib"], r["budget_gib"]
        print(f"  peak {peak:.2f} GiB (h3t-ext's runtime and TransformerEngine's handler alike); budget {budget:.2f} "
              f"GiB ({100 * (peak / budget - 1):+.1f}%); fits while the caching allocator reserves at most "
              f"{100 * r['allocator_gap_left']:.1f}% above the peak{' (marginal)' if r['memory_marginal'] else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
