"""scripts/gpu_check.sh on a machine without a GPU: one line saying so, non-zero exit."""
from __future__ import annotations

import json
import subprocess
import sys

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


def _report_module():
    from tests.script_harness import load_script

    return load_script("gpu/report.py")


def test_report_reads_the_stage_memory_script_on_cpu():
    """The report's stage-memory part runs scripts/gpu/stage_memory.py --json (here its CPU run: two gloo
    ranks, host-staged transfers, activation peaks against the cost model)."""
    error, details, why = _report_module().stage_memory(timeout_s=300, device="cpu")
    assert why == "" and details["device"] == "cpu" and error == details["max_error"]
    assert [s["stage"] for s in details["stages"]] == [0, 1]
    for s in details["stages"]:
        assert s["measured_bytes"] > 0 and s["predicted_bytes"] > 0
        assert s["rel_error"] == pytest.approx((s["measured_bytes"] - s["predicted_bytes"]) / s["predicted_bytes"],
                                               abs=1e-5)
        assert s["staging"]["sends"] > 0 and s["staging"]["recvs"] == s["staging"]["sends"]
        assert s["params"] == s["predicted_params"]  # the ModelSpec/Plan describe the model that ran
    assert error <= 0.02  # 1.15% today (the saved-activation count against the activation model)
    assert details["run"] == {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
                              "ckpt": "ours", "offload_alpha": 0.5, "p2p_staging": "host", "dtype": "fp32",
                              "warmup": 1, "iterations": 1}
    assert details["plan"]["ckpt"] == "ours" and details["plan"]["offload_alpha"] == 0.5
    first, last = details["losses"][0], details["losses"][-1]
    assert len(first) == 4 and sum(last) < sum(first)  # an optimizer step happened


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_report_names_why_stage_memory_is_missing():
    error, details, why = _report_module().stage_memory(timeout_s=120, device="cuda")
    assert error is None and details is None
    assert why == "stage_memory.py: error: no CUDA device (use --device cpu for the CPU run)"


def test_stage_memory_script_bad_input_is_one_line():
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu/stage_memory.py"), "--device", "cpu",
                           "--num-layers", "3"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == "stage_memory.py: error: --num-layers must be divisible by pipeline 2 x virtual 2 = 4, got 3\n"


