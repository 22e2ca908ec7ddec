"""The cost model's timeline of the schedule builder's action lists (h3t_ext/costmodel/timeline.py)."""
from dataclasses import fields, replace

import pytest

from h3t_ext.costmodel import Plan, estimate, get_model, get_system
from h3t_ext.costmodel.timeline import simulate
from h3t_ext.costmodel.timing import LayerTime, TimeTerms, layer_time
from h3t_ext.schedule import build_schedule
from h3t_ext.schedule.actions import ActionKind, ScheduleConfig

M7, H800 = get_model("llama-7b"), get_system("h800")


def _plan(p, l, alpha, m, ckpt="ours"):
    return Plan(num_gpus=p, seq_length=4096, global_batch_size=m, micro_batch_size=1, tensor_model_parallel_size=1,
                pipeline_model_parallel_size=p, num_layers_per_virtual_pipeline_stage=l, ckpt=ckpt, offload_alpha=alpha)


HIDDEN = [(p, l, a, m) for p in (2, 4, 8) for l in (None, 1) for a in (0.0, 0.2) for m in (2 * p, 4 * p)]


@pytest.mark.parametrize("p,l,alpha,m", HIDDEN)
def test_timeline_agrees_with_closed_form_when_offload_is_hidden(p, l, alpha, m):
    """1F1B and interleaved, p 2/4/8, with and without offload (alpha 0.2 on PCIe: hidden): within 1%."""
    e = estimate(M7, _plan(p, l, alpha, m), H800)
    assert e.timeline is not None
    assert e.time_terms.offload_exposed == 0.0 and all(r.stall == 0.0 for r in e.timeline.ranks)
    assert e.iteration_time_s == pytest.approx(e.closed_form_time_s, rel=0.01)
    assert e.iteration_time_s == pytest.approx(e.time_terms.total)
    if alpha:  # the same list with its copies: they are hidden, the time does not move
        assert e.iteration_time_s == pytest.approx(estimate(M7, _plan(p, l, 0.0, m), H800).iteration_time_s)


def test_reload_traffic_over_its_window_stalls():
    """alpha 1 over a very slow PCIe: the timeline stalls, the iteration is longer than at alpha 0."""
    slow = replace(H800, pcie_bandwidth=H800.pcie_bandwidth / 2000)
    off, zero = estimate(M7, _plan(2, None, 1.0, 4), slow), estimate(M7, _plan(2, None, 0.0, 4), slow)
    assert off.timeline.ranks[0].stall > 0 and off.timeline.ranks[1].stall == 0  # the last stage offloads nothing
    assert off.time_terms.offload_exposed > 0
    assert off.iteration_time_s > zero.iteration_time_s + 0.5 * off.timeline.ranks[0].stall
    assert zero.time_terms.offload_exposed == 0


def test_stall_equals_the_excess_computed_by_hand():
    """p = 2, m = 4, 1F1B (blocking), hop 0, rank 0 offloads (microbatches 1 and 2), copies of c seconds.

    Rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3, rank 1 F0 B0 F1 B1 ... . With e = max(2 f0, f0 + f1) + b1 (rank 1's
    B0 ends) and g = max(e + b0 + f0, e + f1 + b1) (the exchange before rank 0's B1): OFF1 runs [2 f0, 2 f0 + c],
    RL1 [2 f0 + c, 2 f0 + 2 c] (it waits for OFF1), so B1 stalls 2 f0 + 2 c - g; OFF2 queues behind OFF1 and ends
    at 2 f0 + 2 c; RL2 is issued after B1, [2 f0 + 2 c + b0, 2 f0 + 3 c + b0], while F3 ends at
    2 f0 + 2 c + b0 + f0: B2 stalls c - f0. Rank 0 ends at 2 f0 + 3 c + 3 b0."""
    f0, b0, f1, b1, c = 1.0, 2.0, 1.5, 3.0, 20.0
    cfg = ScheduleConfig(2, 4, 1, offload_stages=(True, False))
    ranks = simulate(cfg, [[f0], [f1]], [[b0], [b1]], hop=0.0, blocking=True, copy=[c, 0.0])
    e = max(2 * f0, f0 + f1) + b1
    g = max(e + b0 + f0, e + f1 + b1)
    assert ranks[0].stall == pytest.approx((2 * f0 + 2 * c - g) + (c - f0))
    assert ranks[0].end == pytest.approx(2 * f0 + 3 * c + 3 * b0)
    assert ranks[0].busy == pytest.approx(4 * (f0 + b0))
    assert ranks[0].end == pytest.approx(ranks[0].busy + ranks[0].idle)
    no_copy = simulate(ScheduleConfig(2, 4, 1, offload=False), [[f0], [f1]], [[b0], [b1]], hop=0.0, blocking=True)
    assert no_copy[0].stall == 0 and no_copy[0].end < ranks[0].end


