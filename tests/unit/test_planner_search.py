"""Planner library: enumeration and its rejection reasons, search ranking, flags round trip, byte parsing."""
from __future__ import annotations

import importlib
import itertools
import random
from dataclasses import replace

import pytest

from h3t_ext.ckpt import NO_RECOMPUTE, SELECTIVE_CORE_ATTN, Ckpt, Recompute
from h3t_ext.costmodel import ModelSpec, Plan, estimate, get_model, get_system
from h3t_ext.planner import space
from h3t_ext.offload_alpha import OffloadAlpha, format_alpha
from h3t_ext.planner.flags import megatron_flags, plan_from_megatron_flags
from h3t_ext.costmodel.errors import InvalidPlanError
from h3t_ext.planner.bounds import Bounds, candidate_plan as bounds_candidate
from h3t_ext.planner.search import R_BOUND, search
from h3t_ext.planner.space import SearchConstraints, divisors, enumerate_layouts
from h3t_ext.planner.pipeline_balance import balanced_stage_layers, layout_string, output_layer_in_layers
from h3t_ext.planner.units import parse_bytes

# 12 heads, 2 query groups, 6 layers: t=4 fails on groups, t=3 on gpus_per_node, t=8 on heads.
TOY = ModelSpec(name="toy", num_layers=6, hidden_size=384, num_attention_heads=12, num_query_groups=2,
                ffn_hidden_size=1024, vocab_size=1000)


def _brute_force(model, num_gpus, seq, batch, gpus_per_node):
    """Every valid (t, c, p, l, mb, layout), straight from the rules, without the enumeration's structure: Megatron's
    even split where p divides the layers (interleaved too), and with one chunk per stage the balanced layout
    (h3t_ext.planner.pipeline_balance, tested on its own) where there is one."""
    L, valid = model.num_layers, set()
    for t, c, p in itertools.product(range(1, num_gpus + 1), repeat=3):
        if num_gpus % (t * c * p) or gpus_per_node % t:
            continue
        if model.num_attention_heads % t or model.num_query_groups % t:
            continue
        if (c > 1 and seq % (2 * c)) or seq % (c * t):
            continue
        replicas = num_gpus // (t * c * p)
        balanced = balanced_stage_layers(L, p, output_layer_in_layers(model, seq, t))
        layouts = [layout_string(balanced)] if balanced and len(set(balanced)) > 1 else []
        for l, mb in itertools.product([None, *range(1, L + 1)], range(1, batch + 1)):
            if l is not None and (L % (p * l) or p == 1 or p * l == L):
                continue
            if batch % (mb * replicas):
                continue
            if l is not None and (batch // (mb * replicas)) % p:
                continue
            for layout in ([None] if L % p == 0 else []) + (layouts if l is None else []):
                valid.add((t, c, p, l, mb, layout))
    return valid


@pytest.mark.parametrize("num_gpus,seq,batch", [(24, 96, 12), (16, 64, 8), (12, 36, 6)])
def test_enumeration_equals_brute_force(num_gpus, seq, batch):
    layouts, _ = enumerate_layouts(TOY, num_gpus=num_gpus, seq_length=seq, global_batch_size=batch, gpus_per_node=8)
    got = {(x.tensor_model_parallel_size, x.context_parallel_size, x.pipeline_model_parallel_size,
            x.num_layers_per_virtual_pipeline_stage, mb, x.pipeline_model_parallel_layout)
           for x in layouts for mb in x.micro_batch_sizes}
    assert got == _brute_force(TOY, num_gpus, seq, batch, 8)
    assert len(got) == sum(len(x.micro_batch_sizes) for x in layouts)  # no duplicates


def test_layers_that_p_does_not_divide_get_the_balanced_layout():
    """6 layers over 4 stages: Megatron's even split cannot, a layout can (1, 2, 2, 1: the output layer is worth a
    quarter layer here, so the last stage keeps one and the middle ones take the rest)."""
    layouts, rejected = enumerate_layouts(TOY, num_gpus=4, seq_length=96, global_batch_size=12, gpus_per_node=8,
                                          constraints=SearchConstraints(tensor_model_parallel_size=1,
                                                                        context_parallel_size=1,
                                                                        pipeline_model_parallel_size=4))
    assert {x.pipeline_model_parallel_layout for x in layouts} == {"Et|t*2|t*2|tL"}
    assert {x.num_layers_per_virtual_pipeline_stage for x in layouts} == {None}
    assert rejected[space.R_P_LAYERS] == 4  # l = 1, 2, 3, 6: interleaving needs the even split


def _reasons(constraints, *, num_gpus=24, seq=96, batch=12, model=TOY):
    _, rejected = enumerate_layouts(model, num_gpus=num_gpus, seq_length=seq, global_batch_size=batch,
                                    gpus_per_node=8, constraints=constraints)
    return rejected


@pytest.mark.parametrize("fixed,reason", [
    (dict(tensor_model_parallel_size=4), space.R_T_GROUPS),
    (dict(tensor_model_parallel_size=3), space.R_T_NODE),
    (dict(tensor_model_parallel_size=24), space.R_T_NODE),
    (dict(pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=1), space.R_P_LAYERS),
    (dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=2), space.R_L_LAYERS),
    (dict(pipeline_model_parallel_size=1, num_layers_per_virtual_pipeline_stage=1), space.R_L_P1),
    (dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=3), space.R_L_SAME),
    (dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1, micro_batch_size=5),
     space.R_MB_BATCH),
])
def test_enumeration_rejects_for_the_right_reason(fixed, reason):
    base = dict(tensor_model_parallel_size=1, context_parallel_size=1, pipeline_model_parallel_size=1)
    rejected = _reasons(SearchConstraints(**{**base, **fixed}))
    assert dict(rejected) == {reason: 1}  # exactly one partial plan, rejected by exactly this rule


