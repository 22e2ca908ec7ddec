"""torch_dist checkpoints reshard: saved at one t/p layout, resumed at another, the next losses are
those of the saving layout continuing from the same checkpoint; an interrupted save is never loaded."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from driver_harness import (PYTHON, REPO, TINY_MODEL, _env, check_ok, losses,  # noqa: F401
                            run_pretrain)
from h3t_ext.testing import free_port

COMMON = ["--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "4", "--lr-warmup-iters", "1",
          "--lr-decay-style", "cosine"]
"""The default vocabulary padding: ByteTokenizer's 258 tokens pad to 384 rows at t=1 and to 512 at t=2."""
PADDED = {"t1p2": 384, "t2p1": 512}
LAYOUTS = {"t1p2": ["--pipeline-model-parallel-size", "2"], "t2p1": ["--tensor-model-parallel-size", "2"]}


def _resume(argv, ckpt, layout, out):
    proc = run_pretrain([*argv, *LAYOUTS[layout], "--load", str(ckpt), "--metrics-json", str(out)], nproc=2)
    check_ok(proc)
    return proc, losses(out)


@pytest.mark.parametrize("saved, other", [("t1p2", "t2p1"), pytest.param("t2p1", "t1p2", marks=pytest.mark.slow)])
# t2p1 -> t1p2 is the slow tier (about 22 s): the reverse resharding of the same two layouts
def test_resume_at_another_layout_continues_the_same_run(corpus_prefix, tmp_path, saved, other):
    argv = [*TINY_MODEL, *COMMON, "--data-path", corpus_prefix]
    ckpt = tmp_path / "ckpt"
    check_ok(run_pretrain([*argv, *LAYOUTS[saved], "--save", str(ckpt), "--exit-interval", "2"], nproc=2))
    _, same = _resume(argv, ckpt, saved, tmp_path / "same.json")
    proc, moved = _resume(argv, ckpt, other, tmp_path / "moved.json")
    assert "saved with another parallel layout: resharded" in proc.stdout
    notes = [l for l in proc.stdout.splitlines() if "padded to" in l]  # the run keeps the checkpoint's rows
    assert len(notes) == 1 and (f"padded to {PADDED[saved]} rows, this run's flags pad to {PADDED[other]}: "
                                f"continuing with the checkpoint's {PADDED[saved]} rows") in notes[0], notes
    assert len(same) == len(moved) == 2 and same[0] != same[1]
    for a, b in zip(same, moved):
        assert abs(a - b) <= 1e-5 * abs(a), (same, moved)


def test_finetune_and_ckpt_step_and_no_load_optim(corpus_prefix, tmp_path):
    argv = [*TINY_MODEL, *COMMON, "--data-path", corpus_prefix]
    ckpt = tmp_path / "ckpt"
    check_ok(run_pretrain([*argv, "--save", str(ckpt), "--save-interval", "1", "--exit-interval", "2"]))
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")) == ["iter_0000001", "iter_0000002"]
    full = tmp_path / "full.json"
    check_ok(run_pretrain([*argv, "--metrics-json", str(full)]))
    ref = losses(full)
    at1 = tmp_path / "at1.json"
    check_ok(run_pretrain([*argv, "--load", str(ckpt), "--ckpt-step", "1", "--metrics-json", str(at1)]))
    assert losses(at1) == ref[1:]  # from iteration 1, bit for bit
    fresh_optim = tmp_path / "no_optim.json"
    check_ok(run_pretrain([*argv, "--load", str(ckpt), "--no-load-optim", "--metrics-json", str(fresh_optim)]))
    assert len(losses(fresh_optim)) == 2 and losses(fresh_optim)[1] != ref[3]  # Adam restarted
    tuned = tmp_path / "finetune.json"
    proc = run_pretrain([*argv, "--load", str(ckpt), "--finetune", "--metrics-json", str(tuned)])
    check_ok(proc)
    assert len(losses(tuned)) == 4 and losses(tuned)[0] < ref[0]  # from iteration 0, with trained weights


def _wait_for(path, proc, timeout_s=120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if path():
            return True
        time.sleep(0.002)
    return False


@pytest.mark.parametrize("point", ["tmp dir created", "first tensor file", "both tensor files"])
def test_a_run_killed_during_a_save_resumes_from_the_previous_checkpoint(corpus_prefix, tmp_path, point):
    argv = [*TINY_MODEL, *COMMON, "--data-path", corpus_prefix, "--save", str(tmp_path / "ckpt"),
            "--save-interval", "1"]
    ckpt = tmp_path / "ckpt"
    tmp2 = ckpt / "iter_0000002.tmp"
    when = {"tmp dir created": lambda: tmp2.is_dir(),
            "first tensor file": lambda: tmp2.is_dir() and any(n.endswith(".distcp") for n in os.listdir(tmp2)),
            "both tensor files": lambda: tmp2.is_dir() and sum(n.endswith(".distcp") for n in os.listdir(tmp2)) == 2,
            }[point]
    # both ranks started directly and killed together with SIGKILL: a node dying mid-save
    port, procs = free_port(), []
    for rank in (0, 1):
        env = dict(_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([PYTHON, str(REPO / "pretrain_llama.py"), *argv, *LAYOUTS["t1p2"]], cwd=REPO,
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        hit = _wait_for(lambda: (ckpt / "latest_checkpointed_iteration.txt").is_file() and when(), procs[0])
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
    if not hit:
        pytest.fail(f"the save of iteration 2 never reached '{point}' before the run ended")
    tracker = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
    assert tracker == "1" and not (ckpt / "iter_0000002").exists()
    out = tmp_path / "resumed.json"
    resumed = run_pretrain([*argv, *LAYOUTS["t1p2"], "--load", str(ckpt), "--metrics-json", str(out)], nproc=2)
    check_ok(resumed)
    assert "iterations from 1" in resumed.stdout and len(losses(out)) == 3
    assert sorted(n for n in os.listdir(ckpt) if n.startswith("iter_")) == [f"iter_000000{i}" for i in (1, 2, 3, 4)]
    shutil.rmtree(ckpt)


def test_a_padding_the_tensor_parallel_size_does_not_divide_is_refused_once(corpus_prefix, tmp_path):
    argv = [*TINY_MODEL, "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1",
            "--data-path", corpus_prefix]
    ckpt = tmp_path / "ckpt"
    check_ok(run_pretrain([*argv, "--make-vocab-size-divisible-by", "259", "--save", str(ckpt)]))  # 259 rows
    proc = run_pretrain([*argv, "--tensor-model-parallel-size", "2", "--load", str(ckpt)], nproc=2)
    assert proc.returncode != 0 and "[rank" not in proc.stderr  # no worker traceback (torchrun adds its report)
    lines = [l for l in proc.stderr.splitlines() if l.startswith("pretrain_llama.py: error: ")]
    assert len(lines) == 1, lines  # every rank finds it alike; rank 0 says it
    assert ("has its vocabulary padded to 259 rows, which --tensor-model-parallel-size 2 does not divide; load it "
            "at a tensor-parallel size that does (1, 7, 37)") in lines[0], lines
