"""On a GPU no flag that changes memory, speed or numerics is accepted and ignored: every flag the CPU run notices
has a GPU class (implemented through megatron-core, refused in one line, or a notice where its effect on a GPU is
nil), FP8 goes through TransformerEngine or is refused naming it, and the implemented flags reach megatron-core's
TransformerConfig / DDP config and the Plan the driver prices. The GPU and TransformerEngine are faked by replacing
the driver's two probes (``feature_checks.cuda_available``, ``feature_checks.transformer_engine_available``)."""
from __future__ import annotations

import sys

import pytest
import torch

from h3t_training.config import feature_checks
from h3t_training.config.flag_table import TABLE, RunDevice, reason_on
from h3t_training.config.fp8_flags import FP8_FLAGS, Fp8Flag
from h3t_training.config.gpu_flags import GPU_BY_FLAG, GPU_BY_REASON, GPU_NEUTRAL
from h3t_training.config.megatron_fields import attention_backend, ddp_fields, fp8_fields, transformer_fields
from h3t_training.config.run_spec import run_plan
from h3t_training.config.sections import parse_args
from h3t_training.loop.model_provider import transformer_config
from parse_harness import error_body, fake_device

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--bf16"]

PENDING: set = set()
"""Reasons whose GPU mapping is not decided yet (none)."""


def _gpu(monkeypatch, te: bool) -> None:
    fake_device(monkeypatch, gpu=True, te=te)


def test_every_flag_noticed_on_cpu_has_a_gpu_class_or_a_reasoned_neutral_notice():
    neutral_flags = {f for f, rule in GPU_BY_FLAG.items() if rule.cls == "noticed"}
    assert neutral_flags == {"--onnx-safe", "--use-mcore-models", "--local-rank"}
    unmapped = []
    for e in TABLE.values():
        if e.cls != "noticed" or e.key in PENDING:
            continue
        rule = e.gpu
        assert rule is not None, e.flag
        if rule.cls == "noticed":  # only the explicit, reasoned list keeps a notice on a GPU
            assert e.key in GPU_NEUTRAL or e.flag in neutral_flags, e.flag
            assert rule.text != e.reason.text or "CPU" not in rule.text, e.flag  # a reason true on a GPU
        else:
            assert rule.cls in ("implemented", "refused"), e.flag
            assert rule.text and (rule.cls == "implemented" or rule.alternative), e.flag
        unmapped += [] if rule.cls != "implemented" or rule.text.startswith("megatron-core's") else [e.flag]
    assert unmapped == []
    assert set(GPU_BY_FLAG) <= set(TABLE) and set(GPU_BY_REASON) <= {e.key for e in TABLE.values()}
    assert {TABLE[f].cls for f in GPU_BY_FLAG} == {"noticed"}  # the GPU column only changes noticed rows


def test_cpu_classes_are_unchanged_on_cpu():
    cpu = RunDevice()
    assert all(reason_on(e, cpu) == e.reason for e in TABLE.values())
    gpu = RunDevice(True, True)
    assert reason_on(TABLE["--fp8-format"], gpu).cls == "implemented"
    assert reason_on(TABLE["--tp-comm-overlap"], gpu).cls == "refused"
    assert reason_on(TABLE["--enable-cuda-graph"], gpu).cls == "refused"
    assert reason_on(TABLE["--log-memory-interval"], gpu).cls == "noticed"
    assert reason_on(TABLE["--log-params-norm"], gpu).cls == "implemented"


def test_fp8_on_a_gpu_without_transformer_engine_is_refused_naming_it(monkeypatch, capsys):
    _gpu(monkeypatch, te=False)
    body = error_body([*BASE, "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--tp-comm-overlap",
                   "--no-masked-softmax-fusion"], capsys)
    assert body.startswith("--fp8-amax-history-len, --fp8-format are not supported: on a GPU it runs through "
                           "TransformerEngine")
    assert "TransformerEngine is not importable here" in body
    assert "--tp-comm-overlap is not supported: a GPU communication" in body  # all refusals in one line
    assert "--no-masked-softmax-fusion" not in body  # implemented without TE
    # on CPU the same flags are notices, as before
    monkeypatch.setattr(feature_checks, "cuda_available", lambda: False)
    notes = parse_args([*BASE, "--fp8-format", "hybrid", "--tp-comm-overlap"], world_size=2).flag_notices
    assert ("note: --fp8-format: a low-precision (fp16/fp8/fp4) or loss-scaling setting; CPU training is float32 (an "
            "FP8 or optimizer-dtype value a GPU run would refuse is refused on CPU too)") in notes


