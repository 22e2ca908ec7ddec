"""Megatron's run-control behaviours through pretrain_gpt.py (1 CPU process, mock data):
--exit-duration-in-mins and --exit-signal-handler save and exit; the log line averages over --log-interval."""
from __future__ import annotations

import re
import signal
import subprocess

import pytest

from driver_harness import PYTHON, REPO, _env, check_ok, metrics, run_pretrain

TINY_GPT = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
            "--max-position-embeddings", "32",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "200", "--no-progress-bar", "--eval-iters", "0"]


def test_exit_duration_saves_and_exits_after_the_iteration(tmp_path):
    out, save = tmp_path / "m.json", tmp_path / "ckpt"
    proc = run_pretrain([*TINY_GPT, "--train-iters", "50", "--exit-duration-in-mins", "1e-6", "--save", str(save),
                         "--metrics-json", str(out)], entry="pretrain_gpt.py")
    check_ok(proc)
    assert "exiting program at iteration 1: --exit-duration-in-mins 1e-06 reached" in proc.stdout
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert len(metrics(out)["iterations"]) == 1


def test_exit_signal_handler_saves_and_exits_on_sigterm(tmp_path):
    out, save = tmp_path / "m.json", tmp_path / "ckpt"
    cmd = [PYTHON, str(REPO / "pretrain_gpt.py"), *TINY_GPT, "--train-iters", "100000", "--log-interval", "1",
           "--exit-signal-handler", "--save", str(save), "--metrics-json", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if " iteration " in line and "/  100000" in line:  # training has started
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    stdout = "".join(lines) + rest
    assert proc.returncode == 0, stdout[-2000:]
    m = re.search(r"exiting program at iteration (\d+): exit signal received", stdout)
    assert m, stdout[-2000:]
    done = int(m.group(1))
    assert 1 <= done < 100000
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(done)
    assert len(metrics(out)["iterations"]) == done


def test_log_line_averages_over_the_interval(tmp_path):
    out = tmp_path / "m.json"
    proc = run_pretrain([*TINY_GPT, "--train-iters", "4", "--log-interval", "2", "--metrics-json", str(out)],
                        entry="pretrain_gpt.py")
    check_ok(proc)
    its = metrics(out)["iterations"]
    logged = {int(m.group(1)): float(m.group(2)) for m in re.finditer(
        r"iteration\s+(\d+)/\s+4 \|.*? lm loss: (\S+) \| loss scale: 1\.0 \|.*?number of skipped iterations:\s+0 \| "
        r"number of nan iterations:\s+0 \|", proc.stdout)}
    assert sorted(logged) == [1, 2, 4]
    assert logged[1] == pytest.approx(its[0]["loss"], rel=1e-6)
    # Megatron-LM 0.19 prints the first iteration without starting a new interval: the line at 2 averages 1 and 2
    assert logged[2] == pytest.approx((its[0]["loss"] + its[1]["loss"]) / 2, rel=1e-6)
    assert logged[4] == pytest.approx((its[2]["loss"] + its[3]["loss"]) / 2, rel=1e-6)


def test_exit_on_missing_checkpoint_exits_before_training_and_trains_from_scratch_without_it(tmp_path):
    """Megatron-LM's --exit-on-missing-checkpoint: a --load that holds no checkpoint ends the run with status 0 (its
    ``sys.exit()``) before any iteration; without the flag the same command trains from scratch."""
    load, save, out = tmp_path / "empty", tmp_path / "ckpt", tmp_path / "m.json"
    load.mkdir()
    run = [*TINY_GPT, "--train-iters", "2", "--load", str(load), "--save", str(save), "--metrics-json", str(out)]
    proc = run_pretrain([*run, "--exit-on-missing-checkpoint"], entry="pretrain_gpt.py")
    check_ok(proc)
    assert f"note: no checkpoint in --load {load}; --exit-on-missing-checkpoint: exiting" in proc.stdout
    assert " iteration " not in proc.stdout and not out.exists()
    assert not (save / "latest_checkpointed_iteration.txt").exists()
    proc = run_pretrain(run, entry="pretrain_gpt.py")
    check_ok(proc)
    assert f"note: no checkpoint in --load {load}; training from scratch" in proc.stdout
    assert len(metrics(out)["iterations"]) == 2


def test_log_lines_at_the_runs_first_iteration_and_the_interval_only(tmp_path):
    """Lines at the first iteration of each run (a resumed one's too) and at multiples of --log-interval, as
    Megatron-LM 0.19 prints them: none at a last iteration off the interval."""
    save = tmp_path / "ckpt"
    base = [*TINY_GPT, "--train-iters", "5", "--log-interval", "2", "--save", str(save)]

    def lines(proc):
        return {int(m.group(1)): float(m.group(2)) for m in re.finditer(
            r"iteration\s+(\d+)/\s+5 \|.*? lm loss: (\S+) \|", proc.stdout)}

    first = run_pretrain([*base, "--exit-interval", "2", "--metrics-json", str(tmp_path / "a.json")],
                         entry="pretrain_gpt.py")
    check_ok(first)
    assert sorted(lines(first)) == [1, 2]
    resumed = run_pretrain([*base, "--load", str(save), "--metrics-json", str(tmp_path / "b.json")],
                           entry="pretrain_gpt.py")
    check_ok(resumed)
    logged, its = lines(resumed), metrics(tmp_path / "b.json")["iterations"]
    assert sorted(logged) == [3, 4]
    assert logged[4] == pytest.approx((its[0]["loss"] + its[1]["loss"]) / 2, rel=1e-6)  # iterations 3 and 4
