"""cuDNN's fused attention is its own kernel in the cost model: what --attention-backend auto runs on each GPU, its rate
(a measured multiple of the GEMM's) and fixed work per query row, the values stated against the committed H200
report, and the flags that carry it."""
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from h3t_ext.costmodel import Plan, estimate, get_model, get_system
from h3t_ext.costmodel.kernels import (
    ATTENTION_BLOCK_Q,
    FLASH_BACKWARD_FLOP_RATIO,
    attention_kernel,
    flash_attention_seconds,
    kernel_rates,
)
from h3t_ext.costmodel.efficiency_sets import OPTIONAL_EFFICIENCIES, efficiency_set
from h3t_ext.planner.flags import megatron_flags, plan_from_megatron_flags

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "docs" / "gpu-reports" / "2026-11-28-nvidia-h200-ground-truth.json"
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))

from groundtruth.attention_curve import attention_curve, format_curve  # noqa: E402
from groundtruth.cases import AttentionCase, efficiency_key  # noqa: E402


@pytest.mark.parametrize("backend,impl,cc,kernel", [
    ("auto", "transformer_engine", 9.0, "fused"),   # TE prefers cuDNN on Hopper
    ("auto", "transformer_engine", 10.0, "fused"),  # ... and later
    ("auto", "transformer_engine", 8.0, "flash"),   # Ampere: FlashAttention
    ("auto", "local", 9.0, "flash"),                # no TE: the local layers' flash
    ("flash", "transformer_engine", 9.0, "flash"),
    ("fused", "transformer_engine", 8.0, "fused"),
    ("unfused", "transformer_engine", 9.0, "unfused"),
])
def test_auto_is_what_transformer_engine_selects(backend, impl, cc, kernel):
    assert attention_kernel(backend, impl, cc) == kernel


