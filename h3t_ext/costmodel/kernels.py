"""Seconds of one kernel on one GPU: GEMMs by shape, attention by chunk length and head dim, element-wise
work by bytes. Every rate comes from the system file (datasheet numbers and named, fitted efficiencies).

GEMM (``gemm_seconds``). A GEMM C[M, N] = A[M, K] B[K, N] is cut into output tiles of
``gemm_tile_m x gemm_tile_n`` (the CTA tile cuBLAS/CUTLASS pick for large bf16 GEMMs on the GPU); one SM
computes one tile at a time, so the kernel runs ceil(tiles / SMs) waves (wave quantization), and a tile is
ceil(M / tile_m) * ceil(N / tile_n) even when the edge tile is mostly empty (tile quantization). A tile
costs its 2 * tile_m * tile_n * (K + ``gemm_tile_overhead_k``) FLOPs at the per-SM share of the achievable
peak (``gemm_peak_fraction`` x datasheet peak / SMs); the overhead term is the prologue (pipeline fill) and
epilogue (writing the tile) of a tile expressed as extra K, which is what makes thin-K GEMMs (small t
shards) slow. Under FP8 (``fp8=True``, TransformerEngine's linear layers) the K loop runs at the FP8 rate
(``gemm_fp8_peak_fraction`` x the dense FP8 peak / SMs) while the tile's prologue and epilogue (bf16 output)
keep their bf16 time, and the inputs are 1 byte; with ``--fp8-recipe mxfp8`` at ``mxfp8_gemm_rate_fraction`` of that
rate where the family has it measured (:func:`recipe_rates`: Blackwell's block-scaled GEMMs, 0.951). A thin GEMM is
bound by memory instead: it reads A and B and writes C at the achievable HBM bandwidth; the kernel takes the larger
of the two (roofline), plus one launch.

Attention (``flash_attention_seconds``). Flash attention forward is 4 * s_q * s_k * d FLOPs per head
(QK^T and PV), half of it for a causal block on the diagonal; backward recomputes P and runs five
GEMM-like products, 2.5x the forward FLOPs (Dao 2023, FlashAttention-2, Sec. 3), at
``attention_backward_rate_fraction`` of the forward's FLOP/s (0.85: measured on an H200 and stated by FlashAttention-2
on A100; the backward's non-matmul work and atomics). Work is split into
blocks of ``ATTENTION_BLOCK_Q`` query rows per (batch, head) that are quantized into waves over the SMs
like GEMM tiles; the head dim sets how much of the peak a block reaches: d / (d + ``attention_head_dim_overhead``)
(softmax and rescaling are per score, matmul work per score is proportional to d). Two kernels are priced: Dao's
FlashAttention (``flash``, at ``attention_peak_fraction``) and cuDNN's fused attention (``fused``, which
TransformerEngine selects on Hopper: :func:`attention_kernel`). The fused kernel's rate is measured on the chip
(``fused_attention_gemm_ratio``: its FLOP/s at long sequence over the bf16 GEMM's on the same GPU and clocks, so the
GEMM efficiency's step from an isolated kernel to a training step applies to both tensor-core kernels alike), and so
is its fixed work per query row (``fused_attention_row_overhead_keys``: loading the query tile, the final rescale
and writing the output and its logsumexp, which cost as many keys' work; it is why a 2K-token sequence runs 20%
below a 16K one). A family with no fused measurement prices it as FlashAttention. Attention dropout
draws a Philox random number per score in the forward and draws it again in the backward (the mask is
never stored): integer work beside the softmax that lengthens the forward and backward kernels by
``attention_dropout_fwd_slowdown`` and ``attention_dropout_bwd_slowdown``, whatever the probability.
Megatron's unfused attention (``unfused_attention_seconds``, no flash) is two batched GEMMs plus the fused
scale-mask-softmax over the s^2 scores in HBM, and with dropout the dropout kernel over them.

Element-wise kernels (norms, activations, residual adds, RoPE, optimizer) are priced by the bytes they
move at ``hbm_fraction`` of the HBM bandwidth (``elementwise_seconds``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Optional

from h3t_ext.attention_window import attended_pairs
from h3t_ext.costmodel.errors import InvalidPlanError
from h3t_ext.costmodel.specs import SystemSpec
from h3t_ext.dtypes import BF16, BOOL, FP8, FP32

ATTENTION_BLOCK_Q = 128
"""Query rows per flash-attention thread block (FlashAttention-2 forward and backward on A100/H100)."""
UNFUSED_SOFTMAX_BYTES_FWD = BF16 + BF16
"""Bytes per attention score of the unfused forward's fused scale-mask-softmax: read bf16 scores, write bf16
probabilities."""
UNFUSED_DROPOUT_BYTES_FWD = BF16 + BF16 + BOOL
"""Attention dropout over the unfused scores: read the probabilities, write the dropped copy and its 1-byte
mask -- Korthikanti et al. 2022, Sec. 4.1: 5as^2b bytes saved per layer = 2 (softmax) + 1 (mask) + 2
(dropout)."""
UNFUSED_SOFTMAX_BYTES_BWD = BF16 + BF16 + BF16
"""Backward softmax: read probabilities and gradient, write the score gradient."""
UNFUSED_DROPOUT_BYTES_BWD = BOOL + BF16 + BF16
"""Backward dropout: read the mask and the gradient, write the gradient."""
FLASH_BACKWARD_FLOP_RATIO = 2.5
"""Backward / forward FLOPs of flash attention: 5 products (S recompute, dP, dS Q->dK, dQ, dV) vs 2."""


@dataclass(frozen=True)
class KernelRates:
    """Achievable rates of one GPU, from its system file."""

    sms: int
    tile_m: int
    tile_n: int
    tile_overhead_k: float
    sm_flops: float
    """Achievable dense bf16 FLOP/s of one SM on large tiles."""
    fp8_sm_flops: float
    """Achievable dense FP8 FLOP/s of one SM on large tiles (0: the GPU has no FP8)."""
    attention_flops: float
    """Achievable flash-attention FLOP/s of the GPU at infinite head dim."""
    head_dim_overhead: float
    attention_backward_fraction: float
    """FLOP/s of the flash-attention backward as a fraction of the forward's."""
    dropout_fwd_slowdown: float
    """Fraction by which attention dropout lengthens the flash-attention forward."""
    dropout_bwd_slowdown: float
    """... and the backward."""
    hbm: float
    """Achievable HBM bytes/s of element-wise kernels."""
    launch_s: float
    fused_attention_flops: float = 0.0
    """Achievable FLOP/s of cuDNN's fused attention at infinite head dim and sequence (0: the family has no
    measurement of it; priced as FlashAttention)."""
    fused_row_overhead_keys: float = 0.0
    """The fused attention's fixed work per query row, in keys' work (the same in both passes)."""
    fp8_any_layout: bool = False
    """The GPU's FP8 GEMMs take any operand layout (:func:`any_layout_fp8_gemm`): a per-tensor-scaled cast writes no
    transpose (``fp8.fp8_copies``)."""


