#!/usr/bin/env python3
"""Print the cost model's figures against the published reference (alpha, memory, tokens/s, MFU).

  python scripts/costmodel_calibration.py            # table + summary
  python scripts/costmodel_calibration.py --json     # summary as JSON
  python scripts/costmodel_calibration.py --fit      # re-run the grid search of the hopper efficiencies
  python scripts/costmodel_calibration.py --cross-validate  # fit on one part of the table, test on the rest
"""
import argparse
import itertools
import json

from h3t_ext.costmodel import estimate, get_system, solve_offload_alpha
from h3t_ext.costmodel.calibration import calibration_report, reference_model, throughput_rows, with_efficiencies


def _mae(rows, system) -> float:
    m65 = reference_model("llama-65b")
    return sum(abs(estimate(m65, r.plan, system).tokens_per_second / r.tokens_per_s - 1) for r in rows) / len(rows)


def fit(rows=None) -> dict:
    h800 = get_system("h800")
    rows = throughput_rows() if rows is None else rows
    best = None
    for g, a, tp in itertools.product([0.50 + 0.01 * i for i in range(11)], [0.40 + 0.05 * i for i in range(9)],
                                      [0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0]):
        mae = _mae(rows, with_efficiencies(h800, {"gemm": g, "attention": a, "tp_comm_exposed": tp}))
        if best is None or mae < best[0]:
            best = (mae, g, a, tp)
    return {"tokens_mae": best[0], "gemm": round(best[1], 3), "attention": round(best[2], 3),
            "tp_comm_exposed": best[3]}


def cross_validate() -> dict:
    """Fit on one part of the throughput table; tokens/s MAE on the held-out rows."""
    rows, h800 = throughput_rows(), get_system("h800")
    splits = {"ckpt=no": lambda r: r.plan.ckpt == "no", "ckpt=ours": lambda r: r.plan.ckpt == "ours",
              ">=128 GPUs": lambda r: r.plan.num_gpus >= 128}
    out = {}
    for name, pick in splits.items():
        f = fit([r for r in rows if pick(r)])
        eff = {k: f[k] for k in ("gemm", "attention", "tp_comm_exposed")}
        out[f"fit on {name}"] = {**f, "held_out_tokens_mae": _mae([r for r in rows if not pick(r)],
                                                                   with_efficiencies(h800, eff))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--fit", action="store_true", help="grid-search gemm/attention/tp_comm_exposed for h800")
    ap.add_argument("--cross-validate", action="store_true", help="fit on a part of the table, test on the rest")
    args = ap.parse_args()
    if args.cross_validate:
        print(json.dumps(cross_validate(), indent=1))
        return
    if args.fit:
        print(json.dumps(fit(), indent=1))
        return
    rep = calibration_report()
    summary = {
        "alpha_max_abs_error": rep.alpha_max_error,
        "memory_rel_errors": list(rep.memory_errors),
        "oom_point_over_budget": list(rep.oom_predicted),
        "tokens_per_s_mae": rep.tokens_mae,
        "tokens_per_s_errors": list(rep.tokens_errors),
        "demo7b_mfu_computed_published": [list(x) for x in rep.demo_mfu],
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return
    m65, h800 = reference_model("llama-65b"), get_system("h800")
    print(f"{'gpus':>5} {'t':>2} {'p':>3} {'l':>2} {'ckpt':>5} {'alpha':>6} {'model':>6} {'tok/s pub':>10} "
          f"{'model':>8} {'err':>7}")
    for row, err in zip(throughput_rows(), rep.tokens_errors):
        pl = row.plan
        a = solve_offload_alpha(m65, pl, h800, mode="auto")
        print(f"{pl.num_gpus:>5} {pl.tensor_model_parallel_size:>2} {pl.pipeline_model_parallel_size:>3} "
              f"{pl.num_layers_per_virtual_pipeline_stage:>2} {pl.ckpt:>5} {row.published_alpha:>6.3f} {a:>6.3f} "
              f"{row.tokens_per_s:>10.0f} {row.tokens_per_s * (1 + err):>8.0f} {err:>+7.3f}")
    print(f"alpha max |error|      {rep.alpha_max_error:.4f}")
    print("memory errors          " + ", ".join(f"{e:+.2%}" for e in rep.memory_errors)
          + f"; out-of-memory point over budget: {all(rep.oom_predicted)}")
    print(f"tokens/s MAE           {rep.tokens_mae:.2%}")
    print("7B demo MFU            " + ", ".join(f"{c:.3f}/{p:.3f}" for c, p in rep.demo_mfu))


if __name__ == "__main__":
    main()
