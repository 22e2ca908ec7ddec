"""The efficiency sets of ``data/fitted_efficiencies.json``: each GPU family's values over the shared ones, the priors
every fit starts from, the plausible range of each efficiency, and the ones given only where measured."""
from __future__ import annotations

import functools
import json
from pathlib import Path

FITTED_EFFICIENCIES_FILE = Path(__file__).resolve().parent.parent / "data" / "fitted_efficiencies.json"

OPTIONAL_EFFICIENCIES = ("fused_attention_gemm_ratio", "fused_attention_row_overhead_keys", "mxfp8_gemm_rate_fraction")
"""Efficiencies measured on a GPU family's chip, given only where measured: a set or system file without the first two
prices cuDNN's fused attention as FlashAttention, without the third MXFP8 GEMMs at the per-tensor FP8 rate
(:mod:`h3t_ext.costmodel.kernels`)."""


@functools.lru_cache(maxsize=None)
def _fitted() -> dict:
    with open(FITTED_EFFICIENCIES_FILE, encoding="utf-8") as f:
        return json.load(f)


def efficiency_set_names() -> tuple[str, ...]:
    """The GPU-family efficiency sets of ``fitted_efficiencies.json`` a system file may name."""
    return tuple(k for k in _fitted()["efficiencies"] if k != "shared")


def _transfer(name: str):
    """Family ``name``'s entry of ``fitted_efficiencies.json`` ``transfers`` (None where it has its own values)."""
    return _fitted().get("transfers", {}).get(name)


def transferred_source(name: str) -> str:
    """The family whose fitted efficiencies family ``name`` carries over (``fitted_efficiencies.json``
    ``transfers``); empty where it has its own."""
    transfer = _transfer(name)
    return "" if transfer is None else str(transfer["from"])


def transferred_efficiencies(name: str) -> dict[str, float]:
    """The efficiencies family ``name`` takes from another family's (``fitted_efficiencies.json`` ``transfers``):
    each ``scaled`` one is the source family's times the ratio of the two chips' matmul ceilings (measured best
    matmul FLOP/s over the datasheet peak, in the listed precision), each ``same`` one the source's as it is, each
    ``kept_from`` one what another family gives itself (the same silicon's kernel measurements: the GB200's fused
    attention is the B200's). Empty for a family that has no transfer (one fitted or stated on its own runs)."""
    transfer = _transfer(name)
    if transfer is None:
        return {}
    source = efficiency_set(transfer["from"])
    out = {k: float(source[k]) for k in transfer.get("same", ())}
    for family, keys in transfer.get("kept_from", {}).items():
        own = _fitted()["efficiencies"][family]
        out.update({k: float(own[k]) for k in keys})
    for key, precision in transfer["scaled"].items():
        ceiling = transfer["matmul_ceiling"][precision]
        (to_best, to_peak), (from_best, from_peak) = ceiling[name], ceiling[transfer["from"]]
        out[key] = float(source[key]) * (to_best / to_peak) / (from_best / from_peak)
    return out


def efficiency_set(name: str) -> dict:
    """One named set of ``fitted_efficiencies.json`` over the ``shared`` set (values, plus ``_``-prefixed
    notes), with what it takes from another family (:func:`transferred_efficiencies`) under its own values."""
    sets = _fitted()["efficiencies"]
    return {**sets["shared"], **transferred_efficiencies(name), **sets[name]}


def prior_efficiencies(name: str) -> dict[str, float]:
    """Prior values (public benchmarks, ``fitted_efficiencies.json`` ``priors``) of efficiency set ``name``; a family
    priced by transfer (no prior of its own) starts from its transferred values."""
    priors = _fitted()["priors"]
    own = priors.get(name)
    if own is None:
        own = transferred_efficiencies(name)
    return {**priors["shared"], **own}


def plausible_ranges() -> dict[str, tuple[float, float]]:
    """Physically plausible range of every efficiency (``fitted_efficiencies.json``, ``plausible_ranges``)."""
    return {k: (float(v[0]), float(v[1])) for k, v in _fitted()["plausible_ranges"].items() if not k.startswith("_")}
