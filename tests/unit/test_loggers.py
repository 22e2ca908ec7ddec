"""The scalar-writer layer without a training run: dispatch, wandb through a stand-in module, the
one-line refusals of missing packages and bad evaluation/logging flags."""
from __future__ import annotations

import importlib.util
import types

import pytest

from h3t_training.config.arguments import build_parser
from h3t_training.config.sections import TrainConfig
from h3t_training.errors import ArgumentError
from h3t_training.config.feature_checks import check_writer_packages
from h3t_training.telemetry.loggers import (FanOutWriter, NullWriter, WandbWriter, build_writer,
                                       wandb_mode)
from h3t_training.telemetry.scalars import TrainingScalars
from parse_harness import BASE, _error


class RecordingWriter:
    enabled = True

    def __init__(self):
        self.scalars, self.closed = [], False

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


class FakeRun:
    def __init__(self):
        self.logged, self.finished = [], False

    def log(self, data, step):
        self.logged.append((dict(data), step))

    def finish(self):
        self.finished = True


def _fake_wandb():
    calls = {}
    run = FakeRun()

    def init(**kw):
        calls.update(kw)
        return run
    return types.SimpleNamespace(init=init), calls, run


def _args(*extra):
    return TrainConfig.from_namespace(build_parser().parse_args(BASE + list(extra)))


def test_wandb_writer_groups_a_step_and_skips_the_samples_axis(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    module, calls, run = _fake_wandb()
    w = WandbWriter(project="p", name="n", entity=None, save_dir=str(tmp_path / "wb"), module=module)
    assert calls["mode"] == "offline" and calls["project"] == "p" and calls["dir"] == str(tmp_path / "wb")
    w.add_scalar("lm loss", 2.0, 1)
    w.add_scalar("lm loss vs samples", 2.0, 8)
    w.add_scalar("grad-norm", 0.5, 1)
    w.add_scalar("lm loss", 1.5, 2)
    w.close()
    assert run.logged == [({"lm loss": 2.0, "grad-norm": 0.5}, 1), ({"lm loss": 1.5}, 2)]
    assert run.finished


def test_wandb_mode_is_offline_without_a_key():
    assert wandb_mode({}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "x"}) == "online"
    assert wandb_mode({"WANDB_MODE": "disabled", "WANDB_API_KEY": "x"}) == "disabled"


def test_fan_out_and_null_writer():
    a, b = RecordingWriter(), RecordingWriter()
    fan = FanOutWriter([a, b])
    fan.add_scalar("x", 1.0, 3)
    fan.close()
    assert a.scalars == b.scalars == [("x", 1.0, 3)] and a.closed and b.closed
    assert isinstance(build_writer(_args("--tensorboard-dir", "/nonexistent"), is_logging_rank=False), NullWriter)
    assert isinstance(build_writer(_args(), is_logging_rank=True), NullWriter)


def test_scalars_use_megatron_tags_and_switches():
    args = _args("--log-validation-ppl-to-tensorboard", "--log-world-size-to-tensorboard",
                 "--no-log-loss-scale-to-tensorboard", "--log-interval", "2").replace(world_size=2)
    w = RecordingWriter()
    s = TrainingScalars(args, w, on_gpu=False)
    rec = {"iteration": 2, "loss": 3.0, "learning_rate": 1e-3, "grad_norm": 0.7, "tokens_per_second_per_gpu": 10.0,
           "mfu": 0.1, "elapsed_ms": 250.0, "tflops_per_gpu": 0.5}
    s.iteration(rec, loss_scale=1.0)
    s.evaluation(2, "valid", 4.0, 54.6)
    s.evaluation(2, "test", 4.5, 90.0)
    tags = {t: (v, step) for t, v, step in w.scalars}
    assert tags["lm loss"] == (3.0, 2) and tags["lm loss vs samples"] == (3.0, 16)
    assert tags["learning-rate"] == (1e-3, 2) and tags["grad-norm"] == (0.7, 2) and tags["world-size"] == (2, 2)
    assert "loss-scale" not in tags and "iteration-time" not in tags and "throughput" not in tags
    assert tags["lm loss validation"] == (4.0, 2) and tags["lm loss validation ppl"] == (54.6, 2)
    assert tags["lm loss test"] == (4.5, 2) and tags["lm loss validation vs samples"] == (4.0, 16)


def test_missing_packages_are_named_before_any_process():
    args = _args("--tensorboard-dir", "/tmp/x", "--wandb-project", "p")
    with pytest.raises(ArgumentError, match=r"--tensorboard-dir /tmp/x needs the tensorboard package"):
        check_writer_packages(args, find_spec=lambda name: None)
    with pytest.raises(ArgumentError, match=r"--wandb-project p needs the wandb package \(pip install wandb\)"):
        check_writer_packages(args, find_spec=lambda name: None if name == "wandb" else object())


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_project_without_wandb_is_one_line(capsys, monkeypatch):
    line = _error(BASE + ["--wandb-project", "p"], capsys, monkeypatch, world_size=1)
    assert "needs the wandb package (pip install wandb)" in line


@pytest.mark.parametrize("extra, expected", [
    (["--eval-interval", "0"], "--eval-interval 0 is outside [1, inf)"),
    (["--eval-iters", "-1"], "--eval-iters -1 is outside [0, inf)"),
    (["--tensorboard-log-interval", "0"], "--tensorboard-log-interval 0 is outside [1, inf)"),
    (["--tensorboard-queue-size", "0"], "--tensorboard-queue-size 0 is outside [1, inf)"),
    (["--split", "90,x,5"], "--split '90,x,5' is not comma-separated numbers"),
    (["--split", "0,0,0"], "--split 0,0,0 has no positive share"),
    (["--skip-train", "--eval-iters", "0"], "--skip-train with --eval-iters 0 has nothing to do"),
    (["--skip-train", "--split", "100,0,0"], "--skip-train with --split 100,0,0 has no validation or test data"),
    (["--valid-data-path", "/nonexistent/p"], "give exactly one of --data-path PREFIX and --mock-data"),
])
def test_bad_eval_flags_give_one_line(extra, expected, capsys, monkeypatch):
    assert expected in _error(BASE + extra, capsys, monkeypatch, world_size=1)


def test_per_split_paths_need_a_training_path(capsys, monkeypatch, tmp_path):
    argv = [a for a in BASE if a != "--mock-data"] + ["--valid-data-path", str(tmp_path / "v")]
    assert "--valid-data-path/--test-data-path need --train-data-path" in _error(argv, capsys, monkeypatch, 1)
    argv = [a for a in BASE if a != "--mock-data"] + ["--train-data-path", str(tmp_path / "t")]
    assert f"--train-data-path {tmp_path / 't'}: {tmp_path / 't'}.idx does not exist" in _error(
        argv, capsys, monkeypatch, 1)
