"""megatron-core layer specs (``ModuleSpec``) of h3t-ext: the recompute mode is chosen by the spec.

:func:`h3t_layer_spec` returns a TransformerLayer spec whose norm and MLP submodules save what
``ckpt`` needs; megatron-core builds them (no module of a live model is changed afterwards):

============  ===============================================  =========================================
ckpt          local backend (CPU, or GPU without TE)           te backend (GPU, TransformerEngine)
============  ===============================================  =========================================
no, full      :class:`FusedSavesRMSNorm`, :class:`FusedSavesMLP`  megatron-core's TE spec (fused
              (save what fused kernels save)                   layernorm-linear, TE core attention)
ours          :class:`OursRMSNorm`, :class:`OursMLP`           :class:`OursTENorm` + TEColumnParallelLinear
                                                               (separate norm, its output recomputed),
                                                               :class:`OursMLP` with TE linears
============  ===============================================  =========================================

Every layer is an :class:`~h3t_ext.runtime.modules.layer_boundary.H3TTransformerLayer`: megatron-core's
TransformerLayer, which tells the activation manager where its forward starts (layer-granular offload at
pipeline size 1). Megatron's recompute (``recompute``, a :class:`~h3t_ext.ckpt.Recompute`; ckpt=full is full,
uniform, 1 layer on the layers of ``no``) is built in too (:mod:`h3t_ext.runtime.modules.recompute`): full
recompute makes the layers of a unit :class:`~h3t_ext.runtime.modules.recompute.RecomputedLayer` (one spec per
layer, from :meth:`Recompute.units`), selective ``core_attn`` / ``mlp`` wrap the core attention / MLP class,
selective ``layernorm`` takes the norms of ckpt=ours (on the te backend the norms are fused into the linears,
megatron-core's ``IdentityOp``, so there is nothing to recompute, as in megatron-core). The local backend's linears are :class:`SPColumnParallelLinear` /
:class:`SPRowParallelLinear` (megatron-core's, with a sequence-parallel path that runs on CPU) and
its norms carry Megatron's ``sequence_parallel`` parameter attribute, so the spec works with
``--sequence-parallel``. The core attention is a parameter (default: :class:`SDPACoreAttention` on
the local backend, TE's on the te backend), so a context-parallel attention can be plugged in.

:func:`h3t_block_spec` adds the block's final norm (a fused-saves norm on the local backend) and
:func:`built_for_ckpt` tells, from the modules of built model chunks, which ckpt they were built for.
TransformerEngine is imported only when a te spec is built.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Optional

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from h3t_ext.ckpt import NO_RECOMPUTE, Recompute, split_ckpt
from h3t_ext.attention_window import WindowFlagError, window_from_config

from ..config import CKPT_CHOICES, RuntimeConfigError
from .attention import SDPACoreAttention
from .fused_saves import FusedSavesMLP, FusedSavesRMSNorm
from .layer_boundary import H3TTransformerLayer
from .layer_mlp import replace_mlp_class
from .norms import LayerNorm
from .recompute import RecomputedLayer, is_recomputed, recomputed_module
from .recompute_ours import OursLayerNorm, OursMLP, OursRMSNorm, OursTENorm, UnsupportedLayerSpecError, validate_ours_config
from .sequence_parallel import SPColumnParallelLinear, SPRowParallelLinear, mark_sequence_parallel

BACKENDS = ("local", "te")


def _check_choice(ckpt: str, backend: str) -> None:
    if ckpt not in CKPT_CHOICES:
        raise RuntimeConfigError(f"--ckpt must be one of {{{','.join(CKPT_CHOICES)}}}, got {ckpt!r}")
    if backend not in BACKENDS:
        raise RuntimeConfigError(f"layer spec backend must be one of {{{','.join(BACKENDS)}}}, got {backend!r}")


class RecomputedRMSNorm(OursRMSNorm):
    """RMSNorm of ``--recompute-modules layernorm`` on a ckpt=no layer: saves its input, its output recomputed."""

    h3t_ckpt = None


class RecomputedLayerNorm(OursLayerNorm):
    """LayerNorm of ``--recompute-modules layernorm`` on a ckpt=no layer: saves its inputs, its output recomputed."""

    h3t_ckpt = None


def _local_norm(config, ckpt: str, recompute_norm: bool = False) -> type:
    if config.normalization == "RMSNorm":
        return OursRMSNorm if ckpt == "ours" else (RecomputedRMSNorm if recompute_norm else FusedSavesRMSNorm)
    if config.normalization == "LayerNorm":
        return OursLayerNorm if ckpt == "ours" else (RecomputedLayerNorm if recompute_norm else LayerNorm)
    raise UnsupportedLayerSpecError(f"--normalization {config.normalization} is not supported by the h3t local "
                                    "layer spec; use RMSNorm or LayerNorm")


class _SummedOverHeads:
    """The q or k norm of ``--qk-layernorm`` (over each head's d channels). The heads are split over the
    tensor-parallel ranks and the weight is shared by all of them, so its gradient is summed over the tensor-parallel
    group whether or not the sequence is: the weight carries Megatron's ``sequence_parallel`` mark (the CPU
    optimizer's reduction; on a GPU megatron-core's ``finalize_model_grads`` reduces q/k norms by name)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(config, hidden_size, eps)
        mark_sequence_parallel(self, True)


