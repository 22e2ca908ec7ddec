"""The parallel layout of a Megatron job and every rule on it, in one place.

A :class:`ParallelLayout` is the tensor, context, pipeline, virtual-pipeline and data-parallel
sizes plus the microbatches per iteration, under Megatron's names. Its rules are those Megatron-LM
and megatron-core 0.16.1 enforce:

* the world size is t x c x p x d (``args.data_parallel_size = world_size // (t p c)``);
* the global batch is a whole number of micro batches per data-parallel rank
  (``num_microbatches = global_batch_size // (micro_batch_size x d)``);
* the layers split evenly over the p pipeline ranks (or, with uneven first/last stages, the rest
  splits evenly over the middle ranks), and over the v model chunks of each rank;
* interleaving (v > 1) needs p > 1 and megatron-core's microbatch grouping of
  ``forward_backward_pipelining_with_interleaving``: with ``microbatch_group_size_per_vp_stage`` g
  (default p), p <= g <= m and m mod g is 0 or >= p (so with the default, m a multiple of p);
* the tensor-parallel split: t divides the attention heads, the query groups and the MLP columns;
* the sequence split: with c > 1 the sequence is 2c equal chunks, and with sequence parallelism each
  context shard splits over t (s a multiple of c x t).

Every broken rule raises :class:`LayoutError` with one line naming the Megatron flag(s) and the
valid values. The cost model (``h3t_ext.costmodel.plan``), the schedule builder
(``h3t_ext.schedule.builder``), the runtime (``h3t_ext.runtime.schedules``) and the driver take their
verdicts from here, so a layout one of them refuses is refused by all with the same reason.

This module imports nothing from the rest of h3t_ext (no cycles; pure arithmetic).
In formulas t, c, p, v, d, m are the six sizes; public names are Megatron's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class LayoutError(ValueError):
    """A parallel layout Megatron cannot run; ``reason`` is one line naming the flag(s) and valid values."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


def _require(ok: bool, reason: str) -> None:
    if not ok:
        raise LayoutError(reason)


def _positive(name: str, value) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
             f"{name} {value!r} is outside [1, inf); valid: integers >= 1")


def _divisors(n: int) -> str:
    """``n``'s divisors as a short list for a message."""
    ds = [k for k in range(1, n + 1) if n % k == 0] if n <= 10**6 else []
    return ", ".join(map(str, ds)) if 0 < len(ds) <= 12 else f"divisors of {n}"


_SHARD = "--micro-batch-size x data-parallel size"
_NUM_MB = "number of microbatches (--global-batch-size / (--micro-batch-size x data-parallel size))"


def _check_chunks(p: int, v: int) -> None:
    """Model chunks (v > 1) need a pipeline: megatron-core runs no interleaving without one."""
    _require(v == 1 or p > 1, f"{v} model chunks per pipeline rank (--num-layers-per-virtual-pipeline-stage) need "
                              f"--pipeline-model-parallel-size > 1, it is {p}; valid: --pipeline-model-parallel-size "
                              f">= 2, or one model chunk per rank")


def _check_interleaving(p: int, v: int, m: int, group: Optional[int]) -> None:
    """megatron-core 0.16.1's rules of ``forward_backward_pipelining_with_interleaving``."""
    if v == 1:
        return
    _check_chunks(p, v)
    if group is None:  # Megatron's default group size p: m >= p and m mod p in {0} (or >= p: impossible)
        _require(m % p == 0, f"interleaved 1F1B needs the {_NUM_MB} = {m} to be a multiple of "
                             f"--pipeline-model-parallel-size {p}; valid: multiples of {p}")
        return
    g = group
    _require(p <= g <= m, f"--microbatch-group-size-per-virtual-pipeline-stage {g} is outside "
                          f"[--pipeline-model-parallel-size {p}, {_NUM_MB} {m}]; valid: {p} to {m}")
    rest = m % g
    _require(rest == 0 or rest >= p,
             f"interleaved 1F1B: the {_NUM_MB} = {m} mod --microbatch-group-size-per-virtual-pipeline-stage "
             f"{g} = {rest} must be 0 or >= --pipeline-model-parallel-size {p}; valid: remainders 0 or {p} to {g - 1}")


