"""ckpt=ours: what is saved, what is recomputed, and the start-up errors on unsupported specs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from h3t_ext.runtime.memory.activations import ActivationManager
from h3t_ext.runtime.memory.device import make_device_layer
from h3t_ext.runtime.config import RuntimeConfigError
from h3t_ext.runtime.modules.layer_specs import check_built_for
from h3t_ext.runtime.modules.recompute_ours import OursMLP, OursRMSNorm, UnsupportedLayerSpecError, lookup_recipe
from tests.activation_harness import batches, init_single_process_megatron, middle_stage_model, tiny_model


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    init_single_process_megatron()


def test_gemm_inputs_become_recipes_and_outputs_match():
    model = tiny_model(ckpt="ours")
    ids, pos = batches(1)[0]
    ref = tiny_model()(ids, pos, None)
    assert sum(isinstance(m, OursRMSNorm) for m in model.modules()) == 2 * 2  # built by megatron from the spec
    assert sum(isinstance(m, OursMLP) for m in model.modules()) == 2
    mgr = ActivationManager(0.0, make_device_layer("cpu-sync", "cpu"))
    with mgr.forward_scope(0, 0):
        out = model(ids, pos, None)
    assert torch.equal(out, ref)
    # two norm outputs and the SwiGLU output per layer, and the final (fused-saves) norm's x * rstd
    assert mgr.stats.recomputed[(0, 0)] == 3 * 2 + 1


def test_lean_functions_save_only_their_inputs():
    model = middle_stage_model(num_layers=1, ckpt="ours")
    layer = model.decoder.layers[0]
    x = torch.randn(8, 2, 64, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer.input_layernorm(x)
    assert [t.shape for t in saved if not isinstance(t, torch.nn.Parameter)] == [x.shape]
    assert lookup_recipe(out) is not None
    fn, inputs = lookup_recipe(out)
    assert torch.equal(fn(*inputs), out)
    h = layer.pre_mlp_layernorm(x)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = layer.mlp(h)
    # FC1 input, FC1 output (the SwiGLU's only saved tensor), FC2 input; no SiLU or gate intermediates
    shapes = [tuple(t.shape) for t in saved if not isinstance(t, torch.nn.Parameter)]
    assert shapes == [(8, 2, 64), (8, 2, 256), (8, 2, 128)]
    assert out.shape == (8, 2, 64)


def test_recompute_from_offloaded_inputs_is_exact():
    """Recipes read inputs that were offloaded and reloaded (alpha=1)."""
    data = batches(2)
    grads = []
    for alpha in (None, 1.0):
        model = tiny_model(ckpt="ours")
        mgr = ActivationManager(alpha or 0.0, make_device_layer("cpu-thread", "cpu"))
        try:
            losses = []
            for mb, (ids, pos) in enumerate(data):
                with mgr.forward_scope(mb, 0):
                    losses.append(model(ids, pos, None).pow(2).mean())
                mgr.offload(mb, 0)
            for mb in (1, 0):
                mgr.reload(mb, 0)
                with mgr.backward_scope(mb, 0):
                    losses[mb].backward()
                mgr.release(mb, 0)
        finally:
            mgr.device.close()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if alpha:
            assert mgr.stats.offloaded_bytes == sum(mgr.stats.saved_bytes.values())
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


@pytest.mark.parametrize("overrides, match", [
    (dict(gated_linear_unit=False, activation_func=F.relu), "SwiGLU \\(--swiglu\\), GeLU or squared-ReLU"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), "recompute"),
])
def test_unsupported_configs_fail_when_the_spec_is_built(overrides, match):
    with pytest.raises(UnsupportedLayerSpecError, match=match) as info:
        tiny_model(ckpt="ours", **overrides)
    assert "\n" not in str(info.value)


def test_model_of_another_spec_fails_the_ckpt_check():
    """A model not built by the ckpt=ours spec (here megatron-core's stock local spec) is refused for
    ckpt=ours with one line; a ckpt=ours model is refused for ckpt=no."""
    with pytest.raises(UnsupportedLayerSpecError, match="ckpt=ours layer spec") as info:
        check_built_for([tiny_model()], "ours")
    assert "\n" not in str(info.value) and "RMSNorm" in str(info.value)
    check_built_for([tiny_model()], "no")
    check_built_for([tiny_model(ckpt="ours")], "ours")
    with pytest.raises(RuntimeConfigError, match="--ckpt no"):
        check_built_for([tiny_model(ckpt="ours")], "no")