def test_enumeration_rejects_heads_sequence_and_interleaving():
    heads = ModelSpec(name="h", num_layers=6, hidden_size=384, num_attention_heads=6, num_query_groups=6,
                      ffn_hidden_size=1024, vocab_size=1000)
    assert _reasons(SearchConstraints(tensor_model_parallel_size=4), model=heads) == {space.R_T_HEADS: 1}
    assert _reasons(SearchConstraints(tensor_model_parallel_size=1, context_parallel_size=4), seq=36) == \
        {space.R_C_SEQ: 1}
    twelve = ModelSpec(name="m", num_layers=6, hidden_size=384, num_attention_heads=12, num_query_groups=12,
                       ffn_hidden_size=1024, vocab_size=1000)
    # s=12: divisible by t=4 and by 2c=4, but the context shard s/c=6 does not split over t=4
    assert _reasons(SearchConstraints(tensor_model_parallel_size=4, context_parallel_size=2), seq=12,
                    model=twelve) == {space.R_T_SEQ: 1}
    # p=3, l=1 (v=2): 24 GPUs, t=1 c=1 -> 8 replicas, batch 16 -> m = 2 / mb, never a multiple of 3
    r = _reasons(SearchConstraints(tensor_model_parallel_size=1, context_parallel_size=1, pipeline_model_parallel_size=3,
                                   num_layers_per_virtual_pipeline_stage=1), batch=16)
    assert r.get(space.R_MB_INTERLEAVE, 0) > 0


def test_divisors():
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(1) == [1]
    assert divisors(49) == [1, 7, 49]


@pytest.fixture(scope="module")
def small_search():
    return search(get_model("llama-7b"), get_system("h800"), num_gpus=8, seq_length=4096, global_batch_size=16)


def test_search_ranked_best_first_and_all_fit(small_search):
    plans = small_search.plans
    assert len(plans) > 10
    tps = [r.tokens_per_second for r in plans]
    assert tps == sorted(tps, reverse=True)
    assert all(r.evaluation.estimate.fits for r in plans)
    assert small_search.best is plans[0]
    assert small_search.considered >= len(plans)


def test_exhaustive_search_finds_the_same_best_plans(small_search):
    full = search(get_model("llama-7b"), get_system("h800"), num_gpus=8, seq_length=4096, global_batch_size=16,
                  exhaustive=True)
    assert full.considered > small_search.considered
    assert {r.plan for r in small_search.plans} <= {r.plan for r in full.plans}
    assert [r.plan for r in full.plans[:10]] == [r.plan for r in small_search.plans[:10]]


@pytest.mark.parametrize("budget,alpha_mode", [(None, "auto"), (20 * 10**9, "auto"), (20 * 10**9, "balanced"),
                                               (None, 1.0), (20 * 10**9, 0.5)])
def test_best_first_top_is_the_exhaustive_top(budget, alpha_mode):
    model, system = get_model("llama-7b"), get_system("h800")
    kw = dict(num_gpus=8, seq_length=4096, global_batch_size=16, memory_budget_bytes=budget, alpha_mode=alpha_mode)
    full = search(model, system, exhaustive=True, **kw)
    for top in (1, 3, 10):
        best = search(model, system, top=top, **kw)
        assert best.considered < full.considered and best.rejected.get(R_BOUND, 0) > 0
        assert ([(r.plan, r.tokens_per_second) for r in best.plans[:top]]
                == [(r.plan, r.tokens_per_second) for r in full.plans[:top]])


