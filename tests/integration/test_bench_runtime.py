"""scripts/bench_runtime.py --vs-megatron: h3t-ext's executor and megatron-core's own schedule functions on
the same model, data and layout (PP=2, v=1 and v=2) in one run. Checked: both schedules' step times for
both layouts are reported and the two agree on the losses and gradients (timings are not asserted)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_runtime.py"
TINY = ["--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "2",
        "--num-query-groups", "1", "--seq-length", "16", "--micro-batch-size", "1", "--num-microbatches", "4",
        "--iterations", "1"]
FLOAT32_ROUNDOFF = 1e-6  # a few ulps; the two run the same ops in the same order (0 in practice)


def test_vs_megatron_reports_both_schedules_and_the_same_losses():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--vs-megatron", "--json", *TINY], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert out["config"]["iterations"] == 1 and out["config"]["ckpt"] == "no" and out["config"]["offload_alpha"] == 0
    rows = {r["virtual_pipeline_model_parallel_size"]: r for r in out["layouts"]}
    assert sorted(rows) == [1, 2]
    for v, r in rows.items():
        assert r["pipeline_model_parallel_size"] == 2
        for key in ("megatron_step_s", "h3t_step_s", "megatron_cpu_s", "h3t_cpu_s"):
            assert isinstance(r[key], float) and r[key] > 0, (v, key, r[key])
        assert len(r["megatron_step_s_all"]) == len(r["h3t_step_s_all"]) == 1
        assert r["ratio"] > 0 and r["paired_ratio"] > 0
        assert r["losses_compared"] == 4, r  # every microbatch's loss on the last stage
        assert r["max_loss_rel_diff"] <= FLOAT32_ROUNDOFF, r
        assert r["max_grad_rel_diff"] <= FLOAT32_ROUNDOFF, r


def test_vs_megatron_refuses_a_layer_count_it_cannot_interleave():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--vs-megatron", "--num-layers", "6"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--num-layers must be divisible by 2 x --pipeline-model-parallel-size" \
        in proc.stderr, proc.stderr
