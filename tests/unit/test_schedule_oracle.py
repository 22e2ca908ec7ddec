"""The builder's action lists and the timeline's programs equal, element for element, those of the
implementation they replaced (kept as an oracle in tests/schedule_oracle.py), on many shapes: plain and
interleaved 1F1B, group sizes, forward only, offload on some ranks, layer-granular offload at p = 1, and both
posting orders."""
import itertools

import pytest

from h3t_ext.layout import LayoutError
from h3t_ext.costmodel.timeline import _compile
from h3t_ext.schedule.actions import ScheduleConfig
from h3t_ext.schedule.builder import build_rank_actions

import schedule_oracle as oracle


def _shapes():
    out = []
    for p, v, m, g in itertools.product((1, 2, 3, 4, 8), (1, 2, 3), (1, 2, 3, 4, 6, 8, 12, 16), (None, 2, 3, 5)):
        if g is not None and v == 1:
            continue
        for offload in ("none", "all", "some"):
            stages = None if offload != "some" else tuple(r % 2 == 1 or r == p - 1 for r in range(p))
            try:
                out.append(ScheduleConfig(p, m, v, microbatch_group_size_per_vp_stage=g, offload=offload != "none",
                                          offload_stages=stages))
            except LayoutError:
                continue
    out += [ScheduleConfig(p, m, v, forward_only=True) for p, v, m in ((1, 1, 3), (2, 1, 4), (4, 2, 8), (3, 3, 6))]
    for layers, alpha in itertools.product((1, 2, 5), (0.0, 0.3, 0.5, 1.0)):  # layer-granular offload (p = 1)
        out.append(ScheduleConfig(1, 4, offload=alpha > 0, offload_alphas=(alpha,), num_layers_per_chunk=layers))
    return out


SHAPES = _shapes()


def test_the_shapes_cover_the_cases():
    assert len(SHAPES) > 300
    assert sum(c.interleaved for c in SHAPES) > 100
    assert any(c.layer_granular and c.rank_offloaded_layers(0) > 1 for c in SHAPES)
    assert any(c.offload_stages is not None for c in SHAPES)


@pytest.mark.parametrize("early", [True, False])
def test_action_lists_equal_the_oracle(early):
    for cfg in SHAPES:
        want = oracle.rank_actions(cfg, early_receives=early)
        got = tuple(build_rank_actions(cfg, r, early_receives=early) for r in range(cfg.pipeline_model_parallel_size))
        assert got == want, cfg


@pytest.mark.parametrize("early", [True, False])
def test_timeline_programs_equal_the_oracle(early):
    for cfg in SHAPES:
        if cfg.forward_only:
            continue
        want = oracle.compile_lists(cfg, oracle.rank_actions(cfg, early_receives=early))
        assert oracle.canonical(_compile(cfg, early)) == oracle.timeline_program(cfg, want, early), cfg


def test_a_large_interleaved_shape_equals_the_oracle():
    """The size the planner prices (p = 16, m = 32, v = 3, every rank offloading)."""
    cfg = ScheduleConfig(16, 32, 3)
    want = oracle.rank_actions(cfg)
    assert tuple(build_rank_actions(cfg, r) for r in range(16)) == want
    assert oracle.canonical(_compile(cfg, True)) == oracle.timeline_program(cfg, oracle.compile_lists(cfg, want), True)
