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

Interleaved 1F1B (v model chunks per rank) runs N = p v virtual stages in a ring, each microbatch through all of
them, and the virtual stage with the output layer -- the last rank's last chunk -- is the one an even split leaves
behind, and its rank with it: every rank runs all its chunks for each microbatch, so the ranks' totals set the
pace. The ranks are evened out as above, and each rank's layers split evenly over its chunks, except that the output
layer's chunk keeps only what brings it to one virtual stage's share, (L + H) / N - H layers, the rank's other
chunks taking the rest (:func:`balanced_chunk_layers`). Megatron-LM's even interleaving,
``--num-layers-per-virtual-pipeline-stage l``, is v = L / (p l) chunks of l layers; its balanced twin is the layout
string of p v stages (stage k: chunk k // p of rank k % p).

Every microbatch passes every virtual stage in turn, so a virtual stage heavier than the others makes the ring wait
on it whatever the ranks' totals, and the closed form the search ranks by (ranks' totals) would promise too much
(the timeline, which runs the schedule, prices Llama 3 8B's p = 4, v = 8 twin 10% below it, Mistral 7B's p = 8,
v = 4 twin 4%). So the twin is kept only where its virtual stages stay even: the others within one layer of each
other, none heavier than Megatron's heaviest (l layers and the output layer), and the output layer's no heavier than
the others; elsewhere the search keeps Megatron's even interleaving. On the twins it keeps, the closed form and the
timeline agree within about 1% (tests/unit/test_pipeline_balance.py).
"""
from __future__ import annotations

import functools
from typing import Optional

from h3t_ext.costmodel.specs import ModelSpec


def output_layer_in_layers(model: ModelSpec, seq_length: int, tensor_model_parallel_size: int = 1) -> float:
    """The output layer's forward FLOPs per token in transformer layers' (H above)."""
    layer = 2 * model.active_params_per_layer + 4 * model.query_hidden_size * model.attended_pairs_per_layer(
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


def balanced_chunk_layers(num_layers: int, p: int, v: int, head_layers: float) -> Optional[tuple[int, ...]]:
    """Transformer layers of the p v virtual stages of interleaved 1F1B in layout order (stage k: chunk k // p of rank
    k % p): each rank's total as :func:`balanced_stage_layers` evens out the ranks (a rank runs all its chunks for
    every microbatch), split evenly over its chunks, except that the last rank's last chunk, which holds the output
    layer, keeps only the layers that bring it to one virtual stage's share, (L + H) / (p v) - H (at least none),
    and a rank's remainder goes to its later chunks; None where the ranks cannot be balanced. v = 1:
    :func:`balanced_stage_layers`."""
    ranks = balanced_stage_layers(num_layers, p, head_layers)
    if ranks is None or v == 1:
        return ranks
    chunks = [[0] * v for _ in range(p)]
    for r, total in enumerate(ranks):
        even = v if r < p - 1 else v - 1
        if r == p - 1:
            share = (num_layers + head_layers) / (p * v) - head_layers
            chunks[r][v - 1] = min(total, max(0, round(share)))
            total -= chunks[r][v - 1]
        base, extra = divmod(total, even)
        for c in range(even):
            # the remainder to the later chunks: a rank's warm-up holds more microbatches of its earlier chunks, so
            # this keeps its peak lowest (and at or below the cost model's mean-chunk price)
            chunks[r][c] = base + (c >= even - extra)
    counts = tuple(chunks[k % p][k // p] for k in range(p * v))
    others = counts[:-1]
    if (counts[-1] + head_layers > max(others) or max(others) - min(others) > 1
            or max(others) > num_layers / (p * v) + head_layers):
        return None  # a virtual stage the ring would wait on (module doc)
    return counts


def layout_string(stage_layers: tuple[int, ...]) -> str:
    """megatron-core's layout string of one model chunk per stage: ``Et*8|t*9|t*9|t*6L``."""
    def layers(n: int) -> str:
        return f"t*{n}" if n > 1 else "t" * n
    stages = [layers(n) for n in stage_layers]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "L"
    return "|".join(stages)


@functools.lru_cache(maxsize=4096)
def uneven_virtual_sizes(num_layers: int, p: int) -> tuple[int, ...]:
    """The model chunks per rank (v >= 2) of interleaved 1F1B that Megatron's even interleaving cannot write for
    ``num_layers`` over p stages (p v does not divide the layers) but the layers with the embedding and the loss
    counted as one layer each can (p v divides L + 1 or L + 2: megatron-core's ``--account-for-embedding-in-pipeline-split``
    and ``--account-for-loss-in-pipeline-split``; Llama 3.1 405B's 126 layers over 8 stages of 8 chunks, as its
    published recipes run it). The search prices their balanced layout (:func:`balanced_chunk_layers`), which gives
    the first and last chunks what the embedding and the output layer leave them. At most L / p chunks a rank: more
    leave chunks of the embedding or the loss alone, whose fill and drain the timeline prices 1-2% faster than the
    closed form's even chunks, and the search ranks by the closed form."""
    if p < 2:
        return ()
    return tuple(v for v in range(2, num_layers // p + 1)
                 if num_layers % (p * v) and any((num_layers + e) % (p * v) == 0 for e in (1, 2)))


@functools.lru_cache(maxsize=4096)
def split_candidates(model: ModelSpec, seq_length: int, p: int, t: int = 1, v: int = 1) -> tuple[Optional[str], ...]:
    """The layer splits the search prices for p stages of v chunks each: None (Megatron's even split, where it exists:
    p divides the layers, or with v > 1 p v does) and the balanced layout where it differs from it."""
    L, stages = model.num_layers, p * v
    even = L % stages == 0
    out: list[Optional[str]] = [None] if even else []
    if v > 1 and not even and v not in uneven_virtual_sizes(L, p):
        return ()  # interleaving without Megatron's even split: only where the embedding and the loss even it out
    counts = balanced_chunk_layers(L, p, v, output_layer_in_layers(model, seq_length, t))
    if counts is not None and not (even and set(counts) == {L // stages}):
        out.append(layout_string(counts))
    return tuple(out)


__all__ = ["balanced_chunk_layers", "balanced_stage_layers", "layout_string", "output_layer_in_layers", "split_candidates",
           "uneven_virtual_sizes"]
