"""Megatron's recompute flags through the driver (pretrain_llama.py, gloo, CPU): every setting trains with the losses
of no recompute, at one rank and at p=2 with --offload-alpha 0.5, and its measured saved-activation peak is the
cost model's (the prediction the driver makes for the same flags, through h3t_ext.planner.translate)."""
from __future__ import annotations

import pytest

from driver_harness import TINY_MODEL, check_ok, losses, metrics, run_pretrain  # noqa: F401

BATCH = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3"]
P2 = ["--pipeline-model-parallel-size", "2", "--offload-alpha", "0.5", "--micro-batch-size", "1",
      "--global-batch-size", "8"]  # 8 microbatches: the offload overlaps
RUNS = {  # name: (flags, ranks)
    "no": ([], 1),
    "full-uniform-2": (["--recompute-granularity", "full", "--recompute-method", "uniform",
                        "--recompute-num-layers", "2"], 1),
    "full-block-3": (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3"],
                     1),
    "selective-all": (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "layernorm",
                       "mlp"], 1),
    "selective-mlp": (["--recompute-activations", "--recompute-modules", "mlp"], 1),
    "ours-block-1": (["--ckpt", "ours", "--recompute-granularity", "full", "--recompute-method", "block",
                      "--recompute-num-layers", "1"], 1),
    "p2-no": (P2, 2),
    "p2-block-1": ([*P2, "--recompute-granularity", "full", "--recompute-method", "block",
                    "--recompute-num-layers", "1"], 2),
}


def _argv(corpus, flags):
    return [*TINY_MODEL, *BATCH, "--data-path", corpus, *flags]


@pytest.fixture(scope="module")
def runs(corpus_prefix, tmp_path_factory):
    out = {}
    for name, (flags, nproc) in RUNS.items():
        path = tmp_path_factory.mktemp(name) / "metrics.json"
        check_ok(run_pretrain([*_argv(corpus_prefix, flags), "--metrics-json", str(path)], nproc=nproc))
        out[name] = (metrics(path), losses(path))
    return out


@pytest.mark.parametrize("name", [n for n in RUNS if n not in ("no", "p2-no")])
def test_recompute_gives_the_losses_of_no_recompute(runs, name):
    ref = runs["p2-no" if name.startswith("p2") else "no"][1]
    assert len(ref) == 3 and ref[-1] < ref[0]
    assert runs[name][1] == pytest.approx(ref, rel=1e-6, abs=0)


@pytest.mark.parametrize("name", list(RUNS))
def test_measured_peak_is_the_cost_models(runs, corpus_prefix, name):
    """Each stage's measured saved-activation peak equals the driver's prediction for the same flags within 3%."""
    from h3t_training.config.sections import parse_args
    from h3t_training.data.tokenizer import padded_vocab_size, tokenizer_from_args
    from h3t_training.telemetry.prediction import predicted_scalars

    flags, nproc = RUNS[name]
    args = parse_args(_argv(corpus_prefix, flags), prog="pretrain_llama.py", world_size=nproc, rank=0)
    vocab = padded_vocab_size(tokenizer_from_args(args).vocab_size, args.make_vocab_size_divisible_by,
                              args.tensor_model_parallel_size)
    predicted = predicted_scalars(args, vocab_size=vocab, on_gpu=False)
    measured = runs[name][0]["stage_peak_activation_bytes"]
    assert len(measured) == args.pipeline_model_parallel_size
    for stage, got in enumerate(measured):
        assert got == pytest.approx(predicted[f"h3t/predicted-peak-activation-bytes/stage-{stage}"], rel=0.03), stage


def test_the_peak_falls_as_the_cost_model_says(runs):
    """Full recompute keeps a unit's input only, selective drops its modules' terms: the measured peaks fall in
    the order the cost model gives (their amounts: test_measured_peak_is_the_cost_models, within 3%)."""
    (no,) = runs["no"][0]["stage_peak_activation_bytes"]
    peaks = {n: runs[n][0]["stage_peak_activation_bytes"][0] for n in RUNS if not n.startswith("p2")}
    assert peaks["full-uniform-2"] < peaks["full-block-3"] < peaks["selective-all"] < peaks["selective-mlp"] < no
    assert peaks["ours-block-1"] < no
