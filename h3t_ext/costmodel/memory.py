"""Per-stage memory: parameters, gradients, optimizer states, activations over the schedule, transients.

Bytes per parameter on a rank: 2 (bf16 weight) + 4 (fp32 main grad; 2 with --grad-reduce-in-bf16,
``Plan.grad_bytes``) + 12/d (fp32 master, Adam m and v, sharded over the whole data-parallel group d,
context-parallel ranks included). Activations are priced over the schedule builder's timeline (see
activations.py). Transient buffers are the largest short-lived allocations that ``max_memory_allocated``
sees on top of that:

* ``sp_allgather_buffer``  the sequence-parallel all-gather of a norm output before the QKV/FC1 GEMM:
                           (s/c) * h bf16 (t > 1 only).
* ``layer_backward_workspace`` gradients alive inside one layer's backward: d(FC1 output) and
                           d(activation output), (s/c) * (fc1_width + f) / t bf16, plus the gradient
                           flowing between layers, 2 * (s/(c t)) * h bf16.
* ``cp_kv_gather_buffer``  c > 1: the full-sequence K and V of one layer, re-gathered over the
                           context-parallel group at the start of the layer's backward (it is alive next to
                           the MLP backward workspace), mb * s * 2 h_kv / t bf16.
* ``recompute_workspace``  ckpt=ours: the largest tensor recomputed in backward (norm output or SwiGLU
                           output of one layer; they are produced one at a time and freed after use);
                           full recompute: the saved activations of a unit's layers (one for ckpt=full,
                           N with --recompute-method uniform --recompute-num-layers N) re-created in backward.
* ``embedding_grad``       first stage of a pipeline (p > 1): the dense bf16 gradient of the vocabulary-parallel
                           embedding (V_pad/t * h) before it is added to the fp32 main grad, made while the stage
                           holds other microbatches' activations. At p = 1 it is made after the last layer's
                           backward, when the microbatch's activations are gone: a moment of its own (below).
* ``logits_transient``     last stage: the bf16 logits, alive next to the fp32 softmax while the
                           vocabulary-parallel cross entropy runs (and their bf16 gradient next to
                           it in backward), (s/c) * V_pad/t * 2. The fp32 softmax the cross
                           entropy keeps for backward (its gradient is written into it) is saved
                           state, in ``output_layer_activations``. None with TransformerEngine's
                           fused cross entropy before 2.18, which saves the logits themselves
                           (:mod:`h3t_ext.costmodel.te_version`).
* ``output_layer_activations`` last stage: one microbatch's saved tensors of the final norm, output
                           GEMM and cross entropy (``activations.output_layer_bytes``), counted once.
* ``fp8_weight_cache``     with --fp8-format: TransformerEngine's FP8 copy of every GEMM weight and its
                           transpose, cached for the iteration (only the transpose with --fp8-param-gather,
                           whose parameters are the FP8 copy: ``weights`` holds them at 1 byte).
* ``fp8_scaling_state``    with --fp8-format: scales and amax histories of the FP8 tensors (a few kB a layer).
* ``offload_reload_buffer`` the reload double buffer, 2 * alpha * A (reported next to ``activations``); at
                           pipeline size 1 (layer-granular offload, :mod:`h3t_ext.costmodel.layer_offload`) what its
                           two one-layer slots, allocated in the backward, add to the forward's end: 0 unless layer
                           L-2 is offloaded. The runtime frees the slots at the iteration's end (and at p = 1 after
                           each microbatch's backward), so they are not alive at the optimizer step.
* ``moe_backward_workspace`` MoE layers (:mod:`h3t_ext.costmodel.moe`): d(FC1 output), d(activation output) and
                           d(expert input) of the rank's T k etp routed token copies, (fc1_e + f_e) / etp + h each.
* ``moe_dispatch_buffer``  MoE layers: one all-to-all buffer of the T k token copies (two with
                           --overlap-moe-expert-parallel-comm: a merged forward's exchange of another microbatch
                           runs beside the backward's).
* ``p2p_buffers``          received activations/gradients waiting for their compute action (2 per
                           direction), 4 * (s/(c t)) * h bf16 (p > 1 only).
* ``fsdp_buffers``         Megatron FSDP with sharded gradients: the gradients of two layers, in the gradient
                           buffer's dtype, waiting for their reduce-scatter (one reducing, one being produced);
                           with sharded parameters also the all-gathered parameters of two layers (the one
                           running and the prefetched one): bf16, or FP8 with --fp8-param-gather
                           (:func:`fsdp_buffer_bytes`).

The peak is the largest of the moments: a backward (the terms above); at p = 1 the embedding's backward, after
the last layer's; and the optimizer step, after the last backward. At the later two the activations and their
transients are freed but the states, TransformerEngine's FP8 weight copies and the pipeline buffers (kept for the
next iteration) stay, and at the embedding's backward the reload slot of layer 0 when it was offloaded:

* ``embedding_backward_excess`` p = 1: what the embedding's backward holds above the other moments (the terms
                           ``EMBEDDING_MOMENT_TERMS`` and the gradient); left out when smaller, as it nearly always is.
* ``optimizer_step_excess`` what the optimizer step's moment holds above the backward's (0, and left out, when the
                           backward's is larger): with torch's AdamW (``Plan.optimizer_impl`` 'torch', megatron-core's
                           fallback without TransformerEngine and apex) its foreach step allocates sqrt(v) + eps as
                           one fp32 tensor per parameter of the device optimizer shard
                           (``OPTIMIZER_STEP_TEMPORARY_BYTES``); fused Adam updates in place.

With --optimizer-cpu-offload the device keeps the optimizer states of 1 - F of the shard; the rest is on the
host (:func:`stage_host_bytes`, :mod:`h3t_ext.costmodel.optimizer_offload`).

With Megatron FSDP's ``optim_grads`` the gradients are sharded over d like the optimizer states
(4 n / d), with ``optim_grads_params`` the bf16 weights too (2 n / d).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from h3t_ext.costmodel.recompute import chunk_layers, plan_recompute, unit_workspace_layers
from h3t_ext.costmodel.activations import (
    activation_bytes_per_layer_token,
    chunk_resident_factor,
    microbatch_chunk_bytes,
    mlp_activation_impl,
    output_layer_bytes,
    rank_offloads,
    residency_lines,
)
from h3t_ext.costmodel import fp8, moe, optimizer_offload
from h3t_ext.costmodel.elementwise import CROSS_ENTROPY_LOGITS_TRANSIENT
from h3t_ext.costmodel.layer_offload import layer_offload, layers_per_chunk
from h3t_ext.costmodel.plan import LAYER_SPEC, Plan
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec
from h3t_ext.costmodel.te_version import cross_entropy_impl
from h3t_ext.dtypes import BF16, FP32

OPTIMIZER_BYTES_PER_PARAM = 3 * FP32  # fp32 master weight + Adam m + Adam v
OPTIMIZER_STEP_TEMPORARY_BYTES = {"fused": 0, "torch": FP32}
"""Bytes per parameter of the device optimizer shard that the optimizer step allocates on top of the states, by
``Plan.optimizer_impl``: torch's foreach AdamW (``torch.optim._multi_tensor_adamw``) computes ``sqrt(v)`` into a
new fp32 tensor list, divides and adds eps in place and frees it after its ``addcdiv_``; TransformerEngine's and
apex's FusedAdam read and write the states in place. Measured on the H200 (second lease, megatron-core 0.16.1 without
TE or apex): a ~1.1 B-parameter Llama's ckpt=full and ckpt=ours steps peak 4.2 GiB above their 18.5 GiB of states,
as its 1.104 B fp32 temporaries take."""
STEP_PERSISTENT_TERMS = ("weights", "grads", "optimizer_states", "fp8_weight_cache", "fp8_scaling_state",
                         "p2p_buffers")
"""The terms alive at the optimizer step: the states, TE's FP8 weight caches, and the pipeline buffers the runtime
keeps from one iteration to the next. Not the offload's reload slots: the runtime frees them when the iteration's
forward-backward ends (until 2026-12-01 it kept them, and the H200's ckpt=ours steps with alpha 0.5 peaked 404 MiB
above alpha 0's at the optimizer step, the two slots of one layer: ``data/reference/local_stack_steps.json``)."""
EMBEDDING_MOMENT_TERMS = STEP_PERSISTENT_TERMS + ("fsdp_buffers",)
"""The terms alive when the embedding's gradient is made at pipeline size 1, after the last layer's backward: the
persistent ones and a sharded data-parallel rank's unsharded buffers. The H200's ckpt=no step of a 1.1 B Llama
(``data/reference/local_stack_steps.json``) peaked 0.12 GiB (its embedding gradient) below the sum that counted the
gradient at the backward's peak, and at that sum less the gradient to 0.01%."""


@dataclass(frozen=True)
class StageMemory:
    """Peak memory of one pipeline rank, by named term (bytes)."""

    stage: int
    """Pipeline rank."""
    terms: Mapping[str, int] = field(default_factory=dict)
    """Named byte terms; their sum is ``peak_bytes``."""
    params: int = 0
    """Parameters held by the rank."""

    @property
    def peak_bytes(self) -> int:
        return sum(self.terms.values())

    def largest_term(self) -> str:
        return max(self.terms, key=lambda k: self.terms[k])

    def to_dict(self) -> dict:
        return {"stage": self.stage, "params": self.params, "peak_bytes": self.peak_bytes, "terms": dict(self.terms)}


def stage_params(model: ModelSpec, plan: Plan, stage: int) -> int:
    """Parameters on pipeline rank ``stage`` (tensor-parallel shard; norms replicated)."""
    t, p = plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size
    h = model.hidden_size
    layers = plan.stage_layers(model.num_layers, stage)
    if model.mixed_moe:  # its dense and MoE layers, as the stage holds them
        moe_layers = stage_moe_layers(model, plan, stage)
        n = (layers - moe_layers) * model.dense_variant().layer_params_per_rank(t) + moe_layers * \
            model.moe_variant().layer_params_per_rank(t, plan.expert_model_parallel_size,
                                                      plan.expert_tensor_parallel_size)
    else:
        n = layers * model.layer_params_per_rank(t, plan.expert_model_parallel_size,
                                                 plan.expert_tensor_parallel_size)
    vocab = model.padded_vocab_size(t) * h // t
    if stage == 0:
        n += vocab + model.position_embedding_params(plan.seq_length)
    if stage == p - 1:
        n += model.norm_params  # final norm
        if model.untie_embeddings_and_output_weights or p > 1:
            n += vocab  # output layer (a tied copy of the embedding when p > 1)
    return n


def chunk_activation_bytes(model: ModelSpec, plan: Plan, stage: Optional[int] = None) -> int:
    """A: saved bytes of one microbatch-chunk on pipeline rank ``stage`` (None: a middle stage) as the plan
    runs it (its layer spec and sequence parallelism, bf16): ``activations.microbatch_chunk_bytes``."""
    return microbatch_chunk_bytes(model, plan, stage, layer_spec=LAYER_SPEC[plan.transformer_impl],
                                  sequence_parallel=plan.sequence_parallel, fp8=plan.fp8 is not None)


def _transients(model: ModelSpec, plan: Plan, stage: int, system: Optional[SystemSpec] = None) -> dict[str, int]:
    if model.mixed_moe:  # the larger of each buffer over the two kinds of layer
        dense, moe_ = (_transients(model.dense_variant(), plan, stage, system),
                       _transients(model.moe_variant(), plan, stage, system))
        return {k: max(dense.get(k, 0), moe_.get(k, 0)) for k in {**dense, **moe_}}
    t, c, p = plan.tensor_model_parallel_size, plan.context_parallel_size, plan.pipeline_model_parallel_size
    mb, h, f = plan.micro_batch_size, model.hidden_size, model.dense_ffn_hidden_size
    seq_tokens = mb * plan.seq_length // c
    local = seq_tokens // t
    out = {
        "sp_allgather_buffer": seq_tokens * h * BF16 if t > 1 else 0,
        "layer_backward_workspace": seq_tokens * (model.fc1_width + f) // t * BF16 + 2 * local * h * BF16,
        "p2p_buffers": 4 * local * h * BF16 if p > 1 else 0,
        "cp_kv_gather_buffer": mb * plan.seq_length * 2 * model.kv_hidden_size // t * BF16 if c > 1 else 0,
    }
    if model.is_moe:
        out.update(_moe_transients(model, plan))
    if plan.sharding_strategy is not None:
        out["fsdp_buffers"] = fsdp_buffer_bytes(model, plan, stage, system)
    base, recompute = plan_recompute(plan)
    unit_layers = unit_workspace_layers(recompute, chunk_layers(model, plan, stage))
    experts_no = moe.kept_expert_bytes(model, plan, "no", ())
    if unit_layers:  # a full unit's layers re-created in its backward
        out["recompute_workspace"] = unit_layers * local * (activation_bytes_per_layer_token(
            model, "no", activation_impl=mlp_activation_impl(plan))["total"] + experts_no)
    elif base == "ours":
        terms_no = activation_bytes_per_layer_token(model, "no")
        expert_act = moe.expert_terms(model, plan)["expert_act_output"] if model.is_moe else 0
        out["recompute_workspace"] = local * max(terms_no["norm2_output"], terms_no["swiglu_output"], expert_act)
    vocab_shard = model.padded_vocab_size(t) // t
    if stage == 0 and p > 1:
        out["embedding_grad"] = embedding_grad_bytes(model, plan)
    if stage == p - 1:
        transient = CROSS_ENTROPY_LOGITS_TRANSIENT[cross_entropy_impl(plan)]
        if transient:
            out["logits_transient"] = seq_tokens * vocab_shard * transient
        out["output_layer_activations"] = output_layer_bytes(model, plan)["total"]
    return out


def embedding_grad_bytes(model: ModelSpec, plan: Plan) -> int:
    """The dense bf16 gradient of the vocabulary-parallel embedding, V_pad/t * h."""
    t = plan.tensor_model_parallel_size
    return model.padded_vocab_size(t) // t * model.hidden_size * BF16


def _moe_transients(model: ModelSpec, plan: Plan) -> dict[str, int]:
    """A MoE layer's short-lived buffers at a backward: the gradients inside its experts' backward (d(FC1 output),
    d(activation output) and d(expert input) of the rank's T k etp token copies; ``layer_backward_workspace`` holds
    the shared expert's and the gradient flowing between layers), and one all-to-all buffer of the T k token copies (the exchange's
    input, freed after it)."""
    copies, local = moe.expert_token_copies(model, plan), moe.local_tokens(plan)
    etp, h = moe.expert_tensor_parallel_size(plan), model.hidden_size
    grads = copies * ((model.expert_fc1_width + model.expert_ffn_hidden_size) // etp + h) * BF16
    buffer = local * model.moe_router_topk * h * BF16
    # --overlap-moe-expert-parallel-comm: the merged forward's exchange of another microbatch beside the backward's
    return {"moe_backward_workspace": grads,
            "moe_dispatch_buffer": buffer * (2 if plan.overlap_moe_expert_parallel_comm else 1)}


def fsdp_buffer_bytes(model: ModelSpec, plan: Plan, stage: int, system: Optional[SystemSpec] = None) -> int:
    """Unsharded buffers of a sharded data-parallel rank beside its shards, at the peak (a layer's backward).

    Megatron FSDP: the unsharded main gradients of two layers (the one whose backward writes them and the previous
    one's, still reduce-scattering), in the gradient buffer's dtype (``Plan.grad_bytes``: fp32, or bf16 with
    --grad-reduce-in-bf16, as Megatron-Bridge's recipes run), and with 'optim_grads_params' the gathered parameters
    of two layers (the one computing and the next, prefetched): bf16, or with --fp8-param-gather the FP8 GEMM
    weights with the transpose made for their backward where one is kept (:func:`fp8.gathered_weight_bytes` on
    ``system``; bf16 when the rank also holds BF16 layers, which may be the gathered ones).

    Torch FSDP2 (``fully_shard`` per layer): the gathered parameters of two layers (computing, prefetched) and the
    unsharded gradients of two in the parameters' dtype, which FSDP2 reduce-scatters in; without resharding after the
    forward, the whole chunk's gathered parameters instead, kept from the forward to the backward."""
    layer_params = model.layer_params_per_rank(plan.tensor_model_parallel_size)
    if plan.use_torch_fsdp2:
        held = plan.stage_layers(model.num_layers, stage) if not plan.torch_fsdp2_reshard_after_forward else 2
        return held * layer_params * BF16 + 2 * layer_params * BF16
    gathered = 0
    if plan.sharding_strategy == "optim_grads_params":
        per_layer = layer_params * BF16
        layers = plan.stage_layers(model.num_layers, stage)
        if fp8.fsdp_drops_weight_transposes(plan) and plan.stage_fp8_layers(model.num_layers, stage) == layers:
            gemm = fp8.gemm_weight_params(model, plan, 1)
            per_layer = (layer_params - gemm) * BF16 + gemm * fp8.gathered_weight_bytes(plan, system)
        gathered = 2 * per_layer
    return 2 * layer_params * plan.grad_bytes + gathered


def optimizer_shards(plan: Plan) -> int:
    """Ranks the fp32 master weights and Adam states of the dense parameters are sharded over: d with the
    distributed optimizer or torch FSDP2 (the optimizer steps its DTensor shards), 1 without."""
    return plan.data_parallel_size if plan.use_distributed_optimizer or plan.use_torch_fsdp2 else 1


def expert_optimizer_shards(plan: Plan) -> int:
    """... and of the routed experts' parameters: their expert data-parallel group edp with the distributed
    optimizer (megatron-core shards each parameter over the group that reduces its gradient), 1 without."""
    return moe.expert_data_parallel_size(plan) if plan.use_distributed_optimizer else 1


def stage_moe_layers(model: ModelSpec, plan: Plan, stage: int) -> int:
    """MoE layers among those pipeline rank ``stage`` holds (all of them unless --moe-layer-freq mixes in dense ones)."""
    if not model.mixed_moe:
        return plan.stage_layers(model.num_layers, stage) if model.is_moe else 0
    return _held(model.moe_layer_pattern, plan.pipeline_split(model.num_layers), stage)


@functools.lru_cache(maxsize=4096)
def _held(pattern: tuple[int, ...], split, stage: int) -> int:
    """How many of ``pattern``'s 1s lie in the layers of ``stage``'s model chunks under ``split``."""
    return sum(sum(pattern[o:o + split.chunk_layers(stage, c)])
               for c in range(split.virtual_pipeline_model_parallel_size)
               for o in (split.layer_offset(stage, c),))


def stage_expert_params(model: ModelSpec, plan: Plan, stage: int) -> int:
    """Routed-expert parameters on pipeline rank ``stage`` (0 in a dense model)."""
    return stage_moe_layers(model, plan, stage) * model.expert_layer_params_per_rank(
        plan.expert_model_parallel_size, moe.expert_tensor_parallel_size(plan))


def optimizer_shard_params(model: ModelSpec, plan: Plan, stage: int, n: Optional[int] = None) -> float:
    """Parameters of one rank's optimizer shard on pipeline rank ``stage`` (holding ``n``, default
    :func:`stage_params`): the dense ones over :func:`optimizer_shards`, the experts over
    :func:`expert_optimizer_shards`."""
    n = stage_params(model, plan, stage) if n is None else n
    return _shard_params(plan, n, stage_expert_params(model, plan, stage))


def _shard_params(plan: Plan, n: int, experts: int) -> float:
    """A shard of ``n`` parameters of which ``experts`` are routed experts (the one sharding rule)."""
    return (n - experts) / optimizer_shards(plan) + (experts / expert_optimizer_shards(plan) if experts else 0.0)


def _device_shard_params(model: ModelSpec, plan: Plan, stage: int, n: Optional[int] = None) -> float:
    """Parameters of a rank's optimizer shard (of a stage holding ``n``) that are stepped on the device."""
    return optimizer_offload.device_params(optimizer_shard_params(model, plan, stage, n), plan)


def stage_host_bytes(model: ModelSpec, plan: Plan, stage: int) -> dict[str, int]:
    """Host bytes of one rank of pipeline stage ``stage``, by term: the offloaded optimizer share
    (``optimizer_offload.host_bytes``)."""
    return optimizer_offload.host_bytes(optimizer_shard_params(model, plan, stage), plan)


def stage_state_bytes(model: ModelSpec, plan: Plan, stage: int, *, param_bytes: int = BF16,
                      master_weights: bool = True) -> dict[str, dict[str, int]]:
    """Bytes of parameters, gradients and optimizer states one rank of ``stage`` holds, on the device and on
    the host (the driver's measured ``state_bytes``): parameters at ``param_bytes`` each (sharded over d with
    ``optim_grads_params``), fp32 gradients (sharded with Megatron FSDP), Adam's m and v (+ an fp32 master
    copy with ``master_weights``: bf16 training; the CPU stand-in trains in fp32 and steps the parameters
    themselves) of the device share of the optimizer shard; the host holds the offloaded share's fp32 master,
    m and v and its fp32 gradient copy (``optimizer_offload.host_bytes``). Adam's per-tensor step counts are
    not counted (a few bytes per tensor)."""
    n = stage_params(model, plan, stage)
    d = plan.data_parallel_size
    strategy = plan.sharding_strategy
    on_device = _device_shard_params(model, plan, stage, n)
    host = stage_host_bytes(model, plan, stage)
    return {
        "device": {"params": int(round(n * param_bytes / (d if strategy == "optim_grads_params" else 1))),
                   "grads": int(round(n * plan.grad_bytes / (d if strategy is not None else 1))),
                   "optimizer": int(round(on_device * (2 * FP32 + (FP32 if master_weights else 0))))},
        "host": {"params": 0, "grads": host["grads"], "optimizer": host["optimizer_states"]},
    }


def _static_terms(model: ModelSpec, plan: Plan, n: int, layers: int, experts: int) -> dict[str, int]:
    """Weights, gradients and optimizer states of a stage holding ``n`` parameters, ``layers`` FP8 layers (whose
    GEMM weights --fp8-param-gather holds in FP8), ``experts`` of them routed experts' (:func:`stage_expert_params`)."""
    d = plan.data_parallel_size
    strategy = plan.sharding_strategy
    weights = fp8.weight_bytes(model, plan, n, layers)
    if experts:  # dense and expert parameters sharded over their own groups
        states = int(round(optimizer_offload.device_params(_shard_params(plan, n, experts), plan)
                           * OPTIMIZER_BYTES_PER_PARAM))
    else:
        states = -(-int(round(optimizer_offload.device_params(n, plan))) * OPTIMIZER_BYTES_PER_PARAM
                   // optimizer_shards(plan))
    return {
        "weights": -(-weights // d) if strategy == "optim_grads_params" else weights,
        "grads": -(-n * plan.grad_bytes // d) if strategy is not None else n * plan.grad_bytes,
        "optimizer_states": states,
    }


def stage_static_terms(model: ModelSpec, plan: Plan, stage: int) -> dict[str, int]:
    """The terms of :func:`stage_fixed_terms` that depend on neither l, the micro batch, ckpt nor alpha (weights,
    grads, optimizer_states), without computing the others (the planner's check that they alone exceed the
    budget, on every parallel layout)."""
    return _static_terms(model, plan, stage_params(model, plan, stage),
                         plan.stage_fp8_layers(model.num_layers, stage), stage_expert_params(model, plan, stage))


def _fixed_terms(model: ModelSpec, plan: Plan, stage: int, n: int, system: Optional[SystemSpec] = None
                 ) -> dict[str, int]:
    """The alpha-independent terms of a stage holding ``n`` parameters (``system``: the GPU, where the FP8 weight
    copies depend on it; None prices a GPU that keeps their transposes)."""
    layers = plan.stage_fp8_layers(model.num_layers, stage)  # FP8 layers: their weights' FP8 copies and scales
    terms = _static_terms(model, plan, n, layers, stage_expert_params(model, plan, stage))
    if plan.fp8 is not None:
        terms["fp8_weight_cache"] = fp8.weight_cache_bytes(model, plan, layers, system)
        terms["fp8_scaling_state"] = fp8.scaling_state_bytes(plan, layers)
    terms.update(_transients(model, plan, stage, system))
    return terms


def _activation_terms(chunk: int, lines: tuple[tuple[int, int], ...], offloads: bool, alpha: float,
                      layers: Optional[int] = None) -> tuple[int, int, int]:
    """(activations, offload_reload_buffer, the reload slot still held when the embedding's gradient is made) bytes
    at ``alpha``; ``layers``: the chunk's layers when the offload is layer-granular (pipeline size 1: the slot is
    layer 0's, where it was offloaded; with a pipeline it is 0, ``embedding_grad`` being a term of the backward)."""
    if layers is not None:
        lo = layer_offload(alpha, layers)
        return (int(round(chunk * lo.resident)), int(round(chunk * lo.reload_buffer)),
                int(round(chunk * lo.embedding_slot)))
    act = int(round(chunk * chunk_resident_factor(lines, alpha, False)))
    reload = int(round(2 * alpha * chunk)) if offloads and alpha > 0 else 0
    return act, reload, 0


@functools.lru_cache(maxsize=8192)
def _stage_constants(model: ModelSpec, plan: Plan, stage: int, system: Optional[SystemSpec] = None
                     ) -> tuple[int, dict[str, int], int]:
    """(parameters, alpha-independent terms, chunk bytes) of pipeline rank ``stage``, called with the first rank of
    its class (:meth:`~h3t_ext.layout.PipelineSplit.stage_class`: the middle ranks of an even split are one class,
    and the ranks of a layout that hold the same layers), whose ranks have the same parameters, transients and chunk
    bytes."""
    n = stage_params(model, plan, stage)
    return n, _fixed_terms(model, plan, stage, n, system), chunk_activation_bytes(model, plan, stage)


def _constants(model: ModelSpec, plan: Plan, stage: int, system: Optional[SystemSpec] = None
               ) -> tuple[int, dict[str, int], int]:
    plan = plan.with_alpha(0.0)  # none of them depends on alpha: one cache entry for a plan at every alpha
    if model.mixed_moe:  # ranks of one class may hold different numbers of MoE layers
        return _stage_constants(model, plan, stage, system)
    return _stage_constants(model, plan, plan.pipeline_split(model.num_layers).stage_class(stage), system)


def stage_fixed_terms(model: ModelSpec, plan: Plan, stage: int, system: Optional[SystemSpec] = None
                      ) -> Mapping[str, int]:
    """The alpha- and schedule-independent terms of ``stage_memory`` (parameters, gradients, optimizer
    states, transients), without walking the schedule; do not modify the mapping (it is cached)."""
    return _constants(model, plan, stage, system)[1]


def _step_temporary(model: ModelSpec, plan: Plan, stage: int, n: int) -> int:
    """The optimizer step's temporary on a rank of ``stage`` holding ``n`` parameters:
    ``OPTIMIZER_STEP_TEMPORARY_BYTES`` per parameter of its device optimizer shard."""
    per_param = OPTIMIZER_STEP_TEMPORARY_BYTES[plan.optimizer_impl]
    return int(round(_device_shard_params(model, plan, stage, n) * per_param)) if per_param else 0


def _step_moment(terms: Mapping[str, int], temporary: int) -> int:
    """Bytes alive at the optimizer step: the ``STEP_PERSISTENT_TERMS`` among ``terms`` and the step's temporary."""
    return sum(terms.get(k, 0) for k in STEP_PERSISTENT_TERMS) + temporary


def _embedding_moment(model: ModelSpec, plan: Plan, terms: Mapping[str, int], slot: int = 0) -> int:
    """Bytes alive when the embedding's gradient is made at pipeline size 1 (``EMBEDDING_MOMENT_TERMS``, the
    gradient and the offload's ``slot`` still held for layer 0); 0 with a pipeline, where ``embedding_grad`` is a term
    of the backward's moment."""
    if plan.pipeline_model_parallel_size > 1:
        return 0
    return sum(terms.get(k, 0) for k in EMBEDDING_MOMENT_TERMS) + embedding_grad_bytes(model, plan) + slot


def stage_memory(model: ModelSpec, plan: Plan, stage: int, alpha: float,
                 system: Optional[SystemSpec] = None) -> StageMemory:
    """Peak memory terms of pipeline rank ``stage`` with offload ratio ``alpha`` on ``system`` (the GPU, where a term
    depends on it: the FP8 weight copies; None: a GPU that keeps their transposes, as Hopper does)."""
    p, m = plan.pipeline_model_parallel_size, plan.num_microbatches
    v = plan.virtual_size(model.num_layers)
    n, fixed, chunk = _constants(model, plan, stage, system)
    g = plan.microbatch_group_size_per_vp_stage
    act, reload, slot = _activation_terms(chunk, residency_lines(p, m, v, stage, g),
                                          rank_offloads(p, m, v, stage, g) > 0, alpha, layers_per_chunk(model, plan))
    terms = {**{k: fixed[k] for k in ("weights", "grads", "optimizer_states")},
             "activations": act, "offload_reload_buffer": reload}
    terms.update({k: x for k, x in fixed.items() if k not in terms})
    embedding = _embedding_moment(model, plan, terms, slot) - sum(terms.values())
    if embedding > 0:
        terms["embedding_backward_excess"] = embedding
    excess = _step_moment(terms, _step_temporary(model, plan, stage, n)) - sum(terms.values())
    if excess > 0:
        terms["optimizer_step_excess"] = excess
    return StageMemory(stage=stage, terms=terms, params=n)


def stage_peak_function(model: ModelSpec, plan: Plan, stage: int,
                        system: Optional[SystemSpec] = None) -> Callable[[float], int]:
    """peak_bytes of ``stage_memory(model, plan, stage, alpha, system)`` as a cheap function of alpha."""
    p, m = plan.pipeline_model_parallel_size, plan.num_microbatches
    v = plan.virtual_size(model.num_layers)
    n, terms, chunk = _constants(model, plan, stage, system)
    fixed = sum(terms.values())
    g = plan.microbatch_group_size_per_vp_stage
    lines, offloads = residency_lines(p, m, v, stage, g), rank_offloads(p, m, v, stage, g) > 0
    layers = layers_per_chunk(model, plan)
    temporary = _step_temporary(model, plan, stage, n)
    # the later moments' fixed terms (the embedding's adds layer 0's reload slot per alpha); with fused Adam the
    # step's moment never exceeds a backward's
    step = _step_moment(terms, temporary) if temporary else 0
    embedding = _embedding_moment(model, plan, terms)
    if not (step or embedding):
        return lambda alpha: fixed + sum(_activation_terms(chunk, lines, offloads, alpha, layers)[:2])

    def peak(alpha: float) -> int:
        act, reload, slot = _activation_terms(chunk, lines, offloads, alpha, layers)
        return max(fixed + act + reload, step, embedding + slot if embedding else 0)
    return peak
