"""A timeline of many microbatches priced from one shorter run whose steady state is checked periodic
(h3t_ext/costmodel/timeline_steady.py): equal to the whole simulation, or the whole simulation."""
import random

import pytest

import h3t_ext.costmodel.timeline as timeline
from h3t_ext.costmodel import Plan, estimate, get_model, get_system
from h3t_ext.costmodel.timeline import plan_timeline, simulate, simulate_steady
from h3t_ext.costmodel.timeline_steady import MIN_SAVING, period, steady_runs
from h3t_ext.layout import LayoutError
from h3t_ext.schedule.actions import ScheduleConfig

FIELDS = ("end", "busy", "bubble", "p2p", "stall", "hidden")


@pytest.fixture
def verdicts(monkeypatch):
    """Counts of the shorter runs whose steady state was (True) and was not (False) checked periodic."""
    seen = {True: 0, False: 0}
    real = timeline.extrapolate

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        seen[out is not None] += 1
        return out
    monkeypatch.setattr(timeline, "extrapolate", counting)
    return seen


def _difference(a, b) -> float:
    """Largest difference of any rank's field, relative to the iteration."""
    return max(abs(getattr(x, f) - getattr(y, f)) for x, y in zip(a, b) for f in FIELDS) / max(r.end for r in a)


def _random_case(rng):
    p = rng.choice([1, 2, 2, 3, 4, 8])
    v = 1 if p == 1 else rng.choice([1, 1, 2, 3, 4])
    g = None if v == 1 or rng.random() < 0.5 else rng.randint(p, 2 * p)
    m = rng.randint(1, 200 * p) if v == 1 or rng.random() < 0.5 else (g or p) * rng.randint(1, 60)
    layered = p == 1 and rng.random() < 0.6
    offload = [rng.random() < 0.6 for _ in range(p)]
    cfg = ScheduleConfig(p, m, v, microbatch_group_size_per_vp_stage=g, offload=any(offload),
                         offload_stages=tuple(offload) if any(offload) else None,
                         offload_alphas=(0.5,) if layered else None, num_layers_per_chunk=4 if layered else None)
    if rng.random() < 0.4:  # a plan's shape: equal stages, the last one heavier (its output layer)
        fw = [[1.0] * v for _ in range(p)]
        fw[-1][-1] += rng.uniform(0, 0.5)
        bw = [[2 * f for f in row] for row in fw]
    else:
        fw = [[rng.uniform(0.3, 2.0) for _ in range(v)] for _ in range(p)]
        bw = [[f * rng.uniform(1.5, 3.0) for f in row] for row in fw]
    kw = dict(hop=rng.choice([0.0, 0.01, 0.2, 1.0]), blocking=v == 1 or rng.random() < 0.5,
              copy=[rng.choice([0.05, 0.5, 2.0, 10.0]) if o else 0.0 for o in offload],
              layer_stall=(rng.choice([0.0, 0.3]),) if layered else (),
              merge_hidden=[[rng.uniform(0, 0.3)] * v for _ in range(p)] if rng.random() < 0.2 else (),
              in_order_batches=rng.random() < 0.3)
    return cfg, fw, bw, kw


def test_random_schedules_equal_the_whole_simulation(verdicts):
    """p 1-8, v 1-4, groups p to 2p, up to 200 p microbatches, uneven chunks, offload copies up to ten forwards long,
    blocking or not, in-order batches, merged pairs, layer reloads: every field of every rank as the whole
    simulation's, whether the steady state was extrapolated or not."""
    rng, done, worst = random.Random(20261202), 0, 0.0
    while done < 150:
        try:
            cfg, fw, bw, kw = _random_case(rng)
        except LayoutError:
            continue
        worst = max(worst, _difference(simulate(cfg, fw, bw, **kw), simulate_steady(cfg, fw, bw, **kw)))
        done += 1
    assert worst < 2e-13
    assert verdicts[True] >= 40 and verdicts[False] >= 20  # both branches taken many times


# a near-tie between two stages' cycles (backward 2.85 and 2.79 s): the pipeline settles after ~80 microbatches
BACKWARD = [2.85, 1.72, 1.68, 2.16, 2.16, 1.78, 1.59, 2.79]
MERGED = [0.15, 0.18, 0.14, 0.2, 0.22, 0.14, 0.25, 0.16]
OFFLOADS = (False, False, False, True, False, True, False, True)


def _long_transient(m, run=simulate):
    return run(ScheduleConfig(8, m, 1, offload=True, offload_stages=OFFLOADS), [[1.0]] * 8,
               [[b] for b in BACKWARD], hop=0.01, blocking=True, copy=[0.05 if o else 0.0 for o in OFFLOADS],
               merge_hidden=[[x] for x in MERGED], in_order_batches=True)


