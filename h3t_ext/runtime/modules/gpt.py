"""megatron-core GPTModel construction that runs on CPU as well as on GPU.

The layers come from the h3t layer spec (:mod:`h3t_ext.runtime.modules.layer_specs`) of the chosen
``ckpt`` and backend ('te' on a GPU with TransformerEngine, else 'local', whose core attention is
:class:`SDPACoreAttention`: it calls ``torch.nn.functional.scaled_dot_product_attention``, where
the stock ``DotProductAttention`` takes a CUDA buffer from the global memory buffer).

:class:`H3TGPTModel` is megatron-core's GPTModel that, on a host without CUDA, keeps RoPE
frequencies on the host and runs the sequence-parallel scatter of the embedding and the gather of
the output layer with :mod:`h3t_ext.runtime.modules.sequence_parallel` (megatron-core's allocate CUDA buffers),
and copies a tied embedding from the first to the last pipeline stage over the embedding group where the
weight is (megatron-core moves it to CUDA first).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from h3t_ext.ckpt import NO_RECOMPUTE, Recompute

from .attention import SDPACoreAttention
from .layer_specs import h3t_block_spec


class HostRotaryEmbedding(RotaryEmbedding):
    """RoPE that keeps its frequencies on the device they are on.

    megatron-core's ``get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` when it
    is on the CPU, which fails on a machine without CUDA; its ``forward`` takes this
    context-parallel rank's two chunks of the positions through a pinned CUDA index, so
    ``forward`` does the same selection on the host (Megatron's 2c layout, as the data).
    """

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        from h3t_ext.runtime.modules.ring_attention import shard_sequence

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


class H3TGPTModel(GPTModel):
    """megatron-core's GPTModel that runs without CUDA (RoPE, sequence-parallel embedding and output).

    Takes GPTModel's arguments and ``device_type``, where the model runs ('cpu' or 'cuda'; passed in, never
    probed). On 'cpu' the RoPE module is a :class:`HostRotaryEmbedding`
    (built from the same arguments) and, under sequence parallelism, the embedding output is
    scattered to this rank's sequence shard by :func:`scatter_to_sequence_parallel` and the output
    layer is an :class:`SPColumnParallelLinear` that takes over the stock layer's weight.
    """

    def __init__(self, config: TransformerConfig, *args, rotary_percent: float = 1.0, rotary_base: int = 10000,
                 rope_scaling: bool = False, rope_scaling_factor: float = 8.0,
                 seq_len_interpolation_factor: Optional[float] = None, device_type: str, **kwargs):
        from .sequence_parallel import ensure_host_rng_tracker, host_sequence_parallel  # noqa: PLC0415

        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
        host_sp = host_sequence_parallel(config, device_type)
        if host_sp:
            kwargs["scatter_embedding_sequence_parallel"] = False  # scattered in _preprocess instead
            ensure_host_rng_tracker()
        super().__init__(config, *args, rotary_percent=rotary_percent, rotary_base=rotary_base,
                         rope_scaling=rope_scaling, rope_scaling_factor=rope_scaling_factor,
                         seq_len_interpolation_factor=seq_len_interpolation_factor, **kwargs)
        self._h3t_host_sp = host_sp
        if isinstance(getattr(self, "rotary_pos_emb", None), RotaryEmbedding) and device_type == "cpu":
            self.rotary_pos_emb = HostRotaryEmbedding(
                kv_channels=self.config.kv_channels, rotary_percent=rotary_percent,
                rotary_interleaved=self.config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor, rotary_base=rotary_base,
                rope_scaling=rope_scaling, rope_scaling_factor=rope_scaling_factor,
                use_cpu_initialization=self.config.use_cpu_initialization, cp_group=self.pg_collection.cp)
        if self._h3t_host_sp and self.post_process:
            self.output_layer = self._host_output_layer(self.output_layer)

    def setup_embeddings_and_output_layer(self) -> None:
        """megatron-core's setup, whose first-to-last-stage copy of a tied embedding (an all-reduce over the
        embedding group of the first stage's weight and the last stage's zeros) moves the weight to CUDA first:
        a weight on the host is all-reduced where it is (gloo), one on a GPU as megatron-core does."""
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if weight is None or weight.is_cuda:
            return super().setup_embeddings_and_output_layer()
        group, self.embd_group = self.embd_group, None  # megatron-core skips its CUDA all-reduce without a group
        try:
            super().setup_embeddings_and_output_layer()
        finally:
            self.embd_group = group
        if torch.distributed.is_initialized() and self.config.pipeline_model_parallel_size > 1 \
                and self._is_in_embd_group():
            torch.distributed.all_reduce(weight.data, group=group)

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """megatron-core's loss, except that float64 logits keep float64 through the cross entropy
        (megatron-core's casts them to float32; see :mod:`h3t_ext.runtime.modules.cross_entropy`)."""
        if logits.dtype != torch.float64:
            return super().compute_language_model_loss(labels, logits)
        from .cross_entropy import vocab_parallel_cross_entropy  # noqa: PLC0415

        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), self.pg_collection.tp)
        return loss.transpose(0, 1).contiguous()

    def _host_output_layer(self, stock: ColumnParallelLinear) -> ColumnParallelLinear:
        from .sequence_parallel import SPColumnParallelLinear  # noqa: PLC0415

        layer = SPColumnParallelLinear(
            self.config.hidden_size, self.vocab_size, config=self.config, init_method=self.config.init_method,
            bias=False, skip_bias_add=False, gather_output=stock.gather_output,
            skip_weight_param_allocation=True,
            embedding_activation_buffer=self.embedding_activation_buffer, grad_output_buffer=self.grad_output_buffer,
            tp_group=self.pg_collection.tp)
        if stock.weight is not None:  # the stock layer's initialised weight (no second draw from the RNG)
            layer.weight = stock.weight
        return layer

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        if self._h3t_host_sp and decoder_input is None and self.pre_process:
            from .sequence_parallel import scatter_to_sequence_parallel  # noqa: PLC0415

            tp = self.pg_collection.tp
            decoder_input = scatter_to_sequence_parallel(
                self.embedding(input_ids=input_ids, position_ids=position_ids), tp)
            if padding_mask is not None:
                padding_mask = scatter_to_sequence_parallel(padding_mask.transpose(0, 1), tp).transpose(0, 1)
        return super()._preprocess(input_ids, position_ids, decoder_input=decoder_input,
                                   inference_context=inference_context, packed_seq_params=packed_seq_params,
                                   padding_mask=padding_mask)


