"""Activation manager: exact results with offload and ckpt=ours, byte accounting, host pool."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from h3t_ext.costmodel.activations import (
    activation_bytes_per_layer_token,
    output_layer_bytes,
    stage_activation_peak_bytes,
)
from h3t_ext.costmodel.plan import Plan
from h3t_ext.runtime.memory.activations import ActivationManager, build_activation_manager
from h3t_ext.runtime.config import H3TConfig
from h3t_ext.runtime.memory.device import make_device_layer
from tests.activation_harness import (
    FFN,
    GROUPS,
    HEADS,
    HIDDEN,
    batches,
    init_single_process_megatron,
    middle_stage_model,
    run_middle_stage,
    rope_bytes,
    run_rank_schedule,
    tiny_model,
    tiny_model_spec,
)


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    init_single_process_megatron()


@pytest.fixture(scope="module")
def reference():
    data = batches(6)
    return data, run_rank_schedule(tiny_model(), data)


def _manager(alpha, mode="cpu-sync", **kw):
    return ActivationManager(alpha, make_device_layer(mode, "cpu"), **kw)


@pytest.mark.parametrize("mode", ["cpu-sync", "cpu-thread"])
@pytest.mark.parametrize("ckpt", ["no", "ours"])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_loss_and_grads_equal_plain_run(reference, mode, ckpt, alpha):
    data, (ref_losses, ref_grads) = reference
    model = tiny_model(ckpt="ours") if ckpt == "ours" else tiny_model()
    mgr = _manager(alpha, mode)
    try:
        losses, grads = run_rank_schedule(model, data, mgr)
    finally:
        mgr.device.close()
    assert set(grads) == set(ref_grads)
    if ckpt == "no":  # same ops on the same bytes: bitwise
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
        assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    else:  # the lean norm/SwiGLU sum gradient contributions in another order
        assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7)
    st = mgr.stats
    assert st.offloaded_bytes == pytest.approx(alpha * sum(st.saved_bytes.values()), abs=len(data))
    # ours: 3 per layer (2 layers) and the final norm's x * rstd; the stock model: none
    assert all(n == (3 * 2 + 1 if ckpt == "ours" else 0) for n in st.recomputed.values())


@pytest.mark.parametrize("mode", ["cpu-sync", "cpu-thread"])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_resident_count_matches_live_storages(mode, alpha):
    """The manager's resident bytes equal the bytes of saved storages the allocator still holds."""
    model = tiny_model(ckpt="ours")
    mgr = _manager(alpha, mode, track_storages=True)
    samples = []
    orig = mgr._compute_ended

    def sample():
        orig()
        mgr.device.synchronize()  # copies done: their worker no longer holds the source
        samples.append((mgr.resident_bytes, mgr.live_storage_bytes()))

    mgr._compute_ended = sample
    try:
        run_rank_schedule(model, batches(6), mgr, pipeline_size=8)
    finally:
        mgr.device.close()
    assert len(samples) == 13  # 12 compute actions and end_iteration
    assert [a for a, _ in samples] == [b for _, b in samples]
    chunk = samples[0][1]  # after the first forward: one microbatch-chunk
    after_warmup = samples[5][1]  # six forwards held; offloaded bytes really gone from the allocator
    assert (after_warmup < 6 * chunk) if alpha > 0 else (after_warmup == 6 * chunk)


@pytest.mark.parametrize("alpha", [0.3, 1.0])
def test_offloaded_stage_inputs_are_freed_while_the_executor_keeps_them(alpha):
    """A received stage input (a grad-requiring leaf kept for its .grad) is really freed by offload."""
    model = middle_stage_model(num_layers=1, ckpt="ours")
    mgr = _manager(alpha, "cpu-thread", track_storages=True)
    live = []
    try:
        run_middle_stage(model, mgr, pipeline_size=8, rank=0, num_microbatches=8, micro_batch=2, seq=32,
                         hidden=HIDDEN, check_live=live)
    finally:
        mgr.device.close()
    assert [a for a, _ in live] == [b for _, b in live]
    assert max(b for _, b in live) < 8 * live[0][1]