class QKRMSNorm(_SummedOverHeads, FusedSavesRMSNorm):
    """The q/k RMSNorm: saves its input and rstd, as a fused kernel does, under every ckpt (its output goes to RoPE
    and attention, which keep their own inputs)."""

    h3t_ckpt = None


class QKLayerNorm(_SummedOverHeads, LayerNorm):
    """The q/k LayerNorm."""


def _qk_norm(config, te_norm: Optional[type] = None) -> type:
    """The q and k norms' class of ``config`` (``IdentityOp`` without --qk-layernorm; ``te_norm`` on te). Another
    --normalization than RMSNorm or LayerNorm is refused by the layer's own norm (:func:`_local_norm`)."""
    if not config.qk_layernorm:
        return IdentityOp
    if te_norm is not None:
        return te_norm
    return QKRMSNorm if config.normalization == "RMSNorm" else QKLayerNorm


def _te_modules():
    try:
        from megatron.core.extensions import transformer_engine as te_ext  # noqa: PLC0415
    except ImportError as exc:
        te_ext, why = None, str(exc)
    else:
        why = "transformer_engine is not importable"
    if te_ext is None or not te_ext.HAVE_TE:
        raise UnsupportedLayerSpecError(f"the te layer spec needs TransformerEngine ({why}); use backend 'local'")
    return te_ext


def _layer(norm, attention: ModuleSpec, mlp: ModuleSpec, keys_map: Optional[dict] = None) -> ModuleSpec:
    return ModuleSpec(module=H3TTransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=attention, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=norm, mlp=mlp, mlp_bda=get_bias_dropout_add, sharded_state_dict_keys_map=keys_map or {}))


def _attention(linear_qkv, core_attention, linear_proj, qk_norm: type = IdentityOp) -> ModuleSpec:
    return ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=SelfAttentionSubmodules(linear_qkv=linear_qkv, core_attention=core_attention,
                                                         linear_proj=linear_proj, q_layernorm=qk_norm,
                                                         k_layernorm=qk_norm))


def _base_and_recompute(ckpt: str, recompute: Recompute) -> tuple[str, Recompute]:
    try:
        base, recompute = split_ckpt(ckpt, recompute)
    except ValueError as exc:
        raise RuntimeConfigError(str(exc)) from None
    return base.value, recompute


def h3t_layer_spec(config, *, ckpt: str = "no", backend: str = "local", core_attention: Optional[type] = None,
                   recompute: Recompute = NO_RECOMPUTE) -> ModuleSpec:
    """The TransformerLayer spec of ``ckpt`` for ``backend`` ('local' or 'te') and ``config``, with the selective
    ``recompute`` modules built in (full recompute is per layer: :func:`h3t_block_spec`; ckpt 'full' here gives
    a one-layer unit).

    Raises :class:`UnsupportedLayerSpecError` (one line) when ``config`` cannot run ``ckpt``
    (ckpt=ours needs RMSNorm or LayerNorm, a dense SwiGLU or GeLU MLP and no Megatron recompute in its config).
    """
    _check_choice(ckpt, backend)
    base, recompute = _base_and_recompute(ckpt, recompute)
    spec = _selective_layer_spec(config, base, backend, core_attention, recompute)
    if recompute.full:
        spec = dataclasses.replace(spec, module=RecomputedLayer, params={**spec.params, "h3t_unit": (0, 1)})
    return spec


UNBUILT_FEATURES = (
    ("num_moe_experts", "--num-experts (MoE layers)"),
    ("multi_latent_attention", "--multi-latent-attention (MLA)"),
    ("mtp_num_layers", "--mtp-num-layers (multi-token prediction)"),
    ("experimental_attention_variant", "--experimental-attention-variant"),
    ("heterogeneous_block_specs", "heterogeneous layer configs"),
    ("is_hybrid_model", "a hybrid (Mamba) model"),
    ("qk_l2_norm", "--qk-l2-norm"),
)
"""TransformerConfig fields (of megatron-core 0.16-0.19; an absent field is off) that this spec does not build: a
config with one set would be trained as a dense GPT decoder without it."""


