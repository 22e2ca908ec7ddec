"""megatron-core's --pipeline-model-parallel-layout: the layout string read as megatron-core reads it (each model
chunk's layers and offsets equal its PipelineParallelLayerLayout's), refused in one line where megatron-core or this
driver refuses it, priced by the cost model as the split it writes (a layout that equals an uneven or interleaved
split prices the same; a heavy middle stage is the slowest and holds the most), and printed back by h3t-plan."""
from __future__ import annotations

import dataclasses

import pytest

from h3t_ext.costmodel import Plan, get_model, get_system
from h3t_ext.costmodel.errors import InvalidPlanError
from h3t_ext.costmodel.estimate import estimate
from h3t_ext.costmodel.plan_checks import validate_plan
from h3t_ext.layout import LayoutError, ParallelLayout, parse_pipeline_layout, pipeline_split
from h3t_ext.planner.flags import megatron_flags, plan_from_megatron_flags
from tests.planner_harness import run_json, run_main

CASES = [("Et|tttL", 4, 2), ("Et|t|t|tL", 4, 2), ("E|tt|tt|L", 4, 2), ("Ettt|(tt|)*2,tL", 8, 2),
         ("E,t*3|t*2|(t|)*2t*3L", 10, 5), ("Ettttt|L", 5, 2), ("EtL", 1, 1)]


@pytest.mark.parametrize("layout,num_layers,p", CASES)
def test_chunks_and_offsets_are_megatron_cores(monkeypatch, layout, num_layers, p):
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    theirs = PipelineParallelLayerLayout(layout, p)
    theirs.validate_layer_layout(num_layers, None)
    v = theirs.virtual_pipeline_model_parallel_size
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: v if v > 1 else None)
    split = pipeline_split(num_layers, p, pipeline_model_parallel_layout=layout)
    assert split.virtual_pipeline_model_parallel_size == v
    for rank in range(p):
        for chunk in range(v):
            vp = chunk if v > 1 else None
            assert split.chunk_layers(rank, chunk) == theirs.get_num_layers_to_build(LayerType.decoder, vp, rank)
            assert split.layer_offset(rank, chunk) == theirs.get_layer_offset(LayerType.decoder, vp, rank)
        assert split.stage_layers(rank) == sum(split.chunk_layers(rank, c) for c in range(v))


@pytest.mark.parametrize("layout,p,says", [
    ("Et|ttL|", 2, "3 stages, not a multiple of --pipeline-model-parallel-size 2"),
    ("tE|tttL", 2, "the embedding 'E' must be given once, first in the first stage"),
    ("EEt|tttL", 2, "the embedding 'E' must be given once"),
    ("Et|tt|tt|t", 2, "the loss 'L' must be given once, last in the last stage"),
    ("Et|tttLL", 2, "the loss 'L' must be given once"),
    ("Et|tt", 2, "the loss 'L'"),
    ("Et|tt|t|tL", 2, "places 5 transformer layers ('t'), --num-layers is 4"),
    ("Et|tmtL", 2, "multi-token prediction layers ('m')"),
    ("Et|t-ttL", 2, "has '-'; valid characters"),
    ("", 2, "is empty"),
    ("Et*99999999|L", 2, "unrolls to more than"),
    ("Et|t|t|tL", 1, "interleaving needs --pipeline-model-parallel-size > 1"),
])
def test_bad_layouts_are_one_line(layout, p, says):
    with pytest.raises(LayoutError) as e:
        pipeline_split(4, p, pipeline_model_parallel_layout=layout)
    assert says in e.value.reason and "\n" not in e.value.reason


@pytest.mark.parametrize("layout,p", [("Et|ttL|", 2), ("tE|tttL", 2), ("Et|tt|tt|t", 2), ("Et|tt|t|tL", 2),
                                      ("Et|t-ttL", 2)])
