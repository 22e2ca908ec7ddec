"""Every plan h3t-plan prints launches: plans mixing t, c, p and v for a small model on 4 GPUs run
through the driver on 4 CPU ranks with exactly the planner's megatron_flags (issue #9)."""
from __future__ import annotations

import json
import math
import subprocess

import pytest

from driver_harness import PYTHON, REPO, _env, check_ok, losses, run_pretrain  # noqa: F401

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "128", "--seq-length", "64"]
DRIVER_ONLY = ["--group-query-attention", "--lr", "1e-3", "--train-iters", "2", "--log-interval", "1",
               "--no-progress-bar", "--seed", "7"]
# (t, c, p, layers per virtual stage): the mixed layouts a 4-GPU cluster allows
SIGNATURES = [(2, 2, 1, None), (1, 2, 2, 1), (2, 1, 2, 1)]


def _flag(flags: list[str], name: str, default=None):
    return int(flags[flags.index(name) + 1]) if name in flags else default


@pytest.fixture(scope="module")
def planned() -> dict:
    out = subprocess.run([PYTHON, "-m", "h3t_ext.planner", "search", *MODEL, "--vocab-size", "258", "--num-gpus", "4",
                          "--global-batch-size", "8", "--gpu", "h800", "--top", "200", "--json"],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120, check=True)
    first = {}
    for row in json.loads(out.stdout):
        f = row["megatron_flags"]
        key = (_flag(f, "--tensor-model-parallel-size", 1), _flag(f, "--context-parallel-size", 1),
               _flag(f, "--pipeline-model-parallel-size", 1), _flag(f, "--num-layers-per-virtual-pipeline-stage"))
        first.setdefault(key, f)
    return first


@pytest.mark.parametrize("signature", SIGNATURES, ids=lambda s: "t{}c{}p{}l{}".format(*s))
def test_planned_layout_trains_on_four_ranks(planned, signature, corpus_prefix, tmp_path):
    assert signature in planned, f"the planner printed no plan with (t, c, p, l) = {signature}"
    flags = planned[signature]
    out = tmp_path / "m.json"
    proc = run_pretrain([*MODEL, *DRIVER_ONLY, *flags, "--data-path", corpus_prefix, "--metrics-json", str(out)],
                        nproc=4)
    check_ok(proc)
    got = losses(out)
    assert len(got) == 2 and all(math.isfinite(x) for x in got)
    cfg = json.loads(out.read_text())["config"]
    t, c, p, _ = signature
    assert (cfg["tensor_model_parallel_size"], cfg["context_parallel_size"], cfg["pipeline_model_parallel_size"]) == \
        (t, c, p)