def validate_spec_config(config, backend: str) -> None:
    """Raise :class:`UnsupportedLayerSpecError` (one line) when ``config`` asks for a layer this spec does not build,
    whatever the ckpt: the driver refuses those flags before, Megatron-LM's own loop (megatron_native) hands its
    TransformerConfig here. The local core attention is causal softmax attention, within a sliding window where the
    config has one (:mod:`h3t_ext.attention_window`: a causal left window, one pattern entry per layer); no
    off-by-one or learnable softmax (TransformerEngine's attention, backend 'te', takes it)."""
    for field, what in UNBUILT_FEATURES:
        if getattr(config, field, None):
            raise UnsupportedLayerSpecError(f"h3t-ext's layer spec does not build {what}; leave it out or train it "
                                            f"with megatron-core's own spec")
    try:
        window_from_config(config)
    except WindowFlagError as e:
        raise UnsupportedLayerSpecError(str(e)) from None
    if backend == "local":
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise UnsupportedLayerSpecError(f"--softmax-type {config.softmax_type} needs TransformerEngine's attention; "
                                            f"the local spec's softmax is the vanilla one")


def _selective_layer_spec(config, ckpt: str, backend: str, core_attention: Optional[type],
                          recompute: Recompute) -> ModuleSpec:
    validate_spec_config(config, backend)
    if ckpt == "ours":
        validate_ours_config(config)
    if backend == "local":
        if core_attention is None:
            core_attention = SDPACoreAttention
        if recompute.recomputes("core_attn"):
            core_attention = recomputed_module(core_attention)
        mlp_cls = OursMLP if ckpt == "ours" else (FusedSavesMLP if config.normalization == "RMSNorm" else MLP)
        if recompute.recomputes("mlp"):
            mlp_cls = recomputed_module(mlp_cls)
        mlp = ModuleSpec(module=mlp_cls, params={"ffn_hidden_size": config.ffn_hidden_size},
                         submodules=MLPSubmodules(linear_fc1=SPColumnParallelLinear, linear_fc2=SPRowParallelLinear))
        attention = _attention(SPColumnParallelLinear, core_attention, SPRowParallelLinear, _qk_norm(config))
        return _layer(_local_norm(config, ckpt, recompute.recomputes("layernorm")), attention, mlp, keys_map={
            "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"})
    te = _te_modules()
    core_attention = core_attention or te.TEDotProductAttention
    if recompute.recomputes("core_attn"):
        core_attention = recomputed_module(core_attention)
    if ckpt != "ours":  # TE's fused layernorm-linear saves what the cost model counts
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec  # noqa

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=bool(config.qk_layernorm))
        spec.submodules.self_attention.submodules.core_attention = core_attention
        if recompute.recomputes("mlp"):
            spec.submodules.mlp = replace_mlp_class(spec.submodules.mlp, recomputed_module)
        spec.module = H3TTransformerLayer  # says where its forward starts (layer-granular offload)
        return spec
    # ckpt=ours: the norm is separate so that its output can be recomputed instead of saved
    mlp_cls = recomputed_module(OursMLP) if recompute.recomputes("mlp") else OursMLP
    mlp = ModuleSpec(module=mlp_cls, params={"ffn_hidden_size": config.ffn_hidden_size},
                     submodules=MLPSubmodules(linear_fc1=te.TEColumnParallelLinear, linear_fc2=te.TERowParallelLinear))
    attention = _attention(te.TEColumnParallelLinear, core_attention, te.TERowParallelLinear,
                           _qk_norm(config, te.TENorm))
    return _layer(OursTENorm, attention, mlp)


def final_norm_spec(config, *, backend: str = "local") -> type:
    """The block's final norm: a fused-saves RMSNorm (or LayerNorm) locally, TE's norm on te."""
    _check_choice("no", backend)
    if backend == "te":
        return _te_modules().TENorm
    return _local_norm(config, "no")