def _check_uneven(num_layers: int, p: int, first: Optional[int], last: Optional[int]) -> None:
    L = num_layers
    for flag, n in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        _require(n is None or (isinstance(n, int) and 1 <= n < L), f"{flag} {n!r} is outside [1, {L - 1}] "
                                                                   f"(--num-layers {L}); valid: 1 to {L - 1}")
    _require(p > 1, f"--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers need "
                    f"--pipeline-model-parallel-size > 1, it is {p}; valid: >= 2")
    middle = p - (first is not None) - (last is not None)
    rest = L - (first or 0) - (last or 0)
    ok = (middle == 0 and rest == 0) or (middle > 0 and rest > 0 and rest % middle == 0)
    given = " and ".join(f"{flag} {n}" for flag, n in (("--decoder-first-pipeline-num-layers", first),
                                                      ("--decoder-last-pipeline-num-layers", last)) if n is not None)
    valid = (f"first/last stage layers that leave a positive multiple of {middle} layers" if middle > 0
             else f"first + last stage layers = {L}")
    _require(ok, f"--num-layers {L} minus {given} leaves {rest} layer(s), which do not split evenly over the other "
                 f"{middle} pipeline stage(s) (--pipeline-model-parallel-size {p}); valid: {valid}")


def _check_even(num_layers: int, p: int) -> None:
    _require(num_layers % p == 0, f"--num-layers {num_layers} is not a multiple of --pipeline-model-parallel-size "
                                  f"{p}; valid: multiples of {p}, or uneven stages with "
                                  f"--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")


