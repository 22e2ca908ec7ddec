"""The pointer kernels build without torch's headers; only the optional front end needs them.

setup.py's CPU and CUDA host sources are compiled (syntax only) with pybind11 and Python's
headers and no torch include path, so an isolated build never needs a torch. Skipped
without a C++ compiler or pybind11.
"""
import ast
import pathlib
import shutil
import subprocess
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CXX = shutil.which("g++") or shutil.which("c++")
pybind11 = pytest.importorskip("pybind11")

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")


def _setup_list(name: str) -> list[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py defines no {name}")


def test_torch_free_sources_compile_without_torch_headers():
    sources = sorted(set(_setup_list("CPU_SOURCES") + _setup_list("CUDA_SOURCES")))
    assert "csrc/bindings_torch.cpp" not in sources
    assert "csrc/bindings_torch.cpp" in _setup_list("TORCH_SOURCES")
    cmd = [CXX, "-std=c++17", "-fsyntax-only", f"-I{ROOT / 'csrc'}", f"-I{pybind11.get_include()}",
           f"-I{sysconfig.get_paths()['include']}", *[str(ROOT / s) for s in sources]]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
