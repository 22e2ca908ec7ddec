"""Bad input suite: every bad h3t-plan invocation and every bad driver invocation (through the launcher
script) is one line on stderr and exit status 2; the planner answers each within 2 s."""
from __future__ import annotations

import subprocess

import pytest

from driver_harness import PYTHON, REPO, TINY_MODEL, _env

SEARCH = ["search", "--model", "llama-7b", "--seq-length", "4096", "--num-gpus", "8", "--global-batch-size", "64"]
ESTIMATE = ["estimate", "--model", "llama-7b", "--seq-length", "4096", "--num-gpus", "8", "--global-batch-size", "64"]
CUSTOM = ["estimate", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
          "--ffn-hidden-size", "1024", "--vocab-size", "1000", "--seq-length", "512", "--num-gpus", "8",
          "--global-batch-size", "16"]


def _with(base: list[str], **flags) -> list[str]:
    """``base`` with each ``--flag value`` replaced or appended (value None: the flag alone)."""
    out = list(base)
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if flag in out:
            i = out.index(flag)
            del out[i:i + 2]
        out += [flag] if value is None else [flag, str(value)]
    return out


PLANNER_CASES = [
    (_with(SEARCH, num_gpus=0), "--num-gpus: 0 out of range"),
    (_with(SEARCH, num_gpus=-1), "--num-gpus: -1 out of range"),
    (_with(SEARCH, num_gpus="abc"), "'abc' is not an integer"),
    (_with(SEARCH, num_gpus="1e18"), "'1e18' is not an integer"),
    (_with(SEARCH, num_gpus=10**18), "out of range (valid: integer in [1, 1048576])"),
    (_with(SEARCH, seq_length=0), "--seq-length: 0 out of range"),
    (_with(SEARCH, seq_length=2**30), "--seq-length: 1073741824 out of range"),
    (_with(SEARCH, seq_length="4096.5"), "'4096.5' is not an integer"),
    (_with(SEARCH, global_batch_size=0), "--global-batch-size: 0 out of range"),
    (_with(SEARCH, global_batch_size="1e3"), "'1e3' is not an integer"),
    (_with(SEARCH, memory_budget="1e400"), "--memory-budget: '1e400' is out of range"),
    (_with(SEARCH, memory_budget="0.4"), "must be at least 1 byte"),
    (_with(SEARCH, memory_budget="-5"), "'-5' is not a byte count"),
    (_with(SEARCH, memory_budget="12XB"), "'12XB' is not a byte count"),
    (_with(SEARCH, memory_budget="nan"), "'nan' is not a byte count"),
    (_with(SEARCH, memory_budget="inf"), "'inf' is not a byte count"),
    (_with(SEARCH, memory_budget="1e30TiB"), "is out of range"),
    (_with(ESTIMATE, offload_alpha="1.5"), "outside [0, 1]"),
    (_with(ESTIMATE, offload_alpha="-0.1"), "outside [0, 1]"),
    (_with(ESTIMATE, offload_alpha="x"), "'x' is not a number"),
    (_with(ESTIMATE, offload_alpha="nan"), "outside [0, 1]"),
    (_with(ESTIMATE, offload_alpha="0.1,0.2"), "--offload-alpha has 2 values but --pipeline-model-parallel-size is 1"),
    (_with(SEARCH, ckpt="some"), "--ckpt: invalid choice: 'some'"),
    (_with(SEARCH, gpu="nonexistent"), "--gpu"),
    (_with(SEARCH, gpu=""), "--gpu"),
    (_with(SEARCH, model="nonexistent"), "--model"),
    (_with(SEARCH, tensor_model_parallel_size=0), "--tensor-model-parallel-size: 0 out of range"),
    (_with(SEARCH, pipeline_model_parallel_size=0), "--pipeline-model-parallel-size: 0 out of range"),
    (_with(SEARCH, context_parallel_size=0), "--context-parallel-size: 0 out of range"),
    (_with(SEARCH, micro_batch_size=0), "--micro-batch-size: 0 out of range"),
    (_with(SEARCH, num_layers_per_virtual_pipeline_stage=0), "--num-layers-per-virtual-pipeline-stage: 0 out of"),
    (_with(SEARCH, max_micro_batch_size=1, micro_batch_size=2), "--max-micro-batch-size: 1 is below --micro-batch"),
    (_with(SEARCH, max_micro_batch_size=0), "--max-micro-batch-size: 0 out of range"),
    (_with(SEARCH, swiglu=None, no_swiglu=None), "not allowed with argument"),
    (_with(SEARCH, untie_embeddings_and_output_weights=None, tie_embeddings_and_output_weights=None),
     "not allowed with argument"),
    (_with(SEARCH, top=0), "--top: 0 out of range"),
    (["search", "--num-layers", "4", "--seq-length", "64", "--num-gpus", "8", "--global-batch-size", "8"],
     "give --model NAME or a custom model shape (missing --hidden-size"),
    (_with(SEARCH, system_file="/nonexistent/system.json"), "--system-file"),
    (_with(SEARCH, hidden_size=0), "--hidden-size: 0 out of range"),
    (_with(SEARCH, vocab_size=-3), "--vocab-size: -3 out of range"),
    (_with(SEARCH, foo="1"), "unrecognized arguments: --foo"),
    (["search", "--model", "llama-7b", "--num-gpus", "8", "--global-batch-size", "64"],
     "the following arguments are required: --seq-length"),
    ([], "the following arguments are required"),
    (["optimize"], "invalid choice: 'optimize'"),
    (_with(CUSTOM, ffn_hidden_size=1020, tensor_model_parallel_size=8), "--ffn-hidden-size 1020 is not a multiple of --tensor-model-parallel-size 8"),
    (_with(ESTIMATE, pipeline_model_parallel_size=3, num_gpus=3),
     "--num-layers 32 is not a multiple of --pipeline-model-parallel-size 3; valid: multiples of 3"),
    (_with(ESTIMATE, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=3),
     "--num-layers-per-virtual-pipeline-stage 3 does not divide the 16 layers per pipeline rank"),
    (_with(ESTIMATE, global_batch_size=7), "--global-batch-size 7 is not a multiple of --micro-batch-size 1 x data-parallel size 8"),
    (_with(ESTIMATE, context_parallel_size=3, num_gpus=3), "--seq-length 4096 is not a multiple of 2 x --context-parallel-size 3 = 6"),
    (_with(ESTIMATE, num_gpus=7, tensor_model_parallel_size=2), "world size 7 is not a multiple of --tensor-model-parallel-size 2"),
    (_with(ESTIMATE, tensor_model_parallel_size=16, num_gpus=16), "gpus_per_node"),
    (_with(ESTIMATE, tensor_model_parallel_size=3, num_gpus=9), "--num-attention-heads 32 is not a multiple of --tensor-model-parallel-size 3"),
    (_with(CUSTOM, num_query_groups=3), "--num-query-groups (3); valid --num-query-groups: 1, 2, 4, 8"),
    (_with(ESTIMATE, decoder_first_pipeline_num_layers=0), "--decoder-first-pipeline-num-layers: 0 out of range"),
    (_with(ESTIMATE, data_parallel_sharding_strategy="bogus"), "--data-parallel-sharding-strategy"),
    (_with(ESTIMATE, data_parallel_sharding_strategy="optim_grads", no_use_distributed_optimizer=None),
     "--data-parallel-sharding-strategy shards the optimizer states too: it needs --use-distributed-optimizer"),
    (_with(ESTIMATE, num_attention_heads=0), "--num-attention-heads: 0 out of range"),
    (["calibrate", "--model", "llama-7b", "--output", "x.json"], "the following arguments are required: --runs"),
    (["calibrate", "--model", "llama-7b", "--runs", "/nonexistent.json", "--output", "/tmp/x.json"], "/nonexistent"),
    (_with(SEARCH, json=None, num_gpus=0), "--num-gpus: 0 out of range"),
    (_with(ESTIMATE, seq_length=4097, context_parallel_size=2, num_gpus=2), "--seq-length 4097 is not a multiple of 2 x --context-parallel-size 2"),
    (_with(SEARCH, offload_alpha="0.1,0.2"), "--offload-alpha"),
]


