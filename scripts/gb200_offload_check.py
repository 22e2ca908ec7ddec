#!/usr/bin/env python3
"""The memory model on the one published run with activation offload: Megatron-Bridge 25.11's DGX-GB200 Llama-3 70B
FP8-CS row (64 GPUs, Megatron FSDP over all 64, MBS 2, sequence 8192, 4,312 tokens/s/GPU; the recipe's
``cpu_offloading_num_layers = 40``: TransformerEngine's layer offload of the first 40 of the 80 layers, alpha 0.5),
priced on the ``gb200`` system file (184.3 GiB of HBM as PyTorch would report it; ``h3t_ext/data/systems/gb200.json``).

Printed: each term, the peak (h3t-ext's runtime and TransformerEngine's handler both allocate their reload buffers in
the backward, after the forward's peak), the budget the reserve rule gives, where the budget's allocator reserve
(3-8% in steady-state training loops, 5% assumed) would put the verdict, and the same with 39 layers offloaded.

    python scripts/gb200_offload_check.py [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from h3t_ext.costmodel import Plan, estimate, get_model, get_system  # noqa: E402

OFFLOADED_LAYERS = 40
RECIPE = dict(num_gpus=64, seq_length=8192, global_batch_size=256, micro_batch_size=2, use_distributed_optimizer=True,
              data_parallel_sharding_strategy="optim_grads_params", fp8="hybrid", fp8_recipe="tensorwise",
              fp8_param_gather=True, grad_reduce_in_bf16=True, cross_entropy_loss_fusion=True,
              cross_entropy_fusion_impl="te", transformer_engine_version="2.9")
"""The 25.11 recipe (llama3_workload_base_configs.py and llama3_llm_pretrain.py at Megatron-Bridge 00b7660be0):
use_megatron_fsdp, bf16_with_fp8_current_scaling_mixed (--fp8-param-gather; the performance scripts keep the first and
last layers in FP8), grad_reduce_in_fp32 False, TE's fused cross entropy; no recompute. TE 2.9 (25.11's container)."""


def rows() -> dict:
    model, system = get_model("llama3-70b"), get_system("gb200")
    out = {}
    for layers in (OFFLOADED_LAYERS, OFFLOADED_LAYERS - 1):
        est = estimate(model, Plan(**RECIPE, offload_alpha=layers / model.num_layers), system)
        peak = est.peak_memory_bytes / 2**30
        out[layers] = {"terms_gib": {k: v / 2**30 for k, v in est.stages[0].terms.items() if v},
                       "peak_gib": peak, "budget_gib": est.memory_budget_bytes / 2**30, "fits": est.fits,
                       "allocator_gap_left": est.allocator_gap_left, "memory_marginal": est.memory_marginal,
                       # the two runtimes' peaks, one figure since h3t-ext's allocates its reload slots in the backward
                       "h3t_runtime_peak_gib": peak, "te_handler_peak_gib": peak}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = rows()
    if args.json:
        print(json.dumps({"system": "gb200", "gb200_hbm_gib": get_system("gb200").hbm_bytes / 2**30,
                          "offloaded_layers": out}, indent=1))
        return 0
    for layers, r in out.items():
        print(f"{layers} of 80 layers offloaded: " + ", ".join(f"{k} {v:.2f}" for k, v in r["terms_gib"].items()))
        peak, budget = r["peak_gib"], r["budget_gib"]
        print(f"  peak {peak:.2f} GiB (h3t-ext's runtime and TransformerEngine's handler alike); budget {budget:.2f} "
              f"GiB ({100 * (peak / budget - 1):+.1f}%); fits while the caching allocator reserves at most "
              f"{100 * r['allocator_gap_left']:.1f}% above the peak{' (marginal)' if r['memory_marginal'] else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
