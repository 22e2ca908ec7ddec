"""--position-embedding-type none (NoPE) as in Megatron-LM: megatron-core's GPTModel builds neither a learned position
table nor a rotary embedding, and the cost model prices the same parameters as for the other two kinds."""
from __future__ import annotations

import pytest
import torch

from h3t_ext.testing import run_distributed

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "48", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters",
         "1", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--seed", "3"]


def _built(rank: int, world_size: int, kind: str) -> tuple[dict, int, object]:
    from megatron.core import parallel_state as ps

    from h3t_ext.costmodel.memory import stage_params
    from h3t_training.config.arguments import MEGATRON_GPT_DEFAULTS
    from h3t_training.config.run_spec import model_spec, run_plan
    from h3t_training.config.sections import parse_args
    from h3t_training.loop.model_provider import build_model_chunks

    args = parse_args([*FLAGS, "--position-embedding-type", kind], prog="pretrain_gpt.py",
                      defaults=MEGATRON_GPT_DEFAULTS, world_size=world_size)
    ps.initialize_model_parallel()
    (chunk,) = build_model_chunks(args, on_gpu=False, vocab_size=args.tokenizer_vocab_size)
    names = {n: p.numel() for n, p in chunk.named_parameters()}
    predicted = stage_params(model_spec(args, args.tokenizer_vocab_size), run_plan(args), 0)
    return names, predicted, getattr(chunk, "rotary_pos_emb", None) is not None


@pytest.mark.parametrize("kind", ["learned_absolute", "rope", "none"])
def test_each_kind_builds_its_positions_and_the_cost_model_counts_them(kind):
    (names, predicted, rotary), = run_distributed(_built, 1, (kind,))
    assert ("embedding.position_embeddings.weight" in names) is (kind == "learned_absolute")
    assert rotary is (kind == "rope")
    assert sum(names.values()) == predicted
    if kind == "learned_absolute":
        assert names["embedding.position_embeddings.weight"] == 48 * 64


def test_nope_trains_through_the_driver(tmp_path):
    from driver_harness import check_ok, losses, run_pretrain

    out = tmp_path / "m.json"
    check_ok(run_pretrain([*FLAGS, "--train-iters", "3", "--position-embedding-type", "none", "--metrics-json",
                           str(out), "--no-progress-bar"], entry="pretrain_gpt.py"))
    assert len(losses(out)) == 3 and all(torch.isfinite(torch.tensor(losses(out))))
