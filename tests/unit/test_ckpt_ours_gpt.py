"""ckpt=ours on a GPT-3-style model (LayerNorm with bias, GeLU MLP with biases, learned positions, tied
embeddings, also with --apply-layernorm-1p): the same outputs and gradients as ckpt=no, with the two
LayerNorm outputs and the GeLU output of each layer recomputed instead of saved, also from offloaded inputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from h3t_ext.runtime.memory.activations import ActivationManager
from h3t_ext.runtime.memory.device import make_device_layer
from h3t_ext.runtime.modules.gpt import build_gpt_model, tiny_llama_config
from h3t_ext.runtime.modules.layer_specs import check_built_for
from h3t_ext.runtime.modules.recompute_ours import OursLayerNorm, OursMLP
from tests.activation_harness import VOCAB, batches, init_single_process_megatron

LAYERS = 2


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    init_single_process_megatron()


def gpt3_model(ckpt: str, **overrides):
    torch.manual_seed(0)
    cfg = tiny_llama_config(num_layers=LAYERS, num_query_groups=4, normalization="LayerNorm", gated_linear_unit=False,
                            activation_func=F.gelu, add_bias_linear=True, hidden_dropout=0.0, **overrides)
    return build_gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=128, ckpt=ckpt,
                           position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True,
                           device_type="cpu")


def _train_step(model, mgr, data):
    losses = []
    for mb, (ids, pos) in enumerate(data):
        with mgr.forward_scope(mb, 0):
            losses.append(model(ids, pos, None).pow(2).mean())
        mgr.offload(mb, 0)
    for mb in reversed(range(len(data))):
        mgr.reload(mb, 0)
        with mgr.backward_scope(mb, 0):
            losses[mb].backward()
        mgr.release(mb, 0)
    return [l.item() for l in losses], {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("zero_centered", [False, True], ids=["layernorm", "layernorm-1p"])
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_gpt3_ours_matches_no_and_saves_less(zero_centered, alpha):
    data = batches(2)
    got = {}
    for ckpt in ("no", "ours"):
        model = gpt3_model(ckpt, layernorm_zero_centered_gamma=zero_centered)
        check_built_for([model], ckpt)
        mgr = ActivationManager(alpha if ckpt == "ours" else 0.0, make_device_layer("cpu-thread", "cpu"))
        try:
            got[ckpt] = (*_train_step(model, mgr, data), mgr.stats)
        finally:
            mgr.device.close()
    (l_no, g_no, s_no), (l_ours, g_ours, s_ours) = got["no"], got["ours"]
    assert l_ours == l_no
    assert g_no.keys() == g_ours.keys()
    for k in g_no:
        torch.testing.assert_close(g_ours[k], g_no[k], rtol=1e-6, atol=1e-7)
    assert s_ours.recomputed[(0, 0)] == 3 * LAYERS  # two LayerNorm outputs and the GeLU output per layer
    assert s_no.recomputed.get((0, 0), 0) == 0
    assert sum(s_ours.saved_bytes.values()) < sum(s_no.saved_bytes.values())
    if alpha:
        assert s_ours.offloaded_bytes == sum(s_ours.saved_bytes.values())


def test_gpt3_ours_modules_are_built_from_the_spec():
    model = gpt3_model("ours")
    assert sum(isinstance(m, OursLayerNorm) for m in model.modules()) == 2 * LAYERS
    assert sum(isinstance(m, OursMLP) for m in model.modules()) == LAYERS
    assert model.share_embeddings_and_output_weights and model.position_embedding_type == "learned_absolute"
