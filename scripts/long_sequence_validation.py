#!/usr/bin/env python3
"""The cost model against NVIDIA's published long-sequence runs of Llama 2 7B in FP8 on DGX-H100, 4K to 1M tokens a
sequence with context parallelism (``h3t_ext/data/reference/nemo_long_sequence_h100.json``, the NeMo 24.03 container;
held out from every fit).

Per row: the layout, the published throughput (its TFLOP/s in tokens by NeMo's own FLOPs count), the estimate with
the fused attention at its measured (2026 cuDNN) rate, which is the default, and at FlashAttention-2's rate, each with
its error, and the estimate's peak memory (docs/DESIGN.md, "Reference numbers").

    python scripts/long_sequence_validation.py [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from h3t_ext.costmodel.held_out import long_sequence_errors  # noqa: E402
from h3t_ext.costmodel.validation import held_out_record  # noqa: E402


def rows() -> list[dict]:
    flash = {run.label: (est, err) for run, est, err in long_sequence_errors(attention_backend="flash")}
    out = []
    for run, est, err in long_sequence_errors():
        flash_est, flash_err = flash[run.label]
        out.append({**held_out_record(run.label, run.tokens_per_s_per_gpu, est, err),
                    "seq_length": run.plan.seq_length, "published_tflops_per_gpu": run.model_tflops_per_s_per_gpu,
                    "flash_rate_tokens_per_s_per_gpu": flash_est.tokens_per_second_per_gpu, "flash_rate_error": flash_err})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = rows()
    if args.json:
        print(json.dumps({"rows": out}, indent=1))
        return 0
    print(f"{'run':<28} {'published':>10} {'measured rate':>20} {'FlashAttention-2 rate':>22} {'peak':>9}")
    for r in out:
        print(f"{r['label']:<28} {r['published_tokens_per_s_per_gpu']:10,.0f} "
              f"{r['predicted_tokens_per_s_per_gpu']:11,.0f} {100 * r['error']:+7.1f}% "
              f"{r['flash_rate_tokens_per_s_per_gpu']:13,.0f} {100 * r['flash_rate_error']:+7.1f}% "
              f"{r['peak_memory_gib']:5.1f} GiB{'' if r['fits'] else ' OVER'}")
    print("tokens/s per GPU; errors are predicted / published - 1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
