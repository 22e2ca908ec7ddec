"""The GPU tier's stage-memory check (``pytest -m gpu``, run by scripts/gpu_check.sh): two gloo ranks on
the one GPU, host-staged pipeline transfers, pipeline 2 interleaved, ckpt=ours and ckpt=no, alpha 0.5; every stage's
``torch.cuda.max_memory_allocated`` within 3% of the cost model's ``stage_memory(...).peak_bytes``.
Skipped without a GPU (the CPU run of the same script is tests/integration/test_gpu_check.py's)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from driver_harness import REPO, _env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("ckpt", ["ours", "no"])  # no: its norms' saved tensors are a fused kernel's on CUDA too
def test_stage_peaks_within_3_percent_of_the_cost_model(ckpt):
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu/stage_memory.py"), "--json", "--ckpt", ckpt],
                          cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["device"] == "cuda" and len(result["stages"]) == 2
    for s in result["stages"]:
        assert s["staging"]["sends"] > 0  # the transfers went through host buffers
        assert s["params"] == s["predicted_params"]
    assert result["max_error"] <= 0.03, [(s["stage"], s["measured_bytes"], s["predicted_bytes"], s["rel_error"])
                                         for s in result["stages"]]