def test_attention_dropout_bench_runs_its_cpu_path():
    """scripts/gpu/bench_attention_dropout.py --device cpu exercises the measurement (PyTorch's math SDPA at
    dropout 0 and 0.1, forward and backward) and reports the data file's stated slowdowns beside it; its
    timings mean nothing on CPU and are not checked."""
    import json
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu/bench_attention_dropout.py"), "--device", "cpu",
                           "--seq-length", "64", "--micro-batch-size", "1", "--num-attention-heads", "2",
                           "--kv-channels", "16", "--repeats", "2", "--json"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    from h3t_ext.costmodel.efficiency_sets import efficiency_set
    assert out["stated"] == {"fwd_slowdown": efficiency_set("hopper")["attention_dropout_fwd_slowdown"],
                             "bwd_slowdown": efficiency_set("hopper")["attention_dropout_bwd_slowdown"]}
    r = out["backends"]["math"]
    assert r["ran"] and all(r[f"{x}_s_p{p}"] > 0 for x in ("fwd", "bwd") for p in (0.0, 0.1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_attention_dropout_bench_without_a_gpu_is_one_line():
    proc = subprocess.run([sys.executable, str(REPO / "scripts/gpu/bench_attention_dropout.py")], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr == "bench_attention_dropout.py: error: no CUDA GPU (use --device cpu to exercise the code path)\n"


def _lease_written_files() -> tuple[set[str], list[str], dict[str, int]]:
    """The part files scripts/gpu/lease_run.sh writes, its shell variables expanded: the native runs it starts
    (``native NAME PORT``) and the precisions of its sustained-GEMM loop."""
    import re

    text = (REPO / "scripts/gpu/lease_run.sh").read_text()
    natives = re.findall(r"^native (\w+) \d+ ", text, flags=re.M)
    sustained = dict(pair.split(":") for pair in re.search(r"for prec_s in ([\w: ]+); do", text).group(1).split())
    written = set()
    # written: redirected into (>"$PARTS/x"), or named as an output (--json "$PARTS/x", --junitxml="$PARTS/x")
    for name in re.findall(r'(?:>|--json |--junitxml=)"\$PARTS/([\w.${}%:*-]+)"', text):
        if "$name" in name:
            written |= {name.replace("$name", n) for n in natives}
        elif "${prec_s%%:*}" in name:
            written |= {name.replace("${prec_s%%:*}", p) for p in sustained}
        else:
            written.add(name)
    return written, natives, {p: int(s) for p, s in sustained.items()}


def test_the_lease_writes_every_part_the_report_reads():
    """report.py --from-parts and scripts/gpu/lease_run.sh are two files: a part the report reads and the lease never
    writes is a measurement silently missing from every report (the attention-dropout bench was, until the lease ran
    it)."""
    report = _report_module()
    written, natives, sustained = _lease_written_files()
    assert set(report.PART_FILES.values()) <= written, set(report.PART_FILES.values()) - written
    assert tuple(natives) == report.NATIVE_RUNS
    assert sustained == report.SUSTAINED


def _lease_parts(tmp_path):
    """An H200 lease's parts folder holding only its meta.json."""
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "meta.json").write_text(json.dumps({"gpu": "NVIDIA H200", "date": "2026-11-28", "torch": "t",
                                                 "cuda": "c"}))
    return parts


def _report(parts, *extra):
    """report.py --from-parts ``parts`` (and ``extra``), run as a lease's owner would."""
    return subprocess.run([sys.executable, str(REPO / "scripts/gpu/report.py"), "--from-parts", str(parts), *extra],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)


def test_report_from_the_parts_of_a_lease(tmp_path):
    """report.py --from-parts: the report from the files scripts/gpu/lease_run.sh leaves (no GPU needed); a part that
    died is named, not guessed."""
    parts = _lease_parts(tmp_path)
    (parts / "gpu_tests.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0">'
        '<testcase classname="a" name="ok"/><testcase classname="a" name="ok2"/>'
        '<testcase classname="a" name="bad"><failure>x</failure></testcase></testsuite></testsuites>')
    (parts / "stage_memory.json").write_text('some warning\n{"max_error": 0.021, "stages": []}\n')
    (parts / "overlap.json").write_text("  warnings.warn(\n")  # the bench died after a warning
    (parts / "native-ours.log").write_text("iteration 1 | lm loss: 7.5E+00 |\niteration 2 | lm loss: 7.25E+00 |\n")
    (parts / "native-no.log").write_text(  # a rank's exception, then torchrun's own error after it
        "[rank0]: Traceback (most recent call last):\n[rank0]: AttributeError: module 'x' has no attribute 'y'\n"
        "[rank0]:[W1130] Warning: WARNING: destroy_process_group() was not called\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    gt = {"schema": "h3t-ground-truth/1", "system": "h200", "rows": [
        {"status": "measured", "ratio": 1.05}, {"status": "measured", "ratio": 0.8}, {"status": "left_out"}]}
    (parts / "ground_truth.json").write_text(json.dumps(gt))
    (parts / "sustained-bf16.json").write_text(json.dumps({"burst_tflops": 760.0, "sustained_tflops": 690.0}))
    proc = _report(parts, "--out-dir", str(tmp_path / "out"))
    assert proc.returncode == 1, proc.stderr  # a GPU test failed
    report = json.loads((tmp_path / "out" / "2026-11-28-nvidia-h200.json").read_text())
    assert (report["tests_passed"], report["tests_failed"]) == (2, 1)
    assert report["details"]["tests"]["failed_tests"] == ["a.bad"]
    assert report["stage_memory_max_error"] == 0.021
    assert report["offload_step_time_ratio"] is None
    assert report["missing"]["offload_step_time_ratio"].startswith("no result: the process died")
    assert report["missing"]["copy"] == "copies.json was not written (the part did not run)"
    assert report["details"]["megatron_native"]["ours"]["losses"] == [7.5, 7.25]
    assert report["details"]["megatron_native"]["no"] == {
        "ran": True, "losses": [], "last_error": "[rank0]: AttributeError: module 'x' has no attribute 'y'"}
    assert report["ground_truth"]["measured"] == 2 and report["ground_truth"]["within_10_percent"] == 1
    assert report["details"]["sustained_gemm"] == {"bf16": {"burst_tflops": 760.0, "sustained_tflops": 690.0},
                                                   "fp8": None}
    assert (tmp_path / "out" / "2026-11-28-nvidia-h200-ground-truth.json").is_file()
    assert "GPU tests passed / failed" in proc.stdout and "2 / 1" in proc.stdout


def test_a_tier_stopped_by_the_lease_cap_is_counted_from_its_verbose_log(tmp_path):
    """Without the --junitxml (pytest killed at the lease's cap) the report counts the -v result lines, each test's
    last one, and says the counts are partial; --tag names a second lease's report apart."""
    parts = _lease_parts(tmp_path)
    (parts / "gpu_tests.txt").write_text(
        "[gw0] [ 10%] PASSED tests/gpu/test_a.py::test_x\n[gw1] [ 20%] FAILED tests/gpu/test_b.py::test_y[torch]\n"
        "tests/gpu/test_c.py::test_z SKIPPED (needs two GPUs)\ntests/gpu/test_d.py::test_w PASSED\n")
    proc = _report(parts, "--out-dir", str(tmp_path / "out"), "--tag", "lease2")
    assert proc.returncode == 1, proc.stderr
    report = json.loads((tmp_path / "out" / "2026-11-28-nvidia-h200-lease2.json").read_text())
    assert (report["tests_passed"], report["tests_failed"]) == (2, 1)
    assert report["details"]["tests"] == {"passed": 2, "failed": 1, "skipped": 1, "partial": True,
                                          "failed_tests": ["tests/gpu/test_b.py::test_y[torch]"]}
    bad = _report(parts, "--tag", "../x")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith(
        "--tag '../x': letters, digits and '-' only")


def test_the_offload_target_reads_the_compute_bound_shape(tmp_path):
    """bench_offload_overlap.py runs a copy-bound shape (the link's bound, ~1.4x on an H200) and a compute-bound one;
    the report's offload_step_time_ratio is the compute-bound alpha 0.5, where the runtime's overlap is what is
    measured, and a report of the earlier one-shape bench still reads."""
    rows = [{"case": case, "alpha": a, "step_time_ratio": r} for case, ratios in
            (("copy_bound", (1.0, 1.38, 2.37)), ("compute_bound", (1.0, 1.02, 1.1))) for a, r in zip((0.0, 0.5, 1.0),
                                                                                                    ratios)]
    for overlap, want in ((rows, 1.02), ([{"alpha": 0.0, "step_time_ratio": 1.0},
                                          {"alpha": 0.5, "step_time_ratio": 1.35}], 1.35)):
        (tmp_path / str(want)).mkdir()
        parts = _lease_parts(tmp_path / str(want))
        (parts / "overlap.json").write_text(json.dumps(overlap))
        _report(parts, "--out-dir", str(tmp_path / str(want) / "out"))
        (report,) = [json.loads(f.read_text()) for f in (tmp_path / str(want) / "out").glob("*h200.json")]
        assert report["offload_step_time_ratio"] == want


def test_the_copy_figures_read_the_cases_and_keep_the_copies_beside_gemms(tmp_path):
    """copy_speedup_small and copy_bandwidth_share come from the copy cases; bench_copy_cuda.py's beside_gemm rows (each
    method's copies beside a run of GEMMs) are kept in the details, not read as a case."""
    side = {"d2h": {"speedup_over_loop": 3.1, "share_of_one_copy": 0.86},
            "h2d": {"speedup_over_loop": 3.3, "share_of_one_copy": 0.84}}
    beside = {"gemm_alone_s": 0.02, **{m: {"gemm_s": 0.021, "gemm_slowdown": 1.05, "copy_s": 0.012,
                                           "copy_gb_per_s": 44.7} for m in ("auto", "loop", "kernel")}}
    copies = {"many_small": side, "few_large": {"d2h": {"speedup_over_loop": 1.0, "share_of_one_copy": 0.98},
                                                  "h2d": {"speedup_over_loop": 1.0, "share_of_one_copy": 0.97}},
              "beside_gemm": {"many_small": beside, "few_large": beside}}
    parts = _lease_parts(tmp_path)
    (parts / "copies.json").write_text(json.dumps(copies))
    _report(parts, "--out-dir", str(tmp_path / "out"))
    report = json.loads((tmp_path / "out" / "2026-11-28-nvidia-h200.json").read_text())
    assert (report["copy_speedup_small"], report["copy_bandwidth_share"]) == (3.1, 0.84)
    assert report["details"]["copies"]["beside_gemm"]["many_small"]["kernel"]["gemm_slowdown"] == 1.05


def test_driver_steps_lists_its_runs_and_compares_a_report_with_the_estimate():
    """scripts/gpu/driver_steps.py: --dry-run prints each case's driver command; --compare puts the committed H200
    measurements beside h3t-plan estimate (no GPU needed for either)."""
    run = [sys.executable, str(REPO / "scripts/gpu/driver_steps.py")]
    proc = subprocess.run([*run, "--dry-run", "--only", "llama-1b/ours/0.5"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.strip().splitlines()
    assert line.startswith("llama-1b/ours/0.5: ") and "--ckpt ours --offload-alpha 0.5" in line and "--bf16" in line
    bad = subprocess.run([*run, "--only", "llama-9b/no/0"], cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and bad.stderr.startswith(
        "driver_steps.py: error: --only: unknown case llama-9b/no/0 (valid: llama-1b/no/0, ")
    report = REPO / "docs/gpu-reports/2026-11-28-nvidia-h200-driver-steps.json"
    proc = subprocess.run([*run, "--compare", str(report)], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert [ln.split()[0] for ln in lines] == ["llama-1b/no/0", "llama-1b/ours/0", "llama-1b/full/0"]
    assert "step    915.6 ms" in lines[0] and "peak 25.69 GiB" in lines[0]


def test_sustained_gemm_plan_and_bad_input_without_a_gpu():
    run = [sys.executable, str(REPO / "scripts/gpu/sustained_gemm.py")]
    proc = subprocess.run([*run, "--dry-run", "--size", "4096"], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("bf16 GEMM 4096^3 back to back for 20 s") and "TFLOP/s (0." in proc.stdout
    bad = subprocess.run([*run, "--size", "100"], env=_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip() == "sustained_gemm.py: error: --size must be in [256, 32768], got 100"
