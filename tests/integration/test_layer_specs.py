"""The h3t layer specs: what megatron-core builds from them, the sequence-parallel marks, the TE path.

TransformerEngine is not installed on CPU machines: its tests import it with
``pytest.importorskip`` and build a model only where CUDA is present. Without it, asking for the te
spec is a one-line error, and nothing imports TE at module import time.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from h3t_ext.runtime.modules.fused_saves import FusedSavesMLP, FusedSavesRMSNorm
from h3t_ext.runtime.modules.layer_specs import built_for_ckpt, h3t_block_spec, h3t_layer_spec
from h3t_ext.runtime.modules.norms import LayerNorm
from h3t_ext.runtime.modules.recompute_ours import OursMLP, OursRMSNorm, UnsupportedLayerSpecError
from h3t_ext.runtime.modules.sequence_parallel import SPColumnParallelLinear, SPRowParallelLinear
from tests.activation_harness import init_single_process_megatron, tiny_model


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    init_single_process_megatron()


def _config(**kw):
    from h3t_ext.runtime.modules.gpt import tiny_llama_config

    return tiny_llama_config(num_layers=2, **kw)


@pytest.mark.parametrize("ckpt, norm, mlp", [("no", FusedSavesRMSNorm, FusedSavesMLP), ("full", FusedSavesRMSNorm,
                                             FusedSavesMLP), ("ours", OursRMSNorm, OursMLP)])
def test_megatron_builds_the_h3t_modules(ckpt, norm, mlp):
    model = tiny_model(ckpt=ckpt)
    for layer in model.decoder.layers:
        assert type(layer.input_layernorm) is norm and type(layer.pre_mlp_layernorm) is norm
        assert type(layer.mlp) is mlp
        assert type(layer.mlp.linear_fc1) is SPColumnParallelLinear and type(layer.mlp.linear_fc2) is SPRowParallelLinear
        assert type(layer.self_attention.linear_qkv) is SPColumnParallelLinear
    assert type(model.decoder.final_layernorm) is FusedSavesRMSNorm
    assert built_for_ckpt([model]) == ("ours" if ckpt == "ours" else "no")
    assert built_for_ckpt([tiny_model()]) == "no"  # megatron-core's stock local spec


def test_norm_weights_carry_the_sequence_parallel_mark():
    """Megatron's finalize_model_grads (and our CPU optimizer) all-reduce params marked this way."""
    cfg_sp = _config(tensor_model_parallel_size=2, sequence_parallel=True)  # the norms need no process group
    spec = h3t_block_spec(_config(), ckpt="ours")
    norm = spec.layer_specs[0].submodules.input_layernorm(cfg_sp, 64)
    assert norm.weight.sequence_parallel is True
    assert FusedSavesRMSNorm(_config(), 64).weight.sequence_parallel is False
    ln = LayerNorm(cfg_sp, 64)
    assert ln.weight.sequence_parallel is True and ln.bias.sequence_parallel is True


def test_layernorm_model_builds_for_ckpt_no():
    model = tiny_model(ckpt="no", normalization="LayerNorm")
    assert type(model.decoder.layers[0].input_layernorm) is LayerNorm
    assert type(model.decoder.final_layernorm) is LayerNorm


def test_core_attention_is_a_parameter():
    class MyAttention(torch.nn.Module):
        pass

    spec = h3t_layer_spec(_config(), ckpt="ours", core_attention=MyAttention)
    assert spec.submodules.self_attention.submodules.core_attention is MyAttention


def test_unknown_ckpt_or_backend_is_one_line():
    from h3t_ext.runtime.config import RuntimeConfigError

    with pytest.raises(RuntimeConfigError, match="--ckpt must be one of"):
        h3t_layer_spec(_config(), ckpt="some")
    with pytest.raises(RuntimeConfigError, match="backend must be one of"):
        h3t_layer_spec(_config(), backend="apex")


def test_no_module_imports_transformer_engine_at_import_time():
    code = ("import sys\n"
            "import h3t_ext.runtime.modules.layer_specs, h3t_ext.runtime.modules.gpt, h3t_ext.runtime.modules.recompute_ours\n"
            "import h3t_training.loop.model_provider\n"
            "mods = [m for m in sys.modules if m.split('.')[0] == 'transformer_engine']\n"
            "print(len(mods))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    have_te = subprocess.run([sys.executable, "-c", "import transformer_engine"], capture_output=True).returncode == 0
    if not have_te:  # with TE installed, megatron-core itself imports it
        assert out.stdout.strip().splitlines()[-1] == "0"


def test_te_spec_without_transformer_engine_is_one_line():
    try:
        import transformer_engine  # noqa: F401
        pytest.skip("TransformerEngine is installed here")
    except ImportError:
        pass
    with pytest.raises(UnsupportedLayerSpecError, match="needs TransformerEngine") as info:
        h3t_layer_spec(_config(), ckpt="ours", backend="te")
    assert "\n" not in str(info.value)


def test_te_specs_build_with_transformer_engine():
    pytest.importorskip("transformer_engine")
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

    from h3t_ext.runtime.modules.recompute_ours import OursTENorm

    ours = h3t_layer_spec(_config(), ckpt="ours", backend="te")
    sub = ours.submodules
    assert sub.input_layernorm is OursTENorm and sub.mlp.module is OursMLP
    assert sub.self_attention.submodules.linear_qkv is TEColumnParallelLinear
    assert sub.mlp.submodules.linear_fc2 is TERowParallelLinear
    no = h3t_layer_spec(_config(), ckpt="no", backend="te")
    assert no.submodules.mlp is not None
    if not torch.cuda.is_available():
        return
    from h3t_ext.runtime.modules.gpt import build_gpt_model
    from h3t_ext.runtime.memory.activations import ActivationManager
    from h3t_ext.runtime.memory.device import make_device_layer

    cfg = _config(use_cpu_initialization=False)
    models = {}
    for ckpt in ("no", "ours"):
        torch.manual_seed(0)
        models[ckpt] = build_gpt_model(cfg, vocab_size=256, max_sequence_length=64, ckpt=ckpt, backend="te",
                                       device_type="cuda").cuda()
    assert built_for_ckpt([models["ours"]]) == "ours"
    ids = torch.randint(0, 256, (2, 64), device="cuda")
    pos = torch.arange(64, device="cuda").expand(2, 64)
    mgr = ActivationManager(0.0, make_device_layer("cuda", torch.device("cuda")))
    with mgr.forward_scope(0, 0):
        out = models["ours"](ids, pos, None)
    out.float().pow(2).mean().backward()
    assert mgr.stats.recomputed[(0, 0)] >= 3 * 2
