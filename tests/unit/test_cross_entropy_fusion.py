"""Megatron's --cross-entropy-loss-fusion / --cross-entropy-fusion-impl: priced on the last stage's output layer
(h3t_ext/costmodel/elementwise.py FUSED_CROSS_ENTROPY), carried by the one translation, printed back, and read from
the driver's flags."""
from __future__ import annotations

from dataclasses import replace

import pytest

from h3t_ext.costmodel import Plan, estimate, get_model, get_system
from h3t_ext.costmodel.elementwise import cross_entropy_seconds
from h3t_ext.costmodel.kernels import elementwise_seconds, kernel_rates
from h3t_ext.costmodel.timing import head_time
from h3t_ext.planner.cli import main
from h3t_ext.planner.flags import megatron_flags, plan_from_megatron_flags
from h3t_ext.planner.translate import plan_from_args

H100 = get_system("h100-sxm")
PLAN = Plan(num_gpus=64, seq_length=8192, global_batch_size=128, tensor_model_parallel_size=4,
            pipeline_model_parallel_size=8)


def test_fused_cross_entropy_moves_fewer_bytes_by_hand():
    r = kernel_rates(H100)
    tokens, shard = 8192, 32064
    logits = tokens * shard
    assert cross_entropy_seconds(tokens, shard, r, backward=False, fusion="native") == pytest.approx(
        elementwise_seconds(logits * (2 + 4 + 4 + 4 + 4 + 4), r, kernels=4))
    assert cross_entropy_seconds(tokens, shard, r, backward=True, fusion="te") == pytest.approx(
        elementwise_seconds(logits * (4 + 4 + 4 + 2), r, kernels=2))
    unfused, native, te = (sum(cross_entropy_seconds(tokens, shard, r, backward=b, fusion=f) for b in (False, True))
                           for f in (None, "native", "te"))
    assert unfused > native > te


def test_the_output_layer_and_the_step_get_faster_with_the_fusion():
    m = get_model("llama3-70b")
    plain = head_time(m, PLAN, H100)
    native = head_time(m, replace(PLAN, cross_entropy_loss_fusion=True), H100)
    te = head_time(m, replace(PLAN, cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te"), H100)
    assert plain.total > native.total > te.total
    assert head_time(m, replace(PLAN, cross_entropy_fusion_impl="te"), H100) == plain  # read with the fusion only
    slow, fast = (estimate(m, replace(PLAN, cross_entropy_loss_fusion=f), H100, timeline=False) for f in (False, True))
    assert fast.iteration_time_s < slow.iteration_time_s
    assert fast.peak_memory_bytes == slow.peak_memory_bytes  # every implementation keeps 4 bytes a logit


def test_flags_round_trip_and_translation():
    plan = replace(PLAN, cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
    flags = megatron_flags(plan)
    assert " ".join(flags).count("--cross-entropy-loss-fusion --cross-entropy-fusion-impl te") == 1
    assert plan_from_megatron_flags(flags, num_gpus=64, seq_length=8192) == plan
    assert "--cross-entropy-fusion-impl" not in megatron_flags(replace(plan, cross_entropy_fusion_impl="native"))
    read = plan_from_args({"seq_length": 8192, "global_batch_size": 128, "ckpt": "no",
                           "cross_entropy_loss_fusion": True}, num_gpus=64)
    assert read.cross_entropy_loss_fusion and read.cross_entropy_fusion_impl == "native"


def test_cli_prices_the_flags_and_refuses_a_bad_impl(capsys):
    base = ["estimate", "--model", "llama3-8b", "--num-gpus", "8", "--seq-length", "8192", "--global-batch-size", "8",
            "--gpu", "h100-sxm", "--json"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"]) == 0
    fused = capsys.readouterr().out
    import json
    assert json.loads(fused)["tokens_per_second"] > json.loads(plain)["tokens_per_second"]
    assert "--cross-entropy-loss-fusion" in json.loads(fused)["megatron_flags"]
    with pytest.raises(SystemExit) as e:
        main([*base, "--cross-entropy-fusion-impl", "triton"])
    assert e.value.code == 2 and "--cross-entropy-fusion-impl" in capsys.readouterr().err


def test_the_drivers_plan_reads_the_flags():
    from h3t_training.config.run_spec import run_plan
    from h3t_training.config.sections import parse_args
    from parse_harness import BASE

    plan = run_plan(parse_args([*BASE, "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"],
                               world_size=1))
    assert plan.cross_entropy_loss_fusion and plan.cross_entropy_fusion_impl == "te"
    assert not run_plan(parse_args(BASE, world_size=1)).cross_entropy_loss_fusion
