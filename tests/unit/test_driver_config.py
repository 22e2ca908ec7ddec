"""The driver's configuration is built once and frozen: every resolution step returns a new config."""
from __future__ import annotations

import ast
import pathlib
import pickle
import re

import pytest

from h3t_training.config.arguments import LLAMA_DEFAULTS, build_parser
from h3t_training.loop.checkpointing import _check_schedule
from h3t_training.config.sections import FrozenConfigError, TrainConfig, parse_args, resolve

REPO = pathlib.Path(__file__).resolve().parents[2]
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--mock-data"]


def test_the_parsed_config_is_frozen_and_replace_makes_a_new_one():
    config = parse_args(BASE + ["--pipeline-model-parallel-size", "2"], world_size=2)
    assert isinstance(config, TrainConfig)
    with pytest.raises(FrozenConfigError, match="num_layers cannot be set"):
        config.num_layers = 8
    with pytest.raises(FrozenConfigError):
        del config.lr
    changed = config.replace(lr=2e-3)
    assert changed.lr == 2e-3 and config.lr == 1e-3 and changed.num_layers == config.num_layers
    assert getattr(config, "no_such_field", "default") == "default"
    assert pickle.loads(pickle.dumps(config)) == config  # spawned workers get an equal copy


def test_resolution_derives_sizes_without_touching_its_input():
    parsed = build_parser(defaults=LLAMA_DEFAULTS).parse_args(BASE + ["--pipeline-model-parallel-size", "2",
                                               "--num-virtual-stages-per-pipeline-rank", "2"])
    before = TrainConfig.from_namespace(parsed, world_size=4, flag_notices=())
    snapshot = before.as_dict()
    after = resolve(before)
    assert before.as_dict() == snapshot  # nothing was changed in place
    assert snapshot["data_parallel_size"] is None and before.num_layers_per_virtual_pipeline_stage is None
    assert (after.data_parallel_size, after.num_microbatches, after.virtual_pipeline_model_parallel_size) == (2, 4, 2)
    assert after.num_layers_per_virtual_pipeline_stage == 1 and after.ffn_hidden_size == 128  # SwiGLU: int(4h x 2/3 / 64) x 64


