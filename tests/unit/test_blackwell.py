"""Blackwell (DGX B200): its system file, the efficiencies it carries over from Hopper's fit, and the published B200
runs held out to check them (Megatron-Bridge 25.09-25.11 and NeMo 25.04's long-sequence table)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from h3t_ext.costmodel import estimate, get_model, get_system, held_out, published_bridge, published_long_sequence
from h3t_ext.costmodel.efficiency_sets import (
    FITTED_EFFICIENCIES_FILE,
    efficiency_set,
    prior_efficiencies,
    transferred_efficiencies,
    transferred_source,
)
from h3t_ext.costmodel.mfu import model_flops_per_token
from h3t_ext.costmodel.published_long_sequence import nemo_llama_flops_per_token
from h3t_ext.costmodel.specs import REFERENCE_DIR
from h3t_ext.costmodel.uncertainty import UNCERTAINTY_FILE, throughput_uncertainty
from h3t_ext.costmodel.validation import transferred_uncertainty
from h3t_ext.planner.cli import main
from h3t_ext.planner.evaluate import evaluate, flash_rate_tokens_per_second
from h3t_ext.planner.format import attention_stack_clause, interval_line
from h3t_ext.planner.translate import plan_from_args
from tests.script_harness import load_script

TRANSFERS = json.loads(FITTED_EFFICIENCIES_FILE.read_text())["transfers"]
BRIDGE = json.loads((REFERENCE_DIR / "megatron_bridge_b200.json").read_text())
LONG = json.loads((REFERENCE_DIR / "nemo_long_sequence_b200.json").read_text())

BRIDGE_ERRORS = {("llama3-8b", "tensorwise", "25.11"): -0.014, ("llama3-8b", "mxfp8", "25.11"): 0.011,
                 ("llama3-405b", "tensorwise", "25.11"): 0.115, ("llama3-405b", "mxfp8", "25.11"): 0.134,
                 ("llama3-8b", "tensorwise", "25.09"): 0.006, ("llama3-8b", "mxfp8", "25.09"): 0.015,
                 ("llama3-405b", "tensorwise", "25.09"): 0.110, ("llama3-405b", "mxfp8", "25.09"): 0.137}
"""Predicted / published tokens/s - 1 of the Bridge B200 rows with the carried-over efficiencies; pinned (the values
were set before these rows were compared, docs/DESIGN.md "Blackwell"), to be updated with a Hopper refit. Since the
cross entropy is priced as these containers' TransformerEngine (before 2.18) ran it, the bf16 gradient in place, their
output layer is lighter than TE 2.18's (the 8B rows +0.7 to +0.8 points, the 405B +0.2); since the B200's HBM is
priced at the 7.67 TB/s its 7,680-bit bus gives, not the DGX sheet's 8 TB/s, 0.2-0.6 points slower. Since MXFP8's
GEMMs run at Blackwell's measured 0.951 of per-tensor FP8's (TransformerEngine's GEMM benchmark, not these rows), the
MXFP8 rows are 2.4-3.7 points slower than when they were priced at the per-tensor rate."""
LONG_ERRORS = {8: 0.027, 16: -0.012, 32: -0.012, 64: -0.047, 128: -0.057, 256: -0.071, 512: -0.089, 1024: -0.084}
"""The same for NeMo's B200 long-sequence rows, per sequence length (K tokens)."""


def test_the_b200_system_file_is_blackwell():
    b200 = get_system("b200")
    assert b200.efficiency_set == "blackwell" and b200.compute_capability == 10.0
    assert (b200.peak_bf16_flops, b200.peak_fp8_flops, b200.num_sms) == (2.25e15, 4.5e15, 148)
    assert b200.hbm_bytes / 2**30 == pytest.approx(178.36, abs=0.01)


def test_blackwell_carries_over_hoppers_fit_scaled_by_the_matmul_ceilings():
    """Each scaled efficiency is Hopper's times the B200's measured matmul ceiling over the H100's (bf16 0.776 /
    0.803, fp8 0.763 / 0.709); HBM is Hopper's; the fused attention is Blackwell's own; Hopper and Ampere carry
    nothing over."""
    hopper, blackwell = efficiency_set("hopper"), efficiency_set("blackwell")
    assert blackwell["gemm_peak_fraction"] == pytest.approx(
        hopper["gemm_peak_fraction"] * (1745 / 2250) / (794.5 / 989))
    assert blackwell["gemm_fp8_peak_fraction"] == pytest.approx(
        hopper["gemm_fp8_peak_fraction"] * (3432.5 / 4500) / (1402.6 / 1979))
    assert blackwell["attention_peak_fraction"] == pytest.approx(
        hopper["attention_peak_fraction"] * (1745 / 2250) / (794.5 / 989))
    assert blackwell["hbm_fraction"] == hopper["hbm_fraction"]
    assert blackwell["gemm_peak_fraction"] < hopper["gemm_peak_fraction"] < blackwell["gemm_fp8_peak_fraction"]
    assert (blackwell["fused_attention_gemm_ratio"], blackwell["fused_attention_row_overhead_keys"]) == (0.965, 330)
    assert transferred_source("blackwell") == "hopper"
    assert transferred_efficiencies("hopper") == transferred_efficiencies("ampere") == {} == {
        k: v for k, v in transferred_efficiencies("blackwell").items() if k not in TRANSFERS["blackwell"]["scaled"]
        and k not in TRANSFERS["blackwell"]["same"]}


def test_a_hopper_refit_moves_blackwell(monkeypatch):
    """The carry-over is computed when the set is read, so it cannot go stale against Hopper's fit."""
    from h3t_ext.costmodel import efficiency_sets

    data = json.loads(FITTED_EFFICIENCIES_FILE.read_text())
    data["efficiencies"]["hopper"]["gemm_peak_fraction"] = 0.7
    monkeypatch.setattr(efficiency_sets, "_fitted", lambda: data)
    assert efficiency_set("blackwell")["gemm_peak_fraction"] == pytest.approx(0.7 * 0.96542, abs=1e-4)


def test_a_fit_on_blackwell_runs_starts_from_the_carried_over_values():
    """prior_efficiencies (what calibrate starts from and keeps where the runs cannot identify) of a carried-over
    family are its carried-over values, not the shared priors'."""
    priors, carried = prior_efficiencies("blackwell"), transferred_efficiencies("blackwell")
    assert {k: priors[k] for k in carried} == carried
    assert priors["gemm_fp8_peak_fraction"] != prior_efficiencies("hopper")["gemm_fp8_peak_fraction"]


def test_the_bridge_copy_agrees_with_the_tables_flops_count():
    """Every row's tokens/s times the one FLOPs formula (mfu.py, causal) is its published TFLOP/s within 0.2%: the copy
    is checked, and the Bridge counts FLOPs as this project does."""
    src = BRIDGE["source"]
    assert src["repository"] == "NVIDIA-NeMo/Megatron-Bridge" and len(src["commit"]) == 40
    assert src["commit"] in src["url"]
    assert len(BRIDGE["rows"]) == 8 and BRIDGE["system"] == "b200"
    for row in BRIDGE["rows"]:
        flops = model_flops_per_token(get_model(row["model"]), row["seq_length"])
        implied = row["tokens_per_s_per_gpu"] * flops / 1e12 / row["model_tflops_per_s_per_gpu"] - 1
        assert implied == pytest.approx(0.0, abs=0.002), (row["label"], implied)


def test_the_library_reads_the_bridge_rows_as_the_one_translation_does():
    skip = ("label", "model", "num_gpus", "tokens_per_s_per_gpu", "model_tflops_per_s_per_gpu", "container",
            "archive_line")
    runs = published_bridge.bridge_runs("b200")
    for run, row in zip(runs, BRIDGE["rows"], strict=True):
        args = {**BRIDGE["plan"], **{k: v for k, v in row.items() if k not in skip}}
        assert run.plan == plan_from_args(args, num_gpus=row["num_gpus"]), row["label"]
        assert run.system_name == "b200" and run.container == row["container"]
    assert {r.system_name for r in published_bridge.bridge_runs()} == {"h100-sxm"}


def test_the_long_sequence_copy_and_its_gpu_count():
    """The layout columns give each row's GPUs (the table's own '# of GPUs' is four times that on every row, kept as
    published_num_gpus); every batch is 4 Mi tokens; where a run without CP fit, CP was not slower; tokens/s come from
    NeMo's own count at the copied commit."""
    assert LONG["source"]["commit"] == "19fadb67b09ba94c55094d34df119d6f9c565068" and LONG["source"]["inconsistent"]
    for row in LONG["rows"]:
        t, p, d, c = (row[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                       "data_parallel_size", "context_parallel_size"))
        assert t * p * d * c == row["num_gpus"] and row["published_num_gpus"] == 4 * row["num_gpus"], row["label"]
        assert row["global_batch_size"] * row["seq_length"] == 4 * 2**20, row["label"]
        without = row["without_cp_model_tflops_per_s_per_gpu"]
        assert without is None or without <= row["model_tflops_per_s_per_gpu"], row["label"]
    runs = published_long_sequence.long_sequence_runs("b200")
    assert [r.without_cp_model_tflops_per_s_per_gpu for r in runs][-1] is None
    run = runs[0]  # 8K: 1,671 TFLOP/s at 57.9 GFLOP per token by NeMo's count
    assert nemo_llama_flops_per_token(run.model, 8192) == pytest.approx(57.91e9, rel=1e-3)
    assert run.tokens_per_s_per_gpu == pytest.approx(1671e12 / 57.91e9, rel=1e-3)


@pytest.mark.parametrize("gpu_rows", ["bridge", "long"])
def test_every_published_b200_run_fits_its_gpu(gpu_rows):
    rows = (held_out.bridge_errors(gpu="b200") if gpu_rows == "bridge"
            else held_out.long_sequence_errors(table="b200"))
    for run, est, _ in rows:
        assert est.fits and est.peak_memory_bytes < 0.9 * est.memory_budget_bytes, (run.label, est.peak_memory_bytes)


def test_the_bridge_b200_rows_against_the_carried_over_model():
    """Held out: Llama-3 8B within 2% either way; Llama-3.1 405B (t4 p8 c2 vp8, 128 GPUs) 11-14% fast, 2-3 points
    more with MXFP8 (its GEMMs at 0.951 of per-tensor FP8's rate, its casts cheaper), which ran 4-6% slower."""
    errors = {(r.model.name, r.plan.fp8_recipe, r.container): e
              for r, _, e in held_out.bridge_errors(gpu="b200")}
    assert errors == pytest.approx(BRIDGE_ERRORS, abs=0.005)
    assert all(abs(e) < 0.02 for (m, _, _), e in errors.items() if m == "llama3-8b")
    assert all(0.10 < e < 0.14 for (m, _, _), e in errors.items() if m == "llama3-405b")


def test_the_long_sequence_b200_rows_against_the_carried_over_model():
    """Held out: within +-3.3% up to 32K tokens, then slow by up to 9% as attention's share grows: the B200's fused
    attention ran faster on NeMo 25.04 than the FlashAttention-4 rate it is priced at (the opposite of the 2024 H100
    stack, which ran slower than the cuDNN rate measured in 2026)."""
    errors = {r.plan.seq_length // 1024: e for r, _, e in held_out.long_sequence_errors(table="b200")}
    assert errors == pytest.approx(LONG_ERRORS, abs=0.005)
    assert all(abs(errors[k]) < 0.035 for k in (8, 16, 32)) and all(errors[k] < -0.04 for k in (64, 256, 512, 1024))


def test_the_stored_blackwell_interval_is_what_the_b200_rows_give_now():
    stored = json.loads(UNCERTAINTY_FILE.read_text())["transferred"]
    assert stored == transferred_uncertainty()
    u = throughput_uncertainty(False, "blackwell")
    assert u.transferred_from == "hopper" and u.held_out_rows == 16
    assert u.relative_half_width == pytest.approx(0.134, abs=0.001)
    assert u.relative_half_width > throughput_uncertainty(False, "hopper").relative_half_width
    assert throughput_uncertainty(False, "hopper") == throughput_uncertainty()


def test_a_b200_estimate_says_whose_efficiencies_it_uses_and_no_2024_stack_clause():
    model, run = get_model("llama3-8b"), published_long_sequence.long_sequence_runs("b200")[4]  # 128K
    b200 = get_system("b200")
    ev = evaluate(model, run.plan, b200, alpha_mode=0.0)
    line = interval_line(ev.estimate)
    assert "+-13.4%" in line and "DGX-B200" in line and "Hopper's fitted efficiencies carried over" in line, line
    assert flash_rate_tokens_per_second(model, ev, b200) is None and attention_stack_clause(ev, model, b200) == ""
    lo, hi = ev.estimate.tokens_per_second_interval
    assert hi / ev.estimate.tokens_per_second - 1 == pytest.approx(0.133728, abs=1e-6)


def test_mxfp8_is_a_b200_plan_and_not_an_h100_one(capsys):
    run = ["estimate", "--model", "llama3-8b", "--num-gpus", "8", "--seq-length", "8192", "--global-batch-size", "128",
           "--micro-batch-size", "2", "--fp8-format", "hybrid", "--fp8-recipe", "mxfp8", "--json"]
    assert main([*run, "--gpu", "b200"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["fp8_recipe"] == "mxfp8" and "tokens_per_second_at_flash_attention_rate" not in out
    assert main([*run, "--gpu", "h100-sxm"]) == 2
    err = capsys.readouterr().err
    assert "mxfp8 needs Blackwell" in err and len(err.strip().splitlines()) == 1


def test_the_search_on_b200_is_priced_with_blackwells_rates(capsys):
    """The same 70B search on B200 and on H100: the B200's plans are priced 2.2-2.6x an H100's per GPU (FP8 GEMMs
    2.45x, bf16 attention 1.8x), and the interval it ties plans within is Blackwell's."""
    args = ["search", "--model", "llama3-70b", "--num-gpus", "64", "--seq-length", "8192",
            "--global-batch-size", "128", "--precision", "fp8", "--top", "3", "--json"]
    assert main([*args, "--gpu", "b200"]) == 0
    b200 = json.loads(capsys.readouterr().out)
    assert main([*args, "--gpu", "h100-sxm"]) == 0
    h100 = json.loads(capsys.readouterr().out)
    best = b200[0]["tokens_per_second_per_gpu"] / h100[0]["tokens_per_second_per_gpu"]
    assert 2.2 < best < 2.6, best
    lo, hi = b200[0]["tokens_per_second_interval"]
    assert hi / (b200[0]["tokens_per_second_per_gpu"] * 64) - 1 == pytest.approx(0.133728, abs=1e-6)


def test_the_fused_ratio_is_blackwells_own_not_hoppers():
    """The B200's attention is priced at its own fused ratio: Hopper's measured one (1.2 against 0.965) would price
    the 1M-token row more than ten points faster."""
    b200 = get_system("b200")
    hopper_ratio = replace(b200, efficiencies={**b200.efficiencies,
                                               "fused_attention_gemm_ratio": efficiency_set("hopper")[
                                                   "fused_attention_gemm_ratio"]})
    own = held_out.long_sequence_errors(table="b200")[-1][2]
    other = held_out.long_sequence_errors(hopper_ratio, table="b200")[-1][2]
    assert other > own + 0.1


def test_the_validation_script_prints_every_b200_row(capsys):
    """scripts/blackwell_validation.py --json: the 16 B200 rows with the errors held_out gives, the carried-over
    values and the interval (the GB200's section: tests/unit/test_gb200.py)."""
    script = load_script("blackwell_validation.py")
    assert script.main(["--json", "--gpu", "b200"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert script.main(["--json"]) == 0  # all: the B200's at the top level, the GB200's and GB300's under their names
    both = json.loads(capsys.readouterr().out)
    assert both["rows"] == out["rows"] and len(both["gb200"]["rows"]) == 27 and len(both["gb300"]["rows"]) == 21
    assert len(out["rows"]) == 16 and out["carried_over_from"] == "hopper" and out["efficiency_set"] == "blackwell"
    assert sorted(r["error"] for r in out["rows"]) == pytest.approx(
        sorted([*BRIDGE_ERRORS.values(), *LONG_ERRORS.values()]), abs=0.005)
    assert out["carried_over"] == transferred_efficiencies("blackwell")
    assert out["relative_half_width"] == pytest.approx(0.133728)


def test_the_b200_runs_set_blackwells_mfu_ceiling_and_the_405b_plan_is_flagged_above_it():
    """The MFU ceilings are taken over every published run, held-out ones included: Blackwell FP8's is the 405B
    recipe's 74.5%, and that recipe priced at 82% MFU is flagged; Hopper's and Ampere's ceilings are the fitted
    sources' as before (the held-out H100 rows are all below them)."""
    from h3t_ext.costmodel.plausibility import published_mfu_ceilings

    ceilings = published_mfu_ceilings()
    c = ceilings[("blackwell", "fp8")]
    assert c.source == "megatron_bridge_b200" and c.mfu == pytest.approx(0.745, abs=0.001) and c.gpu == "b200"
    assert {k: v.source for k, v in ceilings.items() if "blackwell" not in k[0]} == {
        ("hopper", "bf16"): "atc24_65b", ("ampere", "bf16"): "atc24_demo7b", ("hopper", "fp8"): "nemo_fp8_h100"}
    run, est, _ = held_out.bridge_errors(gpu="b200")[2]  # the 405B, FP8-CS, 25.11
    assert est.plausibility.above_ceiling and est.mfu == pytest.approx(0.82, abs=0.01)
    small = held_out.bridge_errors(gpu="b200")[0][1]  # the 8B: within the range
    assert not small.plausibility.above_ceiling


def test_one_b200_run_moves_a_calibration_further_than_one_hopper_run():
    """The calibration prior of a carried-over family is the spread of its own held-out runs (two B200 sources: across
    them 5.1%, within one 5.4%), so one measured B200 run keeps 47% of its fit where one Hopper run keeps 38%."""
    from h3t_ext.costmodel.fit import MeasuredRun
    from h3t_ext.costmodel.pooling import calibration_prior
    from h3t_ext.planner.calibrate import calibrate

    b200, hopper = calibration_prior("blackwell"), calibration_prior("hopper")
    assert hopper == calibration_prior() and b200.sources == 2 and b200.rows == 16
    assert b200.weight(1) == pytest.approx(0.471, abs=0.001) and hopper.weight(1) == pytest.approx(0.375, abs=0.001)
    run = published_bridge.bridge_runs("b200")[0]
    cal = calibrate(get_system("b200"), {"efficiency_set": "blackwell"},
                    [MeasuredRun(run.model, run.plan, run.tokens_per_s_per_gpu, run.label)])
    assert cal.weight == pytest.approx(b200.weight(1)) and "its GPU family's held-out" in cal.weight_from


def test_per_tensor_fp8_on_blackwell_keeps_no_transpose():
    """TransformerEngine on compute capability 10.x: a per-tensor-scaled FP8 tensor is one buffer both GEMM directions
    read, so the casts write one FP8 copy, not two, and no FP8 weight transpose is cached (none at all with
    --fp8-param-gather); MXFP8 (block scales per direction) keeps both; Hopper keeps both for every recipe."""
    from h3t_ext.costmodel import fp8
    from h3t_ext.costmodel.kernels import any_layout_fp8_gemm, kernel_rates

    assert [any_layout_fp8_gemm(c) for c in (9.0, 10.0, 10.3, 12.0, 13.0)] == [False, True, True, False, True]
    assert kernel_rates(get_system("b200")).fp8_any_layout and not kernel_rates(get_system("h100-sxm")).fp8_any_layout
    assert [fp8.fp8_copies(r, True) for r in ("delayed", "tensorwise", "blockwise", "mxfp8")] == [1, 1, 2, 2]
    assert fp8.cast_bytes_per_element("delayed", 1) == fp8.cast_bytes_per_element("delayed") - 1
    model = get_model("llama3-8b")
    cs, mx = (published_bridge.bridge_runs("b200")[i].plan for i in (0, 1))  # 8B, --fp8-param-gather
    layers, w = model.num_layers, fp8.gemm_weight_params(model, cs, model.num_layers)
    b200, h100 = get_system("b200"), get_system("h100-sxm")
    assert fp8.weight_cache_bytes(model, cs, layers, b200) == 0
    assert fp8.weight_cache_bytes(model, cs, layers, h100) == fp8.weight_cache_bytes(model, cs, layers) == w
    assert fp8.weight_cache_bytes(model, mx, layers, b200) == w
    no_gather = replace(cs, fp8_param_gather=False)
    assert fp8.weight_cache_bytes(model, no_gather, layers, b200) == w
    assert fp8.weight_cache_bytes(model, no_gather, layers, h100) == 2 * w
    est = estimate(model, cs, b200)
    assert est.stages[0].terms["fp8_weight_cache"] == 0
    assert estimate(model, mx, b200).stages[0].terms["fp8_weight_cache"] == w
    hopper_priced = estimate(model, cs, replace(b200, compute_capability=9.0))
    assert hopper_priced.stages[0].terms["fp8_weight_cache"] == w
    assert est.tokens_per_second > hopper_priced.tokens_per_second * 1.005  # the casts write one copy, not two


def test_at_the_other_public_attention_figure_the_long_rows_are_flat_in_attention_share():
    """Recorded, not adopted: with the fused ratio PR #2280's FlashAttention-4 figure gives (1.10), the B200
    long-sequence errors no longer follow attention's share (8K to 1M within four points of each other, +3.0% to
    +6.6%), where the adopted 0.965 spans twelve points (+2.7% to -8.9%)."""
    b200 = get_system("b200")
    faster = replace(b200, efficiencies={**b200.efficiencies, "fused_attention_gemm_ratio": 1.10})
    errors = [e for _, _, e in held_out.long_sequence_errors(faster, table="b200")]
    adopted = [e for _, _, e in held_out.long_sequence_errors(table="b200")]
    assert max(errors) - min(errors) < 0.04 and all(0.025 < e < 0.075 for e in errors)
    assert max(adopted) - min(adopted) > 0.11


def test_mxfp8_gemms_run_at_the_measured_fraction_of_the_per_tensor_rate():
    """Blackwell's block-scaled GEMMs at 0.951 of per-tensor FP8's (TransformerEngine's GEMM benchmark, kernels
    alone); the per-tensor recipes and BF16 keep the rate, and a family without the measurement too."""
    from h3t_ext.costmodel.kernels import kernel_rates, recipe_rates

    b200 = get_system("b200")
    r = kernel_rates(b200)
    assert recipe_rates(r, b200, "mxfp8").fp8_sm_flops == pytest.approx(0.951 * r.fp8_sm_flops)
    assert recipe_rates(r, b200, "mxfp8").sm_flops == r.sm_flops
    assert recipe_rates(r, b200, "tensorwise") is r and recipe_rates(r, b200, None) is r
    h100 = get_system("h100-sxm")
    assert recipe_rates(kernel_rates(h100), h100, "mxfp8") is kernel_rates(h100)
    # the 8B MXFP8 row: its step is slower than at the per-tensor GEMM rate by less than the GEMMs' 1 / 0.951
    run, est, _ = next(x for x in held_out.bridge_errors(gpu="b200") if x[0].plan.fp8_recipe == "mxfp8")
    at_per_tensor = estimate(run.model, run.plan, replace(b200, efficiencies={
        k: v for k, v in b200.efficiencies.items() if k != "mxfp8_gemm_rate_fraction"}))
    slowdown = at_per_tensor.tokens_per_second_per_gpu / est.tokens_per_second_per_gpu
    assert 1.02 < slowdown < 1 / 0.951
