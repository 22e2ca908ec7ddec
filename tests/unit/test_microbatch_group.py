"""--microbatch-group-size-per-virtual-pipeline-stage g (megatron-core's microbatch_group_size_per_vp_stage): the
interleaved schedule runs g microbatches of a model chunk before the next chunk takes over, so a rank's warm-up holds
(v - 1) g + 2 (p - rank - 1) microbatch-chunks. It was a noticed flag ("same result"); it changes a stage's memory,
so the driver passes it to megatron-core's TransformerConfig (which both schedules read), the cost model prices its
warm-up, cool-down and offload from the builder's lists, and h3t-plan takes and prints it."""
from __future__ import annotations

import pytest

from h3t_ext.costmodel import Plan, estimate, get_model, get_system
from h3t_ext.costmodel.activations import _closed_form, _walk_schedule, rank_offloads, residency_lines
from h3t_ext.layout import LayoutError, ParallelLayout
from h3t_ext.planner.flags import megatron_flags, plan_from_megatron_flags
from h3t_training.config.run_spec import run_plan
from h3t_training.config.sections import parse_args
from h3t_training.telemetry.training_log import SPLIT_FIELDS

FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data"]
INTERLEAVED = [*BASE, "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]


def _valid(p: int, m: int, v: int, g: int) -> bool:
    try:
        ParallelLayout(pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=v, num_microbatches=m,
                       microbatch_group_size_per_vp_stage=g)
    except LayoutError:
        return False
    return True


def test_the_closed_form_is_the_builders_walk_for_every_group_size():
    """Residency lines (the peak's held chunks) and offloaded chunks of every rank, closed form against the walk of
    the builder's lists, for every valid g at p <= 6, v <= 4, m <= 3p + 2 (396 shapes with g != p)."""
    shapes = 0
    for p in range(2, 7):
        for v in range(2, 5):
            for m in range(p, 3 * p + 3):
                for g in range(p, m + 1):
                    if _valid(p, m, v, g):
                        assert _closed_form(p, m, v, g) == _walk_schedule(p, m, v, g), (p, m, v, g)
                        shapes += g != p
    assert shapes == 396


def test_a_larger_group_holds_more_chunks_in_the_warm_up():
    p, m, v = 4, 16, 3
    for g in (4, 6, 8, 16):
        for rank in range(p):
            warm = 2 * (p - rank - 1) + (v - 1) * g
            assert sum(residency_lines(p, m, v, rank, g)[0]) == min(warm + 1, m * v)
    assert residency_lines(p, m, v, 0, p) == residency_lines(p, m, v, 0)  # g = p is megatron-core's default
    # with g > p the last rank's last chunk of a microbatch no longer meets its backward at once: it is offloaded
    assert rank_offloads(2, 5, 2, 1, 3) == 6 and rank_offloads(2, 6, 2, 1) == 6


def test_the_estimate_prices_the_group():
    model, system = get_model("llama-7b"), get_system("h100-sxm")
    base = Plan(num_gpus=8, seq_length=4096, global_batch_size=32, pipeline_model_parallel_size=4,
                num_layers_per_virtual_pipeline_stage=2, use_distributed_optimizer=True)
    peaks = {}
    for g in (None, 4, 8, 16):
        e = estimate(model, Plan(**{**base.__dict__, "microbatch_group_size_per_vp_stage": g}), system)
        peaks[g] = e.peak_memory_bytes
    assert peaks[None] == peaks[4] < peaks[8] < peaks[16]
    # (v - 1) g + 2 (p - 1) + 1 chunks of one microbatch's activations on stage 0: 19 -> 31 -> 55 at g 4, 8, 16
    one_chunk = (peaks[16] - peaks[8]) / 24
    assert (peaks[8] - peaks[4]) == pytest.approx(12 * one_chunk, rel=1e-6)


def test_the_flag_round_trips_through_the_planners_megatron_flags():
    plan = Plan(num_gpus=8, seq_length=4096, global_batch_size=32, pipeline_model_parallel_size=4,
                num_layers_per_virtual_pipeline_stage=2, microbatch_group_size_per_vp_stage=8,
                use_distributed_optimizer=True)
    flags = megatron_flags(plan)
    assert flags[flags.index(FLAG) + 1] == "8"
    back = plan_from_megatron_flags(flags, num_gpus=8, seq_length=4096)
    assert back.microbatch_group_size_per_vp_stage == 8
    assert FLAG not in megatron_flags(Plan(**{**plan.__dict__, "microbatch_group_size_per_vp_stage": None}))


def test_the_driver_passes_it_to_megatron_core_and_prices_it():
    from h3t_training.loop.model_provider import transformer_config
    config = parse_args([*INTERLEAVED, FLAG, "4"], world_size=2)
    assert config.microbatch_group_size_per_vp_stage == 4 and config.virtual_pipeline_model_parallel_size == 2
    assert transformer_config(config, on_gpu=False).microbatch_group_size_per_vp_stage == 4
    assert run_plan(config).microbatch_group_size_per_vp_stage == 4
    assert not any(FLAG in n for n in config.flag_notices)
    assert "microbatch_group_size_per_vp_stage" in SPLIT_FIELDS  # --metrics-json records it for calibrate
    # left out: megatron-core's default, p
    assert transformer_config(parse_args(INTERLEAVED, world_size=2), on_gpu=False).microbatch_group_size_per_vp_stage == 2


def test_without_interleaving_it_is_megatrons_no_op_and_says_so():
    config = parse_args([*BASE, FLAG, "3"])
    assert config.virtual_pipeline_model_parallel_size is None
    assert any(n.startswith(f"note: {FLAG}: no effect without interleaving") for n in config.flag_notices)


@pytest.mark.parametrize("argv, says", [
    ([FLAG, "1"], f"{FLAG} 1 is outside [--pipeline-model-parallel-size 2, number of microbatches"),
    ([FLAG, "9"], f"{FLAG} 9 is outside [--pipeline-model-parallel-size 2"),
    ([FLAG, "3", "--global-batch-size", "7"], f"mod {FLAG} 3 = 1 must be 0 or >= --pipeline-model-parallel-size 2"),
    ([FLAG, "x"], f"argument {FLAG}: invalid int value: 'x'"),
])
def test_bad_groups_are_one_line(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        parse_args([*INTERLEAVED, *argv], world_size=2)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
