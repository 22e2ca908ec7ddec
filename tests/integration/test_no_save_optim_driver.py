"""Megatron-LM's --no-save-optim and --no-save-rng through pretrain_llama.py (torch_dist and --ckpt-format torch):
the checkpoint leaves the optimizer state (and the RNG states) out, so it is smaller by at least Adam's two fp32
moments; a resume that would read them is refused in one line naming the flag to add, as Megatron-LM asks; with
--no-load-optim --no-load-rng it continues exactly as a resume from a full checkpoint with the same two flags."""
from __future__ import annotations

import pytest

from driver_harness import TINY_MODEL, check_ok, metrics, run_pretrain

COMMON = [*TINY_MODEL, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
          "--global-batch-size", "2", "--micro-batch-size", "1", "--train-iters", "4", "--eval-iters", "0"]
SKIPS = ["--no-load-optim", "--no-load-rng"]


def _bytes(directory) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def _params() -> int:
    """The model's parameters, from the tiny model's shape (what Adam keeps two fp32 moments of)."""
    h, layers, ffn, vocab, groups, heads = 64, 4, 128, 256, 2, 4
    kv = h // heads * groups
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * ffn + 2 * h
    return layers * per_layer + 2 * vocab * h + h


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_a_checkpoint_without_optimizer_and_rng(tmp_path, fmt):
    full, slim = tmp_path / "full", tmp_path / "slim"
    for root, extra in ((full, []), (slim, ["--no-save-optim", "--no-save-rng"])):
        check_ok(run_pretrain([*COMMON, "--ckpt-format", fmt, "--save", str(root), "--exit-interval", "2", *extra]))
    assert _bytes(full / "iter_0000002") - _bytes(slim / "iter_0000002") >= 2 * 4 * _params()
    proc = run_pretrain([*COMMON, "--load", str(slim)])
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "was saved with --no-save-optim (no optimizer state); add --no-load-optim or --finetune" in proc.stderr
    proc = run_pretrain([*COMMON, "--load", str(slim), "--no-load-optim"])
    assert proc.returncode == 2 and "was saved with --no-save-rng (no RNG states); add --no-load-rng" in proc.stderr
    got, want = tmp_path / "got.json", tmp_path / "want.json"
    check_ok(run_pretrain([*COMMON, "--load", str(slim), *SKIPS, "--metrics-json", str(got)]))
    check_ok(run_pretrain([*COMMON, "--load", str(full), *SKIPS, "--metrics-json", str(want)]))
    assert [r["loss"] for r in metrics(got)["iterations"]] == [r["loss"] for r in metrics(want)["iterations"]]
    assert len(metrics(got)["iterations"]) == 2