def test_auto_plan_returns_a_new_config(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")  # the planner's line is printed on rank 0 only
    argv = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096",
            "--global-batch-size", "64", "--train-iters", "10", "--lr", "1e-4", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--gpu", "h800", "--auto-plan"]
    before = TrainConfig.from_namespace(build_parser(defaults=LLAMA_DEFAULTS).parse_args(argv), world_size=8, flag_notices=())
    after = resolve(before)
    assert before.tensor_model_parallel_size is None and before.ckpt is None
    t, c, p = after.tensor_model_parallel_size, after.context_parallel_size, after.pipeline_model_parallel_size
    assert t * c * p * after.data_parallel_size == 8 and after.ckpt in ("no", "full", "ours")
    assert after.auto_plan_flags and "--tensor-model-parallel-size" in " ".join(after.auto_plan_flags)
    assert capsys.readouterr().out == ""


def test_the_schedule_check_counts_samples_as_megatron_cores_scheduler():
    """megatron-core's OptimizerParamScheduler checks the warm-up and decay in samples: an iteration-based run resumed
    at another global batch has another schedule (refused without --override-opt_param-scheduler), a sample-based
    one keeps its schedule although its derived --lr-decay-iters changes."""
    from h3t_training.loop.checkpointing import CheckpointError, _schedule

    def run(batch, *extra):
        argv = [a for a in BASE if a not in ("--global-batch-size", "8", "--train-iters", "2")]
        return parse_args([*argv, "--global-batch-size", str(batch), *extra], world_size=1)

    iters = ("--train-iters", "20", "--lr-warmup-iters", "2")
    saved = _schedule(run(4, *iters))
    assert (saved["lr_warmup_steps"], saved["lr_decay_steps"]) == (8, 80)
    with pytest.raises(CheckpointError, match=re.escape("was trained with a learning-rate warmup of 8 samples, this "
                                                        "run has 16")):
        _check_schedule(run(8, *iters), saved, 10)
    assert _check_schedule(run(8, *iters, "--override-opt_param-scheduler"), saved, 10) == {}
    adopted = _check_schedule(run(8, *iters, "--use-checkpoint-opt_param-scheduler"), saved, 10)
    assert (adopted["lr_warmup_steps"], adopted["lr_decay_steps"]) == (8, 80)
    samples = ("--train-samples", "96", "--lr-decay-samples", "96", "--lr-warmup-samples", "8")
    saved = _schedule(run(4, *samples))
    assert saved["lr_decay_iters"] != _schedule(run(8, *samples))["lr_decay_iters"]
    assert _check_schedule(run(8, *samples), saved, 10) == {}


def test_a_warm_up_fraction_saved_in_whole_samples_resumes():
    """Earlier versions of this driver saved a --lr-warmup-fraction warm-up truncated to whole samples; Megatron-LM
    saves the product (a float), as the driver now does: both resume, another warm-up does not."""
    from h3t_training.loop.checkpointing import CheckpointError, _schedule

    config = parse_args([*BASE[:-5], "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--lr-warmup-fraction",
                         "0.33"], world_size=1)
    saved = _schedule(config)
    assert saved["lr_warmup_steps"] == 0.33 * 80  # 26.4 samples
    assert _check_schedule(config, saved, 5) == {}
    assert _check_schedule(config, {**saved, "lr_warmup_steps": 26}, 5) == {}
    with pytest.raises(CheckpointError, match="was trained with a learning-rate warmup of 25 samples"):
        _check_schedule(config, {**saved, "lr_warmup_steps": 25}, 5)


def test_a_checkpoint_schedule_is_returned_not_written_into_the_config():
    config = parse_args(BASE, world_size=1).replace(use_checkpoint_opt_param_scheduler=True)
    saved = {"lr": 5e-4, "min_lr": 0.0, "lr_decay_style": "linear"}
    assert _check_schedule(config, saved, 7) == saved
    assert config.lr == 1e-3


def _module_name(path: pathlib.Path, base: pathlib.Path) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, name: str, modules: set[str]) -> set[str]:
    """The modules in ``modules`` that module ``name`` (the file ``path``) imports, at the top or inside a
    function, absolute or relative (``from . import x``, ``from .x import y``, ``from ..x import y``);
    ``from pkg import sub`` is an import of the submodule ``pkg.sub`` when there is one, else of ``pkg``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level > len(parts):
                    continue  # beyond the top-level package: not one of ours
                base = ".".join(parts[:len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found & modules


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module name -> the modules of the same package it imports, for the package directory ``root``."""
    files = {_module_name(f, root.parent): f for f in sorted(root.rglob("*.py"))}
    return {m: _imports(f, m, set(files)) - {m} for m, f in files.items()}


