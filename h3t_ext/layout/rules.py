"""The layout rules' error and the checks both the pipeline split and the parallel layout apply (see
:mod:`h3t_ext.layout`)."""
from __future__ import annotations

from typing import Optional


RULES = ("range", "world_size", "global_batch_size", "num_layers", "uneven_stages", "pipeline_layout",
         "num_layers_per_virtual_pipeline_stage", "virtual_needs_pipeline", "interleaving", "num_attention_heads",
         "num_query_groups", "ffn_hidden_size", "seq_length_context_parallel", "seq_length_sequence_parallel",
         "expert_layout")
"""Names of the rules (``LayoutError.rule``), for callers that count refusals by kind (the planner)."""


class LayoutError(ValueError):
    """A parallel layout Megatron cannot run; ``reason`` is one line naming the flag(s) and valid values,
    ``rule`` which of :data:`RULES` it broke."""

    def __init__(self, reason: str, rule: str = "range") -> None:
        self.reason = reason
        self.rule = rule
        super().__init__(reason)


def _positive(name: str, value) -> None:
    if type(value) is int and value >= 1:  # the common case first (the search builds thousands of layouts)
        return
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise LayoutError(f"{name} {value!r} is outside [1, inf); valid: integers >= 1", "range")


def _divisors(n: int) -> str:
    """``n``'s divisors as a short list for a message (only built when a rule is broken)."""
    small = [k for k in range(1, int(n**0.5) + 1) if n % k == 0]
    ds = sorted(set(small + [n // k for k in small]))
    return ", ".join(map(str, ds)) if len(ds) <= 12 else f"divisors of {n}"


_NUM_MB = "number of microbatches (--global-batch-size / (--micro-batch-size x data-parallel size))"


def _check_chunks(p: int, v: int) -> None:
    """Model chunks (v > 1) need a pipeline: megatron-core runs no interleaving without one."""
    if v > 1 and p == 1:
        raise LayoutError(f"{v} model chunks per pipeline rank (--num-layers-per-virtual-pipeline-stage) need "
                          f"--pipeline-model-parallel-size > 1, it is {p}; valid: --pipeline-model-parallel-size "
                          f">= 2, or one model chunk per rank", "virtual_needs_pipeline")


def _check_interleaving(p: int, v: int, m: int, group: Optional[int]) -> None:
    """megatron-core 0.16.1's rules of ``forward_backward_pipelining_with_interleaving``: with the group size g,
    p <= g <= m and m mod g is 0 or >= p."""
    if v == 1:
        return
    _check_chunks(p, v)
    if group is None:  # the default g = p: m >= p and m mod p = 0 (a remainder >= p cannot be)
        if m % p:
            raise LayoutError(f"interleaved 1F1B needs the {_NUM_MB} = {m} to be a multiple of "
                              f"--pipeline-model-parallel-size {p}; valid: multiples of {p}", "interleaving")
        return
    g = group
    if not p <= g <= m:
        raise LayoutError(f"--microbatch-group-size-per-virtual-pipeline-stage {g} is outside "
                          f"[--pipeline-model-parallel-size {p}, {_NUM_MB} {m}]; valid: {p} to {m}", "interleaving")
    rest = m % g
    if 0 < rest < p:
        valid = "0" if g == p else f"0 or {p} to {g - 1}"
        raise LayoutError(f"interleaved 1F1B: the {_NUM_MB} = {m} mod "
                          f"--microbatch-group-size-per-virtual-pipeline-stage {g} = {rest} must be 0 or >= "
                          f"--pipeline-model-parallel-size {p}; valid remainders: {valid}", "interleaving")


__all__ = ["LayoutError", "RULES"]