def test_fp8_with_transformer_engine_reaches_the_transformer_config_and_the_plan(monkeypatch):
    _gpu(monkeypatch, te=True)
    args = parse_args([*BASE, "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo",
                       "max", "--fp8-param-gather", "--use-distributed-optimizer"], world_size=2)
    assert not any(n.startswith("note: --fp8") for n in args.flag_notices)
    config = transformer_config(args, on_gpu=True)
    assert (config.fp8, config.fp8_recipe, config.fp8_amax_history_len, config.fp8_amax_compute_algo,
            config.fp8_param) == ("hybrid", "delayed", 1024, "max", True)
    assert ddp_fields(args)["fp8_param_gather"] is True
    plan = run_plan(args, on_gpu=True)
    assert (plan.fp8, plan.fp8_recipe, plan.fp8_param_gather) == ("hybrid", "delayed", True)
    bf16 = run_plan(parse_args(BASE, world_size=2), on_gpu=True)
    assert bf16.fp8 is None and bf16.fp8_param_gather is False


def test_each_fp8_flag_is_one_entry_of_the_one_list():
    """The GPU column's FP8 rows are FP8_FLAGS's (no other row names an FP8 field through TransformerEngine), each
    names its TransformerConfig field, and each field is one of megatron-core's TransformerConfig."""
    import dataclasses
    from megatron.core.transformer.transformer_config import TransformerConfig
    te_fp8 = {flag for flag, rule in GPU_BY_FLAG.items() if rule.cls == "implemented" and "FP8 through" in rule.text}
    assert te_fp8 == {f.flag for f in FP8_FLAGS} and set(te_fp8) <= set(TABLE)
    for f in FP8_FLAGS:
        rule = GPU_BY_FLAG[f.flag]
        assert rule.needs_te and rule.text.startswith(f"megatron-core's TransformerConfig.{f.field}"), f.flag
    assert GPU_BY_FLAG["--fp8-param-gather"].text.startswith(
        "megatron-core's TransformerConfig.fp8_param and DistributedDataParallelConfig.fp8_param_gather (")
    assert GPU_BY_FLAG["--no-fp8-wgrad"].text.startswith("megatron-core's TransformerConfig.fp8_wgrad (False) (")
    assert {f.field for f in FP8_FLAGS} <= {x.name for x in dataclasses.fields(TransformerConfig)}
    with pytest.raises(ValueError, match="--x: read 'bool' is not one of choice, int"):
        Fp8Flag("--x", "x", "bool")


def test_every_fp8_flag_sets_its_field(monkeypatch):
    """All FP8 flags given: fp8_fields has one value per field of FP8_FLAGS, read as each entry says; none given
    (but the format): the defaults."""
    _gpu(monkeypatch, te=True)
    fmt = ["--fp8-format", "hybrid"]
    every = parse_args([*BASE, *fmt, "--fp8-recipe", "tensorwise", "--fp8-margin", "1", "--fp8-interval", "2",
                        "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max", "--fp8-param-gather",
                        "--use-distributed-optimizer", "--fp8-quantizer-factory", "pkg.factory", "--no-fp8-wgrad",
                        "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2",
                        "--num-layers-at-end-in-bf16", "3"], world_size=2)
    assert fp8_fields(every) == dict(
        fp8="hybrid", fp8_recipe="tensorwise", fp8_margin=1, fp8_interval=2, fp8_amax_history_len=16,
        fp8_amax_compute_algo="max", fp8_param=True, fp8_quantizer_factory="pkg.factory", fp8_wgrad=False,
        first_last_layers_bf16=True, num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=3)
    assert set(fp8_fields(every)) == {f.field for f in FP8_FLAGS}
    assert fp8_fields(parse_args([*BASE, *fmt], world_size=2)) == dict(
        fp8="hybrid", fp8_recipe="delayed", fp8_margin=0, fp8_interval=1, fp8_amax_history_len=1,
        fp8_amax_compute_algo="most_recent", fp8_param=False, fp8_wgrad=True, first_last_layers_bf16=False,
        num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1)
    assert fp8_fields(parse_args([*BASE, *fmt, "--disable-fp8-wgrad"], world_size=2))["fp8_wgrad"] is False
    assert fp8_fields(parse_args(BASE, world_size=2)) == {}


