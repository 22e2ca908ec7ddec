"""A script of ``scripts/`` loaded as a module, so a test calls its ``main`` in-process (shared by the tests of the
validation scripts)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(relative: str) -> ModuleType:
    """``scripts/<relative>`` (e.g. ``blackwell_validation.py``, ``gpu/report.py``) as a module."""
    path = SCRIPTS / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
