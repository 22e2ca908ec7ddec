"""The pipeline split the search tries beside the even one: megatron-core's --pipeline-model-parallel-layout with the
output layer's work taken into account.

The last pipeline stage runs its transformer layers and the output layer with the loss; an even split leaves it
behind the others by that whole output layer, and every other stage waits for it (1F1B runs at the pace of its
slowest stage). Counted in forward FLOPs per token, a transformer layer is 2 x its GEMM weights plus its attention
(4 q P / s, P the score pairs of a head: :meth:`~h3t_ext.costmodel.specs.ModelSpec.attended_pairs_per_layer`) and the
output layer 2 V h (V padded). With the output layer worth H layers, the stages are alike when each runs
S = (L + H) / p layer-equivalents: the last stage S - H layers, the others S. So the balanced split gives the last
stage round((L - (p - 1) H) / p) layers (at least none) and spreads the rest evenly over the others, the remainder to
the middle stages first: the first stage already holds the most activations in flight under 1F1B.

The FLOP count is a structural estimate, not the cost model's price: the search prices the even split and this one
and keeps what is faster, so the count only has to point at the right neighbourhood. It also gives a split where
the layers do not divide evenly over the stages (L not a multiple of p), which only a layout can write.
Interleaved schedules (v > 1) are searched with even splits only.
"""
from __future__ import annotations

import functools
from typing import Optional

from h3t_ext.costmodel.specs import ModelSpec


def output_layer_in_layers(model: ModelSpec, seq_length: int, tensor_model_parallel_size: int = 1) -> float:
    """The output layer's forward FLOPs per token in transformer layers' (H above)."""
    layer = 2 * model.params_per_layer + 4 * model.query_hidden_size * model.attended_pairs_per_layer(
        seq_length) / seq_length
    return 2 * model.padded_vocab_size(tensor_model_parallel_size) * model.hidden_size / layer


def balanced_stage_layers(num_layers: int, p: int, head_layers: float) -> Optional[tuple[int, ...]]:
    """Transformer layers per pipeline stage that even out the stages' work with the output layer worth
    ``head_layers`` layers on the last one; None where no such split exists (fewer layers than stages but the last)."""
    if p < 2 or num_layers < p - 1:
        return None
    last = min(num_layers, max(0, round((num_layers - (p - 1) * head_layers) / p)))
    rest = num_layers - last
    base, extra = divmod(rest, p - 1)
    if base < 1:
        return None
    counts = [base] * (p - 1)
    order = list(range(1, p - 1)) + [0]  # the middle stages first, the first stage last
    for i in range(extra):
        counts[order[i % len(order)]] += 1
    return (*counts, last)


def layout_string(stage_layers: tuple[int, ...]) -> str:
    """megatron-core's layout string of one model chunk per stage: ``Et*8|t*9|t*9|t*6L``."""
    def layers(n: int) -> str:
        return f"t*{n}" if n > 1 else "t" * n
    stages = [layers(n) for n in stage_layers]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "L"
    return "|".join(stages)


@functools.lru_cache(maxsize=4096)
def split_candidates(model: ModelSpec, seq_length: int, p: int, t: int = 1) -> tuple[Optional[str], ...]:
    """The layer splits the search prices for p stages of one chunk each: None (the even split, where p divides the
    layers) and the balanced layout where it differs from it."""
    L = model.num_layers
    even = L % p == 0
    out: list[Optional[str]] = [None] if even else []
    counts = balanced_stage_layers(L, p, output_layer_in_layers(model, seq_length, t))
    if counts is not None and not (even and set(counts) == {L // p}):
        out.append(layout_string(counts))
    return tuple(out)


__all__ = ["balanced_stage_layers", "layout_string", "output_layer_in_layers", "split_candidates"]