def test_a_block_candidate_over_the_host_budget_prunes_no_other_block_candidate():
    """A block candidate's N is the smallest that fits the device; priced, it may still not fit the host (at alpha 1
    every saved byte goes there), which says nothing of another block candidate's N: block on ``no`` keeps more
    than block on ``ours`` at one N, but its own N is larger and keeps less. The best-first search counted the
    priced failure as the mode's and pruned block on ``no`` at that micro batch and above, which left the exhaustive
    search's tenth plan out of its top ten."""
    model, system = get_model("llama-7b"), get_system("a100-80g")
    kw = dict(num_gpus=8, seq_length=2048, global_batch_size=256, alpha_mode=1.0, memory_budget_bytes=40 * 2**30,
              host_memory_budget_bytes=100 * 2**30)  # with the old rule the best-first top ten differs here
    full, best = search(model, system, exhaustive=True, **kw), search(model, system, top=10, **kw)
    assert [(r.plan, r.tokens_per_second) for r in best.plans[:10]] == [(r.plan, r.tokens_per_second)
                                                                        for r in full.plans[:10]]
    block_no = [r.plan for r in full.plans[:10] if r.plan.recompute.method == "block" and r.plan.ckpt == Ckpt.NO]
    twins = []  # block on ours at a smaller N, same micro batch: fits the device, not the host
    for plan in block_no:
        for n in range(1, plan.recompute.num_layers):
            e = estimate(model, replace(plan, ckpt=Ckpt.OURS, recompute=Recompute("full", "block", n)), system,
                         memory_budget_bytes=kw["memory_budget_bytes"],
                         host_memory_budget_bytes=kw["host_memory_budget_bytes"], timeline=False)
            twins += [(plan.micro_batch_size, n)] if e.peak_memory_bytes <= kw["memory_budget_bytes"] \
                and not e.host_fits else []
    assert twins == [(4, 2)]


def test_a_per_stage_alpha_searches_its_pipeline_size_only():
    """One alpha per stage fixes p: the search refuses it otherwise (a ValueError naming the constraint, where an
    IndexError escaped from a layout of another p), and with that p its best-first top (each candidate's exposed
    copies counted stage by stage) is the exhaustive one."""
    model, system = get_model("llama-7b"), get_system("b200")
    kw = dict(num_gpus=8, seq_length=4096, global_batch_size=32, alpha_mode=(1.0, 0.25))
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size = 2 \(got None\)"):
        search(model, system, top=3, **kw)
    kw["constraints"] = SearchConstraints(pipeline_model_parallel_size=2)
    full, best = search(model, system, exhaustive=True, **kw), search(model, system, top=5, **kw)
    assert best.considered < full.considered
    assert [(r.plan, r.tokens_per_second) for r in best.plans[:5]] == [(r.plan, r.tokens_per_second)
                                                                       for r in full.plans[:5]]
    assert all(r.plan.offload_alpha == (1.0, 0.25) for r in full.plans)


def _random_search_case(rng: random.Random) -> tuple:
    """One small search: a 7B-13B model on 8 or 16 GPUs of four kinds, a device and a host budget or none, a fixed
    or a solved alpha, with or without the memory ladder and FP8."""
    gpu = rng.choice(["h800", "a100-80g", "b200", "a100-40g"])
    kw = dict(num_gpus=rng.choice([8, 16]), seq_length=rng.choice([2048, 4096, 8192]),
              global_batch_size=rng.choice([16, 32, 64]), alpha_mode=rng.choice([0.5, 1.0, 0.25, "auto", "balanced"]),
              host_memory_budget_bytes=rng.choice([None, 100 * 2**30, 200 * 2**30, 400 * 2**30]),
              memory_budget_bytes=rng.choice([None, 20 * 2**30, 30 * 2**30, 40 * 2**30]),
              constraints=SearchConstraints(memory_ladder=space.MEMORY_LADDER if rng.random() < 0.5 else (),
                                            precisions=("bf16", "fp8") if gpu in ("h800", "b200") else ("bf16",)))
    return rng.choice(["llama-7b", "llama2-7b", "llama2-13b", "llama3-8b"]), gpu, kw


def test_random_best_first_searches_have_the_exhaustive_top():
    """Twelve small searches drawn with a fixed seed across budgets, alphas, the ladder and FP8: the best-first top
    ten is the exhaustive search's. (The same check over 150 draws found the block-candidate pruning above, in one;
    0 of 400 since. These twelve fail where a group's bound counts ckpt no's offload.)"""
    rng = random.Random("best-first")
    for _ in range(12):
        name, gpu, kw = _random_search_case(rng)
        model, system = get_model(name), get_system(gpu)
        full, best = search(model, system, exhaustive=True, **kw), search(model, system, top=10, **kw)
        assert best.considered <= full.considered
        assert ([(r.plan, r.tokens_per_second) for r in best.plans[:10]]
                == [(r.plan, r.tokens_per_second) for r in full.plans[:10]]), (name, gpu, kw)


