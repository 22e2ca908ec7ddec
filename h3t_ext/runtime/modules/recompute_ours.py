"""ckpt=ours: keep GEMM outputs, recompute the two norm outputs and the SwiGLU output in backward.

The modules here are put into transformer layers by the h3t layer spec
(:func:`h3t_ext.runtime.modules.layer_specs.h3t_layer_spec` with ``ckpt='ours'``); megatron-core builds them:

* :class:`OursRMSNorm` runs an autograd function that saves only its input (its backward
  recomputes the norm with autograd, so gradients are those of the stock module) and marks its
  output as recomputable from that input; :func:`ours_te_norm` does the same around
  TransformerEngine's RMSNorm (GPU);
* :class:`OursMLP` is megatron-core's MLP whose activation (SwiGLU, GeLU, squared ReLU) saves only the
  FC1 output and marks its output (the FC2 input) as recomputable from it.

A marked tensor lives in a weak registry: storage -> (function, inputs that are saved anyway).
When the next GEMM saves it inside an :class:`~h3t_ext.runtime.memory.activations.ActivationManager`
forward scope, the pack hook stores that recipe instead of the tensor and the unpack hook
recomputes it (from inputs that may have been offloaded and reloaded). Outside a manager nothing
changes except the saved-tensor savings of the two lean autograd functions.
"""
from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megatron.core.activations import squared_relu
from megatron.core.transformer.mlp import MLP

from h3t_ext.runtime.config import RuntimeConfigError
from h3t_ext.runtime.modules.layer_mlp import LayerMLPArgs
from h3t_ext.runtime.modules.norms import LayerNorm, RMSNorm


class UnsupportedLayerSpecError(RuntimeConfigError):
    """ckpt=ours cannot be applied to this layer spec; the message says which part and why."""


# --------------------------------------------------------------------------- the weak registry
_REGISTRY: dict[int, tuple] = {}  # storage data_ptr -> (weakref to output, geometry, fn, inputs)


def _geometry(t: torch.Tensor) -> tuple:
    return t.dtype, tuple(t.size()), tuple(t.stride()), t.storage_offset()


def mark_recomputable(output: torch.Tensor, fn: Callable[..., torch.Tensor], inputs: tuple) -> None:
    """Declare that ``fn(*inputs)`` recomputes ``output`` exactly (valid while ``output`` lives)."""
    key = output.untyped_storage().data_ptr()

    def _forget(_ref, key=key) -> None:
        entry = _REGISTRY.get(key)
        if entry is not None and entry[0] is _ref:
            del _REGISTRY[key]

    _REGISTRY[key] = (weakref.ref(output, _forget), _geometry(output), fn, inputs)


def lookup_recipe(t: torch.Tensor) -> Optional[tuple[Callable[..., torch.Tensor], tuple]]:
    """(fn, inputs) when ``t`` is (an alias with the geometry of) a live marked tensor."""
    if not _REGISTRY or t.layout != torch.strided:
        return None
    entry = _REGISTRY.get(t.untyped_storage().data_ptr())
    if entry is None or entry[0]() is None or entry[1] != _geometry(t):
        return None
    return entry[2], entry[3]


# --------------------------------------------------------------------------- lean autograd functions
def _rms_norm(x: torch.Tensor, weight: torch.Tensor, shape: tuple, eps: Optional[float]) -> torch.Tensor:
    return F.rms_norm(x, shape, weight, eps)


