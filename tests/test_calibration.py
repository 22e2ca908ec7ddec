"""The cost model against the published reference numbers (pure arithmetic; thresholds from the brief)."""
import pytest

from h3t_ext.costmodel import Plan, estimate, get_system, mfu, solve_offload_alpha, stage_memory
from h3t_ext.costmodel.calibration import calibration_report, memory_points, reference, reference_model, throughput_rows


@pytest.fixture(scope="module")
def report():
    return calibration_report()


def test_reference_copy_has_source():
    ref = reference()
    assert "source" in ref and len(ref["throughput_table"]) == 15


def test_alpha_of_every_row_with_one_budget(report):
    assert len(report.alpha_errors) == 15
    assert report.alpha_max_error <= 0.01
    # the model is good enough that the published alpha is reproduced to its last digit +-1
    assert report.alpha_max_error <= 0.0015


def test_zero_alpha_rows_fit_without_offload():
    m65, h800 = reference_model("llama-65b"), get_system("h800")
    for row in throughput_rows():
        if row.published_alpha == 0:
            assert estimate(m65, row.plan.with_alpha(0.0), h800).fits


def test_memory_points_within_two_percent(report):
    assert len(report.memory_errors) == 3
    assert all(abs(e) <= 0.02 for e in report.memory_errors), report.memory_errors


def test_out_of_memory_point_does_not_fit(report):
    assert report.oom_predicted == (True,)


def test_memory_slope_matches_measured():
    """Peak memory is linear in alpha with the measured slope (ckpt=ours, alpha 0 -> 1)."""
    m65 = reference_model("llama-65b")
    plans = {pt[0].offload_alpha: pt for pt in memory_points() if pt[0].ckpt == "ours"}
    (p0, b0), (p1, b1) = plans[0.0], plans[1.0]
    slope_meas = b0 - b1
    slope_model = stage_memory(m65, p0, 0, 0.0).peak_bytes - stage_memory(m65, p1, 0, 1.0).peak_bytes
    assert abs(slope_model / slope_meas - 1) < 0.005


def test_tokens_per_second_mae_within_five_percent(report):
    assert len(report.tokens_errors) == 15
    assert report.tokens_mae <= 0.05
    assert max(abs(e) for e in report.tokens_errors) <= 0.10


def test_demo7b_mfu_exact(report):
    for computed, published in report.demo_mfu:
        assert round(computed, 3) == pytest.approx(published, abs=1e-9)


def test_demo7b_h800_carries_within_ten_percent():
    """Not fitted on: the H800 7B demo rows (t=1, seq 12288) from the 65B fit."""
    m7, h800 = reference_model("llama-7b"), get_system("h800")
    for r in reference()["demo7b"]:
        if r["gpu"] != "h800" or r["method"] == "origin-megatron":
            continue
        plan = Plan(num_gpus=4, seq_length=12288, global_batch_size=16, pipeline_model_parallel_size=4,
                    num_layers_per_virtual_pipeline_stage=1, ckpt=r["ckpt"], offload_alpha=r["alpha"])
        est = estimate(m7, plan, h800)
        assert abs(est.tokens_per_second_per_gpu / r["tokens_per_s_per_gpu"] - 1) < 0.10
        assert est.mfu == pytest.approx(mfu(m7, 12288, est.tokens_per_second_per_gpu, h800.peak_bf16_flops))


def test_solver_alpha_rounds_up():
    """The solved alpha fits; one step (0.001) less does not."""
    m65, h800 = reference_model("llama-65b"), get_system("h800")
    for row in throughput_rows():
        a = solve_offload_alpha(m65, row.plan, h800)
        assert estimate(m65, row.plan.with_alpha(a), h800).fits
        if a > 0:
            assert not estimate(m65, row.plan.with_alpha(round(a - 0.001, 3)), h800).fits
