"""h3t-plan takes a training script's own Megatron flags: the flags ``search`` prints for a plan, given back to
``estimate``, price the same plan; Megatron's spellings of the planner's defaults (--sequence-parallel,
--use-distributed-optimizer, --bf16) and its shorthand --recompute-activations are read, not refused; what
contradicts is one line."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner_harness import run_json, run_main

LLAMA7B = ["--model", "llama-7b", "--num-gpus", "8", "--seq-length", "2048", "--global-batch-size", "128",
           "--gpu", "h100-sxm"]
GPT3_A100_40G = ["--model", "gpt3-175b", "--num-gpus", "64", "--seq-length", "2048", "--global-batch-size", "512",
                 "--gpu", "a100-40g"]
LLAMA70B = ["--model", "llama2-70b", "--num-gpus", "64", "--seq-length", "4096", "--global-batch-size", "512",
            "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize("case,extra", [(LLAMA7B, ["--precision", "auto"]), (GPT3_A100_40G, [])],
                         ids=["llama-7b-fp8-and-bf16", "gpt3-175b-cpu-optimizer"])
def test_the_flags_search_prints_price_the_same_plan_in_estimate(case, extra, capsys):
    found = run_json(["search", *case, *extra, "--top", "5"], capsys)
    assert found
    printed = {flag for p in found for flag in p["megatron_flags"]}
    if case is GPT3_A100_40G:  # the case reaches the CPU optimizer, whose Megatron flags estimate must read
        assert {"--use-precision-aware-optimizer", "--optimizer-cpu-offload"} <= printed
    else:
        assert "--fp8-format" in printed
    for plan in found:
        again = run_json(["estimate", *case, *plan["megatron_flags"]], capsys)
        assert again["tokens_per_second"] == pytest.approx(plan["tokens_per_second"], rel=1e-9)
        assert again["peak_memory_bytes"] == plan["peak_memory_bytes"]


def test_megatrons_spellings_of_the_defaults_are_read(capsys):
    plain = run_json(["estimate", *LLAMA70B, "--recompute-granularity", "selective"], capsys)
    spelled = run_json(["estimate", *LLAMA70B, "--sequence-parallel", "--use-distributed-optimizer", "--bf16",
                     "--recompute-activations", "--group-query-attention", "--use-flash-attn"], capsys)
    assert spelled == plain
    without = run_json(["estimate", *LLAMA70B], capsys)
    assert without["peak_memory_bytes"] > plain["peak_memory_bytes"]  # the shorthand did recompute something


@pytest.mark.parametrize("flags,named", [
    (["--sequence-parallel", "--no-sequence-parallel"], "--no-sequence-parallel: not allowed with argument "
                                                        "--sequence-parallel"),
    (["--use-distributed-optimizer", "--no-use-distributed-optimizer"], "not allowed with argument"),
    (["--recompute-activations", "--recompute-granularity", "full"], "--recompute-activations (selective) "
                                                                     "contradicts --recompute-granularity full"),
    (["--use-megatron-fsdp"], "--use-megatron-fsdp: needs --data-parallel-sharding-strategy"),
    (["--bf16", "--fp16"], "--fp16: not allowed with argument --bf16"),
    (["--max-position-embeddings", "2048"], "--max-position-embeddings: 2048 is below --seq-length 4096"),
    (["--use-flash-attn", "--attention-backend", "unfused"], "--use-flash-attn: contradicts --attention-backend "
                                                             "unfused"),
    (["--normalization", "layernorm"], "--normalization: invalid choice"),
    (["--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"], "--grad-reduce-in-bf16 contradicts "
                                                                          "--accumulate-allreduce-grads-in-fp32"),
])
def test_contradictions_are_one_line(flags, named, capsys):
    code, _, err = run_main(["estimate", *LLAMA70B, *flags], capsys)
    assert code == 2
    assert named in err and len(err.strip().splitlines()) == 1, err


def test_search_reads_the_shorthand_as_selective_recompute(capsys):
    found = run_json(["search", *LLAMA70B, "--recompute-activations", "--top", "3"], capsys)
    assert found and all("selective" in p["megatron_flags"] for p in found)


def test_an_fp16_run_holds_megatrons_fp16_gradients(capsys):
    """Megatron-LM accumulates and reduces gradients in fp32 for --bf16 only: --fp16 prices 2-byte gradients (as
    --grad-reduce-in-bf16 does), --accumulate-allreduce-grads-in-fp32 restores the 4 bytes."""
    bf16 = run_json(["estimate", *LLAMA70B], capsys)
    fp16 = run_json(["estimate", *LLAMA70B, "--fp16"], capsys)
    bf16_grads = run_json(["estimate", *LLAMA70B, "--grad-reduce-in-bf16"], capsys)
    assert {k: v for k, v in fp16.items() if k != "megatron_flags"} == \
        {k: v for k, v in bf16_grads.items() if k != "megatron_flags"}
    assert fp16["peak_memory_bytes"] < bf16["peak_memory_bytes"]
    fp32_grads = run_json(["estimate", *LLAMA70B, "--fp16", "--accumulate-allreduce-grads-in-fp32"], capsys)
    assert fp32_grads["peak_memory_bytes"] == bf16["peak_memory_bytes"]
    assert fp32_grads["tokens_per_second"] == bf16["tokens_per_second"]
    assert run_json(["estimate", *LLAMA70B, "--bf16", "--accumulate-allreduce-grads-in-fp32"], capsys) == bf16


def test_a_custom_gpt_shape_says_its_norm_and_positions(capsys):
    """A GeLU model from shape flags is Megatron's GPT (LayerNorm, a learned position table); the flags say otherwise."""
    gpt = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--ffn-hidden-size", "8192",
           "--vocab-size", "50257", "--no-swiglu", "--seq-length", "2048", "--num-gpus", "8", "--global-batch-size",
           "64", "--tensor-model-parallel-size", "8"]
    learned = run_json(["estimate", *gpt], capsys)
    rope = run_json(["estimate", *gpt, "--position-embedding-type", "rope"], capsys)
    table = 2048 * 2048  # whole on every tensor-parallel rank: weights, fp32 gradients, the optimizer's shard
    assert learned["peak_memory_bytes"] - rope["peak_memory_bytes"] >= table * (2 + 4)
    assert rope["tokens_per_second"] < learned["tokens_per_second"]  # RoPE's kernels in every layer
    assert run_json(["estimate", *gpt, "--position-embedding-type", "learned_absolute", "--normalization", "LayerNorm"],
                 capsys) == learned


