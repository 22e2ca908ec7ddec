"""A run that survives repeated kills by itself (``scripts/chaos_run.py``).

The driver runs under torchrun with ``--max-restarts`` and ``--save``/``--load`` on one directory. A supervisor
reads the launcher's output (the last rank's iteration lines), SIGKILLs a random worker each time the run first
reaches iteration ``K``, ``2K``, ... and once while a checkpoint is being written (``iter_N.tmp`` exists under
``--save``: :func:`h3t_training.loop.checkpointing.save_checkpoint` writes there and renames it only when every rank
has finished). torchrun stops the other workers and starts the group again; the driver resumes from the tracker's
checkpoint. Between the kill and the resume the supervisor checks that the tracker names a complete checkpoint
(:func:`h3t_training.loop.checkpointing.check_latest`). At the end the final checkpoint is compared tensor by tensor,
bit for bit, with an uninterrupted run's of the same flags, and goodput (iterations of the final model per second
of wall time) is set against the uninterrupted run's.
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from h3t_ext.testing import free_port

ITERATION_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|")
"""The driver's iteration log line (``h3t_training.telemetry.training_log``), printed by the last rank after the step."""
ATTEMPT_LINE = re.compile(r"training: \d+ iterations from (\d+),")
"""The header every start (and restart) of the worker group prints: the iteration it resumes from."""
TINY_DRIVER_FLAGS = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size",
                     "128", "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr",
                     "1e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--hidden-dropout", "0.1",
                     "--seed", "7", "--no-progress-bar")
"""The default model: small enough that a restart costs more than the lost iterations. Dropout is on, so the
resumed runs also depend on every rank's RNG state coming back from the checkpoint."""
SAVE_POLL_S = 0.0005
"""How often the supervisor looks for an ``iter_N.tmp`` directory while waiting to kill during a save (a tiny
model's save takes tens of milliseconds)."""
WAIT_S = 600.0
"""The longest the supervisor waits for one event (an iteration, a save, a restart) before giving up."""


class ChaosError(Exception):
    """A chaos run that could not be set up or observed; the message is one line."""


@dataclass(frozen=True)
class ChaosSpec:
    """What to run and how to disturb it."""

    driver_flags: tuple[str, ...]
    """The driver's flags, without --train-iters, --save, --load, --save-interval, --log-interval."""
    train_iters: int = 60
    kills: int = 5
    kill_every: int = 10
    """A kill each time the run first reaches iteration kill_every, 2 kill_every, ..."""
    save_interval: int = 4
    kill_during_save: bool = True
    """The first kill lands while a checkpoint is written (the next save after its iteration)."""
    nproc: int = 2
    max_restarts: int = 7
    seed: int = 0
    """Picks the rank each kill hits."""
    python: str = "python3"
    repo: str = "."
    monitor_interval_s: float = 0.1
    """torchrun's --monitor-interval: how soon it sees a dead worker."""

    def __post_init__(self):
        checks = [(self.nproc >= 2, f"--nproc {self.nproc} is outside [2, inf) (a kill needs a peer to take down)"),
                  (self.train_iters >= 1, f"--train-iters {self.train_iters} is outside [1, inf)"),
                  (self.kills >= 0, f"--kills {self.kills} is outside [0, inf)"),
                  (self.kill_every >= 1, f"--kill-every {self.kill_every} is outside [1, inf)"),
                  (self.kills * self.kill_every < self.train_iters,
                   f"--kills {self.kills} x --kill-every {self.kill_every} is outside [0, --train-iters "
                   f"{self.train_iters}): the last kill would come after the end"),
                  (self.save_interval >= 1, f"--save-interval {self.save_interval} is outside [1, inf)"),
                  (self.max_restarts >= self.kills,
                   f"--max-restarts {self.max_restarts} is outside [--kills {self.kills}, inf)")]
        for ok, line in checks:
            if not ok:
                raise ChaosError(line)


