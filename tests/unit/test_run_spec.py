"""The driver's one rule for the dtype its model computes in (h3t_training.config.run_spec.compute_dtype): the model
provider builds the model in it and the cost model prices the run's saved activations at its size."""
from __future__ import annotations

import pytest

from h3t_training.config.run_spec import activation_spec, compute_dtype
from h3t_training.config.sections import parse_args
from parse_harness import BASE


@pytest.mark.parametrize("extra, on_gpu, dtype, nbytes", [
    ([], False, "float32", 4), (["--bf16"], False, "float32", 4), (["--h3t-float64"], False, "float64", 8),
    ([], True, "float32", 4), (["--bf16"], True, "bfloat16", 2), (["--fp16"], True, "float16", 2),
])
def test_the_model_dtype_and_the_priced_activation_bytes_agree(extra, on_gpu, dtype, nbytes):
    config = parse_args([*BASE, *extra], world_size=1)
    assert compute_dtype(config, on_gpu=on_gpu) == dtype
    spec = activation_spec(config, on_gpu=on_gpu)
    assert spec["dtype_bytes"] == nbytes
    assert spec["dropout_mask_bytes"] == (1 if on_gpu else nbytes)  # a bool mask on a GPU, the noise in dtype on CPU


def test_the_model_provider_builds_in_that_dtype():
    import torch

    from h3t_training.loop.model_provider import transformer_config

    config = parse_args([*BASE, "--h3t-float64"], world_size=1)
    assert transformer_config(config, on_gpu=False).params_dtype == torch.float64
    assert transformer_config(parse_args(BASE, world_size=1), on_gpu=False).params_dtype == torch.float32


def test_the_priced_plan_has_the_swiglu_fusion_megatron_core_gets():
    """--no-bias-swiglu-fusion turns megatron-core's fused bias-SwiGLU off (transformer_config) and the plan the driver
    prices says so (its op-by-op SwiGLU saves two more tensors and moves more bytes: costmodel/activations.py)."""
    from h3t_training.config.run_spec import run_plan
    from h3t_training.loop.model_provider import transformer_config

    for extra, fused in (([], True), (["--no-bias-swiglu-fusion"], False)):
        config = parse_args([*BASE, "--swiglu", "--disable-bias-linear", *extra], world_size=1)
        assert run_plan(config).bias_activation_fusion is fused
        assert transformer_config(config, on_gpu=True).bias_activation_fusion is fused


@pytest.mark.parametrize("extra, priced", [([], "auto"), (["--attention-backend", "fused"], "fused"),
                                           (["--attention-backend", "local"], "unfused"),
                                           (["--attention-backend", "unfused"], "unfused"),
                                           (["--use-flash-attn"], "flash")])
def test_the_cpu_runs_plan_prices_the_attention_its_flags_give(extra, priced):
    """Off a GPU the driver's plan is the GPU job's (its --gpu budget and logged estimate): the attention kernel the
    flags name, as h3t-plan reads them (local: the unfused core attention, which saves the s^2 scores); on a GPU
    without TransformerEngine the local spec's attention, whatever the flags say."""
    from h3t_training.config.run_spec import run_plan

    config = parse_args([*BASE, *extra], world_size=1)
    assert run_plan(config).attention_backend == priced
    assert run_plan(config, on_gpu=True).attention_backend == "auto"
