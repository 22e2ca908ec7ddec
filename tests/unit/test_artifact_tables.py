"""The ATC '24 artifact's tables as plans (h3t_ext/costmodel/artifact.py): every published entry is copied once
with its source and read, and each row says whether a fit used it. The predictions against them are
tests/integration/test_artifact_predictions.py (the calibration against published runs is integration-tier)."""
import json

import pytest

from h3t_ext.costmodel.artifact import (USE_ALPHA_BUDGET, USE_EFFICIENCY_FIT, USE_MEMORY_MODEL, demo7b_rows,
                                        figure7_points, figure9_rows, table8_rows)
from h3t_ext.costmodel.published import published_runs
from h3t_ext.costmodel.specs import DATA_DIR

REF = DATA_DIR / "reference"


def _load(name: str) -> dict:
    with open(REF / name, encoding="utf-8") as f:
        return json.load(f)


def test_copies_state_their_source_and_hold_every_published_entry():
    cal, mem, fig9 = _load("atc24_calibration.json"), _load("atc24_memory.json"), _load("atc24_fig9_70b_175b.json")
    for ref in (cal, mem, fig9):
        assert "source" in ref and "USENIX ATC '24" in ref["source"]
    assert "stated" in fig9 and "not_stated" in fig9
    assert {r["model"] for r in cal["throughput_table"]} == {"Llama-65B"}
    assert {r["model"] for r in fig9["rows"]} == {"Llama2-70B", "Llama-175B"}  # no row copied twice
    assert len(cal["throughput_table"]) + len(fig9["rows"]) == 41
    fig7 = mem["fig7_memory_vs_alpha"]
    assert len(fig7["ours"]) + len(fig7["no"]) == 22 and len(mem["table8"]["rows"]) == 4 and len(cal["demo7b"]) == 6


def test_every_copied_row_and_point_is_read():
    cal, mem, fig9 = _load("atc24_calibration.json"), _load("atc24_memory.json"), _load("atc24_fig9_70b_175b.json")
    rows = figure9_rows()
    assert len(rows) == len(cal["throughput_table"]) + len(fig9["rows"])
    for row, pub in zip(rows, cal["throughput_table"] + fig9["rows"]):
        assert row.published_tokens_per_s_per_gpu * row.plan.num_gpus == pytest.approx(float(pub["tokens_per_s"]))
        assert row.published_alpha == float(pub["alpha"]) and row.plan.offload_alpha == float(pub["alpha"])
        assert row.model.name == pub["model"].lower() and row.plan.seq_length == int(pub["seq_length"])
    assert len(table8_rows()) == len(mem["table8"]["rows"])
    assert len(demo7b_rows()) == len(cal["demo7b"])
    points = figure7_points()
    fig7 = mem["fig7_memory_vs_alpha"]
    assert len(points) == len(fig7["ours"]) + len(fig7["no"])
    assert sorted(p.published_bytes or 0 for p in points) == sorted(v or 0 for ck in ("ours", "no")
                                                                   for v in fig7[ck].values())


def test_fitted_rows_are_exactly_the_calibration_runs():
    """The rows marked as used by the efficiency fit are the ATC '24 runs of published_runs() (the 15 Llama-65B
    rows, the 4 demo rows of this runtime); Llama2-70B, Llama-175B, Table 8 and stock Megatron are held out."""
    atc = published_runs("atc24_65b") + published_runs("atc24_demo7b")
    rows = figure9_rows() + table8_rows() + demo7b_rows()
    used = [r for r in rows if USE_EFFICIENCY_FIT in r.used_for]
    assert len(used) == len(atc) == 19
    assert [r for r in rows if USE_ALPHA_BUDGET in r.used_for] == [r for r in rows if r.model.name == "llama-65b"]
    assert all(r.held_out for r in rows if r.model.name in ("llama2-70b", "llama-175b"))
    assert all(r.held_out for r in rows if r.published_alpha is None)  # origin-megatron: same plan as baseline
    assert sum(r.held_out for r in rows) == 26 + 4 + 2
    points = figure7_points()
    assert sum(USE_MEMORY_MODEL in p.used_for for p in points) == 4 and sum(p.held_out for p in points) == 18
