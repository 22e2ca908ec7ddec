"""Megatron's --overlap-moe-expert-parallel-comm in the cost model: one microbatch's forward merged with another's
backward layer by layer (megatron-core's combined 1F1B), each token exchange half beside the other microbatch's
compute; megatron-core's rules as plan errors; the timeline's merged pairs and the closed form's count agree; the flag
through h3t-plan and the one translation; and the published on/off pairs it is checked on."""
from __future__ import annotations

from dataclasses import replace

import pytest

from h3t_ext.costmodel import InvalidPlanError, Plan, estimate, get_model, get_system, validate_plan
from h3t_ext.costmodel import moe
from h3t_ext.costmodel.published_moe import held_out_errors
from h3t_ext.costmodel.timeline import plan_timeline, timeline_terms
from h3t_ext.costmodel.timing import merged_pairs, shape_times
from h3t_ext.planner.flags import megatron_flags
from h3t_ext.planner.translate import plan_from_args
from tests.planner_harness import run_json, run_main

MODEL, SYSTEM = get_model("mixtral-8x7b"), get_system("h100-sxm")
BASE = Plan(num_gpus=64, seq_length=4096, global_batch_size=512, micro_batch_size=1, expert_model_parallel_size=8,
            moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True, use_distributed_optimizer=True)
A2A = replace(BASE, overlap_moe_expert_parallel_comm=True)


def test_a_merged_layer_pair_runs_each_exchange_half_beside_the_other_microbatchs_compute():
    # compute outlasts every exchange half: only the compute is left
    assert moe.merged_layer_seconds(1.0, 1.0, 2.0, 1.0, 1.0, 1.0) == pytest.approx(6.0)
    # no compute to hide behind: the four halves run one after the other
    assert moe.merged_layer_seconds(0.0, 0.0, 0.0, 0.0, 0.0, 2.0) == pytest.approx(4.0)
    # the dispatch's backward waits for the MLP's data gradient: a long dgrad pushes it past the phase's compute
    assert moe.merged_layer_seconds(1.0, 0.0, 1.0, 3.0, 0.0, 2.0) == pytest.approx(1.0 + 4.0 + 1.0)
    # the MLP's forward waits for the forward's dispatch
    assert moe.merged_layer_seconds(1.0, 1.0, 1.0, 0.0, 0.0, 4.0) == pytest.approx(2.0 + 4.0 + 2.0)


@pytest.mark.parametrize("change,reason", [
    (dict(expert_model_parallel_size=1), "expert_model_parallel_size > 1"),
    (dict(moe_token_dispatcher_type="allgather"), "alltoall or flex"),
    (dict(pipeline_model_parallel_size=2), "needs a virtual pipeline"),
    (dict(recompute_granularity="full"), "without full recompute"),
    (dict(recompute_modules=("moe",)), "recompute module"),
])
def test_megatron_cores_rules_are_plan_errors(change, reason):
    recompute = {k: change.pop(k) for k in ("recompute_granularity", "recompute_modules") if k in change}
    plan = replace(A2A, **change)
    if recompute:
        from h3t_ext.ckpt import Recompute
        plan = replace(plan, recompute=Recompute.parse(recompute.get("recompute_granularity", "selective"),
                                                       modules=recompute.get("recompute_modules"), moe=True))
    with pytest.raises(InvalidPlanError, match=reason):
        validate_plan(MODEL, plan, SYSTEM)
    dense = Plan(num_gpus=8, seq_length=4096, global_batch_size=8, overlap_moe_expert_parallel_comm=True)
    with pytest.raises(InvalidPlanError, match="needs num_experts"):
        validate_plan(get_model("llama2-7b"), dense, SYSTEM)


