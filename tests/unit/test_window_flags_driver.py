"""The training driver's --window-size and --window-attn-skip-freq: resolved into megatron-core's TransformerConfig
fields (the model the run builds), the cost model's ModelSpec (its predictions and logged MFU) and the checkpoint's
model fields; bad values, a pattern of the wrong length and context parallelism are one line before any rank."""
from __future__ import annotations

import types

import pytest
import torch

from h3t_training.config.run_spec import model_spec
from h3t_training.config.sections import parse_args
from h3t_training.loop.checkpoint_common import window_values

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data"]


def _error(capsys, argv, world_size=1) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args([*BASE, *argv], world_size=world_size)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_the_window_reaches_the_model_and_the_cost_model():
    from h3t_training.loop.model_provider import transformer_config
    config = parse_args([*BASE, "--window-size", "(16,0)", "--window-attn-skip-freq", "[1,1,1,0]"])
    assert config.window_size == (16, 0) and config.window_attn_skip_freq == (1, 1, 1, 0)
    tc = transformer_config(config, on_gpu=False)
    assert tc.window_size == (16, 0) and tc.window_attn_skip_freq == [1, 1, 1, 0]
    spec = model_spec(config, 1000)
    assert (spec.window_size, spec.window_attn_skip_freq, spec.windowed_layers) == (16, (1, 1, 1, 0), 3)
    every = parse_args([*BASE, "--window-size", "16,0", "--window-attn-skip-freq", "2"])
    assert transformer_config(every, on_gpu=False).window_attn_skip_freq == 2
    assert model_spec(every, 1000).windowed_layers == 2
    plain = parse_args(BASE)
    assert plain.window_size is None and transformer_config(plain, on_gpu=False).window_size is None


def test_a_frequency_without_a_window_is_megatrons_no_op_and_says_so():
    config = parse_args([*BASE, "--window-attn-skip-freq", "4"])
    assert config.window_size is None
    assert any("--window-attn-skip-freq: no effect without --window-size" in n for n in config.flag_notices)
    assert model_spec(config, 1000).windowed_layers == 0


@pytest.mark.parametrize("argv,says", [
    (["--window-size", "16,16"], "--window-size 16,16: a GPT's attention is causal"),
    (["--window-size", "x"], "--window-size 'x' is not two integers"),
    (["--window-size", "16,0", "--window-attn-skip-freq", "[1,0]"], "has 2 entries but the model has 4 layers"),
    (["--window-size", "16,0", "--window-attn-skip-freq", "0"], "--window-attn-skip-freq 0 is outside [1, inf)"),
])
def test_bad_window_flags_are_one_line(capsys, argv, says):
    assert says in _error(capsys, argv)


def test_context_parallelism_with_a_window_is_one_line(capsys):
    err = _error(capsys, ["--window-size", "16,0", "--context-parallel-size", "2", "--micro-batch-size", "1"],
                 world_size=2)
    assert "--window-size with --context-parallel-size 2" in err


def test_checkpoint_window_fields_compare_by_value():
    """What a checkpoint records and what a Megatron-LM Namespace holds (a tuple and a list) compare equal; a
    frequency without a window is no window."""
    config = parse_args([*BASE, "--window-size", "16,0", "--window-attn-skip-freq", "[1,1,1,0]"])
    megatron = types.SimpleNamespace(window_size=(16, 0), window_attn_skip_freq=[1, 1, 1, 0])
    assert window_values(config) == window_values(megatron) == {"window_size": [16, 0],
                                                                "window_attn_skip_freq": [1, 1, 1, 0]}
    assert window_values(types.SimpleNamespace(window_attn_skip_freq=3)) == \
        {"window_size": None, "window_attn_skip_freq": None}


def test_the_local_spec_builds_windowed_layers_where_the_config_says():
    from h3t_ext.runtime.modules.gpt import build_gpt_model, tiny_llama_config
    from tests.activation_harness import init_single_process_megatron
    init_single_process_megatron()
    cfg = tiny_llama_config(num_layers=4, window_size=(8, 0), window_attn_skip_freq=[1, 0, 0, 1])
    model = build_gpt_model(cfg, vocab_size=128, max_sequence_length=32, ckpt="ours", device_type="cpu")
    windows = [m.window for m in model.modules() if type(m).__name__.endswith("SDPACoreAttention")]
    assert windows == [8, None, None, 8]
    tokens = torch.randint(0, 128, (2, 32))
    pos = torch.arange(32).expand(2, 32)
    assert torch.isfinite(model(tokens, pos, None, labels=tokens)).all()
