"""The hand-written system file of docs/system-files.md: it loads, prices, and every field of it is checked
one by one (a wrong value is one line naming the field and its valid range)."""
from __future__ import annotations

import json
import math
import os
import re

import pytest

from h3t_ext.costmodel import Plan, estimate, get_model, get_system
from h3t_ext.costmodel.schema import SYSTEM_FIELDS
from h3t_ext.costmodel.specs import load_system_file
from h3t_ext.planner.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(REPO, "docs", "system-files.md")
RUN = ["--model", "llama2-70b", "--seq-length", "4096", "--num-gpus", "64", "--global-batch-size", "512",
       "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2", "--json"]


def _doc_example() -> dict:
    text = open(DOC, encoding="utf-8").read()
    block = re.search(r"system-file-example.*?```json\n(.*?)```", text, re.S)
    assert block, "docs/system-files.md lost its example block"
    return json.loads(block.group(1))


def _write(tmp_path, d) -> str:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(d))
    return str(path)


def test_every_checked_field_is_documented():
    table = open(DOC, encoding="utf-8").read()
    for rule in SYSTEM_FIELDS:
        assert f"`{rule.name}`" in table, rule.name


def test_the_example_loads_and_differs_from_h100_where_it_says(tmp_path, capsys):
    path = _write(tmp_path, _doc_example())
    system = load_system_file(path)
    h100 = get_system("h100-sxm")
    assert system.hbm_bytes == 96 * 2**30 and system.network_bandwidth == h100.network_bandwidth / 2
    model = get_model("llama2-70b")
    plan = Plan(num_gpus=64, seq_length=4096, global_batch_size=512, tensor_model_parallel_size=8,
                pipeline_model_parallel_size=2)
    mine, theirs = estimate(model, plan, system), estimate(model, plan, h100)
    assert mine.memory_budget_bytes - theirs.memory_budget_bytes == pytest.approx(16 * 2**30 / 1.05, rel=1e-6)
    assert mine.tokens_per_second < theirs.tokens_per_second  # half the network: slower data-parallel traffic
    assert main(["estimate", "--system-file", path, *RUN]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is True


def _bad_values(rule):
    yield "text"
    yield None
    yield -1 if rule.minimum_inclusive else 0
    if rule.integer:
        yield 1.5
    if rule.maximum is not None:
        yield rule.maximum + (1 if rule.maximum_inclusive else 0)


@pytest.mark.parametrize("rule", SYSTEM_FIELDS, ids=lambda r: r.name)
def test_each_field_of_the_example_is_checked(tmp_path, capsys, rule):
    for bad in _bad_values(rule):
        d = _doc_example()
        d[rule.name] = bad
        if bad is None and not rule.required:
            continue
        code = main(["estimate", "--system-file", _write(tmp_path, d), *RUN])
        err = capsys.readouterr().err
        assert code == 2, (rule.name, bad)
        assert len(err.strip().splitlines()) == 1 and rule.name in err and "must be" in err, err
    d = _doc_example()
    d[rule.name] = math.inf  # json writes Infinity, which Python's json reads back
    assert main(["estimate", "--system-file", _write(tmp_path, d), *RUN]) == 2
    assert rule.name in capsys.readouterr().err


def test_unknown_efficiency_set_is_one_line(tmp_path, capsys):
    d = _doc_example()
    d["efficiency_set"] = "rubin"
    assert main(["estimate", "--system-file", _write(tmp_path, d), *RUN]) == 2
    err = capsys.readouterr().err
    assert "efficiency_set" in err and "hopper" in err and len(err.strip().splitlines()) == 1
