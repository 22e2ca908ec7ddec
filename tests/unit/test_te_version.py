"""The TransformerEngine version in a plan (``Plan.transformer_engine_version``) and the rule it picks: the fused
cross entropy of TE before 2.18 keeps the logits' gradient in place in the bf16 logits (2 bytes a logit, nothing
beside it); from 2.18, and with no version given, a new fp32 gradient (4 bytes a logit, the bf16 logits beside it
while the forward runs)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from h3t_ext.costmodel import InvalidPlanError, Plan, estimate, get_model, get_system, validate_plan
from h3t_ext.costmodel.activations import output_layer_bytes
from h3t_ext.costmodel.elementwise import cross_entropy_seconds
from h3t_ext.costmodel.kernels import kernel_rates
from h3t_ext.costmodel.te_version import FP32_CROSS_ENTROPY_GRADIENT, cross_entropy_impl, parse_te_version
from h3t_ext.planner.translate import plan_from_args
from tests.planner_harness import run_json, run_main

MODEL, SYSTEM = get_model("llama3-8b"), get_system("h100-sxm")
TE = Plan(num_gpus=8, seq_length=8192, global_batch_size=64, cross_entropy_loss_fusion=True,
          cross_entropy_fusion_impl="te")
LOGITS = 8192 * MODEL.padded_vocab_size(1)


@pytest.mark.parametrize("text,want", [("2.9", (2, 9)), ("2.17.1", (2, 17)), ("2.18.0+a1b2c3d", (2, 18)),
                                       (" 3.0 ", (3, 0)), ("2.10.0.dev0", (2, 10))])
def test_versions_parse_to_major_minor(text, want):
    assert parse_te_version(text) == want


@pytest.mark.parametrize("text", ["x", "2", "two.nine", "2.x", ""])
def test_a_malformed_version_is_refused_naming_the_form(text):
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        parse_te_version(text)
    with pytest.raises(InvalidPlanError, match="transformer_engine_version must look like MAJOR.MINOR"):
        validate_plan(MODEL, replace(TE, transformer_engine_version=text), SYSTEM)


def test_the_version_picks_the_fused_cross_entropy_rule():
    assert FP32_CROSS_ENTROPY_GRADIENT == (2, 18)
    assert cross_entropy_impl(TE) == "te"  # no version: the newest rule
    assert cross_entropy_impl(replace(TE, transformer_engine_version="2.17")) == "te-bf16"
    assert cross_entropy_impl(replace(TE, transformer_engine_version="2.18")) == "te"
    native = replace(TE, cross_entropy_fusion_impl="native", transformer_engine_version="2.9")
    assert cross_entropy_impl(native) == "native"
    assert cross_entropy_impl(replace(native, cross_entropy_loss_fusion=False)) is None


def test_before_2_18_the_logits_hold_their_gradient_and_nothing_lies_beside_them():
    old, new = (replace(TE, transformer_engine_version=v) for v in ("2.9", "2.18"))
    assert output_layer_bytes(MODEL, new)["cross_entropy_softmax"] == LOGITS * 4
    assert output_layer_bytes(MODEL, old)["cross_entropy_softmax"] == LOGITS * 2
    terms = {v: estimate(MODEL, p, SYSTEM).stages[0].terms for v, p in (("old", old), ("new", new))}
    assert terms["new"]["logits_transient"] == LOGITS * 2 and "logits_transient" not in terms["old"]
    peak = {v: estimate(MODEL, p, SYSTEM).peak_memory_bytes for v, p in (("old", old), ("new", new))}
    assert peak["new"] - peak["old"] == LOGITS * 4
    assert estimate(MODEL, TE, SYSTEM).peak_memory_bytes == peak["new"]


def test_before_2_18_its_kernels_move_bf16_only():
    r = kernel_rates(SYSTEM)
    for backward in (False, True):
        old = cross_entropy_seconds(8192, 128256, r, backward=backward, fusion="te-bf16")
        new = cross_entropy_seconds(8192, 128256, r, backward=backward, fusion="te")
        assert old < new


def test_h3t_plan_and_the_translation_take_the_version(capsys):
    flags = ["estimate", "--model", "llama3-8b", "--num-gpus", "8", "--seq-length", "8192", "--global-batch-size",
             "64", "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"]
    newest, old = run_json(flags, capsys), run_json([*flags, "--transformer-engine-version", "2.9"], capsys)
    assert newest["peak_memory_bytes"] - old["peak_memory_bytes"] == LOGITS * 4
    assert "--transformer-engine-version" not in " ".join(old["megatron_flags"])  # not a Megatron flag
    code, _, err = run_main([*flags, "--transformer-engine-version", "2"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "MAJOR.MINOR" in err, err
    plan = plan_from_args({"seq_length": 8192, "global_batch_size": 64, "transformer_engine_version": "2.9"},
                          num_gpus=8)
    assert plan.transformer_engine_version == "2.9"


def test_the_driver_plans_with_the_transformer_engine_it_imports(monkeypatch):
    from h3t_training.config import run_spec

    monkeypatch.setattr(run_spec, "optimizer_impl", lambda: "fused")
    monkeypatch.setattr(run_spec, "transformer_engine_version", lambda: "2.9.0+abc")
    monkeypatch.setattr(run_spec, "uses_transformer_engine", lambda on_gpu, config: on_gpu)
    assert run_spec.stack_fields(None, on_gpu=True) == {"optimizer_impl": "fused",
                                                        "transformer_engine_version": "2.9.0+abc"}
    assert run_spec.stack_fields(None, on_gpu=False) == {}