def import_cycles(root: pathlib.Path) -> list[list[str]]:
    """One import cycle (module names, the first repeated at the end) per strongly connected group of the
    package directory ``root``'s modules; empty when the imports form no cycle."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while v not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for group in groups:  # the shortest way round from the group's first module back to itself
        start = min(group)
        paths = {start: [start]}
        todo = [start]
        while todo:
            v = todo.pop(0)
            if start in graph[v]:
                cycles.append(paths[v] + [start])
                break
            for w in sorted(graph[v] & group):
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    todo.append(w)
    return sorted(cycles)


@pytest.mark.parametrize("package", ["h3t_training", "h3t_ext"])
def test_no_import_cycles(package):
    cycles = import_cycles(REPO / package)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_cycle_check_sees_relative_function_level_and_submodule_imports(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        # (a) a cycle closed by a relative import inside a function
        "pkg/a.py": "from .b import helper\nTHING = 1\n",
        "pkg/b.py": "def helper():\n    from .a import THING\n    return THING\n",
        # (b) a cycle through `from pkg import submodule` (absolute one way, relative the other)
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from pkg.sub import d\n",
        "pkg/sub/d.py": "from . import c\nfrom ..a import THING\n",
        # no cycle: imports of the package namespace and of a module that imports nothing of ours
        "pkg/e.py": "import os\nfrom . import a\nfrom .sub import c as _c\nfrom pkg import THING_NAME\n",
    })
    graph = import_graph(tmp_path / "pkg")
    assert graph["pkg.b"] == {"pkg.a"}  # function-level, relative
    assert graph["pkg.sub.d"] == {"pkg.sub.c", "pkg.a"}  # `from . import c` is the submodule; `..a` two up
    assert graph["pkg.sub.c"] == {"pkg.sub.d"}
    assert graph["pkg.e"] == {"pkg.a", "pkg.sub.c", "pkg"}
    assert import_cycles(tmp_path / "pkg") == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.sub.c", "pkg.sub.d", "pkg.sub.c"]]


def test_the_cycle_check_passes_a_package_without_cycles(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from . import b\n", "pkg/b.py": "def f():\n    return 1\n"})
    assert import_cycles(tmp_path / "pkg") == []


RUNTIME_FLOORS = ["config", "modules", "memory", "pipeline"]  # each may import only those before it


def test_the_runtime_floors_import_only_downwards():
    def floor(module: str):
        parts = module.split(".")
        return RUNTIME_FLOORS.index(parts[2]) if parts[:2] == ["h3t_ext", "runtime"] and len(parts) > 2 else None

    upward = [f"{m} -> {d}" for m, deps in import_graph(REPO / "h3t_ext").items() for d in sorted(deps)
              if floor(m) is not None and floor(d) is not None and floor(d) > floor(m)]
    assert not upward, "runtime imports running upwards: " + "; ".join(upward)


def test_the_driver_calls_the_runtime_it_holds():
    """Only Megatron's own loop (loop/megatron_native.py) attaches h3t-ext by installing it into megatron-core; the
    driver's loop and evaluation call the H3TSchedules they hold (nothing rebinds megatron-core's functions)."""
    calls = {}
    for path in sorted((REPO / "h3t_training").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name in ("install", "get_forward_backward_func"):
                    calls.setdefault(str(path.relative_to(REPO)), set()).add(name)
    assert calls == {"h3t_training/loop/megatron_native.py": {"install"}}, calls


def test_pretrain_gpt_requires_max_position_embeddings_as_megatron_lm_does(capsys):
    """Megatron-LM's validate_args requires --max-position-embeddings (its required_args, 0.16 to 0.19, and
    Megatron-Kwai's); pretrain_gpt.py stops without it, pretrain_llama.py fills it with --seq-length."""
    with pytest.raises(SystemExit) as e:
        parse_args(BASE, world_size=1, prog="pretrain_gpt.py")
    assert e.value.code == 2
    assert capsys.readouterr().err == ("pretrain_gpt.py: error: the following arguments are required: "
                                       "--max-position-embeddings (Megatron-LM's pretrain_gpt.py requires it; "
                                       "pretrain_llama.py fills --max-position-embeddings with --seq-length)\n")
    assert parse_args(BASE, world_size=1).max_position_embeddings == 64
    assert parse_args([*BASE, "--max-position-embeddings", "128"], world_size=1,
                      prog="pretrain_gpt.py").max_position_embeddings == 128


def test_padded_vocab_size_is_the_models_rows_as_in_megatron_lm(capsys):
    """--padded-vocab-size P: the model, its checkpoints and the cost model have P vocabulary rows (Megatron-LM pads
    only where it is None); below the tokenizer's tokens or not a multiple of t: one line."""
    from h3t_training.config.run_spec import model_spec
    from h3t_training.data.tokenizer import run_padded_vocab_size

    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--tensor-model-parallel-size", "2"]
    config = parse_args([*BASE, *null], world_size=2)
    v = config.tokenizer_vocab_size
    assert run_padded_vocab_size(config) == 512  # 128 x 2 by default
    config = parse_args([*BASE, *null, "--padded-vocab-size", "310"], world_size=2)
    assert run_padded_vocab_size(config) == 310 == model_spec(config, v).padded_vocab_size(2)
    for p, text in ((str(v - 1), f"--padded-vocab-size {v - 1} is below the tokenizer's {v} tokens; valid: a multiple "
                                 f"of --tensor-model-parallel-size 2 in [{v}, inf)"),
                    ("311", "--padded-vocab-size 311 is not a multiple of --tensor-model-parallel-size 2"),
                    ("0", "--padded-vocab-size 0 is outside [1, inf)")):
        with pytest.raises(SystemExit):
            parse_args([*BASE, *null, "--padded-vocab-size", p], world_size=2)
        assert text in capsys.readouterr().err


