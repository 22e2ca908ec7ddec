"""Mixture-of-experts layers (Megatron's --num-experts with --moe-layer-freq 1: every layer's MLP is a router, E
routed experts and an optional shared expert), priced as megatron-core 0.16-0.19 runs them.

Parallel layout (megatron-core's "parallel folding"): attention keeps its t x c x d grid; the experts of one pipeline
stage use the same t c d ranks as an expert grid of etp (--expert-tensor-parallel-size, default t) x ep
(--expert-model-parallel-size) x edp, etp fastest. Each rank holds E / ep experts, each split over the etp ranks;
their gradients are reduced, and their optimizer states sharded, over the edp = t c d / (ep etp) ranks that hold
the same experts (:func:`expert_data_parallel_size`); the router, the norms, attention and the shared expert are
dense parameters (data-parallel group d).

Per layer and microbatch a rank holds T = b s / (c t) tokens (sequence parallelism: megatron-core refuses MoE with
t > 1 without it). The router (a GEMM T x h x E and a softmax/top-k over E) sends each token to k experts:

* dispatch (--moe-token-dispatcher-type): ``alltoall`` permutes the T k token copies by expert and exchanges them
  over the ep ranks (each rank sends (ep - 1)/ep of T k h bf16), then, with etp > 1, all-gathers them over the etp
  ranks; ``allgather`` (Megatron's default) all-gathers the T tokens of all ep etp ranks and keeps those routed to
  its experts. The combine mirrors it (all-to-all / reduce-scatter) and the backward runs both again for the
  gradients. ``flex`` (DeepEP) is the all-to-all inside a node; across nodes it sends each token once per other
  node its experts lie in and forwards it there over NVLink (:func:`deepep_seconds`). With
  --overlap-moe-expert-parallel-comm megatron-core merges one microbatch's forward of a layer with another's backward
  and runs each exchange beside the other's compute (:func:`merged_layer_seconds`; the schedule's merged pairs are
  the timeline's); otherwise nothing overlaps them (--moe-shared-expert-overlap hides them behind the shared expert).
* experts: every rank runs T k etp token copies through its E / ep experts (balanced routing: each expert gets
  T k etp ep / E of them) -- one grouped GEMM per FC with --moe-grouped-gemm (a batched GEMM), else one GEMM per
  expert; FC1 h -> 2 f_e / etp (SwiGLU), the activation, FC2 f_e / etp -> h.
* permute / unpermute: element-wise copies of the T k token copies (the unpermute also weighs them by the router's
  probabilities and sums each token's k outputs), forward and backward.

Load balance: the routing is priced balanced, as with --moe-router-force-load-balancing; a trained router with an
auxiliary loss still sends some experts more tokens than others, and the busiest rank paces the layer. That
imbalance is a property of the run's router, not of the hardware, and is not priced (DESIGN.md: the published MoE
runs it was checked against, and how far off that leaves a dropless run).

Saved activations per local token of one MoE layer (on top of attention, the norms and a shared expert, which are
:mod:`h3t_ext.costmodel.activations`' dense terms with f the shared expert's width), ``expert_terms``, as megatron-core
0.16.1 saves them (measured on CPU through its own dispatcher and experts: tests/unit/test_moe_costmodel.py):

* ``router_scores``      2 E fp32  the softmax's output and the top-k's input
* ``routing_map``        E (bool + fp32)  the dispatcher's map of local experts and its transposed scores
* ``routing_indices``    k (2 int64 + 2 fp32)  the top-k's indices and probabilities, the permutation's indices and
                                   the permuted probabilities (which the experts' activation multiplies in: megatron-core
                                   weighs the k outputs there, so the unpermute keeps nothing)
* ``expert_input``       k etp h  FC1's input: the dispatched (and, with etp > 1, all-gathered) token copies
* ``expert_fc1_output``  k fc1_e  the activation's input (the rank's 2 f_e / etp of T k etp copies)
* ``expert_act_output``  k f_e    the activation's output, which FC2 saves as its input (one tensor on both specs:
                                   TransformerEngine's grouped linear saves views of the tensor it is given, as
                                   its dense linear does)

ckpt=ours drops the activation outputs (recomputed from the kept FC1 output); Megatron's selective ``moe_act`` drops
the same, ``moe`` all of them (the whole MoE layer, exchanges included, reruns in the backward) and
``shared_experts`` the shared expert's terms; full recompute keeps the layer input only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from h3t_ext.costmodel.collectives import all_gather_seconds, all_to_all_seconds, group_link, group_node_spread, \
    nic_rate, nvlink_rate
from h3t_ext.costmodel.elementwise import activation_elements
from h3t_ext.costmodel.kernels import KernelRates, elementwise_seconds, gemm_seconds, linear_pass_gemm, \
    linear_pass_seconds
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec
from h3t_ext.dtypes import BF16, BOOL, FP32, INT64

MOE_TOKEN_DISPATCHERS = ("allgather", "alltoall", "flex")
"""Megatron's --moe-token-dispatcher-type values ('allgather' its default)."""
EXPERT_ACT_DROPS = ("expert_act_output",)
"""The expert terms ckpt=ours and Megatron's selective ``moe_act`` recompute."""
EXPERT_TERMS = ("router_scores", "routing_map", "routing_indices", "expert_input", "expert_fc1_output",
                "expert_act_output")
