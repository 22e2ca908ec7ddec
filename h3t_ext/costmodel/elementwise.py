"""Byte rules of the element-wise kernels the time model counts, one kernel at a time: the norms, the residual
adds, the activation function and the vocabulary-parallel cross entropy. :func:`layer_elementwise_bytes` sums them
per layer and ``timing.py`` prices the sum with ``kernels.elementwise_seconds``; the per-kernel functions here
price one kernel the same way (the GPU check, ``scripts/gpu/ground_truth.py``, measures them one by one).

Elements are counted per element of the tensor the kernel runs on (a token's ``width`` values), in bf16.
"""
from __future__ import annotations

from typing import Optional

from h3t_ext.costmodel.kernels import KernelRates, elementwise_seconds
from h3t_ext.dtypes import BF16, BOOL, FP32

NORM_ELEMENTS_FWD = 2
"""A norm's forward reads x and writes y."""
NORM_ELEMENTS_BWD = 3
"""A norm's backward reads x and dy and writes dx (the weight gradient's partial sums are small)."""
NORM_KERNELS_FWD, NORM_KERNELS_BWD = 1, 2
"""A fused norm (TransformerEngine's LayerNorm/RMSNorm in ``TELayerNormColumnParallelLinear``, or Apex's
``FusedLayerNorm`` in the local spec) runs one kernel forward; backward one kernel for dx and the partial
dgamma (dbeta) and one that finalizes the dgamma reduction over the thread blocks."""
RESIDUAL_ADD_ELEMENTS = 3
"""A residual add reads the branch and the residual and writes the sum; in the backward autograd's sum of the
residual stream's two gradients moves the same (read 2, write 1)."""

CROSS_ENTROPY_BYTES_PER_LOGIT_FWD = (BF16 + FP32) + FP32 + (FP32 + FP32) + (FP32 + FP32) + FP32 + (FP32 + FP32)
"""Megatron's vocab-parallel cross entropy, unfused, per logit of the rank's vocabulary shard
(megatron-core 0.16.1 ``tensor_parallel/cross_entropy.py``), forward: cast bf16 -> fp32, max, subtract the
max in place, exp in place, sum, divide in place (the softmax is kept for backward)."""
CROSS_ENTROPY_BYTES_PER_LOGIT_BWD = (FP32 + FP32) + (FP32 + BF16)
"""Backward: the softmax becomes the gradient in place (subtracting the one-hot target touches one logit per
token), scaled by the loss gradient in place, and autograd casts it to bf16."""
CROSS_ENTROPY_BYTES_PER_LOGIT = CROSS_ENTROPY_BYTES_PER_LOGIT_FWD + CROSS_ENTROPY_BYTES_PER_LOGIT_BWD
CROSS_ENTROPY_KERNELS_FWD = 6 + 12
"""Kernels ``_VocabParallelCrossEntropy.forward`` launches (megatron-core 0.16.1; the tensor-parallel
all-reduces are collectives, not counted): over the logits ``float()``, ``max``, the in-place subtract,
``exp``, ``sum``, ``div_`` (6); over the tokens the target mask (``<``, ``>=``, ``|``), ``clone`` and the
subtract of the masked target, its masked fill, ``arange``, the gather of the predicted logits and its
``clone``, their masked fill, ``log`` and the loss subtract (12)."""
CROSS_ENTROPY_KERNELS_BWD = 3 + 3
"""Kernels of its backward: ``arange``, ``target_mask.float()`` and ``1.0 - ...`` over the tokens (3); the
indexed subtract of the one-hot target, ``mul_`` by the loss gradient and autograd's cast to bf16 (3)."""
CROSS_ENTROPY_FUSION_IMPLS = ("native", "te")
"""Megatron's --cross-entropy-fusion-impl choices (with --cross-entropy-loss-fusion; 'native' its default)."""
FUSED_CROSS_ENTROPY = {
    # (bytes per logit forward, backward; kernels forward, backward)
    "native": ((BF16 + FP32) + (FP32 + FP32) + (FP32 + FP32), (FP32 + FP32) + (FP32 + BF16), 4, 2),
    "te": ((BF16 + BF16 + FP32), (FP32 + FP32) + (FP32 + BF16), 2, 2),
    "te-bf16": ((BF16 + BF16 + BF16), (BF16 + BF16), 2, 1),
}
"""--cross-entropy-loss-fusion by --cross-entropy-fusion-impl. 'native' (megatron-core 0.16.1
``fusions/fused_cross_entropy.py``: the same steps in three jit-fused functions): forward the fp32 copy of the logits
with their max (read bf16, write fp32), the shifted exp in place with its sum and the predicted logit (read and
write fp32), the division in place (read and write fp32); backward the in-place product with the loss gradient and
the bf16 cast in one function (read fp32, write it back and the bf16 gradient). 'te' (TransformerEngine's triton
``parallel_cross_entropy``): forward an online-softmax pass and a pass that writes the fp32 gradient of the logits
(read bf16 twice, write fp32); backward the in-place scaling by the loss gradient (read and write fp32) and autograd's
cast to the logits' bf16. 'te-bf16' (TransformerEngine before 2.18, :mod:`h3t_ext.costmodel.te_version`): the same
passes writing the gradient in place into the bf16 logits; backward the in-place scaling in bf16, no cast.

What each keeps for the backward (:data:`CROSS_ENTROPY_SAVED_BYTES`) and what lives beside it while the forward runs
(:data:`CROSS_ENTROPY_LOGITS_TRANSIENT`)."""
CROSS_ENTROPY_SAVED_BYTES = {None: FP32, "native": FP32, "te": FP32, "te-bf16": BF16}
"""Bytes a logit the cross entropy saves for its backward, by implementation (None: unfused): the fp32 softmax, TE's
fp32 gradient, or (TE before 2.18) the bf16 logits holding their gradient."""
CROSS_ENTROPY_LOGITS_TRANSIENT = {None: BF16, "native": BF16, "te": BF16, "te-bf16": 0}
"""Bytes a logit of the bf16 logits alive next to the saved tensor while the cross entropy runs (and of their bf16
gradient next to it in the backward): none where the saved tensor is the logits themselves."""


