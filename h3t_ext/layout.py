"""The parallel layout of a Megatron job and every rule on it, in one place.

A :class:`ParallelLayout` is the tensor, context, pipeline, virtual-pipeline and data-parallel
sizes plus the microbatches per iteration, under Megatron's names. Its rules are those Megatron-LM
and megatron-core 0.16.1 enforce:

* the world size is t x c x p x d (``args.data_parallel_size = world_size // (t p c)``);
* the global batch is a whole number of micro batches per data-parallel rank
  (``num_microbatches = global_batch_size // (micro_batch_size x d)``);
* the layers split evenly over the p pipeline ranks (or, with uneven first/last stages, the rest
  splits evenly over the middle ranks; with --account-for-embedding/loss-in-pipeline-split the embedding
  and the loss count as one layer each), and over the v model chunks of each rank (:class:`PipelineSplit`,
  megatron-core's ``get_num_layers_to_build`` / ``get_transformer_layer_offset``);
* or, with megatron-core's ``--pipeline-model-parallel-layout`` (a string such as ``Ett|(tt|)*6tL``: one
  ``|``-separated stage per pipeline rank and model chunk, 'E' the embedding, 't' a transformer layer, 'L' the loss),
  each model chunk's layers as written (:func:`parse_pipeline_layout`, megatron-core's
  ``PipelineParallelLayerLayout``);
* interleaving (v > 1) needs p > 1 and megatron-core's microbatch grouping of
  ``forward_backward_pipelining_with_interleaving``: with ``microbatch_group_size_per_vp_stage`` g
  (default p), p <= g <= m and m mod g is 0 or >= p (so with the default, m a multiple of p);
* the tensor-parallel split: t divides the attention heads, the query groups and the MLP columns;
* the sequence split: with c > 1 the sequence is 2c equal chunks, and with sequence parallelism each
  context shard splits over t (s a multiple of c x t).

Every broken rule raises :class:`LayoutError` with one line naming the Megatron flag(s) and the
valid values. The cost model (``h3t_ext.costmodel.plan``), the schedule builder
(``h3t_ext.schedule.builder``), the runtime (``h3t_ext.runtime.pipeline.schedules``) and the driver take their
verdicts from here, so a layout one of them refuses is refused by all with the same reason.

This module imports nothing from the rest of h3t_ext (no cycles; pure arithmetic).
In formulas t, c, p, v, d, m are the six sizes; public names are Megatron's.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
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
_UNEVEN = "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"


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


@dataclass(frozen=True)
class ParallelLayout:
    """How a Megatron job splits over its ranks (Megatron's names; checked on construction).

    Build one from the command-line sizes with :meth:`from_sizes` (derives d and m); constructing one
    directly checks the sizes and the interleaving rule on them.
    """

    tensor_model_parallel_size: int = 1
    """t: ranks that split each layer's weights."""
    context_parallel_size: int = 1
    """c: ranks that split the sequence (2c chunks)."""
    pipeline_model_parallel_size: int = 1
    """p: pipeline stages."""
    virtual_pipeline_model_parallel_size: int = 1
    """v: model chunks per pipeline rank (interleaved 1F1B); 1 when not interleaved (Megatron's None)."""
    data_parallel_size: int = 1
    """d = world_size / (t c p): Megatron-LM's ``args.data_parallel_size``, the groups that see different
    samples (context-parallel ranks are not counted; see :attr:`data_and_context_parallel_size`)."""
    num_microbatches: int = 1
    """m = global_batch_size / (micro_batch_size x d): microbatches per iteration on each rank."""
    microbatch_group_size_per_vp_stage: Optional[int] = None
    """megatron-core's grouping of microbatches per virtual stage (interleaving only); None means p."""
    expert_model_parallel_size: int = 1
    """ep: ranks that split a MoE layer's experts (each holds E / ep of them)."""
    expert_tensor_parallel_size: Optional[int] = None
    """etp: ranks that split each expert's weights; None means t (Megatron's default)."""

    def __post_init__(self) -> None:
        _positive("--tensor-model-parallel-size", self.tensor_model_parallel_size)
        _positive("--context-parallel-size", self.context_parallel_size)
        _positive("--pipeline-model-parallel-size", self.pipeline_model_parallel_size)
        _positive("virtual pipeline size (model chunks per rank)", self.virtual_pipeline_model_parallel_size)
        _positive("data-parallel size", self.data_parallel_size)
        _positive(_NUM_MB, self.num_microbatches)
        if self.microbatch_group_size_per_vp_stage is not None:
            _positive("--microbatch-group-size-per-virtual-pipeline-stage", self.microbatch_group_size_per_vp_stage)
        _check_interleaving(self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size,
                            self.num_microbatches, self.microbatch_group_size_per_vp_stage)
        _positive("--expert-model-parallel-size", self.expert_model_parallel_size)
        if self.expert_tensor_parallel_size is not None:
            _positive("--expert-tensor-parallel-size", self.expert_tensor_parallel_size)
        grid = self.expert_model_parallel_size * self.effective_expert_tensor_parallel_size
        ranks = self.tensor_model_parallel_size * self.context_parallel_size * self.data_parallel_size
        if ranks % grid:
            raise LayoutError(f"--expert-model-parallel-size {self.expert_model_parallel_size} x "
                              f"--expert-tensor-parallel-size {self.effective_expert_tensor_parallel_size} = {grid} does not "
                              f"divide the {ranks} ranks of a pipeline stage (world size / "
                              f"--pipeline-model-parallel-size); valid products: {_divisors(ranks)}", "expert_layout")

    @classmethod
    def from_sizes(cls, *, world_size: int, global_batch_size: int, micro_batch_size: int = 1,
                   tensor_model_parallel_size: int = 1, context_parallel_size: int = 1,
                   pipeline_model_parallel_size: int = 1, virtual_pipeline_model_parallel_size: Optional[int] = None,
                   microbatch_group_size_per_vp_stage: Optional[int] = None, num_layers: Optional[int] = None,
                   num_layers_per_virtual_pipeline_stage: Optional[int] = None,
                   expert_model_parallel_size: int = 1, expert_tensor_parallel_size: Optional[int] = None,
                   **split) -> "ParallelLayout":
        """The layout of a job of ``world_size`` ranks, with d and m derived and every rule checked.

        v comes from ``virtual_pipeline_model_parallel_size`` (None or 1: not interleaved) or, given
        ``num_layers``, from ``num_layers_per_virtual_pipeline_stage`` (or ``split``'s
        ``num_virtual_stages_per_pipeline_rank``) as Megatron-LM derives it; with ``num_layers`` the layer split
        over the stages is checked too (:func:`pipeline_split`, whose keyword arguments ``split`` takes: uneven
        first/last stages, --account-for-*).
        Checks run in the order world size, layers, batch, interleaving, expert grid; the first broken rule raises.
        """
        t, c, p = tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size
        for flag, n in (("world size", world_size), ("--tensor-model-parallel-size", t),
                        ("--context-parallel-size", c), ("--pipeline-model-parallel-size", p),
                        ("--global-batch-size", global_batch_size), ("--micro-batch-size", micro_batch_size)):
            _positive(flag, n)
        if world_size % (t * c * p):
            raise LayoutError(f"world size {world_size} is not a multiple of --tensor-model-parallel-size {t} x "
                              f"--context-parallel-size {c} x --pipeline-model-parallel-size {p} = {t * c * p}; "
                              f"valid: world sizes that are multiples of {t * c * p}", "world_size")
        d = world_size // (t * c * p)
        v = virtual_pipeline_model_parallel_size or 1
        if num_layers is not None:
            derived = virtual_pipeline_size(num_layers, p, num_layers_per_virtual_pipeline_stage, **split)
            if virtual_pipeline_model_parallel_size not in (None, derived):
                raise LayoutError(f"virtual pipeline size {virtual_pipeline_model_parallel_size} differs from the "
                                  f"{derived} model chunks per rank of --num-layers-per-virtual-pipeline-stage "
                                  f"{num_layers_per_virtual_pipeline_stage}; valid: {derived}",
                                  "num_layers_per_virtual_pipeline_stage")
            v = derived
        shard = micro_batch_size * d
        if global_batch_size % shard:
            raise LayoutError(f"--global-batch-size {global_batch_size} is not a multiple of --micro-batch-size "
                              f"{micro_batch_size} x data-parallel size {d} = {shard}; valid: multiples of {shard}",
                              "global_batch_size")
        return cls(tensor_model_parallel_size=t, context_parallel_size=c, pipeline_model_parallel_size=p,
                   virtual_pipeline_model_parallel_size=v, data_parallel_size=d,
                   num_microbatches=global_batch_size // shard,
                   microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage,
                   expert_model_parallel_size=expert_model_parallel_size,
                   expert_tensor_parallel_size=expert_tensor_parallel_size)

    # -- derived sizes -------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """t x c x p x d ranks."""
        return (self.tensor_model_parallel_size * self.context_parallel_size * self.pipeline_model_parallel_size
                * self.data_parallel_size)

    @property
    def data_and_context_parallel_size(self) -> int:
        """d x c: megatron-core's data-parallel group with context parallelism (gradients are reduced and the
        distributed optimizer is sharded over it; the cost model's ``Plan.data_parallel_size``)."""
        return self.data_parallel_size * self.context_parallel_size

    @property
    def effective_expert_tensor_parallel_size(self) -> int:
        """etp in effect: ``expert_tensor_parallel_size``, else t (Megatron's default)."""
        etp = self.expert_tensor_parallel_size
        return self.tensor_model_parallel_size if etp is None else etp

    @property
    def interleaved(self) -> bool:
        """True for interleaved 1F1B (v > 1)."""
        return self.virtual_pipeline_model_parallel_size > 1

    @property
    def microbatch_group_size(self) -> int:
        """The interleaving group size in effect (megatron-core's default p)."""
        g = self.microbatch_group_size_per_vp_stage
        return self.pipeline_model_parallel_size if g is None else g

    # -- rules that involve the model's shape ----------------------------------------------------------
    def check_num_layers(self, num_layers: int, **split) -> PipelineSplit:
        """The layers split over the p stages (evenly, with uneven first/last stages or with --account-for-*:
        ``split``, :func:`pipeline_split`'s keyword arguments) and into this layout's v chunks; the split."""
        p, v = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        even = pipeline_split(num_layers, p, **{k: x for k, x in split.items()
                                                if k != "num_virtual_stages_per_pipeline_rank"}) if v == 1 else None
        if even is not None:
            return even
        try:
            return pipeline_split(num_layers, p, num_virtual_stages_per_pipeline_rank=v, **split)
        except LayoutError as e:
            if e.rule != "num_layers_per_virtual_pipeline_stage":
                raise
            per_rank = PipelineSplit(num_layers, p, 1, **{k: x for k, x in split.items()
                                                          if k != "num_virtual_stages_per_pipeline_rank"}).rank_slots(0)
            raise LayoutError(f"the {per_rank} layers per pipeline rank (--num-layers {num_layers} / "
                              f"--pipeline-model-parallel-size {p}) do not split into {v} model chunks; "
                              f"valid chunk counts: {_divisors(per_rank)}", "num_layers_per_virtual_pipeline_stage") \
                from None

    def check_tensor_split(self, *, num_attention_heads: int, num_query_groups: Optional[int] = None,
                           ffn_hidden_size: Optional[int] = None) -> None:
        """t divides the attention heads, the query groups (GQA) and the MLP's columns (Megatron splits each
        evenly over the tensor-parallel ranks)."""
        t = self.tensor_model_parallel_size
        for flag, n in (("--num-attention-heads", num_attention_heads), ("--num-query-groups", num_query_groups),
                        ("--ffn-hidden-size", ffn_hidden_size)):
            if n is not None and n % t:
                raise LayoutError(f"{flag} {n} is not a multiple of --tensor-model-parallel-size {t}; "
                                  f"valid --tensor-model-parallel-size: {_divisors(n)}", flag[2:].replace("-", "_"))

    def check_experts(self, *, num_experts: Optional[int], expert_ffn_hidden_size: Optional[int] = None) -> None:
        """ep divides the experts and etp each expert's MLP width; without experts (a dense model) ep and etp stay
        at their defaults (Megatron-LM refuses --expert-model-parallel-size > 1 without --num-experts)."""
        ep, etp = self.expert_model_parallel_size, self.effective_expert_tensor_parallel_size
        if num_experts is None:
            if ep > 1:
                raise LayoutError(f"--expert-model-parallel-size {ep} needs --num-experts (a mixture-of-experts "
                                  f"model); valid: 1", "expert_layout")
            return
        if num_experts % ep:
            raise LayoutError(f"--num-experts {num_experts} is not a multiple of --expert-model-parallel-size {ep}; "
                              f"valid --expert-model-parallel-size: {_divisors(num_experts)}", "expert_layout")
        if expert_ffn_hidden_size is not None and expert_ffn_hidden_size % etp:
            raise LayoutError(f"--moe-ffn-hidden-size {expert_ffn_hidden_size} is not a multiple of "
                              f"--expert-tensor-parallel-size {etp}; valid --expert-tensor-parallel-size: "
                              f"{_divisors(expert_ffn_hidden_size)}", "expert_layout")

    def check_seq_length(self, seq_length: int, *, sequence_parallel: bool = True) -> None:
        """With c > 1 the sequence is 2c equal chunks; with sequence parallelism (t > 1) each rank's context
        shard s/c splits over t."""
        t, c, s = self.tensor_model_parallel_size, self.context_parallel_size, seq_length
        _positive("--seq-length", s)
        if c > 1 and s % (2 * c):
            raise LayoutError(f"--seq-length {s} is not a multiple of 2 x --context-parallel-size {c} = {2 * c} "
                              f"(each rank holds 2 of 2c equal chunks); valid: multiples of {2 * c}",
                              "seq_length_context_parallel")
        if sequence_parallel and t > 1 and s % (c * t):
            raise LayoutError(f"--seq-length {s} is not a multiple of --context-parallel-size {c} x "
                              f"--tensor-model-parallel-size {t} = {c * t} (--sequence-parallel splits each context "
                              f"shard over the tensor-parallel ranks); valid: multiples of {c * t}",
                              "seq_length_sequence_parallel")


__all__ = ["LAYOUT_FLAG", "RULES", "LayoutError", "ParallelLayout", "PipelineSplit", "parse_pipeline_layout",
           "pipeline_split", "virtual_pipeline_size"]