def local_layer_spec() -> ModuleSpec:
    """megatron-core's stock local layer spec (RMSNorm) with :class:`SDPACoreAttention` (no h3t modules;
    no sequence parallelism: its norm refuses it)."""
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
    ckpt: str = "no",
    backend: str = "local",
    core_attention: Optional[type] = None,
    layer_spec: Optional[ModuleSpec] = None,
    pipeline_rank: Optional[int] = None,
    pg_collection=None,
    position_embedding_type: str = "rope",
    share_embeddings_and_output_weights: bool = False,
    rotary_percent: float = 1.0,
    rotary_base: int = 10000,
    rope_scaling: bool = False,
    rope_scaling_factor: float = 8.0,
    seq_len_interpolation_factor: Optional[float] = None,
    recompute: Recompute = NO_RECOMPUTE,
    device_type: str,
) -> GPTModel:
    """A GPTModel for one pipeline (virtual) stage; by default Llama-style (RoPE, untied embeddings),
    GPT-3-style with ``position_embedding_type='learned_absolute'`` and tied embeddings.

    Its layers come from ``h3t_layer_spec(config, ckpt=ckpt, backend=backend,
    core_attention=core_attention)`` with Megatron's ``recompute`` built in (:func:`h3t_block_spec`), or from
    ``layer_spec`` when given (then with megatron-core's default final norm); RoPE with Llama 3.x's frequency
    scaling (``rope_scaling``, ``rope_scaling_factor``) and linear position interpolation
    (``seq_len_interpolation_factor``) as megatron-core's RotaryEmbedding applies them; ``device_type`` ('cpu' or 'cuda') is
    where the model runs, given by the caller (never probed); the ckpt=ours spec raises
    UnsupportedLayerSpecError for configs it cannot run.
    """
    spec = layer_spec if layer_spec is not None else h3t_block_spec(
        config, ckpt=ckpt, backend=backend, core_attention=core_attention, vp_stage=vp_stage, pp_rank=pipeline_rank,
        recompute=recompute)
    return H3TGPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=position_embedding_type,
        rotary_percent=rotary_percent,
        rotary_base=rotary_base,
        rope_scaling=rope_scaling,
        rope_scaling_factor=rope_scaling_factor,
        seq_len_interpolation_factor=seq_len_interpolation_factor,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
        device_type=device_type,
    )


def build_stage_chunks(
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    pipeline_rank: int,
    ckpt: str = "no",
    backend: str = "local",
    core_attention: Optional[type] = None,
    layer_spec: Optional[ModuleSpec] = None,
    **model_kwargs,
) -> list[GPTModel]:
    """Pipeline rank ``pipeline_rank``'s model chunks in virtual-stage order (sizes from ``config``):
    the embedding on rank 0's first chunk, the output layer on the last rank's last chunk; layers
    from the h3t layer spec of ``ckpt`` and ``backend`` (see :func:`build_gpt_model`)."""
    p = config.pipeline_model_parallel_size
    v = config.virtual_pipeline_model_parallel_size or 1
    assert 0 <= pipeline_rank < p, (pipeline_rank, p)
    return [
        build_gpt_model(
            config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
            pre_process=pipeline_rank == 0 and c == 0, post_process=pipeline_rank == p - 1 and c == v - 1,
            vp_stage=c if v > 1 else None, ckpt=ckpt, backend=backend, core_attention=core_attention,
            layer_spec=layer_spec, pipeline_rank=pipeline_rank, **model_kwargs,
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


def mean_loss_forward_step(data_iterator, model):
    """A forward step for megatron-core's schedules over a GPTModel and batches of ``tokens``, ``labels`` and
    ``position_ids``: the loss is the mean of the per-token losses, reported as ``lm loss``."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.to(torch.promote_types(output_tensor.dtype, torch.float32)).mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func
