"""ParallelLayout: the one home of the parallel-layout rules (pure arithmetic), and the cost model, the
schedule builder and the runtime refusing a bad layout with its one reason."""
import pytest

from h3t_ext.layout import RULES, LayoutError, ParallelLayout, virtual_pipeline_size


def _refused(call, *args, **kw) -> LayoutError:
    with pytest.raises(LayoutError) as exc:
        call(*args, **kw)
    msg = str(exc.value)
    assert "\n" not in msg and msg == exc.value.reason and exc.value.rule in RULES
    assert isinstance(exc.value, ValueError)
    return exc.value


# ---- valid layouts: derived sizes ------------------------------------------------------------------

@pytest.mark.parametrize("kw, t, c, p, v, d, m", [
    (dict(world_size=1, global_batch_size=4), 1, 1, 1, 1, 1, 4),
    (dict(world_size=16, global_batch_size=32, micro_batch_size=2, tensor_model_parallel_size=2,
          pipeline_model_parallel_size=2), 2, 1, 2, 1, 4, 4),
    # c ranks are not data-parallel ranks (Megatron-LM: d = world / (t c p)): 64 / (2*2*4) = 4, m = 64/(1*4)
    (dict(world_size=64, global_batch_size=64, tensor_model_parallel_size=2, context_parallel_size=2,
          pipeline_model_parallel_size=4), 2, 2, 4, 1, 4, 16),
    # v from --num-layers-per-virtual-pipeline-stage as Megatron-LM derives it: (32/4)/2 = 4
    (dict(world_size=16, global_batch_size=16, tensor_model_parallel_size=2, pipeline_model_parallel_size=4,
          num_layers=32, num_layers_per_virtual_pipeline_stage=2), 2, 1, 4, 4, 2, 8),
    # l = L/p is plain 1F1B
    (dict(world_size=8, global_batch_size=8, pipeline_model_parallel_size=4, num_layers=8,
          num_layers_per_virtual_pipeline_stage=2), 1, 1, 4, 1, 2, 4),
    # uneven stages: 3 + 2*5 + 3 = 16 layers over p = 4
    (dict(world_size=4, global_batch_size=5, pipeline_model_parallel_size=4, num_layers=16,
          decoder_first_pipeline_num_layers=3, decoder_last_pipeline_num_layers=3), 1, 1, 4, 1, 1, 5),
    # a given group size: p=2 <= g=3 <= m=5, 5 mod 3 = 2 >= p
    (dict(world_size=2, global_batch_size=5, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
          microbatch_group_size_per_vp_stage=3), 1, 1, 2, 2, 1, 5),
])
def test_valid_layouts_derive_d_and_m(kw, t, c, p, v, d, m):
    lay = ParallelLayout.from_sizes(**kw)
    assert (lay.tensor_model_parallel_size, lay.context_parallel_size, lay.pipeline_model_parallel_size,
            lay.virtual_pipeline_model_parallel_size, lay.data_parallel_size, lay.num_microbatches) == \
        (t, c, p, v, d, m)
    assert lay.world_size == kw["world_size"]
    assert lay.data_and_context_parallel_size == d * c
    assert lay.interleaved == (v > 1)
    assert m * kw.get("micro_batch_size", 1) * d == kw["global_batch_size"]


def test_direct_construction_and_group_size():
    lay = ParallelLayout(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, num_microbatches=8)
    assert lay.microbatch_group_size == 4 and lay.world_size == 4
    assert ParallelLayout(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, num_microbatches=9,
                          microbatch_group_size_per_vp_stage=9).microbatch_group_size == 9


# ---- each rule: refused with one line naming the flag(s) and the valid values ---------------------

