"""scripts/gpu/ground_truth.py without a GPU: the dry run (the list and the model's predictions), the CPU smoke
run of the real measurement code (structure only, never timings), the refit on a synthetic report, bad input;
and the cost model's per-term functions the script prices with."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from driver_harness import REPO, _env

SCRIPT = REPO / "scripts/gpu/ground_truth.py"
sys.path.insert(0, str(REPO / "scripts/gpu"))


def _run(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _check_rows(doc: dict) -> None:
    from groundtruth.table import ROW_KEYS, SCHEMA, check_row

    assert doc["schema"] == SCHEMA and doc["system"] == "h100-sxm"
    for r in doc["rows"]:
        check_row(r)
        assert set(r) == set(ROW_KEYS)
        assert math.isfinite(r["predicted_rate"]) and r["predicted_rate"] > 0


def test_dry_run_lists_every_measurement_with_its_prediction(tmp_path):
    out = tmp_path / "dry.json"
    proc = _run("--dry-run", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    _check_rows(doc)
    rows = doc["rows"]
    assert {r["status"] for r in rows} == {"planned"}  # the default budget keeps every (t, tokens) pair
    by_kind = {k: [r for r in rows if r["kind"] == k] for k in ("gemm", "attention", "elementwise", "copy")}
    # 3 models x 16 (t, tokens) x (4 layers x 2 precisions + the BF16 output layer) x 3 passes, + the GEMM
    # measured while copies run
    assert len(by_kind["gemm"]) == 3 * 16 * 9 * 3 + 1
    assert len(by_kind["attention"]) == 2 * 4 * 2 * 2 * 2 and len(by_kind["copy"]) == 4
    assert {r["case"]["op"] for r in by_kind["elementwise"]} >= {"rmsnorm_fwd", "layernorm_bwd", "residual_add",
                                                                 "swiglu_fwd", "gelu_bwd", "cross_entropy_fwd"}
    assert {(r["case"]["t"], r["case"]["tokens"]) for r in by_kind["gemm"]} == {
        (t, n) for t in (1, 2, 4, 8) for n in (2048, 4096, 8192, 16384)}
    # every row is listed in the table, with its prediction
    table = proc.stdout.splitlines()
    for r in rows[:5] + rows[-5:]:
        assert any(line.startswith(r["name"]) and "planned" in line for line in table)
    # the efficiency each row identifies: a large square-ish GEMM the GEMM rate, a thin one HBM
    keys = {(r["case"]["model"], r["case"]["layer"], r["case"]["pass_"], r["case"]["precision"], r["case"]["t"],
             r["case"]["tokens"]): r["efficiency"] for r in by_kind["gemm"]}
    assert keys[("gpt3-175b", "fc1", "fwd", "bf16", 1, 16384)] == "gemm_peak_fraction"
    assert keys[("gpt3-175b", "fc1", "fwd", "fp8", 1, 16384)] == "gemm_fp8_peak_fraction"
    # the experts' batched GEMMs: 4 (model, ep, tokens) layouts x FC1/FC2 x 3 passes, priced as moe prices them
    experts = [r for r in rows if r["kind"] == "experts"]
    assert len(experts) == 4 * 2 * 3 and {r["efficiency"] for r in experts} <= {"gemm_peak_fraction", "hbm_fraction"}
    mixtral = {(r["case"]["ep"], r["case"]["layer"], r["case"]["pass_"]): r["case"] for r in experts
               if r["case"]["model"] == "mixtral-8x7b"}
    assert (mixtral[(8, "fc1", "fwd")]["experts"], mixtral[(8, "fc1", "fwd")]["m"]) == (1, 4096 * 2)
    assert (mixtral[(2, "fc1", "fwd")]["experts"], mixtral[(2, "fc1", "fwd")]["m"]) == (4, 4096 * 2 // 4)


def test_dry_run_subset_under_a_small_budget(tmp_path):
    out = tmp_path / "dry.json"
    proc = _run("--dry-run", "--budget-s", "130", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    pairs = [tuple(p) for p in doc["gemm_pairs"]]
    # a prefix of the Latin-square order: every t and every token count once in the first four pairs
    assert 4 <= len(pairs) < 16 and {t for t, _ in pairs[:4]} == {1, 2, 4, 8}
    assert {n for _, n in pairs[:4]} == {2048, 4096, 8192, 16384}
    left = [r for r in doc["rows"] if r["status"] == "left_out"]
    assert left and all(r["kind"] == "gemm" and (r["case"]["t"], r["case"]["tokens"]) not in pairs for r in left)
    assert doc["estimate_s"] <= 130 / 2
    assert f"{len(left)} left out by --budget-s 130" in doc["selection"]


def test_cpu_smoke_runs_the_measurement_code(tmp_path):
    out = tmp_path / "smoke.json"
    proc = _run("--device", "cpu", "--smoke", "--repeats", "2", "--warmup", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    _check_rows(doc)
    assert doc["mode"] == "smoke" and doc["device"] == "cpu" and doc["timing"]["repeats"] == 2
    status = {}
    for r in doc["rows"]:
        status.setdefault((r["kind"], r["status"]), []).append(r)
    # everything that can run on CPU ran: BF16 GEMMs (and the one under copies), flash SDPA, every element-wise
    # kernel, the copies alone and during a GEMM; FP8 and cuDNN are skipped with the reason
    assert not any(s == "failed" for _, s in status), [r["why"] for (_, s), rs in status.items() if s == "failed"
                                                      for r in rs]
    measured = [r for r in doc["rows"] if r["status"] == "measured"]
    assert all(len(r["samples_s"]) == 2 and r["measured_s"] > 0 and r["ratio"] > 0 for r in measured)
    assert {r["case"]["precision"] for r in measured if r["kind"] == "gemm"} == {"bf16"}
    assert any(r["case"]["during_copy"] for r in measured if r["kind"] == "gemm")
    assert {r["case"]["backend"] for r in measured if r["kind"] == "attention"} == {"flash"}
    assert len([r for r in measured if r["kind"] == "copy"]) == 4
    assert len([r for r in measured if r["kind"] == "experts"]) == 6  # the smoke MoE's FC1 and FC2, 3 passes each
    assert {r["case"]["op"] for r in measured if r["kind"] == "elementwise"} == {
        "rmsnorm_fwd", "rmsnorm_bwd", "layernorm_fwd", "layernorm_bwd", "residual_add", "swiglu_fwd", "swiglu_bwd",
        "cross_entropy_fwd", "cross_entropy_bwd"}
    skipped = status[("gemm", "skipped")] + status[("attention", "skipped")]
    assert {r["why"] for r in skipped} == {"FP8 GEMMs (torch._scaled_mm) need CUDA: skipped on CPU",
                                           "cuDNN attention needs CUDA: skipped on CPU"}
    # the BF16 weight gradient: CPU PyTorch has no fp32-output addmm, so the case says it wrote bf16
    assert doc["wgrad_fp32_accumulate"] is False
    assert all(r["case"]["out_bytes"] == 2 for r in measured if r["kind"] == "gemm" and r["case"]["pass_"] == "wgrad")


def _synthetic_report(path, scale: dict) -> dict:
    """A dry-run report whose rows are 'measured' at the model's time with efficiency ``key`` set to ``value``
    (``scale``: {key: value}); the refit must find those values."""
    import dataclasses
    from types import MappingProxyType

    from groundtruth.cases import case_from_dict
    from h3t_ext.costmodel.specs import get_system

    proc = _run("--dry-run", "--budget-s", "100", "--json", str(path))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(path.read_text())
    system = get_system("h100-sxm")
    truth = dataclasses.replace(system, efficiencies=MappingProxyType({**system.efficiencies, **scale}))
    rows = [r for r in doc["rows"] if r["status"] == "planned"]
    for r in rows:
        r["status"], r["measured_s"] = "measured", case_from_dict(r["case"]).predict(truth)
        r["ratio"] = r["measured_s"] / r["predicted_s"]
    doc["rows"], doc["device"] = rows, "synthetic"
    path.write_text(json.dumps(doc))
    return doc


def test_refit_recovers_the_efficiencies_of_a_synthetic_report(tmp_path):
    from groundtruth.refit import refit

    from h3t_ext.costmodel.efficiency_sets import efficiency_set

    # each row inverts one efficiency with the others at their current values (an FP8 tile's prologue and
    # epilogue run at the bf16 rate): the bf16 GEMM rate is checked on its own report
    current = efficiency_set("hopper")["gemm_peak_fraction"]
    truth = {"gemm_fp8_peak_fraction": 0.55, "attention_peak_fraction": 0.52, "hbm_fraction": 0.85,
             "pcie_fraction": 0.7, "gemm_peak_fraction": current,
             "fused_attention_gemm_ratio": 1.1}  # the cuDNN rows: Hopper's fused kernel has its own rate
    summary = refit(_synthetic_report(tmp_path / "a.json", truth))
    assert {s.efficiency for s in summary} == set(truth)
    for s in summary:
        assert s.implied, s
        assert s.median == pytest.approx(truth[s.efficiency], rel=1e-6), s
        assert min(s.implied) == pytest.approx(max(s.implied), rel=1e-6)  # every row agrees
    doc = _synthetic_report(tmp_path / "synthetic.json", {"gemm_peak_fraction": 0.66})
    gemm = next(s for s in refit(doc) if s.group == "gemm bf16" and s.efficiency == "gemm_peak_fraction")
    assert gemm.median == pytest.approx(0.66, rel=1e-6) and min(gemm.implied) == pytest.approx(0.66, rel=1e-6)
    assert gemm.current == current and gemm.origin == "fitted_efficiencies.json 'hopper'"
    # the achieved fraction of the datasheet peak is below the implied efficiency (tile quantization, launch)
    assert 0.3 < gemm.achieved_fraction < 0.66

    proc = _run("--refit", str(tmp_path / "synthetic.json"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "nothing written" in lines[0]
    line = next(x for x in lines if x.startswith("gemm bf16 ") and "gemm_peak_fraction" in x)
    assert " 0.6600 " in line and f" {current:.4f} " in line


@pytest.mark.parametrize("args, message", [
    (["--budget-s", "-5"], "ground_truth.py: error: --budget-s must be > 0 seconds, got -5"),
    (["--device", "cpu"], "ground_truth.py: error: --device cpu needs --smoke (the full shapes would take hours on a "
                          "CPU) or --dry-run"),
    (["--refit", "/nonexistent.json"], "ground_truth.py: error: --refit /nonexistent.json: no such file"),
    (["--repeats", "0"], "ground_truth.py: error: --repeats must be >= 1 and --warmup >= 0, got 0 and 3"),
])
def test_bad_input_is_one_line(args, message):
    proc = _run(*args)
    assert proc.returncode == 2 and proc.stderr.strip() == message


def test_refit_refuses_a_file_that_is_not_a_report(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    proc = _run("--refit", str(bad))
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"ground_truth.py: error: --refit {bad}: field 'schema' must be "
                                   f"'h3t-ground-truth/1' (a report of scripts/gpu/ground_truth.py)")


def test_the_per_kernel_element_wise_rules_add_up_to_the_layer():
    """The element-wise kernels the script measures one by one, priced by costmodel/elementwise.py, are what
    timing.py sums for a layer (no sequence parallel, no dropout, GPT-style: no RoPE)."""
    from h3t_ext.costmodel import elementwise as ew
    from h3t_ext.dtypes import BF16
    from h3t_ext.costmodel.plan import Plan
    from h3t_ext.costmodel.specs import get_model
    from h3t_ext.costmodel.elementwise import layer_elementwise_bytes as _elementwise_bytes

    model = get_model("gpt3-175b")
    model = type(model)(**{**model.__dict__, "hidden_dropout": 0.0, "add_bias_linear": False})
    plan = Plan(num_gpus=1, seq_length=2048, global_batch_size=1)
    h, f, n = model.hidden_size, model.ffn_hidden_size, 2048
    fwd, bwd, _, _ = _elementwise_bytes(model, plan)
    assert fwd == BF16 * n * (2 * ew.NORM_ELEMENTS_FWD * h + 2 * ew.RESIDUAL_ADD_ELEMENTS * h
                              + ew.activation_elements(f, f, backward=False))
    assert bwd == BF16 * n * (2 * ew.NORM_ELEMENTS_BWD * h + 2 * ew.RESIDUAL_ADD_ELEMENTS * h
                              + ew.activation_elements(f, f, backward=True))


def test_linear_passes_are_what_the_layer_prices():
    """timing.layer_gemm_seconds is the sum of kernels.linear_pass_seconds over timing.layer_gemm_shapes (the
    functions the ground truth predicts with), and the passes' GEMMs have the layer's FLOPs."""
    from h3t_ext.costmodel.kernels import LINEAR_PASSES, kernel_rates, linear_pass_gemm, linear_pass_seconds
    from h3t_ext.costmodel.plan import Plan
    from h3t_ext.costmodel.specs import get_model, get_system
    from h3t_ext.costmodel.timing import layer_gemm_seconds, layer_gemm_shapes

    model, r = get_model("llama2-70b"), kernel_rates(get_system("h100-sxm"))
    plan = Plan(num_gpus=4, seq_length=4096, global_batch_size=1, tensor_model_parallel_size=4)
    shapes = layer_gemm_shapes(model, plan)
    assert shapes["qkv"] == (4096, (8192 + 2 * 1024) // 4, 8192) and shapes["fc2"] == (4096, 8192, 28672 // 4)
    g = layer_gemm_seconds(model, plan, r)
    for p in LINEAR_PASSES:
        assert g[p] == pytest.approx(sum(linear_pass_seconds(p, *s, r) for s in shapes.values()), rel=1e-12)
    m, n, k = shapes["fc1"]
    assert {math.prod(linear_pass_gemm(p, m, n, k)) for p in LINEAR_PASSES} == {m * n * k}
    with pytest.raises(ValueError, match="pass must be one of fwd, dgrad, wgrad"):
        linear_pass_gemm("bwd", m, n, k)
