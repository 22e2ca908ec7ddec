#!/usr/bin/env python3
"""The cost model on Blackwell against NVIDIA's published DGX-B200 runs, none fitted on: Megatron-Bridge's 25.09 and
25.11 Llama-3 8B and Llama-3.1 405B rows (per-tensor current scaling and MXFP8;
``h3t_ext/data/reference/megatron_bridge_b200.json``) and NeMo 25.04's Llama 3 8B long-sequence table, 8K to 1M
tokens (``nemo_long_sequence_b200.json``). Blackwell's efficiencies are Hopper's fitted ones carried over by the two
chips' matmul ceilings (``fitted_efficiencies.json`` ``transfers``; docs/DESIGN.md, "Blackwell").

Per row: the layout, the published throughput, the estimate and its error, and the estimate's peak memory; then the
interval ``h3t-plan estimate`` prints for the family (``data/uncertainty.json`` ``transferred``).

    python scripts/blackwell_validation.py [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from h3t_ext.costmodel import held_out  # noqa: E402
from h3t_ext.costmodel.efficiency_sets import transferred_efficiencies  # noqa: E402
from h3t_ext.costmodel.uncertainty import throughput_uncertainty  # noqa: E402
from h3t_ext.costmodel.validation import held_out_record  # noqa: E402


def rows() -> list[dict]:
    out = []
    for source, errors in (("megatron_bridge_b200", held_out.bridge_errors(gpu="b200")),
                           ("nemo_long_sequence_b200", held_out.long_sequence_errors(table="b200"))):
        out += [{"source": source, "fp8_recipe": run.plan.fp8_recipe,
                 **held_out_record(run.label, run.tokens_per_s_per_gpu, est, err)} for run, est, err in errors]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out, u = rows(), throughput_uncertainty(False, "blackwell")
    carried = transferred_efficiencies("blackwell")
    if args.json:
        print(json.dumps({"rows": out, "carried_over_from": u.transferred_from, "carried_over": carried,
                          "relative_half_width": u.relative_half_width, "coverage": u.coverage}, indent=1))
        return 0
    print("Blackwell efficiencies carried over from " + u.transferred_from + ": "
          + ", ".join(f"{k} {v:.4f}" for k, v in sorted(carried.items())))
    source = None
    for r in out:
        if r["source"] != source:
            source = r["source"]
            print(f"\n{source}\n{'run':<52} {'recipe':>10} {'published':>10} {'predicted':>10} {'error':>7} "
                  f"{'peak':>10}")
        print(f"{r['label']:<52} {r['fp8_recipe']:>10} {r['published_tokens_per_s_per_gpu']:10,.0f} "
              f"{r['predicted_tokens_per_s_per_gpu']:10,.0f} {100 * r['error']:+6.1f}% "
              f"{r['peak_memory_gib']:6.1f} GiB{'' if r['fits'] else ' OVER'}")
    print(f"\ntokens/s per GPU; errors are predicted / published - 1; the interval estimate prints for Blackwell: "
          f"+-{100 * u.relative_half_width:.1f}% ({100 * u.coverage:.0f}% of these {u.held_out_rows} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
