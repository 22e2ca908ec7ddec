"""Torch FSDP2 (``--use-torch-fsdp2``) in the cost model: its shards and gathered buffers in memory, its per-layer
collectives in time, Megatron-LM's rules as plan errors, its flags through the one translation, and the driver's
``--offload-alpha auto`` sized for the FSDP2 run it launches (the alpha ``h3t-plan estimate`` gives)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from h3t_ext.costmodel import InvalidPlanError, Plan, estimate, validate_plan
from h3t_ext.costmodel.data_parallel import FSDP2_EXTRA_UNITS, dp_comm, dp_exposed
from h3t_ext.costmodel.memory import fsdp_buffer_bytes, stage_state_bytes
from h3t_ext.costmodel.specs import get_model, get_system
from h3t_ext.dtypes import BF16
from h3t_ext.planner.flags import megatron_flags, plan_from_megatron_flags
from h3t_training.data.tokenizer import NullTokenizer  # the driver's V for --vocab-size 32000

MODEL, SYSTEM = get_model("llama-7b"), get_system("h100-sxm")
DDP = Plan(num_gpus=8, seq_length=4096, global_batch_size=64, use_distributed_optimizer=False)
FSDP2 = replace(DDP, use_torch_fsdp2=True)


def test_every_state_is_sharded_over_the_data_parallel_ranks():
    """Parameters, gradients and Adam's moments are 1/d of the unsharded run's, as Megatron FSDP's
    optim_grads_params shards them (the CPU stand-in's fp32 precision: no separate master copy)."""
    whole = stage_state_bytes(MODEL, replace(DDP, num_gpus=1), 0, param_bytes=4, master_weights=False)
    sharded = stage_state_bytes(MODEL, FSDP2, 0, param_bytes=4, master_weights=False)
    for kind in ("params", "grads", "optimizer"):
        assert sharded["device"][kind] == pytest.approx(whole["device"][kind] / 8, abs=1), kind
    megatron = replace(DDP, use_distributed_optimizer=True, data_parallel_sharding_strategy="optim_grads_params")
    assert stage_state_bytes(MODEL, FSDP2, 0) == stage_state_bytes(MODEL, megatron, 0)


def test_without_resharding_the_chunks_gathered_parameters_stay_until_the_backward():
    layer = MODEL.layer_params_per_rank(1)
    resharded = fsdp_buffer_bytes(MODEL, FSDP2, 0)
    kept = fsdp_buffer_bytes(MODEL, replace(FSDP2, torch_fsdp2_reshard_after_forward=False), 0)
    assert resharded == (2 + 2) * layer * BF16  # two layers gathered (computing, prefetched), two layers' gradients
    assert kept - resharded == (MODEL.num_layers - 2) * layer * BF16
    peak = {p: estimate(MODEL, p, SYSTEM).stages[0] for p in (FSDP2, DDP)}
    assert peak[FSDP2].terms["fsdp_buffers"] == resharded and "fsdp_buffers" not in peak[DDP].terms


def test_each_layer_is_gathered_and_reduced_once_per_microbatch_pass():
    """One collective per ``fully_shard`` unit (the layers, the embedding and the output layer); parameters
    all-gathered for the forward and again for the backward, once without resharding; gradients reduce-scattered
    after every microbatch: m times the traffic of one, whatever --overlap-grad-reduce says."""
    c = dp_comm(MODEL, FSDP2, SYSTEM)
    assert c.buckets == MODEL.num_layers + FSDP2_EXTRA_UNITS and c.param_seconds == c.grad_seconds > 0
    m = FSDP2.num_microbatches
    assert m == 8
    # no compute to hide behind: everything is exposed
    assert dp_exposed(MODEL, FSDP2, SYSTEM, 0.0, 0.0, 0.0) == pytest.approx(m * c.grad_seconds + 2 * m * c.param_seconds)
    kept = replace(FSDP2, torch_fsdp2_reshard_after_forward=False)
    assert dp_exposed(MODEL, kept, SYSTEM, 0.0, 0.0, 0.0) == pytest.approx(m * c.grad_seconds + m * c.param_seconds)
    # behind long enough microbatches only the last unit's reduce-scatter and all-gather are left
    hidden = dp_exposed(MODEL, FSDP2, SYSTEM, 10.0, 10.0, 10.0)
    assert hidden == pytest.approx(c.grad_seconds / c.buckets + c.param_seconds / c.buckets)


@pytest.mark.parametrize("change, words", [
    (dict(use_distributed_optimizer=True), "runs without use_distributed_optimizer"),
    (dict(use_distributed_optimizer=True, data_parallel_sharding_strategy="optim_grads"), "Megatron FSDP"),
    (dict(pipeline_model_parallel_size=2), "needs pipeline_model_parallel_size 1"),
])
def test_megatron_lms_rules_are_plan_errors(change, words):
    with pytest.raises(InvalidPlanError, match=words):
        validate_plan(MODEL, replace(FSDP2, **change), SYSTEM)
    with pytest.raises(InvalidPlanError, match="needs use_torch_fsdp2"):
        validate_plan(MODEL, replace(DDP, torch_fsdp2_reshard_after_forward=False), SYSTEM)
    with pytest.raises(InvalidPlanError, match="untied embedding"):
        validate_plan(replace(MODEL, untie_embeddings_and_output_weights=False), FSDP2, SYSTEM)


@pytest.mark.parametrize("reshard", [True, False])
def test_the_flags_round_trip(reshard):
    plan = replace(FSDP2, torch_fsdp2_reshard_after_forward=reshard)
    flags = megatron_flags(plan)
    assert "--use-torch-fsdp2" in flags and ("--torch-fsdp2-no-reshard-after-forward" in flags) is not reshard
    assert "--use-distributed-optimizer" not in flags
    assert plan_from_megatron_flags(flags, num_gpus=8, seq_length=4096) == plan


def test_driver_auto_alpha_is_the_planners_for_an_fsdp2_run(capsys):
    """--offload-alpha auto through the driver sizes alpha for the FSDP2 run it launches: the alpha of ``h3t-plan
    estimate --use-torch-fsdp2`` for the same flags (without FSDP2's shards the budget would call for another)."""
    from h3t_ext.planner.cli import main as plan_main
    from h3t_training.config.sections import parse_args

    model = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--ffn-hidden-size",
             "11008", "--seq-length", "4096", "--global-batch-size", "16", "--micro-batch-size", "2", "--ckpt", "no"]

    def planned(*extra) -> dict:
        capsys.readouterr()
        assert plan_main(["estimate", *model, "--vocab-size", str(NullTokenizer(32000).vocab_size), "--num-gpus", "8", "--gpu", "h800", "--json",
                          "--no-sequence-parallel", "--untie-embeddings-and-output-weights", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    low, high = (planned("--use-torch-fsdp2", "--offload-alpha", a)["peak_memory_bytes"] for a in ("1", "0"))
    unsharded = planned("--no-use-distributed-optimizer", "--offload-alpha", "0")["peak_memory_bytes"]
    assert low < high < unsharded
    budget = str(int((low + high) / 2))
    expected = planned("--use-torch-fsdp2", "--memory-budget", budget, "--offload-alpha", "auto")["offload_alpha"]
    config = parse_args(model + ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights", "--swiglu",
                                 "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--tokenizer-type",
                                 "NullTokenizer", "--vocab-size", "32000", "--offload-alpha", "auto", "--memory-budget",
                                 budget, "--gpu", "h800"], world_size=8)
    assert 0.0 < config.offload_alpha < 1.0
    assert config.offload_alpha == pytest.approx(expected, abs=1e-12)
