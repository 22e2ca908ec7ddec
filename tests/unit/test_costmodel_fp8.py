"""FP8 in the cost model: GEMM rates, cast traffic, memory terms against hand-computed bytes, refusals."""
from __future__ import annotations

from dataclasses import replace

import pytest

from h3t_ext.costmodel import InvalidPlanError, ModelSpec, Plan, estimate, get_system, validate_plan
from h3t_ext.costmodel import fp8
from h3t_ext.costmodel.activations import activation_bytes_per_layer_token
from h3t_ext.costmodel.kernels import elementwise_seconds, gemm_seconds, kernel_rates
from h3t_ext.costmodel.memory import stage_memory
from h3t_ext.costmodel.timing import layer_time
from h3t_ext.planner.flags import megatron_flags, plan_from_megatron_flags
from h3t_ext.planner.translate import plan_from_args

H100 = get_system("h100-sxm")
# a small model: h 1024, 8 heads (4 query groups), f 2816, SwiGLU, 4 layers
SMALL = ModelSpec(name="small", num_layers=4, hidden_size=1024, num_attention_heads=8, num_query_groups=4,
                  ffn_hidden_size=2816, vocab_size=32000)
BASE = Plan(num_gpus=2, seq_length=2048, global_batch_size=4, tensor_model_parallel_size=2)
FP8 = replace(BASE, fp8="hybrid")


def test_fp8_gemm_is_the_bf16_gemm_scaled_by_the_rates():
    r = replace(kernel_rates(H100), tile_overhead_k=0.0)  # the pure K loop: time scales with the rate alone
    m = n = k = 16384  # compute bound, whole tiles and waves alike for both precisions
    bf16, f8 = gemm_seconds(m, n, k, r) - r.launch_s, gemm_seconds(m, n, k, r, fp8=True) - r.launch_s
    ratio = (H100.peak_bf16_flops * H100.efficiency("gemm_peak_fraction")) / (
        H100.peak_fp8_flops * H100.efficiency("gemm_fp8_peak_fraction"))
    assert f8 == pytest.approx(bf16 * ratio, rel=1e-12)
    assert 0.45 < ratio < 0.55  # 1979 vs 989 TFLOP/s at fractions 0.58 vs 0.59


