"""Megatron-LM's --log-params-norm and --log-num-zeros-in-grad through pretrain_llama.py.

The logged figures are checked against what the run saved (a --ckpt-format torch checkpoint after one iteration: the
parameters, and Adam's first moment, which is zero exactly where the step's gradient was), and every layout's against
the single rank's: each element of the model counts once whatever the layout (tensor-parallel slices on every tensor
rank, replicated norms on one, torch FSDP2's shards summed, a tied embedding's last-stage copy left out)."""
from __future__ import annotations

import math
import re

import pytest
import torch

from driver_harness import check_ok, metrics, run_pretrain

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
         "--seq-length", "64", "--lr", "1e-3", "--lr-decay-style", "constant", "--log-interval", "1",
         "--no-progress-bar", "--seed", "7", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--eval-iters", "0", "--attention-dropout", "0",
         "--hidden-dropout", "0", "--log-params-norm", "--log-num-zeros-in-grad"]
UNTIED = ["--untie-embeddings-and-output-weights"]  # pretrain_llama.py's default; pretrain_gpt.py ties them


def _run(tmp_path, name: str, flags: list[str], nproc: int = 1, iters: int = 3, entry: str = "pretrain_llama.py"):
    out = tmp_path / f"{name}.json"
    proc = run_pretrain([*MODEL, *flags, "--train-iters", str(iters), "--metrics-json", str(out)], nproc=nproc,
                        entry=entry)
    check_ok(proc)
    return proc, metrics(out)["iterations"]


def _saved(directory, *, leave_out_tied_copy: bool = False) -> tuple[float, float]:
    """(L2 norm of the saved parameters, zero elements of Adam's first moment) of every file of a --ckpt-format torch
    checkpoint; ``leave_out_tied_copy``: the last stage's copy of a tied embedding (its ``output_layer.weight``)."""
    files = sorted(directory.glob("mp_rank_*/model_optim_rng.pt"))
    assert files
    sq, zeros = 0.0, 0.0
    for i, f in enumerate(files):
        sd = torch.load(f, map_location="cpu", weights_only=False)
        for k, v in sd["model"].items():
            if not torch.is_tensor(v) or k.endswith("_extra_state"):
                continue
            if leave_out_tied_copy and i > 0 and k == "output_layer.weight":
                continue
            sq += v.double().pow(2).sum().item()
        zeros += sum(float((s["exp_avg"] == 0).sum()) for s in sd["optimizer"]["state"].values())
    return math.sqrt(sq), zeros


def test_one_rank_logs_the_norm_and_zeros_of_what_it_saved(tmp_path):
    save = tmp_path / "ckpt"
    proc, its = _run(tmp_path, "one", [*UNTIED, "--save", str(save), "--ckpt-format", "torch"], iters=1)
    norm, zeros = _saved(save / "iter_0000001")
    assert its[0]["params_norm"] == pytest.approx(norm, rel=1e-12)
    assert its[0]["num_zeros_in_grad"] == zeros > 0  # the embedding rows of the ids the batch does not hold
    line = re.search(r"grad norm: \S+ \| num zeros: (\S+) \| params norm: (\S+) \|", proc.stdout)
    assert line and float(line.group(1)) == zeros and line.group(2) == f"{norm:.3f}", proc.stdout[-2000:]


def test_two_pipeline_stages_count_each_element_once(tmp_path):
    save = tmp_path / "ckpt"
    _, its = _run(tmp_path, "pp2", [*UNTIED, "--pipeline-model-parallel-size", "2", "--save", str(save),
                                    "--ckpt-format", "torch"], nproc=2, iters=1)
    norm, zeros = _saved(save / "iter_0000001")
    assert its[0]["params_norm"] == pytest.approx(norm, rel=1e-12)
    assert its[0]["num_zeros_in_grad"] == zeros
    tied_save = tmp_path / "tied"
    _, tied = _run(tmp_path, "pp2tied", ["--pipeline-model-parallel-size", "2", "--save", str(tied_save),
                                         "--ckpt-format", "torch", "--max-position-embeddings", "64"], nproc=2,
                   iters=1, entry="pretrain_gpt.py")
    assert tied[0]["params_norm"] == pytest.approx(_saved(tied_save / "iter_0000001", leave_out_tied_copy=True)[0],
                                                   rel=1e-12)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), "ref", UNTIED)[1]


@pytest.mark.parametrize("flags", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ["--use-distributed-optimizer"],
    ["--use-torch-fsdp2"],
], ids=["tp2-sp", "dp2-distopt", "dp2-fsdp2"])
def test_two_rank_layouts_log_the_single_ranks_figures(single, tmp_path, flags):
    _, its = _run(tmp_path, "two", [*UNTIED, *flags], nproc=2)
    assert [r["num_zeros_in_grad"] for r in its] == [r["num_zeros_in_grad"] for r in single]
    assert [r["params_norm"] for r in its] == pytest.approx([r["params_norm"] for r in single], rel=1e-6)
    assert single[-1]["params_norm"] != single[0]["params_norm"]  # the norm is the stepped weights'


def test_without_the_flags_nothing_is_logged(tmp_path):
    out = tmp_path / "m.json"
    flags = [f for f in MODEL if f not in ("--log-params-norm", "--log-num-zeros-in-grad")]
    proc = run_pretrain([*flags, "--train-iters", "1", "--metrics-json", str(out)])
    check_ok(proc)
    rec = metrics(out)["iterations"][0]
    assert rec["params_norm"] is None and rec["num_zeros_in_grad"] is None
    assert "params norm" not in proc.stdout and "num zeros" not in proc.stdout