@functools.lru_cache(maxsize=64)
def kernel_rates(system: SystemSpec) -> KernelRates:
    """The achievable rates of ``system``; InvalidPlanError (one line, naming the system) when a rate times its
    efficiencies is too small to be a number of FLOP/s or bytes/s (a system file's rates of 1/s with efficiencies
    of 1e-300: their product underflows to 0)."""
    r = _kernel_rates(system)
    for name, value in (("peak_bf16_flops x gemm_peak_fraction", r.sm_flops),
                        ("peak_bf16_flops x attention_peak_fraction x attention_backward_rate_fraction",
                         r.attention_flops * r.attention_backward_fraction),
                        ("hbm_bandwidth x hbm_fraction", r.hbm)):
        if not (math.isfinite(value) and value > 0):
            raise InvalidPlanError(f"system {system.name}: {name} is {value:g} per second, too small to price; "
                                   "valid: rates of at least one per second and efficiencies that keep them so")
    return r


def recipe_rates(r: KernelRates, system: SystemSpec, fp8_recipe: Optional[str]) -> KernelRates:
    """``r`` with the FP8 GEMM rate of ``fp8_recipe``: MXFP8's block-scaled GEMMs at the system's
    ``mxfp8_gemm_rate_fraction`` of the per-tensor rate (where measured; else and for every other recipe, ``r``)."""
    fraction = system.efficiencies.get("mxfp8_gemm_rate_fraction") if fp8_recipe == "mxfp8" else None
    return r if fraction is None else replace(r, fp8_sm_flops=r.fp8_sm_flops * fraction)


