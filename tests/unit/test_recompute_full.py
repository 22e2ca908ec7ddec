"""ckpt=full: layers recomputed from their input give the reference's loss and gradients bitwise.

Dropout is on, so the recompute must replay the forward's random masks; the generator state
after the iteration must be what it would have been without recompute.
"""
from __future__ import annotations

import pytest
import torch

from h3t_ext.testing import run_distributed
from gpt_harness import NUM_LAYERS, NUM_MICROBATCHES, RecordingManager, forward_step_func, init_parallel, \
    make_batches, model_config, recording_factory


def _run(model, m: int, seed: int):
    losses, packed = [], []

    def pack(t):
        packed.append(t.numel() * t.element_size())
        return t

    it = iter(make_batches(m))
    torch.manual_seed(seed)
    for _ in range(m):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # count forward saves only
            out, loss_func = forward_step_func(it, model)
            loss, info = loss_func(out)
        (loss / m).backward()
        losses.append(info["lm loss"])
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return losses, grads, sum(packed), torch.get_rng_state()


def _worker(rank, world):
    from h3t_ext.runtime.modules.gpt import build_gpt_model
    from h3t_ext.runtime.modules.recompute_full import apply_full_recompute, is_full_recompute, remove_full_recompute

    init_parallel()
    cfg = model_config(hidden_dropout=0.1, attention_dropout=0.1)

    def fresh():
        torch.manual_seed(0)
        return build_gpt_model(cfg, vocab_size=128, max_sequence_length=32)

    ref_model = fresh()
    ref = _run(ref_model, NUM_MICROBATCHES, seed=7)

    model = fresh()
    mgr = RecordingManager(0.0)
    assert apply_full_recompute([model], suspend=mgr.suspended) == NUM_LAYERS
    assert apply_full_recompute([model], suspend=mgr.suspended) == 0  # idempotent
    calls = {"n": 0}
    layer0 = model.decoder.layers[0]
    inner = layer0.mlp.forward

    def counting(*a, **k):
        calls["n"] += 1
        return inner(*a, **k)

    layer0.mlp.forward = counting
    got = _run(model, NUM_MICROBATCHES, seed=7)
    layer0.mlp.forward = inner

    remove_full_recompute([model])
    restored = not is_full_recompute(model)
    same_grads = all(torch.equal(got[1][k], ref[1][k]) for k in ref[1])
    no_dropout_grads = _no_dropout_differs(fresh, ref[1])
    rebind = _reinstall_rebinds_suspend(fresh)
    return {
        "rebind": rebind,
        "losses_equal": torch.equal(torch.stack(got[0]), torch.stack(ref[0])),
        "grads_equal": same_grads,
        "rng_equal": torch.equal(got[3], ref[3]),
        "saved_ref": ref[2], "saved_full": got[2],
        "mlp_calls": calls["n"], "suspends": sum(e[0] == "suspended" for e in mgr.events),
        "restored": restored, "dropout_matters": no_dropout_grads,
    }


def _reinstall_rebinds_suspend(fresh) -> dict:
    """A second install() on the same model must suspend its own manager, and refuse another ckpt."""
    from h3t_ext.runtime.config import H3TConfig, RuntimeConfigError
    from h3t_ext.runtime.pipeline.prepare import ModelPreparer

    model = fresh()
    first = ModelPreparer(H3TConfig(ckpt="full"), manager_factory=recording_factory).prepare([model], 0, 1)
    second = ModelPreparer(H3TConfig(ckpt="full"), manager_factory=recording_factory).prepare([model], 0, 1)
    _run(model, 1, seed=3)
    try:
        ModelPreparer(H3TConfig(ckpt="no"), manager_factory=recording_factory).prepare([model], 0, 1)
        refused = ""
    except RuntimeConfigError as exc:
        refused = str(exc)
    count = lambda mgr: sum(e[0] == "suspended" for e in mgr.events)  # noqa: E731
    return {"first": count(first), "second": count(second), "refused": refused}


def _no_dropout_differs(fresh, ref_grads) -> bool:
    """Dropout has an effect (a second seed gives other gradients), so bitwise equality means something."""
    model = fresh()
    grads = _run(model, NUM_MICROBATCHES, seed=8)[1]
    return any(not torch.equal(grads[k], ref_grads[k]) for k in ref_grads)


def test_full_recompute_matches_reference_with_dropout():
    r = run_distributed(_worker, 1, timeout_s=300)[0]
    assert r["dropout_matters"]
    assert r["losses_equal"]
    assert r["grads_equal"]
    assert r["rng_equal"], "the generator state after the iteration differs from a run without recompute"
    assert r["mlp_calls"] == 2 * NUM_MICROBATCHES, "each layer must run once in forward and once in backward"
    assert r["suspends"] == NUM_LAYERS * NUM_MICROBATCHES, "every recompute must run with the manager suspended"
    assert r["saved_full"] * 3 < r["saved_ref"], (r["saved_full"], r["saved_ref"])
    assert r["restored"]
    assert r["rebind"]["first"] == 0 and r["rebind"]["second"] == NUM_LAYERS, r["rebind"]
    assert "--ckpt full" in r["rebind"]["refused"] and "\n" not in r["rebind"]["refused"]


def test_full_recompute_refuses_megatron_recompute():
    from h3t_ext.runtime.modules.recompute_full import FullRecomputeError, apply_full_recompute

    class _Cfg:
        recompute_granularity = "full"

    m = torch.nn.Linear(2, 2)
    m.config = _Cfg()
    with pytest.raises(FullRecomputeError, match="recompute-granularity") as exc:
        apply_full_recompute([m])
    assert "\n" not in str(exc.value)
