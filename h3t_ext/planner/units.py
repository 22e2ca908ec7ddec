"""Byte quantities as people write them: ``85899345920``, ``78GB``, ``72GiB``, ``7.5e10``."""
from __future__ import annotations

import math
import re

MAX_BYTES = 2**60
"""Largest byte count accepted (1 EiB): far above any device, and exact in the float arithmetic."""

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
"""Accepted suffixes (case-insensitive): decimal kB..TB and binary KiB..TiB."""

_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str) -> int:
    """Parse a byte count with an optional unit suffix; raise ValueError with the accepted forms."""
    m = _PATTERN.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not a byte count (use plain bytes or a suffix: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value > MAX_BYTES:
        raise ValueError(f"{text!r} is out of range (valid: 1 B to {MAX_BYTES} B = 1 EiB)")
    if round(value) < 1:
        raise ValueError(f"{text!r} must be at least 1 byte")
    return int(round(value))


def format_bytes(n: float) -> str:
    """Human form in GiB (or MiB below one GiB), e.g. ``61.94 GiB``."""
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"
