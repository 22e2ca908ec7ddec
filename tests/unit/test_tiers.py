"""The test tiers hold what their names promise (tests/conftest.py): every test file sits in a tier folder,
and no unit test starts a process (the unit tier is the quick check of a change)."""
import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "gpu")
PROCESS_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing", "torch.distributed.run",
                   "torch.distributed.elastic")
PROCESS_NAMES = ("run_pretrain", "start_processes", "spawn", "Popen", "check_call", "check_output")


def process_uses(source: str) -> list[str]:
    """Imports of process-starting modules and calls of process-starting functions in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith(PROCESS_MODULES)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(PROCESS_MODULES):
                found.append(node.module)
            found += [a.name for a in node.names if a.name in PROCESS_NAMES]
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in PROCESS_NAMES:
                found.append(name)
    return found


def test_every_test_file_is_in_a_tier():
    loose = sorted(p.name for p in TESTS.glob("test_*.py"))
    assert not loose, f"test files outside tests/{{{','.join(TIERS)}}}: {loose}"
    stray = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py") if p.relative_to(TESTS).parts[0]
                   not in TIERS)
    assert not stray, f"test files outside the tier folders: {stray}"


def test_no_unit_test_starts_a_process():
    offenders = {p.name: uses for p in sorted((TESTS / "unit").glob("test_*.py"))
                 if (uses := process_uses(p.read_text()))}
    assert not offenders, f"unit tests that start processes (move them to tests/integration): {offenders}"


def test_the_check_sees_imports_and_calls():
    assert process_uses("import subprocess\n") == ["subprocess"]
    assert process_uses("from torch.multiprocessing import spawn\n") == ["torch.multiprocessing", "spawn"]
    assert process_uses("from driver_harness import run_pretrain\nrun_pretrain([])\n") == ["run_pretrain",
                                                                                             "run_pretrain"]
    assert process_uses("import os\nos.path.join('a')\n") == []
