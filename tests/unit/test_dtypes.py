"""Bytes per element live in one module (h3t_ext/dtypes.py): its sizes are torch's, its lookup refuses unknown
names in one line, and no other source of the library, the driver or the scripts defines a dtype size again or
takes one from anywhere but h3t_ext.dtypes."""
import ast
import pathlib
import typing

import pytest
import torch

from h3t_ext import dtypes
from h3t_ext.dtypes import BF16, BOOL, E8M0, FP8, FP16, FP32, FP64, INT64, DtypeName, bytes_per_element

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCANNED = ("h3t_ext", "h3t_training", "scripts")
OWNER = pathlib.Path("h3t_ext/dtypes.py")
SIZE_NAMES = frozenset(("FP8", "BF16", "FP16", "FP32", "FP64", "INT64", "BOOL", "E8M0"))


def _is_size_name(name: str) -> bool:
    return name in SIZE_NAMES or name.endswith("_DTYPE_BYTES")


def _targets(node) -> list[str]:
    names = []
    for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
        for n in ast.walk(target):
            if isinstance(n, ast.Name):
                names.append(n.id)
    return names


def second_definitions(source: str) -> list[str]:
    """Module-level assignments of a dtype-size name, and imports of one from a module other than h3t_ext.dtypes."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            found += [f"{name} = ... (line {node.lineno})" for name in _targets(node) if _is_size_name(name)]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module != "h3t_ext.dtypes":
            found += [f"from {node.module} import {a.name} (line {node.lineno})" for a in node.names
                      if _is_size_name(a.name)]
    return found


def test_the_scan_sees_assignments_tuples_and_imports():
    assert second_definitions("FP32 = 4\n") == ["FP32 = ... (line 1)"]
    assert second_definitions("FP8, BF16, X = 1, 2, 3\n") == ["FP8 = ... (line 1)", "BF16 = ... (line 1)"]
    assert second_definitions("COMPUTE_DTYPE_BYTES: dict = {}\n") == ["COMPUTE_DTYPE_BYTES = ... (line 1)"]
    assert second_definitions("from h3t_ext.costmodel.kernels import BF16, kernel_rates\n") == [
        "from h3t_ext.costmodel.kernels import BF16 (line 1)"]
    assert second_definitions("from h3t_ext.dtypes import BF16\ndef f():\n    FP32 = 4\n") == []


def test_no_second_definition_of_a_dtype_size():
    offenders = {}
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel != OWNER and (found := second_definitions(path.read_text())):
                offenders[str(rel)] = found
    assert not offenders, f"dtype sizes defined or imported outside h3t_ext/dtypes.py: {offenders}"


def test_the_owner_defines_every_name():
    assert second_definitions((ROOT / OWNER).read_text()) != []  # the scan would see the one module's names
    assert {n for n in SIZE_NAMES if hasattr(dtypes, n)} == SIZE_NAMES


@pytest.mark.parametrize("name", typing.get_args(DtypeName))
def test_sizes_are_torchs(name):
    assert bytes_per_element(name) == getattr(torch, name).itemsize


def test_named_constants_match_the_lookup():
    assert (FP8, E8M0, BF16, FP16, FP32, FP64, INT64, BOOL) == tuple(bytes_per_element(n) for n in (
        "float8_e4m3fn", "float8_e8m0fnu", "bfloat16", "float16", "float32", "float64", "int64", "bool"))
    assert bytes_per_element("float8_e5m2") == FP8


@pytest.mark.parametrize("bad", ["bf16", "torch.bfloat16", "", None])
def test_unknown_name_is_one_line_naming_the_valid_ones(bad):
    with pytest.raises(ValueError) as e:
        bytes_per_element(bad)
    message = str(e.value)
    assert "\n" not in message and repr(bad) in message
    assert all(name in message for name in typing.get_args(DtypeName))