def test_split_left_out_is_resolved_as_megatron_resolves_it():
    """No --split: megatron-core's even 1,1,1 with --mock-data (so mock data evaluates, as in Megatron), nothing
    with per-split paths; an explicit split keeps its value (quotes from a shell string dropped)."""
    mock = parse_args(BASE, world_size=1)
    assert mock.split == "1,1,1"
    from h3t_training.data.datasets import splits_wanted
    assert splits_wanted(mock) == (True, True)
    assert splits_wanted(parse_args([*BASE, "--eval-iters", "0"], world_size=1)) == (False, False)
    given = parse_args([*BASE, "--split", "'99,1,0'"], world_size=1)
    assert given.split == "99,1,0" and splits_wanted(given) == (True, False)
    assert not any("--split" in n for n in mock.flag_notices)


def test_data_path_without_split_takes_megatrons_legacy_default_with_its_notice(monkeypatch):
    from h3t_training.config import megatron_compat

    args = parse_args(BASE, world_size=1).replace(mock_data=False, data_path=["corpus"], split=None)
    out = megatron_compat._split(args)
    assert out["split"] == megatron_compat.MEGATRON_LEGACY_SPLIT == "969,30,1"
    assert [n for n in out["flag_notices"] if "--split" in n] == [
        "note: --split not given with --data-path: Megatron-LM's legacy default 969,30,1 (train,valid,test), as "
        "Megatron-LM uses it"]
    per_split = args.replace(data_path=None, train_data_path=["corpus"])
    assert megatron_compat._split(per_split) == {}


def test_ckpt_format_torch_is_megatrons_legacy_format_and_one_without_its_files_is_one_line(tmp_path, capsys):
    """--ckpt-format torch is accepted without a notice (the driver writes Megatron's legacy files); other values
    name the valid ones; a legacy mp_rank_XX directory without this driver's common.pt (Megatron-LM wrote it) is read
    from its model_optim_rng.pt: a missing one, or one without Megatron-LM's args, is one line."""
    import argparse

    import torch
    from h3t_training.loop.checkpointing import TRACKER, CheckpointError, find_checkpoint

    args = parse_args([*BASE, "--ckpt-format", "torch", "--load", str(tmp_path)], world_size=1)
    assert not [n for n in args.flag_notices if "--ckpt-format" in n]
    for extra, line in ((["--ckpt-format", "tar"], "--ckpt-format tar: the valid values are torch_dist, torch\n"),
                        (["--ckpt-format", "torch", "--use-torch-fsdp2", "--save", str(tmp_path)],
                         "--ckpt-format torch with --use-torch-fsdp2: Megatron's legacy per-rank files")):
        with pytest.raises(SystemExit):
            parse_args([*BASE, *extra], world_size=1)
        assert line in capsys.readouterr().err
    (tmp_path / TRACKER).write_text("10")
    rank_dir = tmp_path / "iter_0000010" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    with pytest.raises(CheckpointError) as e:
        find_checkpoint(args, rank=0)
    assert str(e.value) == f"checkpoint file {rank_dir / 'model_optim_rng.pt'} is missing" and e.value.alike
    torch.save({"iteration": 10, "model": {}}, rank_dir / "model_optim_rng.pt")
    with pytest.raises(CheckpointError, match="has no Megatron-LM 'args' entry") as e:
        find_checkpoint(args, rank=0)
    torch.save({"iteration": 10, "args": argparse.Namespace(num_layers=4)}, rank_dir / "model_optim_rng.pt")
    with pytest.raises(CheckpointError) as e:
        find_checkpoint(args, rank=0)
    assert str(e.value) == (f"checkpoint file {rank_dir / 'model_optim_rng.pt'} (written by Megatron-LM) has no "
                            "field 'hidden_size' in its args; it cannot be checked against this run")


