"""Megatron-LM's activation offload flags as h3t-ext's alpha (h3t_ext/costmodel/megatron_offload.py), the driver's
resolve steps (one notice, one-line refusals) and ``h3t-plan estimate`` pricing the same alpha."""
from __future__ import annotations

import pytest

from h3t_ext.costmodel import ModelSpec, Plan
from h3t_ext.costmodel.megatron_offload import MegatronOffload, MegatronOffloadError, fine_grained_alpha, \
    layer_offload_alpha
from h3t_ext.planner.args import build_parser
from h3t_ext.planner.from_args import model_from_args, plan_from_args
from h3t_training.config.sections import parse_args

H, HEADS, F, L, S, B = 64, 4, 128, 4, 32, 2
MODEL = ModelSpec(name="t", num_layers=L, hidden_size=H, num_attention_heads=HEADS, num_query_groups=HEADS,
                  ffn_hidden_size=F, vocab_size=256, swiglu=True)
TOKENS = B * S  # t = c = 1


def _plan(**kw) -> Plan:
    return Plan(num_gpus=1, micro_batch_size=B, seq_length=S, global_batch_size=B, sequence_parallel=False, **kw)


def _local_layer_bytes(d: int) -> int:
    """One layer's saved bytes, local spec, SwiGLU, no dropout, by hand: per token 7 h-wide tensors (layer input,
    norm outputs, q, attention output, norm2 input; k and v are 2 more), two fp32 rstd, fp32 lse per head, FC1's
    2f output and the SwiGLU output f (FC2's input is the same tensor); plus RoPE's cos and sin (4 s d)."""
    per_token = (6 * H + 2 * H) * d + 2 * 4 + HEADS * 4 + 2 * F * d + F * d
    return TOKENS * per_token + 4 * S * (H // HEADS) * d


def _te_layer_bytes(d: int) -> int:
    """The TE spec keeps no RoPE tables (FC2 saves the SwiGLU output it is given, as on the local spec)."""
    return TOKENS * ((8 * H) * d + 8 + HEADS * 4 + 3 * F * d)


def fg(*modules, **kw) -> MegatronOffload:
    return MegatronOffload(fine_grained_activation_offloading=True, offload_modules=modules, **kw)


def test_attention_modules_without_size_filter_offload_q_k_v_lse_and_the_output():
    m = fine_grained_alpha(MODEL, _plan(), fg("core_attn", "attn_proj", min_offloaded_tensor_size=0),
                           dtype_bytes=4, layer_spec="local", dropout_mask_bytes=4)
    moved = TOKENS * (4 * H * 4 + HEADS * 4)  # q, k, v, output (fp32) + lse
    assert m.layer_bytes == _local_layer_bytes(4)
    assert m.offloaded_bytes == moved
    assert m.alpha == pytest.approx(moved / _local_layer_bytes(4))


def test_the_size_filter_drops_the_small_tensors():
    # q, k, v and the output have B*S*H elements, the lse B*S*HEADS: a filter between them keeps the lse on device
    m = fine_grained_alpha(MODEL, _plan(), fg("core_attn", "attn_proj", min_offloaded_tensor_size=TOKENS * H),
                           dtype_bytes=4, layer_spec="local", dropout_mask_bytes=4)
    assert m.alpha == pytest.approx(TOKENS * 4 * H * 4 / _local_layer_bytes(4))
    assert [x.term for x in m.tensors if not x.counted] == ["softmax_lse"]
    assert fine_grained_alpha(MODEL, _plan(), fg("core_attn", "attn_proj"), dtype_bytes=4,
                              layer_spec="local").alpha == 0.0  # Megatron's default 1M elements: nothing here


def test_the_fraction_scales_alpha():
    full = fine_grained_alpha(MODEL, _plan(), fg("core_attn", "attn_proj", min_offloaded_tensor_size=0))
    half = fine_grained_alpha(MODEL, _plan(), fg("core_attn", "attn_proj", min_offloaded_tensor_size=0,
                                                 activation_offload_fraction=0.5))
    assert half.alpha == pytest.approx(0.5 * full.alpha) and full.alpha > 0


def test_core_attention_alone_leaves_its_output_held_by_the_projection():
    alone = fine_grained_alpha(MODEL, _plan(), fg("core_attn", min_offloaded_tensor_size=0))
    assert alone.offloaded_bytes == TOKENS * (3 * H * 2 + HEADS * 4)  # q, k, v (bf16) + lse; not the output


def test_te_spec_skips_the_fused_norms_where_the_local_spec_offloads_them():
    te = fine_grained_alpha(MODEL, _plan(), fg("attn_norm", "mlp_norm", min_offloaded_tensor_size=0))
    assert te.alpha == 0.0 and te.skipped_modules == ("attn_norm", "mlp_norm")
    local = fine_grained_alpha(MODEL, _plan(), fg("attn_norm", min_offloaded_tensor_size=0), dtype_bytes=4,
                               layer_spec="local", dropout_mask_bytes=4)
    assert local.alpha == pytest.approx(TOKENS * (H * 4 + 4) / _local_layer_bytes(4))  # input + rstd
    # qkv_linear on TE holds the fused norm's input, rstd and output
    qkv = fine_grained_alpha(MODEL, _plan(), fg("qkv_linear", min_offloaded_tensor_size=0))
    assert qkv.layer_bytes == _te_layer_bytes(2)
    assert qkv.alpha == pytest.approx(TOKENS * (2 * H * 2 + 4) / _te_layer_bytes(2))


def test_layer_offload_is_whole_leading_layers():
    assert layer_offload_alpha(MODEL, _plan(), MegatronOffload(cpu_offloading_num_layers=3)).alpha == 0.75


@pytest.mark.parametrize("request_,plan_kw,message", [
    (fg("expert_fc1"), {}, "--offload-modules expert_fc1 is not supported"),
    (fg("fused_group_mlp"), {}, "--offload-modules fused_group_mlp is not supported"),
    (fg("gdp_qkv"), {}, "--offload-modules gdp_qkv is not supported"),
    (fg("attn_proj"), {}, "attn_proj needs core_attn"),
    (fg("mlp"), {}, "not a module Megatron-LM offloads"),
    (fg(), {}, "needs --offload-modules"),
    (MegatronOffload(offload_modules=("core_attn",)), {}, "needs --fine-grained-activation-offloading"),
    (fg("core_attn", delta_offload_bytes_across_pp_ranks=1 << 30), {}, "--delta-offload-bytes-across-pp-ranks"),
    (fg("core_attn", activation_offload_fraction=1.5), {}, "--activation-offload-fraction 1.5 is outside [0, 1]"),
    (fg("core_attn", min_offloaded_tensor_size=-1), {}, "--min-offloaded-tensor-size -1 is outside"),
    (fg("core_attn"), {"ckpt": "full"}, "not mapped with --recompute-granularity full"),
    (MegatronOffload(cpu_offloading_num_layers=4), {}, "--cpu-offloading-num-layers 4 is outside [0, 3]"),
    (MegatronOffload(cpu_offloading_num_layers=1), {"pipeline_model_parallel_size": 2, "num_gpus": 2},
     "not supported with --pipeline-model-parallel-size 2"),
    (MegatronOffload(cpu_offloading_num_layers=1), {"ckpt": "full"}, "does not work with --recompute-granularity"),
    (MegatronOffload(True, ("core_attn",), cpu_offloading_num_layers=1), {}, "cannot be enabled with"),
])
def test_refusals_are_one_line(request_, plan_kw, message):
    plan = _plan(**{k: v for k, v in plan_kw.items() if k != "num_gpus"}) if "num_gpus" not in plan_kw else \
        Plan(micro_batch_size=B, seq_length=S, global_batch_size=2 * B, sequence_parallel=False, **plan_kw)
    fn = layer_offload_alpha if request_.cpu_offloading_num_layers and not request_.fine_grained_activation_offloading \
        else fine_grained_alpha
    with pytest.raises(MegatronOffloadError) as e:
        fn(MODEL, plan, request_)
    assert message in str(e.value) and "\n" not in str(e.value)


DRIVER = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
          "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--mock-data"]