class _RMSNormSaveInput(torch.autograd.Function):
    """RMSNorm saving only its input; backward recomputes the stock op with autograd."""

    @staticmethod
    def forward(ctx, x, weight, shape, eps):
        ctx.save_for_backward(x, weight)
        ctx.shape, ctx.eps = shape, eps
        return _rms_norm(x, weight, shape, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gx, gw = _grads_by_recompute(lambda a, w: _rms_norm(a, w, ctx.shape, ctx.eps), (x, weight),
                                     ctx.needs_input_grad[:2], grad)
        return gx, gw, None, None


def _swiglu(y: torch.Tensor, offset: float) -> torch.Tensor:
    gate, linear = torch.chunk(y, 2, dim=-1)  # megatron-core's unfused glu, op for op
    return F.silu(gate) * (linear + offset)


class _SwiGLUSaveInput(torch.autograd.Function):
    """SwiGLU saving only the FC1 output; backward recomputes the stock ops with autograd."""

    @staticmethod
    def forward(ctx, y, offset):
        ctx.save_for_backward(y)
        ctx.offset = offset
        return _swiglu(y, offset)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        (gy,) = _grads_by_recompute(lambda a: _swiglu(a, ctx.offset), (y,), ctx.needs_input_grad[:1], grad)
        return gy, None


class _SaveInputs(torch.autograd.Function):
    """``fn(*inputs)`` saving only ``inputs``; backward recomputes ``fn`` with autograd (LayerNorm, GeLU)."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.save_for_backward(*inputs)
        ctx.fn = fn
        return fn(*inputs)

    @staticmethod
    def backward(ctx, grad):
        return (None, *_grads_by_recompute(ctx.fn, ctx.saved_tensors, ctx.needs_input_grad[1:], grad))


def _grads_by_recompute(fn, inputs, needs, grad):
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(bool(n)) for t, n in zip(inputs, needs)]
        out = fn(*leaves)
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
    return tuple(next(got) if t.requires_grad else None for t in leaves)


# --------------------------------------------------------------------------- spec-time validation
def validate_ours_config(config, where: str = "ckpt=ours") -> None:
    """Raise :class:`UnsupportedLayerSpecError` (one line) when ``config`` cannot run ckpt=ours."""
    if config.normalization not in ("RMSNorm", "LayerNorm"):
        raise UnsupportedLayerSpecError(
            f"{where}: --normalization {config.normalization} is not supported, needs RMSNorm or LayerNorm")
    swiglu = config.gated_linear_unit and config.activation_func is F.silu
    plain = not config.gated_linear_unit and config.activation_func in (F.gelu, squared_relu)
    if not (swiglu or plain):
        raise UnsupportedLayerSpecError(f"{where}: needs a SwiGLU (--swiglu), GeLU or squared-ReLU (--squared-relu) "
                                        f"MLP")
    if getattr(config, "num_moe_experts", None):
        raise UnsupportedLayerSpecError(f"{where}: needs a dense MLP; --num-experts (MoE) is not supported")
    if config.use_te_activation_func or config.activation_func_clamp_value is not None:
        raise UnsupportedLayerSpecError(f"{where}: TE activation functions and clamped GLU are not supported")
    if config.recompute_granularity is not None:
        raise UnsupportedLayerSpecError(
            f"{where}: --recompute-granularity {config.recompute_granularity} cannot be combined with --ckpt ours")


# --------------------------------------------------------------------------- module classes
class OursRMSNorm(RMSNorm):
    """RMSNorm that saves only its input and marks its output recomputable (ckpt=ours)."""

    h3t_ckpt = "ours"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, eps, gamma = tuple(self.normalized_shape), self.eps, self.gamma()
        out = _RMSNormSaveInput.apply(x, gamma, shape, eps)
        mark_recomputable(out, lambda a, w: _rms_norm(a, w, shape, eps), (x, gamma))
        return out


class OursLayerNorm(LayerNorm):
    """LayerNorm that saves only its input (and weight, bias) and marks its output recomputable (ckpt=ours)."""

    h3t_ckpt = "ours"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, eps = tuple(self.normalized_shape), self.eps

        def norm(a, w, b):
            return F.layer_norm(a, shape, w, b, eps)

        inputs = (x, self.gamma(), self.bias)
        out = _SaveInputs.apply(norm, *inputs)
        mark_recomputable(out, norm, inputs)
        return out


class OursMLP(LayerMLPArgs, MLP):
    """megatron-core's dense MLP whose activation (SwiGLU, GeLU or squared ReLU) saves only the FC1 output and marks
    its output (the FC2 input) recomputable (ckpt=ours)."""

    h3t_ckpt = "ours"

    def __init__(self, config, submodules, *args, **kwargs):
        validate_ours_config(config, "ckpt=ours MLP")
        super().__init__(config, submodules, *args, **kwargs)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None:
            raise UnsupportedLayerSpecError("ckpt=ours does not support per-token-scaled (MoE expert) MLPs")
        y, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            y = y + bias
        if not self.config.gated_linear_unit:  # GeLU, squared ReLU: only the activation is recomputed
            fn = self.config.activation_func
            act = _SaveInputs.apply(fn, y)
            mark_recomputable(act, fn, (y,))
            output, out_bias = self.linear_fc2(act)
            return output, out_bias
        offset = float(self.config.glu_linear_offset)
        act = _SwiGLUSaveInput.apply(y, offset)
        mark_recomputable(act, lambda a: _swiglu(a, offset), (y,))
        return self.linear_fc2(act)


_TE_CLASSES: dict = {}


def _ours_te_class(base: type) -> type:
    """A subclass of TransformerEngine's norm ``base`` marking its output recomputable from its input
    (TE's norm saves its input and rstd itself; the output is what the next linear would save)."""
    if base not in _TE_CLASSES:
        class _OursTENorm(base):
            h3t_ckpt = "ours"

            def _recompute(self, x):
                return base.forward(self, x)

            def forward(self, x):
                out = super().forward(x)
                mark_recomputable(out, self._recompute, (x,))
                return out

        _OursTENorm.__name__ = f"Ours{base.__name__}"
        _TE_CLASSES[base] = _OursTENorm
    return _TE_CLASSES[base]


class OursTENorm:
    """Spec entry (like megatron-core's ``TENorm``): TransformerEngine's RMSNorm whose output is
    recomputed (ckpt=ours on the TE backend). TE is imported only when this is built."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5):
        import transformer_engine.pytorch as te  # noqa: PLC0415
        from megatron.core.extensions.transformer_engine import _get_extra_te_kwargs  # noqa: PLC0415

        validate_ours_config(config, "ckpt=ours TE norm")
        base = te.LayerNorm if config.normalization == "LayerNorm" else te.RMSNorm
        return _ours_te_class(base)(
            hidden_size=hidden_size, eps=eps, sequence_parallel=config.sequence_parallel,
            zero_centered_gamma=config.layernorm_zero_centered_gamma, **_get_extra_te_kwargs(config))


__all__ = ["OursLayerNorm", "OursMLP", "OursRMSNorm", "OursTENorm", "UnsupportedLayerSpecError", "lookup_recipe", "mark_recomputable",
           "validate_ours_config"]
