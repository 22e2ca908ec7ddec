"""The driver's learning-rate and weight-decay schedule against megatron-core's own OptimizerParamScheduler, stepped
as Megatron-LM's training loop steps it: each update runs with the scheduler's values *before* its step, the
scheduler then advances by the samples of that iteration, and not at all after a skipped (fp16 overflow) update."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from h3t_training.config.sections import parse_args
from h3t_training.config.arguments import LR_DECAY_STYLES, WD_INCR_STYLES, WSD_DECAY_STYLES
from h3t_training.loop.param_schedule import ParamSchedule, increment, resumed_steps, steps_before
from parse_harness import error_body

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--lr", "3e-3", "--min-lr", "3e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
ITERS = 40


def _megatron_scheduler(s: ParamSchedule):
    """megatron-core's scheduler over three parameter groups as megatron-core's optimizer makes them: decayed,
    not decayed (wd_mult 0), and one with its own peak and floor (--decoupled-lr)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    p = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    opt = torch.optim.SGD([{"params": [p[0]], "wd_mult": 1.0}, {"params": [p[1]], "wd_mult": 0.0},
                           {"params": [p[2]], "wd_mult": 1.0, "max_lr": 1e-2, "min_lr": 1e-3}], lr=s.max_lr)
    sched = OptimizerParamScheduler(opt, init_lr=s.init_lr, max_lr=s.max_lr, min_lr=s.min_lr,
                                    lr_warmup_steps=s.warmup_steps, lr_decay_steps=s.decay_steps,
                                    lr_decay_style=s.decay_style, start_wd=s.start_wd, end_wd=s.end_wd,
                                    wd_incr_steps=s.wd_incr_steps, wd_incr_style=s.wd_incr_style,
                                    wsd_decay_steps=s.wsd_decay_steps, lr_wsd_decay_style=s.wsd_decay_style)
    return opt, sched


def _run_both(argv: list[str], skipped: frozenset = frozenset()) -> tuple[list, list]:
    """(megatron-core's, the driver's) lr and weight decay of every group at every update, over ITERS iterations of
    a ramp-up batch schedule (8 then 16 samples), the updates in ``skipped`` skipped."""
    args = parse_args([*BASE, *argv], world_size=1)
    schedule = ParamSchedule.from_args(args)
    opt, sched = _megatron_scheduler(schedule)
    ours = [dict(g) for g in opt.param_groups]
    theirs_seen, ours_seen, steps = [], [], 0
    for it in range(args.train_iters):
        theirs_seen.append([(g["lr"], g["weight_decay"]) for g in opt.param_groups])  # what its update uses
        schedule.apply(ours, steps)
        ours_seen.append([(g["lr"], g["weight_decay"]) for g in ours])
        if it not in skipped:  # Megatron-LM steps its scheduler after a successful update only
            sched.step(increment=args.batch_schedule.batch_size(it))
            steps += increment(args, it)
    return theirs_seen, ours_seen


STYLES = [["--lr-decay-style", style] for style in LR_DECAY_STYLES if style != "WSD"] + [
    ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "12", "--lr-wsd-decay-style", w] for w in WSD_DECAY_STYLES]
WD = [["--weight-decay-incr-style", "constant", "--weight-decay", "0.05"]] + [
    ["--weight-decay-incr-style", w, "--start-weight-decay", "0.01", "--end-weight-decay", "0.2"]
    for w in WD_INCR_STYLES if w != "constant"]


@pytest.mark.parametrize("lr_flags,wd_flags", list(itertools.product(STYLES, WD)),
                         ids=lambda f: "-".join(f[1::2][:2]))
def test_every_update_gets_megatron_cores_learning_rate_and_weight_decay(lr_flags, wd_flags):
    argv = ["--train-iters", str(ITERS), "--global-batch-size", "16", "--rampup-batch-size", "8", "8", "64",
            "--lr-warmup-iters", "5", "--lr-decay-iters", "30", "--lr-warmup-init", "1e-4", *lr_flags, *wd_flags]
    theirs, ours = _run_both(argv)
    assert ours == theirs  # the same arithmetic: equal, not close
    lrs = [step[0][0] for step in ours]
    assert lrs[0] == 1e-4 and max(lrs) == 3e-3  # from --lr-warmup-init, up to --lr
    assert len(set(lrs)) >= 10  # the warm-up's steps (and the decay's)
    if "constant" not in lr_flags:
        assert lrs[-1] < 3e-3  # decayed
    wds = {step[0][1] for step in ours}
    assert len(wds) == (1 if "constant" in wd_flags else ITERS) and {step[1][1] for step in ours} == {0.0}


