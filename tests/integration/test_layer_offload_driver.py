"""--offload-alpha at --pipeline-model-parallel-size 1 through the driver: layer-granular offload trains with the
losses of alpha 0 and its measured saved-activation peak is the cost model's (pretrain_llama.py, gloo, CPU)."""
from __future__ import annotations

import pytest

from driver_harness import TINY_MODEL, check_ok, losses, metrics, run_pretrain  # noqa: F401

LAYERS = ["--num-layers", "8"]  # 8 layers: at alpha 0.5 layers 0-3 offloaded, all gone at the peak
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3"]
RUNS = {("no", 0.0, 1): [], ("no", 0.5, 1): [], ("ours", 0.0, 1): [], ("ours", 0.5, 1): [],
        ("no", 0.0, 2): ["--tensor-model-parallel-size", "2"], ("no", 0.5, 2): ["--tensor-model-parallel-size", "2"]}


def _argv(corpus, ckpt, alpha, extra):
    return [*TINY_MODEL, *LAYERS, *BATCH, "--data-path", corpus, "--ckpt", ckpt, "--offload-alpha", str(alpha), *extra]


@pytest.fixture(scope="module")
def runs(corpus_prefix, tmp_path_factory):
    out = {}
    for (ckpt, alpha, nproc), extra in RUNS.items():
        path = tmp_path_factory.mktemp(f"m_{ckpt}_{alpha}_{nproc}") / "metrics.json"
        check_ok(run_pretrain([*_argv(corpus_prefix, ckpt, alpha, extra), "--metrics-json", str(path)], nproc=nproc))
        out[(ckpt, alpha, nproc)] = (metrics(path), losses(path))
    return out


@pytest.mark.parametrize("ckpt,nproc", [("no", 1), ("ours", 1), ("no", 2)])
def test_offload_at_p1_gives_the_losses_of_alpha_0(runs, ckpt, nproc):
    (ref_m, ref), (off_m, off) = runs[(ckpt, 0.0, nproc)], runs[(ckpt, 0.5, nproc)]
    assert len(ref) == 3 and ref[-1] < ref[0]
    assert off == pytest.approx(ref, rel=1e-6, abs=0)
    assert all(b > 0 for b in off_m["offloaded_bytes"]) and all(b == 0 for b in ref_m["offloaded_bytes"])


@pytest.mark.parametrize("key", list(RUNS))
def test_measured_peak_is_the_cost_models(runs, corpus_prefix, key):
    """The measured saved-activation peak of the rank equals the prediction the driver makes for the same flags
    (h3t_training.telemetry.prediction: the model spec and plan through h3t_ext.planner.translate) within 3%."""
    from h3t_training.config.sections import parse_args
    from h3t_training.telemetry.prediction import predicted_scalars
    from h3t_training.data.tokenizer import padded_vocab_size, tokenizer_from_args

    ckpt, alpha, nproc = key
    args = parse_args(_argv(corpus_prefix, ckpt, alpha, RUNS[key]), prog="pretrain_llama.py", world_size=nproc,
                      rank=0)
    vocab = padded_vocab_size(tokenizer_from_args(args).vocab_size, args.make_vocab_size_divisible_by,
                              args.tensor_model_parallel_size)
    predicted = predicted_scalars(args, vocab_size=vocab, on_gpu=False)["h3t/predicted-peak-activation-bytes/stage-0"]
    (measured,) = runs[key][0]["stage_peak_activation_bytes"]
    assert measured == pytest.approx(predicted, rel=0.03)


@pytest.mark.parametrize("ckpt,nproc", [("no", 1), ("ours", 1), ("no", 2)])
def test_offload_at_p1_lowers_the_peak(runs, ckpt, nproc):
    """8 layers at alpha 0.5: layers 0-3 are gone at the peak and two one-layer reload slots are added, so the
    peak falls by a quarter of the layers' bytes (the output layer's saves stay)."""
    (ref,) = runs[(ckpt, 0.0, nproc)][0]["stage_peak_activation_bytes"]
    (off,) = runs[(ckpt, 0.5, nproc)][0]["stage_peak_activation_bytes"]
    assert off < 0.85 * ref
