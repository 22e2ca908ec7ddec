"""Byte rules of the element-wise kernels the time model counts, one kernel at a time: the norms, the residual
adds, the activation function and the vocabulary-parallel cross entropy. ``timing.py`` sums them per layer
(``_elementwise_bytes``) and prices the sum with ``kernels.elementwise_seconds``; the per-kernel functions here
price one kernel the same way (the GPU check, ``scripts/gpu/ground_truth.py``, measures them one by one).

Elements are counted per element of the tensor the kernel runs on (a token's ``width`` values), in bf16.
"""
from __future__ import annotations

from h3t_ext.costmodel.kernels import KernelRates, elementwise_seconds
from h3t_ext.dtypes import BF16, FP32

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


UNFUSED_GLU_ELEMENTS = {"unfused": (7, 13)}
"""Elements per token, in units of f, megatron-core 0.16+'s op-by-op SwiGLU ``silu(gate) * (linear + offset)``
moves (forward, backward): silu reads and writes f (2), the offset's add too (2), the product reads 2f and writes f
(3); backward each of the product's two gradients reads dy and the other factor and writes one (6), the add passes
dy through, silu's backward reads x and its gradient and writes one (3), and the chunk's backward (a cat) copies
the two halves into FC1's 2f gradient (4). The legacy model's SwiGLU is timed as the fused one
(``timing.LEGACY_GLU_TIMED_AS_FUSED``)."""
UNFUSED_GLU_KERNELS = {"unfused": (3, 4)}
"""Its kernels (forward; backward: the product's two gradients, silu's and the chunk's backward) where the fused one
runs one each way."""


def activation_elements(fc1_width: int, ffn_hidden_size: int, *, backward: bool, impl: str = "fused") -> int:
    """Elements per token of the activation. Fused (Megatron's bias-SwiGLU / bias-GeLU): forward reads FC1's
    output (``fc1_width``: 2f with SwiGLU) and writes FC2's input (f); backward reads its saved input and dy
    and writes FC1's gradient. megatron-core's SwiGLU run op by op (``impl`` 'unfused',
    :func:`h3t_ext.costmodel.activations.mlp_activation_impl`): :data:`UNFUSED_GLU_ELEMENTS`."""
    if impl == "unfused" and fc1_width == 2 * ffn_hidden_size:
        return UNFUSED_GLU_ELEMENTS[impl][1 if backward else 0] * ffn_hidden_size
    return (2 * fc1_width + ffn_hidden_size) if backward else (fc1_width + ffn_hidden_size)


def activation_extra_kernels(fc1_width: int, ffn_hidden_size: int, *, backward: bool, impl: str = "fused") -> int:
    """Kernels the activation launches beyond the fused one's (:data:`UNFUSED_GLU_KERNELS`)."""
    if impl == "unfused" and fc1_width == 2 * ffn_hidden_size:
        return UNFUSED_GLU_KERNELS[impl][1 if backward else 0] - 1
    return 0


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


def cross_entropy_seconds(tokens: int, vocab_shard: int, r: KernelRates, *, backward: bool) -> float:
    """Megatron's vocab-parallel cross entropy over ``tokens`` x ``vocab_shard`` logits, forward or backward."""
    logits = tokens * vocab_shard
    if backward:
        return elementwise_seconds(logits * CROSS_ENTROPY_BYTES_PER_LOGIT_BWD, r, kernels=CROSS_ENTROPY_KERNELS_BWD)
    return elementwise_seconds(logits * CROSS_ENTROPY_BYTES_PER_LOGIT_FWD, r, kernels=CROSS_ENTROPY_KERNELS_FWD)
