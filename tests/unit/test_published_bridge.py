"""Megatron-Bridge's published dense H100 runs (h3t_ext/data/reference/megatron_bridge_h100.json), held out from every
fit: runs that ran are predicted to fit their GPU, through the one flags-to-Plan translation. The Llama-3 70B run was
predicted over its budget (76.4 GiB against 72.0) while the memory model counted the SwiGLU output twice on the
TransformerEngine spec (docs/DESIGN.md, "Memory model")."""
from __future__ import annotations

import json

import pytest

from h3t_ext.costmodel import estimate, get_model, get_system
from h3t_ext.costmodel.specs import DATA_DIR
from h3t_ext.planner.translate import plan_from_args

DATA = json.loads((DATA_DIR / "reference" / "megatron_bridge_h100.json").read_text())
_NOT_FLAGS = ("label", "model", "num_gpus", "tokens_per_s_per_gpu", "model_tflops_per_s_per_gpu")


def _estimate(row: dict):
    args = {**DATA["plan"], **{k: v for k, v in row.items() if k not in _NOT_FLAGS}}
    return estimate(get_model(row["model"]), plan_from_args(args, num_gpus=row["num_gpus"]), get_system("h100-sxm"))


def test_the_copy_names_its_source():
    src = DATA["source"]
    assert src["repository"] == "NVIDIA-NeMo/Megatron-Bridge" and len(src["commit"]) == 40
    assert src["commit"] in src["url"] and src["assumed"] and src["not_stated"]


@pytest.mark.parametrize("row", DATA["rows"], ids=[r["label"] for r in DATA["rows"]])
def test_every_published_run_fits_its_gpu(row):
    est = _estimate(row)
    assert est.fits, (row["label"], est.peak_memory_bytes / 2**30, est.memory_budget_bytes / 2**30)
    assert est.peak_memory_bytes < 0.95 * est.memory_budget_bytes  # 66 GiB and 58 GiB of 72 GiB


def test_the_405b_run_is_priced_within_five_percent():
    """The 405B row (t8 p8 c2, 2 layers a chunk) is priced 1.4% fast; the 70B row (t4 p8 vp5) 12% slow, which the
    last stage's output layer (two FP8 layers' time on top of its ten) explains only if the published run's layers
    are faster than this model's: a gap left open (docs/DESIGN.md, "Reference numbers")."""
    row = next(r for r in DATA["rows"] if r["model"] == "llama3-405b")
    assert _estimate(row).tokens_per_second_per_gpu / row["tokens_per_s_per_gpu"] - 1 == pytest.approx(0.0, abs=0.05)