def test_fp8_tile_overhead_keeps_its_bf16_time():
    r = kernel_rates(H100)
    m, n, k = 4096, 4096, 512  # thin K: the epilogue's share matters
    tiles = -(-m // r.tile_m) * -(-n // r.tile_n)
    waves = -(-tiles // r.sms)
    expect = waves * 2.0 * r.tile_m * r.tile_n * (k / r.fp8_sm_flops + r.tile_overhead_k / r.sm_flops) + r.launch_s
    assert gemm_seconds(m, n, k, r, fp8=True) == pytest.approx(expect, rel=1e-12)


def test_layer_time_adds_exactly_the_gemm_saving_and_the_casts():
    r = kernel_rates(H100)
    bf, f8 = layer_time(SMALL, BASE, H100), layer_time(SMALL, FP8, H100)
    T, t, h, hkv, f = 2048, 2, 1024, 512, 2816
    gemms = ((T, (h + 2 * hkv) // t, h), (T, h, h // t), (T, 2 * f // t, h), (T, h, f // t))
    fwd_saving = sum(gemm_seconds(m, n, k, r) - gemm_seconds(m, n, k, r, fp8=True) for m, n, k in gemms)
    cast_fwd = elementwise_seconds(T * (h + h // t + h + f // t) * 4, r, kernels=4)  # read bf16, write fp8 + transpose
    assert f8.fwd == pytest.approx(bf.fwd - fwd_saving + cast_fwd, rel=1e-12)
    cast_bwd = elementwise_seconds(T * ((h + 2 * hkv) // t + h + 2 * f // t + h) * 4, r, kernels=4)
    assert fp8.cast_seconds(SMALL, FP8, r) == pytest.approx((cast_fwd, cast_bwd), rel=1e-12)
    assert f8.bwd < bf.bwd  # the dgrad and wgrad GEMMs at the FP8 rate outweigh the gradients' casts


def test_recipes_differ_by_their_scaling_traffic():
    r = kernel_rates(H100)
    delayed = fp8.cast_seconds(SMALL, FP8, r)
    current = fp8.cast_seconds(SMALL, replace(FP8, fp8_recipe="tensorwise"), r)
    fwd_elems, _ = fp8.cast_elements(SMALL, FP8)
    # current scaling: one more read of every input (2 bytes) and one more kernel per tensor
    assert current[0] - delayed[0] == pytest.approx(fwd_elems * 2 / r.hbm + 4 * r.launch_s, rel=1e-9)
    blockwise = fp8.cast_seconds(SMALL, replace(FP8, fp8_recipe="blockwise"), r)
    assert blockwise[0] - delayed[0] == pytest.approx(fwd_elems * 8 / 128 / r.hbm, rel=1e-9)


def test_fp8_saved_inputs_hand_computed():
    h, hkv, f, heads = 1024, 512, 2816, 8
    bf = activation_bytes_per_layer_token(SMALL, "no")
    q = activation_bytes_per_layer_token(SMALL, "no", fp8=True)
    assert bf["total"] == 2 * (h + h + h + 2 * hkv + h + h + h + 2 * f + f) + 4 + heads * 4 + 4
    assert q["swiglu_output"] == 0  # FC2 keeps its FP8 copy; the activation's bf16 output is freed
    assert (q["norm1_output"], q["norm2_output"], q["fc2_input"], q["projection_input_fp8"]) == (h, h, f, h)
    assert q["attention_output"] == 2 * h  # flash attention keeps its bf16 output
    assert bf["total"] - q["total"] == h + h + f - h
    with pytest.raises(ValueError):
        activation_bytes_per_layer_token(SMALL, "no", layer_spec="local", fp8=True)


def test_fp8_weight_copies_and_param_gather_hand_computed():
    layers, t = 4, 2
    gemm_w = layers * (2 * 1024 * 1024 + 2 * 1024 * 512 + 3 * 1024 * 2816) // t
    bf = stage_memory(SMALL, BASE, 0, 0.0).terms
    q = stage_memory(SMALL, FP8, 0, 0.0).terms
    assert q["fp8_weight_cache"] == 2 * gemm_w  # FP8 copy + transpose
    assert q["weights"] == bf["weights"]
    assert q["fp8_scaling_state"] == layers * 4 * 5 * (2 + 1) * 4
    g = stage_memory(SMALL, replace(FP8, fp8_param_gather=True), 0, 0.0).terms
    assert g["weights"] == bf["weights"] - gemm_w  # GEMM weights held at 1 byte
    assert g["fp8_weight_cache"] == gemm_w  # only the transpose
    assert g["grads"] == bf["grads"] and g["optimizer_states"] == bf["optimizer_states"]  # fp32 main params/grads
    tokens_local = 2048 // t
    assert bf["activations"] - q["activations"] == tokens_local * layers * (1024 + 1024 + 2816 - 1024)


@pytest.mark.parametrize("gpu", ["a100-80g", "a800"])
def test_fp8_refused_on_ampere(gpu):
    with pytest.raises(InvalidPlanError, match=r"^--fp8-format needs FP8 tensor cores .*peak_fp8_flops 0\)$"):
        validate_plan(SMALL, FP8, get_system(gpu))


@pytest.mark.parametrize("kw, needle", [
    (dict(fp8="hybrid", fp8_recipe="mxfp8"), "--fp8-recipe mxfp8 needs Blackwell"),
    (dict(fp8="e5m2"), "--fp8-format must be one of e4m3, hybrid, got 'e5m2'"),
    (dict(fp8="hybrid", fp8_recipe="nvfp4"), "--fp8-recipe must be one of delayed, tensorwise, blockwise, mxfp8"),
    (dict(fp8_param_gather=True), "--fp8-param-gather needs --fp8-format"),
    (dict(fp8="e4m3", transformer_impl="local"), "needs --transformer-impl transformer_engine"),
])
def test_bad_fp8_values_are_one_line(kw, needle):
    with pytest.raises(InvalidPlanError) as e:
        validate_plan(SMALL, replace(BASE, **kw), H100)
    assert needle in e.value.reason and "\n" not in e.value.reason


def test_fp8_estimate_is_faster_and_the_translation_defaults_to_bf16():
    model = get_model_65b()
    plan = Plan(num_gpus=64, seq_length=4096, global_batch_size=64, tensor_model_parallel_size=8,
                pipeline_model_parallel_size=4)
    bf = estimate(model, plan, H100, timeline=False)
    q = estimate(model, replace(plan, fp8="hybrid"), H100, timeline=False)
    assert 1.1 < q.tokens_per_second / bf.tokens_per_second < 1.6
    off = plan_from_args({"seq_length": 4096, "global_batch_size": 64}, num_gpus=64)
    assert (off.fp8, off.fp8_recipe, off.fp8_param_gather) == (None, "delayed", False)  # Megatron's defaults
    on = plan_from_args({"seq_length": 4096, "global_batch_size": 64, "fp8": "e4m3", "fp8_recipe": "tensorwise",
                         "fp8_param_gather": True}, num_gpus=64)
    assert (on.fp8, on.fp8_recipe, on.fp8_param_gather) == ("e4m3", "tensorwise", True)


@pytest.mark.parametrize("kw", [dict(fp8="hybrid"), dict(fp8="e4m3", fp8_recipe="blockwise", fp8_param_gather=True),
                                dict()])
def test_fp8_flags_round_trip(kw):
    plan = replace(Plan(num_gpus=16, seq_length=4096, global_batch_size=32, tensor_model_parallel_size=2,
                        pipeline_model_parallel_size=2), **kw)
    flags = megatron_flags(plan)
    assert ("--fp8-format" in flags) == bool(kw)
    switches = [f for f in flags if f.startswith("--")]
    assert len(switches) == len(set(switches)), flags  # each flag once (--fp8-param-gather was printed twice)
    assert plan_from_megatron_flags(flags, num_gpus=16, seq_length=4096) == plan


def get_model_65b():
    from h3t_ext.costmodel import get_model
    return get_model("llama-65b")


def test_nemo_reference_copy_states_its_source_and_settings():
    from h3t_ext.costmodel.published import REFERENCE_DIR, published_runs, settings
    import json
    ref = json.loads((REFERENCE_DIR / "nemo_fp8_h100.json").read_text())
    assert ref["commit"].startswith("0b8a80ee") and "NeMo 24.07" in ref["nemo_version"] and ref["not_stated"]
    assert len(ref["rows"]) == 12  # every pre-training row copied; 7 have a model shape here
    runs = published_runs("nemo_fp8_h100")
    assert len(runs) == 7 and all(r.plan.fp8 == "hybrid" and r.plan.fp8_param_gather for r in runs)
    assert "bf16_with_fp8_mixed" in settings()["sources"]["nemo_fp8_h100"]["assumed"]
    # VP chunks per rank -> layers per virtual stage: GPT3-175B p 8 VP 6 -> 2, Llama 3 70B p 4 VP 5 -> 4
    by = {r.label.split()[0] + str(r.plan.num_gpus): r.plan for r in runs}
    assert by["GPT3-175B128"].num_layers_per_virtual_pipeline_stage == 2
    assert by["LLAMA3-70B64"].num_layers_per_virtual_pipeline_stage == 4
    assert by["LLAMA2-7B8"].num_layers_per_virtual_pipeline_stage is None