def _megatron_args(saved, **changes):
    """Megatron-LM's args Namespace of the run ``saved`` (its argparse destinations, and the fields its
    validate_args and training fill in), with ``changes``."""
    import argparse
    from h3t_training.data.tokenizer import run_padded_vocab_size
    from h3t_training.loop.checkpointing import LAYOUT_FLAGS, SCHEDULE_FLAGS

    names = ("num_layers", "hidden_size", "num_attention_heads", "group_query_attention", "num_query_groups",
             "ffn_hidden_size", "tokenizer_type", "vocab_size", "global_batch_size", *LAYOUT_FLAGS, *SCHEDULE_FLAGS)
    fields = {k: getattr(saved, k) for k in names}
    fields.update(padded_vocab_size=run_padded_vocab_size(saved), consumed_train_samples=80, no_save_optim=False,
                  no_save_rng=False, group_query_attention=False, num_query_groups=1)  # Megatron's: no GQA
    return argparse.Namespace(**{**fields, **changes})


def test_a_checkpoint_megatron_lm_wrote_is_checked_from_its_args(tmp_path):
    """megatron_written_common derives the 'h3t' section from Megatron-LM's args (num_query_groups: the heads without
    --group-query-attention), so find_checkpoint checks its layout, model shape and schedule as this driver's own;
    on CPU the optimizer state needs --no-load-optim or --finetune, and the consumed samples must be the ones this
    run's batch schedule reaches at the iteration."""
    import torch
    from h3t_training.loop.checkpointing import TRACKER, CheckpointError, find_checkpoint

    saved = parse_args([*BASE, "--ckpt-format", "torch"], world_size=1)
    rank_dir = tmp_path / "iter_0000010" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    (tmp_path / TRACKER).write_text("10")

    def write(**changes):
        torch.save({"args": _megatron_args(saved, **changes), "iteration": 10, "checkpoint_version": 3.0,
                    "opt_param_scheduler": {"max_lr": saved.lr, "min_lr": saved.min_lr,
                                            "lr_decay_style": saved.lr_decay_style},
                    "rng_state": [{}], "model": {}}, rank_dir / "model_optim_rng.pt")

    def find(*extra, world_size=2):
        return find_checkpoint(parse_args([*BASE, *extra, "--load", str(tmp_path)], world_size=world_size), rank=0)

    write()
    found = find("--no-load-optim")
    assert found.legacy and found.iteration == 10 and not found.same_layout  # d=2 now
    assert found.common["h3t"]["model"]["num_query_groups"] == 4 and found.common["consumed_train_samples"] == 80
    assert found.notices[0].startswith(f"note: --load {tmp_path}: checkpoint iteration 10 was written by "
                                       "Megatron-LM: taking the model weights, the iteration and its 80 consumed "
                                       "samples")
    assert find("--no-load-optim", world_size=1).same_layout
    with pytest.raises(CheckpointError, match=r"was written by Megatron-LM: its optimizer state \(.*"
                                              r"model_optim_rng.pt\) is megatron-core's, .* add --no-load-optim "
                                              r"\(or --finetune\)") as e:
        find()
    assert e.value.alike
    assert find("--finetune").notices[0].count("the optimizer state (--finetune)") == 1
    for extra, text in ((["--tensor-model-parallel-size", "2"], "saved with --tensor-model-parallel-size 1; it "
                                                                 "loads only at that layout"),
                        (["--ffn-hidden-size", "192"], "was saved with --ffn-hidden-size 128, this run has 192"),
                        (["--lr", "2e-3"], "was trained with --lr 0.001, this run has 0.002; add "
                                           "--override-opt_param-scheduler")):
        with pytest.raises(CheckpointError, match=re.escape(text)):
            find("--no-load-optim", *extra)
    # another global batch continues the data from the checkpoint's consumed samples, as in Megatron-LM
    found = find("--no-load-optim", "--global-batch-size", "4")
    schedule = found.adopted["batch_schedule"]
    assert schedule.consumed_samples(10) == 80 and schedule.consumed_samples(12) == 88
    assert found.notices[-1].endswith("was saved after 80 consumed samples (this run's batch schedule reaches that "
                                      "iteration after 40): the data continues from sample 80, as in Megatron-LM")
    write(no_save_optim=True)
    assert "not taking the optimizer state (none saved)" in find().notices[0]
    write(no_save_rng=True)
    del_rng = torch.load(rank_dir / "model_optim_rng.pt", weights_only=False)
    del del_rng["rng_state"]  # Megatron-LM's legacy load fails on it: one line naming --no-load-rng
    torch.save(del_rng, rank_dir / "model_optim_rng.pt")
    with pytest.raises(CheckpointError, match=r"without RNG states \(.*model_optim_rng.pt has no 'rng_state'\); "
                                              r"add --no-load-rng, as Megatron-LM asks"):
        find("--no-load-optim")
    assert find("--no-load-optim", "--no-load-rng").iteration == 10