def _rope_and_lse_bytes(seq, mb, dtype_bytes=4):
    """Per layer: the RoPE cos/sin (:func:`rope_bytes`) and SDPA's lse."""
    return rope_bytes(seq, dtype_bytes) + mb * HEADS * seq * 4


@pytest.mark.parametrize("ckpt", ["no", "ours"])
def test_chunk_bytes_equal_cost_model_terms(ckpt):
    """Per microbatch-chunk saved bytes, term by term: offloadable bytes are the cost model's total
    without its fp32 per-token terms (rstd is not saved by the ckpt=ours norm and is below the threshold
    under the fused-saves norm of ckpt=no, as lse is)."""
    layers, mb, seq = 2, 2, 32
    model = middle_stage_model(num_layers=layers, ckpt=ckpt)
    st = run_middle_stage(model, _manager(0.0), pipeline_size=2, rank=1, num_microbatches=2, micro_batch=mb,
                          seq=seq, hidden=HIDDEN)
    terms = activation_bytes_per_layer_token(tiny_model_spec(layers), ckpt, dtype_bytes=4, layer_spec="local")
    tokens = mb * seq
    small_terms = terms["norm1_rstd"] + terms["norm2_rstd"] + terms["softmax_lse"]
    assert st.saved_bytes[(0, 0)] == layers * tokens * (terms["total"] - small_terms)
    rstd = 2 * tokens * 4 if ckpt == "no" else 0  # the two norms' fp32 rstd, one per token
    assert st.small_bytes[(0, 0)] == layers * (_rope_and_lse_bytes(seq, mb) + rstd)


@pytest.mark.parametrize("ckpt", ["no", "ours"])
def test_chunk_bytes_with_kv_channels_equal_cost_model_terms(ckpt):
    """--kv-channels 24 (heads x d = 96 against h = 64): the query, the attention output and RoPE's cos/sin are
    heads x d and d wide; the saved bytes are the cost model's term by term."""
    layers, mb, seq, d = 2, 2, 32, 24
    model = middle_stage_model(num_layers=layers, ckpt=ckpt, kv_channels=d)
    st = run_middle_stage(model, _manager(0.0), pipeline_size=2, rank=1, num_microbatches=2, micro_batch=mb,
                          seq=seq, hidden=HIDDEN)
    spec = replace(tiny_model_spec(layers), kv_channels=d)
    terms = activation_bytes_per_layer_token(spec, ckpt, dtype_bytes=4, layer_spec="local")
    assert terms["query"] == terms["attention_output"] == HEADS * d * 4
    small_terms = terms["norm1_rstd"] + terms["norm2_rstd"] + terms["softmax_lse"]
    assert st.saved_bytes[(0, 0)] == layers * mb * seq * (terms["total"] - small_terms)
    rstd = 2 * mb * seq * 4 if ckpt == "no" else 0
    assert st.small_bytes[(0, 0)] == layers * (4 * seq * d * 4 + mb * HEADS * seq * 4 + rstd)


