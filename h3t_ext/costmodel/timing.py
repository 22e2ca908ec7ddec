"""Iteration time from the shapes each rank runs: every term is kernels (kernels.py) or collectives
(collectives.py) priced with the system file's datasheet numbers and named efficiencies.

Per microbatch, layer and rank (tokens T = micro_batch * s / c of the rank's context shard; with sequence
parallelism the GEMMs see all T tokens of the tensor-parallel group, the norms T / t):

* GEMMs: QKV [T, h] x [h, (h + 2 h_kv)/t], projection [T, h/t] x [h/t, h], FC1 [T, h] x [h, fc1/t],
  FC2 [T, f/t] x [f/t, h]; backward runs the data-gradient GEMM (same FLOPs) and the weight-gradient GEMM
  that accumulates into the fp32 main grads. Each is priced by ``kernels.gemm_seconds`` (tile and wave
  quantization over the SMs, memory-bound roofline for thin GEMMs).
* attention: flash attention over the rank's heads (h/t) and chunk (``attention_seconds``), slower with
  attention dropout (``kernels.flash_attention_seconds``); with context
  parallelism a ring of c steps in which each step's K/V exchange with the neighbour runs against that
  step's attention block (only what outlasts the block is exposed; backward moves K/V and dK/dV).
* element-wise: norms, residual adds (with hidden dropout, their masks), RoPE and the activation function
  as HBM traffic.
* ``recompute``: ckpt=ours the norm outputs and activation function; selective the attention core forward;
  full one more forward of every layer (and its tensor-parallel traffic).
* ``tp_comm``: sequence parallel: 4 collectives (all-gather / reduce-scatter of [T, h]) forward, 6
  backward; without sequence parallel 2 all-reduces each way. --tp-comm-overlap leaves
  ``tp_comm_overlap_exposed`` of them on the critical path; without it the forward ones are exposed and the
  backward re-gather and gradient reduce-scatter/all-reduce run against the data/weight-gradient GEMMs
  (Megatron's async communication in the linear layers), exposed only where they outlast those GEMMs.
* ``pp_p2p``: activations between pipeline ranks, one hop per virtual stage boundary: the first
  microbatch's forward and the last one's backward cross all p v - 1 boundaries on the critical path
  (2 (p v - 1) hops: at each warm-up wrap rank 0 has finished its p chunks while the microbatch still needs
  p hops to come back); plain 1F1B also waits for the two blocking exchanges of every steady-state
  microbatch, and so does the interleaved schedule without --overlap-p2p-communication for its one exchange
  (forward and backward together) of every steady-state microbatch and chunk. With tied embeddings and
  p > 1, the word-embedding gradient all-reduce between the first and the last stage after the backward.
* ``bubble``: (interleaved) 1F1B: 1/v of one microbatch's forward + backward on every rank but the slowest
  ((p - 1)/v microbatches of the slowest rank when the ranks are alike).
* ``dp_exposed``: gradient reduce-scatter (fp32) and parameter all-gather (bf16) with the distributed
  optimizer, an fp32 all-reduce without it. Megatron's buckets (max(40M, 1M x d) parameters) with
  --overlap-grad-reduce start as soon as the last microbatch's backward produces them: what outlasts that
  backward is exposed, at least one bucket. Interleaved, chunk j's gradients are complete j p chunk-backwards
  before the end of rank 0's cool-down (Megatron's chunk order), so the stream is exposed by the larger of
  comm - ((v - 1) p + 1) chunk-backwards and the last chunk's comm / v - 1 chunk-backward
  (``_bucketed_exposed``); likewise --overlap-param-gather against the first forwards of the next
  iteration. Megatron FSDP with sharded
  gradients (``data_parallel_sharding_strategy``) reduce-scatters after every microbatch, with sharded
  parameters also all-gathers them for every microbatch's forward and backward.
* ``optimizer``: gradient norm, Adam and the bf16 weight copy on the optimizer shard, gradient zeroing
  (memory-bound, ``ADAM_BYTES_PER_PARAM``).
* ``offload_exposed``: PCIe copies that do not fit behind the compute action they overlap.
"""
from __future__ import annotations

import math

from h3t_ext.costmodel.activations import BOOL
from h3t_ext.costmodel.collectives import (
    Link,
    all_gather_seconds,
    all_reduce_seconds,
    group_link,
    p2p_link,
    p2p_seconds,
)
from h3t_ext.costmodel.kernels import (
    BF16,
    FP32,
    KernelRates,
    elementwise_seconds,
    flash_attention_seconds,
    gemm_seconds,
    kernel_rates,
    unfused_attention_seconds,
    wgrad_seconds,
)
from h3t_ext.costmodel.memory import optimizer_shards, stage_params
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec

