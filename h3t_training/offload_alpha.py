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


def stage_alphas(value, pipeline_model_parallel_size: int):
    """``--offload-alpha`` as the runtime takes it: one float, or a tuple of one per pipeline stage.
    ``value`` is the flag's text or already-parsed numbers; ArgumentError for another count."""
    if isinstance(value, str):
        alphas = parse_alpha_values(value)
    else:
        alphas = tuple(float(a) for a in (value if isinstance(value, (tuple, list)) else (value,)))
    p = pipeline_model_parallel_size
    if len(alphas) not in (1, p):
        raise ArgumentError(f"--offload-alpha has {len(alphas)} values; give 1 or one per pipeline stage "
                            f"(--pipeline-model-parallel-size {p})")
    return alphas[0] if len(alphas) == 1 else alphas