def _blocks_fill_waves(bh: int, s: int, sms: int) -> bool:
    return (bh * (s // ATTENTION_BLOCK_Q)) % sms == 0


def test_fused_rate_and_row_overhead_by_hand():
    system = get_system("h100-sxm")
    e = system.efficiencies
    r = kernel_rates(system)
    d, bh = 128, 33  # 33 heads x s/128 blocks fill whole waves of 132 SMs at 2K and 16K
    peak = system.peak_bf16_flops * e["gemm_peak_fraction"] * e["fused_attention_gemm_ratio"] * d / (
        d + e["attention_head_dim_overhead"])
    k0 = e["fused_attention_row_overhead_keys"]
    for s in (2048, 16384):
        assert _blocks_fill_waves(bh, s, system.num_sms)
        pairs = s * s / 2
        for backward in (False, True):
            rate = peak * (e["attention_backward_rate_fraction"] if backward else 1.0)
            flops = 4 * bh * pairs * d * (FLASH_BACKWARD_FLOP_RATIO if backward else 1.0)
            want = flops * (1 + k0 * s / pairs) / rate + system.kernel_launch_s
            got = flash_attention_seconds(bh, s, s, d, r, causal=True, backward=backward, kernel="fused")
            assert got == pytest.approx(want, rel=1e-12)
    # the row overhead is why a short sequence runs slower per FLOP: 2K against 16K, forward
    short, long_ = ((flash_attention_seconds(bh, s, s, d, r, causal=True, backward=False, kernel="fused")
                     - r.launch_s) / s ** 2 for s in (2048, 16384))
    assert short / long_ == pytest.approx((1 + 2 * k0 / 2048) / (1 + 2 * k0 / 16384), rel=1e-3)
    # and the measured kernel is faster than the fitted FlashAttention rate on Hopper
    flash = flash_attention_seconds(bh, 16384, 16384, d, r, causal=True, backward=False)
    assert flash / flash_attention_seconds(bh, 16384, 16384, d, r, causal=True, backward=False, kernel="fused") > 1.3


def test_a_family_without_the_measurement_prices_fused_as_flash():
    assert not set(OPTIONAL_EFFICIENCIES) & set(efficiency_set("ampere"))
    fused = {k for k in OPTIONAL_EFFICIENCIES if k.startswith("fused_attention")}
    assert fused <= set(efficiency_set("hopper"))
    r = kernel_rates(get_system("a100-80g"))
    for backward in (False, True):
        args = (32, 4096, 4096, 128, r)
        assert flash_attention_seconds(*args, causal=True, backward=backward, kernel="fused") == \
            flash_attention_seconds(*args, causal=True, backward=backward)
    with pytest.raises(ValueError, match="kernel must be one of flash, fused"):
        flash_attention_seconds(1, 128, 128, 64, r, causal=True, backward=False, kernel="cudnn")


def test_stated_values_are_the_committed_reports():
    """fitted_efficiencies.json's hopper values are what scripts/gpu/ground_truth.py --attention-curve derives from
    the committed H200 report (a changed report or a hand-edited value fails here)."""
    rows = json.loads(REPORT.read_text())["rows"]
    curve = attention_curve(rows)
    hopper = efficiency_set("hopper")
    assert curve.row_overhead_keys == hopper["fused_attention_row_overhead_keys"] == 330
    assert curve.gemm_ratio(hopper["attention_head_dim_overhead"]) == pytest.approx(
        hopper["fused_attention_gemm_ratio"], abs=5e-4)
    assert curve.rows == 32 and curve.worst_error < 0.06
    assert 600e12 < curve.rates[("fwd", 128)] < 700e12 and 650e12 < curve.gemm_plateau < 720e12
    text = format_curve(curve, 32, hopper)
    assert "fused_attention_gemm_ratio        1.203   (stated: 1.203)" in text
    # PyTorch's FlashAttention-2 on the same chip is the slower kernel
    assert attention_curve(rows, "flash").rates[("fwd", 128)] < 0.6 * curve.rates[("fwd", 128)]


def test_the_fit_recovers_a_made_curve():
    """Rows made from R and K0 give them back (the fit, not the data, is under test)."""
    rates = {("fwd", 128): 650e12, ("bwd", 128): 560e12, ("fwd", 64): 480e12}
    rows = []
    for (pass_, d), rate in rates.items():
        for s in (2048, 4096, 8192, 16384):
            work = 1e12
            rows.append({"kind": "attention", "status": "measured", "work": work,
                         "measured_s": work / rate * (1 + 250 * 2 / s),
                         "case": {"backend": "cudnn", "pass_": pass_, "seq": s, "head_dim": d}})
    rows.append({"kind": "gemm", "status": "measured", "group": "gemm bf16", "work": 2.0 ** 40,
                 "measured_s": 2.0 ** 40 / 700e12, "case": {"pass_": "fwd"}})
    curve = attention_curve(rows)
    assert curve.row_overhead_keys == 250 and curve.worst_error < 1e-9
    for g, rate in rates.items():
        assert curve.rates[g] == pytest.approx(rate, rel=1e-9)
    assert curve.gemm_ratio(32) == pytest.approx(650 / 700 * 160 / 128, rel=1e-9)
    with pytest.raises(ValueError, match="no measured flash attention forward at head dim 128"):
        attention_curve(rows, "flash")
    with pytest.raises(ValueError, match="no measured bf16 forward GEMM"):
        attention_curve(rows[:-1])


def test_ground_truth_prices_cudnn_rows_as_the_fused_kernel():
    system = get_system("h200")
    cudnn = AttentionCase("cudnn", "fwd", 8192, 128, 32, 32, 2)
    flash = replace(cudnn, backend="flash")
    r = kernel_rates(system)
    assert cudnn.predict(system) == flash_attention_seconds(64, 8192, 8192, 128, r, causal=True, backward=False,
                                                            kernel="fused")
    assert cudnn.predict(system) < flash.predict(system)
    assert efficiency_key(cudnn, system) == "fused_attention_gemm_ratio"
    assert efficiency_key(flash, system) == "attention_peak_fraction"
    assert efficiency_key(cudnn, get_system("a100-80g")) == "attention_peak_fraction"


def test_plan_default_and_flags_round_trip():
    assert Plan(num_gpus=8, tensor_model_parallel_size=8, seq_length=4096, global_batch_size=8).attention_backend \
        == "auto"
    for backend in ("auto", "flash", "fused", "unfused"):
        plan = Plan(num_gpus=8, tensor_model_parallel_size=8, seq_length=4096, global_batch_size=8,
                    attention_backend=backend)
        flags = megatron_flags(plan)
        assert ("--attention-backend" in flags) == (backend != "auto")
        assert plan_from_megatron_flags(flags, num_gpus=8, seq_length=4096).attention_backend == backend


def test_estimate_prices_the_kernel_each_gpu_runs():
    model = get_model("llama2-7b")
    base = dict(num_gpus=8, tensor_model_parallel_size=8, seq_length=16384, global_batch_size=8,
                sequence_parallel=True)
    tps = {(gpu, b): estimate(model, Plan(**base, attention_backend=b), get_system(gpu)).tokens_per_second
           for gpu in ("h100-sxm", "a100-80g") for b in ("auto", "flash", "fused")}
    assert tps["h100-sxm", "auto"] == tps["h100-sxm", "fused"] > 1.05 * tps["h100-sxm", "flash"]
    assert tps["a100-80g", "auto"] == tps["a100-80g", "flash"] == tps["a100-80g", "fused"]


def test_the_estimate_says_which_kernel_it_priced():
    from h3t_ext.planner.format import attention_line

    base = dict(num_gpus=8, tensor_model_parallel_size=8, seq_length=4096, global_batch_size=8)
    h100, a100 = get_system("h100-sxm"), get_system("a100-80g")
    assert attention_line(Plan(**base), h100) == ("cuDNN's fused attention through TransformerEngine "
                                                  "(--attention-backend auto: TransformerEngine's choice on compute "
                                                  "capability 9.0)")
    assert attention_line(Plan(**base), a100).startswith("FlashAttention (--attention-backend auto: ")
    assert attention_line(Plan(**base, transformer_impl="local"), h100) == (
        "FlashAttention (--attention-backend auto: the local layers' FlashAttention)")
    fused_a100 = attention_line(Plan(**base, attention_backend="fused"), a100)
    assert fused_a100.endswith("priced as FlashAttention: no measurement of it for the ampere family")
    assert "priced as" not in attention_line(Plan(**base, attention_backend="fused"), h100)
    assert attention_line(Plan(**base, attention_backend="unfused"), h100).startswith("unfused attention, s^2 scores")