def test_what_megatron_core_refuses_is_refused(layout, p):
    """Never more forgiving than megatron-core: each of these stops its parser or its validation too."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    with pytest.raises((AssertionError, ValueError)):
        PipelineParallelLayerLayout(layout, p).validate_layer_layout(4, None)
    with pytest.raises(LayoutError):
        parse_pipeline_layout(layout, 4, p)


@pytest.mark.parametrize("other", [dict(num_layers_per_virtual_pipeline_stage=1),
                                   dict(num_virtual_stages_per_pipeline_rank=2),
                                   dict(decoder_first_pipeline_num_layers=1),
                                   dict(account_for_embedding_in_pipeline_split=True)])
def test_the_layout_takes_no_other_split_flag(other):
    l = other.pop("num_layers_per_virtual_pipeline_stage", None)
    with pytest.raises(LayoutError, match="cannot be combined with"):
        pipeline_split(4, 2, l, pipeline_model_parallel_layout="Et|t|t|tL", **other)


def test_the_layout_sets_the_interleaving():
    layout = ParallelLayout.from_sizes(world_size=2, global_batch_size=8, pipeline_model_parallel_size=2,
                                       num_layers=4, pipeline_model_parallel_layout="Et|t|t|tL")
    assert layout.virtual_pipeline_model_parallel_size == 2
    with pytest.raises(LayoutError, match="multiple of --pipeline-model-parallel-size 2"):
        ParallelLayout.from_sizes(world_size=2, global_batch_size=3, pipeline_model_parallel_size=2, num_layers=4,
                                  pipeline_model_parallel_layout="Et|t|t|tL")


# ----------------------------------------------------------------------------------------------- the cost model

SYSTEM = get_system("h800")
MODEL = get_model("llama2-7b")  # 32 layers


def _plan(**kw) -> Plan:
    base = dict(num_gpus=8, seq_length=4096, global_batch_size=64, pipeline_model_parallel_size=4, ckpt="ours")
    return Plan(**{**base, **kw})


def _same(a, b) -> None:
    assert a.stages == b.stages
    assert a.time_terms == b.time_terms and a.iteration_time_s == b.iteration_time_s


@pytest.mark.parametrize("layout,flags", [
    ("Et*5|t*9|t*9|t*9L", dict(decoder_first_pipeline_num_layers=5, decoder_last_pipeline_num_layers=9)),
    ("Et*4|t*4|t*4|t*4|(t*4|)*3t*4L", dict(num_layers_per_virtual_pipeline_stage=4)),
    ("Et*8|t*8|t*8|t*8", None),
])
def test_a_layout_prices_as_the_split_it_writes(layout, flags):
    if flags is None:  # the layout's L must end the last stage
        with pytest.raises(InvalidPlanError, match="the loss 'L'"):
            validate_plan(MODEL, _plan(pipeline_model_parallel_layout=layout), SYSTEM)
        return
    _same(estimate(MODEL, _plan(pipeline_model_parallel_layout=layout), SYSTEM), estimate(MODEL, _plan(**flags), SYSTEM))


def test_a_heavy_middle_stage_is_the_slowest_and_holds_the_most():
    even = estimate(MODEL, _plan(), SYSTEM)
    heavy = estimate(MODEL, _plan(pipeline_model_parallel_layout="Et*6|t*12|t*7|t*7L"), SYSTEM)
    weights = [s.terms["weights"] for s in heavy.stages]
    assert weights[1] == max(weights) and weights[1] > weights[2]
    # the middle rank's 12 layers bound the iteration: slower than the even split's 8 a rank
    assert heavy.iteration_time_s > even.iteration_time_s
    light_middle = estimate(MODEL, _plan(pipeline_model_parallel_layout="Et*9|t*7|t*7|t*9L"), SYSTEM)
    assert light_middle.iteration_time_s < heavy.iteration_time_s


def test_megatron_flags_carry_the_layout_and_read_back():
    plan = _plan(pipeline_model_parallel_layout="Et*6|t*12|t*7|t*7L", micro_batch_size=1)
    flags = megatron_flags(plan)
    assert flags[flags.index("--pipeline-model-parallel-layout") + 1] == "Et*6|t*12|t*7|t*7L"
    back = plan_from_megatron_flags(flags, num_gpus=8, seq_length=4096)
    assert dataclasses.replace(back, ckpt=plan.ckpt) == dataclasses.replace(plan, offload_alpha=back.offload_alpha)


ESTIMATE = ["estimate", "--model", "llama2-7b", "--num-gpus", "8", "--gpu", "h800", "--seq-length", "4096",
            "--global-batch-size", "64", "--pipeline-model-parallel-size", "4", "--ckpt", "ours"]


def test_h3t_plan_estimate_takes_a_layout(capsys):
    got = run_json([*ESTIMATE, "--pipeline-model-parallel-layout", "Et*5|t*9|t*9|t*9L"], capsys)
    same = run_json([*ESTIMATE, "--decoder-first-pipeline-num-layers", "5", "--decoder-last-pipeline-num-layers", "9"],
                    capsys)
    assert got["iteration_time_s"] == same["iteration_time_s"]
    code, _, err = run_main([*ESTIMATE, "--pipeline-model-parallel-layout", "Et*5|t*9|t*9|t*8L"], capsys)
    assert code == 2 and err.count("\n") == 1 and "places 31 transformer layers" in err, err


# ----------------------------------------------------------------------------------------------- the driver

DRIVER = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
          "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data",
          "--pipeline-model-parallel-size", "2"]


def test_the_driver_passes_the_layout_to_megatron_core_and_the_cost_model():
    from h3t_training.config.run_spec import run_plan
    from h3t_training.config.sections import parse_args
    from h3t_training.loop.model_provider import transformer_config
    from h3t_training.telemetry.prediction import predicted_scalars
    config = parse_args([*DRIVER, "--pipeline-model-parallel-layout", "E|tt|tt|L"], world_size=2)
    assert config.virtual_pipeline_model_parallel_size == 2
    built = transformer_config(config, on_gpu=False).pipeline_model_parallel_layout
    from megatron.core.transformer.enums import LayerType
    assert [[stage.count(LayerType.decoder) for stage in rank] for rank in built.layout] == [[0, 2], [2, 0]]
    plan = run_plan(config)
    assert plan.pipeline_model_parallel_layout == "E|tt|tt|L"
    assert [plan.pipeline_split(4).chunk_layers(r, c) for c in range(2) for r in range(2)] == [0, 2, 2, 0]
    predicted = predicted_scalars(config, vocab_size=256, on_gpu=False)
    assert {"h3t/predicted-peak-activation-bytes/stage-0", "h3t/predicted-peak-activation-bytes/stage-1"} <= \
        set(predicted)


@pytest.mark.parametrize("extra,says", [
    (["--pipeline-model-parallel-layout", "Et|t|t|tL", "--num-virtual-stages-per-pipeline-rank", "2"],
     "cannot be combined with --num-virtual-stages-per-pipeline-rank"),
    (["--pipeline-model-parallel-layout", "Et|t|t|tL", "--account-for-loss-in-pipeline-split"],
     "cannot be combined with --account-for-loss-in-pipeline-split"),
    (["--pipeline-model-parallel-layout", "Et|ttt"], "the loss 'L' must be given once"),
    (["--pipeline-model-parallel-layout", "Et|tttL", "--auto-plan"], "--auto-plan searches even layer splits only"),
])
def test_driver_layout_errors_are_one_line(capsys, extra, says):
    from h3t_training.config.sections import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args([*DRIVER, *extra], world_size=2)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and says in err, err


def test_calibrate_prices_the_split_a_run_trained_with(tmp_path):
    """--metrics-json's config carries the split flags, and h3t-plan calibrate reads them: a layout run is priced with
    its layout, an uneven interleaved one with its --num-virtual-stages-per-pipeline-rank (not an even split)."""
    import json

    from h3t_ext.planner.calibrate import read_runs
    base = {"num_gpus": 8, "seq_length": 4096, "global_batch_size": 64, "pipeline_model_parallel_size": 4,
            "virtual_pipeline_model_parallel_size": 2}
    cases = [({"pipeline_model_parallel_layout": "Et*3|t*4|t*4|t*4|(t*4|)*3t*5L"}, "layout"),
             ({"decoder_first_pipeline_num_layers": 6, "decoder_last_pipeline_num_layers": 10}, "uneven")]
    for extra, name in cases:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"config": {**base, **extra},
                                    "iterations": [{"tokens_per_second_per_gpu": 3000.0}] * 2}))
        plan = read_runs([str(path)], MODEL, SYSTEM)[0].plan
        split = plan.pipeline_split(MODEL.num_layers)
        assert split.virtual_pipeline_model_parallel_size == 2
        if name == "layout":
            assert plan.pipeline_model_parallel_layout == extra["pipeline_model_parallel_layout"]
            assert split.stage_layers(0) == 7 and split.stage_layers(3) == 9
        else:
            assert plan.num_virtual_stages_per_pipeline_rank == 2 and plan.num_layers_per_virtual_pipeline_stage is None
            assert split.stage_layers(0) == 6 and split.stage_layers(3) == 10


def test_a_layouts_middle_stage_is_its_fullest_middle_rank_in_the_closed_form():
    """Under a --pipeline-model-parallel-layout "a middle stage" (the closed form's chunk bytes and a model chunk's
    layers for the recompute share) is the fullest rank between the first and the last; it was the first rank's
    count (the embedding's slot there), which halved the copies of the planner's llama3-405b layout on 32 ranks:
    its PCIe bytes were reported at half the timeline's, and its closed form hid them all (8% under the
    timeline at alpha 0.78; now 3.1% over it)."""
    from h3t_ext.costmodel.activations import rank_offloads
    from h3t_ext.costmodel.memory import chunk_activation_bytes
    model, system = get_model("llama-7b"), get_system("h100-sxm")
    plan = Plan(num_gpus=8, seq_length=4096, global_batch_size=64, micro_batch_size=1, pipeline_model_parallel_size=8,
                pipeline_model_parallel_layout="Et*4|t*5|t*4|t*4|t*4|t*4|t*4|t*3L", offload_alpha=0.5,
                use_distributed_optimizer=True)
    assert plan.layers_per_rank(model.num_layers) == 5  # rank 1's; rank 0's 4 before
    assert chunk_activation_bytes(model, plan) == chunk_activation_bytes(model, plan, 1)
    e = estimate(model, plan, system)
    m, p = plan.num_microbatches, 8
    assert e.pcie_bytes_per_iteration == int(2 * 0.5 * chunk_activation_bytes(model, plan, 1) * rank_offloads(p, m, 1, 1))
    even = dataclasses.replace(plan, pipeline_model_parallel_layout=None)  # an even split: L / p as before
    assert even.layers_per_rank(model.num_layers) == 4

    big = get_model("llama3-405b")
    layout = "Et|" + "|".join(["t*2"] * 62) + "|tL"  # 64 chunks of 32 ranks: v = 2, the middle ranks 4 layers
    heavy = Plan(num_gpus=256, seq_length=2048, global_batch_size=1024, micro_batch_size=1,
                 tensor_model_parallel_size=4, pipeline_model_parallel_size=32, pipeline_model_parallel_layout=layout,
                 sequence_parallel=True, use_distributed_optimizer=True, ckpt="no", offload_alpha=0.777)
    est = estimate(big, heavy, get_system("b200"), memory_budget_bytes=30 * 2**30)
    assert est.closed_form.offload_exposed > 0
    assert abs(est.closed_form_time_s / est.iteration_time_s - 1) < 0.05