def test_optimizer_offload_with_fp8_parameters_needs_the_delayed_recipe(monkeypatch, capsys):
    """Megatron-LM 0.16-0.19 assert --fp8-recipe delayed for --optimizer-cpu-offload with --fp8-param-gather (its
    hybrid device optimizer): one line here too, and the delayed recipe starts."""
    _gpu(monkeypatch, te=True)
    offload = ["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--optimizer-cpu-offload",
               "--fp8-format", "hybrid", "--fp8-param-gather"]
    body = error_body([*BASE, *offload, "--fp8-recipe", "tensorwise"], capsys)
    assert body == ("--optimizer-cpu-offload with --fp8-param-gather needs --fp8-recipe delayed, got tensorwise "
                    "(Megatron-LM asserts it); valid: --fp8-recipe delayed, or leave out --fp8-param-gather"), body
    plan = run_plan(parse_args([*BASE, *offload, "--fp8-recipe", "delayed"], world_size=2), on_gpu=True)
    assert plan.optimizer_cpu_offload and plan.fp8_param_gather and plan.fp8_recipe == "delayed"


def test_fp8_parameters_need_an_optimizer_that_keeps_their_master_copy(monkeypatch, capsys):
    """Megatron-LM 0.16-0.19 assert the distributed optimizer (or either FSDP) for --fp8-param-gather; the driver and
    the cost model refuse with the same line."""
    from h3t_ext.costmodel import InvalidPlanError, Plan, estimate, get_model, get_system
    _gpu(monkeypatch, te=True)
    line = ("--fp8-param-gather needs --use-distributed-optimizer (or Megatron FSDP or torch FSDP2: Megatron-LM "
            "asserts it, the FP8 parameters need a master copy the optimizer steps)")
    assert error_body([*BASE, "--fp8-format", "hybrid", "--fp8-param-gather"], capsys) == line
    assert fp8_fields(parse_args([*BASE, "--fp8-format", "hybrid", "--fp8-param-gather",
                                  "--use-distributed-optimizer"], world_size=2))["fp8_param"] is True
    plan = Plan(num_gpus=8, seq_length=4096, global_batch_size=16, fp8="hybrid", fp8_param_gather=True,
                use_distributed_optimizer=False)
    with pytest.raises(InvalidPlanError) as e:
        estimate(get_model("llama3-8b"), plan, get_system("h100-sxm"))
    assert e.value.reason == line


def test_fusion_and_attention_flags_reach_the_transformer_config_on_a_gpu(monkeypatch):
    from megatron.core.transformer.enums import AttnBackend
    _gpu(monkeypatch, te=True)
    plain = transformer_config(parse_args(BASE, world_size=2), on_gpu=True)
    assert plain.bias_activation_fusion is True and plain.cross_entropy_loss_fusion is False
    assert plain.attention_backend == AttnBackend.auto and plain.params_dtype == torch.bfloat16
    assert parse_args(BASE, world_size=2).swiglu  # pretrain_llama.py's default MLP
    args = parse_args([*BASE, "--no-bias-swiglu-fusion", "--cross-entropy-loss-fusion", "--attention-backend",
                       "unfused"], world_size=2)
    config = transformer_config(args, on_gpu=True)
    assert config.bias_activation_fusion is False and config.cross_entropy_loss_fusion is True
    assert config.attention_backend == AttnBackend.unfused
    assert run_plan(args, on_gpu=True).attention_backend == "unfused"
    assert plain.apply_rope_fusion is False  # Megatron-Kwai's --use-fast-rope asks for the fused RoPE
    kwai = parse_args([*BASE, "--use-fast-rope", "--use-fast-rms-norm"], world_size=2)
    assert transformer_fields(kwai)["apply_rope_fusion"] is True  # (megatron-core's config then asks for TE >= 1.4)


