"""Flag checks of pretrain_llama.py: one Megatron-style line, exit status 2, no process group, no traceback."""
from __future__ import annotations

import subprocess

import pytest

from driver_harness import PYTHON, REPO, _env  # noqa: F401
from parse_harness import BASE, _error  # noqa: F401
from h3t_training.config.sections import parse_args



@pytest.mark.parametrize("extra, expected", [
    (["--offload-alpha", "1.5"], "--offload-alpha 1.5 is outside [0, 1]"),
    (["--decoupled-lr", "0"], "--decoupled-lr 0.0 is outside (0, inf)"),
    (["--decoupled-min-lr", "1e-5"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--offload-alpha", "0.2,1.2", "--pipeline-model-parallel-size", "2"], "--offload-alpha 1.2 is outside [0, 1]"),
    (["--offload-alpha", "x"], "--offload-alpha 'x' is not a number"),
    (["--ckpt", "some"], "argument --ckpt: invalid choice: 'some'"),
    (["--lr", "-1"], "--lr -1.0 is outside (0, inf)"),
    (["--micro-batch-size", "0"], "--micro-batch-size 0 is outside [1, inf)"),
    (["--pipeline-model-parallel-size", "3"], "world size 2 is not a multiple of --tensor-model-parallel-size 1 x "
     "--context-parallel-size 1 x --pipeline-model-parallel-size 3 = 3; valid: world sizes that are multiples of 3"),
    (["--num-layers-per-virtual-pipeline-stage", "3", "--pipeline-model-parallel-size", "2"],
     "--num-layers-per-virtual-pipeline-stage 3 does not divide the 2 layers per pipeline rank"),
    (["--micro-batch-size", "3"], "--global-batch-size 8 is not a multiple of --micro-batch-size 3"),
    (["--tensor-model-parallel-size", "2", "--num-attention-heads", "2", "--hidden-size", "64",
      "--group-query-attention", "--num-query-groups", "1"],
     "--num-query-groups 1 is not a multiple of --tensor-model-parallel-size 2"),
    (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
    (["--lr", "inf"], "--lr inf is not a finite number"),
    (["--fp16", "--bf16"], "--fp16 and --bf16 are exclusive; give one"),
    (["--fp16", "--initial-loss-scale", "0"], "--initial-loss-scale 0.0 is outside (0, inf)"),
    (["--fp16", "--hysteresis", "0"], "--hysteresis 0 is outside [1, inf)"),
    (["--weight-decay", "inf"], "--weight-decay inf is not a finite number"),
    (["--clip-grad", "nan"], "--clip-grad nan is not a finite number"),
    (["--init-method-std", "nan"], "--init-method-std nan is not a finite number"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes 0.0 is outside (0, inf)"),
    (["--context-parallel-size", "2", "--seq-length", "66"],
     "--seq-length 66 is not a multiple of 2 x --context-parallel-size 2"),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"],
     "--attention-dropout 0.1 is not supported with --context-parallel-size 2 on CPU"),
    (["--offload-alpha", "0.5", "--num-layers", "1"], "a model chunk has 1 layer(s)"),
    (["--split", "0,100,0", "--data-path", "x", "--mock-data"], "--split 0,100,0 leaves no training data"),
    (["--num-experts", "8"], "--num-experts is not supported: mixture-of-experts"),
    (["--kaimm-recompute-norm"], "--kaimm-recompute-norm alone is not supported"),
    (["--kaimm-offload-activation-ratio", "0.3", "--offload-alpha", "0.5"],
     "--kaimm-offload-activation-ratio 0.3 contradicts --offload-alpha 0.5"),
    (["--train-samples", "64"], "give exactly one of --train-iters and --train-samples"),
    (["--vocab-file", "v.json"], "--vocab-file is not read by --tokenizer-type ByteTokenizer"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "63", "--max-position-embeddings",
      "64"], "--seq-length 63 is not a multiple of --context-parallel-size 1 x --tensor-model-parallel-size 2 = 2"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe_act"],
     "--recompute-modules moe_act recomputes MoE layers; the model is dense"),
    (["--recompute-granularity", "full", "--ckpt", "ours"], "--ckpt ours contradicts --recompute-granularity full"),
    (["--data-path", "/nonexistent/prefix"], "give exactly one of --data-path PREFIX and --mock-data"),
    (["--ckpt-step", "3"], "--ckpt-step needs --load DIR"),
    (["--num-query-groups", "2"], "--num-query-groups needs --group-query-attention"),
    (["--check-weight-hash-across-dp-replicas-interval", "0"],
     "--check-weight-hash-across-dp-replicas-interval 0 is outside [1, inf)"),
    (["--check-weight-hash-across-dp-replicas-interval", "2", "--use-torch-fsdp2",
      "--untie-embeddings-and-output-weights"],
     "--check-weight-hash-across-dp-replicas-interval is not supported with --use-torch-fsdp2: FSDP2 shards"),
    (["--rerun-mode", "replay"], "argument --rerun-mode: invalid choice: 'replay'"),
])
def test_bad_flag_gives_one_line(extra, expected, capsys, monkeypatch):
    assert expected in _error(BASE + extra, capsys, monkeypatch)


def test_missing_data_files_are_named(capsys, monkeypatch, tmp_path):
    argv = [a for a in BASE if a != "--mock-data"] + ["--data-path", str(tmp_path / "nothing")]
    line = _error(argv, capsys, monkeypatch)
    assert "nothing.idx does not exist (make it with tools/preprocess_data.py)" in line


def test_good_flags_derive_sizes(monkeypatch):
    args = parse_args(BASE + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                              "--recompute-granularity", "full", "--recompute-method", "uniform",
                              "--recompute-num-layers", "1"], world_size=4)
    assert args.data_parallel_size == 2 and args.virtual_pipeline_model_parallel_size == 2
    assert args.num_microbatches == 4 and args.ckpt == "full" and args.offload_alpha == 0.0


def test_published_65b_flags_parse_for_256_ranks(monkeypatch):
    from h3t_training.config import feature_checks
    monkeypatch.setattr(feature_checks, "cuda_available", lambda: True)  # as on a GPU host (Hopper: t = 2 needs the
    monkeypatch.setattr(feature_checks, "cuda_compute_capability", lambda: 9.0)  # launch environment Megatron-LM asserts)
    monkeypatch.setenv(feature_checks.CONNECTIONS_VAR, "1")
    args = parse_args(["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
                       "--ffn-hidden-size", "22016", "--seq-length", "4096", "--global-batch-size", "256",
                       "--train-iters", "10", "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
                       "--vocab-size", "32000", "--tensor-model-parallel-size", "2",
                       "--pipeline-model-parallel-size", "8", "--num-layers-per-virtual-pipeline-stage", "2",
                       "--sequence-parallel", "--use-distributed-optimizer", "--ckpt", "no", "--offload-alpha", "0.355"], world_size=256)
    assert args.data_parallel_size == 16 and args.num_microbatches == 16
    assert args.virtual_pipeline_model_parallel_size == 5 and args.offload_alpha == 0.355


def test_auto_plan_fills_only_what_was_left_out(monkeypatch, capsys):
    args = parse_args(["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
                       "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "28672",
                       "--seq-length", "4096", "--global-batch-size", "256", "--train-iters", "10", "--lr", "1e-4",
                       "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
                       "--gpu", "h800", "--auto-plan", "--pipeline-model-parallel-size", "8"], world_size=256)
    assert args.flag_notices[-1].startswith("auto-plan (h800")  # printed once by rank 0 when training starts
    assert args.pipeline_model_parallel_size == 8  # the user's value is kept
    assert args.ckpt in ("no", "full", "ours") and args.use_distributed_optimizer
    t, c, p = args.tensor_model_parallel_size, args.context_parallel_size, args.pipeline_model_parallel_size
    assert t * c * p * args.data_parallel_size == 256


def test_bad_flag_through_the_entry_point_has_no_traceback():
    proc = subprocess.run([PYTHON, str(REPO / "pretrain_llama.py"), *BASE, "--offload-alpha", "1.5"], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "pretrain_llama.py: error: --offload-alpha 1.5 is outside [0, 1] (valid: a number in [0, 1], a "
        "comma-separated list of one per pipeline stage, auto or balanced)")
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("mode", ["auto", "balanced"])
def test_offload_alpha_modes_are_resolved_by_the_cost_model(mode, monkeypatch, capsys):
    args = parse_args(BASE + ["--pipeline-model-parallel-size", "2", "--offload-alpha", mode, "--memory-budget",
                              "80GB"], world_size=2)
    values = args.offload_alpha if isinstance(args.offload_alpha, tuple) else (args.offload_alpha,)
    assert len(values) in (1, 2) and all(0.0 <= a <= 1.0 for a in values)
    assert any(n.startswith(f"--offload-alpha {mode} resolved by the cost model") for n in args.flag_notices)


def test_bad_memory_budget_is_one_line(capsys, monkeypatch):
    line = _error(BASE + ["--offload-alpha", "auto", "--memory-budget", "lots"], capsys, monkeypatch)
    assert "--memory-budget" in line and "not a byte count" in line


def test_overlap_flags_reach_the_run(monkeypatch):
    """Megatron's DDP overlap switches are accepted (the planner prints them) and kept for the GPU wrap."""
    args = parse_args(BASE + ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"], world_size=2)
    assert args.overlap_grad_reduce and args.overlap_param_gather


@pytest.mark.parametrize("prog,gelu_gpt", [("pretrain_gpt.py", True), ("pretrain_llama.py", False)])
def test_cost_model_sees_the_model_the_flags_build(prog, gelu_gpt, monkeypatch):
    """--auto-plan and the predictions price the model that runs: pretrain_gpt.py's GeLU MLP, tied output
    layer, linear biases and Megatron's 0.1 dropout; pretrain_llama.py's SwiGLU, untied, no biases and no
    dropout; flags override."""
    from h3t_training.config.run_spec import model_spec
    base = [*BASE, "--max-position-embeddings", "64"]  # pretrain_gpt.py requires it, as Megatron-LM does
    spec = model_spec(parse_args(base, prog=prog), vocab_size=512)
    assert spec.swiglu is not gelu_gpt and spec.untie_embeddings_and_output_weights is not gelu_gpt
    assert spec.add_bias_linear is gelu_gpt
    assert model_spec(parse_args(base + ["--disable-bias-linear"], prog=prog), 512).add_bias_linear is False
    assert (spec.attention_dropout, spec.hidden_dropout) == ((0.1, 0.1) if gelu_gpt else (0.0, 0.0))
    spec = model_spec(parse_args(base + ["--attention-dropout", "0.2", "--hidden-dropout", "0"], prog=prog), 512)
    assert (spec.attention_dropout, spec.hidden_dropout) == (0.2, 0.0)


@pytest.mark.parametrize("cuda", [False, True])
def test_nccl_backend_runs_on_gloo_without_cuda_with_one_notice(cuda, monkeypatch):
    """Megatron's recipes pass --distributed-backend nccl: without CUDA the run takes gloo and says so once;
    on a GPU nccl stays nccl, silently."""
    from h3t_training.config import feature_checks
    monkeypatch.setattr(feature_checks, "cuda_available", lambda: cuda)
    config = parse_args([*BASE, "--distributed-backend", "nccl"], world_size=2)
    notices = [n for n in config.flag_notices if n.startswith("note: --distributed-backend")]
    assert config.distributed_backend == ("nccl" if cuda else "gloo")
    assert notices == ([] if cuda else ["note: --distributed-backend nccl: no CUDA device on this machine; the "
                                        "process groups run on gloo (the same result on CPU)"])
    assert parse_args([*BASE, "--distributed-backend", "gloo"], world_size=2).distributed_backend == "gloo"


def test_every_refusal_of_a_command_line_is_one_line(capsys, monkeypatch):
    """A MoE recipe learns all its refused flags in one launch, with the resolve steps' first problem."""
    line = _error([*BASE, "--num-experts", "8", "--moe-router-topk", "2", "--multi-latent-attention",
                   "--lr", "-1"], capsys, monkeypatch)
    body = line.split(": error: ", 1)[1]
    assert body.startswith("--moe-router-topk, --num-experts are not supported: mixture-of-experts")
    assert "(instead: a dense model (leave the MoE flags out)); --multi-latent-attention is not supported: " \
           "multi-latent attention" in body
    assert body.count("not supported") == 2
    assert body.endswith("; --lr -1.0 is outside (0, inf)")


def test_only_rank_0_writes_the_error(capsys, monkeypatch):
    from h3t_training.config import arguments

    waits = []
    monkeypatch.setattr(arguments.time, "sleep", waits.append)
    with pytest.raises(SystemExit) as exc:
        parse_args([*BASE, "--num-experts", "8"], world_size=2, rank=1)
    assert exc.value.code == 2 and capsys.readouterr().err == ""
    assert waits == [arguments.SILENT_RANK_EXIT_DELAY_S]  # rank 0 writes the line before torchrun stops the group


def test_bad_flag_under_torchrun_is_said_once(tmp_path):
    from h3t_ext.testing import free_port
    proc = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), str(REPO / "pretrain_llama.py"), *BASE,
                           "--num-experts", "8"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("pretrain_llama.py: error: --num-experts is not supported") == 1, proc.stderr[-3000:]


def test_the_silent_data_corruption_guards_megatron_runs_by_default_are_accepted():
    config = parse_args(BASE + ["--check-weight-hash-across-dp-replicas-interval", "5", "--rerun-mode", "disabled"],
                        world_size=2)
    assert config.check_weight_hash_across_dp_replicas_interval == 5 and config.rerun_mode == "disabled"
    assert not [n for n in config.flag_notices if "rerun" in n or "weight-hash" in n]


def test_null_tokenizer_ids_reach_the_config_and_are_noticed_under_another_tokenizer(corpus_prefix):
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-4"]
    args = parse_args([*base, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300",
                       "--null-tokenizer-eod-id", "5"])
    assert args.null_tokenizer_eod_id == 5 and args.tokenizer_vocab_size in (300, 301)
    assert not any("--null-tokenizer" in line for line in args.flag_notices)
    args = parse_args([*base, "--data-path", corpus_prefix, "--null-tokenizer-eod-id", "5",
                       "--null-tokenizer-pad-id", "6"])
    notes = [line for line in args.flag_notices if "--null-tokenizer" in line]
    assert notes == [f"note: --null-tokenizer-{k}-id: read only by --tokenizer-type NullTokenizer; Megatron-LM ignores "
                     "it under ByteTokenizer too: same result" for k in ("eod", "pad")]


def test_another_tokenizer_types_flag_is_noticed_and_byte_tokenizer_files_stay_refused(capsys):
    """A flag that one tokenizer type alone reads is a notice under another, and leaves the ByteTokenizer's file
    check in place (a NullTokenizer id next to a --vocab-file under ByteTokenizer used to skip it)."""
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-4", "--mock-data"]
    from h3t_training.megatron_release import CORE_TOKENIZERS_FROM, installed_megatron_core

    flag = "--tokenizer-hf-" + ("include" if installed_megatron_core() < CORE_TOKENIZERS_FROM else "no-include") \
        + "-special-tokens"  # the installed release's spelling (0.16 has only the first, 0.18+ only the second)
    args = parse_args([*base, "--tokenizer-type", "NullTokenizer", "--vocab-size", "300", flag])
    assert [line for line in args.flag_notices if "--tokenizer-hf" in line] == [
        f"note: {flag}: read only by --tokenizer-type HuggingFaceTokenizer; "
        "Megatron-LM ignores it under NullTokenizer too: same result"]
    with pytest.raises(SystemExit):
        parse_args([*base, "--vocab-file", "v.json", "--null-tokenizer-eod-id", "5"])
    assert "--vocab-file is not read by --tokenizer-type ByteTokenizer" in capsys.readouterr().err
