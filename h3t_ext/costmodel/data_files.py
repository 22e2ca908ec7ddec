"""The data files shipped under ``h3t_ext/data``: where they are, and the published measurements read once."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
"""``h3t_ext/data``: the model zoo, the systems, the fitted efficiencies and the reference measurements."""


def read_json(path: Path) -> Any:
    """One JSON file (UTF-8)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


REFERENCE_DIR = DATA_DIR / "reference"
"""The published measurements the cost model is checked against (``data/reference/*.json``)."""


@functools.lru_cache(maxsize=None)
def reference_json(name: str) -> dict:
    """One file of :data:`REFERENCE_DIR`, read once (callers do not modify it)."""
    return read_json(REFERENCE_DIR / name)
