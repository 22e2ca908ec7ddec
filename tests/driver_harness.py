"""Shared pieces of the driver tests: run ``pretrain_llama.py`` for real, in 1 or 2 CPU processes.

Runs go through the real entry point (one rank: as a fork of h3t_ext.testing's preloaded server, which gives a
subprocess's exit code and output without importing torch and megatron-core again; more ranks: forks of that server
started as mpirun or srun starts ranks, ``run_entry_world``; the tests of torchrun itself launch it), read the
``--metrics-json`` file the last rank writes, and use a corpus made on the spot by
``tools/make_stdlib_corpus.py`` + ``tools/preprocess_data.py``.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from h3t_ext.testing import free_port, run_entry, run_entry_world  # noqa: F401 (free_port: for the launcher tests)

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TINY_MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
              "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "64", "--lr", "1e-3",
              "--lr-decay-style", "constant", "--log-interval", "1", "--no-progress-bar", "--seed", "7",
              "--split", "100,0,0"]
"""The tiny model every driver test trains (``--split 100,0,0``: all of the corpus trains and nothing evaluates
unless a test asks; Megatron-LM's own default, 969,30,1 with an evaluation at the end, has its own tests)."""
TIMEOUT_S = 300


def _common_pt_files() -> list[str]:
    """["common.pt"] where the installed megatron-core writes a torch_dist checkpoint's common state to its own file
    (0.16-0.18), [] where it keeps it in the shard files (0.19: scripts/megatron_compat_probe.sh runs these tests
    with it)."""
    from importlib.metadata import version

    major, minor = (int(x) for x in version("megatron-core").split(".")[:2])
    return ["common.pt"] if (major, minor) < (0, 19) else []


COMMON_PT = _common_pt_files()


def read_common(directory) -> dict:
    """A torch_dist checkpoint's common state: its common.pt, or (megatron-core 0.19) the common_state object in its
    shard files."""
    import torch

    path = Path(directory) / "common.pt"
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=False)
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(directory))


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def run_pretrain(args: list[str], nproc: int = 1, entry: str = "pretrain_llama.py") -> subprocess.CompletedProcess:
    """``entry args`` (pretrain_llama.py or pretrain_gpt.py) in ``nproc`` CPU processes, forks of h3t_ext.testing's
    preloaded server: a subprocess's result, without the interpreter starts and imports."""
    entry = str(REPO / entry)
    if nproc == 1:
        return run_entry(entry, [str(a) for a in args], env=_env(), cwd=str(REPO), timeout_s=TIMEOUT_S)
    return run_entry_world(entry, [str(a) for a in args], nproc=nproc, env=_env(), cwd=str(REPO), timeout_s=TIMEOUT_S)


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"


def metrics(path) -> dict:
    with open(path) as f:
        return json.load(f)


def losses(path) -> list[float]:
    return [r["loss"] for r in metrics(path)["iterations"]]


def losses_and_grad_norms(path, argv: list[str], *, nproc: int, iterations: int) -> list[float]:
    """Run ``argv`` on ``nproc`` ranks with its --metrics-json at ``path``: the losses, then the gradient norms, of its
    ``iterations`` iterations, every one finite. The gradient norm shows what the losses of a few iterations may not,
    e.g. that norm weights' gradients are summed over the tensor-parallel group."""
    check_ok(run_pretrain([*argv, "--metrics-json", str(path)], nproc=nproc))
    its = metrics(path)["iterations"]
    got = [r["loss"] for r in its] + [r["grad_norm"] for r in its]
    assert len(got) == 2 * iterations and all(math.isfinite(x) for x in got), got
    return got


def single_rank_reference(directory: Path, argv: list[str]) -> tuple[Path, dict]:
    """A single-rank run saved after its first iteration (the start checkpoint every layout under test loads, as
    ``test_layouts_vs_single_rank.py`` does) and the metrics of that run continued from it: (checkpoint, metrics)."""
    check_ok(run_pretrain([*argv, "--save", str(directory / "ckpt"), "--exit-interval", "1"]))
    check_ok(run_pretrain([*argv, "--load", str(directory / "ckpt"), "--metrics-json", str(directory / "ref.json")]))
    return directory / "ckpt", metrics(directory / "ref.json")


def make_corpus_data(directory: Path) -> str:
    """A byte-level indexed dataset of the stdlib documentation; returns its prefix."""
    corpus = directory / "corpus.jsonl"
    for cmd in ([PYTHON, str(REPO / "tools/make_stdlib_corpus.py"), "--output", str(corpus), "--min-bytes", "100000"],
                [PYTHON, str(REPO / "tools/preprocess_data.py"), "--input", str(corpus), "--output-prefix",
                 str(directory / "stdlib"), "--append-eod"]):
        subprocess.run(cmd, check=True, cwd=REPO, env=_env(), capture_output=True, timeout=TIMEOUT_S)
    return str(directory / "stdlib_text_document")


