"""Megatron FSDP's unsharded buffers and FP8 copies in the memory model: the gradient buckets in the gradient
buffer's dtype, the gathered layers in FP8 with --fp8-param-gather (with the transpose made for their backward where
the GPU keeps one), and no FP8 weight copy kept through the iteration when the parameters are sharded (megatron_fsdp
drops each transpose after use)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from h3t_ext.costmodel import Plan, estimate
from h3t_ext.costmodel import fp8
from h3t_ext.costmodel.memory import fsdp_buffer_bytes, stage_memory
from h3t_ext.costmodel.specs import get_model, get_system
from h3t_ext.dtypes import BF16, FP32, FP8

MODEL = get_model("llama3-70b")
HOPPER, BLACKWELL = get_system("h100-sxm"), get_system("b200")
FSDP = Plan(num_gpus=64, seq_length=8192, global_batch_size=256, micro_batch_size=1,
            use_distributed_optimizer=True, data_parallel_sharding_strategy="optim_grads_params")
FSDP_FP8 = replace(FSDP, fp8="hybrid", fp8_recipe="tensorwise", fp8_param_gather=True)
LAYER = MODEL.layer_params_per_rank(1)
GEMM = fp8.gemm_weight_params(MODEL, FSDP, 1)


def test_the_gradient_buckets_are_in_the_gradient_buffers_dtype():
    fp32 = fsdp_buffer_bytes(MODEL, FSDP, 0)
    bf16 = fsdp_buffer_bytes(MODEL, replace(FSDP, grad_reduce_in_bf16=True), 0)
    assert fp32 == 2 * LAYER * FP32 + 2 * LAYER * BF16
    assert fp32 - bf16 == 2 * LAYER * (FP32 - BF16)
    grads_only = replace(FSDP, data_parallel_sharding_strategy="optim_grads", grad_reduce_in_bf16=True)
    assert fsdp_buffer_bytes(MODEL, grads_only, 0) == 2 * LAYER * BF16


def test_gathered_fp8_layers_hold_their_data_and_where_kept_the_transpose_made_for_the_backward():
    grads = 2 * LAYER * FP32
    rest = LAYER - GEMM
    assert fsdp_buffer_bytes(MODEL, FSDP_FP8, 0, BLACKWELL) == grads + 2 * (rest * BF16 + GEMM * FP8)
    assert fsdp_buffer_bytes(MODEL, FSDP_FP8, 0, HOPPER) == grads + 2 * (rest * BF16 + GEMM * 2 * FP8)
    assert fsdp_buffer_bytes(MODEL, FSDP_FP8, 0) == fsdp_buffer_bytes(MODEL, FSDP_FP8, 0, HOPPER)
    mxfp8 = replace(FSDP_FP8, fp8_recipe="mxfp8")  # block scales per direction: both copies on any GPU
    assert fsdp_buffer_bytes(MODEL, mxfp8, 0, BLACKWELL) == fsdp_buffer_bytes(MODEL, FSDP_FP8, 0, HOPPER)
    # a rank that also holds BF16 layers may have one of them gathered: bf16
    bf16_ends = replace(FSDP_FP8, first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                        num_layers_at_end_in_bf16=1)
    assert fsdp_buffer_bytes(MODEL, bf16_ends, 0, BLACKWELL) == fsdp_buffer_bytes(MODEL, FSDP, 0)


@pytest.mark.parametrize("system", [HOPPER, BLACKWELL], ids=["hopper", "blackwell"])
def test_sharded_fp8_parameters_keep_no_weight_copy_through_the_iteration(system):
    assert fp8.fsdp_drops_weight_transposes(FSDP_FP8)
    terms = stage_memory(MODEL, FSDP_FP8, 0, 0.0, system).terms
    assert terms["fp8_weight_cache"] == 0
    # the parameters whole (optim_grads), or no FP8 parameters: TransformerEngine keeps its copies, as without FSDP
    grads_only = replace(FSDP_FP8, data_parallel_sharding_strategy="optim_grads")
    assert not fp8.fsdp_drops_weight_transposes(grads_only)
    assert not fp8.fsdp_drops_weight_transposes(replace(FSDP_FP8, fp8_param_gather=False))
    kept = stage_memory(MODEL, grads_only, 0, 0.0, HOPPER).terms["fp8_weight_cache"]
    assert kept == fp8.gemm_weight_params(MODEL, FSDP, MODEL.num_layers) * FP8


def test_the_dropped_transposes_are_made_again_every_microbatch():
    one = replace(FSDP_FP8, global_batch_size=64)  # m = 1
    four = FSDP_FP8  # m = 4
    assert four.num_microbatches == 4 * one.num_microbatches
    per_mb = [fp8.step_seconds(MODEL, p, HOPPER, MODEL.num_layers) for p in (one, four)]
    assert per_mb[1] > 3.5 * per_mb[0]
    whole = replace(four, data_parallel_sharding_strategy="optim_grads")
    assert fp8.step_seconds(MODEL, whole, HOPPER, MODEL.num_layers) == pytest.approx(per_mb[0])


def test_fsdp_with_fp8_parameters_fits_far_below_the_whole_models_fp8_copy():
    """On Hopper the old rule kept every layer's FP8 transpose (1 byte a GEMM weight of the whole model) on each
    FSDP rank: tens of GiB a sharded rank never holds."""
    peak = estimate(MODEL, FSDP_FP8, HOPPER).peak_memory_bytes
    whole_copy = fp8.gemm_weight_params(MODEL, FSDP, MODEL.num_layers) * FP8
    assert whole_copy > 60 * 2**30
    assert peak < stage_memory(MODEL, FSDP, 0, 0.0, HOPPER).peak_bytes
