"""Megatron-LM's --embedding-init-method-std through the driver's model build: megatron-core draws the word and
learned position embeddings from N(0, that std) and every other weight as before, so with the same seed the
embeddings are the default ones scaled by std / --init-method-std and every other tensor is the same."""
from __future__ import annotations

import pytest
import torch

from h3t_ext.testing import run_distributed

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
         "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--seed", "3"]


def _weights(rank: int, world_size: int, extra: list[str]) -> dict:
    from megatron.core import parallel_state as ps

    from h3t_training.config.arguments import MEGATRON_GPT_DEFAULTS
    from h3t_training.config.sections import parse_args
    from h3t_training.loop.model_provider import build_model_chunks

    args = parse_args([*FLAGS, *extra], prog="pretrain_gpt.py", defaults=MEGATRON_GPT_DEFAULTS, world_size=world_size)
    ps.initialize_model_parallel()
    (chunk,) = build_model_chunks(args, on_gpu=False, vocab_size=256)
    return {k: v.detach().clone() for k, v in chunk.state_dict().items() if torch.is_tensor(v) and v.is_floating_point()}


def test_only_the_embeddings_take_the_embedding_std():
    (plain,), (scaled,) = run_distributed(_weights, 1, ([],)), run_distributed(
        _weights, 1, (["--embedding-init-method-std", "0.5"],))
    embeddings = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight"}
    assert embeddings <= set(plain) and set(plain) == set(scaled)
    for name in embeddings:
        assert torch.allclose(scaled[name], plain[name] * (0.5 / 0.02), rtol=1e-5, atol=0)
        assert scaled[name].std().item() == pytest.approx(0.5, rel=0.05)
    others = [n for n in plain if n not in embeddings and plain[n].abs().sum() > 0]
    assert others and all(torch.equal(plain[n], scaled[n]) for n in others)
