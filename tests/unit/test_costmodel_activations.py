"""Saved-activation accounting and its pricing over the schedule builder's action lists."""
from dataclasses import replace

import pytest

from h3t_ext.costmodel import (
    ModelSpec, Plan, activation_bytes_per_layer_token, get_model, stage_activation_peak_bytes, stage_memory,
)
from h3t_ext.costmodel.activations import _closed_form, _walk_schedule, residency_lines
from h3t_ext.schedule import build_schedule


@pytest.mark.parametrize("name", ["llama-65b", "llama2-70b", "llama3-8b"])
def test_design_formulas_bf16_te(name):
    m = get_model(name)
    h, hkv, f = m.hidden_size, m.kv_hidden_size, m.ffn_hidden_size
    extra = 4 * m.num_attention_heads + 8  # softmax logsumexp (fp32 per head) + two fp32 rstd
    assert activation_bytes_per_layer_token(m, "no")["total"] == 12 * h + 4 * hkv + 6 * f + extra
    # an op-by-op SwiGLU's product keeps its factors: silu(gate) (legacy), and linear + offset (megatron-core)
    for impl, mlp in (("legacy", 8 * f), ("unfused", 10 * f)):
        assert activation_bytes_per_layer_token(m, "no", activation_impl=impl)["total"] == 12 * h + 4 * hkv + mlp + extra
    for impl in ("fused", "legacy", "unfused"):  # ckpt=ours runs its own MLP, whatever the fusion
        ours = activation_bytes_per_layer_token(m, "ours", activation_impl=impl)["total"]
        assert ours == 8 * h + 4 * hkv + 4 * f + extra
    assert activation_bytes_per_layer_token(m, "full")["total"] == 2 * h


def test_ratio_no_over_ours_65b():
    """The ATC '24 runs (Megatron-Kwai's legacy model) and megatron-core's fused SwiGLU."""
    m = get_model("llama-65b")
    ours = activation_bytes_per_layer_token(m, "ours")["total"]
    assert activation_bytes_per_layer_token(m, "no", activation_impl="legacy")["total"] / ours == pytest.approx(
        1.648, abs=0.002)
    assert activation_bytes_per_layer_token(m, "no")["total"] / ours == pytest.approx(1.412, abs=0.002)


def test_fc2_saves_the_activation_output_it_is_given():
    """TransformerEngine's linear saves the tensor it is given (no cast in bf16): the SwiGLU output is one tensor on
    both specs; only an unfused SwiGLU on the TE spec (megatron-core's MLP) adds its factors, never the local spec
    (h3t-ext's runtime saves what the fused kernel saves)."""
    m = get_model("llama-7b")
    f = m.ffn_hidden_size
    te = activation_bytes_per_layer_token(m, "no", dtype_bytes=4, layer_spec="te")
    local = activation_bytes_per_layer_token(m, "no", dtype_bytes=4, layer_spec="local")
    assert te == local
    assert local["fc2_input"] == 0 and local["swiglu_output"] == 4 * f
    for impl, extra in (("legacy", 4 * f), ("unfused", 8 * f)):
        te_impl = activation_bytes_per_layer_token(m, "no", dtype_bytes=4, layer_spec="te", activation_impl=impl)
        assert te_impl["total"] - te["total"] == extra, impl
        assert activation_bytes_per_layer_token(m, "no", dtype_bytes=4, layer_spec="local",
                                                activation_impl=impl) == local
    gelu = replace(m, swiglu=False)  # a GeLU MLP saves the same fused or not
    assert activation_bytes_per_layer_token(gelu, "no", activation_impl="unfused") == \
        activation_bytes_per_layer_token(gelu, "no")
    # breakdown sums to the total
    assert sum(v for k, v in local.items() if k != "total") == local["total"]


def test_bad_arguments():
    m = get_model("llama-7b")
    with pytest.raises(ValueError):
        activation_bytes_per_layer_token(m, "some")
    with pytest.raises(ValueError):
        activation_bytes_per_layer_token(m, "no", layer_spec="apex")


def test_closed_form_equals_builder_walk():
    """The closed form used for large schedules is exactly what walking the builder's lists gives."""
    for p in range(1, 11):
        for v in range(1, 5):
            if p == 1 and v > 1:
                continue
            ms = range(1, 3 * p + 2) if v == 1 else range(p, 4 * p + 1, p)
            for m in ms:
                assert _closed_form(p, m, v) == _walk_schedule(p, m, v), (p, m, v)


