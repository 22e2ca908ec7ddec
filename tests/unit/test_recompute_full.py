"""Megatron's recompute built by the h3t layer spec (ckpt=full, --recompute-granularity full with uniform/block and
any number of layers, selective with every dense module, their mix with ckpt=ours): losses and gradients bitwise
those of no recompute with dropout on, the generator state after the iteration that of no recompute, each
recomputed piece run once more in backward with the activation manager suspended, and the forward's saved bytes
what each setting keeps.
"""
from __future__ import annotations

import pytest
import torch

from h3t_ext.testing import run_distributed
from gpt_harness import MBS, NUM_LAYERS, NUM_MICROBATCHES, SEQ, forward_step_func, init_parallel, make_batches, \
    model_config

H = 64  # tiny_llama_config's hidden size
SETTINGS = {  # name: (ckpt, Megatron's flags as Recompute.parse arguments)
    "no": ("no", {}),
    "ckpt-full": ("full", {}),
    "uniform-2": ("no", dict(granularity="full", method="uniform", num_layers=2)),
    "uniform-all": ("no", dict(granularity="full", method="uniform", num_layers=NUM_LAYERS)),
    "block-3": ("no", dict(granularity="full", method="block", num_layers=3)),
    "block-all": ("no", dict(granularity="full", method="block", num_layers=NUM_LAYERS)),
    "core_attn": ("no", dict(granularity="selective")),
    "layernorm": ("no", dict(granularity="selective", modules=["layernorm"])),
    "mlp": ("no", dict(granularity="selective", modules=["mlp"])),
    "sel-all": ("no", dict(granularity="selective", modules=["core_attn", "layernorm", "mlp"])),
    "ours": ("ours", {}),
    "ours-block-3": ("ours", dict(granularity="full", method="block", num_layers=3)),
    "ours-core_attn": ("ours", dict(granularity="selective", modules=["core_attn"])),
}


def _run(model, mgr, m: int, seed: int):
    losses = []
    it = iter(make_batches(m))
    torch.manual_seed(seed)
    for mb in range(m):
        with mgr.forward_scope(mb, 0):
            out, loss_func = forward_step_func(it, model)
            loss, info = loss_func(out)
        with mgr.backward_scope(mb, 0):
            (loss / m).backward()
        mgr.release(mb, 0)
        losses.append(info["lm loss"])
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return losses, grads, dict(mgr.stats.saved_bytes), torch.get_rng_state()


def _worker(rank, world):
    from h3t_ext.ckpt import Recompute
    from h3t_ext.runtime.memory.activations import ActivationManager
    from h3t_ext.runtime.memory.device import make_device_layer
    from h3t_ext.runtime.modules.gpt import build_gpt_model

    init_parallel()
    cfg = model_config(hidden_dropout=0.1, attention_dropout=0.1)

    def fresh(ckpt="no", recompute=Recompute()):
        torch.manual_seed(0)
        return build_gpt_model(cfg, vocab_size=128, max_sequence_length=SEQ, ckpt=ckpt, recompute=recompute,
                               device_type="cpu")

    def manager():  # every saved tensor counted in saved_bytes (none kept aside as small)
        return ActivationManager(0.0, make_device_layer("cpu-sync", torch.device("cpu")), min_offload_bytes=0)

    import h3t_ext.runtime.modules.attention as attention

    sdpa = attention.F.scaled_dot_product_attention
    out = {}
    for name, (ckpt, flags) in SETTINGS.items():
        model, mgr = fresh(ckpt, Recompute.parse(**flags)), manager()
        calls = {"mlp": 0, "core": 0, "suspended": 0}

        def count(key, mgr=mgr):
            calls[key] += 1
            calls["suspended"] += mgr._suspended > 0  # a rerun in backward runs with the manager suspended

        def counting_sdpa(*a, **k):
            count("core")
            return sdpa(*a, **k)

        for layer in model.decoder.layers:
            layer.mlp.linear_fc1.register_forward_pre_hook(lambda *_: count("mlp"))
        attention.F.scaled_dot_product_attention = counting_sdpa
        try:
            losses, grads, saved, rng = _run(model, mgr, NUM_MICROBATCHES, seed=7)
        finally:
            attention.F.scaled_dot_product_attention = sdpa
        out[name] = {"losses": torch.stack(losses), "grads": grads, "saved": saved[(0, 0)], "rng": rng,
                     "calls": calls, "layers": [type(l).__name__ for l in model.decoder.layers]}
    torch.manual_seed(0)
    other = _run(fresh(), manager(), NUM_MICROBATCHES, seed=8)[1]
    out["dropout_matters"] = any(not torch.equal(other[k], out["no"]["grads"][k]) for k in other)
    out["refusals"] = _refusals(fresh)
    return out


def _refusals(fresh) -> dict:
    from h3t_ext.ckpt import Recompute
    from h3t_ext.runtime.config import H3TConfig, RuntimeConfigError
    from h3t_ext.runtime.modules.layer_specs import h3t_block_spec
    from h3t_ext.runtime.pipeline.prepare import ModelPreparer

    def message(fn) -> str:
        try:
            fn()
        except RuntimeConfigError as exc:
            return str(exc)
        return ""

    full = fresh("full")
    ModelPreparer(H3TConfig(ckpt="full")).prepare([full], 0, 1)
    return {
        "uniform": message(lambda: h3t_block_spec(model_config(), recompute=Recompute.parse("full", "uniform", 3))),
        "not_built": message(lambda: ModelPreparer(H3TConfig(ckpt="full")).prepare([fresh()], 0, 1)),
        "reprepared": message(lambda: ModelPreparer(H3TConfig(ckpt="no")).prepare([full], 0, 1)),
    }


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_worker, 1, timeout_s=600)[0]