def test_a_warm_up_fraction_is_megatrons_product_not_whole_samples():
    argv = ["--train-iters", "10", "--global-batch-size", "4", "--lr-warmup-fraction", "0.33"]
    args = parse_args([*BASE, *argv], world_size=1)
    assert args.lr_warmup_steps == 0.33 * 40  # 13.2 samples, as Megatron-LM computes it
    theirs, ours = _run_both(["--train-iters", str(ITERS), "--global-batch-size", "16", "--lr-warmup-fraction",
                              "0.33", "--lr-decay-style", "cosine"])
    assert ours == theirs


def test_sample_based_wsd_and_skipped_updates_follow_megatron_core():
    argv = ["--train-samples", str(ITERS * 16), "--global-batch-size", "16", "--lr-decay-style", "WSD",
            "--lr-wsd-decay-samples", "160", "--lr-wsd-decay-style", "cosine", "--lr-warmup-samples", "48",
            "--weight-decay-incr-style", "linear", "--start-weight-decay", "0", "--end-weight-decay", "0.1"]
    theirs, ours = _run_both(argv, skipped=frozenset({2, 3, 17}))  # fp16 overflows: the schedule waits
    assert ours == theirs
    assert ours[3] == ours[2] == ours[4] and ours[0][0][0] == 0.0
    assert ours[4][0][0] == 2e-3  # the warm-up's third update, two iterations late
    stable = [step[0][0] for step in ours[5:28]]
    assert stable == pytest.approx([3e-3] * len(stable), rel=1e-15)  # WSD's stable phase at --lr, annealed in the last 160 samples
    assert ours[-1][0][0] == pytest.approx(3e-4 + 0.5 * (math.cos(0.6 * math.pi) + 1) * 2.7e-3)  # 96 of 160 in


def test_inverse_square_root_and_constant_after_the_warm_up():
    s = ParamSchedule(max_lr=1.0, min_lr=0.1, init_lr=0.0, warmup_steps=4, decay_steps=100,
                      decay_style="inverse-square-root")
    assert [s.lr(n) for n in (0, 2, 4, 16, 64, 101)] == [0.0, 0.5, 1.0, 0.5, 0.25, 0.1]
    assert s.lr(99) == pytest.approx(max(0.1, 2 / 99 ** 0.5))


def test_the_first_update_is_at_the_warm_up_init_and_megatron_logs_the_next():
    """Megatron-LM's first update of a warm-up runs at --lr-warmup-init (the scheduler stepped by 0); the learning
    rate it logs for an iteration is the scheduler's after that iteration's step."""
    args = parse_args([*BASE, "--train-iters", "10", "--global-batch-size", "4", "--lr-warmup-iters", "2"],
                      world_size=1)
    s = ParamSchedule.from_args(args)
    assert (args.lr_warmup_steps, args.lr_decay_steps) == (8, 40)
    assert [s.lr(steps_before(args, it)) for it in range(3)] == [0.0, pytest.approx(1.5e-3), 3e-3]


def test_a_resume_continues_the_saved_count():
    args = parse_args([*BASE, "--train-iters", "10", "--global-batch-size", "4"], world_size=1)
    assert resumed_steps(args, {"num_steps": 12}, 5) == 12  # fewer than 5 x 4: updates were skipped
    assert resumed_steps(args, {"lr": 3e-3}, 5) == 20  # a checkpoint that predates the count: its samples
    assert resumed_steps(args, None, 0) == 0
    assert resumed_steps(args.replace(finetune=True), {"num_steps": 12}, 0) == 0  # --finetune starts the schedule


@pytest.mark.parametrize("flags,message", [
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD with --train-iters needs --lr-wsd-decay-iters"),
    (["--lr-wsd-decay-samples", "8"], "--lr-wsd-decay-samples needs --train-samples"),
    (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "0"], "--lr-wsd-decay-iters 0 is outside [1, inf)"),
    (["--start-weight-decay", "0.1"], "--start-weight-decay needs --weight-decay-incr-style linear or cosine"),
    (["--weight-decay-incr-style", "cosine", "--end-weight-decay", "0.1"],
     "--weight-decay-incr-style cosine needs --start-weight-decay and --end-weight-decay"),
    (["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.2", "--end-weight-decay", "0.1"],
     "--start-weight-decay 0.2 is outside [0, --end-weight-decay 0.1]"),
    (["--lr-warmup-iters", "10"], "the learning-rate warm-up (40 samples) must be shorter than the decay span"),
])
def test_a_schedule_megatron_refuses_is_one_line(flags, message, capsys):
    assert error_body([*BASE, "--train-iters", "10", "--global-batch-size", "4", *flags], capsys,
                      world_size=1).startswith(message)
