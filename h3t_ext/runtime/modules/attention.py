"""Core attention of the h3t local layer spec: :class:`SDPACoreAttention` over
``torch.nn.functional.scaled_dot_product_attention`` (the stock ``DotProductAttention`` takes a CUDA
buffer from the global memory buffer)."""
from __future__ import annotations

import math
from typing import Optional

import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPACoreAttention(MegatronModule):
    """Causal core attention over ``scaled_dot_product_attention``; GQA through ``enable_gqa``.

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

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert packed_seq_params is None and attention_bias is None
        groups = query.size(2) // key.size(2)
        # [s, b, n, d] -> [b, n, s, d]
        # value is a view of the fused QKV GEMM output; saving it would keep that whole buffer alive
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value.contiguous()))
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if causal else attention_mask,
            dropout_p=self.dropout_p if self.training else 0.0, is_causal=causal, scale=self.softmax_scale,
            enable_gqa=groups > 1,  # K/V stay h_kv wide (as flash attention saves them), no repeat
        )
        s, b = out.size(2), out.size(0)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


__all__ = ["SDPACoreAttention"]
