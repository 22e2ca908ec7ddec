"""The h3t layer spec refuses, in one line, a TransformerConfig asking for a layer it does not build (MoE, MLA,
multi-token prediction, ...), whatever the ckpt: the driver's parser refuses those flags first, but Megatron-LM's own
loop (megatron_native) hands its config straight to the spec, which would otherwise train a dense GPT decoder."""
from __future__ import annotations

import types

import pytest

from h3t_ext.runtime.modules.gpt import tiny_llama_config
from h3t_ext.runtime.modules.layer_specs import UNBUILT_FEATURES, h3t_layer_spec, validate_spec_config
from h3t_ext.runtime.modules.recompute_ours import UnsupportedLayerSpecError


@pytest.mark.parametrize("field, what", UNBUILT_FEATURES)
@pytest.mark.parametrize("backend", ["local", "te"])
def test_every_unbuilt_feature_is_one_line(field, what, backend):
    with pytest.raises(UnsupportedLayerSpecError, match="does not build " + what.split(" ")[0]):
        validate_spec_config(types.SimpleNamespace(**{field: 2 if field.endswith(("experts", "layers")) else True}),
                             backend)


def test_a_real_moe_config_is_refused_at_the_spec_for_every_ckpt():
    config = tiny_llama_config(num_moe_experts=4, moe_ffn_hidden_size=128)
    for ckpt in ("no", "ours", "full"):
        with pytest.raises(UnsupportedLayerSpecError, match=r"--num-experts \(MoE layers\)"):
            h3t_layer_spec(config, ckpt=ckpt)


def test_local_attention_is_vanilla_softmax_attention():
    """The local spec builds sliding windows (tests/unit/test_sliding_window.py), not another softmax."""
    h3t_layer_spec(tiny_llama_config(window_size=(16, 0)), ckpt="no")
    with pytest.raises(UnsupportedLayerSpecError, match="--softmax-type off-by-one"):
        validate_spec_config(types.SimpleNamespace(softmax_type="off-by-one"), "local")
    validate_spec_config(types.SimpleNamespace(softmax_type="off-by-one", num_layers=2), "te")  # TE takes it
    h3t_layer_spec(tiny_llama_config(), ckpt="ours")  # the plain decoder builds
