#!/usr/bin/env python3
"""The published throughput table and memory-versus-alpha figure next to the cost model's predictions.

Reads the repo copy of the published numbers (h3t_ext/data/reference/atc24_calibration.json) and writes:

* a markdown report (stdout, or ``--out FILE``): every Llama-65B row of the throughput table
  (published vs predicted tokens/s and error, published vs predicted alpha = smallest alpha that
  fits the budget), the 7B demo rows (tokens/s/GPU and MFU), and the memory-versus-alpha points;
* PNG plots in ``--plot-dir`` (default ``reproduce_out``): memory vs alpha (published points and
  the model's line for ckpt=no and ckpt=ours) and predicted vs published tokens/s;
* ``--json``: the same numbers as JSON on stdout (the markdown then goes only to ``--out``).

    python scripts/reproduce_tables.py [--out report.md] [--plot-dir DIR | --no-plots] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from h3t_ext.costmodel import Plan, estimate, get_system, mfu, solve_offload_alpha  # noqa: E402
from h3t_ext.costmodel.calibration import memory_points, reference, reference_model, throughput_rows  # noqa: E402
from h3t_ext.costmodel.published import atc24_memory_budget_bytes, settings  # noqa: E402

BUDGET = atc24_memory_budget_bytes()
"""The budget the ATC '24 authors solved their alphas against (data/reference/run_settings.json)."""
RUN = settings()["sources"]["atc24_65b"]["plan"]
"""Switches of the ATC '24 runs (TP comm overlap, no DP overlap, ...)."""


def throughput_table() -> list[dict]:
    """Llama-65B rows: the plan, published and predicted alpha and tokens/s (at the published alpha)."""
    model, system = reference_model("llama-65b"), get_system("h800")
    out = []
    for row in throughput_rows():
        p = row.plan
        est = estimate(model, p, system, memory_budget_bytes=BUDGET)
        alpha = solve_offload_alpha(model, p, system, memory_budget_bytes=BUDGET, mode="auto")
        per_gpu = row.tokens_per_s / p.num_gpus
        out.append({
            "num_gpus": p.num_gpus, "global_batch_size": p.global_batch_size, "seq_length": p.seq_length,
            "tensor_model_parallel_size": p.tensor_model_parallel_size,
            "context_parallel_size": p.context_parallel_size,
            "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
            "num_layers_per_virtual_pipeline_stage": p.num_layers_per_virtual_pipeline_stage, "ckpt": p.ckpt,
            "published_alpha": row.published_alpha, "predicted_alpha": alpha,
            "published_tokens_per_second": row.tokens_per_s, "predicted_tokens_per_second": est.tokens_per_second,
            "error": est.tokens_per_second / row.tokens_per_s - 1.0,
            "published_mfu": mfu(model, p.seq_length, per_gpu, system.peak_bf16_flops), "predicted_mfu": est.mfu,
            "predicted_peak_memory_bytes": est.peak_memory_bytes, "fits": est.fits,
        })
    return out


def demo_table() -> list[dict]:
    """7B demo rows (4 GPUs, seq 12288): tokens/s/GPU and MFU, published vs predicted."""
    model = reference_model("llama-7b")
    out = []
    for r in reference()["demo7b"]:
        system = get_system(r["gpu"])
        alpha = 0.0 if r["alpha"] is None else float(r["alpha"])
        plan = Plan(num_gpus=r["num_gpus"], seq_length=r["seq_length"], global_batch_size=r["global_batch_size"],
                    tensor_model_parallel_size=r["t"], context_parallel_size=r["c"],
                    pipeline_model_parallel_size=r["p"], num_layers_per_virtual_pipeline_stage=r["l"],
                    ckpt=r["ckpt"], offload_alpha=alpha, **RUN)
        est = estimate(model, plan, system, memory_budget_bytes=BUDGET)
        out.append({
            "gpu": r["gpu"], "method": r["method"], "ckpt": r["ckpt"], "published_alpha": r["alpha"],
            "predicted_alpha": solve_offload_alpha(model, plan, system, memory_budget_bytes=BUDGET, mode="auto"),
            "published_tokens_per_second_per_gpu": r["tokens_per_s_per_gpu"],
            "predicted_tokens_per_second_per_gpu": est.tokens_per_second_per_gpu,
            "error": est.tokens_per_second_per_gpu / r["tokens_per_s_per_gpu"] - 1.0,
            "published_mfu": r["mfu"], "predicted_mfu": est.mfu,
        })
    return out


