"""Core attention of the h3t local layer spec: :class:`SDPACoreAttention` over
``torch.nn.functional.scaled_dot_product_attention`` (the stock ``DotProductAttention`` takes a CUDA
buffer from the global memory buffer), causal, or causal within a sliding window on the layers
``--window-size`` / ``--window-attn-skip-freq`` window (:mod:`h3t_ext.attention_window`).

A windowed layer on CPU runs the flash kernel behind CPU ``scaled_dot_product_attention`` with an additive band
mask, through :class:`_WindowedFlashCPU`, which saves what a flash kernel with a window saves (q, k, v, the output
and the log-sum-exp) and builds the mask again in its backward: no s x s tensor outlives the call, so the saved
bytes are the causal layer's. Elsewhere (a GPU without TransformerEngine, attention dropout) it is
``scaled_dot_product_attention`` with the boolean band as ``attn_mask``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from h3t_ext.attention_window import is_windowed, window_from_config

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def band_allowed(s: int, window: int, device) -> torch.Tensor:
    """[s, s] booleans: query i may attend to key j when i - window <= j <= i."""
    i = torch.arange(s, device=device)
    offset = i[:, None] - i[None, :]
    return (offset >= 0) & (offset <= window)


def _band_bias(s: int, window: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The band as the additive mask the CPU flash kernel takes (0 inside, -inf outside, the inputs' dtype)."""
    return torch.zeros(s, s, dtype=dtype, device=device).masked_fill_(~band_allowed(s, window, device), float("-inf"))


class _WindowedFlashCPU(torch.autograd.Function):
    """Causal attention within a left window on CPU: q [b, n, s, d], k/v [b, groups, s, d] -> [b, n, s, d]."""

    @staticmethod
    def forward(ctx, q, k, v, window: int, scale: float):
        bias = _band_bias(q.size(2), window, q.dtype, q.device)
        out, lse = _flash(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.window, ctx.scale = window, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        bias = _band_bias(q.size(2), ctx.window, q.dtype, q.device)
        gq, gk, gv = _flash_backward(grad_out.contiguous(), q, k, v, out, lse, 0.0, False, attn_mask=bias,
                                     scale=ctx.scale)
        return gq, gk, gv, None, None


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, *, scale: float,
                       dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of q [b, n, s, d] over k/v [b, groups, s, d] within a left window of ``window`` tokens."""
    if q.device.type == "cpu" and dropout_p == 0.0:
        return _WindowedFlashCPU.apply(q, k, v, window, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band_allowed(q.size(2), window, q.device),
                                          dropout_p=dropout_p, scale=scale, enable_gqa=q.size(1) != k.size(1))


class SDPACoreAttention(MegatronModule):
    """Causal core attention over ``scaled_dot_product_attention``; GQA through ``enable_gqa``; a sliding window
    on the layers the config's ``window_size`` / ``window_attn_skip_freq`` window (megatron-core's rule).

    Inputs are Megatron's ``[s, b, heads, head_dim]``; the output is ``[s, b, heads*head_dim]``
    of this tensor-parallel rank's heads. Context parallelism is not supported here.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support --context-parallel-size > 1")
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        left, freq = window_from_config(config)
        self.window: Optional[int] = left if is_windowed(left, freq, layer_number) else None
        """The left window of this layer (``layer_number`` counts from 1 over the whole model), None: full causal."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert packed_seq_params is None and attention_bias is None
        groups = query.size(2) // key.size(2)
        # [s, b, n, d] -> [b, n, s, d]
        # value is a view of the fused QKV GEMM output; saving it would keep that whole buffer alive
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value.contiguous()))
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        dropout_p = self.dropout_p if self.training else 0.0
        if causal and self.window is not None and self.window + 1 < q.size(2):
            out = windowed_attention(q, k, v, self.window, scale=self.softmax_scale, dropout_p=dropout_p)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if causal else attention_mask,
                dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale,
                enable_gqa=groups > 1,  # K/V stay h_kv wide (as flash attention saves them), no repeat
            )
        s, b = out.size(2), out.size(0)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


__all__ = ["SDPACoreAttention", "band_allowed", "windowed_attention"]
