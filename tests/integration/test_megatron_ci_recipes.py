"""Megatron-LM's own GPT CI recipes run through this project's pretrain_gpt.py, as Megatron's CI runs them.

The recipes are ``tests/functional_tests/test_cases/gpt/*/model_config.yaml`` of NVIDIA/Megatron-LM at the
commit recorded in ``tests/data/megatron_ci_recipes.json`` (copied there by ``scripts/megatron_ci_recipes.py``;
this suite reads only the copy). Selected: every *dense GPT training recipe*, i.e. every recipe directory whose
MODE is pretraining, that is not an inference/grpo/server recipe and whose MODEL_ARGS have no
``--num-experts`` (MoE): 156 of the 208 directories (38 inference, 6 rl, 1 inference by name, 5 MoE and 2
without a model_config.yaml are not). The others (gdn-free dense models with MLA, DSA, modelopt distillation,
FIM data, FP8, FSDP, reruns, release and memory/speed recipes) are selected: each must train or be refused.

Each recipe's MODEL_ARGS become the command line as Megatron's launcher builds it (``megatron_recipes.py``),
shrunk only in model size, iterations (2, or 4 for ``ckpt-resume``; one evaluation step), micro/global batch,
paths (the stdlib corpus made here, a byte-level GPT-2 vocabulary, a SentencePiece model trained here, tmp
directories) and data-parallel size (the recipe's own t x p x c with d = 1, or d = 2 where that is 1 rank or
the recipe asks for 2 distributed-optimizer instances); the backend, precision, layout (t, p, c, virtual and
uneven stages) and every other flag are the recipe's own. Each is launched with torchrun and per-rank log files
(``--redirects 3``) as Megatron's CI does, and asserts the outcome recorded in the data:

* ``trains``: exit 0 and a finite loss for every shrunk iteration;
* ``refused: <reason>``: every rank exits 2 with no traceback, and rank 0 alone writes exactly one line
  (``pretrain_gpt.py: error: ...``) containing the reason; the allowed reasons are MoE, a model feature not
  implemented, or a flag without which the result would differ (the rule of ``flag_table.py``).

``ckpt-resume`` recipes run as Megatron's ``run_ci_test.sh`` runs them: to N = 4 saving every N/2, then the
tracker is set back to N/2 (the last checkpoint removed) and a second launch resumes from it to N; the resumed
iterations' losses must equal the uninterrupted run's exactly. ``frozen-start``, ``frozen-resume``,
``release`` and ``checkpoint-consistency`` recipes need checkpoints from Megatron's CI storage; here they run
once from an empty ``--load`` directory, as their first run does (for checkpoint-consistency: its MODEL_ARGS,
not its further MODEL_ARGS_N). Recipes that run the same run share one launch (:func:`run_key`: their shrunk
flags are equal once the flags the driver notices on CPU, which by the flag table's rule give the same result, are
set aside; the ``_1node`` twins, the logging, data-loader and kernel-tuning variants): 156 recipes, 84 runs, 31
of them ckpt-resume (a group with a ckpt-resume recipe runs as one), 115 launches.

Outcomes at the pin (``expect``): 144 train (56 of them ckpt-resume recipes, resumed exactly; the 4 release
recipes with --squared-relu, their W&B logging left out: :data:`megatron_recipes.WANDB_PREFIX`), 12 are refused:
MLA/DSA (3), FIM data (2), muP (1) -- model or data features not implemented; Megatron FSDP, which needs CUDA (2); torch FSDP2 with tied embeddings (1);
--attention-dropout 0.1 with context parallelism on CPU (1); Megatron's post-training (ModelOpt) distillation
flags (--export-kd-*, --export-te-mcore-model: 2).
"""
from __future__ import annotations

import collections
import json
import math
import re
import subprocess

import pytest

from driver_harness import make_corpus_data
from h3t_training.config.flag_table import CPU, TABLE, reason_on
from megatron_recipes import Paths, command_line, launch, load, shrink, world_size

DATA = load()
RESUME_ITERS, ITERS = 4, 2


KEY_PATHS = Paths("corpus", "vocab.json", "merges.txt", "sp.model", "save", "load", "tb", "cache")


