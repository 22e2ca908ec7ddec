"""The resolve steps that price the model (Megatron's offload flags mapped through the cost model, ``--auto-plan``)
run after the steps that check what they price: a bad shape or layer spec is the same one line with them as without
them, never a ValueError from the cost model's ModelSpec (found by random command lines)."""
from __future__ import annotations

import pytest

from h3t_training.config import feature_checks
from parse_harness import error_body, fake_device

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--bf16"]
PRICING = [[], ["--auto-plan"], ["--offload-modules", "attn_norm"], ["--cpu-offloading-num-layers", "1"]]


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
    assert body.endswith("--transformer-impl transformer_engine needs TransformerEngine, and TransformerEngine is not "
                         "importable here"), body


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
