"""Test tiers, one folder each; every test carries its folder's marker.

* ``tests/unit``: pure and fast (the cost model, planner, layout, schedule builder, configuration and the
  runtime's single-process pieces); ``pytest tests/unit`` is the quick check of a change (under 3 minutes on
  2 cores).
* ``tests/integration``: multi-process gloo runs, the driver and launchers end to end, small models, the
  calibration against published runs.
* ``tests/gpu``: needs a CUDA GPU (``scripts/gpu_check.sh`` runs ``-m gpu``); skipped without one.

``pytest tests`` (the README's command, which CI runs) runs all three but the slow tier: tests marked ``slow``
(long end-to-end runs whose behaviour a faster test of the default tier also covers) and the recipe launches beyond
the covering 17; ``pytest tests --run-slow`` runs everything. ``-m unit`` / ``-m "not integration"`` select by
marker. The shared harnesses (``driver_harness.py``, ``gpt_harness.py``, ...) stay in ``tests/`` and are
importable from every tier.
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TIERS = ("unit", "integration", "gpu")


@pytest.fixture(scope="session")
def corpus_prefix(tmp_path_factory) -> str:
    """The stdlib corpus as an indexed dataset (``driver_harness.make_corpus_data``), built once per session: about
    10 s on 2 cores, read by two dozen modules and written by none. Defined here, not imported into the modules: a
    fixture imported into a module is a separate instance per module, whatever its scope."""
    from driver_harness import make_corpus_data

    return make_corpus_data(tmp_path_factory.mktemp("corpus"))


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the slow tier: the tests marked slow (long end-to-end runs) and all 84 launches of "
                          "Megatron-LM's CI recipes (default: the 17 that cover every flag and outcome)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = os.path.relpath(str(item.path), HERE).split(os.sep)[0]
        if tier in TIERS:
            item.add_marker(tier)
    if not config.getoption("run_slow"):  # deselected, and counted as such in the summary
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
