"""Bad driver flags found by the bad-input sweep (parsed in-process, as the driver does before any process group):
each was accepted and either failed later (megatron-core's scheduler asserts, NumPy's seed range) or ran with a
meaningless value; now each is one line naming the flag and its valid range, exit 2."""
from __future__ import annotations

import pytest

from parse_harness import BASE, _error
from h3t_training.config.sections import parse_args


@pytest.mark.parametrize("extra, expected", [
    (["--lr-decay-iters", "0"], "--lr-decay-iters 0 is outside [1, inf)"),
    (["--lr-decay-iters", "-1"], "--lr-decay-iters -1 is outside [1, inf)"),
    (["--train-iters", None, "--train-samples", "64", "--lr-decay-samples", "0"],
     "--lr-decay-samples 0 is outside [1, inf)"),
    (["--train-iters", None, "--train-samples", "64", "--lr-warmup-samples", "-8"],
     "--lr-warmup-samples -8 is outside [0, inf)"),
    (["--min-lr", "1"], "--min-lr 1.0 is outside [0, --lr 0.001]"),
    (["--lr-warmup-init", "-1"], "--lr-warmup-init -1.0 is outside [0, --lr 0.001]"),
    (["--lr-warmup-init", "0.01"], "--lr-warmup-init 0.01 is outside [0, --lr 0.001]"),
    (["--seed", "-1"], "--seed -1 is outside [0, 4294967295]"),
    (["--seed", str(2**64)], f"--seed {2**64} is outside [0, 4294967295]"),
    (["--exit-duration-in-mins", "-1"], "--exit-duration-in-mins -1.0 is outside [0, inf) (0: no limit, as in "
                                        "Megatron-LM)"),
    (["--cpu-offloading-num-layers", "-1"], "--cpu-offloading-num-layers -1 is outside [0, 3]"),
])
def test_bad_driver_value_is_one_line(capsys, monkeypatch, extra, expected):
    argv = list(BASE)
    for flag, value in zip(extra[::2], extra[1::2]):
        if flag in argv:
            i = argv.index(flag)
            del argv[i:i + 2]
        if value is not None:
            argv += [flag, value]
    assert expected in _error(argv, capsys, monkeypatch)


@pytest.mark.parametrize("extra", [["--seed", "0"], ["--seed", str(2**32 - 1)], ["--min-lr", "1e-3"],
                                   ["--lr-warmup-init", "1e-3"], ["--lr-decay-iters", "1"]])
def test_driver_values_at_their_bounds_parse(extra):
    parse_args(BASE + extra, world_size=2)


@pytest.mark.parametrize("extra, expected", [
    (["--fp8-format", "e5m2"], "--fp8-format e5m2 is not one of e4m3, hybrid"),
    (["--fp8-param-gather"], "--fp8-param-gather needs --fp8-format (e4m3 or hybrid)"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "bogus"], "--fp8-recipe bogus is not one of delayed, tensorwise"),
    (["--fp8-format", "hybrid", "--fp8-amax-history-len", "0"], "--fp8-amax-history-len"),
    (["--attention-backend", "nope"], "--attention-backend nope is not one of flash, fused, unfused, auto, local"),
    (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    (["--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"], "--grad-reduce-in-bf16 contradicts"),
])
def test_megatron_core_fields_are_checked_on_cpu_as_on_a_gpu(capsys, monkeypatch, extra, expected):
    """A GPU run computes these megatron-core fields before any process group and refuses a bad value in one line;
    the CPU run (which notices the precision flags and trains in float32) refuses the same values, not more
    forgivingly."""
    assert expected in _error(BASE + extra, capsys, monkeypatch)


@pytest.mark.parametrize("extra", [["--fp8-format", "hybrid"], ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"],
                                   ["--attention-backend", "local"], ["--attention-backend", "flash"]])
def test_valid_megatron_core_fields_still_parse_on_cpu(extra):
    parse_args(BASE + extra, world_size=2)


def test_overlap_param_gather_needs_overlap_grad_reduce(capsys, monkeypatch):
    """Megatron-LM asserts it: the parameter all-gathers are issued by the gradient buckets' overlap."""
    err = _error(BASE + ["--use-distributed-optimizer", "--overlap-param-gather"], capsys, monkeypatch)
    assert "--overlap-param-gather needs --overlap-grad-reduce" in err


def test_exit_duration_zero_sets_no_limit_as_in_megatron():
    """Megatron-LM tests ``if args.exit_duration_in_mins:``, so 0 sets no limit (it is not 'exit at once')."""
    from h3t_training.loop.exit_conditions import ExitConditions

    assert not ExitConditions(parse_args(BASE + ["--exit-duration-in-mins", "0"], world_size=2), 0.0, None).active
    assert ExitConditions(parse_args(BASE + ["--exit-duration-in-mins", "1e-6"], world_size=2), 0.0, None).active


@pytest.mark.parametrize("extra, expected", [
    (["--log-memory-interval", "3", "--log-interval", "2"], "--log-memory-interval 3 is not a multiple of "
                                                            "--log-interval 2 (Megatron-LM asserts it)"),
    (["--log-memory-interval", "0"], "--log-memory-interval 0 is outside [1, inf)"),
    (["--save", "{tmp}", "--save-retain-interval", "5"], "--save-retain-interval 5 needs --save-interval"),
    (["--save", "{tmp}", "--save-interval", "2", "--save-retain-interval", "5"],
     "--save-retain-interval 5 is not a multiple of --save-interval 2 (Megatron-LM asserts it)"),
    (["--save", "{tmp}", "--save-interval", "2", "--save-retain-interval", "0"],
     "--save-retain-interval 0 is outside [1, inf)"),
    (["--save", "{tmp}", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
      "--save-params-interval", "4"], "--save-params-interval with --overlap-param-gather and --save"),
])
def test_megatron_lms_interval_rules_are_one_line(capsys, monkeypatch, tmp_path, extra, expected):
    """Megatron-LM's validate_args relations on the logging and saving intervals (asserts there; the flags are
    noticed here, and a command line Megatron-LM refuses is refused alike)."""
    argv = [*BASE, *(a.format(tmp=tmp_path / "ckpt") for a in extra)]
    assert expected in _error(argv, capsys, monkeypatch)


@pytest.mark.parametrize("extra", [["--log-memory-interval", "4", "--log-interval", "2"],
                                   ["--save", "{tmp}", "--save-interval", "2", "--save-retain-interval", "6"],
                                   ["--save-retain-interval", "5"],  # without --save Megatron-LM reads neither
                                   ["--save", "{tmp}", "--save-params-interval", "4"]])
def test_megatron_lms_interval_rules_pass_what_megatron_lm_passes(tmp_path, extra):
    parse_args([*BASE, *(a.format(tmp=tmp_path / "ckpt") for a in extra)], world_size=2)