def _tight_searches_with_the_ladder(budget=20 * 10**9, alpha_mode="auto"):
    """llama-7b on 8 H800 at a 20 GB budget with the memory ladder: (the exhaustive search, the best-first top 10)."""
    model, system = get_model("llama-7b"), get_system("h800")
    kw = dict(num_gpus=8, seq_length=4096, global_batch_size=16, memory_budget_bytes=budget, alpha_mode=alpha_mode,
              constraints=SearchConstraints(memory_ladder=space.MEMORY_LADDER))
    return search(model, system, exhaustive=True, **kw), search(model, system, top=10, **kw)


def test_best_first_with_the_memory_ladder_is_the_exhaustive_top(monkeypatch):
    """With the memory ladder every option of a plan that needs offload is a plan of its own; the best-first search
    leaves unpriced the variants whose own bound (an FSDP sharding's all-gathers and reduce-scatters in its
    data-parallel term) cannot enter the top, and its top is still the exhaustive one."""
    search_module = importlib.import_module("h3t_ext.planner.search")
    price, skipped = search_module._price, []

    def counting(col, model, system, plan, alpha_mode, budget, can_enter=None, *rest):
        def counted(variant):
            ok = can_enter(variant)
            skipped.append(not ok)
            return ok
        return price(col, model, system, plan, alpha_mode, budget, None if can_enter is None else counted, *rest)

    monkeypatch.setattr(search_module, "_price", counting)
    full, best = _tight_searches_with_the_ladder()
    assert sum(skipped) > 50 and best.considered < full.considered / 2
    assert ([(r.plan, r.tokens_per_second) for r in best.plans[:10]]
            == [(r.plan, r.tokens_per_second) for r in full.plans[:10]])
    assert any(r.plan.data_parallel_sharding_strategy or r.plan.optimizer_cpu_offload for r in full.plans[:10])


def _rung_of(plan):
    """The rung of the memory ladder a plan stands on."""
    search_module = importlib.import_module("h3t_ext.planner.search")
    if plan.data_parallel_sharding_strategy is None and not plan.optimizer_cpu_offload:
        return search_module.BASE_RUNG
    return space.MemoryOption(plan.data_parallel_sharding_strategy, plan.optimizer_cpu_offload)


def _off_the_ladder(plan):
    """A plan without its offload ratio and its rung's options: what one candidate's variants share."""
    return replace(plan, offload_alpha=0.0, data_parallel_sharding_strategy=None, optimizer_cpu_offload=False,
                   optimizer_offload_fraction=1.0)


@pytest.mark.parametrize("alpha_mode", ["auto", 0.5])
def test_a_rung_is_left_only_where_no_candidate_of_its_layout_fits(monkeypatch, alpha_mode):
    """The best-first search stops pricing a layout's candidates on a rung of the memory ladder (the plan as it is,
    an FSDP sharding, optimizer offload) once the layout's least-memory candidate fits nowhere there (at any alpha, or
    at the search's fixed one): the exhaustive search finds no feasible plan of that layout on any such rung, and does
    find them on the others."""
    search_module = importlib.import_module("h3t_ext.planner.search")
    made = []

    class Recorded(search_module._DeadRungs):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(search_module, "_DeadRungs", Recorded)
    full, best = _tight_searches_with_the_ladder(alpha_mode=alpha_mode)

    def layout_of(plan):  # what the candidates of one layout share
        return replace(_off_the_ladder(plan), micro_batch_size=1, ckpt=Ckpt.NO, recompute=NO_RECOMPUTE)

    rung_of = _rung_of
    fitting = {(layout_of(r.plan), rung_of(r.plan)) for r in full.plans}
    rungs = (search_module.BASE_RUNG, *space.MEMORY_LADDER)
    dead = {(layout_of(d.least), r) for d in made for r in d.dead}
    live = {(layout_of(d.least), r) for d in made for r in rungs if r not in d.dead}
    assert len(dead) > 40 and {r for _, r in dead} == set(rungs)
    assert not dead & fitting and live & fitting
    assert ([(r.plan, r.tokens_per_second) for r in best.plans[:10]]
            == [(r.plan, r.tokens_per_second) for r in full.plans[:10]])


