"""scripts/gpu_check.sh on a machine without a GPU: one line saying so, non-zero exit."""
from __future__ import annotations

import subprocess

import pytest
import torch

from driver_harness import REPO, _env


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_gpu_check_without_a_gpu_is_one_line():
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh")], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert lines == ["gpu_check.sh: error: no CUDA GPU is visible to PyTorch (torch.cuda.is_available() is False); "
                     "run this on a machine with one NVIDIA GPU"]


def test_gpu_check_refuses_unknown_arguments():
    proc = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), "--fast"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == "gpu_check.sh: error: unknown argument --fast (valid: --dry-run)"
