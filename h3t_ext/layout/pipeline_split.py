"""Which transformer layers each pipeline rank and model chunk builds: Megatron's even and uneven splits, with
the embedding and the loss counted or not, and megatron-core's ``--pipeline-model-parallel-layout`` strings (see
:mod:`h3t_ext.layout`)."""
from __future__ import annotations

import functools
import re
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from h3t_ext.layout.rules import LayoutError, _check_chunks, _divisors, _positive


_UNEVEN = "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"
_ACCOUNT = ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")


def _check_uneven(num_layers: int, p: int, first: Optional[int], last: Optional[int]) -> None:
    """Megatron's uneven stages: the first/last stage layers as given, the rest split evenly over the others."""
    L = num_layers
    for flag, n in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if not (n is None or (isinstance(n, int) and 1 <= n < L)):
            raise LayoutError(f"{flag} {n!r} is outside [1, {L - 1}] (--num-layers {L}); valid: 1 to {L - 1}",
                              "uneven_stages")
    if p == 1:
        raise LayoutError(f"{_UNEVEN} need --pipeline-model-parallel-size > 1, it is {p}; valid: >= 2",
                          "uneven_stages")
    middle = p - (first is not None) - (last is not None)
    rest = L - (first or 0) - (last or 0)
    if not ((middle == 0 and rest == 0) or (middle > 0 and rest > 0 and rest % middle == 0)):
        given = " and ".join(f"{flag} {n}" for flag, n in (("--decoder-first-pipeline-num-layers", first),
                                                          ("--decoder-last-pipeline-num-layers", last))
                             if n is not None)
        valid = (f"first/last stage layers that leave a positive multiple of {middle} layers" if middle > 0
                 else f"first + last stage layers = {L}")
        raise LayoutError(f"--num-layers {L} minus {given} leaves {rest} layer(s), which do not split evenly over "
                          f"the other {middle} pipeline stage(s) (--pipeline-model-parallel-size {p}); valid: {valid}",
                          "uneven_stages")


def _check_uneven_chunks(num_layers: int, p: int, v: int, first: Optional[int], last: Optional[int]) -> None:
    """megatron-core's TransformerConfig with uneven stages and v model chunks: the first stage's, the last
    stage's and each middle stage's layers are each a multiple of v (every chunk of a stage is as large)."""
    flag_v = "--num-virtual-stages-per-pipeline-rank"
    for flag, n in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if n is not None and n % v:
            raise LayoutError(f"{flag} {n} is not a multiple of {flag_v} {v} (each of the stage's {v} model chunks "
                              f"holds as many layers); valid: multiples of {v}", "uneven_stages")
    middle = p - (first is not None) - (last is not None)
    if middle:
        per = (num_layers - (first or 0) - (last or 0)) // middle
        if per % v:
            raise LayoutError(f"the {per} layers of each middle pipeline stage (--num-layers {num_layers} minus the "
                              f"first/last stages' over {middle} stage(s)) are not a multiple of {flag_v} {v}; valid: "
                              f"first/last stage layers that leave a multiple of {v} per middle stage", "uneven_stages")


def _slots(num_layers: int, embedding: bool, loss: bool) -> tuple[int, str]:
    """Megatron's layer count of the split with --account-for-*: the embedding and the loss each count as one
    layer; the count and how it was made (for messages)."""
    n = num_layers + bool(embedding) + bool(loss)
    said = " + ".join([f"--num-layers {num_layers}"] + [f"1 for {flag}" for flag, on in zip(_ACCOUNT, (embedding, loss))
                                                        if on])
    return n, (said if n == num_layers else f"({said}) = {n}")


LAYOUT_FLAG = "--pipeline-model-parallel-layout"
MAX_LAYOUT_CHARS = 1 << 20
"""Longest layout string expanded (a model has far fewer layers: a longer one is refused, not built)."""
_LAYOUT_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_LAYOUT_REPEAT = re.compile(r"(.)\*(\d+)")