ROUTER_BYTES_PER_SCORE_FWD = BF16 + FP32 + FP32
"""The router's softmax and top-k per score, forward: read the bf16 logits, write the fp32 scores, read them for the
top-k."""
ROUTER_BYTES_PER_SCORE_BWD = FP32 + FP32 + BF16
"""... backward: read the scores and their gradient, write the logits' bf16 gradient."""
ROUTER_KERNELS = 3
"""Softmax, top-k and the probabilities' gather (forward); their backwards."""
PERMUTE_KERNELS = 2
"""The permute and the unpermute (megatron-core's fused ``moe_permute`` / ``moe_unpermute``), each way."""


def expert_tensor_parallel_size(plan) -> int:
    """etp: --expert-tensor-parallel-size, Megatron's default t."""
    etp = plan.expert_tensor_parallel_size
    return plan.tensor_model_parallel_size if etp is None else etp


def expert_data_parallel_size(plan) -> int:
    """edp: ranks of a pipeline stage holding the same experts, t c d / (ep etp) (= num_gpus / (p ep etp))."""
    return plan.num_gpus // (plan.pipeline_model_parallel_size * plan.expert_model_parallel_size
                             * expert_tensor_parallel_size(plan))


def local_tokens(plan) -> int:
    """T: tokens of one microbatch on a rank's local sequence shard, b s / (c t) (a MoE layer's input with sequence
    parallelism; ``activations`` counts saved bytes per such token)."""
    return plan.micro_batch_size * plan.seq_length // (plan.context_parallel_size * plan.tensor_model_parallel_size)


def expert_token_copies(model: ModelSpec, plan) -> int:
    """Token copies one rank's experts run per microbatch: T k etp (balanced routing)."""
    return local_tokens(plan) * model.moe_router_topk * expert_tensor_parallel_size(plan)


@dataclass(frozen=True)
class ExpertShapes:
    """The grouped GEMMs of one rank's experts: ``experts`` local experts, each [tokens, k] x [k, n]."""

    experts: int
    tokens: int
    fc1: tuple[int, int]
    """(n, k) of FC1: 2 f_e / etp (SwiGLU) out, h in."""
    fc2: tuple[int, int]
    """(n, k) of FC2: h out, f_e / etp in."""


