"""Megatron's --kv-channels: a head dimension d with heads x d != h (Qwen3, Gemma). Queries and the attention's
output are heads x d wide, keys and values groups x d; every cost-model term that reads a width takes that one.
Checked against the model megatron-core builds from the same config (its parameters), and by construction on the
GEMM shapes, the FLOPs formula and h3t-plan's flags."""
from __future__ import annotations

import dataclasses

import pytest

from h3t_ext.costmodel import ModelSpec, Plan
from h3t_ext.costmodel.mfu import model_flops_per_token
from h3t_ext.costmodel.timing import layer_gemm_shapes
from h3t_ext.runtime.modules.gpt import build_gpt_model, tiny_llama_config
from tests.activation_harness import FFN, GROUPS, HEADS, HIDDEN, VOCAB, init_single_process_megatron
from tests.planner_harness import run_json, run_main

D = 24  # heads x d = 96, not the hidden size 64


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    init_single_process_megatron()


def _spec(layers: int = 2, **kw) -> ModelSpec:
    return ModelSpec("tiny", layers, HIDDEN, HEADS, GROUPS, FFN, VOCAB, kv_channels=D, **kw)


@pytest.mark.parametrize("bias", [False, True])
def test_parameters_are_those_megatron_core_builds(bias):
    cfg = tiny_llama_config(num_layers=2, kv_channels=D, add_bias_linear=bias)
    model = build_gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=64, ckpt="ours", device_type="cpu")
    assert sum(p.numel() for p in model.parameters()) == _spec(add_bias_linear=bias).num_parameters
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert tuple(qkv.shape) == (HEADS * D + 2 * GROUPS * D, HIDDEN)


def test_widths_follow_the_head_dimension():
    m = _spec()
    assert (m.head_dim, m.query_hidden_size, m.kv_hidden_size) == (D, HEADS * D, GROUPS * D)
    default = dataclasses.replace(m, kv_channels=None)
    assert (default.head_dim, default.query_hidden_size) == (HIDDEN // HEADS, HIDDEN)
    plan = Plan(num_gpus=2, seq_length=128, global_batch_size=4, micro_batch_size=2, tensor_model_parallel_size=2)
    shapes = layer_gemm_shapes(m, plan)
    assert shapes["qkv"] == (256, (HEADS * D + 2 * GROUPS * D) // 2, HIDDEN)
    assert shapes["proj"] == (256, HIDDEN, HEADS * D // 2)
    q = HEADS * D
    per_layer = 2 * HIDDEN * q + 2 * HIDDEN * GROUPS * D + 3 * HIDDEN * FFN
    assert model_flops_per_token(m, 128) == 3.0 * (2 * 2 * per_layer + 2 * 128 * q * 2 + 2 * VOCAB * HIDDEN)


def test_a_zoo_models_head_dimension_follows_a_new_hidden_size():
    base = ModelSpec("m", 2, 4096, 32, 8, 11008, 32000)
    assert dataclasses.replace(base, hidden_size=2048).head_dim == 64  # not kept at 128


def test_h3t_plan_takes_kv_channels_and_refuses_a_shape_that_needs_it(capsys):
    shape = ["estimate", "--num-layers", "8", "--hidden-size", "1000", "--num-attention-heads", "16",
             "--num-query-groups", "4", "--ffn-hidden-size", "3072", "--vocab-size", "32000", "--num-gpus", "8",
             "--seq-length", "4096", "--global-batch-size", "64", "--ckpt", "ours"]
    code, _, err = run_main(shape, capsys)
    assert code == 2 and err.strip().splitlines()[-1].endswith(
        "model: --hidden-size (1000) must be divisible by --num-attention-heads (16); valid --hidden-size: "
        "multiples of 16, or give --kv-channels")
    wide = run_json([*shape, "--kv-channels", "128"], capsys)
    narrow = run_json([*shape, "--kv-channels", "64"], capsys)
    assert wide["peak_memory_bytes"] > narrow["peak_memory_bytes"]
    assert wide["tokens_per_second"] < narrow["tokens_per_second"]
    code, _, err = run_main([*shape, "--kv-channels", "0"], capsys)
    assert code == 2 and "--kv-channels" in err.strip().splitlines()[-1]