def default_kill_every(train_iters: int, kills: int) -> int:
    """Kills spread evenly: ``train_iters // (kills + 1)`` (the last one well before the end)."""
    return max(1, train_iters // (kills + 1))


def run_flags(spec: ChaosSpec, save_dir: str) -> list[str]:
    """The driver's whole command line for a run saving to (and resuming from) ``save_dir``."""
    data = [] if any(f in spec.driver_flags for f in ("--data-path", "--train-data-path", "--mock-data")) \
        else ["--mock-data"]
    return [*spec.driver_flags, *data, "--train-iters", str(spec.train_iters), "--save", save_dir, "--load", save_dir,
            "--save-interval", str(spec.save_interval), "--log-interval", "1"]


def launcher_command(spec: ChaosSpec, save_dir: str, port: int, *, max_restarts: int) -> list[str]:
    """torchrun as ``scripts/launch_torchrun.sh`` starts it (``h3t_training.launch.torchrun``), with ``--max-restarts``."""
    return [spec.python, "-m", "h3t_training.launch.torchrun", "--nproc-per-node", str(spec.nproc), "--nnodes", "1",
            "--max-restarts", str(max_restarts), "--monitor-interval", str(spec.monitor_interval_s),
            "--master-addr", "127.0.0.1", "--master-port", str(port),
            os.path.join(spec.repo, "pretrain_llama.py"), *run_flags(spec, save_dir)]


def launcher_env(repo: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=repo + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    return env


@dataclass(frozen=True)
class PlannedKill:
    target_iteration: int
    """The kill comes once the run first reaches this iteration (or the first save after it)."""
    during_save: bool


def kill_plan(spec: ChaosSpec) -> list[PlannedKill]:
    return [PlannedKill(spec.kill_every * (i + 1), spec.kill_during_save and i == 0) for i in range(spec.kills)]


@dataclass(frozen=True)
class KillEvent:
    """One SIGKILL and what the checkpoint directory held when the job had stopped."""

    target_iteration: int
    seen_iteration: int
    """The last iteration line printed before the kill."""
    rank: int
    pid: int
    save_iteration: Optional[int]
    """The iteration whose save (``iter_N.tmp``) was in progress when the kill was sent (None: not a save kill)."""
    latest_after: Optional[int]
    """The tracker's iteration once the killed group had stopped (its checkpoint checked complete)."""

    @property
    def interrupted_save(self) -> bool:
        """The save was in progress and never completed (the tracker stayed before it)."""
        return self.save_iteration is not None and (self.latest_after or 0) < self.save_iteration

    def as_dict(self) -> dict:
        return {"target_iteration": self.target_iteration, "seen_iteration": self.seen_iteration, "rank": self.rank,
                "pid": self.pid, "save_iteration": self.save_iteration, "latest_after": self.latest_after,
                "interrupted_save": self.interrupted_save}


@dataclass(frozen=True)
class RunResult:
    """One launcher run from start to exit."""

    returncode: int
    wall_s: float
    iterations_run: int
    """Iteration lines printed, redone ones included."""
    attempts: tuple[int, ...]
    """The iteration each start of the worker group resumed from (one entry per start)."""
    log: str
    """The launcher's output file."""
    kills: tuple[KillEvent, ...] = ()

    @property
    def restarts(self) -> int:
        return max(0, len(self.attempts) - 1)


class _Launcher:
    """A launcher process whose output (stdout and stderr) is copied to ``log`` and parsed as it comes."""

    def __init__(self, cmd: list[str], *, cwd: str, log: str):
        self.log = log
        self._file = open(log, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=launcher_env(cwd), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        self.last_iteration = 0
        self.iterations_run = 0
        self.attempts: list[int] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._file.write(line)
            m = ITERATION_LINE.search(line)
            if m:
                self.last_iteration = int(m.group(1))
                self.iterations_run += 1
            m = ATTEMPT_LINE.search(line)
            if m:  # a new start of the group: the iterations count from its checkpoint again
                self.last_iteration = int(m.group(1))
                self.attempts.append(int(m.group(1)))
        self._file.flush()

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout_s: float = WAIT_S) -> float:
        """Wait for the launcher to exit; returns its wall time."""
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise ChaosError(f"the launcher did not finish within {timeout_s:.0f}s (see {self.log})") from None
        wall = time.monotonic() - self.t0
        self._reader.join(timeout=10)
        self._file.close()
        return wall

    def stop(self) -> None:
        """Kill the launcher's session (it and its workers), if it is still there."""
        if self.running():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def workers(self) -> dict[int, int]:
        """{rank: pid} of the launcher's live worker processes."""
        found = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    stat = f.read()
                fields = stat[stat.rindex(")") + 2:].split()
                if int(fields[1]) != self.proc.pid or fields[0] == "Z":
                    continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().decode(errors="replace").split("\0")
            except (OSError, ValueError):
                continue
            rank = next((int(e[5:]) for e in env if e.startswith("RANK=")), None)
            if rank is not None:
                found[rank] = int(pid)
        return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def _wait_for(what: str, predicate, launcher: _Launcher, poll_s: float = 0.01, timeout_s: float = WAIT_S) -> bool:
    """Poll ``predicate`` until it holds (True) or the launcher exits (False)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if not launcher.running():
            return bool(predicate())
        if time.monotonic() > deadline:
            raise ChaosError(f"waited {timeout_s:.0f}s for {what} (see {launcher.log})")
        time.sleep(poll_s)
    return True


def _save_dirs(save_dir: str) -> dict[tuple[str, int], int]:
    """{(name, inode): iteration} of the ``iter_N.tmp`` directories under ``save_dir`` (saves in progress, or left
    by a group killed while saving: the next save of that iteration replaces them with a new directory)."""
    found = {}
    try:
        entries = list(os.scandir(save_dir))
    except OSError:
        return found
    for e in entries:
        if e.name.startswith("iter_") and e.name.endswith(".tmp"):
            try:
                found[(e.name, e.inode())] = int(e.name[5:-4])
            except (OSError, ValueError):
                continue
    return found


class _NewSave:
    """A save that starts after this object was made (left-over ``.tmp`` directories do not count)."""

    def __init__(self, save_dir: str):
        self.save_dir = save_dir
        self.stale = set(_save_dirs(save_dir))
        self.iteration: Optional[int] = None

    def __call__(self) -> bool:
        new = {k: v for k, v in _save_dirs(self.save_dir).items() if k not in self.stale}
        if new:
            self.iteration = max(new.values())
        return self.iteration is not None


def run_reference(spec: ChaosSpec, workdir: str) -> RunResult:
    """The same flags, undisturbed (no restarts allowed)."""
    save = os.path.join(workdir, "reference")
    launcher = _Launcher(launcher_command(spec, save, free_port(), max_restarts=0), cwd=spec.repo,
                         log=os.path.join(workdir, "reference.log"))
    try:
        wall = launcher.wait()
    finally:
        launcher.stop()
    return RunResult(launcher.proc.returncode, wall, launcher.iterations_run, tuple(launcher.attempts), launcher.log)


def run_chaos(spec: ChaosSpec, workdir: str) -> RunResult:
    """The supervised run, killed as :func:`kill_plan` says (a save kill that missed its save, because the save
    finished first, passes the duty to the next kill)."""
    from h3t_training.loop.checkpointing import check_latest

    save = os.path.join(workdir, "chaos")
    rng = random.Random(spec.seed)
    launcher = _Launcher(launcher_command(spec, save, free_port(), max_restarts=spec.max_restarts), cwd=spec.repo,
                         log=os.path.join(workdir, "chaos.log"))
    events: list[KillEvent] = []
    save_kill_due = False
    try:
        for planned in kill_plan(spec):
            save_kill_due = save_kill_due or planned.during_save
            if not _wait_for(f"iteration {planned.target_iteration}",
                             lambda: launcher.last_iteration >= planned.target_iteration, launcher):
                break
            workers = launcher.workers()  # looked up before waiting for a save: the kill follows its start at once
            if not workers:
                break
            rank = rng.choice(sorted(workers))
            saving = None
            if save_kill_due:
                new_save = _NewSave(save)
                if not _wait_for("a save", new_save, launcher, poll_s=SAVE_POLL_S):
                    break
                saving = new_save.iteration
            seen, started = launcher.last_iteration, len(launcher.attempts)
            os.kill(workers[rank], signal.SIGKILL)
            _wait_for("the killed worker group to stop", lambda: not any(_alive(p) for p in workers.values()),
                      launcher)
            latest = check_latest(save)  # before the next group can write: it is still importing
            event = KillEvent(planned.target_iteration, seen, rank, workers[rank], saving, latest)
            events.append(event)
            if saving is not None and event.interrupted_save:
                save_kill_due = False
            # the next target counts from the restarted group's header: the killed group's last lines (read before
            # it, the pipe keeps their order) cannot trigger a kill of a group still starting up
            _wait_for("the restarted group's first line", lambda: len(launcher.attempts) > started, launcher)
        wall = launcher.wait()
    finally:
        launcher.stop()
    return RunResult(launcher.proc.returncode, wall, launcher.iterations_run, tuple(launcher.attempts), launcher.log,
                     tuple(events))


@dataclass(frozen=True)
class Comparison:
    """Two checkpoints' tensors compared bit for bit."""

    tensors: int
    different: tuple[str, ...]
    missing: tuple[str, ...] = field(default=())

    @property
    def equal(self) -> bool:
        return self.tensors > 0 and not self.different and not self.missing


def _tensors(directory: str, scratch: str) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = os.path.join(scratch, os.path.basename(os.path.dirname(directory)) + ".pt")
    dcp_to_torch_save(directory, path)  # no process group needed
    state = torch.load(path, map_location="cpu", weights_only=False)
    os.remove(path)
    return {k: v for k, v in state.items() if torch.is_tensor(v)}


def compare_checkpoints(a: str, b: str) -> Comparison:
    """Every tensor (model, optimizer) of checkpoint directories ``a`` and ``b``, compared as bytes."""
    import torch

    with tempfile.TemporaryDirectory() as scratch:
        ta, tb = _tensors(a, scratch), _tensors(b, scratch)
    missing = tuple(sorted(set(ta) ^ set(tb)))
    different = tuple(k for k in sorted(set(ta) & set(tb))
                      if ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape or
                      not torch.equal(ta[k].contiguous().view(-1).view(torch.uint8),
                                      tb[k].contiguous().view(-1).view(torch.uint8)))
    return Comparison(len(set(ta) & set(tb)), different, missing)


@dataclass(frozen=True)
class ChaosReport:
    spec: ChaosSpec
    reference: RunResult
    chaos: RunResult
    comparison: Optional[Comparison]
    """None when a run did not finish."""

    @property
    def reference_goodput(self) -> float:
        """Iterations of the final model per second of wall time, undisturbed."""
        return self.spec.train_iters / self.reference.wall_s

    @property
    def goodput(self) -> float:
        return self.spec.train_iters / self.chaos.wall_s

    @property
    def interrupted_saves(self) -> int:
        return sum(e.interrupted_save for e in self.chaos.kills)

    def problems(self) -> list[str]:
        """What makes the run a failure (empty: it survived)."""
        out = []
        for name, r in (("uninterrupted", self.reference), ("chaos", self.chaos)):
            if r.returncode != 0:
                out.append(f"the {name} run exited with status {r.returncode} (see {r.log})")
        if len(self.chaos.kills) != self.spec.kills:
            out.append(f"{len(self.chaos.kills)} of {self.spec.kills} kills were sent (the run ended first)")
        if self.chaos.restarts != len(self.chaos.kills):
            out.append(f"{self.chaos.restarts} restarts for {len(self.chaos.kills)} kills")
        if self.spec.kill_during_save and self.spec.kills and not self.interrupted_saves:
            out.append("no kill landed during a save (every save finished first)")
        if self.comparison is not None and not self.comparison.equal:
            c = self.comparison
            out.append(f"the final weights differ from the uninterrupted run's: {len(c.different)} of {c.tensors} "
                       f"tensors differ" + (f", {len(c.missing)} missing on one side" if c.missing else "")
                       + (f" (first: {(c.different or c.missing)[0]})" if c.different or c.missing else ""))
        return out

    def as_dict(self) -> dict:
        c = self.comparison
        return {
            "train_iters": self.spec.train_iters, "nproc": self.spec.nproc, "save_interval": self.spec.save_interval,
            "kill_every": self.spec.kill_every,
            "reference": {"wall_s": self.reference.wall_s, "returncode": self.reference.returncode,
                          "iterations_run": self.reference.iterations_run, "goodput_it_per_s": self.reference_goodput},
            "chaos": {"wall_s": self.chaos.wall_s, "returncode": self.chaos.returncode,
                      "iterations_run": self.chaos.iterations_run, "restarts": self.chaos.restarts,
                      "resumed_from": list(self.chaos.attempts[1:]), "kills": [e.as_dict() for e in self.chaos.kills],
                      "interrupted_saves": self.interrupted_saves, "goodput_it_per_s": self.goodput},
            "goodput_ratio": self.goodput / self.reference_goodput,
            "weights_equal": c is not None and c.equal, "tensors_compared": c.tensors if c else 0,
            "tensors_different": list(c.different) if c else [], "problems": self.problems()}


def run(spec: ChaosSpec, workdir: str) -> ChaosReport:
    """The uninterrupted run, then the chaos run, then the comparison of their final checkpoints."""
    from h3t_training.loop.checkpointing import iter_dir

    reference = run_reference(spec, workdir)
    chaos = run_chaos(spec, workdir)
    comparison = None
    if reference.returncode == 0 and chaos.returncode == 0:
        comparison = compare_checkpoints(iter_dir(os.path.join(workdir, "reference"), spec.train_iters),
                                         iter_dir(os.path.join(workdir, "chaos"), spec.train_iters))
    return ChaosReport(spec, reference, chaos, comparison)


__all__ = ["ChaosError", "ChaosReport", "ChaosSpec", "Comparison", "KillEvent", "PlannedKill", "RunResult",
           "TINY_DRIVER_FLAGS", "compare_checkpoints", "default_kill_every", "kill_plan", "launcher_command", "run",
           "run_chaos", "run_reference", "run_flags"]