UNFUSED_GLU_ELEMENTS = (7, 13)
"""Elements per token, in units of f, megatron-core 0.16+'s op-by-op SwiGLU ``silu(gate) * (linear + offset)``
moves (forward, backward): silu reads and writes f (2), the offset's add too (2), the product reads 2f and writes f
(3); backward each of the product's two gradients reads dy and the other factor and writes one (6), the add passes
dy through, silu's backward reads x and its gradient and writes one (3), and the chunk's backward (a cat) copies
the two halves into FC1's 2f gradient (4). The legacy model's SwiGLU is timed as the fused one
(:data:`LEGACY_GLU_TIMED_AS_FUSED`)."""
UNFUSED_GLU_KERNELS = (3, 4)
"""Its kernels (forward; backward: the product's two gradients, silu's and the chunk's backward) where the fused one
runs one each way."""


def activation_elements(fc1_width: int, ffn_hidden_size: int, *, backward: bool, impl: str = "fused") -> int:
    """Elements per token of the activation. Fused (Megatron's bias-SwiGLU / bias-GeLU): forward reads FC1's
    output (``fc1_width``: 2f with SwiGLU) and writes FC2's input (f); backward reads its saved input and dy
    and writes FC1's gradient. megatron-core's SwiGLU run op by op (``impl`` 'unfused',
    :func:`h3t_ext.costmodel.activations.mlp_activation_impl`): :data:`UNFUSED_GLU_ELEMENTS`."""
    if _op_by_op_glu(fc1_width, ffn_hidden_size, impl):
        return UNFUSED_GLU_ELEMENTS[backward] * ffn_hidden_size
    return (2 * fc1_width + ffn_hidden_size) if backward else (fc1_width + ffn_hidden_size)