def test_gradient_reduction_precision_reaches_the_ddp_config(monkeypatch, capsys):
    _gpu(monkeypatch, te=True)
    assert ddp_fields(parse_args(BASE, world_size=2))["grad_reduce_in_fp32"] is True
    bf16 = parse_args([*BASE, "--grad-reduce-in-bf16"], world_size=2)
    assert ddp_fields(bf16)["grad_reduce_in_fp32"] is False
    assert run_plan(bf16, on_gpu=True).grad_reduce_in_bf16 and not run_plan(parse_args(BASE, world_size=2),
                                                                            on_gpu=True).grad_reduce_in_bf16
    body = error_body([*BASE, "--exp-avg-dtype", "bf16"], capsys)
    assert body == "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer (as in Megatron-LM)"


@pytest.mark.parametrize("backend, runs", [("flash", "flash"), ("auto", "auto"), ("fused", None), ("unfused", None),
                                           ("local", None), (None, None)])
def test_the_local_spec_on_a_gpu_takes_the_attention_backends_it_runs(monkeypatch, capsys, backend, runs):
    """--transformer-impl local on a GPU builds the driver's local spec, whose core attention is PyTorch's SDPA
    (FlashAttention on a GPU): flash and auto are what runs; fused, unfused and local would be accepted and not run,
    so each is refused in one line naming the spec."""
    _gpu(monkeypatch, te=True)
    argv = [*BASE, "--transformer-impl", "local", *(["--attention-backend", backend] if backend else [])]
    if runs is None and backend is not None:
        body = error_body(argv, capsys)
        assert body == (f"--attention-backend {backend} with the local layer spec (--transformer-impl local): its "
                        "core attention is PyTorch's scaled_dot_product_attention, FlashAttention on a GPU; use flash "
                        "or auto, or TransformerEngine's spec for the others"), body
    else:
        assert attention_backend(parse_args(argv, world_size=2)) == runs


def test_an_fp16_run_keeps_megatrons_fp16_gradients_in_ddp_and_in_its_plan(monkeypatch):
    """Megatron-LM forces fp32 gradient accumulation for --bf16 only: an --fp16 run's DDP buffer is fp16 unless
    --accumulate-allreduce-grads-in-fp32, and the plan the driver prices holds the same bytes."""
    _gpu(monkeypatch, te=True)
    base = [f for f in BASE if f != "--bf16"]
    fp16 = parse_args([*base, "--fp16"], world_size=2)
    assert ddp_fields(fp16)["grad_reduce_in_fp32"] is False and run_plan(fp16, on_gpu=True).grad_bytes == 2
    fp32 = parse_args([*base, "--fp16", "--accumulate-allreduce-grads-in-fp32"], world_size=2)
    assert ddp_fields(fp32)["grad_reduce_in_fp32"] is True and run_plan(fp32, on_gpu=True).grad_bytes == 4


def test_bad_gpu_values_are_one_line(monkeypatch, capsys):
    _gpu(monkeypatch, te=True)
    assert error_body([*BASE, "--fp8-format", "e5m2"], capsys) == "--fp8-format e5m2 is not one of e4m3, hybrid"
    assert error_body([*BASE, "--fp8-param-gather"], capsys) == "--fp8-param-gather needs --fp8-format (e4m3 or hybrid)"
    assert error_body([*BASE, "--attention-backend", "local"], capsys).startswith(
        "--attention-backend local on a GPU is megatron-core's local attention, and the driver's TransformerEngine "
        "spec has none")
    _gpu(monkeypatch, te=False)
    body = error_body([*BASE, "--cross-entropy-fusion-impl", "te"], capsys)
    assert body.startswith("--cross-entropy-fusion-impl is not supported: on a GPU with the value te it runs "
                           "through TransformerEngine")
    parse_args([*BASE, "--cross-entropy-fusion-impl", "native"], world_size=2)  # native needs no TE


FSDP_FLAGS = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]


