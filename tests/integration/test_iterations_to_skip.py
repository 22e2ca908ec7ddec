"""--iterations-to-skip through the driver, as Megatron-LM's training loop skips: the iteration's batch is read past,
nothing is trained, logged, evaluated or saved at it, and the learning-rate schedule does not advance; the skipped
samples are counted in the log line and kept by checkpoints. Which iteration a value names follows the installed
megatron-core's Megatron-LM (0.17+: the logged number; 0.16: the iterations done before it)."""
from __future__ import annotations

import json

from driver_harness import TINY_MODEL, check_ok, losses, read_common, run_pretrain  # noqa: F401
from h3t_training.megatron_release import ITERATIONS_TO_SKIP_COUNT_FROM_ONE_FROM, installed_megatron_core

RUN = ["--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "6"]
SKIP = ["--iterations-to-skip", "3" if installed_megatron_core() >= ITERATIONS_TO_SKIP_COUNT_FROM_ONE_FROM else "2"]
"""Skips the iteration logged as 3 under the installed release."""


def _records(path) -> list[dict]:
    return json.load(open(path))["iterations"]


def test_the_skipped_batch_is_read_past_and_not_trained(corpus_prefix, tmp_path):
    """At --lr 1e-30 no float32 weight changes (an Adam step is about lr, far below a weight's last bit), so each
    logged loss is its batch's at the initial weights: the skipping run's are the plain run's with iteration 3's
    left out."""
    flags = [*TINY_MODEL, *RUN, "--data-path", corpus_prefix, "--lr", "1e-30", "--min-lr", "0"]
    check_ok(run_pretrain([*flags, "--metrics-json", str(tmp_path / "plain.json")]))
    proc = run_pretrain([*flags, *SKIP, "--metrics-json", str(tmp_path / "skip.json")])
    check_ok(proc)
    plain, skip = _records(tmp_path / "plain.json"), _records(tmp_path / "skip.json")
    assert [r["iteration"] for r in skip] == [1, 2, 4, 5, 6]
    assert [r["loss"] for r in skip] == [r["loss"] for r in plain if r["iteration"] != 3]
    assert len({r["loss"] for r in plain}) == 6  # six different batches
    lines = [line for line in proc.stdout.splitlines() if " iteration " in line and "consumed samples" in line]
    assert "skipped samples" not in lines[1] and "| consumed samples:            8 | skipped samples:            2 |" \
        in lines[2], lines


def test_the_schedule_does_not_advance_and_a_resume_continues_the_count(corpus_prefix, tmp_path):
    flags = [*TINY_MODEL, *RUN, "--data-path", corpus_prefix, "--lr-warmup-iters", "5", "--lr-decay-style", "linear"]
    check_ok(run_pretrain([*flags, "--metrics-json", str(tmp_path / "plain.json")]))
    check_ok(run_pretrain([*flags, *SKIP, "--save", str(tmp_path / "all"), "--metrics-json",
                           str(tmp_path / "skip.json")]))
    plain = {r["iteration"]: r["learning_rate"] for r in _records(tmp_path / "plain.json")}
    skip = _records(tmp_path / "skip.json")
    # Megatron-LM steps its scheduler only after an update: the skipping run is one update behind from iteration 4
    assert [r["learning_rate"] for r in skip] == [plain[1], plain[2], plain[3], plain[4], plain[5]]
    common = read_common(tmp_path / "all" / "iter_0000006")
    assert common["skipped_train_samples"] == 2 == common["args"].skipped_train_samples
    assert common["opt_param_scheduler"]["num_steps"] == 10  # five updates of 2 samples
    # stopped at iteration 4 and resumed: the same losses, and the count goes on from the checkpoint's
    check_ok(run_pretrain([*flags, *SKIP, "--save", str(tmp_path / "part"), "--exit-interval", "4"]))
    proc = run_pretrain([*flags, *SKIP, "--load", str(tmp_path / "part"), "--metrics-json",
                         str(tmp_path / "resumed.json")])
    check_ok(proc)
    assert losses(tmp_path / "resumed.json") == [r["loss"] for r in skip if r["iteration"] > 4]
    assert all(r["skipped_train_samples"] == 2 for r in _records(tmp_path / "resumed.json"))
