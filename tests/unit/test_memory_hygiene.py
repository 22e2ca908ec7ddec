"""Megatron-LM's --manual-gc / --manual-gc-interval / --no-manual-gc-eval / --empty-unused-memory-level
(h3t_training.config.memory_hygiene): parsed from the flags, checked at start-up, and acting where Megatron's loop
acts."""
from __future__ import annotations

import gc

import pytest

from h3t_training.config.memory_hygiene import MemoryHygiene
from h3t_training.config.sections import parse_args
from parse_harness import BASE, _error


@pytest.fixture
def collections():
    """The generations of the collections that run while the test does."""
    seen = []

    def cb(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(cb)
    yield seen
    gc.callbacks.remove(cb)


def test_flags_are_parsed_as_megatron_names_them():
    h = MemoryHygiene.from_args(parse_args([*BASE, "--manual-gc", "--manual-gc-interval", "3", "--no-manual-gc-eval",
                                            "--empty-unused-memory-level", "2"], world_size=1), on_gpu=True)
    assert h == MemoryHygiene(manual_gc=True, manual_gc_interval=3, manual_gc_eval=False, empty_unused_memory_level=2,
                              on_gpu=True)
    assert MemoryHygiene.from_args(parse_args(BASE, world_size=1), on_gpu=False) == MemoryHygiene()
    assert not MemoryHygiene.from_args(parse_args([*BASE, "--disable-manual-gc-eval"], world_size=1),
                                       on_gpu=False).manual_gc_eval


@pytest.mark.parametrize("extra, expected", [
    (["--empty-unused-memory-level", "3"], "--empty-unused-memory-level 3 is not one of 0, 1, 2"),
    (["--manual-gc-interval", "-1"], "--manual-gc-interval -1 is outside [0, inf)"),
    (["--manual-gc-interval", "x"], "--manual-gc-interval 'x' is not an integer"),
])
def test_bad_values_are_one_line(extra, expected, capsys, monkeypatch):
    assert expected in _error([*BASE, *extra], capsys, monkeypatch)


def test_manual_gc_switches_the_collector_off_and_collects_at_the_interval(collections):
    h = MemoryHygiene(manual_gc=True, manual_gc_interval=2)
    assert gc.isenabled()
    with h.training():
        assert not gc.isenabled() and collections == [2]  # one full collection at the start
        for it in range(1, 6):
            h.after_iteration(it)
        assert collections == [2, 2, 2]  # after iterations 2 and 4
        with h.evaluation():
            assert collections == [2, 2, 2, 2]
        assert collections == [2, 2, 2, 2, 0]  # generation 0 after the evaluation
    assert gc.isenabled()


def test_without_manual_gc_nothing_is_collected_and_the_collector_stays_on(collections):
    for h in (MemoryHygiene(), MemoryHygiene(manual_gc=True, manual_gc_interval=0, manual_gc_eval=False)):
        with h.training():
            h.after_iteration(1)
            with h.evaluation():
                pass
        assert gc.isenabled()
    assert collections == [2]  # only the second one's start collection


def test_the_cuda_cache_is_emptied_at_the_levels_megatron_uses(monkeypatch):
    import torch

    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    for level, expected in ((0, 0), (1, 2), (2, 3)):
        emptied.clear()
        h = MemoryHygiene(empty_unused_memory_level=level, on_gpu=True)
        h.after_forward_backward(), h.after_optimizer_step(), h.after_eval_step()
        assert len(emptied) == expected, level
    emptied.clear()
    h = MemoryHygiene(empty_unused_memory_level=2, on_gpu=False)  # CPU: no cache
    h.after_forward_backward(), h.after_optimizer_step(), h.after_eval_step()
    assert emptied == []


def test_kwai_gc_interval_collects_the_youngest_generation_and_nothing_around_evaluations(collections):
    h = MemoryHygiene.from_args(parse_args([*BASE, "--kaimm-gc-interval", "2"], world_size=1), on_gpu=False)
    assert h == MemoryHygiene(manual_gc=True, manual_gc_interval=2, manual_gc_eval=False, manual_gc_generation=0)
    collections.clear()  # the automatic ones while parsing
    with h.training():
        assert not gc.isenabled()
        for it in range(1, 6):
            h.after_iteration(it)
        with h.evaluation():
            pass
    assert collections == [2, 0, 0]  # the start, then generation 0 after iterations 2 and 4
    assert gc.isenabled()


@pytest.mark.parametrize("extra, expected", [
    (["--kaimm-gc-interval", "-2"], "--kaimm-gc-interval -2 is outside [0, inf)"),
    (["--kaimm-gc-interval", "2.5"], "--kaimm-gc-interval '2.5' is not an integer in [0, inf)"),
    (["--kaimm-gc-interval", "9", "--manual-gc"], "--kaimm-gc-interval 9 (Megatron-Kwai's) and --manual-gc"),
])
def test_bad_kwai_gc_interval_is_one_line(extra, expected, capsys, monkeypatch):
    assert expected in _error([*BASE, *extra], capsys, monkeypatch)