@pytest.mark.parametrize("sizes, fsdp, arch, value, refused", [
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], [], 9, None, "needs CUDA_DEVICE_MAX_CONNECTIONS=1"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], [], 9, "8", "got 8; export"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], [], 9, "1", None),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], [], 10, None, None),  # Blackwell: no requirement
    (["--context-parallel-size", "2"], [], 8, None, "--context-parallel-size 2 on a GPU of compute capability 8.x"),
    ([], [], 9, None, None),  # t = c = 1: nothing to overlap
    ([], FSDP_FLAGS, 9, "1", "--use-megatron-fsdp needs CUDA_DEVICE_MAX_CONNECTIONS unset or above 1"),
    ([], FSDP_FLAGS, 9, None, None),
])
def test_the_launch_environment_megatron_lm_asserts_on_a_gpu(monkeypatch, capsys, sizes, fsdp, arch, value, refused):
    """Megatron-LM 0.16-0.19's validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS on a GPU run: 1 with tensor or context
    parallelism before Blackwell (the sequence-parallel collectives queued ahead of the GEMMs they overlap), unset or
    above 1 with FSDP. The driver starts the same runs and refuses the others in one line naming the variable."""
    fake_device(monkeypatch, gpu=True, te=True, arch_major=arch)
    if value is not None:
        monkeypatch.setenv(feature_checks.CONNECTIONS_VAR, value)
    argv = [*BASE, "--use-distributed-optimizer", *sizes, *fsdp]
    if refused is None:
        assert parse_args(argv, world_size=2)
    else:
        body = error_body(argv, capsys)
        assert refused in body and "Megatron-LM asserts it" in body, body


def test_a_node_launched_without_the_variable_says_so_on_its_first_rank(monkeypatch, capsys):
    """A multi-node torchrun sets the launch environment node by node: a node that left it out is said by its first
    rank, with its host, even where rank 0's node has it."""
    from h3t_training.config import arguments
    from h3t_training.errors import node_line
    fake_device(monkeypatch, gpu=True, te=True)
    monkeypatch.setattr(arguments, "SILENT_RANK_EXIT_DELAY_S", 0.0)
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--tensor-model-parallel-size", "2", "--sequence-parallel"], world_size=4, rank=2,
                   local_rank=0)
    err = capsys.readouterr().err
    assert err.startswith(f"pretrain_llama.py: error: {node_line('', 2)}--tensor-model-parallel-size 2 ") and \
        "needs CUDA_DEVICE_MAX_CONNECTIONS=1" in err, err


def test_the_cpu_path_reads_no_launch_environment(monkeypatch):
    """gloo has no CUDA queue to order: a CPU run with t = 2 starts whatever the variable says."""
    fake_device(monkeypatch, gpu=False, te=False)
    monkeypatch.setenv(feature_checks.CONNECTIONS_VAR, "8")
    assert parse_args([*BASE, "--tensor-model-parallel-size", "2", "--sequence-parallel"], world_size=2)


@pytest.mark.parametrize("ranks, devices, backend, refused", [
    (4, 2, None, "the launcher starts 4 ranks on this node but it shows 2 CUDA devices (NCCL takes one GPU per rank): "
                 "start at most 2 per node (torchrun --nproc-per-node 2, mpirun --npernode 2)"),
    (2, 1, None, "shows 1 CUDA device (NCCL"),
    (2, 2, None, None),
    (8, 2, "gloo", None),  # gloo ranks train on the host's CPUs, not on its GPUs
])
def test_a_gpu_run_needs_a_gpu_for_each_rank_on_its_node(monkeypatch, capsys, ranks, devices, backend, refused):
    """Each rank of a GPU run takes the device of its local rank and NCCL refuses two ranks on one device: a node
    started with more ranks than it shows GPUs is refused in one line at parse time (the rank past the last device
    would stop in a traceback at torch.cuda.set_device)."""
    fake_device(monkeypatch, gpu=True, te=True)
    monkeypatch.setattr(feature_checks, "cuda_device_count", lambda: devices)
    argv = [*BASE, *(["--distributed-backend", backend] if backend else [])]
    if refused is None:
        assert parse_args(argv, world_size=8, ranks_per_node=ranks).ranks_per_node == ranks
    else:
        with pytest.raises(SystemExit):
            parse_args(argv, world_size=8, ranks_per_node=ranks)
        assert refused in capsys.readouterr().err


