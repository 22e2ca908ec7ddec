"""A Megatron-LM user's scripts run unchanged: the flag table covers every flag of Megatron-LM's
pretrain_gpt.py, script flags are never refused, and the flag sets of Megatron-LM's GPT-3 175B and
Llama-3 8B example scripts and of Megatron-Kwai's ATC'24 pretrain_llama.sh train on CPU (only model size,
run length, data paths and parallel sizes changed)."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from driver_harness import REPO, check_ok, metrics, run_pretrain  # noqa: F401
from h3t_training.config.arguments import LLAMA_DEFAULTS, build_parser
from h3t_training.config.flag_docs import render_markdown
from h3t_training.config.flag_table import TABLE
from h3t_training.megatron_release import NULL_TOKENIZER_EOD_IN_VOCAB_FROM, installed_megatron_core
from megatron_scripts import GPT3_175B, LLAMA3_8B_FP8, kwai_pretrain_llama, script_flags, shrink

FLAG_LIST = Path(__file__).resolve().parents[1] / "data" / "megatron_lm_pretrain_gpt_flags.txt"


def _megatron_lm_flags() -> list[str]:
    return [line.strip() for line in FLAG_LIST.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_every_megatron_lm_flag_is_implemented_noticed_or_refused():
    flags = _megatron_lm_flags()
    assert len(flags) == 876
    unknown = [f for f in flags if f not in TABLE]
    assert unknown == []
    assert {TABLE[f].cls for f in flags} == {"implemented", "noticed", "refused"}
    for f in flags:
        e = TABLE[f]
        if e.cls != "implemented":
            assert e.reason.text and e.reason.alternative, f
    for defaults in ({}, LLAMA_DEFAULTS):  # both entry points parse every one of them
        parser = build_parser("pretrain_gpt.py", defaults)
        assert [f for f in flags if f not in parser._option_string_actions] == []


@pytest.mark.parametrize("flags", [GPT3_175B, LLAMA3_8B_FP8, kwai_pretrain_llama("ours", "0.10", "1", "4"),
                                   kwai_pretrain_llama("full", "0.0", "1", "1")], ids=["gpt3", "llama3", "kwai-ours",
                                                                                      "kwai-baseline"])
def test_example_script_flags_are_never_refused(flags):
    parser = build_parser("pretrain_gpt.py", {})
    for f in script_flags(flags):
        assert f in parser._option_string_actions, f
        if f in TABLE:
            assert TABLE[f].cls != "refused", f


def test_docs_are_rendered_from_the_table():
    assert (REPO / "docs" / "flags.md").read_text() == render_markdown() + "\n"


def _gpt2_files(d: Path) -> tuple[str, str]:
    """A byte-level GPT-2 vocabulary (256 bytes + <|endoftext|>) with no merges."""
    from tokenizers import pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n")
    return str(d / "vocab.json"), str(d / "merges.txt")


def _notes(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("note: ")]


def test_gpt3_175b_script_trains_a_gpt_model(corpus_prefix, tmp_path):
    vocab, merges = _gpt2_files(tmp_path)
    L, h, s = 2, 64, 64
    flags = shrink(GPT3_175B, {
        "--num-layers": str(L), "--hidden-size": str(h), "--num-attention-heads": "4", "--seq-length": str(s),
        "--max-position-embeddings": str(s), "--global-batch-size": "4", "--train-iters": "3",
        "--step-batch-size-schedule": "0:2 256:4",  # 256 tokens = 4 samples of 64: two iterations of 2, then 4
        "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "1", "--data-path": corpus_prefix,
        "--vocab-file": vocab, "--merge-file": merges, "--save": str(tmp_path / "ckpt"),
        "--load": str(tmp_path / "ckpt"), "--tensorboard-dir": str(tmp_path / "tb")})
    out = tmp_path / "m.json"
    proc = run_pretrain([*flags, "--metrics-json", str(out)], entry="pretrain_gpt.py")
    check_ok(proc)
    its = metrics(out)["iterations"]
    assert [r["iteration"] for r in its] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in its)
    assert [r["global_batch_size"] for r in its] == [2, 2, 4]
    # Megatron's schedule: warm-up over .001 of the 430000-iteration decay span (iterations of the final
    # batch size), counted in samples: 2 consumed after the first iteration
    assert its[0]["learning_rate"] == pytest.approx(6.0e-5 * 2 / int(0.001 * 430000 * 4))
    # a GPT-3 model: LayerNorm with bias, GeLU MLP with biases, learned positions, tied embeddings
    V = 384  # 257 tokens padded to a multiple of 128
    expected = V * h + s * h + L * (12 * h * h + 13 * h) + 2 * h
    n = int(re.search(r"(\d+) parameters on this rank", proc.stdout).group(1))
    assert n == expected
    notes = _notes(proc.stdout)
    for flag in ("--fp16", "--attention-backend"):
        assert sum(line.startswith(f"note: {flag}:") for line in notes) == 1, notes
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_llama3_8b_script_trains_with_sample_based_schedule(tmp_path):
    flags = shrink(LLAMA3_8B_FP8, {
        "--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "224", "--num-attention-heads": "4",
        "--num-query-groups": "2", "--kv-channels": "32", "--seq-length": "64", "--max-position-embeddings": "64",
        "--global-batch-size": "4", "--train-samples": "12", "--lr-decay-samples": "12", "--lr-warmup-samples": "4",
        "--vocab-size": "1024", "--data-cache-path": str(tmp_path / "cache"), "--save": str(tmp_path / "ckpt"),
        "--load": str(tmp_path / "ckpt"), "--tensorboard-dir": str(tmp_path / "tb")})
    out = tmp_path / "m.json"
    proc = run_pretrain([*flags, "--metrics-json", str(out)], nproc=2, entry="pretrain_gpt.py")
    check_ok(proc)
    its = metrics(out)["iterations"]
    assert [r["iteration"] for r in its] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in its)
    assert [r["learning_rate"] for r in its][:1] == [pytest.approx(0.00015)]  # warm-up ends after 4 samples
    notes = _notes(proc.stdout)
    assert any(line.startswith("note: --sequence-parallel: disabled") for line in notes)
    assert any(line.startswith("note: --fp8-format:") for line in notes)
    assert not any(line.startswith("note: --decoupled-lr") for line in notes)  # implemented
    h, f, L, q, kv = 64, 224, 2, 4 * 32, 2 * 32
    # NullTokenizer: --vocab-size 1024 ids (megatron-core 0.18+) or 1024 ids + eod (0.16, 0.17), padded to 128s
    V = 1024 if installed_megatron_core() >= NULL_TOKENIZER_EOD_IN_VOCAB_FROM else 1152
    per_layer = h * (q + 2 * kv) + q * h + 2 * h * f + f * h + 2 * h
    n = int(re.search(r"(\d+) parameters on this rank", proc.stdout).group(1))
    assert n == 2 * V * h + L * per_layer + h  # untied, no biases, RMSNorm


KWAI_SMALL = {"--num-layers": "4", "--hidden-size": "64", "--num-attention-heads": "4", "--ffn-hidden-size": "128",
              "--seq-length": "64", "--max-position-embeddings": "64", "--global-batch-size": "8", "--train-iters": "3"}


def test_kwai_ours_flags_are_ckpt_ours_with_offload(corpus_prefix, tmp_path):
    kwai = shrink(kwai_pretrain_llama("ours", "0.10", "1", "4"),
                  {**KWAI_SMALL, "--pipeline-model-parallel-size": "2", "--data-path": corpus_prefix})
    ours = shrink(kwai, {}, drop=("--kaimm-recompute-mlp-activation-func", "--kaimm-recompute-norm",
                                  "--kaimm-offload-activation-ratio")) + ["--ckpt", "ours", "--offload-alpha", "0.10"]
    got = {}
    for name, flags in (("kwai", kwai), ("ours", ours)):
        out = tmp_path / f"{name}.json"
        proc = run_pretrain([*flags, "--metrics-json", str(out)], nproc=2, entry="pretrain_gpt.py")
        check_ok(proc)
        got[name] = metrics(out)
    kw, ref = got["kwai"], got["ours"]
    assert kw["config"]["ckpt"] == "ours" and kw["config"]["offload_alpha"] == pytest.approx(0.1)
    assert len(kw["iterations"]) == 3 and kw["offloaded_bytes"][0] > 0  # the first stage offloads
    assert [r["loss"] for r in kw["iterations"]] == [r["loss"] for r in ref["iterations"]]
    assert kw["stage_peak_activation_bytes"] == ref["stage_peak_activation_bytes"]


def test_kwai_baseline_flags_train_with_full_recompute(corpus_prefix, tmp_path):
    flags = shrink(kwai_pretrain_llama("full", "0.0", "1", "1"), {**KWAI_SMALL, "--data-path": corpus_prefix})
    out = tmp_path / "m.json"
    proc = run_pretrain([*flags, "--metrics-json", str(out)], entry="pretrain_gpt.py")
    check_ok(proc)
    m = metrics(out)
    assert m["config"]["ckpt"] == "full" and len(m["iterations"]) == 3
    assert all(math.isfinite(r["loss"]) for r in m["iterations"])
    notes = _notes(proc.stdout)
    assert any(line.startswith("note: --kaimm-cuda-synchronize-level:") for line in notes)