def test_a_legacy_checkpoint_is_found_at_its_layout_and_refused_at_another_or_under_fsdp2(tmp_path):
    """find_checkpoint on a --ckpt-format torch checkpoint (its common.pt and an empty manifest): found at the
    layout that saved it, at any data-parallel size; another tensor-parallel size, and --use-torch-fsdp2, are one
    line each, found alike on every rank."""
    import json
    import torch
    from h3t_training.loop.checkpointing import CHECKSUMS, TRACKER, CheckpointError, _common_state, find_checkpoint

    saved = parse_args([*BASE, "--ckpt-format", "torch"], world_size=1)
    it = tmp_path / "iter_0000010"
    (it / "mp_rank_00").mkdir(parents=True)
    torch.save(_common_state(saved, 10), it / "common.pt")
    (it / CHECKSUMS).write_text(json.dumps({}))
    (tmp_path / TRACKER).write_text("10")
    found = find_checkpoint(parse_args([*BASE, "--load", str(tmp_path)], world_size=2), rank=1)
    assert found.legacy and found.iteration == 10 and not found.same_layout  # d=2 now
    for extra, text in ((["--tensor-model-parallel-size", "2"], "saved with --tensor-model-parallel-size 1; it "
                                                                 "loads only at that layout"),
                        (["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"],
                         "which loads without --use-torch-fsdp2")):
        with pytest.raises(CheckpointError, match=text) as e:
            find_checkpoint(parse_args([*BASE, *extra, "--load", str(tmp_path)], world_size=2), rank=0)
        assert e.value.alike


@pytest.mark.parametrize("switch,field,prog", [("--qk-layernorm", "qk_layernorm", "pretrain_llama.py"),
                                               ("--squared-relu", "squared_relu", "pretrain_gpt.py")])
def test_a_checkpoint_with_a_model_switch_is_refused_by_a_run_without_it(tmp_path, switch, field, prog):
    """--qk-layernorm and --squared-relu are model switches a resume must share (a load reads only the tensors the
    run's model asks for: the q/k norms would be dropped silently, and an activation has no tensor to tell); a
    checkpoint that predates the field was saved without it."""
    import json
    import torch
    from h3t_training.loop.checkpointing import CHECKSUMS, TRACKER, CheckpointError, _common_state, find_checkpoint

    base = [*BASE, "--disable-bias-linear", "--max-position-embeddings", "64"]  # pretrain_gpt.py requires it

    def parse(flags):
        return parse_args([*base, *flags], world_size=1, prog=prog)

    def save(flags, drop_field=False):
        common = _common_state(parse(["--ckpt-format", "torch", *flags]), 10)
        if drop_field:
            del common["h3t"]["model"][field]
        torch.save(common, it / "common.pt")

    it = tmp_path / "iter_0000010"
    (it / "mp_rank_00").mkdir(parents=True)
    (it / CHECKSUMS).write_text(json.dumps({}))
    (tmp_path / TRACKER).write_text("10")
    save([switch])
    assert find_checkpoint(parse([switch, "--load", str(tmp_path)]), rank=0)
    with pytest.raises(CheckpointError) as e:
        find_checkpoint(parse(["--load", str(tmp_path)]), rank=0)
    assert str(e.value) == (f"--load {tmp_path}: checkpoint iteration 10 was saved with {switch}, this run does "
                            "not have it; give the same model flags") and e.value.alike
    save([], drop_field=True)
    assert find_checkpoint(parse(["--load", str(tmp_path)]), rank=0)
    with pytest.raises(CheckpointError, match=f"was saved without {switch}, this run has it"):
        find_checkpoint(parse([switch, "--load", str(tmp_path)]), rank=0)


