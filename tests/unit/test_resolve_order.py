"""The resolve steps that price the model (Megatron's offload flags mapped through the cost model, ``--auto-plan``)
run after the steps that check what they price: a bad shape or layer spec is the same one line with them as without
them, never a ValueError from the cost model's ModelSpec (found by random command lines)."""
from __future__ import annotations

import pytest

from h3t_training.config import feature_checks
from parse_harness import error_body, fake_device

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--bf16"]
PRICING = [[], ["--auto-plan"], ["--fine-grained-activation-offloading", "--offload-modules", "attn_norm"],
           ["--cpu-offloading-num-layers", "1"]]


@pytest.mark.parametrize("pricing", PRICING)
@pytest.mark.parametrize("bad, line", [
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups 3 does not divide "
                                                             "--num-attention-heads 4"),
    (["--max-position-embeddings", "-1"], "--max-position-embeddings -1 is outside [1, inf)"),
    (["--max-position-embeddings", "32"], "--seq-length 64 is outside [1, --max-position-embeddings 32]"),
])
def test_a_bad_shape_is_one_line_whatever_prices_it(capsys, pricing, bad, line):
    assert error_body([*BASE, *bad, *pricing], capsys) == line


@pytest.mark.parametrize("pricing", PRICING)
def test_a_layer_spec_the_gpu_cannot_build_is_one_line_whatever_prices_it(monkeypatch, capsys, pricing):
    fake_device(monkeypatch, gpu=True, te=False)
    monkeypatch.setattr(feature_checks, "cuda_device_count", lambda: 8)
    body = error_body([*BASE, "--transformer-impl", "transformer_engine", *pricing], capsys)
    assert body == ("--transformer-impl is not supported: on a GPU with the value transformer_engine it runs through "
                    "TransformerEngine (megatron-core's TE layers), and TransformerEngine is not importable here "
                    "(instead: install TransformerEngine, or leave the flag out)"), body  # once: no step reads it


def test_a_refused_flag_is_left_out_of_the_resolve_steps_and_their_problems_still_join_the_line(monkeypatch, capsys):
    """The flag table's refusal and the resolve steps' first problem are one line, and no step reads a refused
    flag (the layer-spec step, which reads --transformer-impl, does not say the table's refusal again)."""
    fake_device(monkeypatch, gpu=True, te=False)
    monkeypatch.setattr(feature_checks, "cuda_device_count", lambda: 8)
    body = error_body([*BASE, "--transformer-impl", "transformer_engine", "--max-position-embeddings", "32"], capsys)
    assert body.startswith("--transformer-impl is not supported: on a GPU with the value transformer_engine")
    assert body.endswith("(instead: install TransformerEngine, or leave the flag out); --seq-length 64 is outside "
                         "[1, --max-position-embeddings 32]"), body
    assert body.count("TransformerEngine is not importable here") == 1, body


def test_auto_plan_keeps_context_parallelism_off_where_the_gpu_builds_the_local_attention(monkeypatch):
    """megatron-core's local attention takes context parallel size 1 only: on a GPU without TransformerEngine the
    auto-plan searches c = 1 (validation would refuse any other)."""
    from h3t_training.config.sections import parse_args
    fake_device(monkeypatch, gpu=True, te=False)
    monkeypatch.setattr(feature_checks, "cuda_device_count", lambda: 8)
    monkeypatch.setenv(feature_checks.CONNECTIONS_VAR, "1")
    argv = ["--num-layers", "8", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "32768",
            "--max-position-embeddings", "32768", "--global-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
            "--mock-data", "--bf16", "--auto-plan", "--gpu", "h100-sxm"]  # one sequence on 8 GPUs: t c p = 8
    assert parse_args(argv, world_size=8, ranks_per_node=8).context_parallel_size == 1
    fake_device(monkeypatch, gpu=True, te=True)  # with TransformerEngine's attention the best plan splits the sequence
    monkeypatch.setenv(feature_checks.CONNECTIONS_VAR, "1")
    assert parse_args(argv, world_size=8, ranks_per_node=8).context_parallel_size > 1


def test_a_plan_auto_plan_chose_that_needs_the_launch_variable_says_so(monkeypatch, capsys):
    """On Hopper the best plan of a one-sequence run splits it over GPUs (t or c > 1), which Megatron-LM starts only
    with CUDA_DEVICE_MAX_CONNECTIONS=1: without it the line says the sizes are --auto-plan's and how to plan without."""
    fake_device(monkeypatch, gpu=True, te=True)
    monkeypatch.setattr(feature_checks, "cuda_device_count", lambda: 8)
    argv = ["--num-layers", "8", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "32768",
            "--max-position-embeddings", "32768", "--global-batch-size", "1", "--train-iters", "2", "--lr", "1e-3",
            "--mock-data", "--bf16", "--auto-plan", "--gpu", "h100-sxm"]
    body = error_body(argv, capsys, world_size=8)
    assert "needs CUDA_DEVICE_MAX_CONNECTIONS=1 in the launch environment" in body and body.endswith(
        "(the sizes of the plan --auto-plan chose; or give --tensor-model-parallel-size 1 --context-parallel-size 1 "
        "to keep its search to plans without)"), body
    from h3t_training.config.sections import parse_args
    config = parse_args([*argv, "--tensor-model-parallel-size", "1", "--context-parallel-size", "1"], world_size=8)
    assert (config.tensor_model_parallel_size, config.context_parallel_size) == (1, 1)


@pytest.mark.parametrize("argv, line", [
    (["--auto-plan", "--offload-alpha", "1.5"], "--offload-alpha 1.5 is outside [0, 1]"),
    (["--auto-plan", "--offload-alpha", "x"], "--offload-alpha 'x' is not a number"),
    (["--auto-plan", "--overlap-param-gather"], "--overlap-param-gather needs --overlap-grad-reduce"),
    (["--auto-plan", "--use-megatron-fsdp", "--overlap-param-gather"], "--overlap-param-gather needs "
                                                                       "--overlap-grad-reduce"),
    (["--auto-plan", "--recompute-granularity", "full", "--recompute-method", "block"],
     "--auto-plan searches --ckpt no|full|ours (or --recompute-granularity alone); it cannot keep "
     "--recompute-granularity full --recompute-method block --recompute-num-layers 1: give the parallel flags "
     "yourself, or leave those out"),
])
def test_what_auto_plan_prices_is_checked_before_it(monkeypatch, capsys, argv, line):
    """--auto-plan prices the offload fraction, the overlaps and the recompute it is given: each is checked first (a
    ValueError of the alpha parser, the cost model's plan check, the search's constraints, found by random command
    lines)."""
    fake_device(monkeypatch, gpu=True, te=False)
    monkeypatch.setattr(feature_checks, "cuda_device_count", lambda: 8)
    assert error_body([*BASE, *argv], capsys).startswith(line)


@pytest.mark.parametrize("pricing", PRICING)
def test_an_attention_backend_the_spec_does_not_run_is_one_line_whatever_prices_it(monkeypatch, capsys, pricing):
    fake_device(monkeypatch, gpu=True, te=True)
    monkeypatch.setattr(feature_checks, "cuda_device_count", lambda: 8)
    monkeypatch.setenv(feature_checks.CONNECTIONS_VAR, "1")
    assert error_body([*BASE, "--attention-backend", "local", *pricing], capsys).startswith(
        "--attention-backend local on a GPU is megatron-core's local attention")