def test_a_transient_longer_than_the_outputs_show_is_not_extrapolated_from_them(verdicts):
    """The iteration grows by the same 3.64 s per microbatch from 31 to 77 microbatches, then by 3.71: outputs that
    agree over a few periods do not prove the steady state. From 34 microbatches the state check refuses; from 136
    (past the transient) it extrapolates, and both are the whole simulation's."""
    ends = [max(r.end for r in _long_transient(m)) for m in (33, 34, 35, 36, 90, 91)]
    increments = [round(b - a, 6) for a, b in zip(ends, ends[1:])]
    assert increments[0] == increments[1] == increments[2] == 3.64 and increments[4] == 3.71
    assert _difference(_long_transient(212), _long_transient(212, simulate_steady)) == 0.0  # 34 refused, whole
    assert verdicts == {True: 0, False: 1}
    assert _difference(_long_transient(500), _long_transient(500, simulate_steady)) < 1e-13  # 136 extrapolated
    assert verdicts == {True: 1, False: 2}


def test_shorter_runs_keep_the_last_group_and_save_at_least_threefold():
    interleaved = ScheduleConfig(4, 6 * 100 + 5, 2, microbatch_group_size_per_vp_stage=6, offload=False)
    runs = list(steady_runs(interleaved))
    assert len(runs) == 2 and all(r.num_microbatches % 6 == 5 for r in runs)  # m mod g: the same last group
    assert all(MIN_SAVING * r.num_microbatches <= 605 for r in runs) and period(interleaved) == 6
    assert list(steady_runs(ScheduleConfig(4, 40, 1, offload=False))) == []  # too few microbatches to gain
    assert list(steady_runs(ScheduleConfig(4, 4000, 1, forward_only=True, offload=False))) == []


def test_a_plan_of_many_microbatches_is_priced_as_by_the_whole_simulation(verdicts, monkeypatch):
    """llama3-70b on 8 H100, p = 2, v = 40, 256 microbatches, offloading: the estimate's timeline from a run of 48
    microbatches, every rank and the tokens/s as the whole simulation's."""
    model, system = get_model("llama3-70b"), get_system("h100-sxm")
    plan = Plan(num_gpus=8, seq_length=8192, global_batch_size=256, micro_batch_size=1, tensor_model_parallel_size=4,
                pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1, ckpt="ours",
                offload_alpha=0.5, sequence_parallel=True, use_distributed_optimizer=True)
    steady = estimate(model, plan, system)
    assert plan.num_microbatches == 256 and steady.pcie_bytes_per_iteration > 0 and verdicts[True] == 1
    monkeypatch.setattr(timeline, "simulate_steady", lambda cfg, f, b, whole, **kw: simulate(cfg, f, b, **kw))
    whole = estimate(model, plan, system)
    assert _difference(whole.timeline.ranks, steady.timeline.ranks) < 2e-13
    assert steady.tokens_per_second == pytest.approx(whole.tokens_per_second, rel=1e-14)
    assert plan_timeline(model, plan, system).critical_rank == steady.timeline.critical_rank


def test_a_copy_stream_falling_behind_is_not_a_steady_state():
    """The computes of a run repeat every microbatch, but its offload stream frees a little later each time (a
    backlog that will stall a reload some periods on): not extrapolated. Without the lag it is, each field one
    period's growth per microbatch added."""
    from h3t_ext.costmodel.timeline import RankTimeline
    from h3t_ext.costmodel.timeline_steady import extrapolate
    run, cfg = ScheduleConfig(1, 20, 1, offload=False), ScheduleConfig(1, 100, 1, offload=False)
    records = [[(-1, -1, -1, i % 2, -1, -1, False, -1) for i in range(40)]]  # forward, backward, ...

    def trace(lag):  # start, d2h free, h2d free, last batch, then busy, bubble, p2p, stall, hidden so far
        return [[(1.5 * i, 1.5 * i + 0.5 + lag * i, 0.0, 0.0, 1.5 * (i + 1), 0.0, 0.0, 0.0, 0.0) for i in range(40)]]
    ranks = (RankTimeline(0, 60.0, 60.0, 0.0, 0.0, 0.0),)
    steady = extrapolate(cfg, run, records, trace(0.0), ranks, RankTimeline)
    assert steady[0].end == pytest.approx(60.0 + 80 * 3.0) and steady[0].busy == pytest.approx(60.0 + 80 * 3.0)
    assert extrapolate(cfg, run, records, trace(0.01), ranks, RankTimeline) is None


def test_without_the_whole_simulation_an_unchecked_schedule_has_no_timeline(verdicts):
    """``whole=False`` (a schedule too large to simulate whole): None where no shorter run is checked periodic (the
    estimate then prices the closed form and says why), the extrapolation where one is."""
    assert _long_transient(212, lambda *a, **kw: simulate_steady(*a, whole=False, **kw)) is None
    assert verdicts == {True: 0, False: 1}
    assert simulate_steady(ScheduleConfig(4, 40, 1, offload=False), [[1.0]] * 4, [[2.0]] * 4, hop=0.0, blocking=True,
                           whole=False) is None  # too few microbatches for a shorter run
    steady = _long_transient(500, lambda *a, **kw: simulate_steady(*a, whole=False, **kw))
    assert _difference(_long_transient(500), steady) < 1e-13
