"""--ckpt-format torch: Megatron-LM's legacy per-rank files (h3t_training.loop.legacy_checkpoint) are written,
resume with the uninterrupted losses bit for bit, load only at the layout they were saved with, and load into a
run whose --ckpt-format is torch_dist (the format is read from the files)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from driver_harness import TINY_MODEL, check_ok, losses, run_pretrain  # noqa: F401

COMMON = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4", "--lr-decay-style", "cosine",
          "--lr-warmup-iters", "1", "--ckpt-format", "torch"]
MEGATRON_KEYS = {"args", "checkpoint_version", "iteration", "optimizer", "opt_param_scheduler", "rng_state",
                 "num_floating_point_operations_so_far"}
"""The keys of Megatron-LM's model_optim_rng.pt (its save_checkpoint's state dict), besides the model's."""


def _files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.mark.parametrize("layout, files, model_keys", [
    (["--pipeline-model-parallel-size", "2"],  # two stages, one rank each: the pipeline rank in the name
     ["common.pt", "h3t_checksums.json", "mp_rank_00_000/model_optim_rng.pt", "mp_rank_00_001/model_optim_rng.pt"],
     {"model"}),
    (["--use-distributed-optimizer"],  # d=2: data-parallel rank 0 writes, Adam's shards gathered there
     ["common.pt", "h3t_checksums.json", "mp_rank_00/distrib_optim.pt", "mp_rank_00/model_optim_rng.pt"], {"model"}),
    pytest.param(["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
                 ["common.pt", "h3t_checksums.json", "mp_rank_00_000/model_optim_rng.pt",
                  "mp_rank_00_001/model_optim_rng.pt"], {"model0", "model1"},
                 marks=pytest.mark.slow),  # the slow tier (about 27 s): p2 with two chunks per stage
], ids=["p2", "d2-distributed-optimizer", "p2-interleaved"])
def test_legacy_checkpoints_resume_bit_for_bit(corpus_prefix, tmp_path, layout, files, model_keys):
    common = [*TINY_MODEL, *COMMON, *layout, "--data-path", corpus_prefix]
    full = tmp_path / "full.json"
    check_ok(run_pretrain([*common, "--metrics-json", str(full)], nproc=2))
    ckpt = tmp_path / "ckpt"
    check_ok(run_pretrain([*common, "--save", str(ckpt), "--exit-interval", "2"], nproc=2))
    it = ckpt / "iter_0000002"
    assert _files(it) == files
    state = torch.load(it / next(f for f in files if f.endswith("model_optim_rng.pt")), map_location="cpu",
                       weights_only=False)
    assert MEGATRON_KEYS | model_keys <= set(state) and state["iteration"] == 2 and state["checkpoint_version"] == 3.0
    assert state["args"].ckpt_format == "torch" and len(state["rng_state"]) == (2 if "--use-distributed-optimizer"
                                                                                  in layout else 1)
    assert all(isinstance(v, torch.Tensor) for k in model_keys for n, v in state[k].items()
               if not n.endswith("_extra_state"))  # each chunk's own state_dict(), megatron-core's names
    resumed = tmp_path / "resumed.json"
    proc = run_pretrain([*common, "--load", str(ckpt), "--metrics-json", str(resumed)], nproc=2)
    check_ok(proc)
    assert "iterations from 2" in proc.stdout and "RNG states start from --seed" not in proc.stdout
    ref = losses(full)
    assert len(ref) == 4 and ref[3] != ref[2]
    assert losses(resumed) == ref[2:]  # bit for bit: weights, Adam state, schedule, data position
    assert [r["iteration"] for r in json.load(open(resumed))["iterations"]] == [3, 4]


def test_a_legacy_checkpoint_loads_only_at_its_layout_and_into_a_torch_dist_run(corpus_prefix, tmp_path):
    common = [*TINY_MODEL, *COMMON, "--data-path", corpus_prefix]
    ckpt = tmp_path / "ckpt"
    check_ok(run_pretrain([*common, "--pipeline-model-parallel-size", "2", "--save", str(ckpt), "--exit-interval",
                           "2"], nproc=2))
    moved = run_pretrain([*common, "--tensor-model-parallel-size", "2", "--load", str(ckpt)], nproc=2)
    lines = [l for l in moved.stderr.splitlines() if l.startswith("pretrain_llama.py: error: ")]
    assert moved.returncode != 0 and len(lines) == 1, moved.stderr[-2000:]  # found alike on every rank: said once
    assert ("is a --ckpt-format torch checkpoint (one file per model-parallel rank), saved with "
            "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2; it loads only at that layout, as in "
            "Megatron-LM (torch_dist checkpoints reshard: save with --ckpt-format torch_dist)") in lines[0]
    dist_run = [a for a in common if a not in ("--ckpt-format", "torch")]
    proc = run_pretrain([*dist_run, "--pipeline-model-parallel-size", "2", "--load", str(ckpt),
                         "--metrics-json", str(tmp_path / "m.json")], nproc=2)
    check_ok(proc)
    assert "iterations from 2" in proc.stdout and len(losses(tmp_path / "m.json")) == 2
