"""The NCCL point-to-point model (h3t_ext.schedule.p2p_model) and the builder's posting order (pure)."""
import pytest

from h3t_ext.schedule import build_schedule
from h3t_ext.schedule.builder import ActionKind as K, PipelineSchedule, ScheduleConfig, build_rank_actions
from h3t_ext.schedule.p2p_model import COMM_MAPPINGS, Batch, Compute, Transfer, check_schedule, simulate
from h3t_ext.schedule.posting import posting_batches
from schedule_harness import just_in_time_schedule


def _shapes():
    for p in range(1, 9):
        for v in range(1, 5):
            for m in sorted({p, 2 * p, 3 * p, 2 * p + 1}):
                groups = [None] if v == 1 else sorted({p, p + 1, m} & set(range(p, m + 1)))
                for g in groups:
                    try:
                        ScheduleConfig(p, m, v, microbatch_group_size_per_vp_stage=g)
                    except ValueError:
                        continue
                    yield p, m, v, g


SHAPES = list(_shapes())


@pytest.mark.parametrize("early_receives", [True, False])
@pytest.mark.parametrize("comm", COMM_MAPPINGS)
def test_every_schedule_completes_under_nccl_semantics(comm, early_receives):
    """The builder's order (early receives, what the runtime posts) and Megatron's blocking order (what the
    timeline prices blocking schedules on), every shape p <= 8, v <= 4."""
    interleaved = 0
    for p, m, v, g in SHAPES:
        for forward_only in (False, True):
            s = build_schedule(p, m, v, microbatch_group_size_per_vp_stage=g, forward_only=forward_only)
            if not early_receives:
                s = PipelineSchedule(s.config, tuple(build_rank_actions(s.config, r, early_receives=False)
                                                     for r in range(p)))
            res = check_schedule(s, comm)
            assert res.ok, f"p={p} m={m} v={v} g={g} forward_only={forward_only} comm={comm}: {res}"
            interleaved += v > 1 and m >= 2 * p
    assert interleaved > 100  # the shapes the old order deadlocked on are among them
    assert any(g == m and m == 2 * p + 1 for p, m, v, g in SHAPES if v > 1)


@pytest.mark.parametrize("comm", COMM_MAPPINGS)
def test_the_just_in_time_order_deadlocks_on_p2_m4_v2(comm):
    res = check_schedule(just_in_time_schedule(2, 4, 2), comm)
    assert not res.completed
    assert [s.rank for s in res.stuck] == [0, 1]
    text = str(res)
    assert text.startswith("deadlocks") and "send SB0.1 to rank 1" in text and "send SB1.1 to rank 0" in text
    # plain 1F1B and interleaved shapes with m < 2p complete even in that order
    assert check_schedule(just_in_time_schedule(4, 8, 1), comm).ok
    assert check_schedule(just_in_time_schedule(4, 4, 2), comm).ok


def test_just_in_time_order_deadlocks_on_every_interleaved_shape_with_m_at_least_2p():
    for p in (2, 3, 4):
        for v in (2, 3):
            for m in (p, 2 * p, 3 * p):
                assert check_schedule(just_in_time_schedule(p, m, v)).completed == (m < 2 * p), (p, m, v)


def test_group_and_pair_mappings_differ():
    # Rank 1 posts [send d to 2] then [send c to 0]; rank 0 needs c before it sends e to 2, and
    # rank 2 needs e before it takes d. One stream per rank (group) closes the cycle
    # 1:d -> 2:e -> 0:c -> 1:d; one stream per rank pair (pair) lets c overtake d.
    r0 = [Batch((Transfer(False, 1, "c"),)), Batch((Transfer(True, 2, "e"),))]
    r1 = [Batch((Transfer(True, 2, "d"),)), Batch((Transfer(True, 0, "c"),))]
    r2 = [Batch((Transfer(False, 0, "e"),)), Batch((Transfer(False, 1, "d"),))]
    res = simulate([r0, r1, r2], "group")
    assert not res.completed and [s.rank for s in res.stuck] == [0, 1, 2]
    assert simulate([r0, r1, r2], "pair").ok
    # in one batch the two sends of rank 1 do not wait for each other under either mapping
    r1_one = [Batch((Transfer(True, 2, "d"), Transfer(True, 0, "c")))]
    assert all(simulate([r0, r1_one, r2], comm).ok for comm in COMM_MAPPINGS)


def test_computes_order_their_batches():
    # each rank computes before its send; the receive waits for the peer's compute, not a deadlock
    r0 = [Compute("F0"), Batch((Transfer(True, 1, "x"),)), Batch((Transfer(False, 1, "y"),)), Compute("B0", ("y",))]
    r1 = [Batch((Transfer(False, 0, "x"),)), Compute("F0", ("x",)), Batch((Transfer(True, 0, "y"),))]
    assert simulate([r0, r1]).ok
    # a compute that needs a receive posted only after it never runs
    r1_late = [Compute("F0", ("x",)), Batch((Transfer(False, 0, "x"),)), Batch((Transfer(True, 0, "y"),))]
    res = simulate([r0, r1_late])
    assert not res.completed and "a receive posted after it" in str(res)


def test_order_mismatch_is_reported():
    r0 = [Batch((Transfer(True, 1, "x"), Transfer(True, 1, "y")))]
    r1 = [Batch((Transfer(False, 0, "y"), Transfer(False, 0, "x")))]
    res = simulate([r0, r1])
    assert res.completed and not res.ok and len(res.mismatches) == 2


def test_bad_mapping_is_a_one_line_error():
    with pytest.raises(ValueError, match="comm must be one of"):
        simulate([], "ring")


def test_posting_batches_are_runs_between_computes():
    s = build_schedule(2, 4, 2)
    for r in range(2):
        batches = posting_batches(s.ranks[r])
        comm = [a for a in s.ranks[r] if a.kind.value in ("SF", "SB", "RF", "RB")]
        assert [a for b in batches for a in b] == comm
        computes = len(s.compute_actions(r))
        assert len(batches) <= computes + 1
    # every send is posted in the batch right after the compute that produced it
    acts = [a for a in s.ranks[0] if a.kind not in (K.OFFLOAD, K.RELOAD)]
    for i, a in enumerate(acts):
        if a.kind in (K.SEND_FORWARD, K.SEND_BACKWARD):
            j = i
            while acts[j].kind not in (K.FORWARD, K.BACKWARD):
                j -= 1
            produced = K.FORWARD if a.kind is K.SEND_FORWARD else K.BACKWARD
            assert (acts[j].kind, acts[j].microbatch, acts[j].chunk) == (produced, a.microbatch, a.chunk)