def any_layout_fp8_gemm(compute_capability: float) -> bool:
    """Whether the GPU's FP8 GEMMs take any operand layout, not only TN (TransformerEngine's
    ``is_non_tn_fp8_gemm_supported``: compute capability 10.x, Blackwell's data-center parts, and 13.0 on)."""
    return 10.0 <= compute_capability < 12.0 or compute_capability >= 13.0


def _kernel_rates(system: SystemSpec) -> KernelRates:
    e = system.efficiency
    return KernelRates(
        sms=system.num_sms,
        tile_m=system.gemm_tile_m,
        tile_n=system.gemm_tile_n,
        tile_overhead_k=e("gemm_tile_overhead_k"),
        sm_flops=system.peak_bf16_flops * e("gemm_peak_fraction") / system.num_sms,
        fp8_sm_flops=(system.peak_fp8_flops * e("gemm_fp8_peak_fraction") / system.num_sms
                      if system.peak_fp8_flops > 0 else 0.0),
        attention_flops=system.peak_bf16_flops * e("attention_peak_fraction"),
        head_dim_overhead=e("attention_head_dim_overhead"),
        attention_backward_fraction=e("attention_backward_rate_fraction"),
        dropout_fwd_slowdown=e("attention_dropout_fwd_slowdown"),
        dropout_bwd_slowdown=e("attention_dropout_bwd_slowdown"),
        hbm=system.hbm_bandwidth * e("hbm_fraction"),
        launch_s=system.kernel_launch_s,
        fp8_any_layout=any_layout_fp8_gemm(system.compute_capability),
        **_fused_attention_rates(system),
    )


def _fused_attention_rates(system: SystemSpec) -> dict[str, float]:
    """cuDNN's fused attention where the efficiency set has its measurement (a multiple of the GEMM rate)."""
    ratio = system.efficiencies.get("fused_attention_gemm_ratio")
    if ratio is None:
        return {}
    return {"fused_attention_flops": system.peak_bf16_flops * system.efficiency("gemm_peak_fraction") * ratio,
            "fused_row_overhead_keys": system.efficiency("fused_attention_row_overhead_keys")}


ATTENTION_KERNELS = ("flash", "fused")
"""The flash-attention kernels priced: Dao's FlashAttention and cuDNN's fused attention."""


def priced_attention_kernel(kernel: str, r: KernelRates) -> str:
    """The kernel whose rate prices ``kernel``: cuDNN's fused attention at its own rate only where the GPU family has it
    measured (``fused_attention_gemm_ratio``), else at FlashAttention's; the others as themselves."""
    return "flash" if kernel == "fused" and r.fused_attention_flops <= 0 else kernel


def attention_kernel(backend: str, transformer_impl: str, compute_capability: float) -> str:
    """The kernel Megatron's --attention-backend runs (``flash`` or ``fused``; ``unfused`` passes through): 'auto'
    is TransformerEngine's choice, cuDNN's fused attention on Hopper and later (compute capability 9.0 up: TE 1.2+
    disables FlashAttention there 'for performance reasons' when both can run) and FlashAttention before; without
    TransformerEngine the local layers run FlashAttention."""
    if backend != "auto":
        return backend
    return "fused" if transformer_impl == "transformer_engine" and compute_capability >= 9.0 else "flash"