@pytest.mark.parametrize("p,v,m", [(4, 2, 8), (8, 5, 16), (8, 5, 136), (10, 4, 20), (4, 10, 36)])
def test_first_stage_reduces_to_design_formula(p, v, m):
    """Activation memory of the first stage is A (N - (N - 4) alpha), N = 2(p-1) + (v-1)p + 1."""
    model = get_model("llama-65b")
    L = model.num_layers
    layers_per_virtual = L // (p * v) if L % (p * v) == 0 else None
    if layers_per_virtual is None:
        pytest.skip("layers not divisible")
    n = 2 * (p - 1) + (v - 1) * p + 1
    plan0 = Plan(num_gpus=2 * p * 4, seq_length=4096, global_batch_size=4 * m, tensor_model_parallel_size=2,
                 pipeline_model_parallel_size=p, num_layers_per_virtual_pipeline_stage=layers_per_virtual, ckpt="ours")
    a_chunk = stage_activation_peak_bytes(model, plan0)[0] / n
    for alpha in (0.0, 0.25, 0.5, 1.0):
        got = stage_activation_peak_bytes(model, plan0.with_alpha(alpha))[0]
        assert got == pytest.approx(a_chunk * (n - (n - 4) * alpha), rel=1e-9)


def test_peak_in_flight_matches_builder():
    for p, m, v in [(4, 8, 2), (2, 4, 1), (4, 4, 1), (3, 9, 3)]:
        s = build_schedule(p, m, v)
        for r in range(p):
            full, off = residency_lines(p, m, v, r)[0]
            assert full + off == s.peak_in_flight(r)


def test_activation_memory_linear_in_alpha_and_monotone_in_stage():
    model = get_model("llama-65b")
    plan = Plan(num_gpus=256, seq_length=4096, global_batch_size=256, tensor_model_parallel_size=2,
                pipeline_model_parallel_size=8, num_layers_per_virtual_pipeline_stage=2, ckpt="no")
    a0, a5, a1 = (stage_activation_peak_bytes(model, plan.with_alpha(a)) for a in (0.0, 0.5, 1.0))
    for s in range(8):
        assert a5[s] == pytest.approx((a0[s] + a1[s]) / 2, rel=1e-6)
        assert a1[s] < a0[s]
    assert list(a0) == sorted(a0, reverse=True)  # earlier stages hold more chunks


def test_no_sequence_parallel_is_larger():
    model = get_model("llama-7b")
    plan = Plan(num_gpus=8, seq_length=2048, global_batch_size=8, tensor_model_parallel_size=2,
                pipeline_model_parallel_size=4)
    sp = stage_activation_peak_bytes(model, plan)
    nosp = stage_activation_peak_bytes(model, plan, sequence_parallel=False)
    assert all(b > a for a, b in zip(sp, nosp))


@pytest.mark.parametrize("hidden_dropout", [0.0, 0.1])
def test_stage_memory_activations_match_the_activation_peak_with_the_local_spec(hidden_dropout):
    """stage_memory's activation terms (saved activations, the reload double buffer, the last stage's output
    layer) are stage_activation_peak_bytes, RoPE's saved cos/sin of the 'local' spec and the dropout masks
    (the first stage's embedding mask too) included."""
    model = ModelSpec(name="llama-local", num_layers=8, hidden_size=1024, num_attention_heads=8, num_query_groups=8,
                      ffn_hidden_size=4096, vocab_size=8192, untie_embeddings_and_output_weights=True,
                      hidden_dropout=hidden_dropout)
    plan = Plan(num_gpus=2, seq_length=2048, global_batch_size=16, micro_batch_size=2, pipeline_model_parallel_size=2,
                num_layers_per_virtual_pipeline_stage=2, ckpt="ours", offload_alpha=0.5, sequence_parallel=False,
                use_distributed_optimizer=False, transformer_impl="local")
    peaks = stage_activation_peak_bytes(model, plan, layer_spec="local", sequence_parallel=False)
    for stage, peak in enumerate(peaks):
        terms = stage_memory(model, plan, stage, 0.5).terms
        assert terms["activations"] + terms["offload_reload_buffer"] + terms.get("output_layer_activations", 0) == peak
    if hidden_dropout:
        plain = stage_activation_peak_bytes(replace(model, hidden_dropout=0.0), plan, layer_spec="local",
                                            sequence_parallel=False)
        assert peaks[0] - plain[0] > peaks[1] - plain[1] > 0  # the embedding's mask lives on the first stage


