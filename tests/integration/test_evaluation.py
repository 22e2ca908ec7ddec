"""Evaluation and TensorBoard through pretrain_llama.py: held-out losses at the interval and at the end,
training unchanged by evaluation, the event file matches the metrics JSON, --skip-train, and a
pipelined (interleaved, 2-rank) evaluation equal to a single-process one of the same weights."""
from __future__ import annotations

import math

import pytest

from driver_harness import TINY_MODEL, check_ok, metrics, run_pretrain  # noqa: F401

SMALL = ["--global-batch-size", "4", "--train-iters", "4", "--split", "90,5,5", "--hidden-dropout", "0.1"]


@pytest.fixture(scope="module")
def with_and_without_eval(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    out = {"dir": d}
    runs = {"eval": ["--eval-interval", "2", "--eval-iters", "2", "--tensorboard-dir", str(d / "tb"),
                     "--log-validation-ppl-to-tensorboard", "--log-timers-to-tensorboard"],
            "plain": ["--eval-iters", "0"]}
    for name, flags in runs.items():
        proc = run_pretrain([*TINY_MODEL, *SMALL, "--mock-data", *flags, "--metrics-json", str(d / f"{name}.json")])
        check_ok(proc)
        out[name], out[f"{name}_stdout"] = metrics(d / f"{name}.json"), proc.stdout
    return out


def test_evaluation_leaves_training_unchanged(with_and_without_eval):
    ev, plain = with_and_without_eval["eval"], with_and_without_eval["plain"]
    assert [r["loss"] for r in ev["iterations"]] == [r["loss"] for r in plain["iterations"]]  # bit for bit
    assert plain["evaluations"] == []


def test_evaluations_at_the_interval_and_at_the_end(with_and_without_eval):
    ev = with_and_without_eval["eval"]
    got = [(e["iteration"], e["split"], e["at_end"]) for e in ev["evaluations"]]
    assert got == [(2, "valid", False), (4, "valid", False), (4, "valid", True), (4, "test", True)]
    train = {r["iteration"]: r["loss"] for r in ev["iterations"]}
    for e in ev["evaluations"]:
        assert math.isfinite(e["loss"]) and e["ppl"] == pytest.approx(math.exp(e["loss"]))
        assert e["loss"] != train[e["iteration"]]
    # the validation iterator continues across evaluations (Megatron): later ones read other samples
    assert len({e["loss"] for e in ev["evaluations"]}) == 4
    stdout = with_and_without_eval["eval_stdout"]
    assert f" validation loss at iteration 2 | lm loss value: {ev['evaluations'][0]['loss']:.6E} |" in stdout
    assert " validation loss at the end of training for val data | lm loss value: " in stdout
    assert " test loss at the end of training for test data | lm loss value: " in stdout


def test_tensorboard_event_file_matches_the_metrics(with_and_without_eval):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(with_and_without_eval["dir"] / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    ev = with_and_without_eval["eval"]

    def series(tag):
        return [(e.step, e.value) for e in acc.Scalars(tag)]

    tags = set(acc.Tags()["scalars"])
    assert {"lm loss", "lm loss vs samples", "learning-rate", "grad-norm", "loss-scale", "iteration-time",
            "lm loss validation", "lm loss validation ppl", "lm loss test", "h3t/offload-alpha/stage-0",
            "h3t/peak-activation-bytes/stage-0", "h3t/offloaded-bytes/stage-0"} <= tags
    assert "throughput" not in tags and "world-size" not in tags  # their switches are off
    its = ev["iterations"]
    assert series("lm loss") == [(r["iteration"], pytest.approx(r["loss"], rel=1e-6)) for r in its]
    assert series("lm loss vs samples")[-1][0] == 16
    assert series("grad-norm") == [(r["iteration"], pytest.approx(r["grad_norm"], rel=1e-6)) for r in its]
    valid = [(e["iteration"], pytest.approx(e["loss"], rel=1e-6)) for e in ev["evaluations"] if e["split"] == "valid"]
    assert series("lm loss validation") == valid
    assert series("lm loss test") == [(4, pytest.approx(ev["evaluations"][-1]["loss"], rel=1e-6))]
    measured = ev["stage_peak_activation_bytes"][0]
    assert series("h3t/peak-activation-bytes/stage-0")[-1] == (4, measured)
    # the cost model's prediction is written next to it, hidden-dropout masks included (on CPU PyTorch's
    # dropout keeps a float noise tensor, so a mask costs the activation dtype)
    assert series("h3t/predicted-peak-activation-bytes/stage-0")[-1][1] == pytest.approx(measured, rel=0.01)
    assert series("h3t/predicted-step-time-on-h800")[-1][1] > 0  # a GPU prediction, tagged as such on CPU


def test_skip_train_only_evaluates(tmp_path, with_and_without_eval):
    path = tmp_path / "m.json"
    proc = run_pretrain([*TINY_MODEL, *SMALL, "--mock-data", "--skip-train", "--eval-iters", "2",
                         "--metrics-json", str(path)])
    check_ok(proc)
    m = metrics(path)
    assert m["iterations"] == [] and "iteration " not in proc.stdout.replace("at iteration", "")
    assert [(e["iteration"], e["split"]) for e in m["evaluations"]] == [(0, "valid"), (0, "test")]
    first_train_loss = with_and_without_eval["plain"]["iterations"][0]["loss"]  # same initial weights
    for e in m["evaluations"]:
        assert e["loss"] == pytest.approx(first_train_loss, rel=0.05)


def test_pipelined_evaluation_equals_single_process(corpus_prefix, tmp_path):
    common = [*TINY_MODEL, "--data-path", corpus_prefix, "--split", "90,5,5", "--global-batch-size", "4",
              "--micro-batch-size", "1", "--train-iters", "2", "--eval-interval", "1000", "--eval-iters", "2"]
    ckpt, pp_json, one_json = tmp_path / "ckpt", tmp_path / "pp.json", tmp_path / "one.json"
    check_ok(run_pretrain([*common, "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                           "1", "--save", str(ckpt), "--metrics-json", str(pp_json),
                           "--tensorboard-dir", str(tmp_path / "tb")], nproc=2))
    check_ok(run_pretrain([*common, "--load", str(ckpt), "--skip-train", "--metrics-json", str(one_json)]))
    pp, one = metrics(pp_json)["evaluations"], metrics(one_json)["evaluations"]
    assert [(e["iteration"], e["split"]) for e in pp] == [(2, "valid"), (2, "test")]
    assert [(e["iteration"], e["split"]) for e in one] == [(2, "valid"), (2, "test")]
    for a, b in zip(pp, one):
        assert math.isfinite(a["loss"]) and a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    # the last rank wrote every stage's measured activation peak next to the cost model's prediction
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    measured = metrics(pp_json)["stage_peak_activation_bytes"]
    for r in (0, 1):
        assert acc.Scalars(f"h3t/peak-activation-bytes/stage-{r}")[-1].value == measured[r]
        assert acc.Scalars(f"h3t/predicted-peak-activation-bytes/stage-{r}")[-1].value == pytest.approx(
            measured[r], rel=0.01)


def test_separate_split_paths(corpus_prefix, tmp_path):
    path = tmp_path / "m.json"
    at = TINY_MODEL.index("--split")  # no --split with per-split paths (Megatron-LM asserts them incompatible)
    model = TINY_MODEL[:at] + TINY_MODEL[at + 2:]
    check_ok(run_pretrain([*model, "--global-batch-size", "4", "--train-iters", "2", "--eval-interval", "1",
                           "--eval-iters", "1", "--train-data-path", corpus_prefix, "--valid-data-path", corpus_prefix,
                           "--metrics-json", str(path)]))
    evals = metrics(path)["evaluations"]
    assert [(e["iteration"], e["split"], e["at_end"]) for e in evals] == [(1, "valid", False), (2, "valid", False),
                                                                          (2, "valid", True)]  # no test path
    assert all(math.isfinite(e["loss"]) for e in evals)


def test_resume_continues_the_validation_data(corpus_prefix, tmp_path):
    # real data: with --mock-data, megatron-core's GPTDataset caches the loss mask after zeroing the
    # first sample's pad-valued labels (mock tokens include the pad id), so its losses depend on which
    # sample is read first
    common = [*TINY_MODEL, "--data-path", corpus_prefix, "--global-batch-size", "2", "--train-iters", "4", "--split", "90,5,5",
              "--eval-interval", "1", "--eval-iters", "1"]
    full, first, resumed, ckpt = tmp_path / "full.json", tmp_path / "first.json", tmp_path / "res.json", tmp_path / "c"
    check_ok(run_pretrain([*common, "--metrics-json", str(full)]))
    check_ok(run_pretrain([*common, "--save", str(ckpt), "--exit-interval", "2", "--metrics-json", str(first)]))
    check_ok(run_pretrain([*common, "--load", str(ckpt), "--metrics-json", str(resumed)]))

    def evals(path):
        return [(e["iteration"], e["split"], e["at_end"], e["loss"]) for e in metrics(path)["evaluations"]]
    ref = evals(full)
    assert len(ref) == 6 and len({e[3] for e in ref}) == 6
    assert evals(first) == ref[:2]  # --exit-interval stops before the end-of-training evaluations, as Megatron
    assert evals(resumed) == ref[2:]  # the validation position follows the iteration


def test_without_split_the_run_evaluates_as_megatron_does(corpus_prefix, tmp_path):
    """No --split: --mock-data evaluates at --eval-interval (megatron-core splits mock data 1,1,1), and --data-path
    takes Megatron-LM's legacy 969,30,1 with its notice (its 1 part holds no document of the small corpus: no test
    evaluation, said in a note) and evaluates at the end of training."""
    i = TINY_MODEL.index("--split")
    model = TINY_MODEL[:i] + TINY_MODEL[i + 2:]
    common = [*model, "--global-batch-size", "2", "--micro-batch-size", "1", "--train-iters", "2", "--eval-iters", "1"]
    mock_json, data_json = tmp_path / "mock.json", tmp_path / "data.json"
    check_ok(run_pretrain([*common, "--mock-data", "--eval-interval", "1", "--metrics-json", str(mock_json)]))
    assert [(e["iteration"], e["split"], e["at_end"]) for e in metrics(mock_json)["evaluations"]] == [
        (1, "valid", False), (2, "valid", False), (2, "valid", True), (2, "test", True)]
    proc = run_pretrain([*common, "--data-path", corpus_prefix, "--metrics-json", str(data_json)])
    check_ok(proc)
    assert "note: --split not given with --data-path: Megatron-LM's legacy default 969,30,1" in proc.stdout
    assert "leaves the test split no document" in proc.stdout
    evals = metrics(data_json)["evaluations"]
    assert [(e["iteration"], e["split"], e["at_end"]) for e in evals] == [(2, "valid", True)]
    assert all(math.isfinite(e["loss"]) for e in evals)
