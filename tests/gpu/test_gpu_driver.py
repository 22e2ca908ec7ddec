"""The GPU tier of the driver (``pytest -m gpu``, run by scripts/gpu_check.sh): bf16 training of a small
Llama whose loss falls, a bit-exact resume with megatron-core's DDP and distributed optimizer, and
ckpt=ours equal to ckpt=no within bf16 tolerance. Skipped without a GPU."""
from __future__ import annotations

import importlib.util

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


def _torch_adam_only() -> bool:
    """megatron-core's distributed optimizer steps torch's Adam (neither TransformerEngine nor apex importable)."""
    from megatron.core.optimizer import distrib_optimizer
    return not distrib_optimizer.HAVE_APEX_OR_TE


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])  # torch: Megatron's save/load_parameter_state
def test_resume_with_the_distributed_optimizer_is_bit_exact(corpus_prefix, tmp_path, ckpt_format):
    """Bit-exact with TE's or apex's FusedAdam. With torch's Adam megatron-core cannot load the optimizer's
    per-parameter step (KeyError 'step', H200 2026-11-30): the driver says so in one line before it loads, and the
    weights alone resume with --no-load-optim."""
    argv = [*GPU, "--train-iters", "4", "--data-path", corpus_prefix, "--ckpt-format", ckpt_format]
    check_ok(run_pretrain([*argv, "--metrics-json", str(tmp_path / "full.json")]))
    check_ok(run_pretrain([*argv, "--save", str(tmp_path / "ckpt"), "--exit-interval", "2"]))
    resume = [*argv, "--load", str(tmp_path / "ckpt"), "--metrics-json", str(tmp_path / "r.json")]
    if _torch_adam_only():
        proc = run_pretrain(resume)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert "cannot load that optimizer's per-parameter step" in proc.stderr.strip().splitlines()[-1]
        check_ok(run_pretrain([*resume, "--no-load-optim"]))
        assert len(losses(tmp_path / "r.json")) == 2
        return
    check_ok(run_pretrain(resume))
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


def _runs_and_state_bytes(corpus_prefix, tmp_path, variants: dict) -> tuple[dict, dict]:
    """Four iterations of each variant's flags over the GPU run: its losses and its one rank's measured state_bytes,
    by variant name."""
    import json
    runs, held = {}, {}
    for name, extra in variants.items():
        out = tmp_path / f"{name}.json"
        check_ok(run_pretrain([*GPU, *extra, "--train-iters", "4", "--data-path", corpus_prefix,
                               "--metrics-json", str(out)]))
        runs[name] = losses(out)
        (held[name],) = json.loads(out.read_text())["state_bytes"]
    return runs, held


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_megatron_fsdp_trains_as_ddp_with_the_distributed_optimizer(corpus_prefix, tmp_path, strategy):
    """Megatron FSDP through megatron-core's FullyShardedDataParallel adapter (one GPU: d = 1, so the sharding is
    the identity and the losses are the DDP run's up to the order of bf16 reductions), and the state bytes it
    measures from its own buffers (h3t_training/loop/mcore_buffers.py) are the DDP run's: 2 + 4 + 12 bytes per
    parameter, up to the buffers' padding."""
    runs, held = _runs_and_state_bytes(corpus_prefix, tmp_path, {
        "ddp": [], "fsdp": ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor", "--data-parallel-sharding-strategy",
                              strategy]})
    for a, b in zip(runs["ddp"], runs["fsdp"]):
        assert abs(a - b) <= 1e-2 * abs(a)
    for category in ("params", "grads", "optimizer"):
        ddp, fsdp = held["ddp"]["device"][category], held["fsdp"]["device"][category]
        assert ddp > 0 and fsdp == pytest.approx(ddp, rel=0.01), (category, held)


def test_optimizer_cpu_offload_trains_as_the_device_optimizer(corpus_prefix, tmp_path):
    """megatron-core's HybridDeviceOptimizer on a GPU (--optimizer-cpu-offload, half the states on the host, its
    copies overlapped): the losses are the device optimizer's up to bf16 roundoff, the host holds optimizer states
    and master gradients, the device holds fewer optimizer bytes, and the states' total is unchanged but for the host
    side's master copies."""
    runs, held = _runs_and_state_bytes(corpus_prefix, tmp_path, {"device": [], "offload": [
        "--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--optimizer-offload-fraction", "0.5",
        "--overlap-cpu-optimizer-d2h-h2d"]})
    for a, b in zip(runs["device"], runs["offload"]):
        assert abs(a - b) <= 1e-2 * abs(a)
    dev, off = held["device"], held["offload"]
    assert off["host"]["optimizer"] > 0 and off["host"]["grads"] > 0
    assert off["device"]["optimizer"] < dev["device"]["optimizer"]


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TransformerEngine is here")
def test_fp8_without_transformer_engine_is_refused_in_one_line(corpus_prefix, tmp_path):
    """--fp8-format on a GPU runs through TransformerEngine; where TE is not importable (the lease machine) the driver
    stops before training with one line naming the flag and TransformerEngine, never trains in BF16 instead."""
    proc = run_pretrain([*GPU, "--fp8-format", "hybrid", "--train-iters", "2", "--data-path", corpus_prefix])
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "--fp8-format" in ln]
    assert lines and "TransformerEngine" in lines[-1], proc.stderr[-3000:]
