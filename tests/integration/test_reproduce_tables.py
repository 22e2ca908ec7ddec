"""scripts/reproduce_tables.py: every published row is reported next to its prediction, plots are written."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "reproduce_tables.py")
REFERENCE = os.path.join(REPO, "h3t_ext", "data", "reference", "atc24_calibration.json")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("reproduce")
    md = out_dir / "report.md"
    proc = subprocess.run([sys.executable, SCRIPT, "--json", "--out", str(md), "--plot-dir", str(out_dir / "plots")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with open(REFERENCE, encoding="utf-8") as f:
        ref = json.load(f)
    return json.loads(proc.stdout), md.read_text(encoding="utf-8"), ref


def test_every_published_row_is_reported(run):
    data, _, ref = run
    thr = data["throughput_table"]
    assert len(thr) == len(ref["throughput_table"]) == 15
    for row, pub in zip(thr, ref["throughput_table"]):
        assert row["num_gpus"] == int(pub["num_gpus"]) and row["ckpt"] == pub["ckpt"]
        assert row["published_tokens_per_second"] == float(pub["tokens_per_s"])
        assert row["published_alpha"] == float(pub["alpha"])
        assert row["error"] == pytest.approx(row["predicted_tokens_per_second"] / row["published_tokens_per_second"] - 1)
        assert 0.0 <= row["predicted_alpha"] <= 1.0
    assert len(data["demo7b"]) == len(ref["demo7b"])
    for row, pub in zip(data["demo7b"], ref["demo7b"]):
        assert row["published_tokens_per_second_per_gpu"] == pub["tokens_per_s_per_gpu"]
        assert row["published_mfu"] == pub["mfu"]


def test_memory_points_and_lines(run):
    data, _, ref = run
    pts = data["memory_vs_alpha"]
    assert len(pts) == len(ref["memory_vs_alpha"]["points"])
    lines = data["memory_lines"]
    for ckpt in ("no", "ours"):
        assert len(lines[ckpt]) == len(lines["alpha"])
        assert lines[ckpt][0] > lines[ckpt][-1]  # offloading everything lowers the peak
    assert all(n > o for n, o in zip(lines["no"], lines["ours"]))  # ckpt=ours keeps less than ckpt=no
    for p in pts:
        if p["published_bytes"] is not None:
            assert p["error"] == pytest.approx(p["predicted_bytes"] / p["published_bytes"] - 1)


def test_markdown_and_plots(run):
    data, md, _ = run
    assert md.count("| ours |") + md.count("| no |") >= 15
    assert "tokens/s pub" in md and "alpha pred" in md and "Memory versus alpha" in md
    assert len(data["plots"]) == 2
    for path in data["plots"]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