def memory_table() -> tuple[list[dict], dict]:
    """Published memory points with predictions, and the model's lines (alpha 0..1) for ckpt no/ours."""
    model, system = reference_model("llama-65b"), get_system("h800")
    points = []
    for plan, measured in memory_points():
        peak = estimate(model, plan, system).peak_memory_bytes
        points.append({"ckpt": plan.ckpt, "alpha": plan.offload_alpha, "published_bytes": measured,
                       "predicted_bytes": peak, "hbm_bytes": system.hbm_bytes,
                       "error": None if measured is None else peak / measured - 1.0,
                       "predicted_out_of_memory": peak > BUDGET})
    base = memory_points()[0][0]
    alphas = [k / 50 for k in range(51)]
    lines = {ckpt: [estimate(model, replace(base, ckpt=ckpt, offload_alpha=a), system).peak_memory_bytes
                    for a in alphas] for ckpt in ("no", "ours")}
    return points, {"alpha": alphas, **lines, "hbm_bytes": system.hbm_bytes,
                    "memory_budget_bytes": BUDGET}


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def markdown(thr: list[dict], demo: list[dict], mem_points: list[dict]) -> str:
    out = ["## Llama-65B throughput table (H800, seq 4096, micro batch 1)", "",
           "| GPUs | B | t | c | p | l | ckpt | alpha pub | alpha pred | tokens/s pub | tokens/s pred | error | "
           "MFU pub | MFU pred |", "|" + "---|" * 14]
    for r in thr:
        out.append(f"| {r['num_gpus']} | {r['global_batch_size']} | {r['tensor_model_parallel_size']} | "
                   f"{r['context_parallel_size']} | {r['pipeline_model_parallel_size']} | "
                   f"{r['num_layers_per_virtual_pipeline_stage']} | {r['ckpt']} | {r['published_alpha']:.3f} | "
                   f"{r['predicted_alpha']:.3f} | {r['published_tokens_per_second']:,.0f} | "
                   f"{r['predicted_tokens_per_second']:,.0f} | {_pct(r['error'])} | {100 * r['published_mfu']:.1f}% | "
                   f"{100 * r['predicted_mfu']:.1f}% |")
    mae = sum(abs(r["error"]) for r in thr) / len(thr)
    alpha_err = max(abs(r["predicted_alpha"] - r["published_alpha"]) for r in thr)
    out += ["", f"Mean absolute tokens/s error {100 * mae:.2f}% over {len(thr)} rows; "
                f"largest |alpha pred - alpha pub| {alpha_err:.3f}.", "",
            "## Llama-7B demo (4 GPUs, t=1 p=4 l=1, seq 12288, B=16)", "",
            "| GPU | method | ckpt | alpha pub | alpha pred | tokens/s/GPU pub | tokens/s/GPU pred | error | MFU pub | "
            "MFU pred |", "|" + "---|" * 10]
    for r in demo:
        pub_alpha = "-" if r["published_alpha"] is None else f"{r['published_alpha']:.3f}"
        out.append(f"| {r['gpu']} | {r['method']} | {r['ckpt']} | {pub_alpha} | {r['predicted_alpha']:.3f} | "
                   f"{r['published_tokens_per_second_per_gpu']:,.0f} | {r['predicted_tokens_per_second_per_gpu']:,.0f} | "
                   f"{_pct(r['error'])} | {100 * r['published_mfu']:.1f}% | {100 * r['predicted_mfu']:.1f}% |")
    out += ["", "## Memory versus alpha (Llama-65B, seq 8192, 256 GPUs, t=2 c=2 p=8 l=2)", "",
            "Peak `max_memory_allocated`; an out-of-memory point is predicted right when the model's peak is over "
            "the memory budget (HBM minus the CUDA context, NCCL and allocator reserve).", "",
            "| ckpt | alpha | published GB | predicted GB | error |", "|---|---|---|---|---|"]
    for r in mem_points:
        pub = "out of memory" if r["published_bytes"] is None else f"{r['published_bytes'] / 1e9:.2f}"
        err = ("predicted over budget (OOM)" if r["predicted_out_of_memory"] else "predicted to fit (wrong)") \
            if r["published_bytes"] is None else _pct(r["error"])
        out.append(f"| {r['ckpt']} | {r['alpha']:.2f} | {pub} | {r['predicted_bytes'] / 1e9:.2f} | {err} |")
    return "\n".join(out) + "\n"