FROM_SIZES_CASES = [
    (dict(world_size=10, global_batch_size=8, tensor_model_parallel_size=4), "world_size",
     ["world size 10 is not a multiple of --tensor-model-parallel-size 4 x --context-parallel-size 1 x "
      "--pipeline-model-parallel-size 1 = 4", "valid: world sizes that are multiples of 4"]),
    (dict(world_size=4, global_batch_size=10, micro_batch_size=2, tensor_model_parallel_size=2), "global_batch_size",
     ["--global-batch-size 10 is not a multiple of --micro-batch-size 2 x data-parallel size 2 = 4",
      "valid: multiples of 4"]),
    (dict(world_size=8, global_batch_size=8, pipeline_model_parallel_size=4, num_layers=30), "num_layers",
     ["--num-layers 30 is not a multiple of --pipeline-model-parallel-size 4", "valid: multiples of 4",
      "--decoder-first-pipeline-num-layers"]),
    (dict(world_size=8, global_batch_size=8, pipeline_model_parallel_size=2, num_layers=16,
          num_layers_per_virtual_pipeline_stage=3), "num_layers_per_virtual_pipeline_stage",
     ["--num-layers-per-virtual-pipeline-stage 3 does not divide the 8 layers per pipeline rank",
      "valid: 1, 2, 4, 8"]),
    (dict(world_size=8, global_batch_size=8, num_layers=8, num_layers_per_virtual_pipeline_stage=2),
     "virtual_needs_pipeline",
     ["4 model chunks per pipeline rank (--num-layers-per-virtual-pipeline-stage) need "
      "--pipeline-model-parallel-size > 1", "valid: --pipeline-model-parallel-size >= 2"]),
    # 8 ranks, p = 4 -> d = 2, batch 6 -> m = 3, not a multiple of p under interleaving (v = 2)
    (dict(world_size=8, global_batch_size=6, pipeline_model_parallel_size=4, num_layers=8,
          num_layers_per_virtual_pipeline_stage=1), "interleaving",
     ["interleaved 1F1B needs the number of microbatches", "= 3 to be a multiple of --pipeline-model-parallel-size 4",
      "valid: multiples of 4"]),
    (dict(world_size=4, global_batch_size=4, pipeline_model_parallel_size=4, num_layers=10,
          decoder_first_pipeline_num_layers=3), "uneven_stages",
     ["--num-layers 10 minus --decoder-first-pipeline-num-layers 3 leaves 7 layer(s)", "other 3 pipeline stage(s)",
      "valid: first/last stage layers that leave a positive multiple of 3 layers"]),
    (dict(world_size=4, global_batch_size=4, pipeline_model_parallel_size=4, num_layers=10,
          decoder_last_pipeline_num_layers=10), "uneven_stages",
     ["--decoder-last-pipeline-num-layers 10 is outside [1, 9]", "valid: 1 to 9"]),
    (dict(world_size=4, global_batch_size=4, pipeline_model_parallel_size=4, num_layers=16,
          num_layers_per_virtual_pipeline_stage=2, decoder_first_pipeline_num_layers=4), "uneven_stages",
     ["--num-layers-per-virtual-pipeline-stage cannot be combined with --decoder-first-pipeline-num-layers",
      "valid: --num-virtual-stages-per-pipeline-rank with uneven stages"]),
    (dict(world_size=2, global_batch_size=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
          num_layers=8, num_layers_per_virtual_pipeline_stage=1), "num_layers_per_virtual_pipeline_stage",
     ["virtual pipeline size 2 differs from the 4 model chunks per rank", "valid: 4"]),
    (dict(world_size=0, global_batch_size=4), "range", ["world size 0 is outside [1, inf)", "valid: integers >= 1"]),
    (dict(world_size=4, global_batch_size=4, micro_batch_size=0), "range",
     ["--micro-batch-size 0 is outside [1, inf)"]),
    (dict(world_size=4, global_batch_size=4, context_parallel_size=True), "range",
     ["--context-parallel-size True is outside [1, inf)"]),
]


@pytest.mark.parametrize("kw, rule, parts", FROM_SIZES_CASES,
                         ids=[c[1] + str(i) for i, c in enumerate(FROM_SIZES_CASES)])
def test_from_sizes_refuses_each_rule_in_one_line(kw, rule, parts):
    err = _refused(ParallelLayout.from_sizes, **kw)
    assert err.rule == rule, err
    for part in parts:
        assert part in err.reason, err.reason


@pytest.mark.parametrize("kw, parts", [
    (dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, num_microbatches=6),
     ["= 6 to be a multiple of --pipeline-model-parallel-size 4", "valid: multiples of 4"]),
    (dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, num_microbatches=2),
     ["= 2 to be a multiple of --pipeline-model-parallel-size 4"]),  # m < p
    (dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, num_microbatches=8,
          microbatch_group_size_per_vp_stage=3),
     ["--microbatch-group-size-per-virtual-pipeline-stage 3 is outside [--pipeline-model-parallel-size 4,",
      "valid: 4 to 8"]),
    (dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, num_microbatches=9,
          microbatch_group_size_per_vp_stage=4),
     ["= 9 mod --microbatch-group-size-per-virtual-pipeline-stage 4 = 1 must be 0 or >= "
      "--pipeline-model-parallel-size 4", "valid remainders: 0"]),
    (dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, num_microbatches=13,
          microbatch_group_size_per_vp_stage=6),
     ["= 13 mod --microbatch-group-size-per-virtual-pipeline-stage 6 = 1", "valid remainders: 0 or 4 to 5"]),
])
def test_interleaving_rules_are_megatron_cores(kw, parts):
    err = _refused(ParallelLayout, **kw)
    assert err.rule == "interleaving"
    for part in parts:
        assert part in err.reason, err.reason
    # without interleaving the same sizes are fine
    ParallelLayout(**{**kw, "virtual_pipeline_model_parallel_size": 1})


