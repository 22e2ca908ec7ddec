"""``--auto-plan`` chooses the memory options this run can run (the search's memory ladder, as
``auto_plan.runnable_ladder`` allows it): megatron-core's optimizer CPU offload on CPU and GPU, Megatron FSDP on a GPU
only and not with --save/--load; the chosen plan's flags land in the config, so the run and its logged prediction
(``run_spec.run_plan``) are the plan that was priced. The GPU is faked by replacing the driver's two probes."""
from __future__ import annotations

import pytest

from h3t_training.config.auto_plan import runnable_ladder
from h3t_training.config.run_spec import run_plan
from h3t_training.config.sections import parse_args
from parse_harness import error_body, fake_device

MODEL = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--ffn-hidden-size", "11008",
         "--seq-length", "4096", "--global-batch-size", "16", "--swiglu", "--untie-embeddings-and-output-weights",
         "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
         "32000", "--gpu", "h800", "--auto-plan", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size",
         "1"]
"""A 7B Llama on 8 ranks at t=1 p=1: the weights, fp32 gradients and distributed-optimizer shard alone need 50 GB."""


def _device(monkeypatch, gpu: bool) -> list[str]:
    fake_device(monkeypatch, gpu=gpu, te=gpu)
    return ["--bf16"] if gpu else []


def _error(argv, capsys) -> str:
    return error_body(argv, capsys, world_size=8)


def test_on_cpu_it_offloads_the_optimizer_when_nothing_else_fits(monkeypatch):
    extra = _device(monkeypatch, gpu=False)
    roomy = parse_args([*MODEL, *extra, "--memory-budget", "60GB"], world_size=8)
    assert not roomy.optimizer_cpu_offload and "--optimizer-cpu-offload" not in roomy.auto_plan_flags
    config = parse_args([*MODEL, *extra, "--memory-budget", "45GB"], world_size=8)
    assert config.optimizer_cpu_offload and config.use_precision_aware_optimizer and config.use_distributed_optimizer
    assert not config.use_megatron_fsdp  # Megatron FSDP does not run on CPU: never chosen there
    flags = list(config.auto_plan_flags)
    fraction = float(flags[flags.index("--optimizer-offload-fraction") + 1])
    assert 0.0 < fraction <= 1.0 and config.optimizer_offload_fraction == pytest.approx(fraction)
    plan = run_plan(config)  # the run's logged prediction prices the options it launches
    assert plan.optimizer_cpu_offload and plan.optimizer_offload_fraction == pytest.approx(fraction)


def test_on_a_gpu_it_shards_with_megatron_fsdp(monkeypatch):
    extra = _device(monkeypatch, gpu=True)
    config = parse_args([*MODEL, *extra, "--memory-budget", "30GB"], world_size=8)
    assert config.use_megatron_fsdp and config.data_parallel_sharding_strategy == "optim_grads_params"
    assert "--use-megatron-fsdp" in config.auto_plan_flags
    assert run_plan(config, on_gpu=True).data_parallel_sharding_strategy == "optim_grads_params"
    # with the checkpoint format Megatron-LM runs Megatron FSDP with, in the config and in the printed flags
    flags = list(config.auto_plan_flags)
    assert config.ckpt_format == "fsdp_dtensor" and flags[flags.index("--ckpt-format") + 1] == "fsdp_dtensor"
    # the printed flags, launched by hand, are the run --auto-plan made
    by_hand = parse_args([*[a for a in MODEL if a != "--auto-plan"], *extra, *flags], world_size=8)
    assert by_hand.use_megatron_fsdp and by_hand.ckpt_format == "fsdp_dtensor"
    assert run_plan(by_hand, on_gpu=True) == run_plan(config, on_gpu=True)


def test_megatron_fsdp_is_not_chosen_where_the_run_could_not_save_it(monkeypatch, capsys, tmp_path):
    extra = _device(monkeypatch, gpu=True)
    body = _error([*MODEL, *extra, "--memory-budget", "30GB", "--save", str(tmp_path)], capsys)
    assert body.startswith("--auto-plan found no plan for 8 ranks on h800: ")
    assert "weights, grads and optimizer states alone need" in body


