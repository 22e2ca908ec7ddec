"""Layer-granular activation offload at pipeline size 1: the builder's layer actions run through the manager.

A tiny GPT (embedding, L h3t-spec layers, output layer) runs one iteration in the order of the p=1 action list,
the layer OFFLOAD/RELOAD actions handed to the scope of the compute action they run in, as the executor does.
"""
from __future__ import annotations

import pytest
import torch

from h3t_ext.runtime.memory.activations import ActivationManager
from h3t_ext.runtime.memory.device import make_device_layer
from activation_harness import batches, init_single_process_megatron, run_rank_schedule, tiny_model


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    init_single_process_megatron()


def run_p1(model, data, mgr=None, *, alpha: float = 0.0, layers: int = 2, check_live=None):
    """One iteration of the p=1 list (layer-granular offload at ``alpha``); returns (losses, grads)."""
    return run_rank_schedule(model, data, mgr, pipeline_size=1, check_live=check_live, offload_alphas=(alpha,),
                             num_layers_per_chunk=layers)


def _manager(alpha, mode="cpu-sync", min_offload_bytes=0, **kw):
    return ActivationManager(alpha, make_device_layer(mode, "cpu"), min_offload_bytes=min_offload_bytes, **kw)


def _model(ckpt, layers, mgr=None):
    return tiny_model(num_layers=layers, ckpt=ckpt)  # ckpt=full: the recomputed layers of the spec


@pytest.mark.parametrize("mode", ["cpu-sync", "cpu-thread"])
@pytest.mark.parametrize("ckpt", ["no", "ours", "full"])
@pytest.mark.parametrize("alpha", [0.3, 0.5, 1.0])
def test_losses_and_grads_equal_the_run_without_manager(mode, ckpt, alpha):
    layers, data = 4, batches(3)
    ref = run_p1(_model(ckpt, layers), data)
    mgr = _manager(alpha, mode)
    try:
        got = run_p1(_model(ckpt, layers, mgr), data, mgr, alpha=alpha, layers=layers)
    finally:
        mgr.device.close()
    assert all(torch.equal(a, b) for a, b in zip(got[0], ref[0]))
    assert set(got[1]) == set(ref[1])
    for k in ref[1]:  # the same ops on the same bytes: bitwise
        assert torch.equal(got[1][k], ref[1][k]), k
    assert mgr.stats.offloaded_bytes > 0


@pytest.mark.parametrize("mode", ["cpu-sync", "cpu-thread"])
def test_resident_count_matches_live_storages_and_the_peak_falls(mode):
    layers, data = 8, batches(2)
    peaks = {}
    for alpha in (0.0, 0.5):
        # (the token ids the caller keeps are below 4096 bytes: small, not a record that offload would not free)
        mgr = _manager(alpha, mode, min_offload_bytes=4096, track_storages=True)
        live = []
        try:
            run_p1(_model("ours", layers), data, mgr, alpha=alpha, layers=layers, check_live=live)
        finally:
            mgr.device.close()
        assert [a for a, _ in live] == [b for _, b in live]
        peaks[alpha] = mgr.stats.peak_resident_bytes
        if alpha:
            # two reload slots, each the largest offloaded layer: every layer of this model is alike, and layers
            # 0-3 of each of the 2 microbatches are offloaded
            per_layer = mgr.stats.offloaded_bytes / (layers // 2 * len(data))
            assert mgr.stats.reload_buffer_bytes == 2 * per_layer
            assert 2 * per_layer == pytest.approx(2 * peaks[0.0] / layers, rel=0.1)  # a layer's share of the peak
    # 8 layers at alpha 0.5: layers 0-3 offloaded and all dropped at the peak, plus 2 layers of reload slots
    assert peaks[0.5] < 0.9 * peaks[0.0]


def test_schedule_without_layer_starts_is_one_line():
    from h3t_ext.runtime.config import RuntimeConfigError

    layers, data = 4, batches(1)
    mgr = _manager(0.5)
    with pytest.raises(RuntimeConfigError, match="h3t layer spec"):
        run_p1(tiny_model(num_layers=layers), data, mgr, alpha=0.5, layers=layers)  # megatron's stock spec