def test_timeline_without_transfers_is_the_ideal_pipeline():
    """hop 0, equal stages: (m v + p - 1)(f + b) chunk units on rank 0, for 1F1B and interleaved."""
    for p, m, v in [(2, 4, 1), (4, 8, 1), (4, 8, 2), (4, 16, 3), (8, 16, 2), (8, 8, 2)]:
        ranks = simulate(ScheduleConfig(p, m, v, offload=False), [[1.0] * v] * p, [[2.0] * v] * p, hop=0.0,
                         blocking=v == 1)
        assert max(r.end for r in ranks) == pytest.approx((m * v + p - 1) * 3.0)


def test_layer_time_fields_sum_to_total():
    for ckpt in ("no", "ours", "full", "selective"):
        plan = Plan(num_gpus=8, seq_length=4096, global_batch_size=16, micro_batch_size=1,
                    tensor_model_parallel_size=4, context_parallel_size=2, ckpt=ckpt)
        lt = layer_time(get_model("llama-65b"), plan, H800)
        assert isinstance(lt, LayerTime)
        assert lt.total == pytest.approx(sum(getattr(lt, f.name) for f in fields(lt)))
        assert lt.total == pytest.approx(lt.forward_action + lt.backward_action)
        assert lt.tp > 0 and lt.cp > 0
        with pytest.raises(Exception):
            lt.fwd = 0.0  # frozen
    e = estimate(M7, _plan(4, 1, 0.2, 8), H800)
    for terms in (e.time_terms, e.closed_form):
        assert isinstance(terms, TimeTerms)
        assert terms.total == pytest.approx(sum(terms.as_dict().values()))
        assert list(terms.as_dict()) == ["compute", "recompute", "tp_comm", "cp_comm", "pp_p2p", "bubble",
                                          "dp_exposed", "optimizer", "offload_exposed", "ep_comm"]


def test_builder_emits_offload_only_for_stages_that_offload():
    s = build_schedule(4, 8, 2, offload_stages=(True, False, True, False))
    copies = (ActionKind.OFFLOAD, ActionKind.RELOAD)
    assert s.offloaded(0) and s.offloaded(2)
    assert not any(a.kind in copies for r in (1, 3) for a in s.ranks[r])
    everyone = build_schedule(4, 8, 2)
    assert s.ranks[0] == everyone.ranks[0] and s.ranks[2] == everyone.ranks[2]
    bare = build_schedule(4, 8, 2, offload=False)
    assert s.ranks[1] == bare.ranks[1]
    # the cost model builds the lists of the plan's alphas: alpha 0 on every stage -> no copies at all
    e = estimate(M7, _plan(4, 1, 0.0, 8), H800)
    assert all(r.stall == 0 for r in e.timeline.ranks)
    with pytest.raises(ValueError):
        ScheduleConfig(4, 8, 2, offload_stages=(True,))


@pytest.mark.parametrize("enabled", [True, False])
def test_timeline_leaves_the_garbage_collector_as_it_was(enabled):
    """plan_timeline pauses the cyclic collector while it builds the lists, then restores its state."""
    import gc
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        e = estimate(M7, _plan(4, 1, 0.2, 16), H800)
        assert e.timeline is not None and gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