@pytest.mark.parametrize("ckpt", ["no", "ours"])
def test_chunk_bytes_with_qk_layernorm_equal_cost_model_terms(ckpt):
    """--qk-layernorm on the local spec: q's norm keeps megatron-core's reshaped copy of q, k's norm a view of the
    QKV projection's output and with it the whole output; their per-head rstd are small terms. Under both ckpt the
    saved bytes are the cost model's, term by term."""
    layers, mb, seq = 2, 2, 32
    spec = replace(tiny_model_spec(layers), qk_layernorm=True)
    model = middle_stage_model(num_layers=layers, ckpt=ckpt, qk_layernorm=True)
    st = run_middle_stage(model, _manager(0.0), pipeline_size=2, rank=1, num_microbatches=2, micro_batch=mb,
                          seq=seq, hidden=HIDDEN)
    terms = activation_bytes_per_layer_token(spec, ckpt, dtype_bytes=4, layer_spec="local")
    assert terms["qk_norm_input"] == (2 * HIDDEN + 2 * GROUPS * (HIDDEN // HEADS)) * 4
    small_terms = terms["norm1_rstd"] + terms["norm2_rstd"] + terms["softmax_lse"] + terms["qk_norm_rstd"]
    tokens = mb * seq
    assert st.saved_bytes[(0, 0)] == layers * tokens * (terms["total"] - small_terms)
    rstd = 2 * tokens * 4 if ckpt == "no" else 0
    assert st.small_bytes[(0, 0)] == layers * (_rope_and_lse_bytes(seq, mb) + rstd + tokens * terms["qk_norm_rstd"])


@pytest.mark.parametrize("ckpt", ["no", "ours"])
def test_squared_relu_saves_the_gelu_mlps_bytes(ckpt):
    """--squared-relu (relu(x)^2: relu keeps its output, pow that same tensor) saves what the GeLU MLP saves, the
    cost model's price for both: term by term under ckpt no and ours."""
    from megatron.core.activations import squared_relu

    import torch.nn.functional as F

    layers, mb, seq = 2, 2, 32
    spec = replace(tiny_model_spec(layers), swiglu=False)
    terms = activation_bytes_per_layer_token(spec, ckpt, dtype_bytes=4, layer_spec="local")
    small_terms = terms["norm1_rstd"] + terms["norm2_rstd"] + terms["softmax_lse"]
    for act in (squared_relu, F.gelu):
        model = middle_stage_model(num_layers=layers, ckpt=ckpt, gated_linear_unit=False, activation_func=act)
        st = run_middle_stage(model, _manager(0.0), pipeline_size=2, rank=1, num_microbatches=2, micro_batch=mb,
                              seq=seq, hidden=HIDDEN)
        assert st.saved_bytes[(0, 0)] == layers * mb * seq * (terms["total"] - small_terms), act


@pytest.mark.parametrize("ckpt", ["no", "ours"])
def test_hidden_dropout_masks_equal_cost_model_term(ckpt):
    """With --hidden-dropout the two bias-dropout-adds keep their masks under every ckpt but full; on CPU
    PyTorch's dropout keeps its noise tensor in the activation dtype (CUDA's fused kernel a bool mask), which
    ``dropout_mask_bytes`` says."""
    layers, mb, seq = 2, 2, 32
    spec = replace(tiny_model_spec(layers), hidden_dropout=0.1)
    model = middle_stage_model(num_layers=layers, ckpt=ckpt, hidden_dropout=0.1)
    st = run_middle_stage(model, _manager(0.0), pipeline_size=2, rank=1, num_microbatches=2, micro_batch=mb,
                          seq=seq, hidden=HIDDEN)
    terms = activation_bytes_per_layer_token(spec, ckpt, dtype_bytes=4, layer_spec="local", dropout_mask_bytes=4)
    assert terms["hidden_dropout_mask"] == 2 * HIDDEN * 4
    small_terms = terms["norm1_rstd"] + terms["norm2_rstd"] + terms["softmax_lse"]
    assert st.saved_bytes[(0, 0)] == layers * mb * seq * (terms["total"] - small_terms)


@pytest.mark.parametrize("ckpt", ["no", "ours"])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_stage_peaks_match_cost_model(ckpt, alpha):
    """Peak resident bytes of every stage of a PP=4 1F1B pipeline (each rank's action list run on a
    layers-only chunk) against the cost model's stage_activation_peak_bytes, within 5%."""
    layers, p, m, mb, seq = 2, 4, 8, 4, 32
    plan = Plan(num_gpus=p, seq_length=seq, global_batch_size=m * mb, micro_batch_size=mb,
                pipeline_model_parallel_size=p, ckpt=ckpt, offload_alpha=alpha)
    spec = tiny_model_spec(layers * p)
    predicted = list(stage_activation_peak_bytes(spec, plan, dtype_bytes=4, layer_spec="local",
                                                 sequence_parallel=False))
    # layers-only chunks: the last stage here has no output layer (tests/integration/test_memory_prediction.py has one)
    predicted[-1] -= output_layer_bytes(spec, plan, dtype_bytes=4, sequence_parallel=False)["total"]
    for rank in range(p):
        model = middle_stage_model(num_layers=layers, ckpt=ckpt)
        st = run_middle_stage(model, _manager(alpha), pipeline_size=p, rank=rank, num_microbatches=m,
                              micro_batch=mb, seq=seq, hidden=HIDDEN)
        assert st.peak_resident_bytes == pytest.approx(predicted[rank], rel=0.05), (rank, predicted)


@pytest.mark.parametrize("group", [None, 3, 6])
@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_grouped_interleaved_stage_peaks_match_cost_model(group, alpha):
    """Interleaved 1F1B (p=2, v=2, m=6) with --microbatch-group-size-per-virtual-pipeline-stage g: rank 0's warm-up
    holds 2 (p - 1) + (v - 1) g microbatch-chunks (4, 5 and 8 for g = 2 (the default), 3, 6); every rank's measured
    peak resident bytes equal the cost model's stage peaks within 5%, which move with g."""
    layers, p, v, m, mb, seq = 1, 2, 2, 6, 2, 32
    plan = Plan(num_gpus=p, seq_length=seq, global_batch_size=m * mb, micro_batch_size=mb,
                pipeline_model_parallel_size=p, num_layers_per_virtual_pipeline_stage=layers, ckpt="ours",
                offload_alpha=alpha, microbatch_group_size_per_vp_stage=group)
    spec = tiny_model_spec(layers * p * v)
    predicted = list(stage_activation_peak_bytes(spec, plan, dtype_bytes=4, layer_spec="local",
                                                 sequence_parallel=False))
    predicted[-1] -= output_layer_bytes(spec, plan, dtype_bytes=4, sequence_parallel=False)["total"]
    default = list(stage_activation_peak_bytes(spec, replace(plan, microbatch_group_size_per_vp_stage=None),
                                               dtype_bytes=4, layer_spec="local", sequence_parallel=False))
    assert (predicted[0] > default[0]) == (group not in (None, p))
    for rank in range(p):
        model = middle_stage_model(num_layers=layers, ckpt="ours")
        st = run_middle_stage(model, _manager(alpha), pipeline_size=p, rank=rank, num_microbatches=m,
                              micro_batch=mb, seq=seq, hidden=HIDDEN, virtual_size=v, group_size=group)
        assert st.peak_resident_bytes == pytest.approx(predicted[rank], rel=0.05), (rank, predicted)


def test_ours_saves_what_design_says():
    """no - ours per layer and token = the two norm outputs and the SwiGLU output (2h + f elements)."""
    layers, mb, seq = 2, 2, 32
    saved = {}
    for ckpt in ("no", "ours"):
        model = middle_stage_model(num_layers=layers, ckpt=ckpt)
        st = run_middle_stage(model, _manager(0.0), pipeline_size=1, rank=0, num_microbatches=1,
                              micro_batch=mb, seq=seq, hidden=HIDDEN)
        saved[ckpt] = st.saved_bytes[(0, 0)] + st.small_bytes[(0, 0)]
    per_layer_token = (saved["no"] - saved["ours"]) / (layers * mb * seq)
    assert per_layer_token == pytest.approx((2 * HIDDEN + FFN) * 4, rel=0.05)
    ours = saved["ours"] / (layers * mb * seq)  # 8h + 4h_kv + 4f at 2 bytes = (4h + 2h_kv + 2f) * 4 bytes
    assert ours == pytest.approx((4 * HIDDEN + 2 * GROUPS * HIDDEN // HEADS + 2 * FFN) * 4, rel=0.10)


def test_host_pool_does_not_grow_after_first_iteration():
    model = tiny_model()
    mgr = _manager(0.6)
    data = batches(6)
    seen = []
    for _ in range(3):
        run_rank_schedule(model, data, mgr, pipeline_size=8)
        seen.append((mgr.stats.host_pool_bytes, mgr.stats.host_pool_allocations, mgr.stats.reload_buffer_bytes))
    assert seen[0][0] > 0
    assert seen[1] == seen[0] and seen[2] == seen[0]
    assert mgr.pool.in_use_bytes == 0


def test_offload_reduces_peak_with_deep_pipeline():
    data = batches(8)
    peaks = {}
    for alpha in (0.0, 1.0):
        mgr = _manager(alpha)
        run_rank_schedule(tiny_model(), data, mgr, pipeline_size=8)
        peaks[alpha] = mgr.stats.peak_resident_bytes
    assert peaks[1.0] < 0.8 * peaks[0.0]


def test_chunks_never_offloaded_or_reloaded_just_work(reference):
    """Without OFFLOAD/RELOAD actions, or with OFFLOAD but no RELOAD, results are unchanged."""
    data, (ref_losses, ref_grads) = reference
    for skip in ({"OFF", "RL"}, {"RL"}):
        mgr = _manager(1.0)
        real_offload, real_reload = mgr.offload, mgr.reload
        mgr.offload = (lambda *k: None) if "OFF" in skip else real_offload
        mgr.reload = (lambda *k: None) if "RL" in skip else real_reload
        losses, grads = run_rank_schedule(tiny_model(), data, mgr)
        assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
        assert (mgr.stats.offloaded_bytes > 0) == ("OFF" not in skip)


def test_build_activation_manager_per_stage_alpha():
    assert build_activation_manager(H3TConfig(), 0, 4, "cpu") is None
    assert build_activation_manager(H3TConfig(ckpt="ours"), 0, 4, "cpu").alpha == 0.0
    cfg = H3TConfig(offload_alpha=(0.5, 0.25, 0.0, 0.0), device_mode="cpu-thread", min_offload_bytes=123)
    mgrs = [build_activation_manager(cfg, r, 4, "cpu") for r in range(4)]
    assert [m and m.alpha for m in mgrs] == [0.5, 0.25, None, None]
    assert mgrs[0].device.mode == "cpu-thread" and mgrs[0].min_offload_bytes == 123
    for m in mgrs[:2]:
        m.device.close()


def test_suspended_leaves_saved_tensors_alone():
    mgr = _manager(1.0)
    x = torch.randn(64, 64, requires_grad=True)
    with mgr.forward_scope(0, 0):
        with mgr.suspended():
            y = (x * x).sum()
    assert mgr.stats.saved_bytes[(0, 0)] == 0
    y.backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())


@pytest.mark.parametrize("mode", ["cpu-sync", "cpu-thread"])
def test_aliases_counted_once_and_boundary_split(mode):
    """Two views of one storage are one record; alpha=0.5 splits it at half its bytes."""
    mgr = _manager(0.5, mode)
    x = torch.randn(64, 64, requires_grad=True)
    try:
        with mgr.forward_scope(0, 0):
            a = x * 2  # not saved by the mul (constant factor); saved below as two views
            y = (a[:32] * a[32:]).sum()
        assert mgr.stats.saved_bytes[(0, 0)] == 64 * 64 * 4
        mgr.offload(0, 0)
        del a
        with mgr.forward_scope(1, 0):
            pass
        assert mgr.stats.offloaded_bytes == 64 * 64 * 2
        # half went to host; the kept half is a tail copy, plus the two reload slots of the full record
        assert mgr.resident_bytes == 64 * 64 * 2 + 2 * 64 * 64 * 4
        mgr.reload(0, 0)
        with mgr.backward_scope(0, 0):
            y.backward()
        mgr.release(0, 0)
    finally:
        mgr.device.close()
    xd = x.detach()
    torch.testing.assert_close(x.grad[:32], 4 * xd[32:], rtol=0, atol=0)
    torch.testing.assert_close(x.grad[32:], 4 * xd[:32], rtol=0, atol=0)
