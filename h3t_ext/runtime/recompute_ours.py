"""ckpt=ours on megatron-core's local layer spec: keep GEMM outputs, recompute norms and SwiGLU.

:func:`apply_ckpt_ours` changes, in every transformer layer of the given model chunks,

* the two ``torch.nn.RMSNorm`` modules to an autograd function that saves only its input (its
  backward recomputes the norm with autograd, so gradients are those of the stock module), and
  marks its output as recomputable from that input;
* the gated MLP to one whose SwiGLU saves only the FC1 output and marks its output (the FC2
  input) as recomputable from it.

A marked tensor lives in a weak registry: storage -> (function, inputs that are saved anyway).
When the next GEMM saves it inside an :class:`~h3t_ext.runtime.activations.ActivationManager`
forward scope, the pack hook stores that recipe instead of the tensor and the unpack hook
recomputes it (from inputs that may have been offloaded and reloaded). Outside a manager nothing
changes except the saved-tensor savings of the two lean autograd functions.

With ``discard_outputs=False`` the same lean functions are installed without marking: the model
then saves what fused kernels save (norm input; FC1 output and the FC2 input), which is what the
cost model's ``ckpt='no'`` counts.
"""
from __future__ import annotations

import weakref
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F

from h3t_ext.runtime.config import RuntimeConfigError


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


def _grads_by_recompute(fn, inputs, needs, grad):
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(bool(n)) for t, n in zip(inputs, needs)]
        out = fn(*leaves)
        wanted = [t for t in leaves if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
    return tuple(next(got) if t.requires_grad else None for t in leaves)


# --------------------------------------------------------------------------- module classes
class _OursRMSNorm(torch.nn.RMSNorm):
    _h3t_discard_output = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, eps = tuple(self.normalized_shape), self.eps
        out = _RMSNormSaveInput.apply(x, self.weight, shape, eps)
        if self._h3t_discard_output:
            mark_recomputable(out, lambda a, w: _rms_norm(a, w, shape, eps), (x, self.weight))
        return out


def _ours_mlp_class(mlp_cls: type) -> type:
    class _OursMLP(mlp_cls):
        _h3t_discard_output = True

        def forward(self, hidden_states, per_token_scale=None, **kwargs):
            if per_token_scale is not None:
                raise UnsupportedLayerSpecError("ckpt=ours does not support per-token-scaled (MoE expert) MLPs")
            y, bias = self.linear_fc1(hidden_states)
            if bias is not None:
                y = y + bias
            offset = float(self.config.glu_linear_offset)
            act = _SwiGLUSaveInput.apply(y, offset)
            if self._h3t_discard_output:
                mark_recomputable(act, lambda a: _swiglu(a, offset), (y,))
            return self.linear_fc2(act)

    _OursMLP.__name__ = f"Ours{mlp_cls.__name__}"
    return _OursMLP


# --------------------------------------------------------------------------- validation and transform
def _validate_layer(layer, index: int) -> None:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: PLC0415
    from megatron.core.transformer.mlp import MLP  # noqa: PLC0415

    where = f"ckpt=ours, transformer layer {index}"
    cfg = layer.config
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        norm = getattr(layer, name, None)
        if not isinstance(norm, torch.nn.RMSNorm):
            raise UnsupportedLayerSpecError(
                f"{where}: {name} is {type(norm).__name__}, needs a separate torch.nn.RMSNorm (local layer spec "
                f"with --normalization RMSNorm); fused layernorm-linear (TransformerEngine spec) is not supported")
    attn, mlp = layer.self_attention, layer.mlp
    if type(attn.linear_qkv) is not ColumnParallelLinear:
        raise UnsupportedLayerSpecError(
            f"{where}: linear_qkv is {type(attn.linear_qkv).__name__}, needs megatron-core's ColumnParallelLinear")
    if not isinstance(mlp, MLP) or type(mlp.linear_fc1) is not ColumnParallelLinear \
            or type(mlp.linear_fc2) is not RowParallelLinear:
        raise UnsupportedLayerSpecError(f"{where}: needs a dense MLP with ColumnParallelLinear/RowParallelLinear")
    if not cfg.gated_linear_unit or cfg.activation_func is not F.silu:
        raise UnsupportedLayerSpecError(f"{where}: needs a SwiGLU MLP (gated_linear_unit=True, activation silu)")
    if cfg.use_te_activation_func or cfg.activation_func_clamp_value is not None:
        raise UnsupportedLayerSpecError(f"{where}: TE activation functions and clamped GLU are not supported")
    if cfg.recompute_granularity is not None:
        raise UnsupportedLayerSpecError(
            f"{where}: --recompute-granularity {cfg.recompute_granularity} cannot be combined with --ckpt ours")


def _transformer_layers(model_chunks: Iterable[torch.nn.Module]):
    from megatron.core.transformer.transformer_layer import TransformerLayer  # noqa: PLC0415

    for chunk in model_chunks:
        for m in chunk.modules():
            if isinstance(m, TransformerLayer):
                yield m


def apply_ckpt_ours(model_chunks, *, discard_outputs: bool = True) -> int:
    """Install ckpt=ours into every transformer layer of ``model_chunks`` (a module or a list).

    Returns the number of layers changed. Raises :class:`UnsupportedLayerSpecError` before
    changing anything when a layer does not have the supported structure.
    """
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    layers = list(_transformer_layers(chunks))
    for i, layer in enumerate(layers):
        if not isinstance(layer.input_layernorm, _OursRMSNorm):
            _validate_layer(layer, i)
    for layer in layers:
        for name in ("input_layernorm", "pre_mlp_layernorm"):
            norm = getattr(layer, name)
            norm.__class__ = _OursRMSNorm
            norm._h3t_discard_output = discard_outputs
        if not getattr(layer.mlp, "_h3t_ours", False):
            layer.mlp.__class__ = _ours_mlp_class(type(layer.mlp))
            layer.mlp._h3t_ours = True
        layer.mlp._h3t_discard_output = discard_outputs
    return len(layers)


__all__ = ["UnsupportedLayerSpecError", "apply_ckpt_ours", "lookup_recipe", "mark_recomputable"]
