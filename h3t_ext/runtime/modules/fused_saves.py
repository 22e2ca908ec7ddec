"""ckpt=no (and the final norm of every ckpt) on the local layer spec, saving what fused kernels save.

The unfused ops of the local spec save more than the fused kernels the cost model counts
(TransformerEngine/Apex RMSNorm, fused SwiGLU): torch's composite RMSNorm also saves ``x * rstd``
(and its fp32 upcast of ``x`` with half inputs), megatron-core's unfused GLU saves ``silu(gate)``
and ``linear + offset`` besides the FC1 output. On a CPU (or a GPU without those kernels) ckpt=no
would then hold ~1.5x the activation bytes the cost model predicts.

:class:`FusedSavesRMSNorm` and :class:`FusedSavesMLP`, which the h3t layer spec
(:func:`h3t_ext.runtime.modules.layer_specs.h3t_layer_spec` with ``ckpt='no'``, and the final norm of
every h3t block spec) has megatron-core build, run the *same ops in the same order* as the stock
modules (so losses and gradients are bitwise those of the stock modules) but mark those extra
intermediates as recomputable from tensors that are saved anyway (:func:`~h3t_ext.runtime.modules.recompute_ours.mark_recomputable`). Inside
an :class:`~h3t_ext.runtime.memory.activations.ActivationManager` forward scope they are then saved as
recipes and recomputed (one elementwise op) when backward unpacks them: a norm keeps its input and
rstd, the MLP its FC1 output and the FC2 input, as fused kernels do. Outside a manager nothing
changes. megatron's fused bias-SwiGLU (``bias_activation_fusion``) runs as it is.

The norm marks on CUDA too: PyTorch 2.11's ``F.rms_norm`` under autograd is the composite there as well (the H200's
ckpt=no steps, second lease, held 11.7 bytes per token and hidden element per layer above the cost model, ~6 per
norm: the fp32 upcast of ``x`` and the 16-bit ``x * rstd``; ckpt=ours, whose norms keep their input only, matched).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from h3t_ext.runtime.modules.layer_mlp import LayerMLPArgs
from h3t_ext.runtime.modules.norms import RMSNorm
from h3t_ext.runtime.modules.recompute_ours import mark_recomputable

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


class FusedSavesRMSNorm(RMSNorm):
    """RMSNorm whose saved tensors are those of a fused kernel (input and rstd), on every device."""

    h3t_ckpt = "no"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_marking(x, self.gamma(), tuple(self.normalized_shape), self.eps)


def _silu(gate: torch.Tensor) -> torch.Tensor:
    return F.silu(gate)


class FusedSavesMLP(LayerMLPArgs, MLP):
    """megatron-core's MLP whose unfused SwiGLU marks ``silu(gate)`` and ``linear + offset`` recomputable."""

    h3t_ckpt = "no"

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        cfg = self.config
        if (per_token_scale is not None or cfg.bias_activation_fusion or cfg.use_te_activation_func
                or not cfg.gated_linear_unit or cfg.activation_func_clamp_value is not None):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        y, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            y = y + bias
        offset = cfg.glu_linear_offset
        gate, linear = torch.chunk(y, 2, dim=-1)  # megatron-core's unfused glu, op for op
        act = cfg.activation_func(gate)
        if cfg.activation_func is F.silu:
            mark_recomputable(act, _silu, (gate,))
        shifted = linear + offset
        mark_recomputable(shifted, lambda lin, o=offset: lin + o, (linear,))
        return self.linear_fc2(act * shifted)


__all__ = ["FusedSavesMLP", "FusedSavesRMSNorm", "rms_norm_marking"]
