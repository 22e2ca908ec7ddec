"""The driver's reading of Megatron's recompute flags (h3t_training.config.arguments.resolve_ckpt): the config's
``ckpt`` and ``recompute``, and one-line refusals (exit 2) of what contradicts or does not apply to a dense model."""
from __future__ import annotations

import pytest

from h3t_ext.ckpt import Ckpt, Recompute
from h3t_training.config.sections import parse_args

BASE = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--mock-data",
        "--pipeline-model-parallel-size", "2"]


@pytest.mark.parametrize("flags,ckpt,recompute", [
    ([], Ckpt.NO, Recompute()),
    (["--recompute-granularity", "full"], Ckpt.FULL, Recompute("full", "uniform", 1)),
    (["--ckpt", "full"], Ckpt.FULL, Recompute("full", "uniform", 1)),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"], Ckpt.NO,
     Recompute("full", "uniform", 2)),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "9"], Ckpt.NO,
     Recompute("full", "block", 9)),
    (["--recompute-activations"], Ckpt.NO, Recompute("selective", None, None, ("core_attn",))),
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp", "layernorm"], Ckpt.NO,
     Recompute("selective", None, None, ("layernorm", "mlp"))),
    (["--ckpt", "ours", "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
      "2"], Ckpt.OURS, Recompute("full", "block", 2)),
    (["--ckpt", "ours", "--recompute-granularity", "selective"], Ckpt.OURS,
     Recompute("selective", None, None, ("core_attn",))),
    # no granularity: Megatron-LM ignores the other three (Megatron's CI recipe check_grads passes the number alone)
    (["--recompute-num-layers", "1"], Ckpt.NO, Recompute()),
    (["--recompute-method", "block", "--recompute-modules", "mlp"], Ckpt.NO, Recompute()),
])
def test_flags_become_ckpt_and_recompute(flags, ckpt, recompute):
    config = parse_args(BASE + flags, world_size=2)
    assert config.ckpt is ckpt and config.recompute == recompute


@pytest.mark.parametrize("flags,message", [
    (["--recompute-granularity", "selective", "--recompute-modules", "moe"], "--recompute-modules moe recomputes MoE"),
    (["--recompute-granularity", "selective", "--recompute-modules", "shared_experts"], "shared_experts recomputes MoE"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"], "needs multi-latent attention"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"],
     "--recompute-num-layers 3 must divide the 4 layers of each model chunk"),
    (["--ckpt", "full", "--recompute-granularity", "full", "--recompute-method", "block"], "--ckpt full contradicts"),
    (["--ckpt", "full", "--recompute-activations"], "--ckpt full contradicts --recompute-granularity selective"),
    (["--ckpt", "ours", "--recompute-granularity", "full"], "--ckpt ours contradicts --recompute-granularity full"),
    (["--ckpt", "ours", "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
      "4"], "every one of the 4 layers of a model chunk is recomputed whole"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "2"], "--recompute-num-layers needs"),
    (["--recompute-granularity", "selective", "--recompute-method", "block"], "--recompute-method block needs "
                                                                             "--recompute-granularity full"),
])
def test_refusals_are_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(BASE + flags, world_size=2)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err