def _save(fig, plot_dir: str, name: str) -> str:
    """Lay out, write and close ``fig`` as ``plot_dir/name``; return the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(plot_dir, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plots(thr: list[dict], mem_points: list[dict], lines: dict, plot_dir: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plot_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for ckpt, color in (("no", "tab:red"), ("ours", "tab:blue")):
        ax.plot(lines["alpha"], [b / 1e9 for b in lines[ckpt]], color=color, label=f"model, ckpt={ckpt}")
        pts = [p for p in mem_points if p["ckpt"] == ckpt and p["published_bytes"] is not None]
        ax.scatter([p["alpha"] for p in pts], [p["published_bytes"] / 1e9 for p in pts], color=color, marker="o",
                   zorder=3, label=f"published, ckpt={ckpt}")
        oom = [p for p in mem_points if p["ckpt"] == ckpt and p["published_bytes"] is None]
        ax.scatter([p["alpha"] for p in oom], [lines["hbm_bytes"] / 1e9] * len(oom), color=color, marker="x", s=60,
                   zorder=3, label=f"published OOM, ckpt={ckpt}" if oom else None)
    ax.axhline(lines["hbm_bytes"] / 1e9, color="gray", linestyle="--", linewidth=1,
               label=f"HBM {lines['hbm_bytes'] / 1e9:.0f} GB")
    ax.axhline(lines["memory_budget_bytes"] / 1e9, color="gray", linestyle=":", linewidth=1,
               label=f"budget {lines['memory_budget_bytes'] / 1e9:.1f} GB")
    ax.set_xlabel("offload alpha")
    ax.set_ylabel("peak memory per GPU (GB)")
    ax.set_title("Llama-65B, seq 8192, t=2 c=2 p=8 l=2")
    ax.legend(fontsize=7)
    mem_png = _save(fig, plot_dir, "memory_vs_alpha.png")

    fig, ax = plt.subplots(figsize=(5, 5))
    pub = [r["published_tokens_per_second"] / 1e3 for r in thr]
    pred = [r["predicted_tokens_per_second"] / 1e3 for r in thr]
    for ckpt, color in (("no", "tab:red"), ("ours", "tab:blue")):
        idx = [i for i, r in enumerate(thr) if r["ckpt"] == ckpt]
        ax.scatter([pub[i] for i in idx], [pred[i] for i in idx], color=color, label=f"ckpt={ckpt}")
    lim = (0, max(pub + pred) * 1.05)
    ax.plot(lim, lim, color="gray", linestyle="--", linewidth=1, label="predicted = published")
    ax.set_xlim(lim)
    ax.set_ylim(lim)
    ax.set_xlabel("published tokens/s (thousands)")
    ax.set_ylabel("predicted tokens/s (thousands)")
    ax.set_title("Llama-65B throughput table, H800")
    ax.legend(fontsize=8)
    tps_png = _save(fig, plot_dir, "tokens_predicted_vs_published.png")
    return [mem_png, tps_png]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the markdown report to this file (default: stdout)")
    ap.add_argument("--plot-dir", default="reproduce_out", help="directory of the PNG plots (default reproduce_out)")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = ap.parse_args()
    thr, demo = throughput_table(), demo_table()
    mem_points, lines = memory_table()
    report = markdown(thr, demo, mem_points)
    files = [] if args.no_plots else plots(thr, mem_points, lines, args.plot_dir)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(report)
    if args.json:
        print(json.dumps({"throughput_table": thr, "demo7b": demo, "memory_vs_alpha": mem_points,
                          "memory_lines": lines, "plots": files}, indent=1))
    elif not args.out:
        print(report, end="")
    if files and not args.json:
        print("plots: " + ", ".join(files), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
