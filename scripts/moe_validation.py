#!/usr/bin/env python3
"""The cost model's mixture-of-experts pricing against published Megatron-Core MoE runs on H100
(``h3t_ext/data/reference/moe_published.json``; nothing of the MoE terms was fitted to them: every row is held out).
The prediction interval ``h3t-plan`` gives MoE models is the 90% quantile of these errors (``data/uncertainty.json``,
its ``moe`` entry, written with the dense one by ``scripts/costmodel_calibration.py --write-uncertainty``).

Per row: the published throughput (from its step time, else its TFLOP/s per GPU), the estimate's (the timeline),
the error, the estimate's peak memory and verdict, and its three largest time terms. Rows whose runs use what the
cost model does not price (MoE all-to-all overlap, Megatron FSDP over experts) are listed without a comparison.

    python scripts/moe_validation.py [--gpu h100-sxm] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from h3t_ext.costmodel import get_system  # noqa: E402
from h3t_ext.costmodel.mfu import model_flops_per_token  # noqa: E402
from h3t_ext.costmodel.published_moe import held_out_errors, published_moe_runs  # noqa: E402


def rows(gpu: str) -> list[dict]:
    system = get_system(gpu)
    priced = {run.label: (est, err) for run, est, err in held_out_errors(system)}
    out = []
    for run in published_moe_runs():
        row = {"source": run.source, "label": run.label, "published_tokens_per_s": run.tokens_per_second,
               "published_tflops_per_gpu": run.model_tflops_per_s_per_gpu}
        if run.not_priced:
            out.append({**row, "not_priced": run.not_priced})
            continue
        est, err = priced[run.label]
        flops = model_flops_per_token(run.model, run.plan.seq_length)
        terms = sorted(est.time_terms.as_dict().items(), key=lambda kv: -kv[1])[:3]
        out.append({**row, "predicted_tokens_per_s": est.tokens_per_second,
                    "predicted_tflops_per_gpu": est.tokens_per_second * flops / run.plan.num_gpus / 1e12,
                    "error": err, "peak_memory_gib": est.peak_memory_bytes / 2**30, "fits": est.fits,
                    "largest_time_terms": {k: round(v / est.iteration_time_s, 3) for k, v in terms}})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h100-sxm", help="system the runs are priced on (default h100-sxm)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = rows(args.gpu)
    errors = [abs(r["error"]) for r in out if "error" in r]
    summary = {"priced": len(errors), "median_abs_error": statistics.median(errors), "max_abs_error": max(errors)}
    if args.json:
        print(json.dumps({"rows": out, "summary": summary}, indent=1))
        return 0
    for r in out:
        if "not_priced" in r:
            print(f"{r['label']:<62} published {r['published_tflops_per_gpu']:5.0f} TF/GPU  not priced: "
                  f"{r['not_priced']}")
            continue
        terms = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["largest_time_terms"].items())
        print(f"{r['label']:<62} published {r['published_tflops_per_gpu']:5.0f} TF/GPU  predicted "
              f"{r['predicted_tflops_per_gpu']:5.0f}  {100 * r['error']:+6.1f}%  peak {r['peak_memory_gib']:5.1f} GiB "
              f"{'fits' if r['fits'] else 'OVER'}  ({terms})")
    print(f"{summary['priced']} priced rows: median |error| {100 * summary['median_abs_error']:.1f}%, "
          f"max {100 * summary['max_abs_error']:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