def h3t_block_spec(config, *, ckpt: str = "no", backend: str = "local", core_attention: Optional[type] = None,
                   layer_spec: Optional[ModuleSpec] = None, vp_stage: Optional[int] = None,
                   pp_rank: Optional[int] = None, recompute: Recompute = NO_RECOMPUTE) -> TransformerBlockSubmodules:
    """The decoder block of one (virtual) pipeline stage: its layers and, on the last stage, the final
    norm. ``layer_spec`` overrides the layers (the final norm stays h3t's). With full ``recompute`` (or ckpt
    'full') the layers of each unit of :meth:`Recompute.units` are :class:`RecomputedLayer` s at their place
    in it; RuntimeConfigError (one line) for a ``uniform`` number of layers that does not divide the chunk's."""
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    final = final_norm_spec(config, backend=backend)
    if layer_spec is not None:
        return TransformerBlockSubmodules(layer_specs=[layer_spec] * n, layer_norm=final)
    _check_choice(ckpt, backend)
    base, recompute = _base_and_recompute(ckpt, recompute)
    layer = _selective_layer_spec(config, base, backend, core_attention, recompute)
    layers = [layer] * n
    try:
        units = recompute.units(n)
    except ValueError as exc:
        raise RuntimeConfigError(str(exc)) from None
    for start, end in units:
        for i in range(start, end):
            layers[i] = dataclasses.replace(layer, module=RecomputedLayer,
                                            params={**layer.params, "h3t_unit": (i - start, end - start)})
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final)


# --------------------------------------------------------------------------- what a built model is for
class _QuietUnknownMLP(logging.Filter):
    """megatron-core 0.16's TransformerLayer warns "Unknown MLP type" for every layer whose MLP module
    is not exactly ``MLP`` (our MLP subclasses are), then builds it with its default TP group, which
    is the group the stock MLP gets too. The warning says nothing actionable, so it is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unknown MLP type")


logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_QuietUnknownMLP())

_LAYER_PARTS = ("input_layernorm", "pre_mlp_layernorm", "mlp")


def _layers(chunks: Iterable[torch.nn.Module]):
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, TransformerLayer):
                yield m


def built_for_ckpt(chunks: Iterable[torch.nn.Module]) -> Optional[str]:
    """'ours' when every transformer layer of ``chunks`` was built by the ckpt=ours spec, 'no' when
    none was (h3t's ckpt=no spec or any other spec), None without layers. Raises :class:`UnsupportedLayerSpecError`
    naming the first part that is not ckpt=ours in a model that is partly ours."""
    parts = [(i, name, getattr(layer, name, None)) for i, layer in enumerate(_layers(chunks)) for name in _LAYER_PARTS]
    ours = [getattr(m, "h3t_ckpt", None) == "ours" for _, _, m in parts]
    if not parts:
        return None
    if not any(ours):
        return "no"
    if all(ours):
        return "ours"
    i, name, m = parts[ours.index(False)]
    raise UnsupportedLayerSpecError(
        f"transformer layer {i}: {name} is {type(m).__name__}, not built by h3t_layer_spec(ckpt='ours') like the "
        "rest of the model")


def check_built_for(chunks: Iterable[torch.nn.Module], ckpt: str) -> None:
    """Raise :class:`RuntimeConfigError` (one line) when ``chunks`` were not built for ``ckpt``."""
    chunks = list(chunks)
    try:
        built = built_for_ckpt(chunks)
    except UnsupportedLayerSpecError as exc:
        raise UnsupportedLayerSpecError(f"--ckpt {ckpt}: {exc}") from None
    want = "ours" if ckpt == "ours" else "no"
    if ckpt == "full" and not all(is_recomputed(layer) for layer in _layers(chunks)):
        raise RuntimeConfigError(
            "--ckpt full: the model was not built with the full-recompute layer spec; build it with "
            "h3t_block_spec(config, ckpt='full') (build_gpt_model(..., ckpt='full'))")
    if built in (None, want):
        return
    if want == "ours":
        parts = next((layer for layer in _layers(chunks)), None)
        what = "" if parts is None else f" (input_layernorm is {type(parts.input_layernorm).__name__})"
        raise UnsupportedLayerSpecError(
            f"--ckpt ours: the model was not built with the ckpt=ours layer spec{what}; build it with "
            "h3t_ext.runtime.modules.layer_specs.h3t_layer_spec(config, ckpt='ours') (build_gpt_model(..., ckpt='ours'))")
    raise RuntimeConfigError(
        f"--ckpt {ckpt}: the model was built with the ckpt=ours layer spec; build it with "
        f"h3t_layer_spec(config, ckpt='{ckpt}') (build_gpt_model(..., ckpt='{ckpt}'))")


__all__ = ["BACKENDS", "QKLayerNorm", "QKRMSNorm", "RecomputedLayerNorm", "RecomputedRMSNorm", "built_for_ckpt", "check_built_for", "final_norm_spec", "h3t_block_spec", "h3t_layer_spec"]
