"""Megatron's --normalization and --position-embedding-type in the cost model: a LayerNorm has a bias beside its
weight; a learned position table (GPT's) is max_position_embeddings x h parameters on the first stage, whole on every
tensor-parallel rank; RoPE (Llama's) has no parameters but rotates q and k in every layer."""
from __future__ import annotations

from dataclasses import replace

import pytest

from h3t_ext.costmodel import Plan, estimate, get_model, get_system
from h3t_ext.costmodel.memory import stage_params
from h3t_ext.costmodel.specs import ModelSpec
from h3t_ext.costmodel.timing import shape_times

GPT3 = get_model("gpt3-175b")
PLAN = Plan(num_gpus=1024, seq_length=2048, global_batch_size=1536, micro_batch_size=1, tensor_model_parallel_size=8,
            pipeline_model_parallel_size=16)


def test_the_zoo_says_what_each_family_uses():
    assert (GPT3.normalization, GPT3.position_embedding_type) == ("LayerNorm", "learned_absolute")
    llama = get_model("llama2-70b")
    assert (llama.normalization, llama.position_embedding_type) == ("RMSNorm", "rope")


def test_the_learned_table_is_whole_on_every_tensor_parallel_rank_of_the_first_stage():
    none = replace(GPT3, position_embedding_type="none")
    h, s = GPT3.hidden_size, PLAN.seq_length
    assert stage_params(GPT3, PLAN, 0) - stage_params(none, PLAN, 0) == s * h  # not s h / t
    assert stage_params(GPT3, PLAN, 1) == stage_params(none, PLAN, 1)
    longer = replace(GPT3, max_position_embeddings=4 * s)
    assert stage_params(longer, PLAN, 0) - stage_params(none, PLAN, 0) == 4 * s * h
    fits = estimate(GPT3, PLAN, get_system("a100-80g")).stages[0].peak_bytes
    assert fits > estimate(none, PLAN, get_system("a100-80g")).stages[0].peak_bytes


def test_a_layernorm_has_a_bias():
    rms = replace(GPT3, normalization="RMSNorm")
    per_layer = GPT3.layer_params_per_rank(8) - rms.layer_params_per_rank(8)
    assert per_layer == 2 * GPT3.hidden_size  # two norms, one bias each
    assert stage_params(GPT3, PLAN, 15) - stage_params(rms, PLAN, 15) == (2 * 6 + 1) * GPT3.hidden_size  # 6 layers, final norm


def test_rope_is_element_wise_time_in_every_layer():
    rope = replace(GPT3, position_embedding_type="rope")
    system = get_system("a100-80g")
    assert shape_times(rope, PLAN, system).layer.total > shape_times(GPT3, PLAN, system).layer.total


@pytest.mark.parametrize("field,value", [("normalization", "LayerNorm1p"), ("position_embedding_type", "alibi"),
                                         ("max_position_embeddings", 0)])
def test_bad_values_are_one_line(field, value):
    with pytest.raises(ValueError, match=field):
        ModelSpec(name="x", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                  ffn_hidden_size=256, vocab_size=1000, **{field: value})