def run_key(recipe: dict) -> str:
    """What decides a recipe's run: its shrunk flags without those the driver notices on CPU (the flag table's
    rule: a noticed flag gives the same result, so recipes that differ only in noticed flags run the same run)."""
    kept = [(k, v) for k, v in shrink(recipe["model_args"], KEY_PATHS, RESUME_ITERS)
            if k not in TABLE or reason_on(TABLE[k], CPU).cls != "noticed"]
    return json.dumps(sorted(kept))


def _groups() -> dict[str, list[dict]]:
    """Recipes that run the same run (:func:`run_key`), keyed by the name of the one launched: a ckpt-resume
    recipe where the group has one (its first launch trains the others' iterations and more), else the first."""
    by_run: dict[str, list[dict]] = collections.defaultdict(list)
    for r in DATA["recipes"]:
        by_run[run_key(r)].append(r)
    out = {}
    for rs in by_run.values():
        rs = sorted(rs, key=lambda r: r["test_type"] != "ckpt-resume")
        out[rs[0]["name"]] = rs
    return out


GROUPS = _groups()


def features(recipe: dict) -> frozenset[str]:
    """What a recipe's launch exercises: every flag it keeps (:func:`run_key`; the layout flags among them), its
    outcome and whether it resumes."""
    flags = {f"flag {k}" for k, _ in json.loads(run_key(recipe))}
    return frozenset(flags | {f"outcome {recipe['expect']}", f"ckpt-resume {recipe['test_type'] == 'ckpt-resume'}"})


def covering_groups(groups: dict[str, list[dict]]) -> list[str]:
    """The launches CI runs by default: a greedy set cover of :func:`features` over the groups (each step takes the
    group adding the most features not yet covered, the cheaper launch on a tie: fewer ranks, no resume), so that
    every flag and outcome of the recipe set runs at least once. ``pytest --run-slow`` runs every group."""
    cost = {n: world_size(rs[0]["model_args"]) * (2 if rs[0]["test_type"] == "ckpt-resume" else 1)
            for n, rs in groups.items()}
    feats = {n: features(rs[0]) for n, rs in groups.items()}
    left, chosen = set().union(*feats.values()), []
    while left:
        best = max(sorted(feats), key=lambda n: (len(feats[n] & left), -cost[n]))
        chosen.append(best)
        left -= feats[best]
    return sorted(chosen)


COVER = covering_groups(GROUPS)


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ == "test_recipe":
        metafunc.parametrize("name", sorted(GROUPS) if metafunc.config.getoption("run_slow") else COVER)


def test_recipe_data_counts():
    """The selection and the recorded outcomes: a change in either fails here (and in the launches below)."""
    assert DATA["source"]["commit"] == "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
    assert DATA["counts"] == {"directories": 208, "selected": 156, "excluded": 52}
    assert collections.Counter(DATA["excluded"].values()) == {
        "not training (MODE inference)": 38, "not training (MODE rl)": 6, "MoE (--num-experts)": 5,
        "no model_config.yaml (or an empty one)": 2, "not training (an inference recipe by its name)": 1}
    assert len(GROUPS) == 84 and sum(rs[0]["test_type"] == "ckpt-resume" for rs in GROUPS.values()) == 31
    outcomes = collections.Counter(r["expect"].split(":")[0] for r in DATA["recipes"])
    assert outcomes == EXPECTED_OUTCOMES
    for rs in GROUPS.values():  # recipes sharing a launch share its outcome
        assert len({r["expect"] for r in rs}) == 1, [r["name"] for r in rs]
    assert sum(r["test_type"] == "ckpt-resume" for r in DATA["recipes"]) == 62
    # the default launches cover every flag, outcome and test type of the 84 (pytest --run-slow: all)
    assert set().union(*(features(GROUPS[n][0]) for n in COVER)) == set().union(*map(features, DATA["recipes"]))
    assert len(COVER) == 17 and {GROUPS[n][0]["expect"] for n in COVER} >= {r["expect"] for r in DATA["recipes"]}


