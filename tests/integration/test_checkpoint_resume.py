"""Checkpoints through pretrain_llama.py: resume reproduces the uninterrupted losses; bad ones are refused."""
from __future__ import annotations

import json
import os

import pytest

from driver_harness import COMMON_PT, TINY_MODEL, check_ok, losses, run_pretrain  # noqa: F401

DP2 = ["--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4", "--use-distributed-optimizer",
       "--lr-decay-style", "cosine", "--lr-warmup-iters", "1"]


def test_resume_reproduces_the_uninterrupted_losses(corpus_prefix, tmp_path):
    common = [*TINY_MODEL, *DP2, "--data-path", corpus_prefix]
    full = tmp_path / "full.json"
    check_ok(run_pretrain([*common, "--metrics-json", str(full)], nproc=2))
    ckpt = tmp_path / "ckpt"
    first = run_pretrain([*common, "--save", str(ckpt), "--exit-interval", "2"], nproc=2)
    check_ok(first)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(n for n in os.listdir(ckpt) if not n.startswith(".")) == ["iter_0000002",
                                                                          "latest_checkpointed_iteration.txt"]
    assert (ckpt / ".h3t_run.lock").is_file()  # the run lock (run_guard) stays, released
    assert sorted(os.listdir(ckpt / "iter_0000002")) == sorted([".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                *COMMON_PT, "h3t_checksums.json", "metadata.json"])
    assert json.loads((ckpt / "iter_0000002" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    resumed = tmp_path / "resumed.json"
    proc = run_pretrain([*common, "--load", str(ckpt), "--metrics-json", str(resumed)], nproc=2)
    check_ok(proc)
    assert "iterations from 2" in proc.stdout
    ref = losses(full)
    assert len(ref) == 4 and ref[3] != ref[2]
    assert [r["iteration"] for r in json.load(open(resumed))["iterations"]] == [3, 4]
    assert losses(resumed) == ref[2:]  # bit for bit: same data position, weights, Adam state and schedule


@pytest.fixture(scope="module")
def saved_single_rank(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("one") / "ckpt"
    check_ok(run_pretrain([*TINY_MODEL, "--global-batch-size", "2", "--train-iters", "1", "--mock-data",
                           "--save", str(ckpt)]))
    return ckpt


def _refused(proc) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_corrupt_checkpoint_is_refused(saved_single_rank, tmp_path):
    import shutil
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_single_rank, ckpt)
    f = ckpt / "iter_0000001" / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    proc = run_pretrain([*TINY_MODEL, "--global-batch-size", "2", "--train-iters", "2", "--mock-data",
                         "--load", str(ckpt)])
    line = _refused(proc)
    assert "__0_0.distcp is corrupt (checksum mismatch)" in line


def test_truncated_checkpoint_is_refused(saved_single_rank, tmp_path):
    import shutil
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_single_rank, ckpt)
    f = ckpt / "iter_0000001" / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:-100])
    line = _refused(run_pretrain([*TINY_MODEL, "--global-batch-size", "2", "--train-iters", "2", "--mock-data",
                                  "--load", str(ckpt)]))
    assert "is corrupt (length" in line


def test_mismatched_model_is_refused(saved_single_rank):
    argv = [*TINY_MODEL, "--global-batch-size", "2", "--train-iters", "2", "--mock-data", "--load",
            str(saved_single_rank)]
    argv[argv.index("--ffn-hidden-size") + 1] = "192"
    line = _refused(run_pretrain(argv))
    assert "was saved with --ffn-hidden-size 128, this run has 192" in line


def test_resume_with_another_batch_size_continues_from_the_consumed_samples(corpus_prefix, tmp_path):
    """As in Megatron-LM, a resume whose global batch changed continues the data from the checkpoint's consumed
    samples: 2 iterations of 4 samples, saved, resumed at a batch of 8, give the losses of one run whose step
    schedule goes from 4 to 8 after 8 samples (512 tokens), bit for bit (constant learning rate; the schedule in
    samples changes with the batch, so, as in Megatron-LM, --override-opt_param-scheduler says this run's wins)."""
    common = [*TINY_MODEL, "--micro-batch-size", "1", "--train-iters", "4", "--data-path", corpus_prefix]
    stepped = tmp_path / "stepped.json"
    check_ok(run_pretrain([*common, "--global-batch-size", "8", "--step-batch-size-schedule", "0:4 512:8",
                           "--metrics-json", str(stepped)]))
    ckpt = tmp_path / "ckpt"
    check_ok(run_pretrain([*common, "--global-batch-size", "4", "--save", str(ckpt), "--exit-interval", "2"]))
    # megatron-core's scheduler counts samples: --train-iters 4 decays over 16 samples at a batch of 4, 32 at 8;
    # Megatron-LM refuses the change unless told which schedule wins
    resume = [*common, "--global-batch-size", "8", "--load", str(ckpt)]
    line = _refused(run_pretrain(resume))
    assert ("checkpoint iteration 2 was trained with a learning-rate decay of 16 samples, this run has 32 "
            "(--lr-decay-iters x --global-batch-size, or --lr-decay-samples); add --override-opt_param-scheduler "
            "or --use-checkpoint-opt_param-scheduler") in line, line
    resumed = tmp_path / "resumed.json"
    proc = run_pretrain([*resume, "--override-opt_param-scheduler", "--metrics-json", str(resumed)])
    check_ok(proc)
    assert ("checkpoint iteration 2 was saved after 8 consumed samples (this run's batch schedule reaches that "
            "iteration after 16): the data continues from sample 8, as in Megatron-LM") in proc.stdout
    ref = losses(stepped)
    assert len(ref) == 4 and ref[3] != ref[2]
    assert losses(resumed) == ref[2:]


def test_resume_after_a_resharded_start_is_exact(tmp_path):
    """A d=2 run that began from a single-rank checkpoint, saved and resumed, gives the losses of the same run
    uninterrupted (each sample's loss mask its own: h3t_training.data.datasets._UncachedMasks; before, the first resumed
    loss differed by 1.4e-4 relative), and its first loss is the single-rank one."""
    argv = [*TINY_MODEL, "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4",
            "--lr-warmup-iters", "1", "--make-vocab-size-divisible-by", "256", "--ckpt", "ours",
            "--use-distributed-optimizer", "--mock-data"]
    check_ok(run_pretrain([*argv, "--save", str(tmp_path / "c1"), "--exit-interval", "1"]))
    check_ok(run_pretrain([*argv, "--load", str(tmp_path / "c1"), "--metrics-json", str(tmp_path / "one.json")]))
    check_ok(run_pretrain([*argv, "--load", str(tmp_path / "c1"), "--metrics-json", str(tmp_path / "full.json")],
                          nproc=2))
    check_ok(run_pretrain([*argv, "--load", str(tmp_path / "c1"), "--save", str(tmp_path / "c2"),
                           "--exit-interval", "2"], nproc=2))
    check_ok(run_pretrain([*argv, "--load", str(tmp_path / "c2"), "--metrics-json", str(tmp_path / "r.json")],
                          nproc=2))
    full = losses(tmp_path / "full.json")
    assert losses(tmp_path / "r.json") == full[1:]
    assert full[0] == losses(tmp_path / "one.json")[0]
