#!/usr/bin/env python3
"""The cost model on Blackwell against NVIDIA's published runs, none fitted on, per system:

* ``b200`` (DGX-B200): Megatron-Bridge's 25.09 and 25.11 Llama-3 8B and Llama-3.1 405B rows (per-tensor current scaling
  and MXFP8; ``h3t_ext/data/reference/megatron_bridge_b200.json``) and NeMo 25.04's Llama 3 8B long-sequence table, 8K
  to 1M tokens (``nemo_long_sequence_b200.json``);
* ``gb200`` (DGX-GB200, NVL72): Megatron-Bridge's 25.09 to 26.06 Llama-3 8B, 70B (Megatron FSDP with
  TransformerEngine's activation offload, and a pipeline) and Llama-3.1 405B rows (``megatron_bridge_gb200.json``);
* ``gb300`` (DGX-GB300, Blackwell Ultra NVL72): Megatron-Bridge's 25.11 to 26.06 rows of the same models
  (``megatron_bridge_gb300.json``).

The B200's and GB200's efficiencies are Hopper's fitted ones carried over by the chip's own matmul ceilings, the
GB300's the GB200's as they are (``fitted_efficiencies.json`` ``transfers``; docs/DESIGN.md, "Blackwell"). Per row: the
published throughput, the estimate and its error, the share of a layer's compute time the model gives attention, and
the estimate's peak memory; then the rows' mean error, the interval ``h3t-plan estimate`` prints for the family
(``data/uncertainty.json`` ``transferred``), and what one run of a user's own does: ``h3t-plan calibrate`` on each row
in turn (pooled by the family's calibration prior), and the other rows' mean |error| with that calibration (its median
and worst over the choice of row).

    python scripts/blackwell_validation.py [--gpu {b200,gb200,gb300}] [--json]

Without --gpu every system is printed; --json then gives the B200's report at the top level (its rows, the values
carried over, the interval) and the GB200's and GB300's under ``gb200`` and ``gb300``; with --gpu, that system's report
at the top level.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from h3t_ext.costmodel import held_out, timing  # noqa: E402
from h3t_ext.costmodel.fit import MeasuredRun, mean_abs, relative_errors, with_efficiencies  # noqa: E402
from h3t_ext.costmodel.kernels import kernel_rates, recipe_rates  # noqa: E402
from h3t_ext.costmodel.efficiency_sets import transferred_efficiencies  # noqa: E402
from h3t_ext.costmodel.specs import get_system  # noqa: E402
from h3t_ext.costmodel.uncertainty import throughput_uncertainty  # noqa: E402
from h3t_ext.costmodel.validation import held_out_record  # noqa: E402
from h3t_ext.planner.calibrate import calibrate  # noqa: E402

def attention_share(model, plan, system) -> float:
    """The share of one layer's forward and backward compute time (one microbatch) the model gives attention."""
    r = recipe_rates(kernel_rates(system), system, plan.fp8_recipe if plan.fp8 is not None else None)
    a = timing.attention_seconds(model, plan, system, r)
    lt = timing.layer_time(model, plan, system)
    return (a["fwd"] + a["bwd"]) / (lt.fwd + lt.bwd)


def rows(gpu: str = "b200") -> list[dict]:
    system = get_system(gpu)
    out = []
    for source, errors in held_out.blackwell_sources(gpu).items():
        out += [{"source": source, "fp8_recipe": run.plan.fp8_recipe,
                 "attention_share": attention_share(run.model, run.plan, system),
                 **held_out_record(run.label, run.tokens_per_s_per_gpu, est, err)} for run, est, err in errors]
    return out


def one_run_calibration(gpu: str) -> dict:
    """Calibrate the system on each of its held-out rows alone (what ``h3t-plan calibrate`` does with one run of a
    user's own), and price the other rows with it: their mean |error| before, and its median and worst after over the
    choice of row."""
    system = get_system(gpu)
    runs = [MeasuredRun(run.model, run.plan, run.tokens_per_s_per_gpu, run.label)
            for errors in held_out.blackwell_sources(gpu).values() for run, _, _ in errors]
    after = []
    for i, run in enumerate(runs):
        cal = calibrate(system, {"efficiency_set": system.efficiency_set}, [run])
        rest = runs[:i] + runs[i + 1:]
        after.append(mean_abs(relative_errors(rest, with_efficiencies(system, cal.applied))))
    after.sort()
    return {"rows": len(runs), "weight": cal.weight, "mae_before": mean_abs(relative_errors(runs, system)),
            "median_mae_after": after[len(after) // 2], "worst_mae_after": after[-1]}


def report(gpu: str) -> dict:
    """One system's rows, the family its efficiencies are carried over to, and the interval estimate prints."""
    family = get_system(gpu).efficiency_set
    u = throughput_uncertainty(False, family)
    rs = rows(gpu)
    return {"rows": rs, "mean_error": sum(r["error"] for r in rs) / len(rs), "efficiency_set": family,
            "carried_over_from": u.transferred_from,
            "carried_over": transferred_efficiencies(family), "relative_half_width": u.relative_half_width,
            "coverage": u.coverage, "held_out_rows": u.held_out_rows, "one_run_calibration": one_run_calibration(gpu)}


def _print(gpu: str, r: dict) -> None:
    print(f"{gpu}: {r['efficiency_set']} efficiencies carried over from {r['carried_over_from']}: "
          + ", ".join(f"{k} {v:.4f}" for k, v in sorted(r["carried_over"].items())))
    source = None
    for row in r["rows"]:
        if row["source"] != source:
            source = row["source"]
            print(f"\n{source}\n{'run':<66} {'recipe':>10} {'published':>10} {'predicted':>10} {'error':>7} "
                  f"{'attn':>5} {'peak':>10}")
        print(f"{row['label']:<66} {row['fp8_recipe']:>10} {row['published_tokens_per_s_per_gpu']:10,.0f} "
              f"{row['predicted_tokens_per_s_per_gpu']:10,.0f} {100 * row['error']:+6.1f}% "
              f"{100 * row['attention_share']:4.0f}% {row['peak_memory_gib']:6.1f} GiB{'' if row['fits'] else ' OVER'}")
    print(f"\ntokens/s per GPU; errors are predicted / published - 1 (mean {100 * r['mean_error']:+.1f}%); attn: "
          f"attention's share of a layer's compute in the model; the interval estimate prints for "
          f"{r['efficiency_set']}: +-{100 * r['relative_half_width']:.1f}% ({100 * r['coverage']:.0f}% of its "
          f"{r['held_out_rows']} rows)")
    c = r["one_run_calibration"]
    print(f"one run of one's own: the rows' mean |error| is {100 * c['mae_before']:.1f}%; calibrated on one of them "
          f"(weight {c['weight']:.2f}), the others' is {100 * c['median_mae_after']:.1f}% (median over the row "
          f"chosen), {100 * c['worst_mae_after']:.1f}% at worst\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", choices=held_out.BLACKWELL_SYSTEMS, default=None, help="one system (default: both)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = {gpu: report(gpu) for gpu in ((args.gpu,) if args.gpu else held_out.BLACKWELL_SYSTEMS)}
    if args.json:
        print(json.dumps(out[args.gpu] if args.gpu else {**out["b200"], "gb200": out["gb200"], "gb300": out["gb300"]},
                         indent=1))
        return 0
    for gpu, r in out.items():
        _print(gpu, r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
