"""Bad input suite: every bad h3t-plan invocation and every bad driver invocation (through the launcher
script) is one line on stderr and exit status 2; the planner answers each within 2 s."""
from __future__ import annotations

import json
import re
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
    # a Megatron-LM command line of a model family the cost model does not price: named, not only "unrecognized"
    ([*ESTIMATE, "--num-experts", "8", "--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"],
     "--moe-expert-capacity-factor, --moe-pad-expert-input-to-capacity: the cost model does not price these "
     "mixture-of-experts settings"),
    ([*SEARCH, "--multi-latent-attention", "--kv-lora-rank=512"],
     "--multi-latent-attention, --kv-lora-rank: the cost model does not price multi-latent attention"),
    # an FP8 run's BF16 first / last layers: megatron-core's rules (the recipe, at most L / p each), and FP8 needed
    ([*ESTIMATE, "--gpu", "h100-sxm", "--fp8-format", "hybrid", "--first-last-layers-bf16"],
     "--first-last-layers-bf16 does not work with --fp8-recipe delayed (megatron-core: delayed scaling does not "
     "support first / last layers in BF16); valid: tensorwise, blockwise or mxfp8"),
    ([*ESTIMATE, "--gpu", "h100-sxm", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise",
      "--first-last-layers-bf16", "--pipeline-model-parallel-size", "4", "--num-layers-at-end-in-bf16", "9"],
     "--num-layers-at-end-in-bf16 must be between 0 and the layers per pipeline stage (32 // 4 = 8), got 9"),
    ([*ESTIMATE, "--first-last-layers-bf16"], "--first-last-layers-bf16 needs --fp8-format (e4m3 or hybrid)"),
    ([*SEARCH, "--first-last-layers-bf16"], "--first-last-layers-bf16 need --precision fp8 or auto"),
    ([*ESTIMATE, "--gpu", "h100-sxm", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise",
      "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "-1"],
     "--num-layers-at-start-in-bf16"),
    ([*SEARCH, "--fp4-format", "e2m1"], "--fp4-format: the cost model does not price FP4 training"),
    ([*SEARCH, "--foo"], "unrecognized arguments: --foo"),
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
    # flags that change memory, time or numerics and that the other flags left nothing to act on (accepted, ignored)
    (_with(ESTIMATE, fp8_recipe="blockwise"),
     "argument --fp8-recipe: needs --fp8-format (e4m3 or hybrid); a BF16 plan has no FP8 recipe"),
    (_with(SEARCH, fp8_recipe="blockwise"),
     "argument --fp8-recipe: needs --precision fp8 or auto, or --fp8-format (bf16 plans have no FP8 recipe)"),
    (_with(ESTIMATE, optimizer_offload_fraction="0.5"), "argument --optimizer-offload-fraction: needs "
     "--optimizer-cpu-offload (without it no optimizer state is stepped on the CPU)"),
    (_with(SEARCH, optimizer_offload_fraction="0.5"), "argument --optimizer-offload-fraction: needs "
     "--optimizer-cpu-offload (without it no optimizer state is stepped on the CPU; search picks the fraction of the "
     "plans it offloads itself)"),
    (_with(ESTIMATE, overlap_cpu_optimizer_d2h_h2d=None), "argument --overlap-cpu-optimizer-d2h-h2d: needs "
     "--optimizer-cpu-offload (without it there are no CPU optimizer copies to overlap)"),
    (_with(SEARCH, overlap_cpu_optimizer_d2h_h2d=None, no_use_distributed_optimizer=None),
     "argument --overlap-cpu-optimizer-d2h-h2d: needs --optimizer-cpu-offload"),
    (_with(ESTIMATE, recompute_method="block"),
     "argument --recompute-method: needs --recompute-granularity full (it picks the layers full recompute reruns)"),
    (_with(ESTIMATE, recompute_granularity="selective", recompute_method="block"),
     "argument --recompute-method: needs --recompute-granularity full"),
    (_with(ESTIMATE, recompute_num_layers=4), "argument --recompute-num-layers: needs --recompute-granularity full "
     "(without a granularity Megatron-LM recomputes nothing)"),
    (_with(ESTIMATE, recompute_modules="mlp"), "argument --recompute-modules: needs --recompute-granularity selective "
     "(without a granularity Megatron-LM recomputes nothing)"),
    (_with(ESTIMATE, recompute_granularity="selective", recompute_modules=None),
     "argument --recompute-modules: needs one or more of core_attn, layernorm, mlp"),
    (_with(ESTIMATE, activation_offload_fraction="0.5"), "argument --activation-offload-fraction: needs "
     "--fine-grained-activation-offloading (without it Megatron-LM offloads nothing)"),
    (_with(ESTIMATE, min_offloaded_tensor_size=5), "argument --min-offloaded-tensor-size: needs "
     "--fine-grained-activation-offloading (without it Megatron-LM offloads nothing)"),
    (_with(ESTIMATE, delta_offload_bytes_across_pp_ranks=10**9), "argument --delta-offload-bytes-across-pp-ranks: "
     "needs --fine-grained-activation-offloading (without it Megatron-LM offloads nothing)"),
    (_with(SEARCH, tp_comm_overlap=None, tensor_model_parallel_size=1), "argument --tp-comm-overlap: needs "
     "--sequence-parallel with --tensor-model-parallel-size > 1 (Megatron-LM asserts it; no plan of this search "
     "could overlap)"),
    (_with(SEARCH, tp_comm_overlap=None, no_sequence_parallel=None), "argument --tp-comm-overlap: needs "
     "--sequence-parallel with --tensor-model-parallel-size > 1"),
    # the system: one of --gpu and --system-file, a name that is a name, a path that is a file
    (_with(ESTIMATE, system_file="h3t_ext/data/systems/h800.json", gpu="nonexistent"), "argument --gpu: give one of "
     "--gpu nonexistent and --system-file h3t_ext/data/systems/h800.json (the system file describes the GPU)"),
    (_with(ESTIMATE, system_file=""),
     "argument --system-file: --system-file: an empty path; give the path of a system file (JSON)"),
    (_with(ESTIMATE, system_file="/dev/null"),
     "argument --system-file: --system-file /dev/null: not a regular file; give the path of a system file (JSON)"),
    (_with(ESTIMATE, gpu="../systems/h800"), "argument --gpu: unknown system '../systems/h800'; valid: a100-40g, "
     "a100-80g, a800, b200, gb200, gb300, h100-sxm, h200, h800"),
    (_with(SEARCH, num_layers=16384), "argument --num-layers: 16384 out of range (valid: integer in [1, 1024])"),
    (["calibrate", "--model", "llama-7b", "--runs", "/tmp", "--output", "x.json"],
     "--runs /tmp: a directory; give a --metrics-json or CSV file"),
    (["calibrate", "--model", "llama-7b", "--runs", "/dev/null", "--output", "x.json"],
     "--runs /dev/null: not a regular file"),
    (["calibrate", "--model", "llama-7b", "--runs", "/dev/null", "--output", ""],
     "--output: an empty path; give a file path"),
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


def _plan_json(argv, timeout: float) -> dict:
    proc = subprocess.run([PYTHON, "-m", "h3t_ext.planner", *argv, "--json"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    return json.loads(proc.stdout)


LLAMA = ["--model", "llama-7b", "--seq-length", "4096"]


@pytest.mark.parametrize("argv, note", [
    (["--num-gpus", "1024", "--pipeline-model-parallel-size", "1024", "--num-layers", "1024", "--global-batch-size",
      "1024"], "its schedule has 2 x 1024 microbatches x 1024 pipeline stages x 1 model chunks = 2097152 compute "
               "actions, more than the 524288 the timeline simulates"),  # 40 s
    (["--num-gpus", "512", "--pipeline-model-parallel-size", "512", "--num-layers", "1024", "--global-batch-size",
      "512", "--num-layers-per-virtual-pipeline-stage", "1"],
     "its schedule has 2 x 512 microbatches x 512 pipeline stages x 2 model chunks = 1048576 compute actions, more "
     "than the 524288 the timeline simulates"),
])
def test_schedules_too_large_to_simulate_are_priced_by_the_closed_form(argv, note):
    """A pipeline schedule of millions of actions hung the estimate (a MemoryError traceback with thousands of
    model chunks); it is priced by the closed form, which the output says (thousands of stages: even a shorter
    run of its steady state is too large to simulate)."""
    out = _plan_json(["estimate", *LLAMA, *argv], timeout=15)
    assert out["timeline_note"] == f"priced by the closed form: {note}"
    assert out["iteration_time_s"] == out["closed_form_iteration_time_s"] > 0


@pytest.mark.parametrize("argv", [
    # 16,777,216 computes; 67,108,864 interleaved; 16,777,216 layer copies at p = 1
    ["--num-gpus", "8", "--pipeline-model-parallel-size", "8", "--global-batch-size", "1048576"],
    ["--num-gpus", "8", "--pipeline-model-parallel-size", "8", "--global-batch-size", "1048576",
     "--num-layers-per-virtual-pipeline-stage", "1"],
    ["--num-gpus", "8", "--num-layers", "1024", "--global-batch-size", "65536", "--offload-alpha", "0.5"],
])
def test_schedules_too_large_to_simulate_whole_are_priced_from_their_steady_state(argv):
    """Millions of actions, too many to simulate whole (they were priced by the closed form), priced on the timeline
    from a shorter run whose steady state repeats (h3t_ext/costmodel/timeline_steady.py), in a second: no note,
    within 1% of the closed form."""
    out = _plan_json(["estimate", *LLAMA, *argv], timeout=15)
    assert "timeline_note" not in out
    assert out["iteration_time_s"] == pytest.approx(out["closed_form_iteration_time_s"], rel=0.01)


def test_a_schedule_the_timeline_can_simulate_has_no_note():
    out = _plan_json(["estimate", *LLAMA, "--num-gpus", "8", "--pipeline-model-parallel-size", "8",
                      "--global-batch-size", "64"], timeout=15)
    assert "timeline_note" not in out


def test_groups_spread_over_large_nodes_are_priced_at_once(tmp_path):
    """531441 GPUs (3^12) on nodes of 1024: the node-spread walk visited every member of every group of a period
    (5e8 steps) and did not end."""
    d = json.loads((REPO / "h3t_ext/data/systems/h800.json").read_text())
    d["gpus_per_node"] = 1024
    path = tmp_path / "big-nodes.json"
    path.write_text(json.dumps(d))
    out = _plan_json(["estimate", *LLAMA, "--num-gpus", "531441", "--global-batch-size", "531441", "--system-file",
                      str(path)], timeout=15)
    assert out["fits"] and out["iteration_time_s"] > 0


def test_the_fast_node_spread_is_the_walk():
    from h3t_ext.costmodel.collectives import _group_node_spread_walk, group_node_spread
    for g in (1, 2, 3, 4, 6, 8, 12, 16, 72):
        for stride in range(1, 25):
            for size in range(1, 25):
                assert group_node_spread.__wrapped__(stride, size, g) == _group_node_spread_walk(stride, size, g), \
                    (stride, size, g)


def test_the_split_in_closed_form_is_the_walk():
    """stage_layers, chunk_layer_counts and distinct_chunk_layers (O(1) in the chunks: thousands of them made a
    search of 16384 layers take minutes) against the chunk-by-chunk walk."""
    from collections import Counter

    from h3t_ext.layout import PipelineSplit
    for L in range(1, 30):
        for p in range(1, 7):
            for v in range(1, 6):
                for first, last, e, lo in ((None, None, False, False), (None, None, True, False),
                                           (None, None, True, True), (1, None, False, False), (3, 2, False, False)):
                    s = PipelineSplit(L, p, v, first, last, e, lo)
                    seen = set()
                    for stage in range(p):
                        walk = Counter(s.chunk_layers(stage, c) for c in range(v))
                        assert s.chunk_layer_counts(stage) == dict(walk)
                        assert s.stage_layers(stage) == sum(n * k for n, k in walk.items())
                        seen |= set(walk)
                    assert s.distinct_chunk_layers() == seen


def test_the_unit_shape_is_the_units():
    from h3t_ext.ckpt import Recompute
    for granularity, method in (("full", "uniform"), ("full", "block"), ("selective", None), (None, None)):
        for n in range(1, 7):
            r = Recompute.parse(granularity, method, n if granularity == "full" else None)
            for layers in range(0, 25):
                try:
                    units = r.units(layers)
                except ValueError as e:
                    with pytest.raises(ValueError, match=re.escape(str(e))):
                        r.unit_shape(layers)
                    continue
                assert r.unit_shape(layers) == (len(units), sum(b - a for a, b in units),
                                                max((b - a for a, b in units), default=0))


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
    # FP8 values a GPU run's megatron-core refuses are refused on CPU too (where FP8 itself is only noticed)
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16",
      "--num-layers-at-end-in-bf16", "5"], "--num-layers-at-end-in-bf16 must be between 0 and the layers per pipeline "
                                           "stage"),
    (["--fp8-format", "hybrid", "--first-last-layers-bf16"], "does not work with --fp8-recipe delayed"),
]


