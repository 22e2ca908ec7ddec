"""The cost model's layer-granular offload at pipeline size 1 (pure arithmetic, no torch)."""
from __future__ import annotations

import pytest

from h3t_ext.costmodel import Plan, get_model, get_system
from h3t_ext.costmodel.estimate import estimate
from h3t_ext.costmodel.layer_offload import exposed_seconds_per_microbatch, layer_offload
from h3t_ext.costmodel.memory import chunk_activation_bytes, stage_memory
from h3t_ext.costmodel.offload import pcie_bytes_per_iteration, solve_offload_alpha
from h3t_ext.costmodel.timeline import plan_timeline

MODEL = get_model("llama-7b")
SYSTEM = get_system("h100-sxm")


def _plan(alpha, **kw):
    return Plan(num_gpus=8, seq_length=4096, global_batch_size=64, micro_batch_size=1,
                pipeline_model_parallel_size=1, ckpt="no", offload_alpha=alpha, **kw)


def test_peak_is_the_layers_left_at_the_end_of_the_forward_and_the_slots_come_in_the_backward():
    """The reload slots are allocated at a microbatch's first reload, after the layers behind the last offloaded
    one have freed their bytes: at alpha 0.5 (layers 0-15 offloaded) they add nothing to the forward's end; when
    layer L-2 is offloaded in part, the first slot (a whole layer) holds (1 - f) of a layer more than the dropped
    part; when it is offloaded whole, nothing."""
    L = MODEL.num_layers  # 32
    A = chunk_activation_bytes(MODEL, _plan(0.0))
    base = stage_memory(MODEL, _plan(0.0), 0, 0.0).terms
    half = stage_memory(MODEL, _plan(0.5), 0, 0.5).terms
    assert base["offload_reload_buffer"] == 0 and base["activations"] == A
    # layers 0-15 offloaded, all dropped before layer 31's forward ends (layer 30's copy still overlaps it)
    assert half["activations"] == round(A * (L - 16) / L)
    assert half["offload_reload_buffer"] == 0
    full = stage_memory(MODEL, _plan(1.0), 0, 1.0).terms
    assert full["activations"] == round(A * 2 / L)  # layers 30 (still copying) and 31 (never offloaded) stay
    assert full["offload_reload_buffer"] == 0  # layer 30 offloaded whole: its slot takes its dropped bytes' place
    assert layer_offload(1.0, L).offloaded == pytest.approx((L - 1) / L)
    alpha = (30 + 0.25) / L  # layers 0-29 whole, a quarter of layer 30
    assert layer_offload(alpha, L).fractions[L - 2] == pytest.approx(0.25)
    part = stage_memory(MODEL, _plan(alpha), 0, alpha).terms
    assert part["offload_reload_buffer"] == round(0.75 * A / L)


def test_one_reload_slot_is_held_at_the_embeddings_backward():
    """At p = 1 the embedding's gradient is made after layer 0's backward, while layer 0's reload slot is still
    held: the embedding moment counts one layer's slot when layer 0 was offloaded, none at alpha 0."""
    from h3t_ext.costmodel.memory import EMBEDDING_MOMENT_TERMS, _embedding_moment

    L = MODEL.num_layers
    plan = _plan(0.5)
    A = chunk_activation_bytes(MODEL, plan)
    assert layer_offload(0.5, L).embedding_slot == pytest.approx(1 / L)
    assert layer_offload(0.0, L).embedding_slot == 0
    terms = stage_memory(MODEL, plan, 0, 0.5).terms
    assert "offload_reload_buffer" not in EMBEDDING_MOMENT_TERMS
    assert (_embedding_moment(MODEL, plan, terms, round(A / L)) - _embedding_moment(MODEL, plan, terms)
            == round(A / L))


def test_pcie_bytes_are_every_microbatch_both_ways():
    plan = _plan(0.5)
    A = chunk_activation_bytes(MODEL, plan)
    (pcie,) = pcie_bytes_per_iteration(MODEL, plan, (0.5,))
    assert pcie == int(2 * plan.num_microbatches * 0.5 * A)
    assert estimate(MODEL, plan, SYSTEM, timeline=False).pcie_bytes_per_iteration == pcie


def test_exposed_time_hand_worked():
    """3 layers, layers 0 and 1 offloaded, forward 1 s and backward 2 s a layer, a copy 1.5 s: layer 1's copy out
    queues behind layer 0's (ends at 4.0), its copy back starts then and ends at 5.5, half a second after layer 2's
    backward; layer 0's copy back (5.5 to 7.0) hides behind layer 1's backward (5.5 to 7.5)."""
    lo = layer_offload(2 / 3, 3)
    assert lo.fractions == (1.0, 1.0, 0.0)
    assert exposed_seconds_per_microbatch(lo, 1.0, 1.0, 2.0, 0.0, lambda b: 1.5 * b) == pytest.approx(0.5)
    assert exposed_seconds_per_microbatch(lo, 1.0, 1.0, 2.0, 0.0, lambda b: 0.9 * b) == 0.0  # all hidden


def test_timeline_and_closed_form_price_the_same_stall():
    plan = _plan(0.5)
    est = estimate(MODEL, plan, SYSTEM)
    tl = plan_timeline(MODEL, plan, SYSTEM)
    assert est.closed_form.offload_exposed > 0  # a 7B layer's copy is longer than its forward on PCIe
    assert tl.ranks[0].stall == pytest.approx(est.closed_form.offload_exposed)
    assert est.time_terms.offload_exposed == pytest.approx(est.closed_form.offload_exposed)
    tr = est.offload_traffic
    assert tr.offloaded_layers == 16 and tr.num_layers == 32
    assert tr.layer_copy_s > tr.next_forward_s  # what makes it exposed


def test_auto_alpha_at_p1_fits_the_budget():
    plan = _plan(0.0)
    peak0 = stage_memory(MODEL, plan, 0, 0.0).peak_bytes
    budget = peak0 - chunk_activation_bytes(MODEL, plan) // 4
    alpha = solve_offload_alpha(MODEL, plan, SYSTEM, memory_budget_bytes=budget)
    assert 0 < alpha < 1
    assert stage_memory(MODEL, plan, 0, alpha).peak_bytes <= budget
    assert stage_memory(MODEL, plan, 0, alpha - 0.001).peak_bytes > budget


def test_estimate_explain_shows_the_layer_traffic(capsys):
    from h3t_ext.planner.cli import main

    code = main(["estimate", "--model", "llama-7b", "--seq-length", "4096", "--num-gpus", "8", "--gpu", "h100-sxm",
                 "--global-batch-size", "64", "--pipeline-model-parallel-size", "1", "--offload-alpha", "0.5",
                 "--explain"])
    out = capsys.readouterr().out
    assert code == 0
    assert "layers 0-15 of 32" in out and "hides behind the next layer's forward" in out
