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


def test_the_slots_the_measured_runtime_kept_are_the_models_two_layers_and_what_the_runs_differ_by(capsys):
    """The alpha-0.5 rows ran with the runtime that kept its two reload slots to the optimizer step: their stored
    slots are two layers of the model's saved bytes (2 A / L, A from the estimate's PCIe bytes), and the
    1.1 B Llama's alpha-0.5 step peaked that much above its ckpt=full step, whose peak is the same optimizer step."""
    from h3t_ext.costmodel.layer_offload import layer_offload

    rows = {r.case: r for r in STEPS.rows}
    kept = [r for r in STEPS.rows if r.reload_slots_gib]
    assert {r.case for r in kept} == {"llama-1b/ours/0.5", "llama-3b/ours/0.5"}
    for row in kept:
        est = run_json([*row.estimate_args, "--gpu", STEPS.gpu], capsys)
        layers = int(row.estimate_args[row.estimate_args.index("--num-layers") + 1])
        lo = layer_offload(0.5, layers)
        chunk = est["pcie_bytes_per_iteration"] / (2 * est["num_microbatches"] * lo.offloaded)
        assert row.reload_slots_gib == pytest.approx(2 * chunk / layers / 2**30, abs=2e-3)
    one = rows["llama-1b/ours/0.5"]
    assert one.peak_gib - rows["llama-1b/full/0"].peak_gib == pytest.approx(one.reload_slots_gib, rel=0.02)


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