DDP_BUCKET_PARAMS = 40_000_000
"""Megatron DDP's default bucket size: max(40M, 1M x data-parallel size) parameters."""
DDP_BUCKET_PARAMS_PER_RANK = 1_000_000
CROSS_ENTROPY_BYTES_PER_LOGIT = (2 + 4) + 4 + (4 + 4) + (4 + 4) + 4 + (4 + 4) + (4 + 4) + (4 + 2)
"""Megatron's vocab-parallel cross entropy, unfused, per logit of the rank's vocabulary shard
(megatron-core ``tensor_parallel/cross_entropy.py``). Forward: cast bf16 -> fp32, max, subtract the max
in place, exp in place, sum, divide in place (the softmax is kept for backward); backward: the softmax
becomes the gradient in place (subtracting the one-hot target touches one logit per token), scaled by the
loss gradient in place, and autograd casts it to bf16."""
CP_MERGE_BYTES_FWD = BF16 + FP32 + FP32
"""Context-parallel ring forward, per output element and step: read the step's bf16 output, read and write
the fp32 accumulated output (the softmax-lse rescaling of TransformerEngine's ring attention)."""
CP_MERGE_BYTES_BWD = FP32 + FP32
"""Backward, per dQ / dK / dV element and step: read and write the fp32 gradient accumulators."""
ADAM_BYTES_PER_PARAM = FP32 + (4 * 4 + 3 * 4) + (FP32 + BF16)
"""Optimizer step per parameter of the shard, as Megatron's mixed-precision optimizers run it (separate
kernels): the gradient-norm kernel of gradient clipping (--clip-grad, default 1.0) reads the fp32 gradient;
Adam reads grad, master, m, v and writes master, m, v (fp32); _copy_main_params_to_model_params reads the
fp32 master and writes the bf16 weight."""


