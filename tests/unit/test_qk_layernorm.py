"""Megatron's --qk-layernorm (a norm over each head's q and k after the QKV projection) in the cost model: its
weights (checked against the model megatron-core builds from the same config), its saved input and statistics, its
element-wise traffic, and h3t-plan's flags (with --squared-relu, priced as the GeLU MLP)."""
from __future__ import annotations

import dataclasses

import pytest

from h3t_ext.costmodel import ModelSpec, Plan, get_system
from h3t_ext.costmodel.activations import activation_bytes_per_layer_token
from h3t_ext.costmodel.elementwise import NORM_ELEMENTS_BWD, NORM_ELEMENTS_FWD
from h3t_ext.costmodel.elementwise import layer_elementwise_bytes as _elementwise_bytes
from h3t_ext.costmodel.timing import layer_time
from h3t_ext.dtypes import BF16, FP32
from tests.activation_harness import FFN, GROUPS, HEADS, HIDDEN, VOCAB, init_single_process_megatron
from tests.planner_harness import run_json, run_main


def _spec(**kw) -> ModelSpec:
    return ModelSpec("tiny", 2, HIDDEN, HEADS, GROUPS, FFN, VOCAB, **kw)


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_parameters_are_those_megatron_core_builds(normalization):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from h3t_ext.runtime.modules.gpt import build_gpt_model, tiny_llama_config
    init_single_process_megatron()
    cfg = tiny_llama_config(num_layers=2, qk_layernorm=True, normalization=normalization)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization=normalization)
    model = build_gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=64, ckpt="no", layer_spec=spec,
                            device_type="cpu")
    ours = _spec(qk_layernorm=True, normalization=normalization)
    assert sum(p.numel() for p in model.parameters()) == ours.num_parameters
    per_norm = (2 if normalization == "LayerNorm" else 1) * (HIDDEN // HEADS)
    assert ours.num_parameters - _spec(normalization=normalization).num_parameters == 2 * 2 * per_norm


@pytest.mark.parametrize("ckpt", ["no", "ours", "full"])
def test_saved_bytes_are_the_projection_output_and_the_statistics(ckpt):
    m = _spec(qk_layernorm=True)
    with_norm = activation_bytes_per_layer_token(m, ckpt)
    without = activation_bytes_per_layer_token(_spec(), ckpt)
    extra = (m.query_hidden_size + m.kv_hidden_size) * BF16 + (HEADS + GROUPS) * FP32
    # ckpt=ours keeps it (a GEMM output and statistics); full recompute keeps only the layer input
    assert with_norm["total"] - without["total"] == (0 if ckpt == "full" else extra)
    # the local spec's k norm keeps a view of the whole projection output, and q's reshape is a copy
    local = activation_bytes_per_layer_token(m, ckpt, layer_spec="local")
    extra_local = (2 * m.query_hidden_size + 2 * m.kv_hidden_size) * BF16 + (HEADS + GROUPS) * FP32
    assert local["total"] - activation_bytes_per_layer_token(_spec(), ckpt, layer_spec="local")["total"] == \
        (0 if ckpt == "full" else extra_local)


def test_elementwise_traffic_is_two_norms_over_q_and_k_and_nothing_recomputed():
    plan = Plan(num_gpus=2, tensor_model_parallel_size=2, micro_batch_size=2, seq_length=64, global_batch_size=2,
                ckpt="ours")
    m = _spec(qk_layernorm=True)
    fwd, bwd, ours, masks = _elementwise_bytes(m, plan)
    fwd0, bwd0, ours0, masks0 = _elementwise_bytes(_spec(), plan)
    qk = (m.query_hidden_size + m.kv_hidden_size) * 2 * 64 // 2  # the rank's channels of every token
    assert (fwd - fwd0, bwd - bwd0) == (BF16 * NORM_ELEMENTS_FWD * qk, BF16 * NORM_ELEMENTS_BWD * qk)
    assert (ours, masks) == (ours0, masks0)
    h800 = get_system("h800")
    slower = layer_time(m, plan, h800)
    plain = layer_time(_spec(), plan, h800)
    assert slower.fwd > plain.fwd and slower.bwd > plain.bwd and slower.recompute == plain.recompute


BASE = ["estimate", "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8", "--ffn-hidden-size",
        "4096", "--vocab-size", "32000", "--seq-length", "2048", "--num-gpus", "1", "--global-batch-size", "4"]


def test_h3t_plan_prices_the_flags(capsys):
    base = run_json(BASE, capsys)
    qk = run_json([*BASE, "--qk-layernorm"], capsys)
    assert qk["peak_memory_bytes"] > base["peak_memory_bytes"] and qk["tokens_per_second"] < base["tokens_per_second"]
    relu = run_json([*BASE, "--squared-relu"], capsys)
    assert relu == run_json([*BASE, "--no-swiglu"], capsys)
    code, _, err = run_main([*BASE, "--swiglu", "--squared-relu"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--squared-relu" in err


def test_the_field_is_a_model_field():
    m = dataclasses.replace(_spec(), qk_layernorm=True)
    assert m.layer_norm_params == 2 * HIDDEN + 2 * (HIDDEN // HEADS)
