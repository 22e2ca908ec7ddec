"""Megatron-LM's --reset-position-ids: the position ids of a sample restart at 0 after each end of document
(megatron-core's GPT dataset computes them), which the learned absolute position embedding reads and RoPE does not
(megatron-core's GPTModel rotates by the position in the sequence), as in Megatron-LM."""
from __future__ import annotations

import numpy
import pytest
import torch

from driver_harness import check_ok, metrics, run_pretrain

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters",
         "2", "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--seed", "3",
         "--split", "100,0,0", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
         "--no-progress-bar"]


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> list[str]:
    """--data-path of 200 documents of 5-20 ids, each ended by NullTokenizer's end of document."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from h3t_training.data.tokenizer import NullTokenizer

    prefix = str(tmp_path_factory.mktemp("docs") / "short")
    eod, rng = NullTokenizer(255).eod, numpy.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for _ in range(200):
        doc = [*rng.integers(0, 250, size=int(rng.integers(5, 21))), eod]
        builder.add_document(torch.tensor(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    return ["--data-path", prefix]


def _samples(extra: list[str]) -> list[dict]:
    from h3t_training.config.arguments import MEGATRON_GPT_DEFAULTS
    from h3t_training.config.sections import parse_args
    from h3t_training.data.datasets import build_datasets
    from h3t_training.data.tokenizer import tokenizer_from_args

    args = parse_args([*FLAGS, *extra], prog="pretrain_gpt.py", defaults=MEGATRON_GPT_DEFAULTS, world_size=1)
    train, _, _ = build_datasets(args, tokenizer_from_args(args))
    return [train[i] for i in range(4)], tokenizer_from_args(args).eod


def _restarted(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    out, start = torch.empty_like(tokens), 0
    for k, token in enumerate(tokens.tolist()):
        out[k] = k - start
        if token == eod:
            start = k + 1
    return out


def test_position_ids_restart_after_each_end_of_document(short_documents):
    samples, eod = _samples([*short_documents, "--reset-position-ids"])
    plain, _ = _samples(short_documents)
    inner = sum(int((s["tokens"][:-1] == eod).sum()) for s in samples)
    assert inner >= 2  # documents end inside the samples, so the restart is seen
    for s, p in zip(samples, plain):
        assert torch.equal(s["tokens"], p["tokens"]) and torch.equal(s["labels"], p["labels"])
        assert torch.equal(s["position_ids"], _restarted(s["tokens"], eod))
        assert torch.equal(p["position_ids"], torch.arange(len(p["tokens"])))


def _losses(tmp_path, name: str, extra: list[str]) -> list[float]:
    out = tmp_path / f"{name}.json"
    check_ok(run_pretrain([*FLAGS, *extra, "--metrics-json", str(out)], entry="pretrain_gpt.py"))
    return [r["loss"] for r in metrics(out)["iterations"]]


def test_learned_positions_read_the_reset_ids_and_rope_does_not(tmp_path, short_documents):
    learned = _losses(tmp_path, "l", short_documents)
    learned_reset = _losses(tmp_path, "lr", [*short_documents, "--reset-position-ids"])
    assert learned[0] != learned_reset[0]  # the first loss, before any update, sees other position embeddings
    rope = [*short_documents, "--position-embedding-type", "rope"]
    assert _losses(tmp_path, "r", rope) == _losses(tmp_path, "rr", [*rope, "--reset-position-ids"])
