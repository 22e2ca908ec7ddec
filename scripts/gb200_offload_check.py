#!/usr/bin/env python3
"""The memory model on the one published run with activation offload: Megatron-Bridge 25.11's DGX-GB200 Llama-3 70B
FP8-CS row (64 GPUs, Megatron FSDP over all 64, MBS 2, sequence 8192, 4,312 tokens/s/GPU; the recipe's
``cpu_offloading_num_layers = 40``: TransformerEngine's layer offload of the first 40 of the 80 layers, alpha 0.5).

No GB200 system file ships (its 72-GPU NVLink domain and its Grace C2C link are not modelled), so the run is priced on
the B200 file with a GB200's HBM: 184.3 GiB as PyTorch would report it, assumed from the B200's ratio (186 of the 192 GB
enabled where the B200 enables 180 and reports 178.36 GiB). Memory terms do not depend on the links.

Printed: each term, the peak for h3t-ext's runtime (which keeps two reload slots from one iteration to the next) and
for TransformerEngine's handler (it allocates each reload during the backward, after the forward's peak), the budget
the reserve rule gives, and the same with 39 layers offloaded.

    python scripts/gb200_offload_check.py [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from h3t_ext.costmodel import Plan, estimate, get_model, get_system  # noqa: E402

GB200_HBM_GIB = 184.3
"""Assumed: 178.36 GiB (a B200's) x 186 / 180."""
OFFLOADED_LAYERS = 40
RECIPE = dict(num_gpus=64, seq_length=8192, global_batch_size=256, micro_batch_size=2, use_distributed_optimizer=True,
              data_parallel_sharding_strategy="optim_grads_params", fp8="hybrid", fp8_recipe="tensorwise",
              fp8_param_gather=True, grad_reduce_in_bf16=True, cross_entropy_loss_fusion=True,
              cross_entropy_fusion_impl="te", transformer_engine_version="2.9")
"""The 25.11 recipe (llama3_workload_base_configs.py and llama3_llm_pretrain.py at Megatron-Bridge 00b7660be0):
use_megatron_fsdp, bf16_with_fp8_current_scaling_mixed (--fp8-param-gather; the performance scripts keep the first and
last layers in FP8), grad_reduce_in_fp32 False, TE's fused cross entropy; no recompute. TE 2.9 (25.11's container)."""


def rows() -> dict:
    model = get_model("llama3-70b")
    system = replace(get_system("b200"), hbm_bytes=int(GB200_HBM_GIB * 2**30))
    out = {}
    for layers in (OFFLOADED_LAYERS, OFFLOADED_LAYERS - 1):
        est = estimate(model, Plan(**RECIPE, offload_alpha=layers / model.num_layers), system)
        terms = est.stages[0].terms
        slots = terms.get("offload_reload_buffer", 0)
        out[layers] = {"terms_gib": {k: v / 2**30 for k, v in terms.items() if v},
                       "h3t_runtime_peak_gib": est.peak_memory_bytes / 2**30,
                       "te_handler_peak_gib": (est.peak_memory_bytes - slots) / 2**30,
                       "budget_gib": est.memory_budget_bytes / 2**30}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = rows()
    if args.json:
        print(json.dumps({"gb200_hbm_gib": GB200_HBM_GIB, "offloaded_layers": out}, indent=1))
        return 0
    for layers, r in out.items():
        print(f"{layers} of 80 layers offloaded: " + ", ".join(f"{k} {v:.2f}" for k, v in r["terms_gib"].items()))
        te, budget = r["te_handler_peak_gib"], r["budget_gib"]
        print(f"  peak: h3t-ext's runtime {r['h3t_runtime_peak_gib']:.2f} GiB, TransformerEngine's handler {te:.2f} "
              f"GiB; budget {budget:.2f} GiB ({100 * (te / budget - 1):+.1f}%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