@pytest.mark.parametrize("extra,printed", [(["--fp16"], ["--fp16"]),
                                           (["--fp16", "--accumulate-allreduce-grads-in-fp32"],
                                            ["--fp16", "--accumulate-allreduce-grads-in-fp32"]),
                                           (["--grad-reduce-in-bf16"], ["--grad-reduce-in-bf16"])])
def test_an_fp16_plan_prints_megatrons_fp16_flags_and_reads_them_back(extra, printed, capsys):
    got = run_json(["estimate", *LLAMA70B, *extra], capsys)
    precision = [f for f in got["megatron_flags"] if f in ("--fp16", "--accumulate-allreduce-grads-in-fp32",
                                                            "--grad-reduce-in-bf16", "--bf16")]
    assert precision == printed
    assert run_json(["estimate", *LLAMA70B, *got["megatron_flags"]], capsys) == got


def test_a_custom_gqa_shape_names_its_groups(capsys):
    """Megatron-LM's --group-query-attention without --num-query-groups runs one group: a custom shape must say."""
    shape = ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64", "--ffn-hidden-size",
             "28672", "--vocab-size", "32000", "--seq-length", "4096", "--num-gpus", "64", "--global-batch-size", "512",
             "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2"]
    code, _, err = run_main(["estimate", *shape, "--group-query-attention"], capsys)
    assert code == 2 and "--group-query-attention: needs --num-query-groups" in err and len(err.splitlines()) == 1
    gqa = run_json(["estimate", *shape, "--group-query-attention", "--num-query-groups", "8"], capsys)
    assert gqa == run_json(["estimate", *shape, "--num-query-groups", "8"], capsys)


def test_the_vocabulary_pads_as_megatron_pads_it(capsys):
    """At t = 8 the vocabulary pads to a multiple of 1,024 by Megatron's default (128 x t), of 8 with divisible-by 1."""
    from h3t_ext.costmodel import get_model

    llama = get_model("llama2-70b")
    v = llama.vocab_size
    assert llama.padded_vocab_size(8) == -(-v // 1024) * 1024
    assert replace(llama, make_vocab_size_divisible_by=1).padded_vocab_size(8) == -(-v // 8) * 8 < -(-v // 1024) * 1024
    padded = run_json(["estimate", *LLAMA70B], capsys)
    exact = run_json(["estimate", *LLAMA70B, "--make-vocab-size-divisible-by", "1"], capsys)
    assert exact["peak_memory_bytes"] < padded["peak_memory_bytes"]
    assert exact["tokens_per_second"] > padded["tokens_per_second"]


@pytest.mark.parametrize("abbreviated", [["--tensor-model", "2"], ["--cpu-offloading", "--cpu-offloading-num-layers", "4"],
                                         ["--micro-batch", "2"]])
def test_flags_are_taken_whole_as_megatron_takes_them(abbreviated, capsys):
    """Megatron-LM's parser refuses abbreviations (allow_abbrev=False); so does h3t-plan, in one line, rather than
    price a flag a training script could not pass (``--tensor-model 2``) or read ``--cpu-offloading`` as the start
    of ``--cpu-offloading-num-layers``."""
    code, out, err = run_main(["estimate", *LLAMA7B, *abbreviated], capsys)
    assert code == 2 and err.count("\n") == 1 and "unrecognized arguments: " + abbreviated[0] in err