@pytest.mark.parametrize("p,v,m", [(1, 1, 4), (4, 2, 4), (4, 4, 4), (2, 8, 4), (8, 4, 8), (4, 2, 12)])
def test_the_timeline_merges_the_pairs_the_closed_form_counts(p, v, m):
    """Every rank merges its steady-state steps: the builder's lists hold that many adjacent forward-backward pairs of
    different microbatches (at m = p the first ranks' warm-up holds every forward and they merge none)."""
    plan = replace(A2A, pipeline_model_parallel_size=p, num_virtual_stages_per_pipeline_rank=v if v > 1 else None,
                   global_batch_size=64 // p * m)
    st = shape_times(MODEL, plan, SYSTEM)
    assert st.merge_hidden > 0 and shape_times(MODEL, replace(plan, overlap_moe_expert_parallel_comm=False),
                                               SYSTEM).merge_hidden == 0
    tl = plan_timeline(MODEL, plan, SYSTEM)
    per_chunk = st.merge_hidden * (MODEL.num_layers // (p * v))
    for r in tl.ranks:
        assert r.hidden == pytest.approx(merged_pairs(p, plan.num_microbatches, v, r.rank) * per_chunk), (p, v, r.rank)
    terms = timeline_terms(MODEL, plan, SYSTEM, tl)
    assert terms.total == pytest.approx(tl.iteration_time_s) and terms.ep_comm >= 0


def test_the_overlap_holds_one_more_exchange_buffer():
    """A merged forward's exchange of another microbatch runs beside the backward's: one more all-to-all buffer of
    the rank's T k token copies."""
    off, on = (estimate(MODEL, p, SYSTEM).stages[0].terms for p in (BASE, A2A))
    one = 4096 * MODEL.moe_router_topk * MODEL.hidden_size * 2
    assert off["moe_dispatch_buffer"] == one and on["moe_dispatch_buffer"] == 2 * one


def test_the_overlap_hides_exchange_and_nothing_else():
    off, on = estimate(MODEL, BASE, SYSTEM), estimate(MODEL, A2A, SYSTEM)
    assert on.iteration_time_s < off.iteration_time_s
    assert on.time_terms.ep_comm < off.time_terms.ep_comm
    assert on.time_terms.compute == pytest.approx(off.time_terms.compute)
    assert off.iteration_time_s - on.iteration_time_s <= off.time_terms.ep_comm
    assert on.closed_form.total == pytest.approx(on.iteration_time_s, rel=0.02)


def test_h3t_plan_takes_the_flag_prints_it_back_and_refuses_what_megatron_refuses(capsys):
    args = ["estimate", "--model", "mixtral-8x7b", "--num-gpus", "64", "--seq-length", "4096", "--global-batch-size",
            "512", "--expert-model-parallel-size", "8", "--moe-token-dispatcher-type", "alltoall", "--moe-grouped-gemm",
            "--use-distributed-optimizer"]
    off, on = run_json(args, capsys), run_json([*args, "--overlap-moe-expert-parallel-comm"], capsys)
    assert on["tokens_per_second"] > off["tokens_per_second"]
    assert "--overlap-moe-expert-parallel-comm" in on["megatron_flags"]
    assert "--overlap-moe-expert-parallel-comm" not in off["megatron_flags"]
    allgather = [a for a in args if a not in ("--moe-token-dispatcher-type", "alltoall")]  # Megatron's default
    code, _, err = run_main([*allgather, "--overlap-moe-expert-parallel-comm"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "alltoall or flex" in err, err
    assert megatron_flags(A2A).count("--overlap-moe-expert-parallel-comm") == 1
    plan = plan_from_args({"seq_length": 4096, "global_batch_size": 64, "overlap_moe_expert_parallel_comm": True},
                          num_gpus=8)
    assert plan.overlap_moe_expert_parallel_comm


def test_the_published_on_off_pairs():
    """Held out: two published pairs that differ only in the overlap (the Model Zoo's Qwen3-235B cross-node DeepEP
    rows, the Megatron-Bridge skill's Qwen3-30B HybridEP rows). The model hides nearly all of the modelled exchange;
    the runs gained 12% and 18% where it gains 37% and 27%: optimistic by 23 and 9 points (recorded in DESIGN)."""
    errors = {run.label: e for run, _, e in held_out_errors()}
    zoo = [errors["Qwen3-235B 256 GPUs t2 ep32 p8 v4 (DeepEP, cross-node EP)"],
           errors["Qwen3-235B 256 GPUs t2 ep32 p8 v4 (DeepEP, +1f1b overlap)"]]
    skill = [errors["Qwen3-30B 16 GPUs ep16 (HybridEP, forced balance)"],
             errors["Qwen3-30B 16 GPUs ep16 (HybridEP, forced balance, 1f1b overlap)"]]
    assert zoo == pytest.approx([0.015, 0.244], abs=0.005)
    assert skill == pytest.approx([0.162, 0.249], abs=0.005)


def test_search_keeps_the_overlap_to_the_layouts_that_can_run_it(capsys):
    """The overlap's size rules (ep > 1, a virtual pipeline with p > 1) reject layouts, not the whole search."""
    rows = run_json(["search", "--model", "qwen3-30b-a3b", "--num-gpus", "16", "--seq-length", "4096",
                     "--global-batch-size", "1024", "--overlap-moe-expert-parallel-comm", "--top", "3"], capsys)
    assert len(rows) == 3
    for row in rows:
        assert row["expert_model_parallel_size"] > 1 and row["overlap_moe_expert_parallel_comm"]
        assert row["pipeline_model_parallel_size"] == 1 or row["num_layers_per_virtual_pipeline_stage"] or \
            row["pipeline_model_parallel_layout"]
        assert "--overlap-moe-expert-parallel-comm" in row["megatron_flags"]


def test_best_first_search_with_the_overlap_is_the_exhaustive_top():
    """The best-first search's bound subtracts what merged pairs hide; without it a better plan was pruned (the
    fifth best of this search was missed)."""
    from h3t_ext.planner.search import search
    from h3t_ext.planner.space import SearchConstraints

    model = get_model("qwen3-30b-a3b")
    kw = dict(num_gpus=16, seq_length=4096, global_batch_size=256,
              constraints=SearchConstraints(overlap_moe_expert_parallel_comm=True, ckpt="no"))
    full = search(model, SYSTEM, exhaustive=True, **kw)
    best = search(model, SYSTEM, top=5, **kw)
    assert best.considered < full.considered
    assert [(r.plan, r.tokens_per_second) for r in best.plans[:5]] == [(r.plan, r.tokens_per_second)
                                                                        for r in full.plans[:5]]
