"""The cost model's terms of Megatron's recompute flags (h3t_ext.costmodel.recompute): saved bytes and recompute
time of full uniform/block with N layers and of selective modules, their limits (block with every layer is
ckpt=full, nothing recomputed is ckpt=no), the one-line refusals, and the round trip through megatron_flags."""
from __future__ import annotations

import dataclasses
import re

import pytest

from h3t_ext.ckpt import Ckpt, Recompute, normal_form
from h3t_ext.costmodel import Plan, get_model, get_system
from h3t_ext.costmodel.activations import activation_bytes_per_layer_token, microbatch_chunk_bytes
from h3t_ext.costmodel.errors import InvalidPlanError
from h3t_ext.costmodel.plan_checks import validate_plan
from h3t_ext.costmodel.timing import layer_time

MODEL = get_model("llama2-70b")
SYSTEM = get_system("h100-sxm")
BASE = Plan(num_gpus=64, global_batch_size=128, seq_length=4096, micro_batch_size=1, tensor_model_parallel_size=8,
            pipeline_model_parallel_size=8)  # 80 layers: 10 per stage


def _plan(ckpt="no", **flags) -> Plan:
    ckpt, recompute = normal_form(ckpt, Recompute.parse(**flags))
    return dataclasses.replace(BASE, ckpt=ckpt, recompute=recompute)


def _chunk(plan) -> int:
    return microbatch_chunk_bytes(MODEL, plan)


def test_block_with_every_layer_is_full_and_uniform_1():
    full = _chunk(_plan("full"))
    assert _chunk(_plan(granularity="full", method="block", num_layers=10)) == full
    assert _chunk(_plan(granularity="full", method="block", num_layers=80)) == full  # N beyond the chunk: all
    assert _chunk(_plan(granularity="full", method="uniform", num_layers=1)) == full


def test_block_is_linear_in_its_layers():
    """Block N: N layers keep their input, 10 - N keep everything (N = 0 would be ckpt=no)."""
    no, full = _chunk(_plan()), _chunk(_plan("full"))
    for n in (1, 3, 7):
        assert _chunk(_plan(granularity="full", method="block", num_layers=n)) == pytest.approx(
            no + n * (full - no) / 10, rel=1e-12)


def test_uniform_keeps_one_input_per_unit():
    full = _chunk(_plan("full"))
    assert _chunk(_plan(granularity="full", method="uniform", num_layers=5)) == full // 5
    assert _chunk(_plan(granularity="full", method="uniform", num_layers=10)) == full // 10


def test_uniform_that_does_not_divide_is_an_infeasible_plan():
    with pytest.raises(InvalidPlanError, match="--recompute-num-layers 3 must divide the 10 layers") as e:
        validate_plan(MODEL, _plan(granularity="full", method="uniform", num_layers=3), SYSTEM)
    assert "\n" not in str(e.value)


def test_selective_modules_drop_their_terms():
    no = activation_bytes_per_layer_token(MODEL, "no")
    tokens = BASE.seq_length // 8  # sequence parallel
    layers = 10
    drops = {"layernorm": ("norm1_output", "norm2_output", "norm1_rstd", "norm2_rstd"),
             "mlp": ("fc1_output", "swiglu_output", "fc2_input"), "core_attn": ("softmax_lse",)}
    for module, terms in drops.items():
        got = _chunk(_plan(granularity="selective", modules=[module]))
        assert _chunk(_plan()) - got == layers * tokens * sum(no[k] for k in terms), module
    both = _chunk(_plan(granularity="selective", modules=["layernorm", "mlp"]))
    assert _chunk(_plan()) - both == layers * tokens * sum(no[k] for k in drops["layernorm"] + drops["mlp"])


def test_ours_with_block_recomputes_some_layers_whole():
    ours, full = _chunk(_plan("ours")), _chunk(_plan("full"))
    assert _chunk(_plan("ours", granularity="full", method="block", num_layers=4)) == pytest.approx(
        ours + 4 * (full - ours) / 10, rel=1e-12)