FG = ["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "attn_proj"]


def test_the_driver_runs_the_mapped_alpha_with_one_notice():
    config = parse_args(DRIVER + FG + ["--min-offloaded-tensor-size", "0", "--activation-offload-fraction", "0.5"])
    notes = [n for n in config.flag_notices if "--fine-grained-activation-offloading" in n]
    assert len(notes) == 1 and f"runs as --offload-alpha {config.offload_alpha:.3f}" in notes[0]
    assert 0 < config.offload_alpha < 0.5
    zero = parse_args(DRIVER + FG)  # every tensor of this tiny model is under Megatron's 1M-element filter
    assert zero.offload_alpha == 0.0
    assert any("Megatron-LM would offload nothing either" in n for n in zero.flag_notices)
    layers = parse_args(DRIVER + ["--cpu-offloading-num-layers", "1"])
    assert layers.offload_alpha == 0.25


@pytest.mark.parametrize("flags,message", [
    (FG + ["--offload-alpha", "0.2"], "are two offload requests"),
    (FG + ["--kaimm-offload-activation-ratio", "0.2"], "are two offload requests"),
    (FG + ["--auto-plan"], "not supported with --auto-plan"),
    (FG + ["--transformer-impl", "local"], "needs --transformer-impl transformer_engine"),
    (["--offload-modules", "core_attn"], "needs --fine-grained-activation-offloading"),
    (["--fine-grained-activation-offloading", "--offload-modules", "moe_act"], "--offload-modules moe_act is not"),
    (["--fine-grained-activation-offloading", "--offload-modules", "attn_proj"], "attn_proj needs core_attn"),
    (FG + ["--delta-offload-bytes-across-pp-ranks", "1024"], "--delta-offload-bytes-across-pp-ranks 1024 is not"),
    (["--cpu-offloading-num-layers", "1", "--pipeline-model-parallel-size", "2"], "--cpu-offloading-num-layers 1 is"),
    (["--distribute-saved-activations"], "--distribute-saved-activations is not supported"),
])
def test_driver_refusals_are_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(DRIVER + flags, world_size=2)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_estimate_prices_the_alpha_the_mapping_gives():
    argv = ["estimate", "--model", "llama-7b", "--num-gpus", "8", "--seq-length", "4096", "--global-batch-size", "8",
            "--micro-batch-size", "1", *FG, "--activation-offload-fraction", "0.5"]
    ns = build_parser().parse_args(argv)
    model = model_from_args(ns)
    plan = plan_from_args(ns, model=model)
    no_offload = plan_from_args(ns)
    m = fine_grained_alpha(model, no_offload, fg("core_attn", "attn_proj", activation_offload_fraction=0.5))
    assert plan.offload_alpha == pytest.approx(m.alpha) and m.alpha > 0 and no_offload.offload_alpha == 0.0
