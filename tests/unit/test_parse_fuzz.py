"""Random command lines through the driver's parser and ``h3t-plan``, in-process: each gives a configuration (a
plan) or one line and exit status 2, never a traceback. A fixed seed keeps the draw the same in every run; the
pools mix valid values, values out of range and combinations the resolve steps refuse (the kind of line that found
four tracebacks where a ``ValueError`` escaped a resolve step)."""
from __future__ import annotations

import random

import pytest

from h3t_ext.planner import cli as planner_cli
from h3t_training.config import feature_checks
from h3t_training.config.sections import parse_args
from parse_harness import BASE, fake_device

DRIVER_POOL = {
    "--tensor-model-parallel-size": ["1", "2", "3", "0"],
    "--pipeline-model-parallel-size": ["1", "2", "4"],
    "--context-parallel-size": ["1", "2"],
    "--sequence-parallel": None,
    "--num-layers-per-virtual-pipeline-stage": ["1", "2"],
    "--micro-batch-size": ["1", "2", "3"],
    "--global-batch-size": ["8", "7", "0"],
    "--use-distributed-optimizer": None,
    "--overlap-grad-reduce": None,
    "--overlap-param-gather": None,
    "--ckpt": ["no", "ours", "full", "bogus"],
    "--recompute-granularity": ["full", "selective", "x"],
    "--recompute-method": ["uniform", "block"],
    "--recompute-num-layers": ["1", "0"],
    "--recompute-activations": None,
    "--recompute-modules": ["core_attn", "mlp", "bogus"],
    "--offload-alpha": ["0", "0.5", "1", "1.5", "x"],
    "--cpu-offloading-num-layers": ["1", "-1"],
    "--fine-grained-activation-offloading": None,
    "--offload-modules": ["attn_norm", "bogus"],
    "--activation-offload-fraction": ["0.5", "2"],
    "--bf16": None,
    "--fp16": None,
    "--fp8-format": ["e4m3", "hybrid", "e5m2"],
    "--fp8-recipe": ["delayed", "mxfp8"],
    "--fp8-param-gather": None,
    "--use-megatron-fsdp": None,
    "--use-torch-fsdp2": None,
    "--data-parallel-sharding-strategy": ["optim", "optim_grads_params", "bad"],
    "--ckpt-format": ["torch_dist", "torch", "fsdp_dtensor", "zarr"],
    "--optimizer-cpu-offload": None,
    "--optimizer-offload-fraction": ["0.5", "2"],
    "--use-precision-aware-optimizer": None,
    "--group-query-attention": None,
    "--num-query-groups": ["1", "2", "3"],
    "--ffn-hidden-size": ["0", "128"],
    "--max-position-embeddings": ["32", "64", "-1"],
    "--swiglu": None,
    "--kv-channels": ["16", "0"],
    "--auto-plan": None,
    "--transformer-impl": ["local", "transformer_engine", "x"],
    "--attention-backend": ["flash", "local", "auto"],
    "--seed": ["-1", "1"],
    "--log-memory-interval": ["3", "0"],
    "--save-retain-interval": ["2"],
    "--exit-interval": ["0", "1"],
}
DEVICES = {"cpu": dict(gpu=False, te=False), "gpu-te": dict(gpu=True, te=True), "gpu": dict(gpu=True, te=False),
           "ampere-te": dict(gpu=True, te=True, arch_major=8)}
DRAWS = 60


def _draw(rng: random.Random, pool: dict, most: int) -> list[str]:
    argv = []
    for flag in rng.sample(sorted(pool), rng.randint(1, most)):
        argv += [flag] if pool[flag] is None else [flag, rng.choice(pool[flag])]
    return argv


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_a_random_driver_command_line_is_a_config_or_one_line(monkeypatch, capsys, device):
    fake_device(monkeypatch, **DEVICES[device])
    monkeypatch.setattr(feature_checks, "cuda_device_count", lambda: 8)
    monkeypatch.setenv(feature_checks.CONNECTIONS_VAR, "1")
    rng = random.Random(f"driver-{device}")
    outcomes = {"config": 0, "error": 0}
    for _ in range(DRAWS):
        argv = [*BASE, *_draw(rng, DRIVER_POOL, 5)]
        try:
            parse_args(argv, world_size=8, ranks_per_node=8)
            outcomes["config"] += 1
        except SystemExit as e:
            err = capsys.readouterr().err.strip().splitlines()
            assert e.code == 2 and len(err) == 1 and err[0].startswith("pretrain_llama.py: error: "), (argv, err)
            outcomes["error"] += 1
        except Exception as e:  # noqa: BLE001 - the assertion names the command line
            pytest.fail(f"{' '.join(argv)}: {type(e).__name__}: {e}")
    assert min(outcomes.values()) >= DRAWS // 10, outcomes  # the draw reaches both outcomes


PLANNER_BASE = {
    "--model": ["llama2-7b", "llama3-70b", "gpt3-175b"],
    "--gpu": ["h100-sxm", "a100-80g", "b200"],
    "--num-gpus": ["8", "64"],
    "--seq-length": ["2048", "8192"],
    "--global-batch-size": ["128", "512"],
}
PLANNER_POOL = {
    "--model": ["bogus"],
    "--gpu": ["bogus"],
    "--num-gpus": ["0", "7"],
    "--seq-length": ["131072", "0"],
    "--global-batch-size": ["0", "3"],
    "--tensor-model-parallel-size": ["1", "2", "8", "3"],
    "--pipeline-model-parallel-size": ["1", "4", "5"],
    "--context-parallel-size": ["1", "2"],
    "--micro-batch-size": ["1", "2"],
    "--ckpt": ["no", "ours", "full", "x"],
    "--offload-alpha": ["0", "0.5", "2"],
    "--fp8-format": ["hybrid", "e5m2"],
    "--fp8-recipe": ["delayed", "mxfp8"],
    "--memory-budget": ["40GiB", "-1"],
    "--use-distributed-optimizer": None,
    "--sequence-parallel": None,
    "--use-megatron-fsdp": None,
    "--optimizer-cpu-offload": None,
    "--optimizer-offload-fraction": ["0.5", "2"],
    "--transformer-impl": ["local", "transformer_engine"],
    "--recompute-granularity": ["full", "selective"],
    "--num-experts": ["8", "0"],
}


@pytest.mark.parametrize("command", ["estimate", "search"])
def test_a_random_planner_command_line_is_a_plan_or_one_line(capsys, command):
    rng = random.Random(f"planner-{command}")
    codes = {0: 0, 2: 0}
    for _ in range(DRAWS // 2):
        base = [x for flag in sorted(PLANNER_BASE) for x in (flag, rng.choice(PLANNER_BASE[flag]))]
        argv = [command, *base, *_draw(rng, PLANNER_POOL, 4)]
        try:
            code = planner_cli.main(argv)
        except SystemExit as e:  # argparse's own errors (an unknown choice, a missing value)
            code = e.code
        except Exception as e:  # noqa: BLE001 - the assertion names the command line
            pytest.fail(f"h3t-plan {' '.join(argv)}: {type(e).__name__}: {e}")
        out = capsys.readouterr()
        assert code in codes, (argv, code, out.err)
        if code == 2:
            lines = out.err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("h3t-plan: error: "), (argv, out.err)
        codes[code] += 1
    assert min(codes.values()) >= DRAWS // 20, codes  # the draw reaches both outcomes