def virtual_pipeline_size(num_layers: int, pipeline_model_parallel_size: int,
                          num_layers_per_virtual_pipeline_stage: Optional[int] = None, *,
                          decoder_first_pipeline_num_layers: Optional[int] = None,
                          decoder_last_pipeline_num_layers: Optional[int] = None) -> int:
    """v = (L/p) / l model chunks per pipeline rank (1 when ``l`` is None), after checking that the layers
    split over the pipeline ranks (evenly, or with the uneven first/last stages) and over the chunks."""
    L, p, l = num_layers, pipeline_model_parallel_size, num_layers_per_virtual_pipeline_stage
    _positive("--num-layers", L)
    _positive("--pipeline-model-parallel-size", p)
    first, last = decoder_first_pipeline_num_layers, decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        _require(l is None, "--num-layers-per-virtual-pipeline-stage cannot be combined with "
                            "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers; valid: one "
                            "of them")
        _check_uneven(L, p, first, last)
        return 1
    _check_even(L, p)
    if l is None:
        return 1
    _positive("--num-layers-per-virtual-pipeline-stage", l)
    per_rank = L // p
    _require(per_rank % l == 0, f"--num-layers-per-virtual-pipeline-stage {l} does not divide the {per_rank} "
                                f"layers per pipeline rank (--num-layers {L} / --pipeline-model-parallel-size {p}); "
                                f"valid: {_divisors(per_rank)}")
    v = per_rank // l
    _check_chunks(p, v)
    return v


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

    @classmethod
    def from_sizes(cls, *, world_size: int, global_batch_size: int, micro_batch_size: int = 1,
                   tensor_model_parallel_size: int = 1, context_parallel_size: int = 1,
                   pipeline_model_parallel_size: int = 1, virtual_pipeline_model_parallel_size: Optional[int] = None,
                   microbatch_group_size_per_vp_stage: Optional[int] = None, num_layers: Optional[int] = None,
                   num_layers_per_virtual_pipeline_stage: Optional[int] = None,
                   decoder_first_pipeline_num_layers: Optional[int] = None,
                   decoder_last_pipeline_num_layers: Optional[int] = None) -> "ParallelLayout":
        """The layout of a job of ``world_size`` ranks, with d and m derived and every rule checked.

        v comes from ``virtual_pipeline_model_parallel_size`` (None or 1: not interleaved) or, given
        ``num_layers``, from ``num_layers_per_virtual_pipeline_stage`` as Megatron-LM derives it; with
        ``num_layers`` the layer split over the stages is checked too (:meth:`check_num_layers`).
        Checks run in the order world size, layers, batch, interleaving; the first broken rule raises.
        """
        t, c, p = tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size
        _positive("world size", world_size)
        _positive("--tensor-model-parallel-size", t)
        _positive("--context-parallel-size", c)
        _positive("--pipeline-model-parallel-size", p)
        _positive("--global-batch-size", global_batch_size)
        _positive("--micro-batch-size", micro_batch_size)
        _require(world_size % (t * c * p) == 0,
                 f"world size {world_size} is not a multiple of --tensor-model-parallel-size {t} x "
                 f"--context-parallel-size {c} x --pipeline-model-parallel-size {p} = {t * c * p}; "
                 f"valid: world sizes that are multiples of {t * c * p}")
        d = world_size // (t * c * p)
        v = virtual_pipeline_model_parallel_size or 1
        if num_layers is not None:
            derived = virtual_pipeline_size(num_layers, p, num_layers_per_virtual_pipeline_stage,
                                            decoder_first_pipeline_num_layers=decoder_first_pipeline_num_layers,
                                            decoder_last_pipeline_num_layers=decoder_last_pipeline_num_layers)
            _require(virtual_pipeline_model_parallel_size in (None, derived),
                     f"virtual pipeline size {virtual_pipeline_model_parallel_size} differs from the {derived} "
                     f"model chunks per rank of --num-layers-per-virtual-pipeline-stage "
                     f"{num_layers_per_virtual_pipeline_stage}; valid: {derived}")
            v = derived
        shard = micro_batch_size * d
        _require(global_batch_size % shard == 0,
                 f"--global-batch-size {global_batch_size} is not a multiple of --micro-batch-size {micro_batch_size} "
                 f"x data-parallel size {d} = {shard}; valid: multiples of {shard}")
        return cls(tensor_model_parallel_size=t, context_parallel_size=c, pipeline_model_parallel_size=p,
                   virtual_pipeline_model_parallel_size=v, data_parallel_size=d,
                   num_microbatches=global_batch_size // shard,
                   microbatch_group_size_per_vp_stage=microbatch_group_size_per_vp_stage)

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
    def interleaved(self) -> bool:
        """True for interleaved 1F1B (v > 1)."""
        return self.virtual_pipeline_model_parallel_size > 1

    @property
    def microbatch_group_size(self) -> int:
        """The interleaving group size in effect (megatron-core's default p)."""
        g = self.microbatch_group_size_per_vp_stage
        return self.pipeline_model_parallel_size if g is None else g

    def global_batch_size(self, micro_batch_size: int) -> int:
        """Samples per iteration: m x micro_batch_size x d."""
        return self.num_microbatches * micro_batch_size * self.data_parallel_size

    # -- rules that involve the model's shape ----------------------------------------------------------
    def check_num_layers(self, num_layers: int, *, decoder_first_pipeline_num_layers: Optional[int] = None,
                         decoder_last_pipeline_num_layers: Optional[int] = None) -> None:
        """The layers split over the p stages (evenly or with uneven first/last stages) and the v chunks."""
        p, v = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size
        virtual_pipeline_size(num_layers, p, decoder_first_pipeline_num_layers=decoder_first_pipeline_num_layers,
                              decoder_last_pipeline_num_layers=decoder_last_pipeline_num_layers)
        if v > 1:
            _require(decoder_first_pipeline_num_layers is None and decoder_last_pipeline_num_layers is None,
                     "--num-layers-per-virtual-pipeline-stage cannot be combined with "
                     "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers; valid: one of them")
            per_rank = num_layers // p
            _require(per_rank % v == 0, f"the {per_rank} layers per pipeline rank (--num-layers {num_layers} / "
                                        f"--pipeline-model-parallel-size {p}) do not split into {v} model chunks; "
                                        f"valid chunk counts: {_divisors(per_rank)}")

    def check_tensor_split(self, *, num_attention_heads: int, num_query_groups: Optional[int] = None,
                           ffn_hidden_size: Optional[int] = None) -> None:
        """t divides the attention heads, the query groups (GQA) and the MLP's columns (Megatron splits each
        evenly over the tensor-parallel ranks)."""
        t = self.tensor_model_parallel_size
        for flag, n in (("--num-attention-heads", num_attention_heads), ("--num-query-groups", num_query_groups),
                        ("--ffn-hidden-size", ffn_hidden_size)):
            if n is not None:
                _require(n % t == 0, f"{flag} {n} is not a multiple of --tensor-model-parallel-size {t}; "
                                     f"valid --tensor-model-parallel-size: {_divisors(n)}")

    def check_seq_length(self, seq_length: int, *, sequence_parallel: bool = True) -> None:
        """With c > 1 the sequence is 2c equal chunks; with sequence parallelism (t > 1) each rank's context shard
        s/c splits over t."""
        t, c, s = self.tensor_model_parallel_size, self.context_parallel_size, seq_length
        _positive("--seq-length", s)
        if c > 1:
            _require(s % (2 * c) == 0, f"--seq-length {s} is not a multiple of 2 x --context-parallel-size {c} = "
                                       f"{2 * c} (each rank holds 2 of 2c equal chunks); valid: multiples of {2 * c}")
        if sequence_parallel and t > 1:
            _require(s % (c * t) == 0, f"--seq-length {s} is not a multiple of --context-parallel-size {c} x "
                                       f"--tensor-model-parallel-size {t} = {c * t} (--sequence-parallel splits each "
                                       f"context shard over the tensor-parallel ranks); valid: multiples of {c * t}")


__all__ = ["LayoutError", "ParallelLayout", "virtual_pipeline_size"]
