"""Megatron-LM's --dataloader-type through pretrain_llama.py: ``single`` (given or not) is the split in order,
``cyclic`` reads each data-parallel rank's bucket in a random order per epoch (h3t_training/data/samplers.py) and
resumes where it stopped; ``external`` and cyclic without data sharding are one line."""
from __future__ import annotations

import pytest

from driver_harness import TINY_MODEL, check_ok, metrics, run_pretrain  # noqa: F401


def _losses(tmp_path, name, flags, nproc=1):
    out = tmp_path / f"{name}.json"
    check_ok(run_pretrain([*flags, "--metrics-json", str(out)], nproc=nproc))
    return [r["loss"] for r in metrics(out)["iterations"]]


@pytest.fixture
def common(corpus_prefix):
    return [*TINY_MODEL, "--data-path", corpus_prefix, "--global-batch-size", "4", "--micro-batch-size", "1",
            "--train-iters", "4", "--eval-iters", "0"]


def test_single_is_the_default_and_cyclic_reads_other_samples(common, tmp_path):
    default = _losses(tmp_path, "default", common)
    assert _losses(tmp_path, "single", [*common, "--dataloader-type", "single"]) == default
    cyclic = _losses(tmp_path, "cyclic", [*common, "--dataloader-type", "cyclic"])
    assert cyclic[0] != default[0]


@pytest.mark.parametrize("nproc", [1, 2])
def test_cyclic_resumes_where_it_stopped(common, tmp_path, nproc):
    flags = [*common, "--dataloader-type", "cyclic"] + (["--use-distributed-optimizer"] if nproc == 2 else [])
    full = _losses(tmp_path, "full", flags, nproc)
    ckpt = tmp_path / "ckpt"
    first = _losses(tmp_path, "first", [*flags, "--save", str(ckpt), "--exit-interval", "2"], nproc)
    resumed = _losses(tmp_path, "resumed", [*flags, "--load", str(ckpt)], nproc)
    assert first == full[:2] and resumed == pytest.approx(full[2:], rel=1e-6)


@pytest.mark.parametrize("flags, message", [
    (["--dataloader-type", "external"], "--dataloader-type external hands Megatron-LM a loader"),
    (["--dataloader-type", "cyclic", "--no-data-sharding"], "--no-data-sharding with --dataloader-type cyclic"),
], ids=["external", "no-sharding"])
def test_what_it_cannot_sample_is_one_line(common, flags, message):
    proc = run_pretrain([*common, *flags])
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
