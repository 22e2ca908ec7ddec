"""End to end through pretrain_llama.py with 2 CPU ranks: ckpt/offload equivalence and --auto-plan."""
from __future__ import annotations

import math

import pytest

from driver_harness import TINY_MODEL, check_ok, losses, metrics, run_pretrain  # noqa: F401

PIPELINE = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "3"]


@pytest.fixture(scope="module")
def reference_and_ours(corpus_prefix, tmp_path_factory):
    out = {}
    runs = {"no": ["--ckpt", "no", "--offload-alpha", "0"], "ours": ["--ckpt", "ours", "--offload-alpha", "0.5"],
            "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
                     "--offload-alpha", "0.25,0.5"]}
    for ckpt, flags in runs.items():
        path = tmp_path_factory.mktemp(f"m_{ckpt}") / "metrics.json"
        proc = run_pretrain([*TINY_MODEL, *PIPELINE, "--data-path", corpus_prefix, *flags,
                             "--metrics-json", str(path)], nproc=2)
        check_ok(proc)
        out[ckpt] = metrics(path)
        out[f"{ckpt}_stdout"] = proc.stdout
    return out


def test_ours_with_offload_gives_the_reference_losses(reference_and_ours):
    ref = [r["loss"] for r in reference_and_ours["no"]["iterations"]]
    ours = [r["loss"] for r in reference_and_ours["ours"]["iterations"]]
    assert len(ref) == len(ours) == 3
    assert all(math.isfinite(x) for x in ref)
    assert ours == pytest.approx(ref, rel=1e-5, abs=0)
    assert ref[-1] < ref[0]  # the model learns


def test_megatron_full_recompute_with_per_stage_offload_gives_the_reference_losses(reference_and_ours):
    ref = [r["loss"] for r in reference_and_ours["no"]["iterations"]]
    full = reference_and_ours["full"]
    assert full["config"]["ckpt"] == "full" and full["config"]["offload_alpha"] == [0.25, 0.5]
    assert [r["loss"] for r in full["iterations"]] == pytest.approx(ref, rel=1e-5, abs=0)
    assert all(b > 0 for b in full["offloaded_bytes"])


def test_ours_offloads_and_keeps_less(reference_and_ours):
    ref, ours = reference_and_ours["no"], reference_and_ours["ours"]
    assert len(ours["stage_peak_activation_bytes"]) == len(ours["offloaded_bytes"]) == 2
    assert all(b > 0 for b in ours["offloaded_bytes"])
    assert all(b == 0 for b in ref["offloaded_bytes"])
    for mine, theirs in zip(ours["stage_peak_activation_bytes"], ref["stage_peak_activation_bytes"]):
        assert 0 < mine < theirs


def test_offload_runs_say_which_copy_path_they_use(reference_and_ours):
    from h3t_ext import kernels

    def notes(ckpt):
        return [l for l in reference_and_ours[f"{ckpt}_stdout"].splitlines() if "activation offload copies" in l]

    assert notes("ours") == [f"note: activation offload copies use {kernels.describe('cpu')}"]
    assert notes("no") == []  # --offload-alpha 0: nothing to say


def test_metrics_have_the_documented_fields(reference_and_ours):
    it = reference_and_ours["ours"]["iterations"]
    assert [r["iteration"] for r in it] == [1, 2, 3]
    for r in it:
        assert r["tokens_per_second_per_gpu"] > 0 and 0 < r["mfu"]


def test_auto_plan_picks_a_plan_that_runs(corpus_prefix, tmp_path):
    path = tmp_path / "metrics.json"
    proc = run_pretrain([*TINY_MODEL, "--auto-plan", "--global-batch-size", "8", "--train-iters", "2",
                         "--data-path", corpus_prefix, "--metrics-json", str(path)], nproc=2)
    check_ok(proc)
    line = [l for l in proc.stdout.splitlines() if l.startswith("auto-plan")]
    assert len(line) == 1, proc.stdout
    cfg = metrics(path)["config"]
    flags = cfg["auto_plan_flags"]
    assert flags and "--pipeline-model-parallel-size" in flags
    assert int(flags[flags.index("--pipeline-model-parallel-size") + 1]) == cfg["pipeline_model_parallel_size"]
    assert cfg["tensor_model_parallel_size"] * cfg["pipeline_model_parallel_size"] * cfg["data_parallel_size"] == 2
    assert len(losses(path)) == 2 and all(math.isfinite(x) for x in losses(path))
