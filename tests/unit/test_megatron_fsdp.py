"""Megatron FSDP (``--use-megatron-fsdp --data-parallel-sharding-strategy S``): refused on the CPU path in one line
(megatron-core 0.16.1's MegatronFSDP needs CUDA), run on a GPU through megatron-core's FullyShardedDataParallel
adapter as Megatron-LM's ``get_model`` wraps the chunks, priced in the Plan the driver logs, and refused in one line
under the combinations it cannot run. The GPU and TransformerEngine are faked by replacing the driver's two probes;
the GPU tier (tests/gpu/test_gpu_driver.py) trains through it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from h3t_training.config.run_spec import model_spec, run_plan
from h3t_training.config.sections import parse_args
from h3t_training.loop import gpu_wrap
from parse_harness import error_body, fake_device

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--bf16",
        "--use-distributed-optimizer"]
FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--data-parallel-sharding-strategy"]
"""Megatron FSDP as Megatron-LM 0.16-0.19 take it: with the checkpoint format they require (the strategy follows)."""


def _gpu(monkeypatch) -> None:
    fake_device(monkeypatch, gpu=True, te=True)


def test_on_the_cpu_path_it_is_one_line_naming_why(monkeypatch, capsys):
    fake_device(monkeypatch, gpu=False, te=False)
    body = error_body([*BASE, *FSDP, "optim_grads_params"], capsys)
    assert body.startswith("--use-megatron-fsdp is not supported: megatron-core 0.16.1's MegatronFSDP needs CUDA")
    assert body.endswith("and this run has no GPU (on a GPU it runs through megatron-core's FullyShardedDataParallel; "
                         "on CPU use --use-torch-fsdp2, or --use-distributed-optimizer for optim)")


@pytest.mark.parametrize("on_gpu", [False, True])
def test_a_sharding_strategy_without_megatron_fsdp_is_refused(monkeypatch, capsys, on_gpu):
    """Megatron-LM would shard nothing: the run a user asked for must not silently be another."""
    fake_device(monkeypatch, gpu=on_gpu, te=on_gpu)
    body = error_body([*BASE, "--data-parallel-sharding-strategy", "optim_grads"], capsys)
    assert body.startswith("--data-parallel-sharding-strategy optim_grads is Megatron FSDP's and needs "
                           "--use-megatron-fsdp")


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_on_a_gpu_it_reaches_megatron_cores_ddp_config_and_the_plan(monkeypatch, strategy):
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    from h3t_ext.costmodel.memory import stage_state_bytes

    _gpu(monkeypatch)
    config = parse_args([*BASE, *FSDP, strategy], world_size=2)
    ddp = gpu_wrap.ddp_config_for(config)
    assert ddp.use_megatron_fsdp and ddp.data_parallel_sharding_strategy == strategy and ddp.use_distributed_optimizer
    assert gpu_wrap.data_parallel_wrapper(config) is FullyShardedDataParallel
    plain = parse_args(BASE, world_size=2)
    assert gpu_wrap.data_parallel_wrapper(plain) is DistributedDataParallel
    assert not gpu_wrap.ddp_config_for(plain).use_megatron_fsdp

    # the logged prediction prices the sharding the run asks for ('optim' is the distributed optimizer's)
    plan = run_plan(config, on_gpu=True)
    assert plan.data_parallel_sharding_strategy == (None if strategy == "optim" else strategy)
    model = model_spec(config, 512)
    sharded, whole = stage_state_bytes(model, plan, 0), stage_state_bytes(model, run_plan(plain, on_gpu=True), 0)
    halves = {"optim": (), "optim_grads": ("grads",), "optim_grads_params": ("grads", "params")}[strategy]
    for kind in ("params", "grads"):
        want = whole["device"][kind] / 2 if kind in halves else whole["device"][kind]
        assert sharded["device"][kind] == pytest.approx(want, rel=1e-3), kind


@pytest.mark.parametrize("release, strategy", [((0, 16), "no_shard"), ((0, 17), "no_shard"),
                                               ((0, 18), "optim_grads_params"), ((0, 19), "optim_grads_params")])
def test_left_out_the_strategy_is_the_installed_releases_default(monkeypatch, release, strategy):
    """Megatron-LM changed --data-parallel-sharding-strategy's default in 0.18 (no_shard -> optim_grads_params): a
    GPU run with --use-megatron-fsdp alone shards what the Megatron-LM of its megatron-core would, and prices it."""
    from h3t_training import megatron_release

    _gpu(monkeypatch)
    monkeypatch.setattr(megatron_release, "installed_megatron_core", lambda: release)
    config = parse_args([*BASE, "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"], world_size=2)
    assert config.data_parallel_sharding_strategy == strategy
    assert gpu_wrap.ddp_config_for(config).data_parallel_sharding_strategy == strategy
    assert run_plan(config, on_gpu=True).data_parallel_sharding_strategy == (
        None if strategy == "no_shard" else strategy)
    assert parse_args(BASE, world_size=2).data_parallel_sharding_strategy == "no_shard"  # no Megatron FSDP


def test_the_installed_release_is_read_from_megatron_cores_metadata():
    from importlib.metadata import version

    from h3t_training.megatron_release import default_sharding_strategy, installed_megatron_core

    assert installed_megatron_core() == tuple(int(p) for p in version("megatron-core").split(".")[:2])
    assert default_sharding_strategy((0, 16)) == "no_shard" and default_sharding_strategy((1, 0)) == "optim_grads_params"


@pytest.mark.parametrize("extra, what", [
    ([a for a in BASE if a != "--use-distributed-optimizer"], "no --use-distributed-optimizer"),
    ([*BASE, "--use-torch-fsdp2", "--untie-embeddings-and-output-weights"], "--use-torch-fsdp2"),
    ([*BASE, "--use-precision-aware-optimizer", "--optimizer-cpu-offload"], "--optimizer-cpu-offload"),
    ([*BASE, "--save", "{tmp}"], "--save (Megatron-LM saves Megatron FSDP only as --ckpt-format fsdp_dtensor"),
    ([*BASE, "--load", "{tmp}"], "--load (Megatron FSDP's parameters load only from --ckpt-format fsdp_dtensor"),
    ([*BASE, "--megatron-fsdp-main-grads-dtype", "fp32"], "--megatron-fsdp-main-grads-dtype (a Megatron FSDP tuning"),
])
def test_on_a_gpu_what_it_cannot_run_with_is_one_line(monkeypatch, capsys, tmp_path, extra, what):
    _gpu(monkeypatch)
    argv = [str(tmp_path) if a == "{tmp}" else a for a in extra]
    body = error_body([*argv, *FSDP, "optim_grads_params"], capsys)
    assert body.startswith(f"--use-megatron-fsdp is not supported with {what}"), body


def test_on_a_gpu_it_needs_the_checkpoint_format_megatron_lm_needs(monkeypatch, capsys):
    """Megatron-LM's validate_args asserts --ckpt-format fsdp_dtensor with --use-megatron-fsdp (0.16-0.19): the same
    command line is refused here in one line naming the flag, so a line this driver takes also starts Megatron-LM."""
    _gpu(monkeypatch)
    body = error_body([*BASE, "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"], capsys)
    assert body.startswith("--use-megatron-fsdp needs --ckpt-format fsdp_dtensor (got torch_dist): Megatron-LM runs "
                           "Megatron FSDP with no other checkpoint format"), body
    body = error_body([*BASE, "--use-megatron-fsdp", "--ckpt-format", "torch", "--data-parallel-sharding-strategy",
                       "optim"], capsys)
    assert body.startswith("--use-megatron-fsdp needs --ckpt-format fsdp_dtensor (got torch)"), body


@pytest.mark.parametrize("on_gpu", [False, True])
def test_the_fsdp_checkpoint_format_without_megatron_fsdp_is_refused(monkeypatch, capsys, on_gpu):
    """Megatron-LM takes --ckpt-format fsdp_dtensor only with Megatron FSDP ("only tested with Megatron FSDP")."""
    fake_device(monkeypatch, gpu=on_gpu, te=on_gpu)
    body = error_body([*BASE, "--ckpt-format", "fsdp_dtensor"], capsys)
    assert body == ("--ckpt-format fsdp_dtensor is Megatron FSDP's checkpoint format and needs --use-megatron-fsdp "
                    "(Megatron-LM refuses it without); use --ckpt-format torch_dist"), body


def test_each_chunk_is_wrapped_as_megatron_lm_wraps_it(monkeypatch):
    """Every chunk in the adapter with the run's DDP config, bucketing only on the first (Megatron-LM's
    ``disable_bucketing=(model_chunk_idx > 0)``), and the no-sync, finalize and loss-scale hooks in the model config."""
    _gpu(monkeypatch)
    config = parse_args([*BASE, *FSDP, "optim_grads", "--pipeline-model-parallel-size", "2",
                         "--num-layers-per-virtual-pipeline-stage", "1"], world_size=2)
    made = []

    class Recorder:
        def __init__(self, *, config, ddp_config, module, disable_bucketing):
            self.ddp_config, self.module, self.disable_bucketing = ddp_config, module, disable_bucketing
            self.no_sync = object()
            made.append(self)

    monkeypatch.setattr(gpu_wrap, "data_parallel_wrapper", lambda args: Recorder)
    scale_loss = object()
    monkeypatch.setattr(gpu_wrap, "MegatronOptimizerAdapter",
                        lambda wrapped, args, cfg: SimpleNamespace(wrapped=wrapped, opt=SimpleNamespace(scale_loss=scale_loss)))
    tf_config = SimpleNamespace()
    chunks = [SimpleNamespace(config=tf_config), SimpleNamespace(config=tf_config)]
    wrapped, optimizer = gpu_wrap.wrap_for_gpu(config, chunks)
    assert [w.module for w in wrapped] == chunks and optimizer.wrapped == wrapped
    assert tf_config.grad_scale_func is scale_loss  # Megatron-LM's train(): the loss carries the optimizer's scale
    assert [w.disable_bucketing for w in made] == [False, True]
    assert all(w.ddp_config.use_megatron_fsdp and w.ddp_config.data_parallel_sharding_strategy == "optim_grads"
               for w in made)
    assert tf_config.no_sync_func == [w.no_sync for w in made]
    assert tf_config.finalize_model_grads_func is gpu_wrap.finalize_model_grads


@pytest.mark.parametrize("precision, checked", [(["--fp16"], False), (["--fp16", "--loss-scale", "1024"], True),
                                                (["--bf16"], True)])
def test_fp16_dynamic_loss_scaling_turns_the_nan_check_off_as_megatron_lm(monkeypatch, precision, checked):
    """megatron-core's DDP raises at a NaN gradient when check_for_nan_in_grad is set; with --fp16's dynamic loss
    scale an overflow is a skipped step, so Megatron-LM's validate_args turns the check off there (a GPU fp16 run
    stopped at its first overflow before)."""
    _gpu(monkeypatch)
    config = parse_args([*[a for a in BASE if a != "--bf16"], *precision], world_size=1)
    assert gpu_wrap.ddp_config_for(config).check_for_nan_in_grad is checked