def _gemms(model: ModelSpec, plan: Plan) -> tuple[tuple[int, int, int], ...]:
    """(M, N, K) of the four GEMMs of one layer on one rank."""
    t, tokens = plan.tensor_model_parallel_size, plan.micro_batch_size * plan.seq_length // plan.context_parallel_size
    h, hkv, f = model.hidden_size, model.kv_hidden_size, model.ffn_hidden_size
    return ((tokens, (h + 2 * hkv) // t, h), (tokens, h, h // t), (tokens, model.fc1_width // t, h),
            (tokens, h, f // t))


def layer_gemm_seconds(model: ModelSpec, plan: Plan, r: KernelRates) -> dict[str, float]:
    """Forward, data-gradient and weight-gradient GEMM seconds of one layer (one microbatch, one rank),
    and the QKV and FC1 backward GEMMs that the sequence-parallel backward communication overlaps."""
    fwd = dgrad = wgrad = 0.0
    per = []
    for m, n, k in _gemms(model, plan):
        f, d, w = gemm_seconds(m, n, k, r), gemm_seconds(m, k, n, r), wgrad_seconds(k, n, m, r)
        fwd, dgrad, wgrad = fwd + f, dgrad + d, wgrad + w
        per.append((f, d, w))
    return {"fwd": fwd, "dgrad": dgrad, "wgrad": wgrad, "qkv_dgrad": per[0][1], "qkv_wgrad": per[0][2],
            "fc1_dgrad": per[2][1], "fc1_wgrad": per[2][2]}


def _cp_link(plan: Plan, system: SystemSpec) -> Link:
    return p2p_link(plan.tensor_model_parallel_size, plan.context_parallel_size, system)


def attention_seconds(model: ModelSpec, plan: Plan, system: SystemSpec, r: KernelRates) -> dict[str, float]:
    """Attention of one layer (one microbatch, one rank): forward and backward seconds including what the
    context-parallel K/V ring leaves exposed (reported separately as ``cp_fwd``/``cp_bwd``)."""
    t, c, s, mb = (plan.tensor_model_parallel_size, plan.context_parallel_size, plan.seq_length,
                   plan.micro_batch_size)
    bh, d = mb * model.num_attention_heads // t, model.kv_channels
    drop = model.attention_dropout > 0
    if plan.attention_backend == "unfused":
        return {"fwd": unfused_attention_seconds(bh, s // c, d, r, backward=False, dropout=drop),
                "bwd": unfused_attention_seconds(bh, s // c, d, r, backward=True, dropout=drop), "cp_fwd": 0.0,
                "cp_bwd": 0.0}
    if c == 1:
        return {"fwd": flash_attention_seconds(bh, s, s, d, r, causal=True, backward=False, dropout=drop),
                "bwd": flash_attention_seconds(bh, s, s, d, r, causal=True, backward=True, dropout=drop),
                "cp_fwd": 0.0, "cp_bwd": 0.0}
    # load-balanced causal ring (2c chunks): step 0 is the rank's own causal block, steps 1..c-1 are
    # s/c queries against half of a neighbour's s/c keys
    q = s // c
    out = {"cp_fwd": 0.0, "cp_bwd": 0.0}
    kv_bytes = mb * q * 2 * model.kv_hidden_size // t * BF16
    link = _cp_link(plan, system)
    for name, backward, bytes_per_step in (("fwd", False, kv_bytes), ("bwd", True, 2 * kv_bytes)):
        diag = flash_attention_seconds(bh, q, q, d, r, causal=True, backward=backward, dropout=drop)
        off = flash_attention_seconds(bh, q, q // 2, d, r, causal=False, backward=backward, dropout=drop)
        send = p2p_seconds(bytes_per_step, link)
        steps = [diag] + [off] * (c - 1)
        # every step after the first merges its partial result into fp32 accumulators
        merge = (CP_MERGE_BYTES_BWD if backward else CP_MERGE_BYTES_FWD) * mb * q * (
            model.hidden_size + (2 * model.kv_hidden_size if backward else 0)) // t
        out[name] = sum(steps) + (c - 1) * elementwise_seconds(merge, r, kernels=2)
        out["cp_" + name] = sum(max(0.0, send - x) for x in steps[:-1])
    return out


def _elementwise_bytes(model: ModelSpec, plan: Plan) -> tuple[float, float, float, float]:
    """Bytes one layer's element-wise kernels move for one microbatch: (forward, backward, recomputed by
    ckpt=ours, hidden-dropout masks: written in the forward, read once in the backward).

    Per kernel, in elements of the tokens it runs on (the norms and residual adds on T / t with sequence
    parallelism, the rest on the rank's T x width / t):

    * forward: two norms read x, write y (2 h); two bias-dropout-adds read the branch and the residual and
      write the sum (3 h); RoPE (Llama) reads and writes q and k; the activation reads the FC1 output and
      writes its input to FC2 (fc1 + f);
    * backward: two norm backwards read x and dy, write dx (3 h); the residual stream is read by the norm
      and by the add, so autograd adds the two gradients (read 2 h, write h); with hidden dropout each
      dropout backward reads dy and writes its gradient (2 h; without dropout the add passes dy through);
      RoPE rotates dq and dk; the activation backward reads its saved input and dy and writes the FC1
      gradient (2 fc1 + f), and with linear biases autograd reduces that gradient into FC1's bias (fc1;
      megatron-core's bias-GeLU / bias-SwiGLU functions return the full-size gradient for the bias)."""
    t = plan.tensor_model_parallel_size
    tokens = plan.micro_batch_size * plan.seq_length // plan.context_parallel_size
    norm_tokens = tokens // t if plan.sequence_parallel else tokens
    h, hkv, f, fc1 = model.hidden_size, model.kv_hidden_size, model.ffn_hidden_size, model.fc1_width
    dropout = model.hidden_dropout > 0
    norms_fwd, norms_bwd = 2 * 2 * h * norm_tokens, 2 * 3 * h * norm_tokens
    residual_fwd = 2 * 3 * h * norm_tokens
    residual_bwd = 2 * 3 * h * norm_tokens + (2 * 2 * h * norm_tokens if dropout else 0)
    rope = 2 * (h + hkv) * tokens // t if model.swiglu else 0  # Llama models rotate q and k
    act_fwd, act_bwd = (fc1 + f) * tokens // t, (2 * fc1 + f) * tokens // t
    if model.add_bias_linear:  # the fused bias-activation's bias gradient, reduced over the tokens by autograd
        act_bwd += fc1 * tokens // t
    # hidden dropout: the two fused bias-dropout-adds also write their 1-byte masks
    masks = 2 * h * norm_tokens * BOOL if dropout else 0
    return (BF16 * (norms_fwd + residual_fwd + rope + act_fwd), BF16 * (norms_bwd + residual_bwd + rope + act_bwd),
            BF16 * (norms_fwd + act_fwd), masks)


def _tp_seconds(model: ModelSpec, plan: Plan, system: SystemSpec, g: dict[str, float]) -> tuple[float, float]:
    """Exposed tensor-parallel communication of one layer: (forward, backward) seconds."""
    t = plan.tensor_model_parallel_size
    if t == 1:
        return 0.0, 0.0
    link = group_link(1, t, system)
    nbytes = plan.micro_batch_size * plan.seq_length // plan.context_parallel_size * model.hidden_size * BF16
    if plan.sequence_parallel:
        one = all_gather_seconds(nbytes, t, link)
        fwd_total, bwd_total = 4 * one, 6 * one
        bwd_overlappable = [(one, g["qkv_dgrad"]), (one, g["qkv_wgrad"]), (one, g["fc1_dgrad"]), (one, g["fc1_wgrad"])]
        bwd_blocking = 2 * one
    else:
        one = all_reduce_seconds(nbytes, t, link)
        fwd_total, bwd_total = 2 * one, 2 * one
        bwd_overlappable = [(one, g["qkv_wgrad"]), (one, g["fc1_wgrad"])]
        bwd_blocking = 0.0
    if plan.tp_comm_overlap:
        e = system.efficiency("tp_comm_overlap_exposed")
        return e * fwd_total, e * bwd_total
    return fwd_total, bwd_blocking + sum(max(0.0, comm - gemm) for comm, gemm in bwd_overlappable)


_CACHE_LIMIT = 65536
_layer_cache: dict = {}


def _shape_key(model: ModelSpec, plan: Plan, system: SystemSpec) -> tuple:
    """Everything a layer's (or the output layer's) time depends on; a search prices many plans that share it.
    (SystemSpec's hash leaves out its efficiencies, so their values are part of the key: fits try many.)"""
    return (model, system, tuple(system.efficiencies.values()), plan.tensor_model_parallel_size,
            plan.context_parallel_size, plan.seq_length,
            plan.micro_batch_size, plan.ckpt, plan.sequence_parallel, plan.tp_comm_overlap, plan.attention_backend)


def layer_seconds(model: ModelSpec, plan: Plan, system: SystemSpec) -> dict[str, float]:
    """Seconds of one layer for one microbatch on one rank, by part (memoised by shape)."""
    key = _shape_key(model, plan, system)
    hit = _layer_cache.get(key)
    if hit is None:
        if len(_layer_cache) > _CACHE_LIMIT:
            _layer_cache.clear()
        hit = _layer_cache[key] = (_layer_seconds(model, plan, system), head_seconds(model, plan, system))
    return hit[0]


def _head(model: ModelSpec, plan: Plan, system: SystemSpec) -> float:
    layer_seconds(model, plan, system)
    return _layer_cache[_shape_key(model, plan, system)][1]


def _layer_seconds(model: ModelSpec, plan: Plan, system: SystemSpec) -> dict[str, float]:
    r = kernel_rates(system)
    g = layer_gemm_seconds(model, plan, r)
    a = attention_seconds(model, plan, system, r)
    elem_fwd, elem_bwd, elem_ours, masks = _elementwise_bytes(model, plan)
    e_fwd = elementwise_seconds(elem_fwd + masks, r, kernels=6)
    e_bwd = elementwise_seconds(elem_bwd + masks, r, kernels=8)
    tp_f, tp_b = _tp_seconds(model, plan, system, g)
    fwd = g["fwd"] + a["fwd"] + e_fwd
    rec = {"no": 0.0, "ours": elementwise_seconds(elem_ours, r, kernels=3), "selective": a["fwd"],
           "full": fwd}[plan.ckpt]  # its communication is in tp / cp below
    return {"fwd": fwd, "bwd": g["dgrad"] + g["wgrad"] + a["bwd"] + e_bwd, "recompute": rec,
            "tp": tp_f + tp_b + (tp_f if plan.ckpt == "full" else 0.0),
            "cp": a["cp_fwd"] + a["cp_bwd"] + (a["cp_fwd"] if plan.ckpt == "full" else 0.0)}


def head_seconds(model: ModelSpec, plan: Plan, system: SystemSpec) -> float:
    """Output layer and vocabulary-parallel cross entropy of one microbatch (forward + backward)."""
    r = kernel_rates(system)
    t = plan.tensor_model_parallel_size
    tokens = plan.micro_batch_size * plan.seq_length // plan.context_parallel_size
    h, v_shard = model.hidden_size, model.padded_vocab_size(t) // t
    gemm = gemm_seconds(tokens, v_shard, h, r) + gemm_seconds(tokens, h, v_shard, r) + wgrad_seconds(h, v_shard, tokens, r)
    ce = elementwise_seconds(tokens * v_shard * CROSS_ENTROPY_BYTES_PER_LOGIT, r, kernels=10)
    return gemm + ce


def _bucketed_exposed(comm: float, buckets: int, chunks: int, unit: float, p: int) -> float:
    """Exposed part of Megatron's bucketed gradient reduce-scatter (or parameter all-gather) stream on the
    rank that finishes last (rank 0), with ``chunks`` = v model chunks of ``unit`` seconds of one
    microbatch's backward (forward) each.

    Interleaved 1F1B runs the last p v backward units as p units of chunk v - 1, then p of chunk v - 2, ...,
    p of chunk 0 (Megatron's schedules.py: backward chunk = v - 1 - (k // p) % v), so chunk j's gradients are
    complete j p units before the end, and within its last unit they arrive bucket by bucket. One link
    drains them in that order, each chunk carrying comm / v: it ends max_j ((j + 1) comm / v - j p unit - unit)
    after the backward -- j = v - 1 (the link is the bottleneck: comm - ((v - 1) p + 1) unit) or j = 0
    (the last chunk alone: comm / v - unit) -- and at least one bucket after it. The parameter all-gather
    mirrors it in the forward (chunk j is first used j p units after the start). v = 1: comm - unit."""
    window = ((chunks - 1) * p + 1) * unit
    return max(comm / buckets, comm - window, comm / chunks - unit)


def _dp_seconds(model: ModelSpec, plan: Plan, system: SystemSpec, bwd_unit: float, fwd_unit: float,
                mb_window: float = math.inf) -> float:
    """Exposed data-parallel communication of one iteration (the stage with most parameters). ``bwd_unit``
    and ``fwd_unit``: one microbatch's backward (forward) of one model chunk (``_bucketed_exposed``).

    Megatron FSDP with sharded gradients reduce-scatters after every microbatch's backward (m times the
    traffic; with --overlap-grad-reduce it runs behind the compute of the following microbatches,
    ``mb_window`` seconds each, and the last one's backward); with sharded parameters it also all-gathers
    them before every microbatch's forward and backward (2 m times; with --overlap-param-gather behind
    the compute), and there is no all-gather after the optimizer step."""
    d, p = plan.data_parallel_size, plan.pipeline_model_parallel_size
    if d == 1:
        return 0.0
    n = max(stage_params(model, plan, k) for k in {0, p - 1})
    link = group_link(plan.tensor_model_parallel_size, d, system)
    buckets = max(1, math.ceil(n / max(DDP_BUCKET_PARAMS, DDP_BUCKET_PARAMS_PER_RANK * d)))
    if plan.use_distributed_optimizer:
        grads = all_gather_seconds(n * FP32, d, link)  # reduce-scatter: same ring cost
        params = all_gather_seconds(n * BF16, d, link)
    else:
        grads, params = all_reduce_seconds(n * FP32, d, link), 0.0
    strategy = plan.data_parallel_sharding_strategy
    v = plan.virtual_size(model.num_layers)
    bwd_window = ((v - 1) * p + 1) * bwd_unit
    if strategy is not None:
        m = plan.num_microbatches
        grads *= m
        if plan.overlap_grad_reduce:
            grads = max(grads / (m * buckets), grads - (m - 1) * mb_window - bwd_window)
        if strategy == "optim_grads_params":
            params *= 2 * m
            if plan.overlap_param_gather:
                params = max(params / (2 * m * buckets), params - m * mb_window)
            return grads + params
    elif plan.overlap_grad_reduce:
        grads = _bucketed_exposed(grads, buckets, v, bwd_unit, p)
    if plan.overlap_param_gather and params:
        params = _bucketed_exposed(params, buckets, v, fwd_unit, p)
    return grads + params


def pipeline_p2p_seconds(model: ModelSpec, plan: Plan, system: SystemSpec) -> float:
    """The ``pp_p2p`` term: activations between pipeline ranks on the critical path of one iteration, and
    the gradient all-reduce of a tied embedding between the first and the last stage."""
    t, p = plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size
    if p == 1:
        return 0.0
    m, v = plan.num_microbatches, plan.virtual_size(model.num_layers)
    tokens = plan.micro_batch_size * plan.seq_length // plan.context_parallel_size
    # Megatron sends 1/t of the activation between stages (sequence parallel, or the scatter-gather
    # optimization without it, which all-gathers it over NVLink on arrival)
    hop_bytes = tokens // t * model.hidden_size * BF16
    link = p2p_link(t * plan.data_parallel_size, p, system)
    hop = p2p_seconds(hop_bytes, link)
    # the first microbatch's forward (and the last one's backward) crosses every virtual stage boundary
    # on the critical path: at each of the v - 1 wraps of the warm-up, rank 0 has done its p chunks
    # while the microbatch took p hops more to come back (and the same in the cool-down)
    activations = 2 * (p * v - 1) * hop
    if v == 1:  # 1F1B: send_forward_recv_backward and send_backward_recv_forward block every steady step
        activations += 2 * m * hop
    elif not plan.overlap_p2p_comm:  # each interleaved step waits for its batched exchange (both directions)
        activations += m * v * hop
    # tied embeddings: the first stage's word embedding and the last stage's output layer are one weight,
    # so after the backward Megatron all-reduces its fp32 gradient shard (V/t x h) between the two ranks
    # (finalize_model_grads, _allreduce_word_embedding_grads): a 2-rank all-reduce, bytes / link, exposed
    tied = 0.0
    if not model.untie_embeddings_and_output_weights:
        tied = all_reduce_seconds(model.padded_vocab_size(t) // t * model.hidden_size * FP32, 2, link)
    return activations + tied


def dp_seconds_lower_bound(model: ModelSpec, plan: Plan, system: SystemSpec) -> float:
    """The ``dp_exposed`` term with unbounded overlap windows: exact without --overlap-grad-reduce and
    --overlap-param-gather, never more than the term otherwise (at least one bucket stays exposed)."""
    return _dp_seconds(model, plan, system, math.inf, math.inf, math.inf)


def time_terms(model: ModelSpec, plan: Plan, system: SystemSpec, *, alphas: tuple[float, ...],
               chunk_bytes: int, offloaded_chunks: tuple[int, ...]) -> dict[str, float]:
    """Seconds per iteration by term (they add up to the iteration time)."""
    r = kernel_rates(system)
    t, p = plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size
    m, L = plan.num_microbatches, model.num_layers
    v = plan.virtual_size(L)
    lt = layer_seconds(model, plan, system)
    head = _head(model, plan, system)
    per_layer = lt["fwd"] + lt["bwd"] + lt["recompute"] + lt["tp"] + lt["cp"]

    def stage_time(k: int) -> float:
        return plan.stage_layers(L, k) * per_layer + (head if k == p - 1 else 0.0)

    slow = max({0, min(1, p - 1), p - 1}, key=stage_time)  # middle stages are alike: first, one middle, last
    layers = plan.stage_layers(L, slow)
    per_mb = stage_time(slow)
    # the warm-up and cool-down are the forward and backward of the first and last microbatch on every
    # rank but the slowest one (which runs all m in between): (p - 1)/v microbatches when the ranks are
    # alike, less when the last rank is the slow one only because it also runs the output layer
    everyone = L * per_layer + head
    bubble = (everyone - per_mb) / v if p > 1 else 0.0

    pp = pipeline_p2p_seconds(model, plan, system)

    off = 0.0
    if chunk_bytes and any(a > 0 for a in alphas):
        f_chunk = layers * lt["fwd"] / v
        b_chunk = layers * (lt["bwd"] + lt["recompute"]) / v
        pcie = system.pcie_bandwidth * system.efficiency("pcie_fraction")
        for a, n in zip(alphas, offloaded_chunks):
            copy = a * chunk_bytes / pcie
            off = max(off, n * (max(0.0, copy - f_chunk) + max(0.0, copy - b_chunk)))

    dp = _dp_seconds(model, plan, system, layers * (lt["bwd"] + lt["recompute"]) / v, layers * lt["fwd"] / v,
                     per_mb)
    n = max(stage_params(model, plan, k) for k in {0, p - 1})
    opt = elementwise_seconds(n * ADAM_BYTES_PER_PARAM / optimizer_shards(plan) + n * FP32, r, kernels=4)

    return {
        "compute": m * (layers * (lt["fwd"] + lt["bwd"]) + (head if slow == p - 1 else 0.0)),
        "recompute": m * layers * lt["recompute"],
        "tp_comm": m * layers * lt["tp"],
        "cp_comm": m * layers * lt["cp"],
        "pp_p2p": pp,
        "bubble": bubble,
        "dp_exposed": dp,
        "optimizer": opt,
        "offload_exposed": off,
    }