def test_model_shape_rules():
    t4 = ParallelLayout(tensor_model_parallel_size=4, context_parallel_size=2)
    t4.check_tensor_split(num_attention_heads=32, num_query_groups=8, ffn_hidden_size=11008)
    err = _refused(t4.check_tensor_split, num_attention_heads=6)
    assert err.rule == "num_attention_heads"
    assert err.reason == ("--num-attention-heads 6 is not a multiple of --tensor-model-parallel-size 4; "
                          "valid --tensor-model-parallel-size: 1, 2, 3, 6")
    assert _refused(t4.check_tensor_split, num_attention_heads=32, num_query_groups=2).rule == "num_query_groups"
    assert _refused(t4.check_tensor_split, num_attention_heads=32, ffn_hidden_size=1022).rule == "ffn_hidden_size"
    t4.check_seq_length(64)
    err = _refused(t4.check_seq_length, 66)  # 66 is not 2c = 4 chunks
    assert err.rule == "seq_length_context_parallel"
    assert "--seq-length 66 is not a multiple of 2 x --context-parallel-size 2 = 4" in err.reason
    assert "valid: multiples of 4" in err.reason
    # s = 12: 2c = 4 divides it, but the context shard 6 does not split over t = 4 ...
    err = _refused(t4.check_seq_length, 12)
    assert err.rule == "seq_length_sequence_parallel" and "valid: multiples of 8" in err.reason
    t4.check_seq_length(12, sequence_parallel=False)  # ... which only --sequence-parallel needs


def test_layer_split_rules():
    assert virtual_pipeline_size(32, 4) == 1 and virtual_pipeline_size(32, 4, 2) == 4
    assert virtual_pipeline_size(16, 4, decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=3) == 1
    lay = ParallelLayout(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=3, num_microbatches=4)
    lay.check_num_layers(24)
    err = _refused(lay.check_num_layers, 32)  # 8 layers per rank, 3 chunks
    assert "the 8 layers per pipeline rank" in err.reason and "valid chunk counts: 1, 2, 4, 8" in err.reason
    assert _refused(lay.check_num_layers, 24, decoder_first_pipeline_num_layers=3).rule == "uneven_stages"
    assert _refused(virtual_pipeline_size, 8, 1, decoder_first_pipeline_num_layers=3).rule == "uneven_stages"


# ---- one source of truth: cost model, schedule builder and runtime agree ------------------------

BAD_SHAPES = [
    # (p, m, v) of a job with 8 layers and micro batch 1, on p * 2 ranks (d = 2), batch 2m
    (4, 3, 2),  # m not a multiple of p under interleaving
    (4, 2, 2),  # m < p
    (1, 4, 8),  # chunks without a pipeline
]


