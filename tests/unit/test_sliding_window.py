"""Sliding-window attention (Megatron's --window-size and --window-attn-skip-freq): the flags' reading, the layer
rule against megatron-core's own, the local spec's windowed attention against a float64 reference (forward and
backward, GQA, what it saves), and the cost model's and planner's pricing of it."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from h3t_ext.attention_window import (WindowFlagError, attended_pairs, check_window, is_windowed, parse_skip_freq,
                                      parse_window_size, windowed_layer_count)
from h3t_ext.costmodel import ModelSpec, Plan, get_model, get_system
from h3t_ext.costmodel.errors import InvalidPlanError
from h3t_ext.costmodel.estimate import estimate
from h3t_ext.costmodel.kernels import flash_attention_flops
from h3t_ext.costmodel.mfu import model_flops_per_token
from h3t_ext.costmodel.plan_checks import validate_plan
from h3t_ext.costmodel.timing import attention_seconds, kernel_rates
from tests.planner_harness import run_json, run_main


# ----------------------------------------------------------------------------------------------- the flags

@pytest.mark.parametrize("text,left", [("4096,0", 4096), ("(128,0)", 128), (" 0 , 0 ", 0), ((16, 0), 16)])
def test_window_size_reads_megatron_forms(text, left):
    assert parse_window_size(text) == left


@pytest.mark.parametrize("text,says", [("4096,4096", "right window must be 0"), ("-1,0", "leave --window-size out"),
                                       ("-5,0", "outside [0, inf)"), ("4096", "two integers"),
                                       ("1,2,3", "two integers"), ("a,b", "two integers")])
def test_bad_window_sizes_are_one_line(text, says):
    with pytest.raises(WindowFlagError, match=re_escape(says)) as e:
        parse_window_size(text)
    assert "\n" not in str(e.value) and str(e.value).startswith("--window-size")


def re_escape(s: str) -> str:
    import re
    return re.escape(s)


@pytest.mark.parametrize("text,value", [("4", 4), (3, 3), ("[1,1,1,0]*2", (1, 1, 1, 0, 1, 1, 1, 0)),
                                        ("([1]*2+[0])*2", (1, 1, 0, 1, 1, 0)), ([0, 1], (0, 1))])
def test_skip_freq_reads_integers_and_patterns(text, value):
    assert parse_skip_freq(text) == value


@pytest.mark.parametrize("text", ["0", "-2", "[2,1]", "[]", "[1]*100000000", "__import__('os')", "[1,(0,1)]",
                                  "[1]**2", "[1.0,0]", "x"])
def test_bad_skip_freqs_are_one_line(text):
    with pytest.raises(WindowFlagError) as e:
        parse_skip_freq(text)
    assert "\n" not in str(e.value) and str(e.value).startswith("--window-attn-skip-freq")


def test_a_pattern_has_one_entry_per_layer():
    check_window(64, (1, 0) * 2, 4)
    with pytest.raises(WindowFlagError, match="3 entries but the model has 4 layers"):
        check_window(64, (1, 1, 0), 4)
    check_window(None, (1, 1, 0), 4)  # no window: Megatron-LM never reads the pattern


@pytest.mark.parametrize("freq", [None, 1, 2, 3, 4, [1, 0, 0, 1, 1, 0], [0] * 6, [1] * 6])
@pytest.mark.parametrize("window", [None, 32])
def test_the_layer_rule_is_megatron_cores(freq, window):
    from megatron.core.transformer.utils import is_layer_window_attention
    megatron = [is_layer_window_attention(None if window is None else (window, 0), freq, n) for n in range(1, 7)]
    ours_freq = None if freq is None else parse_skip_freq(freq)
    assert [is_windowed(window, ours_freq, n) for n in range(1, 7)] == megatron
    assert windowed_layer_count(window, ours_freq, 6) == sum(megatron)


# ----------------------------------------------------------------------------------------------- the runtime

def _reference(q, k, v, window, scale):
    """Float64 softmax attention of q [b, n, s, d] over k/v [b, g, s, d] with keys i - window .. i allowed."""
    n, g = q.size(1), k.size(1)
    kk, vv = (t.repeat_interleave(n // g, dim=1) for t in (k, v))
    s = q.size(2)
    i = torch.arange(s)
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - window)
    scores = (q @ kk.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ vv


@pytest.mark.parametrize("window", [0, 1, 5, 15])
@pytest.mark.parametrize("groups", [4, 2])
def test_windowed_attention_equals_the_float64_reference(window, groups):
    from h3t_ext.runtime.modules.attention import windowed_attention
    torch.manual_seed(0)
    b, n, s, d = 2, 4, 16, 8
    q = torch.randn(b, n, s, d, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, groups, s, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    scale = 1 / math.sqrt(d)
    got = windowed_attention(q, k, v, window, scale=scale)
    want = _reference(q, k, v, window, scale)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    go = torch.randn_like(want)
    for a, r in zip(torch.autograd.grad(got, (q, k, v), go), torch.autograd.grad(want, (q, k, v), go)):
        assert torch.allclose(a, r, rtol=0, atol=1e-12)
    if window == 0:  # each token attends to itself alone
        assert torch.allclose(got, v.repeat_interleave(n // groups, dim=1), atol=1e-12)


def _core_attention(window, freq=None, layer_number=1, num_layers=4):
    from megatron.core.transformer.enums import AttnMaskType

    from h3t_ext.runtime.modules.attention import SDPACoreAttention
    from h3t_ext.runtime.modules.gpt import tiny_llama_config
    cfg = tiny_llama_config(num_layers=num_layers, params_dtype=torch.float64, pipeline_dtype=torch.float64,
                            window_size=None if window is None else (window, 0), window_attn_skip_freq=freq)
    return SDPACoreAttention(cfg, layer_number, AttnMaskType.causal, "self")


def _qkv(s=24, b=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, 4, 16, dtype=torch.float64, generator=g)
    k, v = (torch.randn(s, b, 2, 16, dtype=torch.float64, generator=g) for _ in range(2))
    return q, k, v


def test_core_attention_windows_the_layers_megatron_core_windows():
    q, k, v = _qkv()
    full = _core_attention(None)(q, k, v, None)
    windowed = _core_attention(6)(q, k, v, None)
    assert not torch.allclose(full, windowed)
    # [1,0,1,0]: layer 2 attends fully; --window-attn-skip-freq 2 is the same rule
    assert torch.equal(_core_attention(6, [1, 0, 1, 0], layer_number=2)(q, k, v, None), full)
    assert torch.equal(_core_attention(6, 2, layer_number=4)(q, k, v, None), full)
    assert torch.equal(_core_attention(6, 2, layer_number=3)(q, k, v, None), windowed)
    # a window that covers the sequence is causal attention
    assert torch.allclose(_core_attention(23)(q, k, v, None), full, rtol=0, atol=1e-12)
    want = _reference(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), 6, 1 / 4).permute(2, 0, 1, 3).reshape(24, 2, -1)
    assert torch.allclose(windowed, want, rtol=0, atol=1e-12)


def _saved_bytes(module, q, k, v) -> int:
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(q, k, v, None).sum().backward()
    return sum(storages.values())


def test_a_windowed_layer_saves_what_a_causal_one_saves():
    """q, k, v, the output and the log-sum-exp: no s x s mask or score tensor outlives the call (the cost model's
    flash-attention bytes), as causal SDPA on CPU saves."""
    q, k, v = _qkv(s=64)
    assert _saved_bytes(_core_attention(8), q, k, v) == _saved_bytes(_core_attention(None), q, k, v)


def test_the_spec_and_the_ring_refuse_what_they_cannot_build():
    import types

    from h3t_ext.runtime.modules.layer_specs import validate_spec_config
    from h3t_ext.runtime.modules.recompute_ours import UnsupportedLayerSpecError
    ok = types.SimpleNamespace(window_size=(16, 0), window_attn_skip_freq=[1, 0], num_layers=2)
    validate_spec_config(ok, "local")
    for bad, says in (({"window_size": (16, 16)}, "right window must be 0"),
                      ({"window_attn_skip_freq": [1, 0, 1]}, "3 entries but the model has 2 layers")):
        with pytest.raises(UnsupportedLayerSpecError, match=re_escape(says)):
            validate_spec_config(types.SimpleNamespace(**{**vars(ok), **bad}), "local")


# ----------------------------------------------------------------------------------------------- the cost model

def test_attended_pairs_are_the_band_and_the_triangle():
    assert attended_pairs(8) == 32
    assert attended_pairs(8, 8) == attended_pairs(8, 100) == 32
    assert attended_pairs(8, 2) == 8 * 2 - 2  # s W - W^2/2
    assert attended_pairs(4096, 1024) / attended_pairs(4096) == pytest.approx(7 / 16)
    assert flash_attention_flops(2, 4096, 4096, 128, causal=True, backward=False, window=1024) == \
        pytest.approx(4 * 2 * 128 * attended_pairs(4096, 1024))
    assert flash_attention_flops(2, 4096, 4096, 128, causal=True, backward=False, window=None) == \
        pytest.approx(4 * 2 * 128 * 4096 * 4096 / 2)


def _plan(**kw):
    base = dict(num_gpus=8, seq_length=16384, global_batch_size=32, tensor_model_parallel_size=2,
                micro_batch_size=1, ckpt="ours")
    return Plan(**{**base, **kw})


def test_the_window_prices_the_band_and_saves_no_memory():
    system = get_system("h100-sxm")
    full, mistral = get_model("llama3-8b"), get_model("mistral-7b")
    assert mistral.window_size == 4096 and mistral.windowed_layers == 32
    same_shape = dataclasses.replace(mistral, window_size=None)
    r = kernel_rates(system)
    a_win = attention_seconds(mistral, _plan(), system, r)
    a_full = attention_seconds(same_shape, _plan(), system, r)
    # at s = 16384 the band holds 7/16 of the triangle's pairs (2 W/s - (W/s)^2); the launch stays, and so does the
    # fused kernel's fixed work per query row (auto on Hopper is cuDNN's), K0 keys' work for each of the s queries
    s, k0 = 16384, r.fused_row_overhead_keys
    assert k0 > 0
    for part in ("fwd", "bwd"):
        launch = r.launch_s
        assert (a_win[part] - launch) / (a_full[part] - launch) == pytest.approx(
            (7 / 16 * s * s / 2 + k0 * s) / (s * s / 2 + k0 * s), rel=1e-9)
    flash = dataclasses.replace(_plan(), attention_backend="flash")  # FlashAttention: the pairs alone
    for part in ("fwd", "bwd"):
        assert (attention_seconds(mistral, flash, system, r)[part] - r.launch_s) / (
            attention_seconds(same_shape, flash, system, r)[part] - r.launch_s) == pytest.approx(7 / 16, rel=1e-9)
    half = dataclasses.replace(mistral, window_attn_skip_freq=2)  # every other layer full
    a_half = attention_seconds(half, _plan(), system, r)
    assert a_half["fwd"] == pytest.approx((a_win["fwd"] + a_full["fwd"]) / 2)
    e_win, e_full = estimate(mistral, _plan(), system), estimate(same_shape, _plan(), system)
    assert e_win.iteration_time_s < e_full.iteration_time_s
    assert e_win.stages == e_full.stages
    # a window as long as the sequence is causal attention: the same estimate
    covering = estimate(dataclasses.replace(mistral, window_size=16384), _plan(), system)
    assert covering.iteration_time_s == e_full.iteration_time_s
    del full


def test_model_flops_count_the_band():
    m = get_model("mistral-7b")
    full = dataclasses.replace(m, window_size=None)
    s = 16384
    drop = 3 * 4 * m.query_hidden_size * m.num_layers * (attended_pairs(s) - attended_pairs(s, 4096)) / s
    assert model_flops_per_token(full, s) - model_flops_per_token(m, s) == pytest.approx(drop)
    assert model_flops_per_token(m, 4096) == model_flops_per_token(full, 4096)


def test_context_parallelism_with_a_window_is_refused():
    system = get_system("h100-sxm")
    with pytest.raises(InvalidPlanError, match="sliding-window attention"):
        validate_plan(get_model("mistral-7b"), _plan(context_parallel_size=2), system)
    validate_plan(get_model("llama3-8b"), _plan(context_parallel_size=2), system)


def test_model_spec_checks_the_pattern_against_the_layers():
    with pytest.raises(ValueError, match="window_attn_skip_freq has 2 entries but the model has 4 layers"):
        ModelSpec("m", 4, 64, 4, 4, 128, 100, window_size=8, window_attn_skip_freq=(1, 0))
    assert ModelSpec("m", 4, 64, 4, 4, 128, 100, window_size=8, window_attn_skip_freq=[1, 0, 1, 0]).windowed_layers == 2


# ----------------------------------------------------------------------------------------------- h3t-plan

ESTIMATE = ["estimate", "--num-gpus", "8", "--gpu", "h100-sxm", "--seq-length", "16384", "--global-batch-size", "32",
            "--tensor-model-parallel-size", "2", "--ckpt", "ours"]


def test_h3t_plan_reads_the_window_flags(capsys):
    plain = run_json([*ESTIMATE, "--model", "llama3-8b"], capsys)
    windowed = run_json([*ESTIMATE, "--model", "llama3-8b", "--window-size", "4096,0"], capsys)
    pattern = run_json([*ESTIMATE, "--model", "llama3-8b", "--window-size", "4096,0", "--window-attn-skip-freq",
                        "[1,1,1,0]*8"], capsys)
    t = [r["iteration_time_s"] for r in (plain, windowed, pattern)]
    assert t[1] < t[2] < t[0]


@pytest.mark.parametrize("flags,says", [
    (["--window-size", "4096,8"], "--window-size 4096,8: a GPT's attention is causal"),
    (["--window-size", "4096,0", "--window-attn-skip-freq", "[1,0]"], "--window-attn-skip-freq has 2 entries"),
    (["--window-size", "4096,0", "--context-parallel-size", "2"], "--context-parallel-size 2 with sliding-window"),
])
def test_h3t_plan_window_errors_are_one_line(capsys, flags, says):
    code, _, err = run_main([*ESTIMATE, "--model", "llama3-8b", *flags], capsys)
    assert code == 2 and err.count("\n") == 1 and says in err, err
