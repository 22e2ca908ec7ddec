"""GPT model chunks (GPT-3 or Llama shapes, as the flags say) from megatron-core's GPTModel, built with the h3t layer spec of ``--ckpt``.

The spec (``h3t_ext.runtime.modules.layer_specs``) uses TransformerEngine's modules when TE is importable
on a GPU (backend 'te'), else megatron-core's local modules with h3t-ext's SDPA core attention and
sequence-parallel-capable norms and linears (backend 'local'), and with context parallelism on
CPU the ring attention of ``h3t_ext.runtime.modules.ring_attention``. One chunk per virtual pipeline stage;
weights come from the generators seeded by :func:`~h3t_training.loop.initialize.set_random_seed`
(``--seed + 100 * pipeline rank``, as Megatron seeds), so every data-parallel replica starts identical (with
--data-parallel-random-init each replica seeds its own generators and takes the first replica's weights).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.activations import squared_relu
from megatron.core.transformer.transformer_config import TransformerConfig

from h3t_ext.attention_window import megatron_window_fields
from h3t_ext.runtime.modules.gpt import build_stage_chunks, tiny_llama_config
from h3t_training.config import feature_checks
from h3t_training.config.megatron_fields import spec_backend, transformer_fields
from h3t_training.config.run_spec import compute_dtype, window_left
from h3t_training.errors import ArgumentError
from h3t_training.loop.initialize import set_random_seed
from h3t_training.data.tokenizer import padded_vocab_size


def layer_spec_backend(on_gpu: bool) -> str:
    """'te' on a GPU with TransformerEngine importable, else 'local' (Megatron's own loop; the driver's run takes
    ``--transformer-impl`` too: :func:`~h3t_training.config.megatron_fields.spec_backend`)."""
    return "te" if on_gpu and feature_checks.transformer_engine_available() else "local"


def core_attention(args, *, on_gpu: bool):
    """None (the spec's default) except with context parallelism on CPU: the ring attention of
    ``h3t_ext.runtime.modules.ring_attention``, its waits bounded by ``--distributed-timeout-minutes`` (on a
    GPU, TransformerEngine's attention does context parallelism)."""
    if on_gpu or args.context_parallel_size == 1:
        return None
    from megatron.core.transformer.spec_utils import ModuleSpec

    from h3t_ext.runtime.modules.ring_attention import RingSDPACoreAttention
    return ModuleSpec(module=RingSDPACoreAttention, params={"cp_timeout_s": args.distributed_timeout_minutes * 60})


def transformer_config(args, *, on_gpu: bool) -> TransformerConfig:
    """Megatron's TransformerConfig of the run: the architecture Megatron's flags describe (norm, MLP,
    biases, head dim, ...) with the parallel layout and dtype; on a GPU also the fields of the table flags a GPU
    run implements (FP8, fusions, attention backend: :func:`~h3t_training.config.megatron_fields.transformer_fields`)."""
    if on_gpu and args.h3t_float64:
        raise ArgumentError("--h3t-float64 is for CPU equivalence checks only (a GPU runs float64 GEMMs at a "
                            "fraction of its bf16 rate); drop it, or train on CPU with --distributed-backend gloo")
    dtype = getattr(torch, compute_dtype(args, on_gpu=on_gpu))
    common = dict(
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else squared_relu if args.squared_relu else F.gelu,
        glu_linear_offset=args.glu_linear_offset,
        add_bias_linear=not args.disable_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        kv_channels=args.kv_channels,
        qk_layernorm=args.qk_layernorm,
        **megatron_window_fields(window_left(args), args.window_attn_skip_freq),
        calculate_per_token_loss=args.calculate_per_token_loss,
        rotary_interleaved=args.rotary_interleaved,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        init_method_std=args.init_method_std,
        embedding_init_method_std=args.embedding_init_method_std,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=args.pipeline_model_parallel_layout,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
    )
    if not on_gpu:
        return tiny_llama_config(**common)
    try:
        fields = transformer_fields(args)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    return TransformerConfig(**fields, **common)


def build_model_chunks(args, *, on_gpu: bool, vocab_size: int) -> list[torch.nn.Module]:
    """This rank's model chunks, in virtual-stage order."""
    config = transformer_config(args, on_gpu=on_gpu)
    set_random_seed(args.seed, on_gpu=on_gpu, data_parallel_random_init=args.data_parallel_random_init)
    padded = padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    chunks = build_stage_chunks(config, vocab_size=padded, max_sequence_length=args.max_position_embeddings,
                                pipeline_rank=ps.get_pipeline_model_parallel_rank(), ckpt=args.ckpt,
                                recompute=args.recompute,
                                position_embedding_type=args.position_embedding_type,
                                share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                                rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                                rope_scaling=args.use_rope_scaling, rope_scaling_factor=args.rope_scaling_factor,
                                seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
                                backend=spec_backend(args, on_gpu=on_gpu), core_attention=core_attention(args, on_gpu=on_gpu),
                                device_type="cuda" if on_gpu else "cpu")
    if on_gpu:
        for chunk in chunks:
            chunk.cuda(torch.cuda.current_device())
            cast_to_params_dtype(chunk, config.params_dtype)
    if args.data_parallel_random_init:
        broadcast_from_first_replica(chunks)
    return chunks


def cast_to_params_dtype(chunk: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point parameter and buffer of ``chunk`` in ``dtype`` (bf16 or fp16), as Megatron-LM's
    ``get_model`` has them through ``Float16Module`` (``module.bfloat16()`` / ``.half()``). megatron-core's layers
    create their weights in ``params_dtype``, but the modules torch builds (the learned position embedding,
    ``torch.nn.Embedding``, and the local spec's ``torch.nn`` norms) in float32: a GPT embedding summed in float32
    reached the first bf16 GEMM as float32 (an H200 run stopped there, 2026-11-30)."""
    if dtype in (torch.bfloat16, torch.float16):
        chunk.to(dtype=dtype)


def broadcast_from_first_replica(chunks) -> None:
    """--data-parallel-random-init: every replica takes the first data-parallel rank's weights, as Megatron-LM's
    ``get_model`` has megatron-core's DDP ``broadcast_params`` them (over the data- and context-parallel group); the
    replicas' generators keep their own seeds."""
    group = ps.get_data_parallel_group(with_context_parallel=True)
    if torch.distributed.get_world_size(group) == 1:
        return
    src = torch.distributed.get_global_rank(group, 0)
    for chunk in chunks:
        for p in chunk.parameters():
            torch.distributed.broadcast(p.data, src=src, group=group)


def num_parameters(chunks) -> int:
    """Parameters held by this rank."""
    return sum(p.numel() for c in chunks for p in c.parameters())
