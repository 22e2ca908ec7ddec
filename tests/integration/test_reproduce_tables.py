"""scripts/reproduce_tables.py as a user runs it: every published row and point of the ATC '24 artifact in the
JSON and the markdown next to its prediction, one PNG per table and figure, the plotted data as CSV, and CSV only
(with a note) when matplotlib cannot be imported."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "reproduce_tables.py")
REF = os.path.join(REPO, "h3t_ext", "data", "reference")
STEMS = ("figure9", "table8", "demo7b", "figure7")


def _ref(name: str) -> dict:
    with open(os.path.join(REF, name), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("reproduce")
    md = out_dir / "report.md"
    proc = subprocess.run([sys.executable, SCRIPT, "--json", "--out", str(md), "--plot", str(out_dir / "plots")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), md.read_text(encoding="utf-8"), out_dir / "plots"


def test_every_published_row_is_reported(run):
    data, _, _ = run
    cal, mem, fig9 = _ref("atc24_calibration.json"), _ref("atc24_memory.json"), _ref("atc24_fig9_70b_175b.json")
    published = cal["throughput_table"] + fig9["rows"]
    rows = data["tables"]["Figure 9"]
    assert len(rows) == len(published) == 41
    for row, pub in zip(rows, published):
        assert row["model"] == pub["model"].lower() and row["num_gpus"] == int(pub["num_gpus"])
        assert row["published_tokens_per_s"] == pytest.approx(float(pub["tokens_per_s"]))
        assert row["published_alpha"] == float(pub["alpha"]) and 0.0 <= row["predicted_alpha"] <= 1.0
        assert row["error"] == pytest.approx(row["predicted_tokens_per_s"] / row["published_tokens_per_s"] - 1)
        assert row["held_out"] == (row["model"] != "llama-65b")
    for table, pubs in (("Table 8", mem["table8"]["rows"]), ("7B demo", cal["demo7b"])):
        assert [(r["published_tokens_per_s_per_gpu"], r["published_alpha"]) for r in data["tables"][table]] == \
            [(p["tokens_per_s_per_gpu"], p["alpha"]) for p in pubs]
    fig7 = mem["fig7_memory_vs_alpha"]
    assert [(p["ckpt"], p["alpha"], p["published_bytes"]) for p in data["figure7"]] == \
        [(ck, float(a), b) for ck in ("ours", "no") for a, b in fig7[ck].items()]


def test_out_of_memory_entries_and_error_summaries(run):
    data, _, _ = run
    oom = [r for t in data["tables"].values() for r in t if r["published_out_of_memory"]] + \
        [p for p in data["figure7"] if p["published_out_of_memory"]]
    assert len(oom) == 4 and not any(r["predicted_fits"] for r in oom)
    assert data["wrong_memory_verdicts"] == []
    groups = {s["group"]: s for s in data["tokens_per_s_error"]}
    for g in ("Figure 9", "Figure 9 / llama-65b", "Figure 9 / llama2-70b", "Figure 9 / llama-175b",
              "Figure 9 / calibration rows", "Figure 9 / held out", "Table 8", "7B demo"):
        assert groups[g]["count"] > 0 and groups[g]["mean_abs"] is not None
    assert groups["Figure 9 / held out"]["count"] == 26


def test_markdown_lists_every_row(run):
    data, md, _ = run
    assert md.count("| held out |") == 26 + 4 + 2 + 18  # Figure 9, Table 8, demo, Figure 7
    assert md.count("| efficiency fit, alpha budget |") == 15 and md.count("| efficiency fit |") == 4
    assert "OOM (right)" in md and "Out-of-memory verdicts wrong: none" in md


def test_one_png_per_table_and_figure_and_the_data_as_csv(run):
    data, _, plot_dir = run
    assert [os.path.basename(p) for p in data["plots"]] == [f"{s}.png" for s in STEMS] and data["plot_note"] is None
    for path in data["plots"]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(plot_dir / "figure9.csv", encoding="utf-8") as f:
        assert len(list(csv.DictReader(f))) == 41
    with open(plot_dir / "figure7_model_lines.csv", encoding="utf-8") as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == 51 and float(lines[0]["ckpt_no_bytes"]) > float(lines[-1]["ckpt_no_bytes"])


def test_without_matplotlib_the_plots_are_csv(tmp_path):
    """A matplotlib that cannot be imported (a stub package first on the path): no PNG, the CSVs and a note."""
    stub = tmp_path / "stub" / "matplotlib"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "stub")}
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / "r.md"), "--plot", str(tmp_path / "p")],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "matplotlib is not importable" in proc.stderr
    assert sorted(os.listdir(tmp_path / "p")) == sorted([f"{s}.csv" for s in STEMS] + ["figure7_model_lines.csv"])
