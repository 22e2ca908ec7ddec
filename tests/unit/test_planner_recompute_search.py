"""The search's recompute axis: Megatron's block recompute with the smallest N that fits, selective core_attn with
unfused attention, the pruning relation between modes, and the flags of the plans it picks."""
from __future__ import annotations

from dataclasses import replace

import pytest

from h3t_ext.ckpt import SELECTIVE_CORE_ATTN, Ckpt, Recompute
from h3t_ext.costmodel import Plan, estimate, get_model, get_system
from h3t_ext.planner.flags import megatron_flags, plan_from_megatron_flags
from h3t_ext.planner.format import evaluation_dict, recompute_label
from h3t_ext.planner.recompute_modes import (R_BLOCK_NONE, R_BLOCK_UNNEEDED, RecomputeMode, search_modes,
                                             smallest_block_layers)
from h3t_ext.planner.search import search
from h3t_ext.planner.space import SearchConstraints

MODEL, SYSTEM = get_model("llama-7b"), get_system("h800")
BUDGET = 20 * 10**9
"""Between ckpt full's peak (17.2 GB) and ckpt ours's (24.6 GB; no: 28.0 GB) of the layout below, at alpha 0."""
LAYOUT = SearchConstraints(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, micro_batch_size=1,
                           num_layers_per_virtual_pipeline_stage=4)
"""t=2 p=4 l=4 (v=2: model chunks of 4 layers), micro batch 1, 16 microbatches."""
RUN = dict(num_gpus=8, seq_length=4096, global_batch_size=16, memory_budget_bytes=BUDGET)


def _fits(plan: Plan) -> bool:
    return estimate(MODEL, plan, SYSTEM, memory_budget_bytes=BUDGET, timeline=False).fits


def test_block_recompute_with_the_smallest_n_that_fits_is_the_best_plan():
    """No offload (alpha 0): ckpt no and ours do not fit, full fits but reruns every layer; block recompute of the
    first N layers of every chunk fits and is faster, with N the smallest that fits. On ckpt no it beats ours: both
    need N = 3 here, and with megatron-core's fused SwiGLU ckpt=ours saves too little on the other layers (1.41x) to
    pay for its recompute of the norms and activation (ours would need fewer block layers to win)."""
    result = search(MODEL, SYSTEM, constraints=LAYOUT, alpha_mode=0.0, top=3, **RUN)
    best = result.best.plan
    n = best.recompute.num_layers
    assert best.ckpt is Ckpt.NO and best.recompute == Recompute("full", "block", n) and 1 < n < 4
    runner_up = result.plans[1].plan
    assert runner_up.ckpt is Ckpt.OURS and runner_up.recompute == best.recompute
    assert _fits(best) and not _fits(replace(best, recompute=Recompute("full", "block", n - 1)))
    assert not _fits(replace(best, recompute=Recompute())) and not _fits(replace(best, ckpt="no", recompute=Recompute()))
    full = replace(best, ckpt="full", recompute=Recompute())
    assert _fits(full)
    full_tps = estimate(MODEL, full, SYSTEM, memory_budget_bytes=BUDGET).tokens_per_second
    assert result.best.tokens_per_second > full_tps * 1.02  # the cost model's own numbers: 52.4k vs 49.2k tokens/s
    flags = result.best.megatron_flags
    assert " ".join(flags).count(f"--ckpt no --recompute-granularity full --recompute-method block "
                                 f"--recompute-num-layers {n} ") == 1
    assert plan_from_megatron_flags(flags, num_gpus=8, seq_length=4096) == best
    d = evaluation_dict(result.best.evaluation)
    assert d["recompute"] == f"no+block({n})" == recompute_label(best)
    assert (d["recompute_granularity"], d["recompute_method"], d["recompute_num_layers"]) == ("full", "block", n)
    exhaustive = search(MODEL, SYSTEM, constraints=LAYOUT, alpha_mode=0.0, exhaustive=True, **RUN)
    assert [(r.plan, r.tokens_per_second) for r in exhaustive.plans[:3]] == [(r.plan, r.tokens_per_second)
                                                                              for r in result.plans[:3]]


@pytest.mark.parametrize("ckpt,budget", [("ours", 18 * 10**9), ("ours", 20 * 10**9), ("no", 19 * 10**9),
                                         ("no", 21 * 10**9), ("no", 30 * 10**9), ("ours", 16 * 10**9)])
def test_smallest_block_layers_is_a_linear_scans_first_fit(ckpt, budget):
    """The bisection finds the first N of a scan N = 1, 2, ... that estimate() says fits (or says why none)."""
    plan = Plan(num_gpus=8, seq_length=4096, global_batch_size=16, tensor_model_parallel_size=2,
                pipeline_model_parallel_size=4, ckpt=ckpt)  # chunks of 8 layers
    choice = smallest_block_layers(MODEL, SYSTEM, plan, alpha_mode=0.0, memory_budget_bytes=budget)
    fits = [estimate(MODEL, replace(plan, recompute=Recompute("full", "block", n)) if n else plan, SYSTEM,
                     memory_budget_bytes=budget, timeline=False).fits for n in range(8)]
    if fits[0]:
        assert choice.reason == R_BLOCK_UNNEEDED
    elif not any(fits):
        assert choice.reason == R_BLOCK_NONE
    else:
        assert choice.num_layers == fits.index(True) and all(fits[choice.num_layers:])


def test_pruning_relation_between_modes():
    full, ours, no = (RecomputeMode(Ckpt(c)) for c in ("full", "ours", "no"))
    block_ours, block_no = RecomputeMode(Ckpt.OURS, block=True), RecomputeMode(Ckpt.NO, block=True)
    sel = RecomputeMode(Ckpt.SELECTIVE)
    assert all(m.fails_where(full) for m in (full, ours, no, block_ours, block_no, sel))
    assert no.fails_where(ours) and not ours.fails_where(no) and block_no.fails_where(block_ours)
    # "no N fits without offload" says nothing of a plan that offloads, and the other way round
    assert not ours.fails_where(block_ours) and not block_no.fails_where(no)
    assert not no.fails_where(sel) and not sel.fails_where(no)


def test_selective_core_attn_is_searched_with_unfused_attention_only():
    assert all(not m.selective for m in search_modes(None, "flash"))
    assert {m for m in search_modes(None, "unfused") if m.selective} == {
        RecomputeMode(Ckpt.SELECTIVE), RecomputeMode(Ckpt.OURS, SELECTIVE_CORE_ATTN)}
    assert search_modes("full", "unfused") == (RecomputeMode(Ckpt.FULL),)
    k = SearchConstraints(attention_backend="unfused")
    result = search(MODEL, SYSTEM, num_gpus=8, seq_length=4096, global_batch_size=16, memory_budget_bytes=30 * 10**9,
                    alpha_mode=0.0, constraints=k, top=5)
    chosen = [r for r in result.plans[:5] if r.plan.recompute == SELECTIVE_CORE_ATTN or r.plan.ckpt is Ckpt.SELECTIVE]
    assert chosen
    for r in chosen:
        assert "--recompute-granularity selective --recompute-modules core_attn" in " ".join(r.megatron_flags)
        assert "--ckpt selective" not in " ".join(r.megatron_flags)  # the driver takes Megatron's flags
        assert plan_from_megatron_flags(r.megatron_flags, num_gpus=8, seq_length=4096) == r.plan
