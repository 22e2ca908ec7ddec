#!/usr/bin/env python3
"""Print the cost model's figures against the published runs: leave-one-source-out tokens/s errors (before
and after calibrating on one row), the ATC '24 alphas and memory points, and every run's error.

  python scripts/costmodel_calibration.py            # tables + summary
  python scripts/costmodel_calibration.py --json     # summary as JSON
  python scripts/costmodel_calibration.py --fit      # fit every efficiency set on all runs and print it
  python scripts/costmodel_calibration.py --fit --write  # ... and write it into h3t_ext/data/fitted_efficiencies.json
  python scripts/costmodel_calibration.py --write-uncertainty  # store the held-out prediction interval (data/uncertainty.json)
  python scripts/costmodel_calibration.py --residuals [--json]  # each run's error against the shares of its time terms
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from h3t_ext.costmodel.calibration import calibration_report  # noqa: E402
from h3t_ext.costmodel.fit import SHARED_KEYS  # noqa: E402
from h3t_ext.costmodel.published import published_runs  # noqa: E402
from h3t_ext.costmodel.efficiency_sets import FITTED_EFFICIENCIES_FILE  # noqa: E402
from h3t_ext.costmodel.validation import errors_with, fit_families, leave_one_source_out  # noqa: E402
from h3t_ext.costmodel.uncertainty import UNCERTAINTY_FILE  # noqa: E402
from h3t_ext.costmodel.validation import computed_uncertainty  # noqa: E402

ROUND = {"gemm_tile_overhead_k": 0, "attention_head_dim_overhead": 0}
SHARES = ("gemm", "attention", "elementwise", "recompute", "tp_comm", "pipeline", "dp_exposed", "optimizer")
"""The time terms whose shares --residuals correlates with the errors: the compute term split by one layer's
forward and backward GEMM, attention and element-wise seconds (the output layer's go with the layers'), then the
recompute, the exposed communication and the optimizer."""


def residual_shares() -> dict:
    """Every published run's tokens/s error (the data file's efficiencies) beside the share of the iteration each
    time term takes, and the Pearson correlation of the errors with each share over the runs: a term mispriced by a
    factor shows as errors that follow its share."""
    from h3t_ext.costmodel.estimate import estimate
    from h3t_ext.costmodel.kernels import kernel_rates
    from h3t_ext.costmodel.timing import attention_seconds, layer_gemm_seconds, layer_time

    rows, runs = [], published_runs()
    for r, err in zip(runs, errors_with(runs, {})):
        terms = estimate(r.model, r.plan, r.system, timeline=False).time_terms.as_dict()
        total = sum(terms.values())
        rates = kernel_rates(r.system)
        g = layer_gemm_seconds(r.model, r.plan, rates)
        a = attention_seconds(r.model, r.plan, r.system, rates)
        layer = layer_time(r.model, r.plan, r.system)
        kernels = layer.fwd + layer.bwd
        gemm, attn = g["fwd"] + g["dgrad"] + g["wgrad"], a["fwd"] + a["bwd"]
        compute = terms["compute"] / total
        share = {"gemm": compute * gemm / kernels, "attention": compute * attn / kernels,
                 "elementwise": compute * (kernels - gemm - attn) / kernels, "recompute": terms["recompute"] / total,
                 "tp_comm": terms["tp_comm"] / total,
                 "pipeline": (terms["pp_p2p"] + terms["bubble"]) / total, "dp_exposed": terms["dp_exposed"] / total,
                 "optimizer": terms["optimizer"] / total}
        rows.append({"source": r.source, "run": r.label, "error": err, "shares": share})
    errors = [row["error"] for row in rows]
    corr = {}
    for name in SHARES:
        x = [row["shares"][name] for row in rows]
        corr[name] = statistics.correlation(errors, x) if len(set(x)) > 1 else None
    return {"runs": rows, "correlation_with_error": corr}


def fit(write: bool) -> dict:
    runs = published_runs()
    fits = fit_families(runs, neutral=True)
    out = {fam: {"rows": f.rows, "fitted": dict(f.fitted), "not_identified": dict(f.unidentified),
                 "mae_before": f.mae_before, "mae_after": f.mae_after} for fam, f in fits.items()}
    if write:
        path = FITTED_EFFICIENCIES_FILE
        data = json.loads(path.read_text())
        for fam, f in fits.items():
            for k, v in f.fitted.items():
                scope = "shared" if k in SHARED_KEYS else fam
                data["efficiencies"][scope][k] = round(v, ROUND.get(k, 4)) if ROUND.get(k, 4) else int(round(v))
            data["efficiencies"][fam]["_fitted_on"] = (
                f"{f.rows} published runs (scripts/costmodel_calibration.py --fit): " + ", ".join(sorted(
                    {r.source for r in runs if r.system.efficiency_set == fam})) + "; fitted: "
                + ", ".join(f.fitted) + "; not identified: " + (", ".join(f.unidentified) or "none"))
        path.write_text(json.dumps(data, indent=1) + "\n")
    return out


def summary() -> dict:
    rep = calibration_report()
    loso = [h.to_dict() for h in leave_one_source_out()]
    runs = published_runs()
    errs = errors_with(runs, {})
    return {
        "leave_one_source_out": loso,
        "all_runs_with_data_file_efficiencies": [
            {"source": r.source, "run": r.label, "measured_tokens_per_s_per_gpu": r.tokens_per_s_per_gpu,
             "error": e} for r, e in zip(runs, errs)],
        "atc24_alpha_max_abs_error": rep.alpha_max_error,
        "atc24_memory_rel_errors": list(rep.memory_errors),
        "atc24_oom_point_over_budget": list(rep.oom_predicted),
        "atc24_tokens_per_s_mae": rep.tokens_mae,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--fit", action="store_true", help="fit every efficiency set on all published runs")
    ap.add_argument("--write", action="store_true", help="with --fit: write the fit into the data file")
    ap.add_argument("--residuals", action="store_true",
                    help="each run's error beside the shares of its time terms, and their correlations")
    ap.add_argument("--write-uncertainty", action="store_true",
                    help="write the leave-one-source-out prediction interval and calibration prior into "
                         "h3t_ext/data/uncertainty.json")
    args = ap.parse_args()
    if args.write_uncertainty:
        u = computed_uncertainty()
        UNCERTAINTY_FILE.write_text(json.dumps(u, indent=1) + "\n", encoding="utf-8")
        print(json.dumps(u, indent=1))
        return
    if args.fit:
        print(json.dumps(fit(args.write), indent=1))
        return
    if args.residuals:
        res = residual_shares()
        if args.json:
            print(json.dumps(res, indent=1))
            return
        print(f"{'source':<14} {'run':<46} {'error':>7} " + " ".join(f"{n[:6]:>6}" for n in SHARES))
        for row in res["runs"]:
            print(f"{row['source']:<14} {row['run'][:46]:<46} {row['error']:+7.2%} "
                  + " ".join(f"{row['shares'][n]:6.3f}" for n in SHARES))
        print(f"correlation of the error with the share ({len(res['runs'])} runs): " + ", ".join(
            f"{n} {c:+.2f}" if c is not None else f"{n} n/a" for n, c in res["correlation_with_error"].items()))
        return
    s = summary()
    if args.json:
        print(json.dumps(s, indent=1))
        return
    print("leave one source out (efficiencies fitted on the other sources; then calibrate on one row, pooled at\n"
          "the weight the other sources' prior gives one row, as h3t-plan calibrate does, and taken whole):")
    print(f"{'held-out source':<16} {'rows':>4} {'MAE uncalibrated':>17} {'MAE after 1 row: mean':>22} "
          f"{'median':>7} {'worst':>7} {'weight':>7} {'whole: mean':>12}")
    for h in s["leave_one_source_out"]:
        after = sorted(h["mae_after_calibrating_on_one_row"])
        print(f"{h['source']:<16} {h['rows']:>4} {h['mae_uncalibrated']:>17.2%} {h['mae_after_one_row_mean']:>22.2%} "
              f"{after[len(after) // 2]:>7.2%} {h['mae_after_one_row_worst']:>7.2%} {h['one_row_weight']:>7.3f} "
              f"{h['mae_after_one_row_full_weight_mean']:>12.2%}")
    print("\nevery run with the data file's efficiencies:")
    for r in s["all_runs_with_data_file_efficiencies"]:
        print(f"  {r['source']:<14} {r['run']:<52} {r['measured_tokens_per_s_per_gpu']:>9.1f} {r['error']:+7.2%}")
    print(f"\nATC '24: alpha max |error| {s['atc24_alpha_max_abs_error']:.4f}; memory errors "
          + ", ".join(f"{e:+.2%}" for e in s["atc24_memory_rel_errors"])
          + f"; out-of-memory point over budget: {all(s['atc24_oom_point_over_budget'])}; "
          f"tokens/s MAE {s['atc24_tokens_per_s_mae']:.2%}")


if __name__ == "__main__":
    main()