@pytest.mark.parametrize("p, m, v", BAD_SHAPES)
def test_cost_model_builder_and_runtime_refuse_with_the_same_reason(p, m, v):
    from h3t_ext.costmodel import InvalidPlanError, ModelSpec, Plan, get_system, validate_plan
    from h3t_ext.runtime.config import H3TConfig
    from h3t_ext.runtime.pipeline.schedules import H3TSchedules
    from h3t_ext.schedule import build_schedule

    L = 8
    model = ModelSpec(name="m", num_layers=L, hidden_size=256, num_attention_heads=8, num_query_groups=8,
                      ffn_hidden_size=1024, vocab_size=1000)
    plan = Plan(num_gpus=2 * p, seq_length=64, global_batch_size=2 * m, micro_batch_size=1,
                pipeline_model_parallel_size=p, num_layers_per_virtual_pipeline_stage=L // p // v)
    layout_err = _refused(ParallelLayout.from_sizes, world_size=2 * p, global_batch_size=2 * m,
                          pipeline_model_parallel_size=p, num_layers=L,
                          num_layers_per_virtual_pipeline_stage=L // p // v)
    with pytest.raises(InvalidPlanError) as cost:
        validate_plan(model, plan, get_system("h800"))
    builder = _refused(build_schedule, p, m, v)
    runtime = _refused(H3TSchedules(H3TConfig()).schedule, 0, p, m, v)
    assert cost.value.reason == builder.reason == runtime.reason == layout_err.reason
    assert builder.rule == runtime.rule == layout_err.rule


def _overlap_verdicts(p, m, v, L, alpha):
    """(the cost model's reason, the runtime's reason) for ``alpha`` on a job of L layers, micro batch 1, p * 2
    ranks, m microbatches and v chunks; None where it accepts."""
    from h3t_ext.costmodel import InvalidPlanError, ModelSpec, Plan, get_system, validate_plan
    from h3t_ext.runtime.config import H3TConfig, RuntimeConfigError
    from h3t_ext.runtime.pipeline.prepare import validate_parallel_layout

    model = ModelSpec(name="m", num_layers=L, hidden_size=256, num_attention_heads=8, num_query_groups=8,
                      ffn_hidden_size=1024, vocab_size=1000)
    l = L // p // v if v > 1 else None
    plan = Plan(num_gpus=2 * p, seq_length=64, global_batch_size=2 * m, micro_batch_size=1,
                pipeline_model_parallel_size=p, num_layers_per_virtual_pipeline_stage=l, offload_alpha=alpha)
    lay = ParallelLayout.from_sizes(world_size=2 * p, global_batch_size=2 * m, pipeline_model_parallel_size=p,
                                    num_layers=L, num_layers_per_virtual_pipeline_stage=l)
    try:
        validate_plan(model, plan, get_system("h800"))
        cost = None
    except InvalidPlanError as e:
        cost = e.reason
    try:
        validate_parallel_layout(H3TConfig(offload_alpha=alpha), lay,
                                 num_layers_per_chunk=L if p == 1 else None)  # as the driver passes it
        runtime = None
    except RuntimeConfigError as e:
        runtime = str(e)
    return cost, runtime


@pytest.mark.parametrize("p, v", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (4, 2)])
def test_cost_model_and_runtime_refuse_the_same_unoverlappable_offloads(p, v):
    """An alpha > 0 where the schedule has no place to hide an offload moves nothing: the runtime refuses it, and
    the cost model, which priced it as alpha 0 (accepted and ignored), refuses it with the same line, for one alpha
    and for one per stage; every microbatch count a layout of this shape takes."""
    refused = 0
    for m in range(1, 3 * p + 3):
        if v > 1 and m % p:
            continue  # megatron-core's interleaving rule, refused before the offload is looked at
        alphas = [0.5] + ([tuple(0.5 if r == k else 0.0 for r in range(p)) for k in range(p)] if p > 1 else [])
        for L in ((1, 8) if p == 1 else (4 * p,)):
            for alpha in alphas:
                cost, runtime = _overlap_verdicts(p, m, v, L, alpha)
                assert cost == runtime, (m, L, alpha)
                refused += cost is not None
    # without interleaving each shape has a microbatch count (or a chunk of one layer) with no place for it; with
    # it, every rank has one wherever megatron-core's m % p rule holds
    assert (refused > 0) == (v == 1)


def test_the_unoverlappable_offload_is_named_in_one_line():
    cost, _ = _overlap_verdicts(2, 2, 1, 8, 0.5)
    assert cost == ("--offload-alpha 0.5 cannot be overlapped: with --pipeline-model-parallel-size 2, 1 model chunk(s), "
                    "2 microbatch(es) no microbatch has two compute steps between its forward and backward; use "
                    "--offload-alpha 0")
    assert _overlap_verdicts(2, 4, 1, 8, 0.5) == (None, None)
    assert _overlap_verdicts(1, 4, 1, 8, 0.5) == (None, None)  # layer by layer at pipeline size 1
    assert "a model chunk has 1 layer(s)" in _overlap_verdicts(1, 4, 1, 1, 0.5)[0]
    assert "stage(s) [1]" in _overlap_verdicts(2, 4, 1, 8, (0.0, 0.5))[0]  # the last stage never can


def test_runtime_checks_a_whole_layout_for_the_driver():
    from h3t_ext.runtime.config import H3TConfig, RuntimeConfigError
    from h3t_ext.runtime.pipeline.prepare import validate_parallel_layout

    lay = ParallelLayout.from_sizes(world_size=4, global_batch_size=8, pipeline_model_parallel_size=2)  # m = 4
    validate_parallel_layout(H3TConfig(offload_alpha=0.3), lay)
    validate_parallel_layout(H3TConfig(offload_alpha=(0.5, 0.0)), lay)
    one = ParallelLayout.from_sizes(world_size=4, global_batch_size=2, pipeline_model_parallel_size=2)  # m = 1
    with pytest.raises(RuntimeConfigError, match="cannot be overlapped"):
        validate_parallel_layout(H3TConfig(offload_alpha=0.3), one)
    with pytest.raises(RuntimeConfigError, match="3 per-stage values"):
        validate_parallel_layout(H3TConfig(offload_alpha=(0.1, 0.1, 0.1)), lay)


def test_layout_package_imports_nothing_from_the_rest_of_h3t_ext():
    import ast
    import pathlib

    import h3t_ext.layout as pkg

    files = sorted(pathlib.Path(pkg.__file__).parent.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "rules.py", "pipeline_split.py", "parallel.py"}
    for f in files:
        tree = ast.parse(f.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        own = {m for m in imported if m.startswith("h3t_ext.layout.")}
        assert imported - own <= {"__future__", "collections", "dataclasses", "functools", "re", "typing"}, (f.name, imported)
