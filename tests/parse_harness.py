"""The driver's argument parser in-process: a small valid command line and the one-line error a bad one gives
(shared by the driver-argument tests of both tiers)."""
from typing import Optional

import pytest

from h3t_training.config.sections import parse_args

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data"]


def _error(argv, capsys, monkeypatch, world_size=2) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=world_size)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pretrain_llama.py: error: ")
    return lines[0]


def fake_device(monkeypatch, *, gpu: bool, te: bool, arch_major: int = 9, capability: Optional[float] = None) -> None:
    """Make the driver see a GPU (or none) of compute capability ``arch_major``.x (Hopper's 9 unless given;
    ``capability`` the full figure, ``arch_major``.0 unless given) and TransformerEngine (or none): its probes
    replaced (``feature_checks.cuda_available``, ``feature_checks.transformer_engine_available``,
    ``feature_checks.cuda_compute_capability``), and the launch environment without ``CUDA_DEVICE_MAX_CONNECTIONS``
    (a test that needs it sets it)."""
    from h3t_training.config import feature_checks
    monkeypatch.setattr(feature_checks, "cuda_available", lambda: gpu)
    monkeypatch.setattr(feature_checks, "transformer_engine_available", lambda: te)
    monkeypatch.setattr(feature_checks, "cuda_compute_capability",
                        lambda: float(arch_major) if capability is None else capability)
    monkeypatch.delenv(feature_checks.CONNECTIONS_VAR, raising=False)


def error_body(argv, capsys, world_size: int = 2) -> str:
    """The one-line error a bad command line gives, after ``prog: error: `` (exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=world_size)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0].split(": error: ", 1)[1]
