"""One schema check for the files the planner reads: typed, required, finite and in range, each error one
line naming the file, the field and the valid range (:class:`SchemaError`, a ValueError)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional


class SchemaError(ValueError):
    """A file field that is missing, of the wrong type, not finite or out of range."""


@dataclass(frozen=True)
class Field:
    """One numeric field: its type, its lower bound and optional upper bound (each inclusive or not)."""

    name: str
    integer: bool = False
    minimum: float = 0.0
    minimum_inclusive: bool = False
    maximum: Optional[float] = None
    required: bool = True
    maximum_inclusive: bool = False
    zero_ok: bool = False
    """0 is valid besides the range (an optional rate: 0 means the system has none)."""

    @property
    def valid(self) -> str:
        low = f"{'>=' if self.minimum_inclusive else '>'} {self.minimum:g}"
        kind = "an integer" if self.integer else "a finite number"
        top = "" if self.maximum is None else (str(int(self.maximum)) if self.integer else f"{self.maximum:g}")
        high = "" if self.maximum is None else f" and {'<=' if self.maximum_inclusive else '<'} {top}"
        return f"{'0 or ' if self.zero_ok else ''}{kind} {low}{high}"


MAX_BYTES = 2**60
"""Largest byte count of a system file (1 EiB, as ``--memory-budget``'s): exact in the float arithmetic."""
MAX_UNITS = 2**20
"""Largest count of streaming multiprocessors or GEMM tile side (the planner's range of counts)."""


def _rate(name: str, required: bool = True) -> Field:
    """A rate (FLOP/s, bytes/s): at least 1 per second (a positive rate far below that, 1e-300, priced an
    iteration at NaN seconds); an optional one may be 0 (the system has none)."""
    return Field(name, minimum=1.0, minimum_inclusive=True, required=required, zero_ok=not required)


def _bytes(name: str, required: bool = True, positive: bool = False) -> Field:
    return Field(name, integer=True, minimum_inclusive=not positive, maximum=MAX_BYTES, maximum_inclusive=True,
                 required=required)


def _units(name: str) -> Field:
    return Field(name, integer=True, maximum=MAX_UNITS, maximum_inclusive=True)


SYSTEM_FIELDS = (
    _rate("peak_bf16_flops"), _bytes("hbm_bytes", positive=True), _rate("hbm_bandwidth"),
    _rate("nvlink_bandwidth"), _rate("network_bandwidth"), _rate("pcie_bandwidth"),
    Field("gpus_per_node", integer=True, maximum=1024, maximum_inclusive=True), _units("num_sms"),
    _units("gemm_tile_m"), _units("gemm_tile_n"), Field("kernel_launch_s", minimum_inclusive=True),
    Field("nvlink_latency_s", minimum_inclusive=True), Field("network_latency_s", minimum_inclusive=True),
    _bytes("cuda_context_bytes"), _bytes("nccl_bytes_per_communicator"),
    Field("allocator_fragmentation_fraction", minimum_inclusive=True, maximum=1.0),
    _rate("peak_fp8_flops", required=False),
    Field("compute_capability", minimum_inclusive=True, required=False),
    _bytes("host_memory_bytes", required=False),
    _rate("host_memory_bandwidth", required=False),
    Field("gpus_per_host", integer=True, maximum=1024, maximum_inclusive=True, required=False),
)
"""The numbers of a system file (``data/systems/*.json``, ``--system-file``); ``peak_fp8_flops`` optional.
``gpus_per_node`` (the GPUs of one NVLink domain) is at most 1024, above the largest announced domain (576 GPUs),
which also bounds the node-spread walk of :mod:`h3t_ext.costmodel.collectives` (a billion hung it); ``gpus_per_host``
(the GPUs of one host's DRAM, optional: absent, one host per NVLink domain) has the same bound."""
TEXT_FIELDS = ("name", "source", "efficiency_set", "efficiencies", "calibration")
"""The other fields a system file may hold (besides ``source_*`` and ``_``-prefixed notes): its name, sources,
efficiency set or inline efficiencies and the record ``h3t-plan calibrate`` writes."""

EFFICIENCY = Field("efficiencies")
"""Every fitted efficiency: a finite number > 0 (a fraction of a peak, or an overhead count)."""

FRACTION_EFFICIENCY = Field("efficiencies", maximum=1.0, maximum_inclusive=True)
"""An efficiency that is a share of something (its name ends in ``_fraction``: of a peak rate or of a memory;
``tp_comm_overlap_exposed``: of the tensor-parallel communication time): in (0, 1]."""


def efficiency_rule(name: str) -> Field:
    """The range of the efficiency ``name`` (:data:`FRACTION_EFFICIENCY` or :data:`EFFICIENCY`)."""
    return FRACTION_EFFICIENCY if name.endswith("_fraction") or name == "tp_comm_overlap_exposed" else EFFICIENCY


def _number(where: str, name: str, value: Any, rule: Field) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SchemaError(f"{where}: field {name} must be {rule.valid}, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer beyond any float
        finite = False
    if not finite or (rule.integer and value != int(value)):
        raise SchemaError(f"{where}: field {name} must be {rule.valid}, got {value!r}")
    if rule.zero_ok and value == 0:
        return 0.0
    low_ok = value >= rule.minimum if rule.minimum_inclusive else value > rule.minimum
    high_ok = rule.maximum is None or (value <= rule.maximum if rule.maximum_inclusive else value < rule.maximum)
    if not low_ok or not high_ok:
        raise SchemaError(f"{where}: field {name} must be {rule.valid}, got {value!r}")
    return float(value)


def check_fields(where: str, d: Any, rules: tuple[Field, ...]) -> None:
    """Raise SchemaError (one line: ``where``, the field, the valid range) unless ``d`` is an object whose
    fields satisfy ``rules``."""
    if not isinstance(d, Mapping):
        raise SchemaError(f"{where}: must be a JSON object, got {type(d).__name__}")
    for rule in rules:
        if rule.name not in d or d[rule.name] is None:
            if rule.required:
                raise SchemaError(f"{where}: field {rule.name} is missing; it must be {rule.valid}")
            continue
        _number(where, rule.name, d[rule.name], rule)


def check_system_dict(where: str, d: Any, efficiency_set_names: tuple[str, ...] = ("hopper", "ampere"),
                      efficiency_names: tuple[str, ...] = (), optional_names: tuple[str, ...] = ()) -> None:
    """A system file: its numbers (:data:`SYSTEM_FIELDS`), its ``source`` text, its inline ``efficiencies``
    (when present: each of ``efficiency_names`` given but ``optional_names``, in its :func:`efficiency_rule` range,
    and no other name than those and ``_``-prefixed notes), its ``efficiency_set`` (one of ``efficiency_set_names``, when no
    efficiencies are inline) and a positive memory budget (HBM above the CUDA context and NCCL buffers)."""
    check_fields(where, d, SYSTEM_FIELDS)
    known = {rule.name for rule in SYSTEM_FIELDS} | set(TEXT_FIELDS)
    for k in d:
        if k not in known and not str(k).startswith(("source_", "_")):
            raise SchemaError(f"{where}: field {k} is not a system file field (a typo would be ignored); valid: "
                              f"{', '.join(sorted(known))}, source_* and _-prefixed notes")
    if "name" in d and not (isinstance(d["name"], str) and d["name"].strip()):
        raise SchemaError(f"{where}: field name must be a non-empty string, got {d['name']!r}")
    if not isinstance(d.get("source"), str):
        raise SchemaError(f"{where}: field source must be a string (where the numbers come from)")
    if "efficiencies" not in d and d.get("efficiency_set") not in efficiency_set_names:
        raise SchemaError(f"{where}: field efficiency_set must be one of {', '.join(efficiency_set_names)} "
                          f"(or give an efficiencies object), got {d.get('efficiency_set')!r}")
    if "efficiencies" in d:
        eff = d["efficiencies"]
        if not isinstance(eff, Mapping):
            raise SchemaError(f"{where}: field efficiencies must be an object of {EFFICIENCY.valid}")
        for k, v in eff.items():
            if str(k).startswith("_"):
                continue
            if efficiency_names and k not in efficiency_names:
                raise SchemaError(f"{where}: field efficiencies.{k} is not an efficiency of the cost model; "
                                  f"valid: {', '.join(efficiency_names)}")
            _number(where, f"efficiencies.{k}", v, efficiency_rule(k))
        for k in efficiency_names:
            if k not in eff and k not in optional_names:
                raise SchemaError(f"{where}: field efficiencies.{k} is missing; it must be {efficiency_rule(k).valid}")


def check_positive_rate(where: str, name: str, value: Any) -> float:
    """A measured rate (tokens/s per GPU): a finite number > 0, given as a number or as text."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise SchemaError(f"{where}: field {name} must be a finite number > 0, got {value!r}") from None
    return _number(where, name, value, Field(name))
