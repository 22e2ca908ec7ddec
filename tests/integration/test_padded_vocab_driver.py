"""--padded-vocab-size through the driver: the model it builds and saves has exactly that many vocabulary rows (as
Megatron-LM builds it), and --use-checkpoint-args takes the rows from a checkpoint when the command line gives none."""
from __future__ import annotations

import torch

from driver_harness import TINY_MODEL, check_ok, losses, run_pretrain  # noqa: F401

RUN = ["--micro-batch-size", "1", "--global-batch-size", "2", "--lr-warmup-iters", "0", "--ckpt-format", "torch"]


def _rows(directory) -> tuple[int, int]:
    state = torch.load(directory / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt", map_location="cpu",
                       weights_only=False)["model"]
    return state["embedding.word_embeddings.weight"].shape[0], state["output_layer.weight"].shape[0]


def test_the_model_has_the_given_rows_and_a_checkpoint_gives_them_back(corpus_prefix, tmp_path):
    flags = [*TINY_MODEL, *RUN, "--data-path", corpus_prefix, "--train-iters", "2"]
    check_ok(run_pretrain([*flags, "--padded-vocab-size", "300", "--save", str(tmp_path / "p"), "--exit-interval", "1"]))
    assert _rows(tmp_path / "p") == (300, 300)  # ByteTokenizer's 257 tokens would pad to 384
    check_ok(run_pretrain([*flags, "--save", str(tmp_path / "default"), "--exit-interval", "1"]))
    assert _rows(tmp_path / "default") == (384, 384)
    out = tmp_path / "m.json"
    proc = run_pretrain([*flags, "--load", str(tmp_path / "p"), "--use-checkpoint-args",
                         "--no-load-optim", "--metrics-json", str(out)])
    check_ok(proc)
    assert "padded_vocab_size=300" in proc.stdout and len(losses(out)) == 1
