"""The driver's measured local-stack steps (h3t_ext/data/reference/local_stack_steps.json) stay the model's: each
row's stored estimate is what h3t-plan estimate gives for its arguments today (a model change that moves one must
refresh the file, and the figure estimate prints with it), and estimate names the measured gap for a plan with the
local layers."""
from __future__ import annotations

import pytest

from h3t_ext.costmodel.measured_local_steps import local_stack_steps
from tests.planner_harness import run_json, run_main

STEPS = local_stack_steps()


@pytest.mark.parametrize("row", STEPS.rows, ids=lambda r: r.case)
def test_each_stored_estimate_is_the_current_models(row, capsys):
    est = run_json([*row.estimate_args, "--gpu", STEPS.gpu], capsys)
    assert 1e3 * est["iteration_time_s"] == pytest.approx(row.estimate_ms, rel=2e-3)
    assert est["peak_memory_bytes"] / 2**30 == pytest.approx(row.estimate_gib, rel=2e-3)


def test_the_measured_memory_is_the_models_and_the_time_is_not():
    assert all(abs(r.memory_ratio - 1) < 0.01 for r in STEPS.rows)
    assert all(1.4 < r.time_ratio < 1.9 for r in STEPS.rows)


def test_estimate_names_the_gap_for_the_local_layers_only(capsys):
    args = list(STEPS.rows[0].estimate_args)
    code, out, _ = run_main([*args, "--gpu", STEPS.gpu], capsys)
    assert code == 0
    (line,) = [ln for ln in out.splitlines() if ln.startswith("stack")]
    assert "ran 1.44-1.84x their estimate" in line and "peak memory within 0.4%" in line
    te = [a for a in args if a not in ("--transformer-impl", "local")]
    code, out, _ = run_main([*te, "--gpu", STEPS.gpu], capsys)
    assert code == 0 and not [ln for ln in out.splitlines() if ln.startswith("stack")]
