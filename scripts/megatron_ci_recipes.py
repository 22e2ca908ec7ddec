#!/usr/bin/env python3
"""Copy Megatron-LM's own GPT CI recipes into the project as test data (tests/data/megatron_ci_recipes.json).

Reads ``tests/functional_tests/test_cases/gpt/*/model_config.yaml`` of a local bare mirror of
https://github.com/NVIDIA/Megatron-LM at a pinned commit and writes, for every recipe directory, either the
recipe (name, source path and commit, TEST_TYPE, every MODEL_ARGS* mapping exactly as published: keys in
order, values as the YAML text gives them, YAML merge keys expanded as Megatron's launcher's ``yq explode``
does) or why it is not a dense GPT training recipe. The suite ``tests/integration/test_megatron_ci_recipes.py``
reads only the written file, never the mirror. Run once per pin::

    scripts/megatron_ci_recipes.py --mirror /work/.mirror/NVIDIA+Megatron-LM/repo

The ``expect`` field of each recipe (the outcome the suite asserts) is written by hand and kept when the file
is regenerated.

Selection rule ("dense GPT training recipe"): a recipe directory with a model_config.yaml whose MODE is
pretraining (absent = pretraining), whose name is not an inference/grpo/server recipe, and whose MODEL_ARGS
do not pass ``--num-experts`` (MoE). Everything else in the directory (gdn, mla, dsa, modelopt distillation,
FIM data, FP8, FSDP, reruns, release and memory/speed recipes) is selected: it must train or be refused in one
line for a reason the flag rule allows.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "megatron_ci_recipes.json")
PIN = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
RECIPES_DIR = "tests/functional_tests/test_cases/gpt"
RULE = [
    "Megatron-LM's GPT CI recipes (tests/functional_tests/test_cases/gpt/*/model_config.yaml) at the commit below.",
    "A dense GPT training recipe: MODE pretraining (or absent), not an inference / grpo / server recipe (they do "
    "not train: MODE inference or rl), and no --num-experts in MODEL_ARGS (MoE). Directories without a "
    "model_config.yaml are listed under 'excluded' too.",
    "All other recipes are selected, whatever features they use (gdn, mla, dsa, modelopt distillation, FIM "
    "data, FP8, FSDP, reruns, release, memory/speed): each must train or be refused in one line for a reason "
    "the flag rule allows (the 'expect' field).",
    "model_args: the recipe's MODEL_ARGS as published (keys in order, values as YAML text, merge keys expanded); "
    "more_model_args: further MODEL_ARGS_N of checkpoint-consistency recipes.",
    "expect: 'trains', or 'refused: <a substring of the one-line reason>' (written by hand, kept on regeneration).",
    "Written by scripts/megatron_ci_recipes.py; the suite is tests/integration/test_megatron_ci_recipes.py.",
]


def _git(mirror: str, *args: str) -> str:
    return subprocess.run(["git", "-C", mirror, *args], check=True, capture_output=True, text=True).stdout


def _pairs(mapping) -> list[list[str]]:
    """A MODEL_ARGS mapping as [key, value] pairs, values as their YAML text (BaseLoader keeps ``.01`` and
    ``1e-2`` as written); a ``<<`` merge key puts the merged mapping's entries first, overridden by later keys."""
    out: dict[str, str] = {}
    for k, v in mapping.items():
        if k == "<<":
            for mk, mv in _pairs(v):
                out[mk] = mv
        else:
            out.pop(k, None)
            out[k] = v if isinstance(v, str) else json.dumps(v)
    return [[k, v] for k, v in out.items()]


def _excluded_reason(name: str, doc) -> str | None:
    if not doc:
        return "no model_config.yaml (or an empty one)"
    mode = doc.get("MODE", "pretraining")
    if mode != "pretraining":
        return f"not training (MODE {mode})"
    if any(w in name for w in ("inference", "grpo", "server")):
        return "not training (an inference recipe by its name)"
    if "--num-experts" in (doc.get("MODEL_ARGS") or {}):
        return "MoE (--num-experts)"
    return None


def collect(mirror: str, commit: str) -> tuple[list[dict], dict[str, str]]:
    names = sorted(p.rsplit("/", 1)[1] for p in _git(mirror, "ls-tree", "--name-only", commit, RECIPES_DIR + "/").split())
    recipes, excluded = [], {}
    for name in names:
        path = f"{RECIPES_DIR}/{name}/model_config.yaml"
        try:
            text = _git(mirror, "show", f"{commit}:{path}")
        except subprocess.CalledProcessError:
            text = ""
        doc = yaml.load(text, Loader=yaml.BaseLoader) if text else None
        reason = _excluded_reason(name, doc)
        if reason:
            excluded[name] = reason
            continue
        more = {k: _pairs(v) for k, v in doc.items() if k.startswith("MODEL_ARGS_")}
        rec = {"name": name, "path": path, "test_type": doc.get("TEST_TYPE", "regular"),
               "model_args": _pairs(doc["MODEL_ARGS"])}
        if more:
            rec["more_model_args"] = more
        recipes.append(rec)
    return recipes, excluded


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mirror", required=True, help="a bare git mirror of NVIDIA/Megatron-LM")
    ap.add_argument("--commit", default=PIN)
    ap.add_argument("--output", default=OUT)
    a = ap.parse_args(argv)
    recipes, excluded = collect(a.mirror, a.commit)
    old = {}
    if os.path.exists(a.output):
        with open(a.output) as f:
            old = {r["name"]: r.get("expect") for r in json.load(f)["recipes"]}
    for r in recipes:
        if old.get(r["name"]):
            r["expect"] = old[r["name"]]
    data = {"rule": RULE, "source": {"repository": "https://github.com/NVIDIA/Megatron-LM", "commit": a.commit,
                                     "directory": RECIPES_DIR},
            "counts": {"directories": len(recipes) + len(excluded), "selected": len(recipes),
                       "excluded": len(excluded)},
            "excluded": excluded, "recipes": recipes}
    text = json.dumps(data, indent=1)
    # one [key, value] pair a line
    text = re.sub(r'\[\s*("(?:[^"\\]|\\.)*"),\s*("(?:[^"\\]|\\.)*")\s*\]', r"[\1, \2]", text)
    with open(a.output, "w") as f:
        f.write(text + "\n")
    print(f"{len(recipes)} recipes selected, {len(excluded)} excluded -> {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