def expert_shapes(model: ModelSpec, plan) -> ExpertShapes:
    """The rank's expert GEMM shapes (tokens per expert rounded up)."""
    etp, ep = expert_tensor_parallel_size(plan), plan.expert_model_parallel_size
    experts = model.num_experts // ep
    return ExpertShapes(experts, -(-expert_token_copies(model, plan) // experts),
                        (model.expert_fc1_width // etp, model.hidden_size),
                        (model.hidden_size, model.expert_ffn_hidden_size // etp))


def grouped_pass_seconds(pass_: str, tokens: int, n: int, k: int, experts: int, r: KernelRates, *,
                         grouped: bool = True, out_bytes: Optional[int] = None) -> float:
    """One pass of one FC X[tokens, k] -> Y[tokens, n] over ``experts`` local experts: a batched GEMM
    (--moe-grouped-gemm) or one GEMM per expert; the weight gradient accumulates into fp32 main grads as the dense
    layers' does (``out_bytes`` replaces the bytes per output element: a measurement that writes bf16)."""
    if tokens <= 0:
        return 0.0
    if not grouped:
        return experts * linear_pass_seconds(pass_, tokens, n, k, r, out_bytes=out_bytes)
    if out_bytes is None:
        out_bytes = 2 * FP32 if pass_ == "wgrad" else BF16
    return gemm_seconds(*linear_pass_gemm(pass_, tokens, n, k), r, batch=experts, out_bytes=out_bytes)


def expert_gemm_seconds(model: ModelSpec, plan, r: KernelRates) -> dict[str, float]:
    """Forward, data- and weight-gradient seconds of the rank's expert GEMMs (FC1 and FC2 of its E / ep experts) for
    one microbatch."""
    s = expert_shapes(model, plan)
    grouped = plan.moe_grouped_gemm
    return {p: sum(grouped_pass_seconds(p, s.tokens, n, k, s.experts, r, grouped=grouped) for n, k in (s.fc1, s.fc2))
            for p in ("fwd", "dgrad", "wgrad")}


def router_gemm_seconds(model: ModelSpec, plan, r: KernelRates) -> dict[str, float]:
    """... of the router's GEMM (T x h x E)."""
    tokens = local_tokens(plan)
    return {p: linear_pass_seconds(p, tokens, model.num_experts, model.hidden_size, r)
            for p in ("fwd", "dgrad", "wgrad")}


def activation_bytes(model: ModelSpec, plan, *, backward: bool) -> float:
    """Bytes of the experts' activation kernel over the T k etp copies' 2 f_e / etp columns, one way."""
    etp = expert_tensor_parallel_size(plan)
    return BF16 * activation_elements(model.expert_fc1_width // etp, model.expert_ffn_hidden_size // etp,
                                      backward=backward) * expert_token_copies(model, plan)


def elementwise_bytes(model: ModelSpec, plan) -> tuple[float, float, float]:
    """(forward, backward, recomputed by ckpt=ours / ``moe_act``) bytes of one MoE layer's element-wise kernels: the
    router's softmax and top-k over T x E scores; the permute (read T h, write T k h) and the unpermute (read T k h,
    write T h), each way; the activation (:func:`activation_bytes`)."""
    tokens, h, k = local_tokens(plan), model.hidden_size, model.moe_router_topk
    router_f = ROUTER_BYTES_PER_SCORE_FWD * tokens * model.num_experts
    router_b = ROUTER_BYTES_PER_SCORE_BWD * tokens * model.num_experts
    permute = 2 * BF16 * (tokens * h + tokens * k * h)
    act_f, act_b = activation_bytes(model, plan, backward=False), activation_bytes(model, plan, backward=True)
    return router_f + permute + act_f, router_b + permute + act_b, act_f


def elementwise_kernels() -> int:
    """Kernels of a MoE layer's element-wise work beyond the dense layer's, each way."""
    return ROUTER_KERNELS + PERMUTE_KERNELS


def remote_nodes_per_token(model: ModelSpec, ep: int, members_per_node: int) -> float:
    """Expected number of other nodes a token's k experts lie in, when the ep ranks sit ``members_per_node`` to a
    node and each node holds E members_per_node / ep experts: (N - 1) (1 - C(E - E_n, k) / C(E, k)) for N nodes
    (balanced routing: every k-subset of the experts alike)."""
    nodes = ep // members_per_node
    per_node = model.num_experts * members_per_node // ep
    k, e = model.moe_router_topk, model.num_experts
    miss = math.comb(e - per_node, k) / math.comb(e, k)
    return (nodes - 1) * (1.0 - miss)


def deepep_seconds(model: ModelSpec, tokens: int, ep: int, stride: int, system: SystemSpec) -> float:
    """One direction of DeepEP's exchange (``flex``) over ep ranks spanning nodes: each token crosses the network
    once per other node its experts lie in (:func:`remote_nodes_per_token`; DeepEP forwards it inside that node
    over NVLink) instead of once per expert there; the NVLink legs carry the token copies for the experts inside
    the rank's node and those forwarded to it, at once. Inside one node it is the all-to-all."""
    k = group_node_spread(stride, ep, system.gpus_per_node)
    row = model.hidden_size * BF16
    if k == 0 or ep % k:
        return all_to_all_seconds(tokens * model.moe_router_topk * row, ep, stride, system)
    network = tokens * remote_nodes_per_token(model, ep, k) * row / nic_rate(system)
    local = tokens * model.moe_router_topk * row * (k - 1) / ep / nvlink_rate(system)
    return system.network_latency_s + max(network, local)


def dispatch_seconds(model: ModelSpec, plan, system: SystemSpec) -> float:
    """One direction's token exchange of one MoE layer and microbatch (dispatch + combine; the backward moves the
    gradients the same way): the all-to-all over ep and the all-gather / reduce-scatter over etp, or the
    allgather dispatcher's all-gather / reduce-scatter over ep etp."""
    ep, etp = plan.expert_model_parallel_size, expert_tensor_parallel_size(plan)
    tokens, h = local_tokens(plan), model.hidden_size
    if plan.moe_token_dispatcher_type == "allgather":
        size = ep * etp
        return 2 * all_gather_seconds(size * tokens * h * BF16, size, group_link(1, size, system))
    copies = tokens * model.moe_router_topk
    if plan.moe_token_dispatcher_type == "flex":
        a2a = deepep_seconds(model, tokens, ep, etp, system)
    else:
        a2a = all_to_all_seconds(copies * h * BF16, ep, etp, system)
    gather = all_gather_seconds(etp * copies * h * BF16, etp, group_link(1, etp, system))
    return 2 * (a2a + gather)


@dataclass(frozen=True)
class MoELayerTime:
    """What a MoE layer adds to one layer's time, per microbatch on one rank (``timing``'s ``LayerTime`` takes it)."""

    fwd: float
    """Router, experts' GEMMs and element-wise work (softmax/top-k, permute/unpermute, activation) of the forward."""
    bwd: float
    """... of the backward."""
    act: float
    """The experts' activation forward: what ckpt=ours and Megatron's ``moe_act`` recompute."""
    exchange: float
    """One direction's token exchange (:func:`dispatch_seconds`), before any overlap."""
    exchange_fwd: float
    """The forward's exchange left exposed (less the shared expert's forward GEMMs with --moe-shared-expert-overlap)."""
    exchange_bwd: float
    """... the backward's (less the shared expert's data- and weight-gradient GEMMs)."""
    mlp_fwd: float = 0.0
    """The experts' own forward (their GEMMs and activation, megatron-core's ``mlp`` node of the 1F1B overlap),
    part of ``fwd``."""
    mlp_dgrad: float = 0.0
    """... their data-gradient backward (GEMMs and activation), part of ``bwd``."""
    mlp_wgrad: float = 0.0
    """... their weight-gradient GEMMs, part of ``bwd``."""


def layer_seconds(model: ModelSpec, plan, system: SystemSpec, r: KernelRates,
                  shared_shapes: tuple[tuple[int, int, int], ...]) -> MoELayerTime:
    """A MoE layer's own work and exchanges; ``shared_shapes``: (m, n, k) of the tensor-parallel MLP's FC1 and FC2 (the
    shared expert's), whose GEMMs --moe-shared-expert-overlap runs beside the exchange."""
    mlp, router = expert_gemm_seconds(model, plan, r), router_gemm_seconds(model, plan, r)
    m_fwd, m_bwd, m_act = elementwise_bytes(model, plan)
    kernels = elementwise_kernels()
    ep = dispatch_seconds(model, plan, system)
    ep_f = ep_b = ep
    if plan.moe_shared_expert_overlap:
        q = plan.fp8 is not None

        def shared(*passes: str) -> float:
            return sum(linear_pass_seconds(p, *shape, r, fp8=q) for p in passes for shape in shared_shapes)
        ep_f, ep_b = max(0.0, ep - shared("fwd")), max(0.0, ep - shared("dgrad", "wgrad"))
    act = elementwise_seconds(m_act, r, kernels=1)
    act_b = elementwise_seconds(activation_bytes(model, plan, backward=True), r, kernels=1)
    return MoELayerTime(fwd=mlp["fwd"] + router["fwd"] + elementwise_seconds(m_fwd, r, kernels=kernels),
                        bwd=sum(mlp[p] + router[p] for p in ("dgrad", "wgrad"))
                        + elementwise_seconds(m_bwd, r, kernels=kernels),
                        act=act, exchange=ep, exchange_fwd=ep_f, exchange_bwd=ep_b, mlp_fwd=mlp["fwd"] + act,
                        mlp_dgrad=mlp["dgrad"] + act_b, mlp_wgrad=mlp["wgrad"])


def merged_layer_seconds(pre_fwd: float, mlp_fwd: float, pre_bwd: float, mlp_dgrad: float, mlp_wgrad: float,
                         exchange: float) -> float:
    """One layer's forward of one microbatch and another layer's backward of another, merged as megatron-core's
    --overlap-moe-expert-parallel-comm runs them (``TransformerLayerSchedulePlan.run``): two streams, each serial,
    every exchange half (a dispatch or a combine, ``exchange`` / 2 each) on the communication stream while the other
    microbatch computes:

        comm:    combine bwd       | dispatch fwd -> dispatch bwd      | combine fwd
        compute: pre-dispatch fwd  | mlp dgrad -> mlp wgrad -> mlp fwd | pre-dispatch bwd

    ``pre_*``: the layer's work before the dispatch (attention, norms, router, permute and their tensor- and
    context-parallel traffic); ``mlp_*``: the experts' (:class:`MoELayerTime`). The MLP's backward waits for the
    combine's backward, its forward for the forward's dispatch, the dispatch's backward for the MLP's data gradient,
    and the last phase for both streams."""
    half = exchange / 2
    start = max(pre_fwd, half)  # both streams' first items
    mlp_fwd_end = max(mlp_dgrad + mlp_wgrad, half) + mlp_fwd  # on the compute stream after the dispatch fwd
    dispatch_bwd_end = max(half, mlp_dgrad) + half
    return start + max(mlp_fwd_end, dispatch_bwd_end) + max(half, pre_bwd)


def expert_terms(model: ModelSpec, plan, *, dtype_bytes: int = BF16) -> dict[str, int]:
    """Saved bytes of one MoE layer's router and experts per local token, by term, before any recompute
    (module docstring)."""
    k, h, b, e = model.moe_router_topk, model.hidden_size, dtype_bytes, model.num_experts
    etp = expert_tensor_parallel_size(plan)
    return {
        "router_scores": 2 * e * FP32,
        "routing_map": e * (BOOL + FP32),
        "routing_indices": k * (2 * INT64 + 2 * FP32),
        "expert_input": k * etp * h * b,
        "expert_fc1_output": k * model.expert_fc1_width * b,
        "expert_act_output": k * model.expert_ffn_hidden_size * b,
    }


def kept_expert_bytes(model: ModelSpec, plan, base: str, modules: tuple[str, ...], *,
                      dtype_bytes: int = BF16) -> int:
    """Saved expert bytes per local token of a layer outside full-recompute units: ``base`` ckpt ('no' or 'ours')
    and Megatron's selective ``modules``."""
    if not model.is_moe:
        return 0
    terms = expert_terms(model, plan, dtype_bytes=dtype_bytes)
    drop: set[str] = set()
    if base == "ours" or "moe_act" in modules:
        drop.update(EXPERT_ACT_DROPS)
    if "moe" in modules:
        drop.update(EXPERT_TERMS)
    return sum(v for key, v in terms.items() if key not in drop)


__all__ = ["EXPERT_TERMS", "MOE_TOKEN_DISPATCHERS", "ExpertShapes", "MoELayerTime", "layer_seconds", "dispatch_seconds",
           "activation_bytes", "elementwise_bytes", "elementwise_kernels", "expert_data_parallel_size", "expert_gemm_seconds", "grouped_pass_seconds",
           "expert_shapes", "expert_tensor_parallel_size", "expert_terms", "expert_token_copies",
           "kept_expert_bytes", "local_tokens", "merged_layer_seconds", "router_gemm_seconds"]
