"""megatron-core GPTModel construction that runs on CPU as well as on GPU.

On a GPU with TransformerEngine importable, callers may use TE's layer spec. Everywhere else
this module gives megatron-core's local layer spec with the stock core attention replaced by
:class:`SDPACoreAttention`, which calls ``torch.nn.functional.scaled_dot_product_attention``
(the stock ``DotProductAttention`` takes a CUDA buffer from the global memory buffer).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
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


class _HostRotaryEmbedding(RotaryEmbedding):
    """RoPE that keeps its frequencies on the device they are on.

    megatron-core's ``get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` when it
    is on the CPU, which fails on a machine without CUDA; its ``forward`` takes this
    context-parallel rank's two chunks of the positions through a pinned CUDA index, so
    ``forward`` does the same selection on the host (Megatron's 2c layout, as the data).
    """

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        from h3t_ext.runtime.ring_attention import shard_sequence

        emb = self.get_emb(max_seq_len, offset)
        group = cp_group if cp_group is not None else self.cp_group
        if group is not None and group.size() > 1 and not packed_seq:
            emb = shard_sequence(emb, 0, group.rank(), group.size())
        return emb

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]


def _keep_rope_on_host(model: GPTModel) -> None:
    rope = getattr(model, "rotary_pos_emb", None)
    if isinstance(rope, RotaryEmbedding) and not torch.cuda.is_available():
        rope.__class__ = _HostRotaryEmbedding


def local_layer_spec() -> ModuleSpec:
    """megatron-core's local layer spec (RMSNorm) with :class:`SDPACoreAttention`."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def build_gpt_model(
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    layer_spec: Optional[ModuleSpec] = None,
    pg_collection=None,
) -> GPTModel:
    """A Llama-style GPTModel (RoPE, untied embeddings) for one pipeline (virtual) stage."""
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec or local_layer_spec(),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
    _keep_rope_on_host(model)
    return model


def build_stage_chunks(
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    pipeline_rank: int,
    layer_spec: Optional[ModuleSpec] = None,
) -> list[GPTModel]:
    """Pipeline rank ``pipeline_rank``'s model chunks in virtual-stage order (sizes from ``config``):
    the embedding on rank 0's first chunk, the output layer on the last rank's last chunk."""
    p = config.pipeline_model_parallel_size
    v = config.virtual_pipeline_model_parallel_size or 1
    assert 0 <= pipeline_rank < p, (pipeline_rank, p)
    return [
        build_gpt_model(
            config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
            pre_process=pipeline_rank == 0 and c == 0, post_process=pipeline_rank == p - 1 and c == v - 1,
            vp_stage=c if v > 1 else None, layer_spec=layer_spec,
        )
        for c in range(v)
    ]


def tiny_llama_config(**overrides) -> TransformerConfig:
    """A small float32 CPU-friendly Llama config (GQA, SwiGLU, RMSNorm, no biases, dropout 0)."""
    kw = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        pipeline_dtype=torch.float32,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)
