"""The driver's GPU model in Megatron-LM's precision: every floating-point parameter in --bf16's dtype, as
Float16Module casts it (torch's own modules, the learned position embedding and the local norms, are built in
float32 whatever params_dtype says)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from h3t_ext.runtime.modules.gpt import build_gpt_model, tiny_llama_config
from h3t_training.loop.model_provider import cast_to_params_dtype
from tests.activation_harness import init_single_process_megatron


@pytest.fixture
def model_parallel():
    init_single_process_megatron()


def _gpt(dtype):
    config = tiny_llama_config(normalization="LayerNorm", gated_linear_unit=False, activation_func=F.gelu,
                               add_bias_linear=True, params_dtype=dtype, pipeline_dtype=dtype, bf16=True)
    return build_gpt_model(config, vocab_size=128, max_sequence_length=16, position_embedding_type="learned_absolute",
                           device_type="cpu")


def test_a_bf16_gpt_is_all_bf16_after_the_cast_and_runs(model_parallel):
    model = _gpt(torch.bfloat16)
    float32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert "embedding.position_embeddings.weight" in float32  # what reached the first GEMM as float32 on a GPU
    tokens = torch.randint(0, 128, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    with pytest.raises(RuntimeError, match="dtype"):
        model(tokens, positions, None)
    cast_to_params_dtype(model, torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model(tokens, positions, None).dtype == torch.bfloat16


def test_float32_stays(model_parallel):
    model = _gpt(torch.float32)
    cast_to_params_dtype(model, torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