@pytest.mark.parametrize("extra, expected", DRIVER_CASES, ids=[f"drv{i}" for i in range(len(DRIVER_CASES))])
def test_bad_driver_input_is_one_line_before_any_rank_starts(extra, expected, capsys):
    """Every case through the launchers' check (h3t_training.launch.preflight, which the launch scripts run before
    torchrun, mpirun or srun start a rank), called in this process: its one line and status 2. The launcher around it
    is run for real on three of them below."""
    from h3t_training.launch.preflight import main

    try:
        code = main(["--world-size", "2", "--", *BASE, *extra])
    except SystemExit as e:  # argparse's own errors (unknown flag, invalid choice) leave through SystemExit
        code = e.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("pretrain_llama.py: error: ") and expected in lines[0], lines[0]


LAUNCHER_CASES = [DRIVER_CASES[0], DRIVER_CASES[3],  # a value out of its range; argparse's invalid choice
                  next(c for c in DRIVER_CASES if "--tensor-model-parallel-size" in c[0])]  # a layout of the world


@pytest.mark.parametrize("extra, expected", LAUNCHER_CASES, ids=["range", "choice", "world"])
def test_bad_driver_input_is_one_line_through_the_launcher(extra, expected):
    proc = subprocess.run(["bash", str(REPO / "scripts/launch_torchrun.sh"), *BASE, *extra], cwd=REPO,
                          env=dict(_env(), NPROC_PER_NODE="2"), capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("pretrain_llama.py: error: ") and expected in lines[0], lines[0]


def test_the_driver_suite_is_large_enough():
    assert len(DRIVER_CASES) >= 40
