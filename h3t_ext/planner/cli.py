"""``h3t-plan``: estimate one plan or search all of them (thin: parse, build specs, run, print)."""
from __future__ import annotations

import json
import os
import sys
from typing import Optional, Sequence

from rich.console import Console

from h3t_ext.costmodel import InfeasiblePlanError, PlanError
from h3t_ext.planner import format as fmt
from h3t_ext.planner.args import PROG, SEARCH_ALPHA_REFUSAL, build_parser
from h3t_ext.planner.from_args import UsageError, constraints_from_args, flagify, megatron_offload_requested, \
    model_from_args, plan_from_args, system_file_from_args, system_from_args
from h3t_ext.planner.calibrate import RunFileError, calibrate, check_output_path, read_runs
from h3t_ext.planner.evaluate import evaluate, flash_rate_tokens_per_second
from h3t_ext.planner.flags import megatron_flags
from h3t_ext.planner.launch_env import describe_launch_env, launch_env_words
from h3t_ext.planner.search import search

def _fail(message: str) -> int:
    sys.stderr.write(f"{PROG}: error: {' '.join(message.split())}\n")
    return 2


def _reader_gone() -> int:
    """The process reading stdout closed it (``| head``): no traceback; stdout goes to the null device so that
    the interpreter's last flush at exit does not fail again, and the exit status is 1, as Python's own advice
    has it."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1


def _console() -> Console:
    console = Console()
    return console if console.is_terminal else Console(width=200)


def _estimate(ns, model, system) -> int:
    try:
        plan = plan_from_args(ns, model=model)
        mode = plan.offload_alpha if megatron_offload_requested(ns) else ns.offload_alpha
        ev = evaluate(model, plan, system, alpha_mode=mode,
                      memory_budget_bytes=ns.memory_budget, host_memory_budget_bytes=ns.host_memory_budget)
    except InfeasiblePlanError as e:
        return _fail(f"--offload-alpha {ns.offload_alpha}: no alpha in [0, 1] fits the memory budget: {e.reason}")
    if ns.json:
        out = fmt.evaluation_dict(ev, megatron_flags(ev.plan, moe=model.is_moe), launch_env_words(ev.plan, system))
        flash = flash_rate_tokens_per_second(model, ev, system)
        if flash is not None:  # the fused attention at a 2024 stack's rate (format.attention_stack_clause)
            out["tokens_per_second_at_flash_attention_rate"] = flash
        if ns.explain:
            out["estimate"] = ev.estimate.to_dict()
        print(json.dumps(out, indent=2))
        return 0
    console = _console()
    for line in fmt.estimate_lines(ev, model, system):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    for table in fmt.explain_tables(ev) if ns.explain else ():
        console.print(table)
    return 0


def _search(ns, model, system) -> int:
    if isinstance(ns.offload_alpha, tuple):
        raise UsageError(f"argument --offload-alpha: {SEARCH_ALPHA_REFUSAL}")
    result = search(model, system, num_gpus=ns.num_gpus, seq_length=ns.seq_length,
                    global_batch_size=ns.global_batch_size, constraints=constraints_from_args(ns),
                    alpha_mode=ns.offload_alpha, memory_budget_bytes=ns.memory_budget, exhaustive=ns.exhaustive,
                    top=ns.top, host_memory_budget_bytes=ns.host_memory_budget)
    if not result.plans:
        return _fail(flagify(fmt.no_plan_message(result)))
    if ns.json:
        print(json.dumps(fmt.search_dicts(result, ns.top), indent=2))
        return 0
    console = _console()
    console.print(fmt.search_table(result, ns.top))
    console.print(fmt.tie_line(result), highlight=False, markup=False, soft_wrap=True)
    console.print(fmt.plausibility_line(result, ns.top), highlight=False, markup=False, soft_wrap=True)
    for i, r in enumerate(result.plans[:ns.top], 1):
        console.print(f"#{i:<3d} " + " ".join(r.megatron_flags), highlight=False, markup=False, soft_wrap=True)
        if r.launch_env:
            console.print("     " + describe_launch_env(r.launch_env), highlight=False, markup=False, soft_wrap=True)
    for line in fmt.rejected_lines(result):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    return 0


def _calibrate(ns, model, system) -> int:
    try:
        check_output_path(ns.output)
        runs = read_runs(ns.runs, model, system)
        result = calibrate(system, system_file_from_args(ns), runs, ns.calibration_weight)
    except (RunFileError, OSError) as e:
        return _fail(str(e))
    with open(ns.output, "w", encoding="utf-8") as f:
        json.dump(result.system_file, f, indent=1)
        f.write("\n")
    report = result.system_file["calibration"]
    if ns.json:
        print(json.dumps({**report, "output": ns.output}, indent=2))
        return 0
    fit = result.fit
    print(f"calibrated {system.name} on {fit.rows} run(s): tokens/s MAE {fit.mae_before:.2%} -> "
          f"{result.mae_applied:.2%} (the fit taken whole: {fit.mae_after:.2%})")
    print(f"applied at weight {result.weight:.3g}: {result.weight_from}")
    for k, v in fit.fitted.items():
        print(f"  fitted       {k:<28} {result.applied[k]:.4g}  (fit {v:.4g}, prior {system.efficiency(k):.4g}; "
              f"plausible {report['fitted'][k]['plausible_range']})")
    for k, why in fit.unidentified.items():
        print(f"  not fitted   {k:<28} {fit.system.efficiency(k):.4g}  ({why})")
    print(f"wrote {ns.output}; use it with --system-file {ns.output}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``h3t-plan``; returns the exit code (2 for bad input, one line on stderr)."""
    ns = build_parser().parse_args(argv)
    try:
        model, system = model_from_args(ns), system_from_args(ns)
        command = {"estimate": _estimate, "search": _search, "calibrate": _calibrate}[ns.command]
        code = command(ns, model, system)
        sys.stdout.flush()  # a reader that stopped early (h3t-plan ... --json | head) fails here, not at exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except UsageError as e:
        return _fail(str(e))
    except PlanError as e:
        return _fail(flagify(e.reason))


if __name__ == "__main__":
    sys.exit(main())