@pytest.mark.parametrize("argv, expected", PLANNER_CASES, ids=[f"plan{i}" for i in range(len(PLANNER_CASES))])
def test_bad_planner_input_is_one_line(argv, expected):
    proc = subprocess.run([PYTHON, "-m", "h3t_ext.planner", *argv], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=2.0)  # the planner answers bad input at once (torch-free)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("h3t-plan: error: "), proc.stderr
    assert expected in lines[0], lines[0]


def test_the_planner_suite_is_large_enough():
    assert len(PLANNER_CASES) >= 60


BASE = [*TINY_MODEL, "--global-batch-size", "4", "--train-iters", "2", "--mock-data"]
DRIVER_CASES = [
    (["--offload-alpha", "1.5"], "--offload-alpha 1.5 is outside [0, 1]"),
    (["--offload-alpha", "x"], "is not a number"),
    (["--offload-alpha", "0.1,0.2,0.3"], "--offload-alpha has 3 values"),
    (["--ckpt", "some"], "invalid choice: 'some'"),
    (["--lr", "-1"], "--lr -1.0 is outside (0, inf)"),
    (["--lr", "inf"], "--lr inf is not a finite number"),
    (["--lr", "nan"], "--lr nan is not a finite number"),
    (["--weight-decay", "inf"], "--weight-decay inf is not a finite number"),
    (["--clip-grad", "nan"], "--clip-grad nan is not a finite number"),
    (["--init-method-std", "nan"], "--init-method-std nan is not a finite number"),
    (["--adam-beta1", "1.5"], "--adam-beta1 1.5 is outside [0, 1)"),
    (["--hidden-dropout", "1"], "--hidden-dropout 1.0 is outside [0, 1)"),
    (["--micro-batch-size", "0"], "--micro-batch-size 0 is outside [1, inf)"),
    (["--micro-batch-size", "3"], "--global-batch-size 4 is not a multiple of --micro-batch-size 3"),
    (["--train-iters", "0"], "--train-iters 0 is outside [1, inf)"),
    (["--pipeline-model-parallel-size", "3"], "world size 2 is not a multiple of"),
    (["--tensor-model-parallel-size", "4"], "world size 2 is not a multiple of --tensor-model-parallel-size 4"),
    (["--context-parallel-size", "2", "--seq-length", "66"], "--seq-length 66 is not a multiple of 2 x"),
    (["--tensor-model-parallel-size", "2", "--num-query-groups", "1"],
     "--num-query-groups 1 is not a multiple of --tensor-model-parallel-size 2"),
    (["--num-layers-per-virtual-pipeline-stage", "3", "--pipeline-model-parallel-size", "2"], "does not divide"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "63", "--max-position-embeddings",
      "64"], "--seq-length 63 is not a multiple of --context-parallel-size 1 x --tensor-model-parallel-size 2 = 2"),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"], "--attention-dropout"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe"], "--recompute-modules moe recomputes MoE"),
    (["--recompute-granularity", "full", "--ckpt", "ours"], "contradicts --recompute-granularity full"),
    (["--data-path", "/nonexistent/prefix"], "give exactly one of --data-path PREFIX and --mock-data"),
    (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
    (["--ckpt-step", "3"], "--ckpt-step needs --load DIR"),
    (["--ckpt-step", "-1", "--load", "/tmp"], "--ckpt-step -1 is outside [0, inf)"),
    (["--tokenizer-type", "NullTokenizer"], "--tokenizer-type NullTokenizer needs --vocab-size"),
    (["--tokenizer-type", "SentencePieceTokenizer"], "needs --tokenizer-model PATH"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/nonexistent", "--merge-file", "/x"],
     "--vocab-file /nonexistent does not exist"),
    (["--metrics-json", "/nonexistent/dir/m.json"], "directory /nonexistent/dir does not exist"),
    (["--metrics-json", "/tmp"], "--metrics-json /tmp is a directory; give the path of a file"),
    (["--metrics-json", "/proc/m.json"], "--metrics-json /proc is not writable"),
    (["--save", "/proc/h3t-save"], "--save /proc/h3t-save is not writable"),
    (["--load", "/etc/hostname"], "is a file, not a directory"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes 0.0 is outside (0, inf)"),
    (["--memory-budget", "1e400", "--offload-alpha", "auto"], "--memory-budget"),
    (["--hidden-size", "66"], "--hidden-size 66 is not a multiple of --num-attention-heads 4"),
    (["--seq-length", "128", "--max-position-embeddings", "64"], "--seq-length 128 is outside"),
    (["--num-query-groups", "3"], "--num-query-groups 3 does not divide"),
    (["--strict-p2p-comm", "nope"], "--strict-p2p-comm"),
    (["--foo"], "unrecognized arguments: --foo"),
]


@pytest.mark.parametrize("extra, expected", DRIVER_CASES, ids=[f"drv{i}" for i in range(len(DRIVER_CASES))])
def test_bad_driver_input_is_one_line_through_the_launcher(extra, expected):
    proc = subprocess.run(["bash", str(REPO / "scripts/launch_torchrun.sh"), *BASE, *extra], cwd=REPO,
                          env=dict(_env(), NPROC_PER_NODE="2"), capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("pretrain_llama.py: error: ") and expected in lines[0], lines[0]


def test_the_driver_suite_is_large_enough():
    assert len(DRIVER_CASES) >= 40
