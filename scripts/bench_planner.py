#!/usr/bin/env python3
"""Time the planner's search: in-process (wall and CPU time of the search call) and as a CLI process.

Default case: ``h3t-plan search --model llama-175b --num-gpus 4096 --seq-length 4096
--global-batch-size 2048 --gpu h800 --precision auto`` (BF16 and FP8 plans, the memory ladder; target: search call
under 0.5 s CPU on one core, with the CLI's default ``--top 10``; ``--top 0`` ranks every feasible plan, as
``search(top=None)`` does). The search call runs in this process after the CLI runs, with its caches empty (a cold
call, as the CLI's): 22 plans priced (29 since 2026-12-02, every rung of the memory ladder a plan of its own), 3 on
the timeline; 0.29-0.37 s CPU on the shared 2-core machine on
2026-11-28 (best of 5 interleaved 0.289 s, the commit before 0.331 s; the machine's speed varies by day, so
compare commits interleaved), the CLI process ~0.65 s wall; results unchanged (``scripts/planner_search_digest.py``);
where the time goes: docs/DESIGN.md, "Search speed".

    python scripts/bench_planner.py [--model llama-175b] [--num-gpus 4096] [--seq-length 4096]
                                    [--global-batch-size 2048] [--gpu h800] [--precision auto] [--top 10]
                                    [--fp8-recipe delayed] [--first-last-layers-bf16] [--memory-budget BYTES]
                                    [--offload-alpha auto] [--repeat 1] [--json]

A fixed ``--offload-alpha`` times the search that prices each candidate's exposed copies in its bound
(docs/DESIGN.md, "Search speed"): ``--model llama3-70b --num-gpus 512 --seq-length 4096 --global-batch-size 512
--gpu b200 --precision bf16 --offload-alpha 1`` (the CLI's --top 10) priced 3,751 plans before, 68 since, and 87 once
the closed form priced each reload against the compute it overlaps (2026-12-03; 0.53 s CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from h3t_ext.costmodel import get_model, get_system  # noqa: E402
from h3t_ext.costmodel.fp8 import DEFAULT_FP8_RECIPE, FP8_RECIPES  # noqa: E402
from h3t_ext.planner.search import search  # noqa: E402
from h3t_ext.planner.space import MEMORY_LADDER, SearchConstraints  # noqa: E402
from h3t_ext.offload_alpha import format_alpha  # noqa: E402
from h3t_ext.planner.args import search_alpha  # noqa: E402
from h3t_ext.planner.units import parse_bytes  # noqa: E402


def _in_process(args) -> dict:
    model, system = get_model(args.model), get_system(args.gpu)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    result = search(model, system, num_gpus=args.num_gpus, seq_length=args.seq_length,
                    global_batch_size=args.global_batch_size, top=args.top or None, alpha_mode=args.offload_alpha,
                    memory_budget_bytes=None if args.memory_budget is None else parse_bytes(args.memory_budget),
                    constraints=SearchConstraints(precisions=("bf16", "fp8") if args.precision == "auto"
                                                  else (args.precision,), memory_ladder=MEMORY_LADDER,
                                                  fp8_recipe=args.fp8_recipe,
                                                  first_last_layers_bf16=args.first_last_layers_bf16))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    best = result.best
    return {
        "search_wall_s": wall,
        "search_cpu_s": cpu,
        "plans_priced": result.considered,
        "plans_feasible": len(result.plans),
        "partial_plans_rejected": sum(result.rejected.values()),
        "best_tokens_per_second": best.tokens_per_second if best else None,
        "best_megatron_flags": list(best.megatron_flags) if best else None,
    }


def _cli(args) -> dict:
    cmd = [sys.executable, "-m", "h3t_ext.planner", "search", "--model", args.model, "--num-gpus", str(args.num_gpus),
           "--seq-length", str(args.seq_length), "--global-batch-size", str(args.global_batch_size), "--gpu", args.gpu,
           "--precision", args.precision, "--json", "--top", str(args.top or 10**9),
           *(["--fp8-recipe", args.fp8_recipe] if args.precision != "bf16" else []),  # the CLI refuses it on bf16
           *(["--first-last-layers-bf16"] if args.first_last_layers_bf16 else []),
           *(["--memory-budget", args.memory_budget] if args.memory_budget is not None else []),
           "--offload-alpha", _alpha_text(args.offload_alpha)]
    t0 = time.perf_counter()
    before = os.times()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    after = os.times()
    wall = time.perf_counter() - t0
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return {"cli_wall_s": wall, "cli_cpu_s": cpu, "cli_exit_code": proc.returncode, "cli_command": " ".join(cmd[1:])}


def _alpha_text(alpha) -> str:
    """``--offload-alpha`` as the CLI run is given it: a mode's name, or the number as h3t-plan prints it."""
    return alpha if isinstance(alpha, str) else format_alpha(alpha)


def _byte_count(text: str) -> str:
    """``--memory-budget`` as given (the CLI run takes it so), checked to be a byte count h3t-plan reads."""
    try:
        parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-175b")
    ap.add_argument("--num-gpus", type=int, default=4096)
    ap.add_argument("--seq-length", type=int, default=4096)
    ap.add_argument("--global-batch-size", type=int, default=2048)
    ap.add_argument("--gpu", default="h800")
    ap.add_argument("--top", type=int, default=10, help="best plans wanted (0: rank every feasible plan)")
    ap.add_argument("--precision", default="auto", choices=("bf16", "fp8", "auto"))
    ap.add_argument("--fp8-recipe", default=DEFAULT_FP8_RECIPE, choices=FP8_RECIPES,
                    help=f"the FP8 plans' recipe (default {DEFAULT_FP8_RECIPE}, Megatron's)")
    ap.add_argument("--first-last-layers-bf16", action="store_true",
                    help="the FP8 plans' first and last layers in BF16 (needs a recipe other than delayed)")
    ap.add_argument("--memory-budget", type=_byte_count, default=None,
                    help="bytes per GPU as h3t-plan takes them (e.g. 40GiB; default: the system's budget)")
    ap.add_argument("--offload-alpha", type=search_alpha, default="auto",
                    help="auto (default), balanced, or one fixed alpha in [0, 1] (as h3t-plan search takes it)")
    ap.add_argument("--repeat", type=int, default=1, help="CLI runs; the minimum is reported")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = {"case": vars(args).copy()}
    out["case"].pop("json")
    cli_runs = [_cli(args) for _ in range(max(1, args.repeat))]
    out.update(min(cli_runs, key=lambda r: r["cli_wall_s"]))
    out.update(_in_process(args))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"case: h3t-plan search --model {args.model} --num-gpus {args.num_gpus} --seq-length {args.seq_length} "
          f"--global-batch-size {args.global_batch_size} --gpu {args.gpu}"
          + ("" if args.memory_budget is None else f" --memory-budget {args.memory_budget}")
          + ("" if args.offload_alpha == "auto" else f" --offload-alpha {_alpha_text(args.offload_alpha)}"))
    print(f"search call : {out['search_wall_s']:.3f} s wall, {out['search_cpu_s']:.3f} s CPU")
    print(f"CLI process : {out['cli_wall_s']:.3f} s wall, {out['cli_cpu_s']:.3f} s CPU (exit {out['cli_exit_code']})")
    print(f"plans priced {out['plans_priced']}, feasible {out['plans_feasible']}, partial plans rejected "
          f"{out['partial_plans_rejected']}")
    if out["best_megatron_flags"]:
        print(f"best: {out['best_tokens_per_second']:,.0f} tokens/s  {' '.join(out['best_megatron_flags'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
