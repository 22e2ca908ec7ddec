"""Hand-worked small cases of the schedule builder (pure, no torch)."""
import pytest

from h3t_ext.schedule import ActionKind, build_schedule


def compute_str(sched, rank):
    return " ".join(str(a) for a in sched.compute_actions(rank))


def kinds(sched, rank, *wanted):
    return [str(a) for a in sched.ranks[rank] if a.kind.value in wanted]


# ---- plain 1F1B -----------------------------------------------------------------------------------

def test_1f1b_p2_m2_order():
    s = build_schedule(2, 2)
    # rank 0: one warm-up forward (p - rank - 1), one steady F/B pair, one cool-down backward
    assert compute_str(s, 0) == "F0 F1 B0 B1"
    assert compute_str(s, 1) == "F0 B0 F1 B1"
    assert [s.warmup_forwards(r) for r in range(2)] == [2, 1]


def test_1f1b_p4_m4_order_and_warmup():
    s = build_schedule(4, 4)
    assert compute_str(s, 0) == "F0 F1 F2 F3 B0 B1 B2 B3"
    assert compute_str(s, 1) == "F0 F1 F2 B0 F3 B1 B2 B3"
    assert compute_str(s, 3) == "F0 B0 F1 B1 F2 B2 F3 B3"
    # forwards before the first backward: (p - rank - 1) warm-up + the first steady forward
    assert [s.warmup_forwards(r) for r in range(4)] == [4, 3, 2, 1]
    assert [s.peak_in_flight(r) for r in range(4)] == [4, 3, 2, 1]


def test_1f1b_p2_m4_steady_state():
    s = build_schedule(2, 4)
    assert compute_str(s, 0) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert compute_str(s, 1) == "F0 B0 F1 B1 F2 B2 F3 B3"
    assert s.peak_in_flight(0) == 2  # p - rank


def test_1f1b_comms_first_and_last_stage():
    s = build_schedule(2, 2, offload=False)
    # rank 0 never receives activations; rank 1 never sends them
    assert kinds(s, 0, "RF") == [] and kinds(s, 1, "SF") == []
    assert len(kinds(s, 0, "SF")) == 2 and len(kinds(s, 1, "RF")) == 2
    assert len(kinds(s, 0, "RB")) == 2 and len(kinds(s, 1, "SB")) == 2


def test_1f1b_offload_points_p2_m4():
    s = build_schedule(2, 4)
    # rank 0: F0..B0 has one compute between (F1): kept. F1..B1 has B0, F2: offloaded.
    # F2..B2 has B1, F3: offloaded. F3..B3 has B2 only: kept.
    assert s.offloaded(0) == {(1, 0), (2, 0)}
    acts = [str(a) for a in s.ranks[0]]
    assert acts.index("OFF1") == acts.index("F1") + 1  # right after its forward
    assert acts.index("OFF2") == acts.index("F2") + 1
    # the reload precedes the compute action just before the backward (B1 is preceded by F2)
    assert acts.index("RL1") < acts.index("F2") < acts.index("B1")
    assert acts.index("RL2") < acts.index("F3") < acts.index("B2")
    assert acts.index("RL1") > acts.index("B0")
    assert s.offloaded(1) == set()  # last stage: every backward follows its forward


def test_no_offload_flag():
    s = build_schedule(4, 8, 2, offload=False)
    assert all(a.kind not in (ActionKind.OFFLOAD, ActionKind.RELOAD) for r in s.ranks for a in r)


# ---- interleaved 1F1B ------------------------------------------------------------------------------

def test_interleaved_p2_v2_m2_order():
    s = build_schedule(2, 2, 2)
    # rank 0 warm-up = 2 (p-1) + (v-1) p = 4 = all forwards
    assert compute_str(s, 0) == "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1"
    # rank 1 warm-up = (v-1) p = 2
    assert compute_str(s, 1) == "F0 F1 F0.1 B0.1 F1.1 B1.1 B0 B1"
    assert s.peak_in_flight(0) == 4


def test_interleaved_p2_v2_m4_order():
    s = build_schedule(2, 4, 2)
    assert compute_str(s, 0) == "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3"
    assert compute_str(s, 1) == "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3"


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 2, 12), (2, 3, 6), (4, 3, 8)])
def test_interleaved_peak_in_flight_rank0(p, v, m):
    s = build_schedule(p, m, v)
    assert s.peak_in_flight(0) == 2 * (p - 1) + (v - 1) * p + 1
    assert s.warmup_forwards(0) == 2 * (p - 1) + (v - 1) * p + 1


def test_interleaved_peak_m_equals_p_is_all_chunks():
    s = build_schedule(4, 4, 2)
    assert s.peak_in_flight(0) == 8  # warm-up 2*3 + 4 = 10 > m*v = 8: every chunk is held