def activation_extra_kernels(fc1_width: int, ffn_hidden_size: int, *, backward: bool, impl: str = "fused") -> int:
    """Kernels the activation launches beyond the fused one's (:data:`UNFUSED_GLU_KERNELS`)."""
    return UNFUSED_GLU_KERNELS[backward] - 1 if _op_by_op_glu(fc1_width, ffn_hidden_size, impl) else 0


def _op_by_op_glu(fc1_width: int, ffn_hidden_size: int, impl: str) -> bool:
    """A SwiGLU (FC1 2f wide) that runs megatron-core's op-by-op path (``impl`` 'unfused')."""
    return impl == "unfused" and fc1_width == 2 * ffn_hidden_size


def norm_seconds(tokens: int, width: int, r: KernelRates, *, backward: bool) -> float:
    """One fused norm (LayerNorm or RMSNorm: the same traffic) over ``tokens`` x ``width`` bf16 elements."""
    if backward:
        return elementwise_seconds(BF16 * NORM_ELEMENTS_BWD * width * tokens, r, kernels=NORM_KERNELS_BWD)
    return elementwise_seconds(BF16 * NORM_ELEMENTS_FWD * width * tokens, r, kernels=NORM_KERNELS_FWD)


def residual_add_seconds(tokens: int, width: int, r: KernelRates) -> float:
    """One residual add (or the backward's gradient sum) over ``tokens`` x ``width`` bf16 elements."""
    return elementwise_seconds(BF16 * RESIDUAL_ADD_ELEMENTS * width * tokens, r)


def activation_seconds(tokens: int, fc1_width: int, ffn_hidden_size: int, r: KernelRates, *,
                       backward: bool) -> float:
    """The fused activation kernel over ``tokens`` (:func:`activation_elements`)."""
    return elementwise_seconds(BF16 * activation_elements(fc1_width, ffn_hidden_size, backward=backward) * tokens, r)


def cross_entropy_seconds(tokens: int, vocab_shard: int, r: KernelRates, *, backward: bool,
                          fusion: Optional[str] = None) -> float:
    """Megatron's vocab-parallel cross entropy over ``tokens`` x ``vocab_shard`` logits, forward or backward;
    ``fusion``: the --cross-entropy-fusion-impl of a run with --cross-entropy-loss-fusion (:data:`FUSED_CROSS_ENTROPY`),
    None without it."""
    logits = tokens * vocab_shard
    if fusion is not None:
        fwd_bytes, bwd_bytes, fwd_kernels, bwd_kernels = FUSED_CROSS_ENTROPY[fusion]
        return elementwise_seconds(logits * (bwd_bytes if backward else fwd_bytes), r,
                                   kernels=bwd_kernels if backward else fwd_kernels)
    if backward:
        return elementwise_seconds(logits * CROSS_ENTROPY_BYTES_PER_LOGIT_BWD, r, kernels=CROSS_ENTROPY_KERNELS_BWD)
    return elementwise_seconds(logits * CROSS_ENTROPY_BYTES_PER_LOGIT_FWD, r, kernels=CROSS_ENTROPY_KERNELS_FWD)


LEGACY_GLU_TIMED_AS_FUSED = True
"""The legacy model's eager SwiGLU (``F.silu(x[0]) * x[1]``, the ATC '24 runs) is timed as the fused kernel: it saves
one more f-wide tensor (measured: Figure 7's ckpt=no peaks, priced in ``activations``), but the ATC '24 step times the
efficiencies are fitted on do not show its extra traffic. Pricing it (5f / 13f elements forward / backward, +2.3% of
a 65B layer at t = 2, +4.5% of a 7B layer at t = 1) and refitting moved every efficiency and made the held-out checks
worse (Korthikanti's held-out MAE 2.8% -> 4.2%, the 7B demo's H800 rows 2 points slower, the published ATC '24
layouts in the search's top 3 on 11 of 15 rows instead of 12): measured time wins over the kernel count here."""


