"""The driver's configuration is built once and frozen: every resolution step returns a new config."""
from __future__ import annotations

import ast
import pathlib
import pickle

import pytest

from h3t_training.arguments import LLAMA_DEFAULTS, build_parser
from h3t_training.checkpointing import _check_schedule
from h3t_training.config import FrozenConfigError, TrainConfig, parse_args, resolve

REPO = pathlib.Path(__file__).resolve().parents[1]
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


def test_a_checkpoint_schedule_is_returned_not_written_into_the_config():
    config = parse_args(BASE, world_size=1).replace(use_checkpoint_opt_param_scheduler=True)
    saved = {"lr": 5e-4, "min_lr": 0.0, "lr_decay_style": "linear"}
    assert _check_schedule(config, saved, 7) == saved
    assert config.lr == 1e-3


def _imports(path: pathlib.Path, package: str, modules: set[str]) -> set[str]:
    """Every module of ``package`` that ``path`` imports, at the top or inside a function
    (``from pkg import sub`` is an import of the submodule ``pkg.sub``, not of ``pkg``'s namespace)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == package or node.module.startswith(package + "."):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(package + ".")}
    return found


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("package", ["h3t_training", "h3t_ext"])
def test_no_import_cycles(package):
    modules = {_module_name(f): f for f in (REPO / package).rglob("*.py")}
    names = set(modules)
    graph = {m: {d for d in _imports(f, package, names) if d in modules and d != m} for m, f in modules.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            assert state.get(d) != 1, "import cycle: " + " -> ".join(path[path.index(d):] + [d]) if d in path else d
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
