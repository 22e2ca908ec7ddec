"""The GPU tier of the driver (``pytest -m gpu``, run by scripts/gpu_check.sh): bf16 training of a small
Llama whose loss falls, a bit-exact resume with megatron-core's DDP and distributed optimizer, and
ckpt=ours equal to ckpt=no within bf16 tolerance. Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

from driver_harness import TINY_MODEL, check_ok, losses, run_pretrain  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
GPU = [*TINY_MODEL, "--bf16", "--micro-batch-size", "2", "--global-batch-size", "8", "--distributed-backend", "nccl",
       "--use-distributed-optimizer"]


def test_bf16_training_loss_falls(corpus_prefix, tmp_path):
    out = tmp_path / "m.json"
    check_ok(run_pretrain([*GPU, "--train-iters", "30", "--data-path", corpus_prefix, "--metrics-json", str(out)]))
    got = losses(out)
    assert got[-1] < 0.8 * got[0]


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])  # torch: Megatron's save/load_parameter_state
def test_resume_with_the_distributed_optimizer_is_bit_exact(corpus_prefix, tmp_path, ckpt_format):
    argv = [*GPU, "--train-iters", "4", "--data-path", corpus_prefix, "--ckpt-format", ckpt_format]
    check_ok(run_pretrain([*argv, "--metrics-json", str(tmp_path / "full.json")]))
    check_ok(run_pretrain([*argv, "--save", str(tmp_path / "ckpt"), "--exit-interval", "2"]))
    check_ok(run_pretrain([*argv, "--load", str(tmp_path / "ckpt"), "--metrics-json", str(tmp_path / "r.json")]))
    assert losses(tmp_path / "r.json") == losses(tmp_path / "full.json")[2:]


def test_ckpt_ours_equals_no_within_bf16_tolerance(corpus_prefix, tmp_path):
    runs = {}
    for ckpt in ("no", "ours"):
        out = tmp_path / f"{ckpt}.json"
        check_ok(run_pretrain([*GPU, "--train-iters", "3", "--ckpt", ckpt, "--data-path", corpus_prefix,
                               "--metrics-json", str(out)]))
        runs[ckpt] = losses(out)
    for a, b in zip(runs["no"], runs["ours"]):
        assert abs(a - b) <= 2e-2 * abs(a)


def test_fp16_overflow_skips_steps_and_lowers_the_loss_scale(corpus_prefix, tmp_path):
    import json
    argv = [a for a in GPU if a != "--bf16"]
    out = tmp_path / "m.json"
    check_ok(run_pretrain([*argv, "--fp16", "--train-iters", "6", "--data-path", corpus_prefix,
                           "--metrics-json", str(out)]))
    recs = json.loads(out.read_text())["iterations"]
    assert recs[0]["skipped"] and recs[-1]["loss_scale"] < 2.0**32  # 2^32 overflows at once, then halves


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_megatron_fsdp_trains_as_ddp_with_the_distributed_optimizer(corpus_prefix, tmp_path, strategy):
    """Megatron FSDP through megatron-core's FullyShardedDataParallel adapter (one GPU: d = 1, so the sharding is
    the identity and the losses are the DDP run's up to the order of bf16 reductions), and the state bytes it
    measures from its own buffers (h3t_training/loop/mcore_buffers.py) are the DDP run's: 2 + 4 + 12 bytes per
    parameter, up to the buffers' padding."""
    import json
    runs, held = {}, {}
    for name, extra in (("ddp", []), ("fsdp", ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy])):
        out = tmp_path / f"{name}.json"
        check_ok(run_pretrain([*GPU, *extra, "--train-iters", "4", "--data-path", corpus_prefix,
                               "--metrics-json", str(out)]))
        runs[name] = losses(out)
        (held[name],) = json.loads(out.read_text())["state_bytes"]
    for a, b in zip(runs["ddp"], runs["fsdp"]):
        assert abs(a - b) <= 1e-2 * abs(a)
    for category in ("params", "grads", "optimizer"):
        ddp, fsdp = held["ddp"]["device"][category], held["fsdp"]["device"][category]
        assert ddp > 0 and fsdp == pytest.approx(ddp, rel=0.01), (category, held)
