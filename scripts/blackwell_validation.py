#!/usr/bin/env python3
"""The cost model on Blackwell against NVIDIA's published runs, none fitted on, per system:

* ``b200`` (DGX-B200): Megatron-Bridge's 25.09 and 25.11 Llama-3 8B and Llama-3.1 405B rows (per-tensor current scaling
  and MXFP8; ``h3t_ext/data/reference/megatron_bridge_b200.json``) and NeMo 25.04's Llama 3 8B long-sequence table, 8K
  to 1M tokens (``nemo_long_sequence_b200.json``);
* ``gb200`` (DGX-GB200, NVL72): Megatron-Bridge's 25.09 and 25.11 Llama-3 8B, 70B (Megatron FSDP with TransformerEngine's
  activation offload, and a pipeline) and Llama-3.1 405B rows (``megatron_bridge_gb200.json``).

Each family's efficiencies are Hopper's fitted ones carried over by the chip's own matmul ceilings
(``fitted_efficiencies.json`` ``transfers``; docs/DESIGN.md, "Blackwell"). Per row: the published throughput, the
estimate and its error, and the estimate's peak memory; then the interval ``h3t-plan estimate`` prints for the family
(``data/uncertainty.json`` ``transferred``).

    python scripts/blackwell_validation.py [--gpu {b200,gb200}] [--json]

Without --gpu both systems are printed; --json then gives the B200's report at the top level (its rows, the values
carried over, the interval) and the GB200's under ``gb200``; with --gpu, that system's report at the top level.
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
from h3t_ext.costmodel.specs import get_system  # noqa: E402
from h3t_ext.costmodel.uncertainty import throughput_uncertainty  # noqa: E402
from h3t_ext.costmodel.validation import held_out_record  # noqa: E402

def rows(gpu: str = "b200") -> list[dict]:
    out = []
    for source, errors in held_out.blackwell_sources(gpu).items():
        out += [{"source": source, "fp8_recipe": run.plan.fp8_recipe,
                 **held_out_record(run.label, run.tokens_per_s_per_gpu, est, err)} for run, est, err in errors]
    return out


def report(gpu: str) -> dict:
    """One system's rows, the family its efficiencies are carried over to, and the interval estimate prints."""
    family = get_system(gpu).efficiency_set
    u = throughput_uncertainty(False, family)
    return {"rows": rows(gpu), "efficiency_set": family, "carried_over_from": u.transferred_from,
            "carried_over": transferred_efficiencies(family), "relative_half_width": u.relative_half_width,
            "coverage": u.coverage, "held_out_rows": u.held_out_rows}


def _print(gpu: str, r: dict) -> None:
    print(f"{gpu}: {r['efficiency_set']} efficiencies carried over from {r['carried_over_from']}: "
          + ", ".join(f"{k} {v:.4f}" for k, v in sorted(r["carried_over"].items())))
    source = None
    for row in r["rows"]:
        if row["source"] != source:
            source = row["source"]
            print(f"\n{source}\n{'run':<66} {'recipe':>10} {'published':>10} {'predicted':>10} {'error':>7} "
                  f"{'peak':>10}")
        print(f"{row['label']:<66} {row['fp8_recipe']:>10} {row['published_tokens_per_s_per_gpu']:10,.0f} "
              f"{row['predicted_tokens_per_s_per_gpu']:10,.0f} {100 * row['error']:+6.1f}% "
              f"{row['peak_memory_gib']:6.1f} GiB{'' if row['fits'] else ' OVER'}")
    print(f"\ntokens/s per GPU; errors are predicted / published - 1; the interval estimate prints for "
          f"{r['efficiency_set']}: +-{100 * r['relative_half_width']:.1f}% ({100 * r['coverage']:.0f}% of its "
          f"{r['held_out_rows']} rows)\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", choices=held_out.BLACKWELL_SYSTEMS, default=None, help="one system (default: both)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = {gpu: report(gpu) for gpu in ((args.gpu,) if args.gpu else held_out.BLACKWELL_SYSTEMS)}
    if args.json:
        print(json.dumps(out[args.gpu] if args.gpu else {**out["b200"], "gb200": out["gb200"]}, indent=1))
        return 0
    for gpu, r in out.items():
        _print(gpu, r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
