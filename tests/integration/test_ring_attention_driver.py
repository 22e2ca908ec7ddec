"""pretrain_llama.py with --context-parallel-size 2 on CPU (ring attention) against runs without it.

c = 2 (2 ranks, --ckpt ours) and c = 2 x d = 2 (4 ranks, distributed optimizer) must give the losses
of one rank; c = 2 x p = 2 (4 ranks, --ckpt ours
--offload-alpha 0.5) those of p = 2 without context parallelism (2 ranks: the pipeline stages are
seeded per pipeline rank, so a one-rank model has other initial weights). A --seq-length that 2c
does not divide is a one-line error naming the flag, exit status 2, before any process group.
"""
from __future__ import annotations

import math
import subprocess

import pytest

from driver_harness import PYTHON, REPO, _env, check_ok, metrics, run_pretrain

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "64", "--lr", "1e-3",
         "--lr-decay-style", "constant", "--log-interval", "1", "--no-progress-bar", "--seed", "7", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--micro-batch-size", "1",
         "--global-batch-size", "4", "--train-iters", "3", "--eval-iters", "0"]
RUNS = {  # name: (ranks, flags)
    "ref": (1, ["--ckpt", "no"]),
    "cp2": (2, ["--context-parallel-size", "2", "--ckpt", "ours"]),
    "cp2dp2": (4, ["--context-parallel-size", "2", "--use-distributed-optimizer", "--ckpt", "ours"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2", "--ckpt", "no"]),
    "cp2pp2": (4, ["--context-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--ckpt", "ours",
                   "--offload-alpha", "0.5"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for name, (nproc, flags) in RUNS.items():
        path = tmp_path_factory.mktemp(name) / "metrics.json"
        proc = run_pretrain([*MODEL, *flags, "--metrics-json", str(path)], nproc=nproc)
        check_ok(proc)
        out[name] = metrics(path)
    return out


def _losses(m) -> list[float]:
    return [r["loss"] for r in m["iterations"]]


@pytest.mark.parametrize("run,reference", [("cp2", "ref"), ("cp2dp2", "ref"), ("cp2pp2", "pp2")])
def test_context_parallel_gives_the_reference_losses(runs, run, reference):
    ref = _losses(runs[reference])
    assert len(ref) == 3 and all(math.isfinite(x) for x in ref) and ref[-1] < ref[0]
    assert _losses(runs[run]) == pytest.approx(ref, rel=1e-5, abs=0)
    assert runs[run]["config"]["context_parallel_size"] == 2


def test_context_parallel_halves_saved_activations_and_offloads(runs):
    """Each context-parallel rank saves the activations of half the tokens (the per-rank part of
    the output layer's too); at alpha 0.5 the first stage offloads."""
    (ref,), (cp,) = runs["ref"]["stage_peak_activation_bytes"], runs["cp2"]["stage_peak_activation_bytes"]
    assert 0 < cp < 0.6 * ref
    assert runs["cp2pp2"]["offloaded_bytes"][0] > 0


def test_seq_length_not_divisible_by_2c_is_one_line():
    env = dict(_env(), WORLD_SIZE="2", RANK="0")  # no MASTER_ADDR: a process group could not even start
    proc = subprocess.run([PYTHON, str(REPO / "pretrain_llama.py"), *MODEL, "--seq-length", "66",
                           "--context-parallel-size", "2"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0] == ("pretrain_llama.py: error: --seq-length 66 is not a multiple of 2 x --context-parallel-size 2 "
                        "= 4 (each rank holds 2 of 2c equal chunks); valid: multiples of 4")
