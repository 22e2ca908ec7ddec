"""The driver trains on Megatron-LM's learning-rate and weight-decay schedule: the first update of a warm-up runs
at --lr-warmup-init (megatron-core's scheduler is stepped after each update), the logged learning rate is the one
Megatron-LM logs (after its scheduler's step), WSD and a weight-decay increment run through the driver, and a
resume continues the schedule from the checkpoint's ``num_steps``."""
from __future__ import annotations

import pytest

from driver_harness import TINY_MODEL, check_ok, metrics, read_common, run_pretrain
from h3t_training.loop.param_schedule import ParamSchedule

B = 4
SCHEDULE = ["--micro-batch-size", "2", "--global-batch-size", str(B), "--train-iters", "4", "--mock-data",
            "--lr-warmup-iters", "1", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2", "--min-lr", "1e-4",
            "--weight-decay-incr-style", "linear", "--start-weight-decay", "0", "--end-weight-decay", "0.1"]


def _argv(lr: str) -> list[str]:
    flags = [a for a in TINY_MODEL]
    flags[flags.index("--lr") + 1] = lr
    return [a for a in flags if a not in ("--lr-decay-style", "constant")] + SCHEDULE


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("lr")
    out = {}
    for lr in ("1e-3", "4e-3"):
        check_ok(run_pretrain([*_argv(lr), "--metrics-json", str(d / f"{lr}.json")]))
        out[lr] = metrics(d / f"{lr}.json")["iterations"]
    ckpt = d / "ckpt"
    check_ok(run_pretrain([*_argv("1e-3"), "--save", str(ckpt), "--exit-interval", "2"]))
    check_ok(run_pretrain([*_argv("1e-3"), "--load", str(ckpt), "--metrics-json", str(d / "resumed.json")]))
    out["resumed"] = metrics(d / "resumed.json")["iterations"]
    out["common"] = read_common(ckpt / "iter_0000002")
    return out


def test_the_first_update_runs_at_the_warm_up_init(runs):
    """Two peaks, one warm-up of one iteration: the first update is at lr 0 in both, so the second iteration's loss
    is the first's weights' in both; the third shows the peaks apart."""
    low, high = ([r["loss"] for r in runs[lr]] for lr in ("1e-3", "4e-3"))
    assert low[:2] == high[:2]
    assert low[2] != high[2]


def test_the_logged_learning_rate_is_megatrons(runs):
    """Megatron-LM logs its scheduler's rate after the iteration's step: here warm-up over 4 samples, stable, then
    the WSD annealing of the last 8 samples (exponential, Megatron's default) to --min-lr."""
    s = ParamSchedule(max_lr=1e-3, min_lr=1e-4, init_lr=0.0, warmup_steps=B, decay_steps=4 * B, decay_style="WSD",
                      wsd_decay_steps=2 * B)
    logged = [r["learning_rate"] for r in runs["1e-3"]]
    assert logged == pytest.approx([s.lr(B * (i + 1)) for i in range(4)], rel=1e-12)
    assert logged[0] == logged[1] == pytest.approx(1e-3) and logged[3] == pytest.approx(1e-4)


def test_a_resume_continues_the_schedule(runs):
    assert runs["common"]["opt_param_scheduler"]["num_steps"] == 2 * B
    assert runs["common"]["opt_param_scheduler"]["end_weight_decay"] == 0.1
    resumed = runs["resumed"]
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in runs["1e-3"][2:]]
    assert [r["learning_rate"] for r in resumed] == [r["learning_rate"] for r in runs["1e-3"][2:]]