def _expand(pattern: re.Pattern, text: str) -> str:
    """One pass of megatron-core's unrolling (``parse_str_to_list``: every ``(x)*n`` then every ``c*n``)."""
    def repeat(m: re.Match) -> str:
        n = int(m.group(2))
        if len(m.group(1)) * n > MAX_LAYOUT_CHARS:
            raise LayoutError(f"{LAYOUT_FLAG}: {m.group(0)!r} unrolls to more than {MAX_LAYOUT_CHARS} layers",
                              "pipeline_layout")
        return m.group(1) * n
    return pattern.sub(repeat, text)


def _unrolled(layout: str) -> str:
    """A layout string as megatron-core reads it: commas dropped, ``(x)*n`` and then ``c*n`` unrolled once each."""
    return _expand(_LAYOUT_REPEAT, _expand(_LAYOUT_GROUP, layout.replace(",", "")))


def layout_stage_count(layout: str) -> int:
    """Virtual stages of a --pipeline-model-parallel-layout string (its ``|``-separated stages once the repeats are
    unrolled); p x v for a valid one (:func:`parse_pipeline_layout` checks it)."""
    return len(_unrolled(layout).split("|"))


def parse_pipeline_layout(layout: str, num_layers: int, pipeline_model_parallel_size: int) -> tuple[int, ...]:
    """The transformer layers of each virtual stage of megatron-core's ``--pipeline-model-parallel-layout``, in its
    order (stage ``k`` is model chunk ``k // p`` of pipeline rank ``k % p``), after megatron-core's rules
    (``PipelineParallelLayerLayout``: commas dropped, ``(x)*n`` and ``c*n`` unrolled once each, stages split on
    ``|``; their count a multiple of p; the embedding 'E' first and the loss 'L' last, once each; as many 't' as
    --num-layers). This driver builds no multi-token prediction layers ('m'), and the output layer and the loss are
    the last pipeline rank's: 'L' must end the last stage. LayoutError (one line) otherwise."""
    if isinstance(layout, str) and type(num_layers) is int and type(pipeline_model_parallel_size) is int:
        return _layout_counts(layout, num_layers, pipeline_model_parallel_size)  # a search asks it of every plan
    return _layout_counts.__wrapped__(layout, num_layers, pipeline_model_parallel_size)


@functools.lru_cache(maxsize=256)
def _layout_counts(layout: str, num_layers: int, pipeline_model_parallel_size: int) -> tuple[int, ...]:
    _positive("--num-layers", num_layers)
    _positive("--pipeline-model-parallel-size", pipeline_model_parallel_size)
    if not isinstance(layout, str) or not layout.strip():
        raise LayoutError(f"{LAYOUT_FLAG} {layout!r} is empty; valid: stages of E, t and L separated by |, e.g. "
                          f"Ett|ttL", "pipeline_layout")
    text = _unrolled(layout)
    stages = text.split("|")
    bad = sorted(set(text) - set("ELt|m"))
    if bad:
        raise LayoutError(f"{LAYOUT_FLAG} {layout!r} has {', '.join(map(repr, bad))}; valid characters: E "
                          f"(embedding), t (transformer layer), L (loss), | between stages, (..)*N and c*N repeats",
                          "pipeline_layout")
    if "m" in text:
        raise LayoutError(f"{LAYOUT_FLAG} {layout!r} places multi-token prediction layers ('m'), which this driver "
                          f"does not build; valid: E, t and L only", "pipeline_layout")
    p = pipeline_model_parallel_size
    if len(stages) % p:
        raise LayoutError(f"{LAYOUT_FLAG} {layout!r} has {len(stages)} stages, not a multiple of "
                          f"--pipeline-model-parallel-size {p}; valid: p x (model chunks per rank) stages",
                          "pipeline_layout")
    if text.count("E") != 1 or not stages[0].startswith("E"):
        raise LayoutError(f"{LAYOUT_FLAG} {layout!r}: the embedding 'E' must be given once, first in the first "
                          f"stage", "pipeline_layout")
    if text.count("L") != 1 or not stages[-1].endswith("L"):
        raise LayoutError(f"{LAYOUT_FLAG} {layout!r}: the loss 'L' must be given once, last in the last stage (the "
                          f"last pipeline rank's last model chunk holds the output layer)", "pipeline_layout")
    counts = tuple(stage.count("t") for stage in stages)
    if sum(counts) != num_layers:
        raise LayoutError(f"{LAYOUT_FLAG} {layout!r} places {sum(counts)} transformer layers ('t'), --num-layers is "
                          f"{num_layers}; valid: {num_layers} 't'", "pipeline_layout")
    return counts


