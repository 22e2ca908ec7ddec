"""The posting orders of h3t_ext/schedule/posting.py priced on the timeline (pure): the builder's early
receives hide the steady state's hops; Megatron's blocking order keeps exposing one per microbatch."""
import pytest

from h3t_ext.costmodel.timeline import simulate
from h3t_ext.schedule.actions import ActionKind as K, ScheduleConfig
from h3t_ext.schedule.builder import build_rank_actions


def _excess(p, m, v, hop, blocking):
    """Timeline end minus the ideal pipeline 3m + 3(p-1)/v (forward 1/v, backward 2/v per chunk)."""
    cfg = ScheduleConfig(p, m, v, offload=False)
    ranks = simulate(cfg, [[1 / v] * v] * p, [[2 / v] * v] * p, hop=hop, blocking=blocking)
    return max(r.end for r in ranks) - (3 * m + 3 * (p - 1) / v)


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (8, 2), (4, 4), (8, 3)])
@pytest.mark.parametrize("hop_per_forward", [0.05, 0.3])
def test_interleaved_steady_state_exposes_no_hop_per_microbatch(p, v, hop_per_forward):
    """A hop shorter than a chunk's forward: only the fill and drain hops 2(pv - 1) hop, whatever m (the
    order of just-before-the-consumer receives exposed about two hops per microbatch-chunk here)."""
    hop = hop_per_forward / v
    for m in (2 * p, 4 * p, 8 * p):
        assert _excess(p, m, v, hop, blocking=False) == pytest.approx(2 * (p * v - 1) * hop, abs=1e-9), m


@pytest.mark.parametrize("p", [4, 8])
def test_blocking_1f1b_still_exposes_two_hops_per_microbatch(p):
    """Megatron's 1F1B blocks on send_forward_recv_backward / send_backward_recv_forward: 2(p + m - 2) hops
    (the lists it is priced on are the unit-clock order's, unchanged)."""
    for m in (p, 2 * p, 4 * p):
        assert _excess(p, m, 1, 0.05, blocking=True) == pytest.approx(2 * (p + m - 2) * 0.05, abs=1e-9), m


def _batch_before(actions, i):
    """Number of computes between the receive at ``i`` and the compute that consumes it."""
    a = actions[i]
    want = (K.FORWARD if a.kind is K.RECV_FORWARD else K.BACKWARD, a.microbatch, a.chunk)
    between = 0
    for b in actions[i + 1:]:
        if b.kind in (K.FORWARD, K.BACKWARD):
            if (b.kind, b.microbatch, b.chunk) == want:
                return between
            between += 1
    raise AssertionError(f"{a} is never consumed")


def test_steady_state_receives_are_posted_ahead_of_the_compute_before_their_consumer():
    """p=4 m=32 v=2: in the builder's order no steady-state receive is in the batch right before its consumer
    (each is posted at least one compute earlier, as Megatron's --overlap-p2p-communication posts it, and
    none more than three ahead); in Megatron's blocking order the backward receives of the middle ranks are."""
    cfg = ScheduleConfig(4, 32, 2, offload=False)
    for r in range(4):
        for early in (False, True):
            acts = build_rank_actions(cfg, r, early_receives=early)
            recvs = [(a.kind, _batch_before(acts, i)) for i, a in enumerate(acts)
                     if a.kind in (K.RECV_FORWARD, K.RECV_BACKWARD)]
            steady = recvs[len(recvs) // 4: 3 * len(recvs) // 4]
            if early:
                assert min(n for _, n in steady) >= 1 and max(n for _, n in recvs) <= 3, r
            elif r in (1, 2):
                assert {n for k, n in steady if k is K.RECV_BACKWARD} == {0}, r
