"""Megatron's fine-grained activation offload flags in a real driver run (CPU, p=1): they run as the mapped
--offload-alpha, which offloads (the metrics show it) and is lossless (the losses equal a run without offload)."""
from __future__ import annotations

import pytest

from tests.driver_harness import TINY_MODEL, check_ok, metrics, run_pretrain

RUN = [*TINY_MODEL, "--mock-data", "--global-batch-size", "2", "--micro-batch-size", "1", "--train-iters", "3"]
FG = ["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "attn_proj",
      "--min-offloaded-tensor-size", "0"]


def test_fine_grained_flags_train_as_the_mapped_alpha_with_the_same_losses(tmp_path):
    got = {}
    for name, flags in (("fg", FG), ("plain", [])):
        out = tmp_path / f"{name}.json"
        proc = run_pretrain([*RUN, *flags, "--metrics-json", str(out)])
        check_ok(proc)
        got[name] = (metrics(out), proc.stdout + proc.stderr)
    (fg, log), (plain, _) = got["fg"], got["plain"]
    alpha = fg["config"]["offload_alpha"]
    assert 0 < alpha < 1 and plain["config"]["offload_alpha"] == 0.0
    assert f"runs as --offload-alpha {alpha:.3f}" in log
    assert fg["offloaded_bytes"][0] > 0
    assert [r["loss"] for r in fg["iterations"]] == pytest.approx([r["loss"] for r in plain["iterations"]], abs=0)
