#!/usr/bin/env python3
"""Every table and figure of the ATC '24 artifact next to the cost model's predictions.

Figure 9 (41 rows: Llama-65B, Llama2-70B, Llama-175B), Table 8 (Llama-175B, seq 8192, 256 GPUs, four methods),
the 7B demo (scripts 1-4) and Figure 7 (22 points of memory against alpha), from the repo's copies under
h3t_ext/data/reference (h3t_ext/costmodel/artifact.py reads them). Per row: published and predicted tokens/s,
MFU, alpha (the smallest that fits the runs' own budget) and peak memory with the out-of-memory verdict against
the plan's default budget, the error, and what the row was used for (an efficiency fit, the alpha budget, the
memory model; none = held out). Per table, per model and for calibration against held-out rows: the mean and
largest absolute error. Published out-of-memory entries predicted to fit (or runs predicted not to) are listed.

    python scripts/reproduce_tables.py [--json] [--out report.md] [--plot DIR]

``--json`` prints the numbers as JSON (the markdown then goes only to ``--out``). ``--plot DIR`` writes one PNG
per table and figure when matplotlib can be imported, and always the plotted data as CSV.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from dataclasses import replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from h3t_ext.costmodel import estimate  # noqa: E402
from h3t_ext.costmodel.artifact import (DEMO7B, FIG7, FIG9, TABLE8, ArtifactReport, ErrorSummary,  # noqa: E402
                                        PointPrediction, RowPrediction, artifact_report)
from h3t_ext.costmodel.published import atc24_memory_budget_bytes  # noqa: E402

GB = 1e9
STEMS = {FIG9: "figure9", TABLE8: "table8", DEMO7B: "demo7b", FIG7: "figure7"}
"""File names (without extension) of each table's and figure's PNG and CSV."""


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def _alpha(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _used(used_for) -> str:
    return ", ".join(used_for) if used_for else "held out"


def _verdict(ran: bool, fits: bool) -> str:
    if ran:
        return "fits" if fits else "**predicted OOM, but it ran**"
    return "OOM (right)" if not fits else "**predicted to fit, but it went OOM**"


def _summary_table(title: str, sums: list[ErrorSummary], fmt=lambda x: f"{100 * x:.2f}%") -> list[str]:
    out = [f"| {title} | rows | mean abs | max abs |", "|---|---|---|---|"]
    for s in sums:
        mean = "n/a" if s.mean_abs is None else fmt(s.mean_abs)
        mx = "n/a" if s.max_abs is None else fmt(s.max_abs)
        out.append(f"| {s.group} | {s.count} | {mean} | {mx} |")
    return out + [""]


def _layout(p: RowPrediction) -> str:
    plan = p.row.plan
    return (f"t{plan.tensor_model_parallel_size} c{plan.context_parallel_size} p{plan.pipeline_model_parallel_size} "
            f"l{plan.num_layers_per_virtual_pipeline_stage}")


def markdown(rep: ArtifactReport) -> str:
    wrong = rep.wrong_verdicts
    out = ["# ATC '24 artifact: published against predicted", "",
           "Rows marked *held out* were used for no fit: the honest test. tokens/s and MFU at the published alpha; "
           f"alpha pred = smallest alpha under the runs' own budget ({atc24_memory_budget_bytes() / GB:.3f} GB, "
           "run_settings.json); peak and verdict against the plan's default budget (reserve.py).", "",
           "## Errors", ""]
    out += _summary_table("tokens/s (timeline)", rep.tokens_errors)
    out += ["The closed form prices the same plans without the simulated timeline; the efficiencies were fitted "
            "on it (fitted_efficiencies.json), so its calibration rows show the fit's own error:", ""]
    out += _summary_table("tokens/s (closed form)", rep.closed_form_tokens_errors)
    out += _summary_table("MFU (pred - pub)", rep.mfu_errors, lambda x: f"{100 * x:.2f} points")
    out += _summary_table("alpha (pred - pub)", rep.alpha_errors, lambda x: f"{x:.4f}")
    out += _summary_table("Figure 7 peak memory", rep.memory_errors)
    out += ["Out-of-memory verdicts wrong: " + ("none (every published OOM entry is predicted OOM, every run that ran "
                                                 "is predicted to fit)" if not wrong else "; ".join(wrong)), ""]

    out += ["## Figure 9: throughput (H800, micro batch 1; whole-cluster tokens/s)", "",
            "MFU pub is computed from the published tokens/s with costmodel/mfu.py's FLOPs.", "",
            "| model | GPUs | B | layout | ckpt | used for | alpha pub | alpha pred | tokens/s pub | tokens/s pred | "
            "error | closed-form error | MFU pub | MFU pred | peak GB | verdict |", "|" + "---|" * 16]
    for p in rep.table(FIG9):
        r, plan = p.row, p.row.plan
        out.append(f"| {r.model.name} | {plan.num_gpus} | {plan.global_batch_size} | {_layout(p)} | {plan.ckpt} | "
                   f"{_used(r.used_for)} | {_alpha(r.published_alpha)} | {_alpha(p.alpha)} | "
                   f"{r.published_tokens_per_s_per_gpu * plan.num_gpus:,.0f} | "
                   f"{p.tokens_per_s_per_gpu * plan.num_gpus:,.0f} | {_pct(p.error)} | {_pct(p.closed_form_error)} | "
                   f"{100 * p.published_mfu:.1f}% | {100 * p.mfu:.1f}% | {p.peak_memory_bytes / GB:.1f} | "
                   f"{_verdict(r.ran, p.fits)} |")

    for table, title in ((TABLE8, "Table 8: Llama-175B, seq 8192, 256 H800"),
                         (DEMO7B, "7B demo: Llama-7B, seq 12288, 4 GPUs, t1 p4 l1, B 16")):
        out += ["", f"## {title}", "",
                "Stock Megatron-LM (origin-megatron, no alpha) is priced as this runtime's ckpt=full, alpha 0.", "",
                "| row | GPU | used for | alpha pub | alpha pred | tokens/s/GPU pub | tokens/s/GPU pred | error | "
                "closed-form error | MFU pub | MFU pred | peak GB | budget GB | verdict |", "|" + "---|" * 14]
        for p in rep.table(table):
            r = p.row
            pub = "OOM" if not r.ran else f"{r.published_tokens_per_s_per_gpu:,.0f}"
            pub_mfu = "-" if p.published_mfu is None else f"{100 * p.published_mfu:.1f}%"
            out.append(f"| {r.label} | {r.system.name} | {_used(r.used_for)} | {_alpha(r.published_alpha)} | "
                       f"{_alpha(p.alpha)} | {pub} | {p.tokens_per_s_per_gpu:,.0f} | {_pct(p.error)} | "
                       f"{_pct(p.closed_form_error)} | {pub_mfu} | "
                       f"{100 * p.mfu:.1f}% | {p.peak_memory_bytes / GB:.1f} | {p.memory_budget_bytes / GB:.1f} | "
                       f"{_verdict(r.ran, p.fits)} |")

    out += ["", "## Figure 7: peak max_memory_allocated against alpha (Llama-65B, seq 8192, 256 GPUs, t2 c2 p8 l2)", "",
            "| ckpt | alpha | used for | published GB | predicted GB | error | budget GB | verdict |",
            "|---|---|---|---|---|---|---|---|"]
    for p in rep.points:
        pt = p.point
        pub = "OOM" if not pt.ran else f"{pt.published_bytes / GB:.2f}"
        out.append(f"| {pt.plan.ckpt} | {pt.plan.offload_alpha:.1f} | {_used(pt.used_for)} | {pub} | "
                   f"{p.peak_memory_bytes / GB:.2f} | {_pct(p.error)} | {p.memory_budget_bytes / GB:.2f} | "
                   f"{_verdict(pt.ran, p.fits)} |")
    return "\n".join(out) + "\n"


def figure7_lines(rep: ArtifactReport) -> dict:
    """The model's peak for ckpt no and ours at alpha 0, 0.02, ..., 1 on Figure 7's layout."""
    base = rep.points[0].point
    alphas = [k / 50 for k in range(51)]
    lines = {ckpt: [estimate(base.model, replace(base.plan, ckpt=ckpt, offload_alpha=a), base.system,
                             timeline=False).peak_memory_bytes for a in alphas] for ckpt in ("no", "ours")}
    return {"alpha": alphas, **lines, "memory_budget_bytes": rep.points[0].memory_budget_bytes,
            "alpha_budget_bytes": atc24_memory_budget_bytes(), "hbm_bytes": base.system.hbm_bytes}


def _write_csv(path: str, rows: list[dict]) -> str:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def _csv_row(d: dict) -> dict:
    return {k: (";".join(v) if isinstance(v, list) else v) for k, v in d.items()}


def write_csv(data: dict, lines: dict, plot_dir: str) -> list[str]:
    """The plotted data: one CSV per table and figure (and the model's lines of Figure 7)."""
    files = [_write_csv(os.path.join(plot_dir, f"{STEMS[t]}.csv"), [_csv_row(r) for r in rows])
             for t, rows in data["tables"].items()]
    files.append(_write_csv(os.path.join(plot_dir, f"{STEMS[FIG7]}.csv"), [_csv_row(r) for r in data["figure7"]]))
    files.append(_write_csv(os.path.join(plot_dir, f"{STEMS[FIG7]}_model_lines.csv"),
                            [{"alpha": a, "ckpt_no_bytes": n, "ckpt_ours_bytes": o}
                             for a, n, o in zip(lines["alpha"], lines["no"], lines["ours"])]))
    return files


MODEL_COLORS = {"llama-65b": "tab:blue", "llama2-70b": "tab:green", "llama-175b": "tab:red", "llama-7b": "tab:purple"}


def _save(plt, fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bars(plt, preds: list[RowPrediction], title: str, path: str) -> str:
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    x = range(len(preds))
    pub = [p.row.published_tokens_per_s_per_gpu or 0.0 for p in preds]
    ax.bar([i - 0.2 for i in x], pub, width=0.4, label="published", color="tab:gray")
    ax.bar([i + 0.2 for i in x], [p.tokens_per_s_per_gpu for p in preds], width=0.4, label="predicted",
           color="tab:blue")
    for i, p in enumerate(preds):
        if not p.row.ran:
            ax.text(i - 0.2, 0, "OOM", rotation=90, ha="center", va="bottom", fontsize=8)
        if not p.fits:
            ax.text(i + 0.2, p.tokens_per_s_per_gpu, "pred. OOM", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x))
    ax.set_xticklabels([p.row.label if p.row.table == DEMO7B else p.row.label.split(" t")[0] + "\n" + _layout(p)
                        for p in preds], fontsize=7, rotation=20, ha="right")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plots(rep: ArtifactReport, lines: dict, plot_dir: str) -> list[str]:
    """One PNG per table and figure (needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4.6))
    fig9 = rep.table(FIG9)
    for model in dict.fromkeys(p.row.model.name for p in fig9):
        for held, marker in ((False, "o"), (True, "^")):
            ps = [p for p in fig9 if p.row.model.name == model and p.row.held_out == held]
            if not ps:
                continue
            name = f"{model} ({'held out' if held else 'calibration'})"
            ax.scatter([p.row.published_tokens_per_s_per_gpu * p.row.plan.num_gpus / 1e3 for p in ps],
                       [p.tokens_per_s_per_gpu * p.row.plan.num_gpus / 1e3 for p in ps],
                       color=MODEL_COLORS.get(model), marker=marker, label=name)
            bx.scatter([p.row.published_alpha for p in ps], [p.alpha for p in ps], color=MODEL_COLORS.get(model),
                       marker=marker, label=name)
    top = max(p.row.published_tokens_per_s_per_gpu * p.row.plan.num_gpus for p in fig9) / 1e3 * 1.05
    ax.plot((0, top), (0, top), color="gray", linestyle="--", linewidth=1)
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="published tokens/s (thousands)", ylabel="predicted tokens/s (thousands)",
           title="Figure 9: throughput")
    bx.plot((0, 1), (0, 1), color="gray", linestyle="--", linewidth=1)
    bx.set(xlim=(-0.02, 1.02), ylim=(-0.02, 1.02), xlabel="published alpha", ylabel="predicted alpha",
           title="Figure 9: alpha")
    ax.legend(fontsize=7)
    files = [_save(plt, fig, os.path.join(plot_dir, f"{STEMS[FIG9]}.png"))]
    files.append(_bars(plt, rep.table(TABLE8), "Table 8: Llama-175B, seq 8192, 256 H800",
                       os.path.join(plot_dir, f"{STEMS[TABLE8]}.png")))
    files.append(_bars(plt, rep.table(DEMO7B), "7B demo: seq 12288, 4 GPUs", os.path.join(plot_dir, f"{STEMS[DEMO7B]}.png")))

    fig, ax = plt.subplots(figsize=(6.5, 4.4))
    for ckpt, color in (("no", "tab:red"), ("ours", "tab:blue")):
        ax.plot(lines["alpha"], [b / GB for b in lines[ckpt]], color=color, label=f"model, ckpt={ckpt}")
        pts: list[PointPrediction] = [p for p in rep.points if p.point.plan.ckpt == ckpt]
        ran = [p for p in pts if p.point.ran]
        ax.scatter([p.point.plan.offload_alpha for p in ran], [p.point.published_bytes / GB for p in ran], color=color,
                   zorder=3, label=f"published, ckpt={ckpt}")
        oom = [p for p in pts if not p.point.ran]
        if oom:
            ax.scatter([p.point.plan.offload_alpha for p in oom], [p.peak_memory_bytes / GB for p in oom], color=color,
                       marker="x", s=60, zorder=3, label=f"published OOM (at predicted peak), ckpt={ckpt}")
    ax.axhline(lines["memory_budget_bytes"] / GB, color="black", linestyle="--", linewidth=1,
               label=f"default budget {lines['memory_budget_bytes'] / GB:.1f} GB")
    ax.axhline(lines["alpha_budget_bytes"] / GB, color="gray", linestyle=":", linewidth=1,
               label=f"runs' alpha budget {lines['alpha_budget_bytes'] / GB:.1f} GB")
    ax.set(xlabel="offload alpha", ylabel="peak memory per GPU (GB)", title=f"{FIG7}: Llama-65B, seq 8192, t2 c2 p8 l2")
    ax.legend(fontsize=7)
    files.append(_save(plt, fig, os.path.join(plot_dir, f"{STEMS[FIG7]}.png")))
    return files


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    ap.add_argument("--out", help="write the markdown report to this file (default: stdout without --json)")
    ap.add_argument("--plot", "--plot-dir", dest="plot", metavar="DIR",
                    help="write one PNG per table and figure (matplotlib) and the plotted data as CSV into DIR")
    args = ap.parse_args()
    rep = artifact_report()
    data = rep.to_dict()
    report = markdown(rep)
    pngs, csvs, note = [], [], None
    if args.plot:
        os.makedirs(args.plot, exist_ok=True)
        lines = figure7_lines(rep)
        data["figure7_model_lines"] = lines
        csvs = write_csv(data, lines, args.plot)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            note = "matplotlib is not importable: no PNG written, the plotted data is in the CSV files"
        else:
            pngs = plots(rep, lines, args.plot)
    data.update(plots=pngs, csv=csvs, plot_note=note)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(report)
    if args.json:
        print(json.dumps(data, indent=1))
    elif not args.out:
        print(report, end="")
    if args.plot and not args.json:
        print(note or "plots: " + ", ".join(pngs), file=sys.stderr)
        print("csv: " + ", ".join(csvs), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