def gemm_seconds(m: int, n: int, k: int, r: KernelRates, *, out_bytes: int = BF16, batch: int = 1,
                 fp8: bool = False) -> float:
    """One (batched) GEMM [m, k] x [k, n] -> [m, n]: max(tile waves, HBM traffic) + launch; ``fp8``: FP8
    inputs (1 byte) with the K loop at the FP8 rate."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    tiles = batch * (-(-m // r.tile_m)) * (-(-n // r.tile_n))
    waves = -(-tiles // r.sms)
    k_time = k / (r.fp8_sm_flops if fp8 else r.sm_flops) + r.tile_overhead_k / r.sm_flops
    compute = waves * 2.0 * r.tile_m * r.tile_n * k_time
    memory = batch * ((FP8 if fp8 else BF16) * (m * k + k * n) + out_bytes * m * n) / r.hbm
    return max(compute, memory) + r.launch_s


def wgrad_seconds(m: int, n: int, k: int, r: KernelRates, *, accumulate_fp32: bool = True, fp8: bool = False) -> float:
    """Weight-gradient GEMM dW[m, n] = X^T[m, k] dY[k, n] accumulated into fp32 main grads (read + write
    4 bytes each) with Megatron's gradient-accumulation fusion."""
    out = 2 * FP32 if accumulate_fp32 else BF16
    return gemm_seconds(m, n, k, r, out_bytes=out, fp8=fp8)


LINEAR_PASSES = ("fwd", "dgrad", "wgrad")
"""The three GEMMs of a linear layer Y[m, n] = X[m, k] W^T: forward, data gradient, weight gradient."""


def linear_pass_gemm(pass_: str, m: int, n: int, k: int) -> tuple[int, int, int]:
    """(M, N, K) of the GEMM that one pass of a linear layer X[m, k] -> Y[m, n] runs: the forward
    (m, n, k); the data gradient dX[m, k] = dY[m, n] W[n, k], (m, k, n); the weight gradient
    dW^T[k, n] = X^T[k, m] dY[m, n], (k, n, m)."""
    if pass_ == "fwd":
        return m, n, k
    if pass_ == "dgrad":
        return m, k, n
    if pass_ == "wgrad":
        return k, n, m
    raise ValueError(f"pass must be one of {', '.join(LINEAR_PASSES)}, got {pass_!r}")


def linear_pass_seconds(pass_: str, m: int, n: int, k: int, r: KernelRates, *, fp8: bool = False,
                        out_bytes: int | None = None) -> float:
    """One pass of a linear layer X[m, k] -> Y[m, n] (:func:`linear_pass_gemm`): forward and data gradient
    write a bf16 output, the weight gradient accumulates into the fp32 main grads (:func:`wgrad_seconds`);
    ``out_bytes`` replaces the bytes per output element (a GEMM that writes a plain bf16 or fp32 output)."""
    gm, gn, gk = linear_pass_gemm(pass_, m, n, k)
    if out_bytes is not None:
        return gemm_seconds(gm, gn, gk, r, out_bytes=out_bytes, fp8=fp8)
    if pass_ == "wgrad":
        return wgrad_seconds(gm, gn, gk, r, fp8=fp8)
    return gemm_seconds(gm, gn, gk, r, fp8=fp8)


