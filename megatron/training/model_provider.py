"""Llama model chunks from megatron-core's GPTModel.

TransformerEngine's layer spec when TE is importable on a GPU, else megatron-core's local spec
with h3t-ext's SDPA core attention (``h3t_ext.runtime.gpt``), or its ring attention with context
parallelism (``h3t_ext.runtime.ring_attention``). One chunk per virtual pipeline stage; weights
come from the generators seeded by :func:`~megatron.training.initialize.set_random_seed`
(``--seed + 100 * pipeline rank``, as Megatron seeds), so every data-parallel replica starts identical.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.transformer.transformer_config import TransformerConfig

from h3t_ext.runtime.gpt import build_stage_chunks, tiny_llama_config
from megatron.training.initialize import set_random_seed
from megatron.training.tokenizer import padded_vocab_size


def _te_layer_spec():
    """TE's layer spec on a GPU with TransformerEngine, else None."""
    if not torch.cuda.is_available():
        return None
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    except ImportError:
        return None
    return get_gpt_layer_with_transformer_engine_spec()


def _cpu_layer_spec(context_parallel_size: int):
    """The default local spec (None) at c = 1; with context parallelism its core attention is the
    ring attention of ``h3t_ext.runtime.ring_attention``."""
    if context_parallel_size == 1:
        return None
    from h3t_ext.runtime.gpt import local_layer_spec
    from h3t_ext.runtime.ring_attention import RingSDPACoreAttention
    spec = local_layer_spec()
    spec.submodules.self_attention.submodules.core_attention = RingSDPACoreAttention
    return spec


def transformer_config(args, *, on_gpu: bool) -> TransformerConfig:
    """Megatron's TransformerConfig of the run (Llama: RMSNorm, SwiGLU, RoPE, no biases)."""
    dtype = torch.bfloat16 if (args.bf16 and on_gpu) else torch.float32
    common = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        init_method_std=args.init_method_std,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
    )
    if not on_gpu:
        return tiny_llama_config(**common)
    return TransformerConfig(
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=True, apply_rope_fusion=False, **common)


def build_model_chunks(args, *, on_gpu: bool, vocab_size: int) -> list[torch.nn.Module]:
    """This rank's model chunks, in virtual-stage order."""
    config = transformer_config(args, on_gpu=on_gpu)
    set_random_seed(args.seed, on_gpu=on_gpu)
    padded = padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    chunks = build_stage_chunks(config, vocab_size=padded, max_sequence_length=args.max_position_embeddings,
                                pipeline_rank=ps.get_pipeline_model_parallel_rank(),
                                layer_spec=_te_layer_spec() if on_gpu else _cpu_layer_spec(args.context_parallel_size))
    if on_gpu:
        for chunk in chunks:
            chunk.cuda(torch.cuda.current_device())
    return chunks


def num_parameters(chunks) -> int:
    """Parameters held by this rank."""
    return sum(p.numel() for c in chunks for p in c.parameters())
