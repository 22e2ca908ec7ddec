"""The parallel layout of a Megatron job (:class:`ParallelLayout`; see :mod:`h3t_ext.layout`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from h3t_ext.layout.pipeline_split import PipelineSplit, pipeline_split, virtual_pipeline_size
from h3t_ext.layout.rules import _NUM_MB, LayoutError, _check_interleaving, _divisors, _positive


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
                              f"--expert-tensor-parallel-size {self.effective_expert_tensor_parallel_size} = {grid} "
                              f"does not divide the {ranks} ranks of a pipeline stage (world size / "
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


__all__ = ["ParallelLayout"]
