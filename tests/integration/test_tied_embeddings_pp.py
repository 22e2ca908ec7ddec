"""Megatron's default GPT (tied input and output embeddings) with pipeline parallelism on CPU (issue #23, item 2).

The first and last stage each hold the word embedding; megatron-core copies the first stage's weight to the
last at construction (an all-reduce over its embedding group) and the driver sums their gradients over that
group before the step (finalize_model_grads' word-embedding step), counting the last stage's copy once in the
gradient norm. Through pretrain_gpt.py, p=2 (and p=2 interleaved) from the single-rank run's checkpoint
gives the single-rank losses and gradient norms within 1e-6 relative; without the gradient all-reduce the
losses move by about 1e-3 relative after one step, so the comparison catches a missing or doubled sum."""
from __future__ import annotations

import pytest
import torch

from driver_harness import check_ok, metrics, run_pretrain
from h3t_ext.testing import run_distributed

TOL = 1e-6
TINY_GPT = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "4", "--lr", "1e-3", "--lr-decay-style", "constant", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "200", "--no-progress-bar", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--log-interval", "1", "--seed", "7", "--eval-iters", "0"]  # tied: pretrain_gpt.py's default


def _copies_worker(rank, world):
    import torch
    from megatron.core import parallel_state as ps

    from h3t_ext.runtime.modules.gpt import build_stage_chunks, tiny_llama_config

    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    torch.manual_seed(1 + 100 * rank)  # different draws per stage, as Megatron seeds
    config = tiny_llama_config(num_layers=2, pipeline_model_parallel_size=2)
    chunks = build_stage_chunks(config, vocab_size=128, max_sequence_length=32, pipeline_rank=rank,
                                position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True,
                                device_type="cpu")
    weight = chunks[0].shared_embedding_or_output_weight()
    ps.destroy_model_parallel()
    return weight.detach().clone(), bool(getattr(weight, "shared", False))


def test_last_stage_starts_from_the_first_stage_embedding():
    (first, first_shared), (last, last_shared) = run_distributed(_copies_worker, 2, timeout_s=120)
    assert first.abs().sum() > 0 and torch.equal(first, last)
    assert not first_shared and last_shared  # the last stage's copy is the one left out of the gradient norm


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    d = tmp_path_factory.mktemp("tied")
    check_ok(run_pretrain([*TINY_GPT, "--save", str(d / "ckpt"), "--exit-interval", "1"], entry="pretrain_gpt.py"))
    check_ok(run_pretrain([*TINY_GPT, "--load", str(d / "ckpt"), "--metrics-json", str(d / "ref.json")],
                          entry="pretrain_gpt.py"))
    ref = metrics(d / "ref.json")["iterations"]
    assert len(ref) == 3 and len({r["loss"] for r in ref}) == 3
    return d / "ckpt", ref


@pytest.mark.parametrize("layout", [["--distributed-backend", "nccl"],  # as Megatron's recipes pass it
                                    ["--num-layers-per-virtual-pipeline-stage", "1"]])
def test_tied_gpt_with_two_stages_gives_the_single_rank_losses(single_rank, layout, tmp_path):
    ckpt, ref = single_rank
    out = tmp_path / "m.json"
    proc = run_pretrain([*TINY_GPT, "--pipeline-model-parallel-size", "2", *layout, "--load", str(ckpt),
                         "--metrics-json", str(out)], nproc=2, entry="pretrain_gpt.py")
    check_ok(proc)
    got = metrics(out)["iterations"]
    assert len(got) == len(ref)
    for it, (a, b) in enumerate(zip(ref, got), start=2):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= TOL * abs(a[key]), (layout, it, key, a[key], b[key])
    if "nccl" in layout:  # no CUDA here: gloo, said once (rank 0), no traceback
        assert proc.stdout.count("note: --distributed-backend nccl:") == 1, proc.stdout[-2000:]


def test_tied_gpt_with_two_stages_resumes_exactly(single_rank, tmp_path):
    """The last stage's copy is not written (megatron-core ties it to the first stage's key): a p=2 checkpoint
    resumes at p=2 bit for bit, the last stage reading its copy from the first stage's embedding."""
    ckpt, _ = single_rank
    p2 = [*TINY_GPT, "--pipeline-model-parallel-size", "2"]
    straight, resumed, save = tmp_path / "straight.json", tmp_path / "resumed.json", tmp_path / "ckpt"
    check_ok(run_pretrain([*p2, "--load", str(ckpt), "--metrics-json", str(straight)], nproc=2, entry="pretrain_gpt.py"))
    check_ok(run_pretrain([*p2, "--load", str(ckpt), "--save", str(save), "--exit-interval", "2"], nproc=2,
                          entry="pretrain_gpt.py"))
    check_ok(run_pretrain([*p2, "--load", str(save), "--metrics-json", str(resumed)], nproc=2, entry="pretrain_gpt.py"))
    want = [(r["loss"], r["grad_norm"]) for r in metrics(straight)["iterations"][1:]]
    assert [(r["loss"], r["grad_norm"]) for r in metrics(resumed)["iterations"]] == want and len(want) == 2