def test_uneven_stages_price_their_own_layers():
    """With --decoder-first/last-pipeline-num-layers each stage's chunk holds its own layers: the activation
    peaks are stage_memory's activation terms stage by stage, and the 2-layer first stage's chunk is 2/6 of a
    6-layer middle stage's."""
    from h3t_ext.costmodel.activations import microbatch_chunk_bytes
    model = ModelSpec(name="uneven", num_layers=10, hidden_size=1024, num_attention_heads=8, num_query_groups=8,
                      ffn_hidden_size=4096, vocab_size=8192)
    plan = Plan(num_gpus=3, seq_length=2048, global_batch_size=12, micro_batch_size=1, pipeline_model_parallel_size=3,
                decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=2, ckpt="no",
                sequence_parallel=False, use_distributed_optimizer=False)
    peaks = stage_activation_peak_bytes(model, plan, sequence_parallel=False)
    for stage, peak in enumerate(peaks):
        terms = stage_memory(model, plan, stage, 0.0).terms
        assert terms["activations"] + terms["offload_reload_buffer"] + terms.get("output_layer_activations", 0) == peak
    assert 3 * microbatch_chunk_bytes(model, plan, 0, sequence_parallel=False) == \
        microbatch_chunk_bytes(model, plan, 1, sequence_parallel=False)


def test_an_fp8_plan_prices_its_stage_peaks_with_fp8_saved_inputs_as_the_memory_model_does():
    from h3t_ext.costmodel.memory import chunk_activation_bytes

    model = get_model("llama-65b")
    plan = Plan(num_gpus=64, seq_length=4096, global_batch_size=64, tensor_model_parallel_size=2,
                pipeline_model_parallel_size=4, ckpt="no")
    fp8 = replace(plan, fp8="hybrid")
    bf16_peaks, fp8_peaks = stage_activation_peak_bytes(model, plan), stage_activation_peak_bytes(model, fp8)
    assert all(f < b for f, b in zip(fp8_peaks, bf16_peaks))
    # at alpha 0 without interleaving the first stage holds p chunks: the memory model's A, p times
    assert fp8_peaks[0] == 4 * chunk_activation_bytes(model, fp8, 0)
    assert bf16_peaks[0] == 4 * chunk_activation_bytes(model, plan, 0)


def test_swiglu_fusion_is_priced_in_memory_and_time():
    """--no-bias-swiglu-fusion (megatron-core's op-by-op SwiGLU): two more f-wide saved tensors per token and layer
    and more element-wise traffic; the legacy model's (the ATC '24 runs): one more saved tensor, timed as the fused
    kernel (elementwise.LEGACY_GLU_TIMED_AS_FUSED). A GeLU model reads neither."""
    from h3t_ext.costmodel import estimate, get_system
    from h3t_ext.costmodel.activations import mlp_activation_impl
    from h3t_ext.planner.translate import plan_from_args

    m, system = get_model("llama3-8b"), get_system("h100-sxm")
    plan = Plan(num_gpus=8, seq_length=8192, global_batch_size=8, tensor_model_parallel_size=2)
    runs = {impl: estimate(m, replace(plan, **kw), system, timeline=False) for impl, kw in (
        ("fused", {}), ("unfused", {"bias_activation_fusion": False}), ("legacy", {"use_legacy_models": True}))}
    f = m.ffn_hidden_size
    per_layer = {k: activation_bytes_per_layer_token(m, "no", activation_impl=k)["total"] for k in runs}
    assert per_layer["unfused"] - per_layer["fused"] == 2 * 2 * f and per_layer["legacy"] - per_layer["fused"] == 2 * f
    assert runs["unfused"].peak_memory_bytes > runs["legacy"].peak_memory_bytes > runs["fused"].peak_memory_bytes
    assert runs["unfused"].iteration_time_s > runs["fused"].iteration_time_s * 1.005
    assert runs["legacy"].iteration_time_s == runs["fused"].iteration_time_s
    gelu = replace(m, swiglu=False)
    assert estimate(gelu, replace(plan, bias_activation_fusion=False), system, timeline=False).iteration_time_s == \
        estimate(gelu, plan, system, timeline=False).iteration_time_s
    # the one translation: Megatron's --no-bias-swiglu-fusion (dest bias_swiglu_fusion) -> the plan's field
    read = plan_from_args({"seq_length": 8192, "global_batch_size": 8, "bias_swiglu_fusion": False, "ckpt": "no"},
                          num_gpus=8)
    assert read.bias_activation_fusion is False and mlp_activation_impl(read) == "unfused"
    assert plan_from_args({"seq_length": 8192, "global_batch_size": 8, "ckpt": "no"}, num_gpus=8).bias_activation_fusion
