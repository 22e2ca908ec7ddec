#!/usr/bin/env python3
"""A run that survives repeated kills by itself (h3t_training/launch/chaos.py).

    .venv/bin/python scripts/chaos_run.py [--nproc 2] [--train-iters 60] [--kills 5] [--kill-every K]
        [--save-interval 4] [--no-kill-during-save] [--max-restarts N] [--seed 0] [--workdir DIR] [--keep]
        [--json] [--dry-run] [-- DRIVER FLAGS]

Runs pretrain_llama.py (a tiny model on mock data unless DRIVER FLAGS say otherwise) once undisturbed, then under
torchrun --max-restarts with --save/--load on one directory, SIGKILLing a random worker each time the run first
reaches iteration K, 2K, ... (the first kill while a checkpoint is being written), and lets it resume on its own.
Prints whether the final weights equal the undisturbed run's bit for bit, the restarts, and goodput (iterations
of the final model per second of wall time) against the undisturbed run's. Exit 0 when the run survived with
bit-equal weights, 1 otherwise, 2 for a bad flag.
"""
import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from h3t_training.launch import chaos  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chaos_run.py", description=__doc__.split("\n\n")[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="CPU ranks (gloo)")
    p.add_argument("--train-iters", type=int, default=60)
    p.add_argument("--kills", type=int, default=5, help="SIGKILLs of a random worker, the first during a save")
    p.add_argument("--kill-every", type=int, default=None,
                   help="iterations between kills (default: train-iters // (kills + 1))")
    p.add_argument("--save-interval", type=int, default=4)
    p.add_argument("--no-kill-during-save", action="store_true", help="kill at iterations only")
    p.add_argument("--max-restarts", type=int, default=None, help="torchrun's (default: kills + 2)")
    p.add_argument("--seed", type=int, default=0, help="picks the rank each kill hits")
    p.add_argument("--workdir", default=None, help="checkpoints and logs (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the temporary working directory")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--dry-run", action="store_true", help="print the resolved commands and the kill plan")
    p.add_argument("driver_flags", nargs="*", help="after --: pretrain_llama.py flags replacing the tiny model's")
    return p


def _spec(args) -> chaos.ChaosSpec:
    kill_every = args.kill_every if args.kill_every is not None else chaos.default_kill_every(args.train_iters,
                                                                                              args.kills)
    python = os.path.join(ROOT, ".venv", "bin", "python")
    return chaos.ChaosSpec(
        driver_flags=tuple(args.driver_flags) or chaos.TINY_DRIVER_FLAGS, train_iters=args.train_iters,
        kills=args.kills, kill_every=kill_every, save_interval=args.save_interval,
        kill_during_save=not args.no_kill_during_save, nproc=args.nproc,
        max_restarts=args.max_restarts if args.max_restarts is not None else args.kills + 2, seed=args.seed,
        python=python if os.path.exists(python) else sys.executable, repo=ROOT)


def _dry_run(spec: chaos.ChaosSpec, workdir: str) -> None:
    print("uninterrupted:", shlex.join(chaos.launcher_command(spec, os.path.join(workdir, "reference"), 0,
                                                              max_restarts=0)))
    print("supervised:   ", shlex.join(chaos.launcher_command(spec, os.path.join(workdir, "chaos"), 0,
                                                              max_restarts=spec.max_restarts)))
    print("(--master-port 0: a free port is picked at launch)")
    for i, k in enumerate(chaos.kill_plan(spec), 1):
        print(f"kill {i}: a random worker (SIGKILL) once the run reaches iteration {k.target_iteration}"
              + (", while the next checkpoint is being written" if k.during_save else ""))


def _text(report: chaos.ChaosReport) -> None:
    s, ref, run = report.spec, report.reference, report.chaos
    print(f"uninterrupted: {s.train_iters} iterations in {ref.wall_s:.1f} s ({report.reference_goodput:.2f} it/s)")
    print(f"supervised:    {s.train_iters} iterations in {run.wall_s:.1f} s ({report.goodput:.2f} it/s): "
          f"{len(run.kills)} kills, {run.restarts} restarts (resumed from iterations "
          f"{', '.join(map(str, run.attempts[1:])) or 'none'}), {run.iterations_run - s.train_iters} iterations "
          f"redone")
    for i, e in enumerate(run.kills, 1):
        where = (f"during the save of iteration {e.save_iteration}" + ("" if e.interrupted_save else
                                                                      " (the save finished first)")
                 if e.save_iteration is not None else f"at iteration {e.seen_iteration}")
        print(f"  kill {i}: rank {e.rank} (pid {e.pid}) {where}; latest complete checkpoint then: "
              f"iteration {e.latest_after}")
    c = report.comparison
    if c is not None:
        print(f"final weights: {'bit-equal to' if c.equal else 'DIFFERENT from'} the uninterrupted run's "
              f"({c.tensors} tensors of iteration {s.train_iters}, model and optimizer)")
    print(f"goodput: {report.goodput / report.reference_goodput:.3f} of the uninterrupted run's")
    for line in report.problems():
        print(f"chaos_run.py: error: {line}", file=sys.stderr)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = _spec(args)
    except chaos.ChaosError as e:
        print(f"chaos_run.py: error: {e}", file=sys.stderr)
        return 2
    workdir = args.workdir or tempfile.mkdtemp(prefix="h3t-chaos-")
    if args.dry_run:
        _dry_run(spec, workdir)
        if not args.workdir:
            os.rmdir(workdir)
        return 0
    from h3t_training.loop.checkpointing import CheckpointError

    os.makedirs(workdir, exist_ok=True)
    try:
        report = chaos.run(spec, workdir)
    except (chaos.ChaosError, CheckpointError) as e:  # CheckpointError: the latest checkpoint after a kill is bad
        print(f"chaos_run.py: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
        for line in report.problems():
            print(f"chaos_run.py: error: {line}", file=sys.stderr)
    else:
        _text(report)
    if not args.workdir and not args.keep and not report.problems():
        shutil.rmtree(workdir, ignore_errors=True)
    elif not args.workdir:
        print(f"logs and checkpoints kept in {workdir}", file=sys.stderr)
    return 1 if report.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
