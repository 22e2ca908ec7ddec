"""An FP8 plan's BF16 first and last layers (Megatron's --first-last-layers-bf16, --num-layers-at-start-in-bf16,
--num-layers-at-end-in-bf16): which layers they are (megatron-core's own rule), and what they cost on the ranks
and model chunks that hold them, in time and in memory."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from h3t_ext.costmodel import InvalidPlanError, ModelSpec, Plan, estimate, get_system, validate_plan
from h3t_ext.costmodel.activations import layer_kept_bytes
from h3t_ext.costmodel.fp8 import gemm_weight_params, WEIGHT_CACHE_BYTES
from h3t_ext.costmodel.memory import stage_memory
from h3t_ext.costmodel.timeline import plan_timeline
from h3t_ext.costmodel.timing import shape_times, slowest_stage, stage_microbatch_seconds
from h3t_ext.planner.flags import megatron_flags, plan_from_megatron_flags

H100 = get_system("h100-sxm")
# 16 layers of Llama-3 8B's width: FP8's GEMMs save more than its casts cost (at h 1024 they would not)
MODEL = ModelSpec(name="l3-16", num_layers=16, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                  ffn_hidden_size=14336, vocab_size=128256)
FP8 = Plan(num_gpus=1, seq_length=2048, global_batch_size=4, fp8="hybrid", fp8_recipe="tensorwise")


def _bf16(plan: Plan, start: int = 1, end: int = 1) -> Plan:
    return replace(plan, first_last_layers_bf16=True, num_layers_at_start_in_bf16=start,
                   num_layers_at_end_in_bf16=end)


SPLITS = [
    dict(pipeline_model_parallel_size=1),
    dict(pipeline_model_parallel_size=4),
    dict(pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=1),
    dict(pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=2),
    dict(pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=2, decoder_last_pipeline_num_layers=6),
    dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et*3|t*5|t*5|t*3L"),
]


@pytest.mark.parametrize("split", SPLITS, ids=[str(i) for i in range(len(SPLITS))])
@pytest.mark.parametrize("start, end", [(1, 1), (3, 0), (0, 4), (4, 4)])
def test_the_bf16_layers_of_each_chunk_are_megatron_cores(split, start, end):
    """Every chunk's count is megatron-core's fp8_utils.is_first_last_bf16_layer over the layers the chunk builds
    (global numbers, PipelineSplit.layer_offset): with interleaving the first layers reach the second rank."""
    from megatron.core.fp8_utils import is_first_last_bf16_layer
    p = split["pipeline_model_parallel_size"]
    plan = _bf16(replace(FP8, num_gpus=p, **split), start, end)
    config = SimpleNamespace(first_last_layers_bf16=True, num_layers_at_start_in_bf16=start,
                             num_layers_at_end_in_bf16=end, num_layers=MODEL.num_layers)
    s = plan.pipeline_split(MODEL.num_layers)
    total = 0
    for r in range(p):
        want = tuple(sum(is_first_last_bf16_layer(config, s.layer_offset(r, c) + i)
                         for i in range(s.chunk_layers(r, c)))
                     for c in range(s.virtual_pipeline_model_parallel_size))
        assert plan.chunk_bf16_layers(MODEL.num_layers, r) == want
        assert plan.stage_fp8_layers(MODEL.num_layers, r) == s.stage_layers(r) - sum(want)
        total += sum(want)
    assert total == start + end


def test_at_pipeline_size_1_the_iteration_is_the_layer_mix():
    """p = 1: each of the N BF16 layers adds one BF16 layer's time less one FP8 layer's, so the layers' part of the
    iteration moves N / L of the way from the all-FP8 plan to the all-BF16 plan (the output layer is BF16 in both)."""
    n, L = 3, MODEL.num_layers
    mixed, fp8_all, bf16_all = (estimate(MODEL, x, H100) for x in (_bf16(FP8, 2, 1), FP8, replace(FP8, fp8=None)))
    for term in ("compute", "recompute", "tp_comm"):
        a, b, c = (getattr(e.time_terms, term) for e in (mixed, fp8_all, bf16_all))
        assert a == pytest.approx(b + n / L * (c - b), rel=1e-12, abs=1e-15)
    assert mixed.time_terms.compute > fp8_all.time_terms.compute * (1 + 0.5 * n / L * 0.1)
    # counts of 0 are the all-FP8 plan exactly
    assert estimate(MODEL, _bf16(FP8, 0, 0), H100).iteration_time_s == fp8_all.iteration_time_s


def test_the_timeline_prices_each_chunk_with_its_own_layers():
    """p 4, v 2 (two layers a chunk), 3 BF16 layers at the start: chunk 0 of rank 0 holds two, chunk 0 of rank 1
    one; their forward actions are the FP8 chunk's plus the BF16 layers' extra, the other chunks unchanged, and the
    slower first ranks make the iteration longer."""
    base = replace(FP8, num_gpus=4, global_batch_size=16, pipeline_model_parallel_size=4,
                   num_layers_per_virtual_pipeline_stage=2)
    plan = _bf16(base, 3, 0)
    assert [plan.chunk_bf16_layers(MODEL.num_layers, r) for r in range(4)] == [(2, 0), (1, 0), (0, 0), (0, 0)]
    st = shape_times(MODEL, plan, H100)
    extra = st.bf16_layer.forward_action - st.layer.forward_action
    assert extra > 0
    with_bf16, without = plan_timeline(MODEL, plan, H100), plan_timeline(MODEL, base, H100)
    assert with_bf16.iteration_time_s > without.iteration_time_s
    e, e0 = estimate(MODEL, plan, H100), estimate(MODEL, base, H100)
    assert e.closed_form_time_s > e0.closed_form_time_s
    # each rank's microbatch grows by its BF16 layers' extra; the closed form's compute is its slowest rank's
    one = (st.bf16_layer.fwd + st.bf16_layer.bwd) - (st.layer.fwd + st.layer.bwd)
    for r, b in enumerate((2, 1, 0, 0)):
        assert stage_microbatch_seconds(MODEL, plan, H100, r) - stage_microbatch_seconds(MODEL, base, H100, r) == \
            pytest.approx(b * (st.bf16_layer.total - st.layer.total), rel=1e-9, abs=1e-15)
    slow, m = slowest_stage(MODEL, plan, H100), plan.num_microbatches
    assert e.closed_form.compute == pytest.approx(
        m * (plan.stage_layers(MODEL.num_layers, slow) * (st.layer.fwd + st.layer.bwd)
             + plan.stage_bf16_layers(MODEL.num_layers, slow) * one
             + (st.head.fwd + st.head.bwd if slow == 3 else 0.0)), rel=1e-9)


def test_a_rank_that_only_the_interleaving_gives_bf16_layers_is_priced():
    """One layer a model chunk: the last BF16 layers lie on the last ranks of the last virtual stage, and a rank
    among them that is neither the first, the one middle rank that stands for the others, nor the last (rank 6 of
    8) is priced on its own."""
    plan = _bf16(replace(FP8, num_gpus=4, global_batch_size=16, pipeline_model_parallel_size=4,
                         num_layers_per_virtual_pipeline_stage=1), 0, 3)
    holders = [r for r in range(4) if plan.stage_bf16_layers(MODEL.num_layers, r)]
    assert holders == [1, 2, 3]
    assert set(holders) <= set(plan.representative_stages(MODEL.num_layers))
    plan2 = _bf16(replace(plan, num_gpus=8, pipeline_model_parallel_size=8, num_layers_per_virtual_pipeline_stage=1,
                          global_batch_size=32), 0, 2)
    assert plan2.stage_bf16_layers(MODEL.num_layers, 6) == 1  # layer 14 of 16 on rank 6 of 8
    assert 6 in plan2.representative_stages(MODEL.num_layers)


def test_memory_of_the_bf16_layers_hand_computed():
    """p 1, one microbatch in flight, no offload: the BF16 layers hold no FP8 weight copy and save their GEMM inputs
    in bf16 (layer_kept_bytes without FP8), the rest of the stage as in the all-FP8 plan."""
    n = 3
    plan = _bf16(FP8, 1, 2)
    mixed, fp8_all = stage_memory(MODEL, plan, 0, 0.0), stage_memory(MODEL, FP8, 0, 0.0)
    L = MODEL.num_layers
    assert mixed.terms["fp8_weight_cache"] == gemm_weight_params(MODEL, plan, L - n) * WEIGHT_CACHE_BYTES
    assert fp8_all.terms["fp8_weight_cache"] == gemm_weight_params(MODEL, plan, L) * WEIGHT_CACHE_BYTES
    kept = {q: layer_kept_bytes(MODEL, plan, tensor_model_parallel_size=1, sequence_parallel=False, fp8=q)
            for q in (True, False)}
    assert kept[False] > kept[True]
    assert mixed.terms["activations"] - fp8_all.terms["activations"] == n * (kept[False] - kept[True])
    for term in ("weights", "grads", "optimizer_states"):
        assert mixed.terms[term] == fp8_all.terms[term]


def test_fp8_param_gather_keeps_the_bf16_layers_weights_in_bf16():
    """--fp8-param-gather holds the FP8 layers' GEMM weights in 1 byte; the BF16 layers' stay 2 bytes."""
    gather = replace(FP8, fp8_param_gather=True, use_distributed_optimizer=True)
    per_layer = gemm_weight_params(MODEL, gather, 1)
    a, b = stage_memory(MODEL, _bf16(gather, 1, 1), 0, 0.0), stage_memory(MODEL, gather, 0, 0.0)
    assert a.terms["weights"] - b.terms["weights"] == 2 * per_layer * (2 - 1)


@pytest.mark.parametrize("kw, needle", [
    (dict(fp8=None, fp8_recipe="delayed"), "--first-last-layers-bf16 needs --fp8-format"),
    (dict(fp8_recipe="delayed"), "does not work with --fp8-recipe delayed"),
    (dict(num_layers_at_start_in_bf16=17), "--num-layers-at-start-in-bf16 must be between 0 and the layers per "
                                           "pipeline stage (16 // 1 = 16), got 17"),
    (dict(num_layers_at_end_in_bf16=-1), "--num-layers-at-end-in-bf16 must be an integer >= 0, got -1"),
])
def test_megatron_cores_rules_are_one_line(kw, needle):
    with pytest.raises(InvalidPlanError, match=None) as err:
        validate_plan(MODEL, replace(_bf16(FP8), **kw), H100)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_flags_round_trip():
    plan = _bf16(replace(FP8, num_gpus=4, global_batch_size=16, pipeline_model_parallel_size=4), 2, 3)
    flags = megatron_flags(plan)
    assert flags[flags.index("--first-last-layers-bf16"):][:5] == [
        "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2", "--num-layers-at-end-in-bf16", "3"]
    back = plan_from_megatron_flags(flags, num_gpus=4, seq_length=plan.seq_length)
    assert (back.first_last_layers_bf16, back.num_layers_at_start_in_bf16, back.num_layers_at_end_in_bf16) == (
        True, 2, 3)
    assert "--first-last-layers-bf16" not in megatron_flags(FP8)


def _sampled_plans(n: int = 24):
    """Valid FP8 plans with BF16 layers over the split kinds, pipeline sizes 1-8 and both counts (seeded)."""
    import random
    rng = random.Random(7)
    out = []
    while len(out) < n:
        p = rng.choice((1, 2, 4, 8))
        split = rng.choice([{}, {"num_layers_per_virtual_pipeline_stage": rng.choice((1, 2))},
                            {"account_for_embedding_in_pipeline_split": True,
                             "account_for_loss_in_pipeline_split": True}])
        most = MODEL.num_layers // p
        start, end = rng.randint(0, most), rng.randint(0, most)
        plan = _bf16(replace(FP8, num_gpus=p, global_batch_size=4 * p, pipeline_model_parallel_size=p,
                             **(split if p > 1 else {})), start, end)
        try:
            validate_plan(MODEL, plan, H100)
        except InvalidPlanError:
            continue
        out.append(plan)
    return out


@pytest.mark.parametrize("plan", _sampled_plans(), ids=lambda p: (
    f"p{p.pipeline_model_parallel_size}-l{p.num_layers_per_virtual_pipeline_stage}-"
    f"{int(p.account_for_embedding_in_pipeline_split)}-{p.num_layers_at_start_in_bf16}+{p.num_layers_at_end_in_bf16}"))
def test_every_split_prices_its_bf16_layers_where_they_are(plan):
    """Over sampled splits: the ranks hold N1 + N2 BF16 layers in all (fewer only where the two ranges overlap);
    the iteration is no faster than the all-FP8 plan's (at this width a BF16 layer is the slower one); a rank
    without BF16 layers holds what it holds in the all-FP8 plan, byte for byte, and a rank with some more."""
    L, p = MODEL.num_layers, plan.pipeline_model_parallel_size
    fp8_all = replace(plan, first_last_layers_bf16=False)
    held = [plan.stage_bf16_layers(L, r) for r in range(p)]
    assert sum(held) == min(L, plan.num_layers_at_start_in_bf16 + plan.num_layers_at_end_in_bf16)
    e, e0 = estimate(MODEL, plan, H100), estimate(MODEL, fp8_all, H100)
    assert e.iteration_time_s >= e0.iteration_time_s - 1e-12
    assert (e.iteration_time_s > e0.iteration_time_s) == (sum(held) > 0)
    for r in range(p):
        a, b = stage_memory(MODEL, plan, r, 0.0), stage_memory(MODEL, fp8_all, r, 0.0)
        if held[r] == 0:
            assert a.terms == b.terms
        else:
            assert a.terms["fp8_weight_cache"] < b.terms["fp8_weight_cache"]
            assert a.terms["activations"] >= b.terms["activations"]


def test_the_parameter_all_gather_moves_only_fp8_layers_weights_in_fp8():
    """--fp8-param-gather: megatron-core gathers TransformerEngine's FP8 weights in 1 byte and the rest (embedding,
    norms, output layer, the BF16 layers' weights) in 2 from buffers of their own: the mean bytes per parameter of a
    rank's all-gather, hand-computed; 2 without the switch or FP8."""
    from h3t_ext.costmodel.fp8 import param_gather_bytes
    from h3t_ext.costmodel.memory import stage_params
    gather = _bf16(replace(FP8, fp8_param_gather=True, use_distributed_optimizer=True), 1, 1)
    n = stage_params(MODEL, gather, 0)
    w = gemm_weight_params(MODEL, gather, MODEL.num_layers - 2)
    assert 0 < w < n
    assert param_gather_bytes(gather, n, w) == pytest.approx((w + 2 * (n - w)) / n, rel=1e-15)
    assert param_gather_bytes(replace(gather, fp8_param_gather=False), n, w) == 2.0
    assert param_gather_bytes(replace(gather, fp8=None, fp8_param_gather=False, first_last_layers_bf16=False),
                              n, w) == 2.0


