"""Llama model chunks from megatron-core's GPTModel, built with the h3t layer spec of ``--ckpt``.

The spec (``h3t_ext.runtime.layer_specs``) uses TransformerEngine's modules when TE is importable
on a GPU (backend 'te'), else megatron-core's local modules with h3t-ext's SDPA core attention and
sequence-parallel-capable norms and linears (backend 'local'), and with context parallelism on
CPU the ring attention of ``h3t_ext.runtime.ring_attention``. One chunk per virtual pipeline stage;
weights come from the generators seeded by :func:`~megatron.training.initialize.set_random_seed`
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


def layer_spec_backend(on_gpu: bool) -> str:
    """'te' on a GPU with TransformerEngine importable, else 'local'."""
    if not on_gpu:
        return "local"
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return "local"
    return "te"


def core_attention(args, *, on_gpu: bool):
    """None (the spec's default) except with context parallelism on CPU: the ring attention of
    ``h3t_ext.runtime.ring_attention``, its waits bounded by ``--distributed-timeout-minutes`` (on a
    GPU, TransformerEngine's attention does context parallelism)."""
    if on_gpu or args.context_parallel_size == 1:
        return None
    from megatron.core.transformer.spec_utils import ModuleSpec

    from h3t_ext.runtime.ring_attention import RingSDPACoreAttention
    return ModuleSpec(module=RingSDPACoreAttention, params={"cp_timeout_s": args.distributed_timeout_minutes * 60})


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
                                pipeline_rank=ps.get_pipeline_model_parallel_rank(), ckpt=args.ckpt,
                                backend=layer_spec_backend(on_gpu), core_attention=core_attention(args, on_gpu=on_gpu))
    if on_gpu:
        for chunk in chunks:
            chunk.cuda(torch.cuda.current_device())
    return chunks


def num_parameters(chunks) -> int:
    """Parameters held by this rank."""
    return sum(p.numel() for c in chunks for p in c.parameters())