EXPECTED_OUTCOMES = {"trains": 144, "refused": 12}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The stdlib corpus, a byte-level GPT-2 vocabulary (257 tokens, no merges) and a SentencePiece model."""
    import sentencepiece
    from tokenizers import pre_tokenizers

    d = tmp_path_factory.mktemp("recipes")
    prefix = make_corpus_data(d)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n")
    texts = [json.loads(line)["text"] for line in (d / "corpus.jsonl").read_text().splitlines()]
    (d / "corpus.txt").write_text("\n".join(texts))
    sentencepiece.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "sp"),
                                             vocab_size=300, minloglevel=2)
    return {"prefix": prefix, "vocab": str(d / "vocab.json"), "merges": str(d / "merges.txt"),
            "sp": str(d / "sp.model")}


def _run(recipe: dict, files: dict, d, iters: int, save_interval, load_dir=None):
    paths = Paths(files["prefix"], files["vocab"], files["merges"], files["sp"], str(d / "save"),
                  str(load_dir or d / "load"), str(d / "tb"), str(d / "cache"))
    env = {"DATA_PATH": str(d / "data"), "CHECKPOINT_SAVE_PATH": paths.save, "CHECKPOINT_LOAD_PATH": paths.load,
           "TENSORBOARD_PATH": paths.tensorboard, "DATA_CACHE_PATH": paths.data_cache, "REPEAT": "1",
           "WANDB_EXPERIMENT": recipe["name"], "WANDB_SAVE_PATH": str(d / "wandb")}
    metrics = d / f"metrics_{'resumed' if load_dir else 'first'}.json"
    argv = command_line(shrink(recipe["model_args"], paths, iters, save_interval), env)
    result = launch([*argv, "--metrics-json", str(metrics)], world_size(recipe["model_args"]),
                    d / f"logs_{'resumed' if load_dir else 'first'}")
    return result, metrics


def _losses(metrics) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in json.loads(metrics.read_text())["iterations"]}


def _check_refused(result, reason: str):
    """Rank 0 wrote one line and exited 2 (torchrun's root cause), no rank wrote a traceback or anything else on
    stderr. torchrun's own report (its ChildFailedError traceback, the ranks it stopped) is torchrun's."""
    ranks = "".join(result.rank_stderr) + "".join(result.rank_stdout)
    assert result.returncode != 0 and "Traceback" not in ranks, ranks[-3000:]
    root = result.report[result.report.index("Root Cause"):]
    assert re.search(r"rank\s*:\s*0 \(local_rank: 0\)\s*exitcode\s*:\s*2 ", root), result.report[-2000:]
    lines = result.rank_stderr[0].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), result.rank_stderr[0][-3000:]
    assert reason in lines[0], lines[0]
    assert all(e.strip() == "" for e in result.rank_stderr[1:]), result.rank_stderr


def test_recipe(name, files, tmp_path):
    recipe = GROUPS[name][0]
    expect = recipe["expect"]
    resume = recipe["test_type"] == "ckpt-resume"
    iters = RESUME_ITERS if resume else ITERS
    result, metrics = _run(recipe, files, tmp_path, iters, iters // 2 if resume else None)
    if expect.startswith("refused: "):
        _check_refused(result, expect[len("refused: "):])
        return
    assert expect == "trains"
    assert result.returncode == 0, "\n".join(e[-3000:] for e in result.rank_stderr if e.strip())
    first = _losses(metrics)
    assert sorted(first) == list(range(1, iters + 1)) and all(math.isfinite(x) for x in first.values()), first
    if not resume:
        return
    save = tmp_path / "save"  # run_ci_test.sh: drop the last checkpoint, point the tracker at N/2, resume
    subprocess.run(["rm", "-rf", str(save / f"iter_{iters:07d}")], check=True)
    assert (save / f"iter_{iters // 2:07d}").is_dir()
    (save / "latest_checkpointed_iteration.txt").write_text(f"{iters // 2}\n")
    result, metrics = _run(recipe, files, tmp_path, iters, iters // 2, load_dir=save)
    assert result.returncode == 0, "\n".join(e[-3000:] for e in result.rank_stderr if e.strip())
    resumed = _losses(metrics)
    assert resumed == {i: first[i] for i in range(iters // 2 + 1, iters + 1)}, (resumed, first)