def test_recompute_time():
    """A layer in a full unit reruns its forward; block N reruns N of 10; selective mlp reruns the FC1 and FC2
    forward GEMMs, core_attn the attention core's forward, layernorm nothing priced."""
    full = layer_time(MODEL, _plan("full"), SYSTEM)
    assert full.recompute == full.fwd and full.tp_recompute == full.tp_fwd
    block = layer_time(MODEL, _plan(granularity="full", method="block", num_layers=4), SYSTEM)
    assert block.recompute == pytest.approx(0.4 * full.fwd) and block.tp_recompute == pytest.approx(0.4 * full.tp_fwd)
    assert layer_time(MODEL, _plan(granularity="full", method="uniform", num_layers=5), SYSTEM).recompute == full.fwd
    assert layer_time(MODEL, _plan(granularity="selective", modules=["layernorm"]), SYSTEM).recompute == 0.0
    mlp = layer_time(MODEL, _plan(granularity="selective", modules=["mlp"]), SYSTEM).recompute
    core = layer_time(MODEL, _plan(granularity="selective"), SYSTEM).recompute
    both = layer_time(MODEL, _plan(granularity="selective", modules=["mlp", "core_attn"]), SYSTEM).recompute
    assert 0 < core < mlp < full.fwd  # Llama2-70B at s=4096: the MLP's GEMMs outweigh the attention core
    assert both == pytest.approx(mlp + core)


@pytest.mark.parametrize("flags,message", [
    (dict(granularity="selective", modules=["moe_act"]), "--recompute-modules moe_act recomputes MoE layers"),
    (dict(granularity="selective", modules=["mla_up_proj"]), "--recompute-modules mla_up_proj needs multi-latent"),
    (dict(granularity="selective", modules=["attn"]), "--recompute-modules 'attn' is not one of"),
    (dict(granularity="selective", num_layers=2), "--recompute-num-layers needs --recompute-granularity full"),
    (dict(granularity="selective", method="uniform"), "--recompute-method uniform needs --recompute-granularity full "
                                                      "(Megatron-LM asserts"),
    (dict(granularity="full", num_layers=0), "--recompute-num-layers 0 is outside [1, inf)"),
])
def test_bad_flags_are_one_line(flags, message):
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        Recompute.parse(**flags)
    assert "\n" not in str(e.value)


def test_without_a_granularity_the_other_flags_are_ignored_as_megatron_does():
    assert Recompute.parse(method="block", num_layers=2, modules=["mlp"]) == Recompute()
    assert Recompute.parse(num_layers=1) == Recompute() and not Recompute.parse(method="uniform").full


def test_contradictions_with_ckpt():
    with pytest.raises(ValueError, match="--ckpt full contradicts --recompute-granularity full --recompute-method block"):
        normal_form("full", Recompute.parse("full", "block", 2))
    with pytest.raises(ValueError, match="--ckpt ours contradicts --recompute-granularity full --recompute-method uniform"):
        normal_form("ours", Recompute.parse("full"))
    assert normal_form("no", Recompute.parse("full")) == (Ckpt.FULL, Recompute())
    assert normal_form("no", Recompute.parse("selective")) == (Ckpt.SELECTIVE, Recompute())


@pytest.mark.parametrize("flags", [dict(granularity="full", method="block", num_layers=3),
                                   dict(granularity="selective", modules=["mlp", "layernorm"])])
def test_megatron_flags_round_trip(flags):
    from h3t_ext.planner.flags import megatron_flags, plan_from_megatron_flags

    plan = dataclasses.replace(_plan(**flags), sequence_parallel=True, use_distributed_optimizer=True)
    printed = megatron_flags(plan)
    assert "--recompute-granularity" in printed
    assert plan_from_megatron_flags(printed, num_gpus=plan.num_gpus, seq_length=plan.seq_length) == plan
