"""``--offload-alpha`` values: one ratio, or one per pipeline stage."""
from __future__ import annotations

from h3t_training.errors import ArgumentError


def parse_alpha_values(text: str) -> tuple[float, ...]:
    """``0.5`` or ``0.1,0.2`` -> floats in [0, 1]; raise ArgumentError naming the flag otherwise."""
    out = []
    for part in str(text).split(","):
        try:
            a = float(part)
        except ValueError:
            raise ArgumentError(f"--offload-alpha {text!r} is not a number, a comma-separated list of numbers, "
                                f"'auto' or 'balanced'") from None
        if not 0.0 <= a <= 1.0:
            raise ArgumentError(f"--offload-alpha {part} is outside [0, 1]")
        out.append(a)
    return tuple(out)