@pytest.mark.parametrize("gpu, fixed, want", [
    (False, [], ("optimizer_cpu_offload",)),
    (True, [], ("optim_grads", "optim_grads_params", "optimizer_cpu_offload")),
    (True, ["--load", "{tmp}"], ("optimizer_cpu_offload",)),
    (True, ["--megatron-fsdp-main-grads-dtype", "fp32"], ("optimizer_cpu_offload",)),  # a refused tuning flag
    (True, ["--use-precision-aware-optimizer", "--optimizer-cpu-offload"], ()),
])
def test_the_ladder_is_what_this_run_can_run(monkeypatch, tmp_path, gpu, fixed, want):
    extra = _device(monkeypatch, gpu=gpu)
    argv = [a for a in MODEL if a != "--auto-plan"] + extra + ["--use-distributed-optimizer"]
    config = parse_args([str(tmp_path) if a == "{tmp}" else a for a in [*argv, *fixed]], world_size=8)
    got = tuple(o.data_parallel_sharding_strategy or "optimizer_cpu_offload" for o in runnable_ladder(config))
    assert got == want


def test_the_ladder_leaves_megatron_fsdp_out_where_the_launch_environment_forbids_it(monkeypatch):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (what tensor parallelism on Hopper needs) is what Megatron-LM refuses Megatron
    FSDP with: --auto-plan does not choose it there."""
    extra = _device(monkeypatch, gpu=True)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    argv = [a for a in MODEL if a != "--auto-plan"] + extra + ["--use-distributed-optimizer"]
    config = parse_args(argv, world_size=8)
    assert tuple(o.data_parallel_sharding_strategy or "optimizer_cpu_offload" for o in runnable_ladder(config)) == (
        "optimizer_cpu_offload",)


def test_auto_plan_with_torch_fsdp2_is_one_line(monkeypatch, capsys):
    extra = _device(monkeypatch, gpu=False)
    body = _error([*MODEL, *extra, "--use-torch-fsdp2"], capsys)
    assert body.startswith("--auto-plan does not search torch FSDP2 layouts")


@pytest.mark.parametrize("fixed, world_size, rule", [
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 2,
     "the world size (2) not divisible by the parallel sizes"),
    (["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--num-query-groups", "1",
      "--group-query-attention"], 8, None),
    (["--pipeline-model-parallel-size", "1", "--tensor-model-parallel-size", "4", "--num-query-groups", "2",
      "--group-query-attention"], 8, "--num-query-groups not divisible by --tensor-model-parallel-size"),
])
def test_no_valid_layout_names_the_rule_it_broke(monkeypatch, capsys, fixed, world_size, rule):
    """Where the fixed flags leave no valid layout, the one line says which divisibility rule every layout broke
    (in the driver's terms: its flags and the world size), as h3t-plan search does."""
    extra = _device(monkeypatch, gpu=False)
    assert MODEL[-4:] == ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
    argv = [*MODEL[:-4], *extra, *fixed]
    if rule is None:  # a layout exists: a plan is chosen
        assert parse_args(argv, world_size=world_size).auto_plan_flags
        return
    body = error_body(argv, capsys, world_size=world_size)
    assert body == f"--auto-plan found no plan for {world_size} ranks on h800: no valid layout ({rule})"


@pytest.mark.parametrize("gpu,world_size,batch,budget", [
    ("a100-40g", 64, 128, ["--memory-budget", "30GB"]), ("h800", 8, 16, ["--memory-budget", "45GB"]),
    ("h100-sxm", 16, 64, []),
])
def test_auto_plan_runs_the_plan_the_search_ranks_first(monkeypatch, gpu, world_size, batch, budget):
    """``--auto-plan`` (every layout free) launches the plan an exhaustive search of its constraints ranks first
    (what ``h3t-plan search`` prints first), found best-first: it prices a fraction of the exhaustive search's plans."""
    search_module = __import__("importlib").import_module("h3t_ext.planner.search")
    search, calls = search_module.search, []

    def recorded(*args, **kwargs):
        calls.append((args, kwargs, search(*args, **kwargs)))
        return calls[-1][2]

    monkeypatch.setattr(search_module, "search", recorded)
    free = MODEL[:-4]  # without the fixed t = p = 1
    free = [gpu if flag == "--gpu" else str(batch) if flag == "--global-batch-size" else a
            for flag, a in zip([None, *free], free)]
    config = parse_args([*free, *budget, *_device(monkeypatch, gpu=False)], world_size=world_size)
    (args, kwargs, result), = calls
    full = search(*args, **{**kwargs, "top": None, "exhaustive": True})
    assert config.auto_plan_flags == result.best.megatron_flags == full.best.megatron_flags
    assert result.considered < full.considered / 20  # 30-116x fewer here; the search it replaced priced 60-75%
