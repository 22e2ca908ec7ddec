"""Megatron-LM's --eval-global-batch-size, --eval-micro-batch-size and --start-eval-at-iter through
pretrain_llama.py.

An evaluation reads --eval-iters batches of --eval-global-batch-size samples: the same samples cut into other batches
or microbatches give the same loss (a 2-stage pipeline too, whose transfers take the evaluation's microbatch shape);
evaluations run from --start-eval-at-iter on; a run resumed after a skipped evaluation reads the validation samples an
uninterrupted run reads; a batch the data-parallel ranks cannot share is one line."""
from __future__ import annotations

import pytest

from driver_harness import TINY_MODEL, check_ok, metrics, run_pretrain  # noqa: F401


def _common(corpus):
    return [*TINY_MODEL, "--data-path", corpus, "--split", "90,5,5", "--global-batch-size", "2",
            "--micro-batch-size", "1", "--train-iters", "2", "--eval-interval", "2"]


def _evals(tmp_path, name, flags, nproc=1):
    out = tmp_path / f"{name}.json"
    check_ok(run_pretrain([*flags, "--metrics-json", str(out)], nproc=nproc))
    return [(e["iteration"], e["split"], e["at_end"], e["loss"]) for e in metrics(out)["evaluations"]]


def test_the_same_samples_in_other_batches_give_the_same_loss(corpus_prefix, tmp_path):
    base = _common(corpus_prefix)
    ref = _evals(tmp_path, "ref", [*base, "--eval-iters", "2", "--eval-global-batch-size", "4"])
    assert [e[:3] for e in ref] == [(2, "valid", False), (2, "valid", True), (2, "test", True)]
    assert ref[0][3] != ref[1][3]  # the end of training reads the next samples
    for name, flags in {"one-batch": ["--eval-iters", "1", "--eval-global-batch-size", "8"],
                        "micro-4": ["--eval-iters", "2", "--eval-global-batch-size", "4",
                                    "--eval-micro-batch-size", "4"]}.items():
        got = _evals(tmp_path, name, [*base, *flags])
        assert [e[:3] for e in got] == [e[:3] for e in ref]
        # validation: the same 8 + 8 samples; test: the first 8 of the test split for one-batch, 4 + 4 for micro-4
        assert [e[3] for e in got[:2]] == pytest.approx([e[3] for e in ref[:2]], rel=1e-6), name
    trained = _evals(tmp_path, "default", [*base, "--eval-iters", "4"])  # default: the training's batch of 2
    assert [e[3] for e in trained[:2]] == pytest.approx([e[3] for e in ref[:2]], rel=1e-6)


def test_pipeline_evaluates_microbatches_of_its_own_size(corpus_prefix, tmp_path):
    base = [*_common(corpus_prefix), "--pipeline-model-parallel-size", "2", "--eval-iters", "1",
            "--eval-global-batch-size", "4"]
    one = _evals(tmp_path, "mb1", base, nproc=2)
    four = _evals(tmp_path, "mb4", [*base, "--eval-micro-batch-size", "4"], nproc=2)
    assert [e[3] for e in four] == pytest.approx([e[3] for e in one], rel=1e-6)


def test_start_eval_at_iter_and_a_resume_after_it(corpus_prefix, tmp_path):
    common = [*TINY_MODEL, "--data-path", corpus_prefix, "--split", "90,5,5", "--global-batch-size", "2",
              "--train-iters", "5", "--eval-interval", "1", "--eval-iters", "1", "--start-eval-at-iter", "3"]
    full = _evals(tmp_path, "full", common)
    assert [e[:3] for e in full] == [(3, "valid", False), (4, "valid", False), (5, "valid", False),
                                     (5, "valid", True), (5, "test", True)]
    assert len({e[3] for e in full[:4]}) == 4  # each evaluation reads the next samples
    ckpt = tmp_path / "ckpt"
    first = _evals(tmp_path, "first", [*common, "--save", str(ckpt), "--exit-interval", "3"])
    assert first == full[:1]
    resumed = _evals(tmp_path, "resumed", [*common, "--load", str(ckpt)])
    assert resumed == full[1:]


def test_a_batch_the_ranks_cannot_share_is_one_line(corpus_prefix):
    proc = run_pretrain([*_common(corpus_prefix), "--eval-iters", "1", "--eval-global-batch-size", "3",
                         "--eval-micro-batch-size", "2"])
    assert proc.returncode == 2
    assert "--eval-global-batch-size 3 is not a multiple of --eval-micro-batch-size 2 x data-parallel size 1" in \
        proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr


def test_a_batch_ramp_up_evaluates_at_the_full_batch(corpus_prefix, tmp_path):
    """Megatron-LM evaluates --eval-global-batch-size samples (default the final --global-batch-size) whatever the
    ramp-up's batch: the end-of-training evaluation of a ramped run equals a --skip-train evaluation of its checkpoint
    (the evaluation iterators followed the ramp before, reading other samples)."""
    common = [*TINY_MODEL, "--data-path", corpus_prefix, "--split", "90,5,5", "--global-batch-size", "4",
              "--micro-batch-size", "1", "--eval-interval", "1000", "--eval-iters", "2"]
    ckpt = tmp_path / "ckpt"
    ramped = _evals(tmp_path, "ramped", [*common, "--train-iters", "3", "--rampup-batch-size", "2", "2", "4",
                                         "--save", str(ckpt)])
    alone = _evals(tmp_path, "alone", [*common, "--train-iters", "3", "--load", str(ckpt), "--skip-train"])
    assert [e[:2] for e in ramped] == [e[:2] for e in alone] == [(3, "valid"), (3, "test")]
    assert [e[3] for e in ramped] == pytest.approx([e[3] for e in alone], rel=1e-6)
