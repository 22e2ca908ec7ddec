"""ckpt=no saving what fused kernels save (h3t_ext.runtime.modules.fused_saves): bitwise results, saved bytes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from h3t_ext.costmodel.activations import activation_bytes_per_layer_token
from h3t_ext.runtime.memory.activations import ActivationManager
from h3t_ext.runtime.memory.device import make_device_layer
from h3t_ext.runtime.modules.fused_saves import FusedSavesMLP, FusedSavesRMSNorm, rms_norm_marking
from tests.activation_harness import (
    HIDDEN,
    batches,
    init_single_process_megatron,
    middle_stage_model,
    run_middle_stage,
    rope_bytes,
    run_rank_schedule,
    tiny_model,
    tiny_model_spec,
)


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    init_single_process_megatron()


def _manager(alpha):
    return ActivationManager(alpha, make_device_layer("cpu-sync", "cpu"), min_offload_bytes=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_is_torch_rms_norm_bitwise(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, 64, generator=g).to(dtype).requires_grad_()
    w = torch.randn(64, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(8, 3, 64, generator=g).to(dtype)
    ref = F.rms_norm(x, (64,), w, 1e-5)
    got = rms_norm_marking(x, w, (64,), 1e-5)
    assert torch.equal(got, ref)
    for a, b in zip(torch.autograd.grad(got, (x, w), grad), torch.autograd.grad(ref, (x, w), grad)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_losses_and_grads_bitwise_equal_stock_model(alpha):
    data = batches(4)
    ref_losses, ref_grads = run_rank_schedule(tiny_model(), data, pipeline_size=2)
    model = tiny_model(ckpt="no")  # the h3t spec of ckpt=no
    fused = sum(isinstance(m, (FusedSavesRMSNorm, FusedSavesMLP)) for m in model.modules())
    assert fused == 2 * 3 + 1  # two norms and the MLP per layer, the final norm
    assert isinstance(model.decoder.final_layernorm, FusedSavesRMSNorm)
    mgr = _manager(alpha)
    losses, grads = run_rank_schedule(model, data, mgr, pipeline_size=2)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert set(grads) == set(ref_grads) and all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    assert all(n > 0 for n in mgr.stats.recomputed.values())


def test_saved_bytes_are_the_cost_models_fused_terms():
    """Per microbatch-chunk of a layers-only stage: the cost model's ckpt=no 'local' total (fp32) plus
    megatron's unfused RoPE cos/sin; without the transform the stock ops save ~1.4x that."""
    layers, mb, seq = 2, 2, 32
    total = activation_bytes_per_layer_token(tiny_model_spec(layers), "no", dtype_bytes=4, layer_spec="local")["total"]
    rope = rope_bytes(seq)
    saved = {}
    for fused in (False, True):
        model = middle_stage_model(num_layers=layers, ckpt="no" if fused else None)
        st = run_middle_stage(model, _manager(0.0), pipeline_size=1, rank=0, num_microbatches=1, micro_batch=mb,
                              seq=seq, hidden=HIDDEN)
        saved[fused] = st.saved_bytes[(0, 0)] + st.small_bytes[(0, 0)]
    assert saved[True] == layers * (mb * seq * total + rope)
    assert saved[False] > 1.3 * saved[True]