def test_a_candidate_is_left_on_a_rung_where_one_that_keeps_no_more_fits_nowhere(monkeypatch):
    """On a rung of the memory ladder where a candidate fits nowhere, the best-first search does not price the same
    layout's candidates that keep at least as much (a larger micro batch, a mode that keeps more): the exhaustive
    search finds none of them fitting on that rung."""
    search_module = importlib.import_module("h3t_ext.planner.search")
    price, left = search_module._price, []

    def recording(col, model, system, plan, alpha_mode, budget, can_enter=None, rungs=None, tried=None):
        if tried is not None:
            covered = tried.covered
            tried.covered = lambda rung: covered(rung) and not left.append((_off_the_ladder(plan), rung))
        return price(col, model, system, plan, alpha_mode, budget, can_enter, rungs, tried)

    monkeypatch.setattr(search_module, "_price", recording)
    for alpha_mode in ("auto", 0.5):
        left.clear()
        full, best = _tight_searches_with_the_ladder(alpha_mode=alpha_mode)
        fitting = {(_off_the_ladder(r.plan), _rung_of(r.plan)) for r in full.plans}
        assert len(left) > 20 and not set(left) & fitting
        assert ([(r.plan, r.tokens_per_second) for r in best.plans[:10]]
                == [(r.plan, r.tokens_per_second) for r in full.plans[:10]])


@pytest.mark.parametrize("budget,alpha_mode", [(5.2e9, "auto"), (5.2e9, 0.5), (5.4e9, "auto"), (5.6e9, "auto")])
def test_a_search_with_fewer_plans_than_its_top_names_the_exhaustive_closest(budget, alpha_mode):
    """Where fewer plans fit than ``top`` (none at 5.2 GB), no bound stops the best-first search, so what it prunes
    fits nowhere: the closest to fitting it names is the exhaustive search's (a layout's least-memory candidate, checked
    on a rung where it fits nowhere, is the layout's closest there), after pricing a fraction of its plans."""
    full, best = _tight_searches_with_the_ladder(int(budget), alpha_mode)
    assert len(best.plans) == len(full.plans) < 10
    assert best.closest_infeasible.excess_bytes == full.closest_infeasible.excess_bytes
    assert best.considered < full.considered / 5


def test_top_does_not_change_the_plans_shown():
    """The timeline re-ranks the closed form's first plans (up to TIMELINE_CAP of them), so the best-first search
    goes at least that deep whatever --top asks: --top k shows the first k plans of --top 10. Searched only as deep as
    the three plans the timeline re-ranks first, --top 1 and 3 here put first a plan the closed form ranks below ten
    others (the timeline prices it 1.5% faster), and --top 10 does not show it at all."""
    model, system = get_model("llama2-13b"), get_system("a100-40g")
    kw = dict(num_gpus=16, seq_length=4096, global_batch_size=512,
              constraints=SearchConstraints(memory_ladder=space.MEMORY_LADDER))
    ten = [(r.plan, r.tokens_per_second) for r in search(model, system, top=10, **kw).plans[:10]]
    for k in (1, 3, 5):
        assert [(r.plan, r.tokens_per_second) for r in search(model, system, top=k, **kw).plans[:k]] == ten[:k]