def timed_activation_impl(impl: str) -> str:
    """The SwiGLU the time model prices for a run whose SwiGLU is ``impl``
    (:func:`h3t_ext.costmodel.activations.mlp_activation_impl`; :data:`LEGACY_GLU_TIMED_AS_FUSED`)."""
    return "fused" if impl == "legacy" and LEGACY_GLU_TIMED_AS_FUSED else impl


def layer_elementwise_bytes(model, plan, impl: str = "fused") -> tuple[float, float, float, float]:
    """Bytes one layer's element-wise kernels move for one microbatch: (forward, backward, recomputed by
    ckpt=ours, hidden-dropout masks: written in the forward, read once in the backward).

    Per kernel, in elements of the tokens it runs on (the norms and residual adds on T / t with sequence
    parallelism, the rest on the rank's T x width / t):

    * forward: two norms read x, write y (2 h); two bias-dropout-adds read the branch and the residual and
      write the sum (3 h); RoPE (Llama) reads and writes q and k; the activation reads the FC1 output and
      writes its input to FC2 (fc1 + f; a SwiGLU run op by op moves more: ``UNFUSED_GLU_ELEMENTS``,
      and ckpt=ours recomputes it as the forward ran it);
    * backward: two norm backwards read x and dy, write dx (3 h); the residual stream is read by the norm
      and by the add, so autograd adds the two gradients (read 2 h, write h); with hidden dropout each
      dropout backward reads dy and writes its gradient (2 h; without dropout the add passes dy through);
      RoPE rotates dq and dk; the activation backward reads its saved input and dy and writes the FC1
      gradient (2 fc1 + f), and with linear biases autograd reduces that gradient into FC1's bias (fc1;
      megatron-core's bias-GeLU / bias-SwiGLU functions return the full-size gradient for the bias);
    * with --qk-layernorm, the q and k norms as the two norms, over the rank's q + h_kv channels of every token
      (their output goes to RoPE and attention, which save their own inputs: nothing to recompute).

    ``impl``: the SwiGLU priced (:func:`timed_activation_impl`)."""
    t = plan.tensor_model_parallel_size
    tokens = plan.micro_batch_size * plan.seq_length // plan.context_parallel_size
    norm_tokens = tokens // t if plan.sequence_parallel else tokens
    h, hkv, f, fc1 = model.hidden_size, model.kv_hidden_size, model.dense_ffn_hidden_size, model.fc1_width
    dropout = model.hidden_dropout > 0
    norms_fwd, norms_bwd = 2 * NORM_ELEMENTS_FWD * h * norm_tokens, 2 * NORM_ELEMENTS_BWD * h * norm_tokens
    residual_fwd = 2 * RESIDUAL_ADD_ELEMENTS * h * norm_tokens
    residual_bwd = 2 * RESIDUAL_ADD_ELEMENTS * h * norm_tokens + (2 * 2 * h * norm_tokens if dropout else 0)
    rope = 2 * (model.query_hidden_size + hkv) * tokens // t if model.rotates_qk else 0
    qk = (model.query_hidden_size + hkv) * tokens // t if model.qk_layernorm else 0  # the q and k norms' channels
    act_fwd = activation_elements(fc1, f, backward=False, impl=impl) * tokens // t
    act_bwd = activation_elements(fc1, f, backward=True, impl=impl) * tokens // t
    if model.add_bias_linear:  # the fused bias-activation's bias gradient, reduced over the tokens by autograd
        act_bwd += fc1 * tokens // t
    # hidden dropout: the two fused bias-dropout-adds also write their 1-byte masks
    masks = 2 * h * norm_tokens * BOOL if dropout else 0
    return (BF16 * (norms_fwd + NORM_ELEMENTS_FWD * qk + residual_fwd + rope + act_fwd),
            BF16 * (norms_bwd + NORM_ELEMENTS_BWD * qk + residual_bwd + rope + act_bwd),
            BF16 * (norms_fwd + act_fwd), masks)
