"""scripts/gb200_offload_check.py: the published GB200 Llama-3 70B run with TransformerEngine's layer offload of 40
layers is priced at its budget (the recipe offloads as few layers as fit: 39 would be over), where the model before
the p = 1 embedding moment, Megatron FSDP's bf16 and FP8 buffers and TE 2.9's cross entropy put it 9% over."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gb200_offload_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("gb200_offload_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_published_offload_run_sits_at_its_budget_and_one_layer_less_would_not(capsys):
    assert _script().main(["--json"]) == 0
    out = json.loads(capsys.readouterr().out)["offloaded_layers"]
    forty, thirty_nine = out["40"], out["39"]
    assert abs(forty["te_handler_peak_gib"] / forty["budget_gib"] - 1) < 0.01
    assert thirty_nine["te_handler_peak_gib"] / thirty_nine["budget_gib"] - 1 > 0.02
    # h3t-ext's runtime holds its two reload slots (one layer each) at that peak
    slots = forty["terms_gib"]["offload_reload_buffer"]
    assert forty["h3t_runtime_peak_gib"] - forty["te_handler_peak_gib"] == pytest.approx(slots)
    assert abs(slots - 2 * forty["terms_gib"]["activations"] / 40) < 1e-6