def test_dropout_has_an_effect(runs):
    assert runs["dropout_matters"]  # so that bitwise equality below means the masks were replayed


@pytest.mark.parametrize("name", [n for n in SETTINGS if n != "no"])
def test_recompute_gives_the_losses_and_gradients_of_no_recompute(runs, name):
    """Bitwise, except where the norms are recomputed: their backward is autograd's over the recomputed norm
    (ckpt=ours's norms) where ckpt=no's fused-saves norm has its own, which rounds differently."""
    ref = runs["ours" if name.startswith("ours") else "no"]
    got = runs[name]
    assert torch.equal(got["losses"], ref["losses"])
    assert torch.equal(got["rng"], ref["rng"]), "the generator state after the iteration differs"
    if name in ("layernorm", "sel-all"):
        worst = max(((got["grads"][k] - ref["grads"][k]).abs().max() / ref["grads"][k].abs().max()).item()
                    for k in ref["grads"])
        assert 0 < worst < 1e-5, worst
    else:
        assert all(torch.equal(got["grads"][k], ref["grads"][k]) for k in ref["grads"]), name


@pytest.mark.parametrize("name,rerun_mlp,rerun_core,units", [
    ("no", 0, 0, 0), ("ckpt-full", 8, 8, 8), ("uniform-2", 8, 8, 4), ("uniform-all", 8, 8, 1), ("block-3", 3, 3, 3),
    ("block-all", 8, 8, 8), ("core_attn", 0, 8, 0), ("layernorm", 0, 0, 0), ("mlp", 8, 0, 0), ("sel-all", 8, 8, 0),
    ("ours-block-3", 3, 3, 3), ("ours-core_attn", 0, 8, 0)])
def test_what_is_rerun_in_backward(runs, name, rerun_mlp, rerun_core, units):
    """Every layer's MLP and core attention run once per microbatch, once more where recomputed; every rerun
    (and nothing else) runs with the activation manager suspended."""
    r = runs[name]
    m = NUM_MICROBATCHES
    assert r["calls"] == {"mlp": (NUM_LAYERS + rerun_mlp) * m, "core": (NUM_LAYERS + rerun_core) * m,
                          "suspended": (rerun_mlp + rerun_core) * m}
    assert r["layers"].count("RecomputedLayer") == (units if name not in ("uniform-2", "uniform-all") else NUM_LAYERS)


def test_saved_bytes_of_full_recompute(runs):
    """A unit keeps only its input (MBS x SEQ x H fp32), so the layers' saved bytes scale with the units; block
    with N = all layers is uniform with 1 layer; the rest (embedding, output layer) is the same in every run."""
    x = MBS * SEQ * H * 4
    rest = runs["ckpt-full"]["saved"] - NUM_LAYERS * x
    assert rest > 0
    assert runs["uniform-2"]["saved"] == rest + NUM_LAYERS // 2 * x
    assert runs["uniform-all"]["saved"] == rest + x
    assert runs["block-all"]["saved"] == runs["ckpt-full"]["saved"]
    per_layer = (runs["no"]["saved"] - rest) / NUM_LAYERS
    assert runs["block-3"]["saved"] == pytest.approx(rest + 3 * x + (NUM_LAYERS - 3) * per_layer, rel=1e-9)


def test_selective_modules_drop_what_they_recompute(runs):
    """Per layer: layernorm drops the two norm outputs (2h) and rstd; mlp the FC1 output and the SwiGLU output
    (2f + f = 3 * 128) and keeps its input; core_attn what SDPA keeps beyond q, k, v (with attention dropout on
    the CPU's math kernel keeps its s^2 probabilities and mask, so more than flash attention's log-sum-exp);
    all three together drop the sum (the MLP input is then itself a recomputed norm output)."""
    no = runs["no"]["saved"]
    tokens, f, heads = MBS * SEQ, 128, 4
    drop = {name: (no - runs[name]["saved"]) / (NUM_LAYERS * tokens) for name in ("layernorm", "mlp", "core_attn",
                                                                                   "sel-all")}
    assert drop["layernorm"] == 2 * H * 4 + 2 * 4  # and the two fp32 rstd
    assert drop["mlp"] == 3 * f * 4
    assert drop["core_attn"] >= heads * 4
    assert drop["sel-all"] == drop["layernorm"] + drop["mlp"] + drop["core_attn"]


def test_ours_with_block_recomputes_some_layers_whole(runs):
    x = MBS * SEQ * H * 4
    ours, no = runs["ours"]["saved"], runs["no"]["saved"]
    rest = runs["ckpt-full"]["saved"] - NUM_LAYERS * x
    per_ours = (ours - rest) / NUM_LAYERS
    assert ours < no
    assert runs["ours-block-3"]["saved"] == pytest.approx(rest + 3 * x + (NUM_LAYERS - 3) * per_ours, rel=1e-9)


def test_refusals_are_one_line(runs):
    r = runs["refusals"]
    assert "--recompute-num-layers 3 must divide the 8 layers" in r["uniform"]
    assert "--ckpt full: the model was not built with the full-recompute layer spec" in r["not_built"]
    assert "prepared for --ckpt full" in r["reprepared"]
    assert all(v and "\n" not in v for v in r.values())
