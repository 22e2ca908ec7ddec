"""The efficiency sets of ``data/fitted_efficiencies.json``: each GPU family's values over the shared ones, the priors
every fit starts from, the plausible range of each efficiency, and the ones given only where measured."""
from __future__ import annotations

import functools
import json
from pathlib import Path

FITTED_EFFICIENCIES_FILE = Path(__file__).resolve().parent.parent / "data" / "fitted_efficiencies.json"

OPTIONAL_EFFICIENCIES = ("fused_attention_gemm_ratio", "fused_attention_row_overhead_keys")
"""Efficiencies measured on a GPU family's chip, given only where measured: a set or system file without them
prices cuDNN's fused attention as FlashAttention (:mod:`h3t_ext.costmodel.kernels`)."""


@functools.lru_cache(maxsize=None)
def _fitted() -> dict:
    with open(FITTED_EFFICIENCIES_FILE, encoding="utf-8") as f:
        return json.load(f)


def efficiency_set_names() -> tuple[str, ...]:
    """The GPU-family efficiency sets of ``fitted_efficiencies.json`` a system file may name."""
    return tuple(k for k in _fitted()["efficiencies"] if k != "shared")


def efficiency_set(name: str) -> dict:
    """One named set of ``fitted_efficiencies.json`` over the ``shared`` set (values, plus ``_``-prefixed
    notes)."""
    sets = _fitted()["efficiencies"]
    return {**sets["shared"], **sets[name]}


def prior_efficiencies(name: str) -> dict[str, float]:
    """Prior values (public benchmarks, ``fitted_efficiencies.json`` ``priors``) of efficiency set ``name``."""
    priors = _fitted()["priors"]
    return {**priors["shared"], **priors.get(name, {})}


def plausible_ranges() -> dict[str, tuple[float, float]]:
    """Physically plausible range of every efficiency (``fitted_efficiencies.json``, ``plausible_ranges``)."""
    return {k: (float(v[0]), float(v[1])) for k, v in _fitted()["plausible_ranges"].items() if not k.startswith("_")}