@pytest.mark.parametrize("rank, local_rank, devices, argv, said", [
    (0, 0, 4, [], True),    # rank 0 says every problem
    (8, 0, 4, [], True),    # another node's first rank says its node's problem (rank 0's node may have enough GPUs)
    (9, 1, 4, [], False),   # the node's other ranks do not
    (8, 0, 8, ["--offload-alpha", "1.5"], False),  # nor a problem of the command line, which rank 0 has too
])
def test_a_node_short_of_gpus_is_said_by_its_first_rank(monkeypatch, capsys, rank, local_rank, devices, argv, said):
    """Nodes of one job may differ: the node's first rank writes a problem of its node (with its host and rank),
    where a problem of the command line is rank 0's to write alone."""
    from h3t_training.config import arguments
    from h3t_training.errors import node_line
    fake_device(monkeypatch, gpu=True, te=True)
    monkeypatch.setattr(feature_checks, "cuda_device_count", lambda: devices)
    monkeypatch.setattr(arguments, "SILENT_RANK_EXIT_DELAY_S", 0.0)
    with pytest.raises(SystemExit) as exc:
        parse_args([*BASE, *argv], world_size=16, rank=rank, ranks_per_node=8, local_rank=local_rank)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    if not said:
        assert err == ""
        return
    message = ("the launcher starts 8 ranks on this node but it shows 4 CUDA devices (NCCL takes one GPU per rank): "
               "start at most 4 per node (torchrun --nproc-per-node 4, mpirun --npernode 4) or make more GPUs visible "
               "(CUDA_VISIBLE_DEVICES)")
    assert err == f"pretrain_llama.py: error: {message if rank == 0 else node_line(message, rank)}\n"
    if rank:
        import socket
        assert node_line(message, rank).startswith(f"on {socket.gethostname()} (rank {rank}): the launcher starts")


def test_the_cpu_path_starts_any_number_of_ranks_on_a_node(monkeypatch):
    fake_device(monkeypatch, gpu=False, te=False)
    monkeypatch.setattr(feature_checks, "cuda_device_count", lambda: 0)
    assert parse_args(BASE, world_size=8, ranks_per_node=8).ranks_per_node == 8


def test_the_launch_scripts_preflight_checks_the_gpus_of_a_node_it_is_told(monkeypatch, capsys):
    """launch_torchrun.sh and launch_slurm.sbatch pass the ranks they start per node to the preflight check, so a GPU
    node with too few devices is one line before any rank starts."""
    from h3t_training.launch import preflight

    assert preflight._options(["--world-size", "8", "--ranks-per-node", "4", "--", "--x"]) == (
        8, "pretrain_llama.py", 4, ["--x"])
    assert preflight._options(["--world-size", "8", "--", "--x"])[2] == 1
    for bad in (["--world-size", "8", "--ranks-per-node", "0"], ["--world-size", "8", "--ranks-per-node"],
                ["--world-size", "8", "--world-size", "4"], ["--ranks-per-node", "2"], ["--nodes", "2"]):
        assert preflight._options([*bad, "--", "--x"]) is None, bad
    fake_device(monkeypatch, gpu=True, te=True)
    monkeypatch.setattr(feature_checks, "cuda_device_count", lambda: 4)
    assert preflight.main(["--world-size", "8", "--ranks-per-node", "4", "--", *BASE]) == 0
    with pytest.raises(SystemExit) as exc:
        preflight.main(["--world-size", "16", "--ranks-per-node", "8", "--", *BASE])
    assert exc.value.code == 2
    assert "the launcher starts 8 ranks on this node but it shows 4 CUDA devices" in capsys.readouterr().err