def _attention_waves(batch_heads: int, s_q: int, r: KernelRates) -> float:
    """Quantization factor (>= 1) of flash-attention blocks over the SMs."""
    blocks = batch_heads * -(-s_q // ATTENTION_BLOCK_Q)
    return math.ceil(blocks / r.sms) * r.sms / blocks


def score_pairs(s_q: int, s_k: int, *, causal: bool, window: Optional[int] = None) -> float:
    """(query, key) pairs one head of a flash-attention call scores: s_q s_k, half of them causal, the band of a
    sliding ``window`` (causal self-attention, s_q = s_k: :func:`h3t_ext.attention_window.attended_pairs`)."""
    if causal and window is not None:
        if s_q != s_k:
            raise ValueError(f"a windowed flash-attention call is self-attention, got {s_q} queries over {s_k} keys")
        return attended_pairs(s_q, window)
    return s_q * s_k * (0.5 if causal else 1.0)


def flash_attention_flops(batch_heads: int, s_q: int, s_k: int, head_dim: int, *, causal: bool,
                          backward: bool, window: Optional[int] = None) -> float:
    """FLOPs of one flash-attention call: 4 d per scored pair (:func:`score_pairs`) per head (QK^T and PV), times
    ``FLASH_BACKWARD_FLOP_RATIO`` for the backward."""
    flops = 4.0 * batch_heads * score_pairs(s_q, s_k, causal=causal, window=window) * head_dim
    return flops * FLASH_BACKWARD_FLOP_RATIO if backward else flops


def flash_attention_seconds(batch_heads: int, s_q: int, s_k: int, head_dim: int, r: KernelRates, *,
                            causal: bool, backward: bool, dropout: bool = False, window: Optional[int] = None,
                            kernel: str = "flash") -> float:
    """One flash-attention call of ``batch_heads`` (batch x local heads) of s_q queries over s_k keys, with
    or without attention dropout, causal within a sliding ``window`` when one is given; ``kernel`` 'fused' prices
    cuDNN's fused attention (its own rate and fixed work per query row) where the GPU family has it measured."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(ATTENTION_KERNELS)}, got {kernel!r}")
    flops = flash_attention_flops(batch_heads, s_q, s_k, head_dim, causal=causal, backward=backward, window=window)
    peak = r.attention_flops
    if priced_attention_kernel(kernel, r) == "fused":
        peak = r.fused_attention_flops
        pairs = score_pairs(s_q, s_k, causal=causal, window=window)
        flops *= 1.0 + (r.fused_row_overhead_keys * s_q / pairs if pairs > 0 else 0.0)
    rate = peak * head_dim / (head_dim + r.head_dim_overhead)
    if backward:
        rate *= r.attention_backward_fraction
    if dropout:
        rate /= 1.0 + (r.dropout_bwd_slowdown if backward else r.dropout_fwd_slowdown)
    return flops / rate * _attention_waves(batch_heads, s_q, r) + r.launch_s


def unfused_attention_seconds(batch_heads: int, s: int, head_dim: int, r: KernelRates, *, backward: bool,
                              dropout: bool = False) -> float:
    """Megatron's attention without flash: QK^T and PV as batched GEMMs over the full s x s scores, plus the
    fused scale-mask-softmax (and the attention dropout kernel) over the scores in HBM."""
    bmm = gemm_seconds(s, s, head_dim, r, batch=batch_heads) + gemm_seconds(s, head_dim, s, r, batch=batch_heads)
    scores = batch_heads * s * s
    if backward:
        per_score = UNFUSED_SOFTMAX_BYTES_BWD + (UNFUSED_DROPOUT_BYTES_BWD if dropout else 0)
        return 2 * bmm + elementwise_seconds(scores * per_score, r, kernels=2 if dropout else 1)
    per_score = UNFUSED_SOFTMAX_BYTES_FWD + (UNFUSED_DROPOUT_BYTES_FWD if dropout else 0)
    return bmm + elementwise_seconds(scores * per_score, r, kernels=2 if dropout else 1)


def elementwise_seconds(nbytes: float, r: KernelRates, kernels: int = 1) -> float:
    """Memory-bound kernels moving ``nbytes`` in total."""
    return nbytes / r.hbm + kernels * r.launch_s
