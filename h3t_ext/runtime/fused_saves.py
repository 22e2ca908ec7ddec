"""ckpt=no on megatron-core's local layer spec, saving what fused GPU kernels save.

The unfused ops of the local spec save more than the fused kernels the cost model counts
(TransformerEngine/Apex RMSNorm, fused SwiGLU): torch's composite RMSNorm also saves ``x * rstd``
(and its fp32 upcast of ``x`` with half inputs), megatron-core's unfused GLU saves ``silu(gate)``
and ``linear + offset`` besides the FC1 output. On a CPU (or a GPU without those kernels) ckpt=no
would then hold ~1.5x the activation bytes the cost model predicts.

:func:`apply_fused_saves` swaps the RMSNorm modules (the two of every layer and the final one)
and the gated MLPs for classes that run the *same ops in the same order* (so losses and gradients
are bitwise those of the stock modules) but mark those extra intermediates as recomputable from
tensors that are saved anyway (:func:`~h3t_ext.runtime.recompute_ours.mark_recomputable`). Inside
an :class:`~h3t_ext.runtime.activations.ActivationManager` forward scope they are then saved as
recipes and recomputed (one elementwise op) when backward unpacks them: a norm keeps its input and
rstd, the MLP its FC1 output and the FC2 input, as fused kernels do. Outside a manager nothing
changes. Layers of another structure (e.g. TransformerEngine's fused spec), megatron's fused
bias-SwiGLU and norms on CUDA (where ``F.rms_norm`` is a fused kernel) are left as they are.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

from h3t_ext.runtime.recompute_ours import (
    UnsupportedLayerSpecError,
    _transformer_layers,
    _validate_layer,
    mark_recomputable,
)

_HALF = (torch.float16, torch.bfloat16)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def _scale(x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    return (x.to(torch.float32) if x.dtype in _HALF else x).mul(rstd)


def rms_norm_marking(x: torch.Tensor, weight, shape: tuple, eps) -> torch.Tensor:
    """torch's composite ``F.rms_norm``, op for op (half inputs computed in fp32), marking
    ``x * rstd`` and the fp32 upcast of a half ``x`` as recomputable from ``x`` and ``rstd``."""
    half = x.dtype in _HALF
    xu = x.to(torch.float32) if half else x
    if half:
        mark_recomputable(xu, _upcast, (x,))
    if eps is None:
        eps = torch.finfo(xu.dtype).eps
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    rstd = torch.rsqrt(xu.pow(2).mean(dims, keepdim=True).add_(eps))
    scaled = xu.mul(rstd)
    if weight is None:
        return scaled.type_as(x)
    mark_recomputable(scaled, _scale, (x, rstd))
    return scaled.mul(weight).type_as(x)


class FusedSavesRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose saved tensors are those of a fused kernel (input and rstd)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_marking(x, self.weight, tuple(self.normalized_shape), self.eps)


def _silu(gate: torch.Tensor) -> torch.Tensor:
    return F.silu(gate)


def _fused_saves_mlp_class(mlp_cls: type) -> type:
    class _FusedSavesMLP(mlp_cls):
        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            if per_token_scale is not None:
                return super().forward(hidden_states, per_token_scale, **kwargs)
            y, bias = self.linear_fc1(hidden_states)
            if bias is not None:
                y = y + bias
            offset = self.config.glu_linear_offset
            gate, linear = torch.chunk(y, 2, dim=-1)  # megatron-core's unfused glu, op for op
            act = F.silu(gate)
            mark_recomputable(act, _silu, (gate,))
            shifted = linear + offset
            mark_recomputable(shifted, lambda lin, o=offset: lin + o, (linear,))
            out, out_bias = self.linear_fc2(act * shifted)
            return out, out_bias

    _FusedSavesMLP.__name__ = f"FusedSaves{mlp_cls.__name__}"
    return _FusedSavesMLP


def _composite_norm(norm) -> bool:
    """A stock ``torch.nn.RMSNorm`` off CUDA (there ``F.rms_norm`` is a fused kernel already)."""
    return type(norm) is torch.nn.RMSNorm and not (norm.weight is not None and norm.weight.is_cuda)


def _final_norms(chunks: Iterable[torch.nn.Module]):
    for chunk in chunks:
        norm = getattr(getattr(chunk, "decoder", None), "final_layernorm", None)
        if _composite_norm(norm):
            yield norm


def apply_fused_saves(model_chunks, *, layers: bool = True) -> int:
    """Make the local spec's norms and gated MLPs save what fused kernels save (see module doc).

    ``layers=False`` changes only the final norm (ckpt=ours has its own lean layers). Returns the
    number of modules changed; unsupported layers (another spec) are skipped.
    """
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    changed = 0
    for norm in _final_norms(chunks):
        norm.__class__ = FusedSavesRMSNorm
        changed += 1
    if not layers:
        return changed
    for i, layer in enumerate(_transformer_layers(chunks)):
        try:
            _validate_layer(layer, i)
        except UnsupportedLayerSpecError:
            continue
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            if _composite_norm(getattr(layer, name)):
                getattr(layer, name).__class__ = FusedSavesRMSNorm
                changed += 1
        if layer.config.bias_activation_fusion:  # megatron's fused SwiGLU already saves only its input
            continue
        if not getattr(layer.mlp, "_h3t_fused_saves", False) and not getattr(layer.mlp, "_h3t_ours", False):
            layer.mlp.__class__ = _fused_saves_mlp_class(type(layer.mlp))
            layer.mlp._h3t_fused_saves = True
            changed += 1
    return changed


__all__ = ["FusedSavesRMSNorm", "apply_fused_saves", "rms_norm_marking"]
