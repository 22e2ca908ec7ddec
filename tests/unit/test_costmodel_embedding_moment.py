"""The embedding's gradient in the memory model: with a pipeline the first stage makes it while holding other
microbatches' activations (a term of the backward's moment); at pipeline size 1 it is made after the last layer's
backward, when the microbatch's activations are gone (a moment of its own), as the H200's ckpt=no step measured."""
from __future__ import annotations

from dataclasses import replace

import pytest

from h3t_ext.costmodel import Plan
from h3t_ext.costmodel.measured_local_steps import local_stack_steps
from h3t_ext.costmodel.memory import (
    EMBEDDING_MOMENT_TERMS,
    embedding_grad_bytes,
    stage_memory,
    stage_peak_function,
)
from h3t_ext.costmodel.specs import ModelSpec, get_model, get_system

SYSTEM = get_system("h100-sxm")
MODEL = get_model("llama2-7b")
P1 = Plan(num_gpus=8, seq_length=4096, global_batch_size=64)


def test_with_a_pipeline_the_first_stage_counts_it_at_its_backward():
    plan = replace(P1, pipeline_model_parallel_size=2)
    first, last = (stage_memory(MODEL, plan, s, 0.0, SYSTEM).terms for s in (0, 1))
    assert first["embedding_grad"] == embedding_grad_bytes(MODEL, plan) == 32000 * 4096 * 2
    assert "embedding_grad" not in last


def test_at_pipeline_size_one_it_is_not_at_the_backwards_peak():
    terms = stage_memory(MODEL, P1, 0, 0.0, SYSTEM).terms
    assert "embedding_grad" not in terms and "embedding_backward_excess" not in terms
    assert terms["activations"] > embedding_grad_bytes(MODEL, P1)


def test_a_vocabulary_larger_than_the_activations_makes_the_embedding_moment_the_peak():
    """One thin layer and a huge vocabulary: the embedding's moment (the persistent terms and the gradient) is the
    peak, and the cheap peak function the planner uses agrees."""
    tiny = ModelSpec(name="wide-vocab", num_layers=1, hidden_size=256, num_attention_heads=4, num_query_groups=4,
                     ffn_hidden_size=1024, vocab_size=4_000_000, swiglu=True,
                     untie_embeddings_and_output_weights=True)
    plan = Plan(num_gpus=1, seq_length=16, global_batch_size=1)
    mem = stage_memory(tiny, plan, 0, 0.0, SYSTEM)
    moment = sum(mem.terms.get(k, 0) for k in EMBEDDING_MOMENT_TERMS) + embedding_grad_bytes(tiny, plan)
    assert mem.terms["embedding_backward_excess"] > 0
    assert mem.peak_bytes == moment
    assert stage_peak_function(tiny, plan, 0, SYSTEM)(0.0) == mem.peak_bytes


def test_the_h200_ckpt_no_step_is_the_models_to_a_hundredth_of_a_percent():
    """The 1.1 B Llama's ckpt=no and ckpt=ours alpha 0 steps peak at the backward; counting the embedding's
    gradient there put the estimate 0.5% above both."""
    rows = {r.case: r for r in local_stack_steps().rows}
    for case in ("llama-1b/no/0", "llama-1b/ours/0"):
        assert rows[case].memory_ratio == pytest.approx(1.0, abs=2e-4), case