@pytest.mark.parametrize("argv,prog,message", [
    (["--squared-relu", "--disable-bias-linear"], "pretrain_llama.py", "--squared-relu excludes --swiglu"),
    (["--squared-relu"], "pretrain_gpt.py", "--squared-relu with linear biases needs --no-bias-gelu-fusion"),
])
def test_squared_relu_is_refused_where_megatron_refuses_it(argv, prog, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--max-position-embeddings", "64", *argv], world_size=1, prog=prog)
    assert message in capsys.readouterr().err


def test_squared_relu_builds_megatrons_activation():
    from megatron.core.activations import squared_relu

    from h3t_ext.runtime.modules.recompute_ours import validate_ours_config
    from h3t_training.loop.model_provider import transformer_config

    for flags in (["--disable-bias-linear"], ["--no-bias-gelu-fusion"]):
        cfg = transformer_config(parse_args([*BASE, "--squared-relu", "--max-position-embeddings", "64", *flags],
                                            world_size=1, prog="pretrain_gpt.py"),
                                 on_gpu=False)
        assert cfg.activation_func is squared_relu and not cfg.gated_linear_unit
        validate_ours_config(cfg)  # ckpt=ours takes it


def test_auto_plan_runs_the_recompute_it_chose(monkeypatch):
    """A budget where ckpt no and ours do not fit without offload and full is slower: the search picks Megatron's
    block recompute (on ckpt no: tests/unit/test_planner_recompute_search.py), and the config (its Megatron flags,
    its record and the plan the driver prices) carries it."""
    from h3t_ext.ckpt import Ckpt, Recompute
    from h3t_training.config.run_spec import run_plan
    monkeypatch.setenv("RANK", "1")
    argv = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096",
            "--global-batch-size", "16", "--train-iters", "10", "--lr", "1e-4", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000", "--gpu", "h800", "--auto-plan",
            "--memory-budget", "20GB", "--offload-alpha", "0", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "4",
            "--micro-batch-size", "1"]
    after = resolve(TrainConfig.from_namespace(build_parser(defaults=LLAMA_DEFAULTS).parse_args(argv), world_size=8,
                                               flag_notices=()))
    n = after.recompute_num_layers
    assert after.recompute == Recompute("full", "block", n) and after.ckpt is Ckpt.NO
    assert (after.recompute_granularity, after.recompute_method) == ("full", "block")
    assert f"--recompute-method block --recompute-num-layers {n}" in " ".join(after.auto_plan_flags)
    plan = run_plan(after)
    assert plan.ckpt is Ckpt.NO and plan.recompute == after.recompute


RERUN_BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--mock-data"]

@pytest.mark.parametrize("mode", ["validate_results", "report_stats"])
def test_rerun_modes_are_a_notice(mode):
    """Megatron's rerun state machine only acts after a failed result check; without a fault the run is the same,
    so the flag rule accepts it with one notice (Megatron's CI reruns_* recipes pass validate_results)."""
    config = parse_args(RERUN_BASE + ["--rerun-mode", mode], world_size=2)
    lines = [n for n in config.flag_notices if n.startswith("note: --rerun-mode")]
    assert len(lines) == 1 and lines[0].startswith(f"note: --rerun-mode {mode}: Megatron-LM's rerun state machine")
    default = parse_args(RERUN_BASE, world_size=2)  # Megatron-LM's default (validate_results) is not a notice
    assert default.rerun_mode is None and not any(n.startswith("note: --rerun-mode") for n in default.flag_notices)


def test_expert_tensor_parallel_size_on_a_dense_model_is_a_notice():
    """It splits MoE expert layers only; a dense model has none (Megatron's CI etp4 recipes pass it with t=2)."""
    config = parse_args(RERUN_BASE + ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "4"],
                        world_size=2)
    assert [n for n in config.flag_notices if n.startswith("note: --expert-tensor-parallel-size: ")] != []
    with pytest.raises(SystemExit):  # a MoE model is still refused
        parse_args(RERUN_BASE + ["--expert-tensor-parallel-size", "4", "--num-experts", "8"], world_size=2)



