"""Model FLOPs utilisation with the convention of the published tables (DESIGN.md)."""
from __future__ import annotations

from h3t_ext.costmodel.specs import ModelSpec


def model_flops_per_token(model: ModelSpec, seq_length: int) -> float:
    """3 * [2 L (2h q + 2h h_kv + k h f) + 4 q L P / s + 2 V h]: forward+backward FLOPs per token, q the query width
    (heads x kv_channels, h unless --kv-channels says otherwise), k = 3 for a SwiGLU MLP (FC1 2f wide, FC2) and 2
    for GeLU (:attr:`ModelSpec.active_params_per_layer`: with --num-experts, the MLP is the shared expert and k
    routed experts of width f_e, as Megatron-LM's ``num_floating_point_operations`` counts them, router excluded), P
    the score pairs of an average layer's head (causal attention
    counted as half of s^2, so 4 q L P / s = 2 s q L; a sliding window's layers count its band:
    :meth:`ModelSpec.attended_pairs_per_layer`), unpadded vocabulary, no recompute. The one FLOPs formula: the
    planner's MFU and the training driver's logged MFU both come from here."""
    h, L = model.hidden_size, model.num_layers
    attention = 4 * model.query_hidden_size * L * model.attended_pairs_per_layer(seq_length) / seq_length
    return 3.0 * (2 * L * model.active_params_per_layer + attention + 2 * model.vocab_size * h)


def mfu(model: ModelSpec, seq_length: int, tokens_per_second_per_gpu: float, peak_flops: float) -> float:
    """MFU from per-GPU throughput."""
    return tokens_per_second_per_gpu * model_flops_per_token(model, seq_length) / peak_flops