@pytest.mark.parametrize("p,v,m", [(2, 1, 2), (4, 1, 8), (2, 2, 4), (4, 2, 8)])
def test_every_rank_runs_every_microbatch_chunk_once(p, v, m):
    s = build_schedule(p, m, v)
    for r in range(p):
        fw = [(a.microbatch, a.chunk) for a in s.compute_actions(r) if a.kind is ActionKind.FORWARD]
        bw = [(a.microbatch, a.chunk) for a in s.compute_actions(r) if a.kind is ActionKind.BACKWARD]
        assert sorted(fw) == sorted(bw) == sorted((i, c) for i in range(m) for c in range(v))
        # every backward comes after its forward
        pos = {(str(a)): k for k, a in enumerate(s.compute_actions(r))}
        assert all(pos[f"B{i}" + (f".{c}" if c else "")] > pos[f"F{i}" + (f".{c}" if c else "")] for i, c in fw)


def test_interleaved_offload_rule_two_computes_between():
    s = build_schedule(4, 8, 2)
    for r in range(4):
        comp = s.compute_actions(r)
        pos = {(a.kind, a.microbatch, a.chunk): k for k, a in enumerate(comp)}
        expect = {(i, c) for (kind, i, c), k in pos.items()
                  if kind is ActionKind.FORWARD and pos[(ActionKind.BACKWARD, i, c)] - k - 1 >= 2}
        assert s.offloaded(r) == expect
    # rank 0 offloads its first chunk-0 forward (held through the whole warm-up)
    assert (0, 0) in s.offloaded(0)


def test_interleaved_grouping_validation():
    with pytest.raises(ValueError):
        build_schedule(4, 6, 2)  # 6 mod 4 = 2 < p
    with pytest.raises(ValueError):
        build_schedule(4, 2, 2)  # m < p


# ---- layer-granular offload (pipeline size 1) ----------------------------------------------------------

@pytest.mark.parametrize("alpha,layers", [(0.5, 4), (0.3, 4), (1.0, 4), (0.5, 8), (0.99, 3), (0.1, 2)])
def test_p1_layer_offload_reloads_every_offloaded_layer_before_its_backward(alpha, layers):
    from h3t_ext.schedule import layer_offload_fractions

    m = 3
    s = build_schedule(1, m, offload_alphas=(alpha,), num_layers_per_chunk=layers)
    acts = list(s.ranks[0])
    fractions = layer_offload_fractions(alpha, layers)
    expected = tuple(l for l, f in enumerate(fractions) if f > 0)
    assert expected and layers - 1 not in expected  # something offloads; never the last layer
    assert s.offloaded_layers(0) == {(mb, 0): expected for mb in range(m)}
    for mb in range(m):
        f, b = acts.index(next(a for a in acts if str(a) == f"F{mb}")), acts.index(
            next(a for a in acts if str(a) == f"B{mb}"))
        for l in expected:
            off, rl = (next(i for i, a in enumerate(acts) if a.kind is kind and a.microbatch == mb and a.layer == l)
                       for kind in (ActionKind.OFFLOAD, ActionKind.RELOAD))
            # the offload runs inside this microbatch's forward (right after it in the list), after which its
            # reload runs inside the backward: both layer l+1 exists and is where they are issued
            assert f < off < b < rl
            assert all(a.microbatch == mb and a.layer is not None for a in acts[f + 1:off + 1])
            assert all(a.microbatch == mb and a.layer is not None for a in acts[b + 1:rl + 1])
            assert l + 1 < layers
        reloads = [a.layer for a in acts if a.kind is ActionKind.RELOAD and a.microbatch == mb]
        assert reloads == sorted(expected, reverse=True)  # layer l+1's backward (and reload of l) comes first


def test_p1_layer_fractions_follow_alpha():
    from h3t_ext.schedule import layer_offload_fractions

    assert layer_offload_fractions(0.5, 4) == (1.0, 1.0, 0.0, 0.0)
    assert layer_offload_fractions(0.3, 4) == pytest.approx((1.0, 0.2, 0.0, 0.0))
    assert layer_offload_fractions(1.0, 4) == (1.0, 1.0, 1.0, 0.0)  # the last layer never offloads
    assert layer_offload_fractions(0.0, 4) == (0.0,) * 4
    s = build_schedule(1, 2, offload_alphas=(0.0,), num_layers_per_chunk=4)
    assert not s.offloaded(0)  # alpha 0: no OFFLOAD/RELOAD at all
    s = build_schedule(1, 2, offload_alphas=(0.9,), num_layers_per_chunk=1)
    assert not s.offloaded(0)  # one layer per chunk: nothing can hide


def test_pipelines_stay_chunk_granular_with_layers_known():
    plain = build_schedule(2, 4)
    layered = build_schedule(2, 4, offload_alphas=(0.5, 0.5), num_layers_per_chunk=4)
    assert layered.ranks == plain.ranks
    assert all(a.layer is None for r in layered.ranks for a in r)