NARROW = ModelSpec(name="narrow", num_layers=16, hidden_size=512, num_attention_heads=8, num_query_groups=4,
                   ffn_hidden_size=1408, vocab_size=32000)


@pytest.mark.parametrize("model", [MODEL, NARROW], ids=["l3-16", "narrow"])
def test_best_first_search_with_bf16_layers_is_the_exhaustive_top(model):
    """The best-first search's bound counts each rank's BF16 layers (Bounds._pipelined), so its top plans are the
    exhaustive search's, and it prunes: it priced 123 plans of the 175B / 4,096-GPU case while the bound took every
    layer for an FP8 one, 19 since (scripts/bench_planner.py --fp8-recipe tensorwise --first-last-layers-bf16)."""
    from h3t_ext.planner.search import R_BOUND, search
    from h3t_ext.planner.space import SearchConstraints
    assert shape_times(model, _bf16(FP8), H100).extra(1) > 0
    k = SearchConstraints(precisions=("fp8",), fp8_recipe="tensorwise", first_last_layers_bf16=True,
                          num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=1)
    kw = dict(num_gpus=8, seq_length=2048, global_batch_size=32, constraints=k)
    full = search(model, H100, exhaustive=True, **kw)
    assert all(r.plan.has_bf16_layers for r in full.plans)
    for top in (1, 5):
        best = search(model, H100, top=top, **kw)
        assert best.considered < full.considered and best.rejected.get(R_BOUND, 0) > 0
        assert ([(r.plan, r.tokens_per_second) for r in best.plans[:top]]
                == [(r.plan, r.tokens_per_second) for r in full.plans[:top]])
