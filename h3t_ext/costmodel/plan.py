"""The parallel plan (Megatron's flag names); the rules it meets to be built are :mod:`h3t_ext.costmodel.plan_checks`'s
(layout rules: h3t_ext.layout)."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Optional

from h3t_ext.ckpt import CKPT_CHOICES, NO_RECOMPUTE, Ckpt, Recompute, split_ckpt  # noqa: F401  (CKPT_CHOICES re-exported)
from h3t_ext.costmodel.errors import InvalidPlanError
from h3t_ext.costmodel.fp8 import DEFAULT_FP8_RECIPE, bf16_layers_in
from h3t_ext.costmodel.kernels import attention_kernel
from h3t_ext.costmodel.specs import SystemSpec
from h3t_ext.layout import PipelineSplit, parse_pipeline_layout
from h3t_ext.offload_alpha import Alpha

SELECTIVE = Ckpt.SELECTIVE
"""Megatron's --recompute-granularity selective: the attention core is recomputed in backward. The cost model
prices it (published runs use it); with flash attention nothing of the core is saved anyway, so its
activation bytes are those of 'no'."""
PRICED_CKPT = tuple(Ckpt)
TRANSFORMER_IMPLS = ("transformer_engine", "local")
OPTIMIZER_IMPLS = ("fused", "torch")
"""The Adam megatron-core steps with (``Plan.optimizer_impl``)."""
LAYER_SPEC = {"transformer_engine": "te", "local": "local"}
"""Layer spec of the activation byte counts (activations.py) for each --transformer-impl."""
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused")
"""Megatron's --attention-backend (its AttnBackend names; 'local' is priced as 'unfused'): 'flash' (FlashAttention,
Dao's kernels), 'fused' (cuDNN's fused attention through TransformerEngine), 'auto' (what TransformerEngine selects:
:func:`h3t_ext.costmodel.kernels.attention_kernel`), all three saving no s^2 scores; or 'unfused' (batched GEMMs and
a fused softmax over the s^2 scores in HBM)."""

FSDP_SHARDING_STRATEGIES = ("optim_grads", "optim_grads_params")
"""Megatron FSDP's --data-parallel-sharding-strategy values that shard more than the distributed optimizer:
gradients (ZeRO-2 like, reduce-scattered after every microbatch's backward) and also parameters (ZeRO-3
like, all-gathered before every microbatch's forward and backward). 'optim' is priced as the distributed
optimizer and 'no_shard' as plain DDP."""
FSDP2_SHARDING = "optim_grads_params"
"""Torch FSDP2 (``fully_shard``) shards what Megatron FSDP's 'optim_grads_params' does: parameters, gradients
and optimizer states."""



@dataclass(frozen=True)
class Plan:
    """One way to run a model on a cluster."""

    num_gpus: int
    """GPUs in the job (t * c * (d/c) * p = t * d * p)."""
    seq_length: int
    """Tokens per sample s."""
    global_batch_size: int
    """Samples per iteration B."""
    micro_batch_size: int = 1
    """Samples per microbatch."""
    tensor_model_parallel_size: int = 1
    """t (sequence parallel is always on when t > 1)."""
    context_parallel_size: int = 1
    """c."""
    pipeline_model_parallel_size: int = 1
    """p."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """l; None means L/p (plain 1F1B, v = 1)."""
    ckpt: Ckpt = Ckpt.NO
    """Activation checkpointing (a :class:`~h3t_ext.ckpt.Ckpt`; its flag text is coerced)."""
    recompute: Recompute = NO_RECOMPUTE
    """Megatron's --recompute-granularity/-method/-num-layers/-modules on top of ``ckpt`` (``no`` or ``ours``;
    ``full`` and ``selective`` imply their own), priced by :mod:`h3t_ext.costmodel.recompute`."""
    offload_alpha: Alpha = 0.0
    """Fraction of saved activations offloaded to host; a tuple gives one value per pipeline stage."""
    overlap_grad_reduce: bool = False
    """Megatron's --overlap-grad-reduce: data-parallel reduce-scatter behind the backward pass (the
    published throughput table ran without it)."""
    overlap_param_gather: bool = False
    """Megatron's --overlap-param-gather: parameter all-gather behind the next forward pass."""
    tp_comm_overlap: bool = False
    """Megatron's --tp-comm-overlap: TransformerEngine userbuffers overlap the sequence-parallel all-gathers
    and reduce-scatters with the GEMMs (only ``tp_comm_overlap_exposed`` of them stays on the critical path)."""
    overlap_p2p_comm: bool = True
    """Megatron's --overlap-p2p-communication (on unless --no-overlap-p2p-communication): with an interleaved
    schedule each step's pipeline sends and receives run behind the next chunk's compute. Off (and in Megatron
    before 2023, which had no such overlap) every interleaved step waits for its exchange. Plain 1F1B waits
    for its two exchanges per microbatch either way."""
    sequence_parallel: bool = True
    """Megatron's --sequence-parallel (with t > 1): norms and dropout on s/t tokens, all-gather /
    reduce-scatter instead of all-reduce."""
    use_distributed_optimizer: bool = True
    """Megatron's --use-distributed-optimizer: fp32 master weights and Adam states sharded over d, gradients
    reduce-scattered and parameters all-gathered; off: replicated states and a gradient all-reduce."""
    data_parallel_sharding_strategy: Optional[str] = None
    """Megatron FSDP (--use-megatron-fsdp) with --data-parallel-sharding-strategy 'optim_grads' or
    'optim_grads_params' (see FSDP_SHARDING_STRATEGIES); None: Megatron's DDP."""
    use_torch_fsdp2: bool = False
    """Megatron's --use-torch-fsdp2: megatron-core's TorchFullyShardedDataParallel, ``fully_shard`` on every
    transformer layer (and the embedding and output layer): parameters, gradients and optimizer states sharded over
    d (:attr:`sharding_strategy` 'optim_grads_params'), without the distributed optimizer (Megatron-LM refuses
    both) and with p = 1; each layer's parameters all-gathered before its forward and its backward and its
    gradients reduce-scattered after every microbatch's backward, prefetched and overlapped with compute (FSDP2's
    own streams, whatever --overlap-grad-reduce says)."""
    torch_fsdp2_reshard_after_forward: bool = True
    """Megatron's --torch-fsdp2-no-reshard-after-forward clears it (its field ``torch_fsdp2_reshard_after_forward``):
    the gathered parameters of every layer are kept from its forward to its backward (one all-gather per layer and
    microbatch instead of two, the chunk's parameters whole on the device until the backward)."""
    optimizer_cpu_offload: bool = False
    """Megatron's --optimizer-cpu-offload (with --use-precision-aware-optimizer and the distributed optimizer, as
    Megatron-LM's arguments.py requires): a share of the optimizer shard is stepped on the CPU by megatron-core's
    HybridDeviceOptimizer (:mod:`h3t_ext.costmodel.optimizer_offload`)."""
    optimizer_offload_fraction: float = 1.0
    """Megatron's --optimizer-offload-fraction (default 1.0): that share, in [0, 1]."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """Megatron's --overlap-cpu-optimizer-d2h-h2d: gradient and parameter copies pipelined with the CPU steps."""
    attention_backend: str = "auto"
    """Megatron's --attention-backend, default 'auto' (see ATTENTION_BACKENDS)."""
    grad_reduce_in_bf16: bool = False
    """The gradient buffer and its data-parallel reduction in 16 bits (2 bytes per parameter) instead of fp32
    (megatron-core's DDP ``grad_reduce_in_fp32``, Megatron-LM's default with bf16): Megatron's --grad-reduce-in-bf16,
    or an --fp16 run's fp16 gradients (:func:`h3t_ext.planner.translate.sixteen_bit_grads`)."""

    fp16: bool = False
    """Megatron's --fp16: parameters and activations in fp16 instead of bf16, priced alike (the same tensor-core
    rate on Ampere and Hopper, the same bytes); its gradients are ``grad_reduce_in_bf16``'s 16 bits unless the run
    keeps fp32 accumulation (:func:`h3t_ext.planner.translate.sixteen_bit_grads`). Kept for the flags it prints."""

    @property
    def grad_bytes(self) -> int:
        """Bytes per parameter of the gradient buffer and of its reduce-scatter / all-reduce."""
        return 2 if self.grad_reduce_in_bf16 else 4
    transformer_impl: str = "transformer_engine"
    """Megatron's --transformer-impl: 'transformer_engine' (megatron-core's TE layer spec) or 'local' (h3t-ext's
    local spec, whose ckpt=no MLP saves what the fused kernels save whatever the fusion flags say)."""
    bias_activation_fusion: bool = True
    """megatron-core's ``TransformerConfig.bias_activation_fusion`` for a SwiGLU MLP (Megatron-LM's default; its
    --no-bias-swiglu-fusion clears it): one jit-fused kernel that saves its input only. Unfused, megatron-core 0.16+
    computes ``silu(gate) * (linear + glu_linear_offset)`` op by op: the product keeps both factors, two more f-wide
    tensors per token, and three kernels run where one did (:func:`h3t_ext.costmodel.activations.mlp_activation_impl`).
    A GeLU MLP saves the same either way. Read on the 'transformer_engine' spec only."""
    cross_entropy_loss_fusion: bool = False
    """Megatron's --cross-entropy-loss-fusion: the vocabulary-parallel cross entropy in fused kernels
    (``cross_entropy_fusion_impl``); fewer bytes and kernels on the last stage, the same saved 4 bytes a logit
    (:data:`h3t_ext.costmodel.elementwise.FUSED_CROSS_ENTROPY`)."""
    cross_entropy_fusion_impl: str = "native"
    """Megatron's --cross-entropy-fusion-impl: 'native' (megatron-core's jit-fused functions) or 'te'
    (TransformerEngine's triton kernel); read with ``cross_entropy_loss_fusion``."""
    transformer_engine_version: Optional[str] = None
    """The TransformerEngine the run imports, 'MAJOR.MINOR' (None: the newest this package knows). Not a Megatron
    flag: ``h3t-plan --transformer-engine-version`` and the driver's installed TransformerEngine set it; where TE
    changed what a kernel saves, it picks the rule (:mod:`h3t_ext.costmodel.te_version`)."""
    use_legacy_models: bool = False
    """Megatron-LM's --use-legacy-models (through core 0.15): the legacy GPT model (``megatron/legacy/model``, the
    code Megatron-Kwai's ATC '24 runs use), whose SwiGLU is never fused and multiplies ``silu(gate)`` by the linear
    half directly: one more f-wide saved tensor than the fused kernel, timed as the fused one
    (:data:`h3t_ext.costmodel.elementwise.LEGACY_GLU_TIMED_AS_FUSED`). Not a flag of ``h3t-plan`` (Megatron-LM 0.16+
    has no legacy models); the published ATC '24 runs set it."""
    optimizer_impl: str = "fused"
    """The Adam megatron-core steps with; it takes the first it can import: 'fused' (TransformerEngine's or apex's
    FusedAdam, multi-tensor kernels updating in place) or 'torch' (torch.optim.AdamW, its fallback without both, whose
    foreach step allocates an fp32 temporary per parameter: ``memory.OPTIMIZER_STEP_TEMPORARY_BYTES``). Not a Megatron
    flag: what the machine has installed (h3t-plan --optimizer-impl; the driver reads megatron-core's choice)."""
    decoder_first_pipeline_num_layers: Optional[int] = None
    """Megatron's --decoder-first-pipeline-num-layers: layers of the first stage (the rest split evenly)."""
    decoder_last_pipeline_num_layers: Optional[int] = None
    """Megatron's --decoder-last-pipeline-num-layers: layers of the last stage."""
    num_virtual_stages_per_pipeline_rank: Optional[int] = None
    """Megatron's --num-virtual-stages-per-pipeline-rank: v model chunks per rank given directly, the way
    Megatron-LM interleaves uneven stages (which refuse ``num_layers_per_virtual_pipeline_stage``)."""
    account_for_embedding_in_pipeline_split: bool = False
    """Megatron's --account-for-embedding-in-pipeline-split: the embedding counts as one layer of the first stage
    (L + 1 split evenly; the first stage's first chunk builds one transformer layer fewer)."""
    account_for_loss_in_pipeline_split: bool = False
    """Megatron's --account-for-loss-in-pipeline-split: the loss counts as one layer of the last stage."""
    pipeline_model_parallel_layout: Optional[str] = None
    """megatron-core's --pipeline-model-parallel-layout (e.g. ``Ett|tt|tt|tL``): every model chunk's layers as
    written (:func:`h3t_ext.layout.parse_pipeline_layout`; v is its stages / p); it excludes the other split flags."""
    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Megatron's --microbatch-group-size-per-virtual-pipeline-stage g (interleaving only): each model chunk runs g
    microbatches before the next chunk takes over, so a rank's warm-up holds (v - 1) g + 2 (p - rank - 1)
    microbatch-chunks (:func:`h3t_ext.schedule.builder.schedule_table`); None: megatron-core's default g = p."""
    fp8: Optional[str] = None
    """Megatron's --fp8-format (its field ``fp8``): 'e4m3' or 'hybrid' runs the linear layers' GEMMs in FP8
    through TransformerEngine (h3t_ext.costmodel.fp8); None: BF16 (Megatron's default)."""
    fp8_recipe: str = DEFAULT_FP8_RECIPE
    """Megatron's --fp8-recipe: 'delayed' (its default), 'tensorwise', 'blockwise' or 'mxfp8' (Blackwell)."""
    fp8_param_gather: bool = False
    """Megatron's --fp8-param-gather: parameters held and all-gathered in FP8 (needs --fp8-format)."""
    first_last_layers_bf16: bool = False
    """Megatron's --first-last-layers-bf16: an FP8 plan's first and last layers run in BF16 (not with the delayed
    recipe; :mod:`h3t_ext.costmodel.fp8`)."""
    num_layers_at_start_in_bf16: int = 1
    """Megatron's --num-layers-at-start-in-bf16: the model's first layers kept in BF16 (0 .. L / p)."""
    num_layers_at_end_in_bf16: int = 1
    """Megatron's --num-layers-at-end-in-bf16: the model's last layers kept in BF16 (0 .. L / p)."""
    expert_model_parallel_size: int = 1
    """Megatron's --expert-model-parallel-size ep: ranks that split a MoE model's experts (:mod:`h3t_ext.costmodel.moe`)."""
    expert_tensor_parallel_size: Optional[int] = None
    """Megatron's --expert-tensor-parallel-size etp: ranks that split each expert's weights; None: t (its default)."""
    moe_token_dispatcher_type: str = "allgather"
    """Megatron's --moe-token-dispatcher-type: 'allgather' (its default), 'alltoall' or 'flex' (DeepEP: a token crosses
    the network once per node its experts lie in, :func:`h3t_ext.costmodel.moe.deepep_seconds`)."""
    moe_grouped_gemm: bool = False
    """Megatron's --moe-grouped-gemm: one grouped GEMM per FC over a rank's experts instead of one GEMM per expert."""
    moe_shared_expert_overlap: bool = False
    """Megatron's --moe-shared-expert-overlap: the shared expert runs on a side stream while the token exchange runs
    (its FC1 and activation during the dispatch, its FC2 during the combine; their backwards likewise, on the streams
    the forward used), hiding the exchange up to the shared expert's compute (alltoall dispatcher only)."""
    overlap_moe_expert_parallel_comm: bool = False
    """Megatron's --overlap-moe-expert-parallel-comm: one microbatch's forward merged with another's backward, layer by
    layer, each token exchange running beside the other microbatch's compute (:func:`h3t_ext.costmodel.moe.
    merged_layer_seconds`); every adjacent forward-backward pair of different microbatches in a rank's schedule
    merges (1F1B's steady state; at pipeline size 1 each backward with the next forward)."""

    def __post_init__(self) -> None:
        if not isinstance(self.ckpt, Ckpt):
            try:
                object.__setattr__(self, "ckpt", Ckpt(self.ckpt))
            except ValueError:
                raise InvalidPlanError(f"ckpt must be one of {', '.join(PRICED_CKPT)}, got {self.ckpt!r}") from None
        if self.recompute is NO_RECOMPUTE:  # the search's plans: nothing to contradict
            return
        try:
            split_ckpt(self.ckpt, self.recompute)
        except ValueError as exc:
            raise InvalidPlanError(str(exc)) from None

    @property
    def sharding_strategy(self) -> Optional[str]:
        """What the data-parallel ranks shard beyond the distributed optimizer, as Megatron FSDP names it:
        --data-parallel-sharding-strategy, or 'optim_grads_params' under torch FSDP2; None: Megatron's DDP."""
        return FSDP2_SHARDING if self.use_torch_fsdp2 else self.data_parallel_sharding_strategy

    @property
    def precision(self) -> str:
        """'fp8' with --fp8-format, else 'bf16'."""
        return "bf16" if self.fp8 is None else "fp8"

    def attention_kernel(self, system: SystemSpec) -> str:
        """The attention kernel this plan runs on ``system`` (:func:`~h3t_ext.costmodel.kernels.attention_kernel`)."""
        return attention_kernel(self.attention_backend, self.transformer_impl, system.compute_capability)

    @property
    def data_parallel_size(self) -> int:
        """d = num_gpus / (t * p): counts the context-parallel ranks (megatron-core's data-parallel group with
        context parallelism, :attr:`h3t_ext.layout.ParallelLayout.data_and_context_parallel_size`; Megatron-LM's
        ``--data-parallel-size`` is d / c, :attr:`data_parallel_sample_shards`). Valid once :func:`validate_plan`
        passed."""
        return self.num_gpus // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)

    @property
    def data_parallel_sample_shards(self) -> int:
        """d / c: groups that see different samples."""
        return self.data_parallel_size // self.context_parallel_size

    @property
    def num_microbatches(self) -> int:
        """m = B / (micro_batch * d / c)."""
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_sample_shards)

    def pipeline_split(self, num_layers: int) -> PipelineSplit:
        """Megatron's layer split of this plan (:class:`~h3t_ext.layout.PipelineSplit`: uneven first/last
        stages, --account-for-*, v chunks); its rules are checked by :func:`validate_plan`, not here."""
        return _split(num_layers, self.pipeline_model_parallel_size, self.num_layers_per_virtual_pipeline_stage,
                      self.num_virtual_stages_per_pipeline_rank, self.decoder_first_pipeline_num_layers,
                      self.decoder_last_pipeline_num_layers, self.account_for_embedding_in_pipeline_split,
                      self.account_for_loss_in_pipeline_split, self.pipeline_model_parallel_layout)

    def microbatch_group_size(self) -> int:
        """g of the interleaved schedule: ``microbatch_group_size_per_vp_stage``, else megatron-core's default p."""
        g = self.microbatch_group_size_per_vp_stage
        return self.pipeline_model_parallel_size if g is None else g

    def last_microbatch_group(self) -> int:
        """Microbatches of the interleaved schedule's last group (m mod g, or g when g divides m): the cool-down
        runs each chunk's backwards of that many microbatches in turn."""
        g = self.microbatch_group_size()
        return self.num_microbatches % g or g

    def layers_per_rank(self, num_layers: int) -> int:
        """Layers of a middle stage: L / p, (L + 1 per --account-for-* flag) / p, or with uneven first/last stages
        the rest split evenly (the first stage's layers when there is no middle stage); under a
        --pipeline-model-parallel-layout the most any middle rank holds (the first rank's at p = 2); L at p = 1."""
        split, p = self.pipeline_split(num_layers), self.pipeline_model_parallel_size
        if p == 1:
            return split.stage_layers(0)
        if split.stage_layout is not None:  # rank 0 holds the embedding's slot: not a middle stage
            return max(split.stage_layers(r) for r in (range(1, p - 1) if p > 2 else (0,)))
        if not split.uneven:
            return split.rank_slots(0)
        first, last = self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers
        if p - (first is not None) - (last is not None) == 0:
            return first
        return split.rank_slots(0 if first is None else 1)

    def representative_stages(self, num_layers: int) -> tuple[int, ...]:
        """The pipeline ranks whose memory and time stand for all (:meth:`PipelineSplit.representative_stages`),
        and every rank holding an FP8 plan's BF16 first / last layers (with interleaving they may reach past the
        first and last rank)."""
        stages = self.pipeline_split(num_layers).representative_stages()
        if not self.has_bf16_layers:
            return stages
        return tuple(sorted(set(stages) | {r for r in range(self.pipeline_model_parallel_size)
                                           if self.stage_bf16_layers(num_layers, r)}))

    def stage_layers(self, num_layers: int, stage: int) -> int:
        """Transformer layers held by pipeline rank ``stage`` (Megatron's rule: the embedding / loss of
        --account-for-* take one layer's place on the first / last stage)."""
        return self.pipeline_split(num_layers).stage_layers(stage)

    @property
    def has_bf16_layers(self) -> bool:
        """An FP8 plan with --first-last-layers-bf16 and at least one such layer (:mod:`h3t_ext.costmodel.fp8`)."""
        return (self.fp8 is not None and self.first_last_layers_bf16
                and self.num_layers_at_start_in_bf16 + self.num_layers_at_end_in_bf16 > 0)

    def chunk_bf16_layers(self, num_layers: int, stage: int) -> tuple[int, ...]:
        """BF16 layers of an FP8 plan in each model chunk of pipeline rank ``stage`` (all 0 without
        --first-last-layers-bf16)."""
        split = self.pipeline_split(num_layers)
        if not self.has_bf16_layers:
            return (0,) * split.virtual_pipeline_model_parallel_size
        return _chunk_bf16_layers(split, stage, self.num_layers_at_start_in_bf16, self.num_layers_at_end_in_bf16)

    def stage_bf16_layers(self, num_layers: int, stage: int) -> int:
        """BF16 layers of an FP8 plan on pipeline rank ``stage`` (0 without --first-last-layers-bf16)."""
        return sum(self.chunk_bf16_layers(num_layers, stage)) if self.has_bf16_layers else 0

    def stage_fp8_layers(self, num_layers: int, stage: int) -> int:
        """Layers of pipeline rank ``stage`` that run in FP8 (none in a BF16 plan)."""
        if self.fp8 is None:
            return 0
        return self.stage_layers(num_layers, stage) - self.stage_bf16_layers(num_layers, stage)

    def virtual_size(self, num_layers: int) -> int:
        """v = (L/p) / l, or --num-virtual-stages-per-pipeline-rank."""
        return self.pipeline_split(num_layers).virtual_pipeline_model_parallel_size

    def virtual_pipeline_model_parallel_size(self, num_layers: int) -> int:
        """v = (L/p) / l (1 for plain 1F1B); L comes from the model, so this takes ``num_layers``."""
        return self.virtual_size(num_layers)

    def alphas(self) -> tuple[float, ...]:
        """offload_alpha as one value per pipeline stage."""
        a = self.offload_alpha
        if isinstance(a, (int, float)):
            return (float(a),) * self.pipeline_model_parallel_size
        return tuple(float(x) for x in a)

    def with_alpha(self, alpha: Alpha) -> "Plan":
        """Copy of this plan with another offload_alpha (this plan where it has that alpha already)."""
        if type(alpha) is type(self.offload_alpha) and alpha == self.offload_alpha:
            return self
        return self.with_fields(offload_alpha=alpha)

    def with_fields(self, **changes) -> "Plan":
        """``dataclasses.replace(self, **changes)``, without re-running ``__init__`` where no field that
        ``__post_init__`` reads changes (``ckpt``, ``recompute``: those go through ``replace``): a copy of the
        instance's dict (a search asks for ~20,000 alphas and ~5,000 memory options, and ``replace`` re-runs
        ``__init__`` over 70 fields for each). Unknown field names are a TypeError, as ``replace`` makes them."""
        if _POST_INIT_FIELDS.intersection(changes):
            return replace(self, **changes)
        unknown = [k for k in changes if k not in _FIELDS]
        if unknown:
            raise TypeError(f"Plan has no field {unknown[0]!r}")
        plan = object.__new__(type(self))
        plan.__dict__.update(self.__dict__)
        for k, x in changes.items():
            object.__setattr__(plan, k, x)
        return plan

    @property
    def tokens_per_iteration(self) -> int:
        return self.global_batch_size * self.seq_length