@pytest.mark.parametrize("ckpt,recompute,modules", [
    ("no", None, None), ("full", None, None), ("selective", None, ["core_attn"]),
    ("ours", ("full", "block", 3), None), ("no", ("selective", None, None, ("core_attn", "mlp")), ["core_attn", "mlp"])])
def test_auto_plan_writes_the_planners_recompute_fields(ckpt, recompute, modules):
    """The config's --recompute-* values of a chosen plan are the planner's one rule (format.recompute_fields),
    with argparse's None (not []) where no --recompute-modules are given; the driver's parser reads them back as
    the plan's recompute."""
    from types import SimpleNamespace
    from h3t_ext.ckpt import Recompute, split_ckpt
    from h3t_ext.costmodel.plan import Plan
    from h3t_ext.planner.format import recompute_fields
    from h3t_training.config.arguments import recompute_of
    from h3t_training.config.auto_plan import _recompute_args
    plan = Plan(num_gpus=8, seq_length=4096, global_batch_size=16, tensor_model_parallel_size=2,
                pipeline_model_parallel_size=4, ckpt=ckpt, recompute=Recompute(*recompute) if recompute else Recompute())
    fields = _recompute_args(plan)
    assert fields == {**recompute_fields(plan), "recompute_modules": modules}
    assert recompute_of(SimpleNamespace(recompute_activations=False, **fields)) == split_ckpt(plan.ckpt,
                                                                                              plan.recompute)[1]


def test_the_tokenizer_is_read_once_at_start_up(monkeypatch, tmp_path):
    """parse_args reads the tokenizer's files once (validation.resolve_tokenizer) and keeps its vocabulary for
    --auto-plan, Megatron's offload request, the checkpoint checks and the out-of-memory line; none reads it again."""
    import h3t_training.data.tokenizer as tokenizer
    from h3t_training.data.tokenizer import NullTokenizer
    from h3t_training.loop.checkpointing import find_checkpoint
    builds = []
    real = tokenizer.build_tokenizer
    monkeypatch.setattr(tokenizer, "build_tokenizer", lambda *a, **k: builds.append(a) or real(*a, **k))
    argv = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "1024",
            "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-4", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "32000", "--gpu", "h800", "--load", str(tmp_path)]
    for extra in (["--auto-plan"], ["--cpu-offloading-num-layers", "1"]):
        builds.clear()
        args = parse_args([*argv, *extra], world_size=8)
        # NullTokenizer adds its end of document in Megatron-LM 0.16 and 0.17, keeps it inside from 0.18
        assert len(builds) == 1 and args.tokenizer_vocab_size == NullTokenizer(32000).vocab_size in (32000, 32001)
        assert find_checkpoint(args, rank=0) is None and len(builds) == 1
    assert args.offload_alpha != 0  # Megatron's offload request was priced (with the vocabulary read once)


def test_parsing_creates_no_output_directory(tmp_path, capsys):
    """--save, --tensorboard-dir and --wandb-save-dir are checked for writability where the run will create them
    (their nearest existing directory); parsing creates none, so a parse that fails at a later flag leaves nothing
    behind. A file in the way and an unwritable parent are one line each."""
    save, board = tmp_path / "runs" / "ckpt", tmp_path / "runs" / "tb"
    out = ["--save", str(save), "--tensorboard-dir", str(board)]
    with pytest.raises(SystemExit):  # a later flag fails: no directory is left
        parse_args([*BASE, *out, "--eval-iters", "-3"], world_size=1)
    capsys.readouterr()
    assert not (tmp_path / "runs").exists()
    config = parse_args([*BASE, *out], world_size=1)
    assert config.save == str(save) and not (tmp_path / "runs").exists() and not list(tmp_path.iterdir())
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--save", str(tmp_path / "file" / "ckpt")], world_size=1)
    err = capsys.readouterr().err
    assert f"--save {tmp_path / 'file' / 'ckpt'} is not writable (Not a directory)" in err, err
