"""The stacks published runs use, said on h3t-plan's command line: --attention-backend and --transformer-impl
(through the one translation), priced in memory and time, printed back as flags and round-tripped."""
from __future__ import annotations

import json

import pytest

from h3t_ext.costmodel import Plan, estimate, get_model, get_system
from h3t_ext.planner.cli import main
from h3t_ext.planner.flags import megatron_flags, plan_from_megatron_flags
from planner_harness import run_main

GPT3 = ["--model", "gpt3-175b", "--seq-length", "2048", "--num-gpus", "1024", "--global-batch-size", "1536",
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16", "--gpu", "a100-80g",
        "--offload-alpha", "0", "--json"]


def _estimate(argv, capsys) -> dict:
    code, out, err = run_main(["estimate", *argv], capsys)
    assert code == 0, err
    return json.loads(out)


def test_unfused_attention_keeps_korthikantis_5as2b_per_layer(capsys):
    """Korthikanti et al. 2022 (Sec. 4.1): with attention dropout, the unfused core attention saves 5 a s^2 b
    bytes per layer beyond the 34 s b h of the rest, split over t heads' ranks: what --attention-backend unfused
    adds to the peak of GPT-3 175B (dropout 0.1) over flash, for every microbatch the first stage holds."""
    flash = _estimate([*GPT3, "--attention-backend", "flash"], capsys)
    unfused = _estimate([*GPT3, "--attention-backend", "unfused"], capsys)
    a, s, b, t, layers = 96, 2048, 1, 8, 96 // 16
    held = 16  # plain 1F1B, m >= p: the first stage holds p microbatches of its L/p layers
    expected = held * layers * 5 * a * s * s * b // t
    assert unfused["peak_memory_bytes"] - flash["peak_memory_bytes"] == expected
    assert unfused["tokens_per_second"] < flash["tokens_per_second"]


@pytest.mark.parametrize("ckpt", ["selective", "full"])
def test_recomputing_the_core_attention_drops_the_scores(capsys, ckpt):
    flash = _estimate([*GPT3, "--attention-backend", "flash", "--recompute-granularity", ckpt], capsys)
    local = _estimate([*GPT3, "--attention-backend", "local", "--recompute-granularity", ckpt], capsys)
    assert local["peak_memory_bytes"] == flash["peak_memory_bytes"]


def test_fused_and_auto_price_as_flash(capsys):
    runs = {name: _estimate([*GPT3, "--attention-backend", name], capsys) for name in ("auto", "fused", "flash")}
    assert len({(r["peak_memory_bytes"], r["tokens_per_second"]) for r in runs.values()}) == 1


def test_search_keeps_the_backend_and_prints_megatrons_flags(capsys):
    try:
        code = main(["search", "--model", "llama-7b", "--seq-length", "4096", "--num-gpus", "8",
                     "--global-batch-size", "64", "--attention-backend", "local", "--transformer-impl", "local",
                     "--top", "3", "--json"])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = json.loads(out)
    assert rows
    for row in rows:
        flags = row["megatron_flags"]
        assert flags[flags.index("--attention-backend") + 1] == "unfused"
        assert flags[flags.index("--transformer-impl") + 1] == "local"


def test_backend_flags_round_trip():
    plan = Plan(num_gpus=8, seq_length=4096, global_batch_size=64, tensor_model_parallel_size=2,
                attention_backend="unfused", transformer_impl="local", use_distributed_optimizer=True)
    back = plan_from_megatron_flags(megatron_flags(plan), num_gpus=8, seq_length=4096)
    assert back == plan
    model, system = get_model("llama-7b"), get_system("h800")
    assert estimate(model, back, system).peak_memory_bytes == estimate(model, plan, system).peak_memory_bytes


@pytest.mark.parametrize("argv,named", [(["--attention-backend", "cudnn"], "--attention-backend"),
                                        (["--transformer-impl", "te"], "--transformer-impl")])
def test_bad_backend_is_one_line(capsys, argv, named):
    with pytest.raises(SystemExit) as e:
        main(["estimate", *GPT3, *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and named in err


def test_recompute_granularity_is_megatrons_spelling_of_ckpt(capsys):
    full = _estimate([*GPT3, "--recompute-granularity", "full"], capsys)
    assert full == _estimate([*GPT3, "--ckpt", "full"], capsys)
    selective = _estimate([*GPT3, "--recompute-granularity", "selective", "--attention-backend", "unfused"], capsys)
    no = _estimate([*GPT3, "--attention-backend", "unfused"], capsys)
    assert selective["peak_memory_bytes"] < no["peak_memory_bytes"]
    assert main(["estimate", *GPT3, "--recompute-granularity", "full", "--ckpt", "ours"]) == 2
    err = capsys.readouterr().err
    assert "--recompute-granularity" in err and "--ckpt ours" in err and len(err.strip().splitlines()) == 1