_FIELDS = frozenset(f.name for f in fields(Plan))
_POST_INIT_FIELDS = frozenset({"ckpt", "recompute"})
"""The fields ``Plan.__post_init__`` reads (and may rewrite): a copy that changes one re-runs it."""


@lru_cache(maxsize=4096)
def _split(L: int, p: int, l: Optional[int], V: Optional[int], first: Optional[int], last: Optional[int],
           embedding: bool, loss: bool, layout: Optional[str] = None) -> PipelineSplit:
    """The plan's split without the layout checks (v = (n/p) / l, with n = L + the --account-for-* slots); a
    --pipeline-model-parallel-layout is read as written (LayoutError where it cannot be)."""
    if layout is not None:
        return PipelineSplit(L, p, len(counts := parse_pipeline_layout(layout, L, p)) // p, stage_layout=counts)
    if V is not None:
        v = V
    elif l is None or first is not None or last is not None:
        v = 1
    else:
        v = max(1, (L + embedding + loss) // p // l)
    return PipelineSplit(L, p, v, first, last, embedding, loss)


@lru_cache(maxsize=4096)
def _chunk_bf16_layers(split: PipelineSplit, stage: int, at_start: int, at_end: int) -> tuple[int, ...]:
    """BF16 layers in each model chunk of ``stage``: the model's first ``at_start`` and last ``at_end`` layers by
    their global numbers (megatron-core numbers layers chunk-major, :meth:`PipelineSplit.layer_offset`)."""
    return tuple(bf16_layers_in(at_start, at_end, split.num_layers, split.layer_offset(stage, c),
                                split.chunk_layers(stage, c))
                 for c in range(split.virtual_pipeline_model_parallel_size))