@dataclass(frozen=True)
class PipelineSplit:
    """Which transformer layers each pipeline rank and model chunk builds, by megatron-core 0.16.1's rule
    (``transformer_block.get_num_layers_to_build``, ``transformer_layer.get_transformer_layer_offset``).

    Evenly: each rank holds n / p "layers" with n = L (+ 1 with --account-for-embedding-in-pipeline-split, + 1
    with --account-for-loss-in-pipeline-split), split evenly over its v chunks; the first chunk of the first rank
    builds one layer fewer for the embedding, the last chunk of the last rank one fewer for the loss. Unevenly
    (--decoder-first/last-pipeline-num-layers): the first/last rank hold the layers given, the middle ranks the
    rest evenly, each rank's split evenly over its v chunks. Layers are numbered chunk-major: virtual stage 0 of
    ranks 0..p-1, then virtual stage 1, ... Build one with :func:`pipeline_split` (which checks the rules);
    the arithmetic here assumes a split that passed them."""

    num_layers: int
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int = 1
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    stage_layout: Optional[tuple[int, ...]] = None
    """--pipeline-model-parallel-layout's transformer layers per virtual stage (:func:`parse_pipeline_layout`,
    stage ``chunk x p + rank``); None: the split of the other flags."""

    @property
    def uneven(self) -> bool:
        """True with --decoder-first/last-pipeline-num-layers."""
        return self.decoder_first_pipeline_num_layers is not None or self.decoder_last_pipeline_num_layers is not None

    def representative_stages(self) -> tuple[int, ...]:
        """Pipeline ranks that stand for all: the first, a middle one and the last (the middle ranks hold alike);
        under a layout, which may give each rank its own layers, the first rank of each :meth:`stage_class`."""
        p = self.pipeline_model_parallel_size
        if self.stage_layout is None:
            return tuple(sorted({0, min(1, p - 1), p - 1}))
        return tuple(sorted({self.stage_class(r) for r in range(p)}))

    def stage_class(self, stage: int) -> int:
        """The first pipeline rank that holds what ``stage`` holds: the same layers in each model chunk, and the
        embedding or the output layer where ``stage`` has them (their weights, grads and per-microbatch work are
        alike; the microbatches in flight still depend on the rank)."""
        p, layout = self.pipeline_model_parallel_size, self.stage_layout
        if stage in (0, p - 1):
            return stage
        if layout is None:
            return 1
        mine = layout[stage::p]
        return next(r for r in range(1, p - 1) if layout[r::p] == mine)

    def rank_slots(self, stage: int) -> int:
        """Layers of pipeline rank ``stage`` as the split counts them (the embedding and loss slots included; under a
        layout its transformer layers)."""
        if self.stage_layout is not None:
            return self.stage_layers(stage)
        p, first, last = self.pipeline_model_parallel_size, self.decoder_first_pipeline_num_layers, \
            self.decoder_last_pipeline_num_layers
        if not self.uneven:
            return (self.num_layers + self.account_for_embedding_in_pipeline_split
                    + self.account_for_loss_in_pipeline_split) // p  # _slots' count, without its message
        if stage == 0 and first is not None:
            return first
        if stage == p - 1 and last is not None:
            return last
        middle = p - (first is not None) - (last is not None)
        return (self.num_layers - (first or 0) - (last or 0)) // middle if middle > 0 else 0

    def chunk_layers(self, stage: int, chunk: int = 0) -> int:
        """Transformer layers that model chunk ``chunk`` of pipeline rank ``stage`` builds."""
        p, v = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        if self.stage_layout is not None:
            return self.stage_layout[chunk * p + stage]
        n = self.rank_slots(stage) // v
        if self.account_for_embedding_in_pipeline_split and stage == 0 and chunk == 0:
            n -= 1
        if self.account_for_loss_in_pipeline_split and stage == p - 1 and chunk == v - 1:
            n -= 1
        return n

    def stage_layers(self, stage: int) -> int:
        """Transformer layers of pipeline rank ``stage`` (all its chunks): the sum of :meth:`chunk_layers` over
        them, in closed form (v chunks of ``rank_slots // v``, less the embedding's and the loss's slots), so a
        split of thousands of chunks costs no more than one of a few."""
        p, v = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        if self.stage_layout is not None:
            return sum(self.stage_layout[stage::p])
        return (v * (self.rank_slots(stage) // v) - (self.account_for_embedding_in_pipeline_split and stage == 0)
                - (self.account_for_loss_in_pipeline_split and stage == p - 1))

    def chunk_layer_counts(self, stage: int) -> dict[int, int]:
        """How many model chunks of pipeline rank ``stage`` build how many layers ({layers: chunks}), without
        walking its chunks: only the first and the last chunk can differ from the others (the embedding's and the
        loss's slots)."""
        v = self.virtual_pipeline_model_parallel_size
        if self.stage_layout is not None:
            return dict(Counter(self.stage_layout[stage::self.pipeline_model_parallel_size]))
        counts = {self.chunk_layers(stage, 0): 1}
        if v > 1:
            last = self.chunk_layers(stage, v - 1)
            counts[last] = counts.get(last, 0) + 1
        if v > 2:
            middle = self.chunk_layers(stage, 1)
            counts[middle] = counts.get(middle, 0) + v - 2
        return counts

    def distinct_chunk_layers(self) -> set[int]:
        """The layer counts of every model chunk of every pipeline rank (the set), from the ranks that can differ:
        the first, a middle one and the last."""
        if self.stage_layout is not None:
            return set(self.stage_layout)
        p = self.pipeline_model_parallel_size
        return {n for stage in {0, min(1, p - 1), p - 1} for n in self.chunk_layer_counts(stage)}

    def layer_offset(self, stage: int, chunk: int = 0) -> int:
        """Index of the first layer of model chunk ``chunk`` of pipeline rank ``stage`` in the whole model."""
        p = self.pipeline_model_parallel_size
        return sum(self.chunk_layers(r, c) for c in range(chunk + 1) for r in range(p) if (c, r) < (chunk, stage))


def pipeline_split(num_layers: int, pipeline_model_parallel_size: int,
                   num_layers_per_virtual_pipeline_stage: Optional[int] = None, *,
                   num_virtual_stages_per_pipeline_rank: Optional[int] = None,
                   decoder_first_pipeline_num_layers: Optional[int] = None,
                   decoder_last_pipeline_num_layers: Optional[int] = None,
                   account_for_embedding_in_pipeline_split: bool = False,
                   account_for_loss_in_pipeline_split: bool = False,
                   pipeline_model_parallel_layout: Optional[str] = None) -> PipelineSplit:
    """The :class:`PipelineSplit` of Megatron's flags, after Megatron-LM's and megatron-core's checks
    (``arguments.py`` and ``TransformerConfig.__post_init__``): uneven stages exclude the --account-for-* flags
    and --num-layers-per-virtual-pipeline-stage (their chunks come from --num-virtual-stages-per-pipeline-rank,
    which must divide each stage's layers); otherwise L (+1 per --account-for-* flag) splits evenly over the p
    ranks and each rank's share over its chunks. Each broken rule is a :class:`LayoutError` naming the flags."""
    L, p, l = num_layers, pipeline_model_parallel_size, num_layers_per_virtual_pipeline_stage
    V = num_virtual_stages_per_pipeline_rank
    first, last = decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers
    e, lo = bool(account_for_embedding_in_pipeline_split), bool(account_for_loss_in_pipeline_split)
    _positive("--num-layers", L)
    _positive("--pipeline-model-parallel-size", p)
    if l is not None and V is not None:
        raise LayoutError("give one of --num-layers-per-virtual-pipeline-stage and "
                          "--num-virtual-stages-per-pipeline-rank; valid: one of them", "range")
    if V is not None:
        _positive("--num-virtual-stages-per-pipeline-rank", V)
    if pipeline_model_parallel_layout is not None:
        return _layout_split(L, p, pipeline_model_parallel_layout, {
            "--num-layers-per-virtual-pipeline-stage": l is not None,
            "--num-virtual-stages-per-pipeline-rank": V is not None,
            "--decoder-first-pipeline-num-layers": first is not None,
            "--decoder-last-pipeline-num-layers": last is not None, _ACCOUNT[0]: e, _ACCOUNT[1]: lo})
    uneven = first is not None or last is not None
    if uneven:
        if e or lo:
            accounted = " and ".join(flag for flag, on in zip(_ACCOUNT, (e, lo)) if on)
            raise LayoutError(f"{accounted} cannot be combined with {_UNEVEN} (megatron-core's TransformerConfig "
                              f"refuses both); valid: one of them", "uneven_stages")
        if l is not None:
            raise LayoutError(f"--num-layers-per-virtual-pipeline-stage cannot be combined with {_UNEVEN} "
                              f"(Megatron-LM's rule); valid: "
                              f"--num-virtual-stages-per-pipeline-rank with uneven stages", "uneven_stages")
        _check_uneven(L, p, first, last)
        v = V or 1
        _check_chunks(p, v)
        if v > 1:
            _check_uneven_chunks(L, p, v, first, last)
        return PipelineSplit(L, p, v, first, last)
    n, said = _slots(L, e, lo)
    if n % p:
        alternative = f", or uneven stages with {_UNEVEN}" if not (e or lo) else ""
        raise LayoutError(f"{said} is not a multiple of --pipeline-model-parallel-size {p}; valid: "
                          f"multiples of {p}{alternative}", "num_layers")
    per_rank = n // p
    if l is not None:
        _positive("--num-layers-per-virtual-pipeline-stage", l)
        if per_rank % l:
            raise LayoutError(f"--num-layers-per-virtual-pipeline-stage {l} does not divide the {per_rank} layers "
                              f"per pipeline rank ({said} / --pipeline-model-parallel-size {p}); "
                              f"valid: {_divisors(per_rank)}", "num_layers_per_virtual_pipeline_stage")
        v = per_rank // l
    elif V is not None:
        if per_rank % V:
            raise LayoutError(f"--num-virtual-stages-per-pipeline-rank {V} does not divide the {per_rank} layers "
                              f"per pipeline rank ({said} / --pipeline-model-parallel-size {p}); "
                              f"valid: {_divisors(per_rank)}", "num_layers_per_virtual_pipeline_stage")
        v = V
    else:
        v = 1
    _check_chunks(p, v)
    return PipelineSplit(L, p, v, account_for_embedding_in_pipeline_split=e, account_for_loss_in_pipeline_split=lo)


def _layout_split(num_layers: int, p: int, layout: str, others: dict[str, bool]) -> PipelineSplit:
    """The split of --pipeline-model-parallel-layout, which Megatron-LM (its interleaving flags) and megatron-core's
    TransformerConfig (uneven stages, --account-for-*) take alone."""
    given = [flag for flag, on in others.items() if on]
    if given:
        raise LayoutError(f"{LAYOUT_FLAG} cannot be combined with {', '.join(given)} (Megatron-LM and megatron-core "
                          f"refuse both: the layout says every stage's layers); valid: one of them", "pipeline_layout")
    counts = parse_pipeline_layout(layout, num_layers, p)
    v = len(counts) // p
    if v > 1 and p == 1:
        raise LayoutError(f"{LAYOUT_FLAG} {layout!r} has {v} stages, {v} model chunks on the one pipeline rank; "
                          f"interleaving needs --pipeline-model-parallel-size > 1; valid: one stage per rank at "
                          f"--pipeline-model-parallel-size 1", "virtual_needs_pipeline")
    return PipelineSplit(num_layers, p, v, stage_layout=counts)


def virtual_pipeline_size(num_layers: int, pipeline_model_parallel_size: int,
                          num_layers_per_virtual_pipeline_stage: Optional[int] = None, **split) -> int:
    """v = (n/p) / l model chunks per pipeline rank (1 when ``l`` is None), after checking the layer split
    (:func:`pipeline_split`, whose keyword arguments ``split`` takes)."""
    return pipeline_split(num_layers, pipeline_model_parallel_size, num_layers_per_virtual_pipeline_stage,
                          **split).virtual_pipeline_model_parallel_size


__all__ = ["LAYOUT_FLAG", "PipelineSplit", "layout_stage_count", "parse_pipeline_layout", "pipeline_split",
           "virtual_pipeline_size"]
