#!/usr/bin/env python3
"""Print the cost model's figures against the published runs: leave-one-source-out tokens/s errors (before
and after calibrating on one row), the ATC '24 alphas and memory points, and every run's error.

  python scripts/costmodel_calibration.py            # tables + summary
  python scripts/costmodel_calibration.py --json     # summary as JSON
  python scripts/costmodel_calibration.py --fit      # fit every efficiency set on all runs and print it
  python scripts/costmodel_calibration.py --fit --write  # ... and write it into h3t_ext/data/fitted_efficiencies.json
  python scripts/costmodel_calibration.py --write-uncertainty  # store the held-out prediction interval (data/uncertainty.json)
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from h3t_ext.costmodel.calibration import calibration_report  # noqa: E402
from h3t_ext.costmodel.fit import SHARED_KEYS  # noqa: E402
from h3t_ext.costmodel.published import published_runs  # noqa: E402
from h3t_ext.costmodel.specs import DATA_DIR  # noqa: E402
from h3t_ext.costmodel.validation import errors_with, fit_families, leave_one_source_out  # noqa: E402
from h3t_ext.costmodel.uncertainty import UNCERTAINTY_FILE  # noqa: E402
from h3t_ext.costmodel.validation import computed_uncertainty  # noqa: E402

ROUND = {"gemm_tile_overhead_k": 0, "attention_head_dim_overhead": 0}


def fit(write: bool) -> dict:
    runs = published_runs()
    fits = fit_families(runs, neutral=True)
    out = {fam: {"rows": f.rows, "fitted": dict(f.fitted), "not_identified": dict(f.unidentified),
                 "mae_before": f.mae_before, "mae_after": f.mae_after} for fam, f in fits.items()}
    if write:
        path = DATA_DIR / "fitted_efficiencies.json"
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
    ap.add_argument("--write-uncertainty", action="store_true",
                    help="write the leave-one-source-out prediction interval into h3t_ext/data/uncertainty.json")
    args = ap.parse_args()
    if args.write_uncertainty:
        u = computed_uncertainty()
        UNCERTAINTY_FILE.write_text(json.dumps(u, indent=1) + "\n", encoding="utf-8")
        print(json.dumps(u, indent=1))
        return
    if args.fit:
        print(json.dumps(fit(args.write), indent=1))
        return
    s = summary()
    if args.json:
        print(json.dumps(s, indent=1))
        return
    print("leave one source out (efficiencies fitted on the other sources; then calibrate on one row):")
    print(f"{'held-out source':<16} {'rows':>4} {'MAE uncalibrated':>17} {'MAE after 1 row: mean':>22} "
          f"{'median':>7} {'worst':>7}")
    for h in s["leave_one_source_out"]:
        after = sorted(h["mae_after_calibrating_on_one_row"])
        print(f"{h['source']:<16} {h['rows']:>4} {h['mae_uncalibrated']:>17.2%} {h['mae_after_one_row_mean']:>22.2%} "
              f"{after[len(after) // 2]:>7.2%} {h['mae_after_one_row_worst']:>7.2%}")
    print("\nevery run with the data file's efficiencies:")
    for r in s["all_runs_with_data_file_efficiencies"]:
        print(f"  {r['source']:<14} {r['run']:<52} {r['measured_tokens_per_s_per_gpu']:>9.1f} {r['error']:+7.2%}")
    print(f"\nATC '24: alpha max |error| {s['atc24_alpha_max_abs_error']:.4f}; memory errors "
          + ", ".join(f"{e:+.2%}" for e in s["atc24_memory_rel_errors"])
          + f"; out-of-memory point over budget: {all(s['atc24_oom_point_over_budget'])}; "
          f"tokens/s MAE {s['atc24_tokens_per_s_mae']:.2%}")


if __name__ == "__main__":
    main()