def test_search_agrees_with_estimate_and_alpha_is_minimal(small_search):
    model, system = get_model("llama-7b"), get_system("h800")
    for r in small_search.plans[:: max(1, len(small_search.plans) // 15)]:
        # the search's best TIMELINE_TOP plans carry the timeline, the rest the closed form it prunes with
        est = estimate(model, r.plan, system, timeline=r.evaluation.estimate.timeline is not None)
        assert est.tokens_per_second == pytest.approx(r.tokens_per_second)
        alpha = r.plan.offload_alpha
        if alpha > 0:
            assert not estimate(model, r.plan.with_alpha(round(alpha - 0.001, 3)), system).fits


def test_search_tight_budget_offloads_and_no_budget_reports_closest():
    model, system = get_model("llama-7b"), get_system("h800")
    tight = search(model, system, num_gpus=8, seq_length=4096, global_batch_size=16, memory_budget_bytes=20 * 10**9)
    assert tight.plans and all(r.evaluation.estimate.peak_memory_bytes <= 20 * 10**9 for r in tight.plans)
    assert any(r.plan.offload_alpha > 0 for r in tight.plans)
    none = search(model, system, num_gpus=8, seq_length=4096, global_batch_size=16, memory_budget_bytes=2 * 10**9)
    assert none.plans == ()
    c = none.closest_infeasible
    assert c is not None and c.excess_bytes > 0 and c.term
    assert sum(n for k, n in none.rejected.items() if k.startswith("memory")) > 0


def test_search_balanced_never_moves_more_pcie_bytes():
    model, system = get_model("llama-7b"), get_system("h800")
    res = search(model, system, num_gpus=8, seq_length=4096, global_batch_size=16, memory_budget_bytes=20 * 10**9,
                 alpha_mode="balanced", constraints=SearchConstraints(ckpt="no"))
    assert res.plans
    for r in res.plans:
        assert r.evaluation.pcie_bytes_saved_vs_auto is not None and r.evaluation.pcie_bytes_saved_vs_auto >= 0
        assert max(r.plan.alphas()) == pytest.approx(max(r.evaluation.auto_estimate.offload_alpha))


PLANS = [
    Plan(num_gpus=256, seq_length=4096, global_batch_size=256, tensor_model_parallel_size=2,
         pipeline_model_parallel_size=8, num_layers_per_virtual_pipeline_stage=2, ckpt="ours", offload_alpha=0.162),
    Plan(num_gpus=64, seq_length=8192, global_batch_size=64, micro_batch_size=2, context_parallel_size=4,
         pipeline_model_parallel_size=4, ckpt="full", offload_alpha=(0.1, 0.25, 0.0, 1.0), overlap_grad_reduce=True),
    Plan(num_gpus=8, seq_length=2048, global_batch_size=16, ckpt="no", offload_alpha=0.12345,
         overlap_param_gather=True),
    Plan(num_gpus=64, seq_length=4096, global_batch_size=64, tensor_model_parallel_size=4, ckpt="ours",
         data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True),
    Plan(num_gpus=64, seq_length=4096, global_batch_size=64, tensor_model_parallel_size=2,
         pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=2, overlap_p2p_comm=False),
    # the search's recompute choices: block N on ours and on no, selective core_attn on no and on ours
    Plan(num_gpus=8, seq_length=4096, global_batch_size=16, tensor_model_parallel_size=2,
         pipeline_model_parallel_size=4, ckpt="ours", recompute=Recompute("full", "block", 3)),
    Plan(num_gpus=8, seq_length=4096, global_batch_size=16, pipeline_model_parallel_size=2, ckpt="no",
         recompute=Recompute("full", "block", 5), offload_alpha=0.25),
    Plan(num_gpus=8, seq_length=4096, global_batch_size=16, ckpt="selective", attention_backend="unfused"),
    Plan(num_gpus=8, seq_length=4096, global_batch_size=16, ckpt="ours", recompute=SELECTIVE_CORE_ATTN,
         attention_backend="unfused"),
]


@pytest.mark.parametrize("plan", PLANS)
def test_megatron_flags_round_trip(plan):
    flags = megatron_flags(plan)
    assert plan_from_megatron_flags(flags, num_gpus=plan.num_gpus, seq_length=plan.seq_length) == plan
    assert ("--sequence-parallel" in flags) == (plan.tensor_model_parallel_size > 1)
    assert "--use-distributed-optimizer" in flags


def test_a_megatron_fsdp_plans_flags_carry_the_checkpoint_format_megatron_lm_requires():
    """Megatron-LM 0.16-0.19's validate_args asserts --ckpt-format fsdp_dtensor with --use-megatron-fsdp; the printed
    line carries it (and reads back), and the reader refuses it where the writer never puts it."""
    plan = next(p for p in PLANS if p.data_parallel_sharding_strategy)
    flags = megatron_flags(plan)
    i = flags.index("--use-megatron-fsdp")
    assert flags[i:i + 5] == ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                              "--ckpt-format", "fsdp_dtensor"]
    assert "--ckpt-format" not in megatron_flags(PLANS[0])  # no Megatron FSDP: Megatron's default format
    with pytest.raises(ValueError, match="unexpected --ckpt-format torch_dist"):
        plan_from_megatron_flags([*megatron_flags(PLANS[0]), "--ckpt-format", "torch_dist"], num_gpus=64,
                                 seq_length=4096)


def test_megatron_flags_published_example():
    assert megatron_flags(PLANS[0]) == (
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 8 --num-layers-per-virtual-pipeline-stage 2 "
        "--sequence-parallel --use-distributed-optimizer --ckpt ours --offload-alpha 0.162 --micro-batch-size 1 "
        "--global-batch-size 256").split()


def test_alpha_text():
    assert format_alpha(0.162) == "0.162" and format_alpha(0.0) == "0.000"
    assert OffloadAlpha.parse(format_alpha((0.1, 0.2))).alpha == (0.1, 0.2)
    with pytest.raises(ValueError):
        OffloadAlpha.parse("1.2")


@pytest.mark.parametrize("text,value", [("85899345920", 85899345920), ("78GB", 78 * 10**9), ("72GiB", 72 * 2**30),
                                        ("7.5e10", 75 * 10**9), ("512 MiB", 512 * 2**20), ("1tb", 10**12)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GB", "12XB", "-5GB", "0"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_ties_with_the_best_are_the_plans_inside_its_interval():
    from h3t_ext.costmodel.uncertainty import throughput_uncertainty
    from h3t_ext.planner.search import search
    from h3t_ext.costmodel import get_model, get_system
    result = search(get_model("llama2-7b"), get_system("h100-sxm"), num_gpus=8, seq_length=4096,
                    global_batch_size=64, top=50)
    assert len(result.plans) > 2
    tps = [r.evaluation.estimate.tokens_per_second for r in result.plans]
    w = throughput_uncertainty().relative_half_width
    tied = result.tied_with_best()
    assert tied[0] == 0 and tied == tuple(i for i, x in enumerate(tps) if x >= tps[0] * (1 - w))
    assert result.tied_with_best(0.0) == tuple(i for i, x in enumerate(tps) if x == tps[0])
    assert len(tied) < len(tps)  # the interval does not swallow every plan


@pytest.mark.parametrize("model_name,precisions", [("llama-7b", ("bf16", "fp8")), ("gpt3-175b", ("bf16",))])
def test_best_first_group_bounds_hold_their_candidates(model_name, precisions):
    """The best-first queue takes candidates in the order of their own bounds only if a layout's bound is at least
    each of its micro batches' group bound, and that at least each of their ckpts' bound (ckpt no has the
    smallest layer time: the other modes add recompute terms)."""
    search_mod = importlib.import_module("h3t_ext.planner.search")  # the package exports search() by that name
    model, system = get_model(model_name), get_system("h800")
    k = SearchConstraints(precisions=precisions)
    layouts, _ = enumerate_layouts(model, num_gpus=16, seq_length=4096, global_batch_size=32, gpus_per_node=8,
                                   constraints=k)
    switches = {"sequence_parallel": True, "use_distributed_optimizer": True}
    live = [(run, x) for run in search_mod._runs(16, 4096, 32, switches, k) for x in layouts]
    bounds = Bounds(model, system, live, space.CKPT_BY_MEMORY)
    assert bounds.grouped and len(live) > 20
    strict = 0
    for li, (_, layout) in enumerate(live):
        top = bounds.layout(li)
        for i in range(len(layout.micro_batch_sizes)):
            group = bounds.group(li, i)
            own = [bounds.bound(li, ci, i) for ci in range(3)]
            assert top >= group >= max(own) and group == own[2]  # ckpt no (index 2) is the group's bound
            strict += own[0] < group
    assert strict > 0  # full recompute's bound is below the group's somewhere (the grouping skips work)


LADDER_OPTIONS = (dict(data_parallel_sharding_strategy="optim_grads_params"), dict(data_parallel_sharding_strategy="optim"),
                  dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5))


@pytest.mark.parametrize("alpha", [1.0, 0.25])
def test_a_fixed_alphas_bound_counts_each_candidates_own_offload_exactly(alpha):
    """At a fixed alpha a candidate's bound adds its own closed-form offload_exposed once counted (as it comes out of
    the search's queue): it stays at least the candidate's closed-form tokens/s (the search's ranking), and the time
    it adds is that term exactly; a group's and
    a layout's bounds leave it out (it depends on the mode: ckpt no's own is the largest), so they still hold every
    candidate's. (A group bound with ckpt no's offload pruned the best plans of llama3-70b on 512 B200 at alpha 1.)"""
    search_mod = importlib.import_module("h3t_ext.planner.search")
    model, system = get_model("llama-7b"), get_system("b200")
    k = SearchConstraints()
    layouts, _ = enumerate_layouts(model, num_gpus=16, seq_length=4096, global_batch_size=64, gpus_per_node=8,
                                   constraints=k)
    switches = {"sequence_parallel": True, "use_distributed_optimizer": True}
    live = [(run, x) for run in search_mod._runs(16, 4096, 64, switches, k) for x in layouts]
    plain, fixed = Bounds(model, system, live, space.CKPT_BY_MEMORY), Bounds(model, system, live, space.CKPT_BY_MEMORY,
                                                                              alpha)
    tokens = 64 * 4096
    exposed = checked = variants = 0
    for li, (run, layout) in enumerate(live):
        for i, mb in enumerate(layout.micro_batch_sizes):
            uncounted = [fixed.bound(li, ci, i) for ci in range(3)]
            lowered = [fixed.count_offload(li, ci, i) for ci in range(3)]
            own = [fixed.bound(li, ci, i) for ci in range(3)]
            assert uncounted == [plain.bound(li, ci, i) for ci in range(3)]
            assert [b < u for b, u in zip(own, uncounted)] == lowered
            assert fixed.layout(li) >= fixed.group(li, i) == plain.group(li, i) >= max(own)
            for ci, mode in enumerate(fixed.modes):
                plan = replace(bounds_candidate(run, layout, mb, mode), offload_alpha=alpha)
                try:
                    closed = estimate(model, plan, system, timeline=False)
                except InvalidPlanError:
                    continue
                checked += 1
                assert own[ci] * (1 + 1e-9) >= closed.tokens_per_second
                added = tokens / own[ci] - tokens / plain.bound(li, ci, i)
                assert added == pytest.approx(closed.time_terms.offload_exposed, rel=1e-9, abs=1e-12)
                exposed += closed.time_terms.offload_exposed > 0
                for option in LADDER_OPTIONS:  # Bounds.variant counts the candidate's term for its ladder variants
                    try:
                        variant = estimate(model, replace(plan, **option), system, timeline=False)
                    except InvalidPlanError:
                        continue
                    variants += 1
                    assert variant.time_terms.offload_exposed == closed.time_terms.offload_exposed
    assert checked > 100 and exposed > checked // 4  # the term is there to count, on both sides of the window
    assert variants > checked


def test_best_first_with_one_ckpt_is_the_exhaustive_top():
    model, system = get_model("llama-7b"), get_system("h800")
    kw = dict(num_gpus=8, seq_length=4096, global_batch_size=16, constraints=SearchConstraints(ckpt="full"))
    full = search(model, system, exhaustive=True, **kw)
    best = search(model, system, top=5, **kw)
    assert best.considered < full.considered
    assert [(r.plan, r.tokens_per_second) for r in best.plans[:5]] == [(r.plan, r.tokens_per_second)
                                                                        for r in full.plans[:5]]


@pytest.mark.parametrize("model_name,num_gpus,seq_length,global_batch_size,budget", [
    ("llama2-7b", 8, 4096, 64, 24 * 10**9), ("llama3-8b", 8, 8192, 32, 30 * 10**9)])
def test_top_does_not_change_which_plan_comes_first(model_name, num_gpus, seq_length, global_batch_size, budget):
    """The timeline re-ranks the closed form's best three; a best-first search for fewer kept fewer, so --top 1 gave
    another (1.4-1.7% slower) plan than --top 3's first in these two runs. It now keeps at least the three."""
    model, system = get_model(model_name), get_system("h100-sxm")
    kw = dict(num_gpus=num_gpus, seq_length=seq_length, global_batch_size=global_batch_size, memory_budget_bytes=budget)
    firsts = [search(model, system, top=top, **kw).plans[0] for top in (1, 2, 3)]
    assert firsts[0].plan == firsts[1].plan == firsts[2].plan
    assert firsts[0].evaluation.estimate.timeline is not None  # priced on the timeline, as the first plan always is


def test_where_the_states_live_is_said_in_the_plan_line_and_the_table(small_search):
    """states_label names Megatron FSDP's strategy, torch FSDP2, the distributed optimizer or plain DDP, and CPU Adam's
    fraction; the search table shows a states column only when a printed plan is not the distributed optimizer (a
    Megatron FSDP plan was listed without it before, its choice only in the flags), and estimate's plan line always."""
    from dataclasses import replace

    from h3t_ext.planner.format import evaluation_dict, no_plan_message, search_table, states_label

    base = Plan(num_gpus=8, seq_length=4096, global_batch_size=16)
    assert states_label(base) == "dist-opt"
    assert states_label(replace(base, use_distributed_optimizer=False)) == "ddp"
    assert states_label(replace(base, data_parallel_sharding_strategy="optim_grads")) == "fsdp=optim_grads"
    assert states_label(replace(base, use_distributed_optimizer=False, use_torch_fsdp2=True)) == "torch-fsdp2"
    assert states_label(replace(base, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)) == \
        "dist-opt+cpu-adam=0.5"
    columns = lambda result: [c.header for c in search_table(result, 3).columns]  # noqa: E731
    assert "states" not in columns(small_search)
    sharded = search(get_model("gpt3-175b"), get_system("a100-80g"), num_gpus=32, seq_length=2048,
                     global_batch_size=512, constraints=SearchConstraints(memory_ladder=space.MEMORY_LADDER))
    assert sharded.plans and all(states_label(r.plan) != "dist-opt" for r in sharded.plans[:3])
    table = search_table(sharded, 3)
    assert "states" in columns(sharded)
    cells = table.columns[[c.header for c in table.columns].index("states")]._cells
    assert cells == [states_label(r.plan) for r in sharded.plans[:3]]
    d = evaluation_dict(sharded.plans[0].evaluation)  # --json: the same choice in Megatron's field names
    best = sharded.plans[0].plan
    assert (d["data_parallel_sharding_strategy"], d["optimizer_cpu_offload"], d["optimizer_offload_fraction"],
            d["use_distributed_optimizer"], d["use_torch_fsdp2"]) == (
        best.data_parallel_sharding_strategy, best.optimizer_cpu_offload, best.optimizer_offload_fraction,
        best.use_distributed_optimizer, False)
    none = search(get_model("gpt3-175b"), get_system("a100-40g"), num_gpus=16, seq_length=2048, global_batch_size=512,
                  constraints=SearchConstraints(memory_ladder=space.MEMORY_LADDER))
    assert not none.plans  # the message names the closest plan's states the same way
    assert f" states={states_label(none.closest_infeasible.plan)}:" in no_plan_message(none)
