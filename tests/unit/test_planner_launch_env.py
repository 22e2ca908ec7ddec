"""The launch environment Megatron-LM 0.16-0.19 assert (``CUDA_DEVICE_MAX_CONNECTIONS``): one rule
(h3t_ext.planner.launch_env) that the planner prints beside each plan's flags and the driver enforces."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from h3t_ext.costmodel import Plan, get_system
from h3t_ext.planner.cli import main
from h3t_ext.planner.launch_env import ONE, UNSET, connections_refusal, describe_launch_env, launch_env_words, \
    required_connections

H100, B200 = get_system("h100-sxm"), get_system("b200")
PLAN = Plan(num_gpus=8, seq_length=4096, global_batch_size=64, micro_batch_size=1, tensor_model_parallel_size=2)


@pytest.mark.parametrize("parallel, fsdp, arch, need", [
    (True, False, 9, ONE), (True, False, 8, ONE), (True, False, 10, None), (False, False, 9, None),
    (True, False, None, None), (True, True, 9, UNSET), (False, True, 10, UNSET),
])
def test_the_rule(parallel, fsdp, arch, need):
    assert required_connections(tensor_or_context_parallel=parallel, fsdp=fsdp, arch_major=arch) == need


@pytest.mark.parametrize("system, plan, words, why", [
    (H100, PLAN, ("CUDA_DEVICE_MAX_CONNECTIONS=1",), "is 1 with tensor or context parallelism before Blackwell"),
    (H100, replace(PLAN, tensor_model_parallel_size=1, context_parallel_size=2), ("CUDA_DEVICE_MAX_CONNECTIONS=1",),
     "is 1 with"),
    (B200, PLAN, (), None),  # Blackwell: nothing asked
    (H100, replace(PLAN, tensor_model_parallel_size=1), (), None),
    (H100, replace(PLAN, tensor_model_parallel_size=1, use_distributed_optimizer=True,
                   data_parallel_sharding_strategy="optim_grads"), ("-u", "CUDA_DEVICE_MAX_CONNECTIONS"),
     "is unset or above 1 with an FSDP"),
])
def test_a_plans_launch_environment_is_the_rules(system, plan, words, why):
    assert launch_env_words(plan, system) == words
    line = describe_launch_env(words)
    assert (line == "") == (why is None)
    if why is not None:
        assert line.startswith(f"env {' '.join(words)} (Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS {why}"), line


def test_what_the_planner_prints_the_driver_accepts_and_its_opposite_it_refuses():
    """Each plan's words, applied, pass the driver's check; the other setting is refused (one rule, two readers)."""
    sizes = (("--tensor-model-parallel-size", 2), ("--context-parallel-size", 1))
    assert connections_refusal("1", sizes=sizes, fsdp_flag=None, arch_major=9) is None
    assert "needs CUDA_DEVICE_MAX_CONNECTIONS=1" in connections_refusal(None, sizes=sizes, fsdp_flag=None, arch_major=9)
    assert connections_refusal(None, sizes=sizes, fsdp_flag="--use-megatron-fsdp", arch_major=9) is None
    assert connections_refusal("1", sizes=sizes, fsdp_flag="--use-megatron-fsdp", arch_major=9).startswith(
        "--use-megatron-fsdp needs CUDA_DEVICE_MAX_CONNECTIONS unset or above 1")
    assert connections_refusal(None, sizes=(("--tensor-model-parallel-size", None),), fsdp_flag=None,
                               arch_major=9) is None  # sizes not filled yet: nothing asked of them


def test_search_prints_and_writes_each_plans_launch_environment(capsys):
    argv = ["search", "--model", "llama3-70b", "--gpu", "h100-sxm", "--num-gpus", "64", "--seq-length", "8192",
            "--global-batch-size", "128", "--top", "3"]
    assert main([*argv, "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    for p in plans:
        t, c = p["tensor_model_parallel_size"], p["context_parallel_size"]
        assert p["launch_env"] == (["CUDA_DEVICE_MAX_CONNECTIONS=1"] if max(t, c) > 1 else []), p
    assert any(p["launch_env"] for p in plans)
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.count("     env CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM asserts") == sum(
        bool(p["launch_env"]) for p in plans)


def test_estimate_prints_the_launch_environment_on_its_own_line(capsys):
    small = ["estimate", "--model", "llama3-8b", "--num-gpus", "8", "--seq-length", "8192", "--global-batch-size",
             "128", "--tensor-model-parallel-size", "2"]
    assert main([*small, "--gpu", "h100-sxm"]) == 0
    assert "launch      env CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM asserts" in capsys.readouterr().out
    assert main([*small, "--gpu", "b200", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["launch_env"] == []
