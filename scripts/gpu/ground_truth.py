#!/usr/bin/env python3
"""Ground truth for the cost model: measure its terms on one GPU, each beside the model's prediction.

Measures (``scripts/gpu/groundtruth/``; each case priced by ``h3t_ext/costmodel``'s own function for that work):
BF16 and FP8 (``torch._scaled_mm``, E4M3, per-tensor scales) GEMMs of the QKV, projection, FC1, FC2 and output
layers of Llama 2 7B, Llama 2 70B and GPT-3 175B at t in {1, 2, 4, 8} and micro-batch tokens in
{2K, 4K, 8K, 16K}, forward, data- and weight-gradient (as many (t, tokens) pairs as ``--budget-s`` allows, in
an order that covers both axes first: the output says which); the experts' batched GEMMs of Mixtral 8x7B and
Qwen3-235B-A22B at the published runs' expert-parallel sizes (``--moe-grouped-gemm``'s work, ``torch.bmm``); SDPA
attention forward and backward (flash and
cuDNN backends, causal, sequence 2K-16K, head dim 64 and 128, with and without GQA); the element-wise kernels
as bandwidth (RMSNorm/LayerNorm, SwiGLU/GeLU, residual add, cross entropy); pinned host<->device copies alone
and while a GEMM runs on the other stream (and that GEMM while copies run). Timing: CUDA events around work
queued behind a 1 ms GPU sleep (the kernels, not the host's dispatch of them), warm-up runs,
the median of ``--repeats``.

  python scripts/gpu/ground_truth.py [--budget-s 420] [--json PATH]   # on the GPU
  python scripts/gpu/ground_truth.py --dry-run [--json PATH]          # anywhere: the list and the predictions
  python scripts/gpu/ground_truth.py --device cpu --smoke [--json PATH]  # the code paths, tiny shapes, on CPU
  python scripts/gpu/ground_truth.py --refit REPORT.json              # the efficiencies a report implies
  python scripts/gpu/ground_truth.py --attention-curve REPORT.json    # cuDNN attention's stated rate and row cost

``scripts/gpu_check.sh`` (``scripts/gpu/report.py``) runs it and writes its JSON beside the report under
docs/gpu-reports/. The training steps through the driver (~1B and ~3B Llama and GPT at t = p = 1, ckpt and alpha
varied, against ``h3t-plan estimate``) are ``scripts/gpu/driver_steps.py``'s.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROG = "ground_truth.py"


def _parser():
    from h3t_training.config.arguments import OneLineParser

    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="list the measurements and predictions; needs no GPU")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny shapes: exercise the code paths (CPU or GPU)")
    p.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget of the measurements")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--system", default="h100-sxm", help="the cost model's system file to predict with")
    p.add_argument("--json", metavar="PATH", help="write every row (and the run's settings) to PATH")
    p.add_argument("--refit", metavar="REPORT", help="print the efficiencies a report's measurements imply")
    p.add_argument("--attention-curve", metavar="REPORT",
                   help="print cuDNN's fused attention as the report measured it (rate and fixed work per query row) "
                        "beside the values the cost model states")
    return p


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if not args.budget_s > 0:
        p.error(f"--budget-s must be > 0 seconds, got {args.budget_s:g}")
    if args.repeats < 1 or args.warmup < 0:
        p.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    from h3t_ext.costmodel.errors import UnknownNameError
    from h3t_ext.costmodel.specs import get_system

    try:
        system = get_system(args.system)
    except UnknownNameError as e:
        p.error(f"--system: {e}")
    if args.attention_curve:
        from groundtruth.attention_curve import attention_curve, format_curve
        from groundtruth.refit import load_report

        try:
            curve = attention_curve(load_report(args.attention_curve, "--attention-curve")["rows"])
        except ValueError as e:
            p.error(str(e))
        print(format_curve(curve, system.efficiency("attention_head_dim_overhead"), system.efficiencies))
        return 0
    if args.refit:
        from groundtruth.refit import format_refit, load_report, refit

        try:
            doc = load_report(args.refit)
            summary = refit(doc)
        except (ValueError, UnknownNameError) as e:
            p.error(str(e))
        print(format_refit(doc, summary))
        return 0
    if args.device == "cpu" and not (args.smoke or args.dry_run):
        p.error("--device cpu needs --smoke (the full shapes would take hours on a CPU) or --dry-run")
    from groundtruth.cases import select
    from groundtruth.runner import measured_rows, planned_rows
    from groundtruth.table import document, format_table

    selection = select(system, args.budget_s, args.warmup, args.repeats, smoke=args.smoke)
    if args.dry_run:
        rows, meta, device, mode = planned_rows(selection, system), {}, "none (dry run)", "dry run"
    else:
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            print(f"{PROG}: error: no CUDA GPU (use --dry-run to list the measurements, or --device cpu --smoke to "
                  f"exercise the code paths)", file=sys.stderr)
            return 1
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        rows, meta = measured_rows(selection, system, args.device, warmup=args.warmup, repeats=args.repeats,
                                   budget_s=args.budget_s, progress=lambda m: print(m, file=sys.stderr, flush=True))
        meta.update(torch=torch.__version__, cuda=torch.version.cuda)
        mode = "smoke" if args.smoke else "measured"
    doc = document(rows, selection, system, mode=mode, device=device, warmup=args.warmup, repeats=args.repeats,
                   meta=meta)
    print(format_table(doc))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
