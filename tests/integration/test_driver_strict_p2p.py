"""pretrain_llama.py --strict-p2p: interleaved pipelines under NCCL's P2P semantics on gloo give the
losses of the plain gloo runs (the posting order does not deadlock, and strict mode changes no data)."""
from __future__ import annotations

import math

import pytest

from driver_harness import TINY_MODEL, check_ok, losses, run_pretrain  # noqa: F401

ITERS = 2


def _flags(pp: int, num_layers: int, global_batch: int) -> list[str]:
    model = list(TINY_MODEL)
    model[model.index("--num-layers") + 1] = str(num_layers)
    return [*model, "--pipeline-model-parallel-size", str(pp), "--num-layers-per-virtual-pipeline-stage", "1",
            "--micro-batch-size", "1", "--global-batch-size", str(global_batch), "--train-iters", str(ITERS),
            "--ckpt", "no", "--offload-alpha", "0"]


# (pp, layers, global batch): v = layers / (pp * 1) = 2 and m = global batch
@pytest.mark.parametrize("pp,layers,gbs", [(2, 4, 4), (4, 8, 8)], ids=["p2-v2-m4", "p4-v2-m8"])
def test_strict_p2p_runs_give_the_plain_losses(corpus_prefix, tmp_path, pp, layers, gbs):
    runs = {}
    for name, extra in (("plain", []), ("strict", ["--strict-p2p"])):
        path = tmp_path / f"{name}.json"
        proc = run_pretrain([*_flags(pp, layers, gbs), "--data-path", corpus_prefix, *extra,
                             "--metrics-json", str(path)], nproc=pp)
        check_ok(proc)
        runs[name] = losses(path)
        note = "note: --strict-p2p: pipeline transfers follow NCCL's ordering (group communicators)"
        assert (note in proc.stdout) == (name == "strict"), proc.stdout[-2000:]
    assert len(runs["plain"]) == ITERS and all(math.isfinite(x) for x in runs["plain"])
    assert runs["strict"] == runs["plain"]


def test_bad_strict_p2p_comm_is_a_one_line_error():
    proc = run_pretrain([*_flags(2, 4, 4), "--mock-data", "--strict-p2p", "--strict-p2p-comm", "ring"])
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "--strict-p2p-comm" in err[0] and "ring" in err[0], proc.stderr