def test_a_transformer_engine_that_is_installed_but_does_not_import_is_named(monkeypatch, capsys, tmp_path):
    """An installed TransformerEngine whose PyTorch module fails to import (an extension built for another torch) is
    not TransformerEngine to the driver: on a GPU a flag that needs it is refused naming the import's failure, where
    megatron-core would have stopped later in a traceback."""
    package = tmp_path / "transformer_engine"
    (package / "pytorch").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pytorch" / "__init__.py").write_text(
        "raise ImportError('libtransformer_engine.so: undefined symbol: _ZN3c104cuda9SetDevice')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    feature_checks.transformer_engine_problem.cache_clear()
    try:
        assert not feature_checks.transformer_engine_available()
        problem = feature_checks.transformer_engine_problem()
        assert problem == ("TransformerEngine is installed here but does not import (ImportError: "
                           "libtransformer_engine.so: undefined symbol: _ZN3c104cuda9SetDevice)")
        monkeypatch.setattr(feature_checks, "cuda_available", lambda: True)
        monkeypatch.setattr(feature_checks, "cuda_compute_capability", lambda: 9.0)
        body = error_body([*BASE, "--fp8-format", "hybrid"], capsys)
        assert body.startswith("--fp8-format is not supported: on a GPU it runs through TransformerEngine") and \
            problem in body, body
        body = error_body([*BASE, "--transformer-impl", "transformer_engine"], capsys)
        assert body.startswith("--transformer-impl is not supported: on a GPU with the value transformer_engine it "
                               "runs through TransformerEngine") and problem in body, body
        config = parse_args(BASE, world_size=2)  # Megatron's default impl: the local spec, as without TE
        from h3t_training.config.run_spec import uses_transformer_engine
        assert not uses_transformer_engine(True, config)
    finally:  # nothing of the stand-in stays (monkeypatch.delitem would put the modules back at teardown)
        for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
            del sys.modules[name]
        feature_checks.transformer_engine_problem.cache_clear()


@pytest.mark.parametrize("capability, recipe, refused", [
    (8.0, "delayed", "--fp8-format needs FP8 tensor cores (Hopper or newer, compute capability >= 8.9): this GPU has "
                     "8.0"),
    (8.9, "delayed", None),
    (9.0, "mxfp8", "--fp8-recipe mxfp8 needs Blackwell (compute capability >= 10.0): this GPU has 9.0"),
    (10.0, "mxfp8", None),
])
def test_fp8_on_a_gpu_that_cannot_run_it_is_one_line(monkeypatch, capsys, capability, recipe, refused):
    """The planner's rule for a system file's GPU (fp8.fp8_device_refusal) on the GPU a run has: TransformerEngine
    would stop at the first FP8 layer's forward in a traceback."""
    fake_device(monkeypatch, gpu=True, te=True, arch_major=int(capability), capability=capability)
    argv = [*BASE, "--fp8-format", "hybrid", "--fp8-recipe", recipe]
    if refused is None:
        assert parse_args(argv, world_size=2).flag_notices is not None
    else:
        assert error_body(argv, capsys) == refused
    fake_device(monkeypatch, gpu=False, te=False)  # on CPU the flags are noticed, whatever the host
    assert parse_args(argv, world_size=2)


@pytest.mark.parametrize("te, extra, refused", [
    (False, [], "--context-parallel-size 2 on a GPU runs in TransformerEngine's attention (megatron-core's local "
                "attention takes context parallel size 1 only), and TransformerEngine is not importable here: install "
                "TransformerEngine, or train with --context-parallel-size 1"),
    (True, ["--transformer-impl", "local"], "and the run gives --transformer-impl local: leave --transformer-impl "
                                            "local out, or train with --context-parallel-size 1"),
    (True, [], None),
])
def test_context_parallelism_on_a_gpu_needs_transformer_engines_attention(monkeypatch, capsys, te, extra, refused):
    """megatron-core's local DotProductAttention asserts context parallel size 1 when the model is built: a GPU run
    on the local spec is refused at parse time (the CPU path runs h3t-ext's ring attention instead)."""
    fake_device(monkeypatch, gpu=True, te=te)
    monkeypatch.setenv(feature_checks.CONNECTIONS_VAR, "1")
    argv = [*BASE, "--context-parallel-size", "2", *extra]
    if refused is None:
        assert parse_args(argv, world_size=2).context_parallel_size == 2
    else:
        assert refused in error_body(argv, capsys)
    fake_device(monkeypatch, gpu=False, te=False)
    assert parse_args(argv, world_size=2).context_parallel_size == 2
