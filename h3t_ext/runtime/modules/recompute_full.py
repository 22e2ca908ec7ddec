"""``ckpt=full``: every transformer layer is recomputed from its input in the backward pass.

A device-agnostic replacement for megatron-core's CUDA-only full recompute. :func:`apply_full_recompute`
wraps the ``forward`` of each ``TransformerLayer`` of the given model chunks: the forward runs
without building a graph and keeps only the layer input; the backward restores the random number
generator states of the forward (the CPU generator; on CUDA also the device generator and
Megatron's CUDA RNG tracker states, so dropout draws the same masks), reruns the layer with a
graph, back-propagates through it and puts the generators back as they were.

While the layer is rerun inside the backward, the activation manager must not offload what the
rerun saves: the ``suspend`` callable given to :func:`apply_full_recompute` returns a context in
which the manager's hooks do nothing (``ActivationManager.suspended``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterable, Optional

import torch

from ..config import RuntimeConfigError

_MARK = "_h3t_full_recompute"
Suspend = Callable[[], ContextManager]


class FullRecomputeError(RuntimeConfigError):
    """A model that ``ckpt=full`` cannot transform; the message is one line."""


def _capture_rng(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["cuda"] = torch.cuda.get_rng_state(device)
        state["tracker"] = get_cuda_rng_tracker().get_states()
    return state


def _restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.cuda.set_rng_state(state["cuda"], device)
        get_cuda_rng_tracker().set_states(state["tracker"])


class _RecomputeLayer(torch.autograd.Function):
    """Run ``run(x)`` without a graph; in backward, rerun it with the forward's RNG states."""

    @staticmethod
    def forward(ctx, run: Callable, suspend: Suspend, device: torch.device, x: torch.Tensor):
        ctx.run, ctx.suspend, ctx.device = run, suspend, device
        ctx.rng = _capture_rng(device)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(ctx.needs_input_grad[3])
        after = _capture_rng(ctx.device)
        _restore_rng(ctx.rng, ctx.device)
        try:
            with torch.enable_grad(), ctx.suspend():
                out = ctx.run(x)
        finally:
            _restore_rng(after, ctx.device)
        if out.requires_grad:
            torch.autograd.backward(out, grad_out)
        return None, None, None, x.grad if ctx.needs_input_grad[3] else None


def _wrap(layer: torch.nn.Module, suspend: Suspend) -> None:
    original = layer.forward
    device = next(layer.parameters()).device

    def forward(*args, **kwargs):
        if args:
            hidden, args = args[0], args[1:]
        else:
            hidden = kwargs.pop("hidden_states")
        if not torch.is_grad_enabled() or not isinstance(hidden, torch.Tensor):
            return original(hidden, *args, **kwargs)
        if kwargs.get("context") is not None or kwargs.get("inference_context") is not None:
            raise FullRecomputeError("--ckpt full supports self-attention training layers only (got a context input)")
        extra: list = []

        def run(h):
            out = original(h, *args, **kwargs)
            extra[:] = [out[1] if isinstance(out, tuple) else None]
            return out[0] if isinstance(out, tuple) else out

        out = _RecomputeLayer.apply(run, suspend, device, hidden)
        return out, extra[0] if extra else kwargs.get("context")

    layer.forward = forward
    setattr(layer, _MARK, original)


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for m in model.modules() if isinstance(m, TransformerLayer)]


def _validate(model: torch.nn.Module) -> None:
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "recompute_granularity", None) is not None:
        raise FullRecomputeError(
            f"--ckpt full replaces Megatron's recompute; unset --recompute-granularity (got {cfg.recompute_granularity!r})"
        )


def apply_full_recompute(model_chunks: Iterable[torch.nn.Module], suspend: Optional[Suspend] = None) -> int:
    """Make every TransformerLayer of ``model_chunks`` recompute itself in backward; returns how many.

    Idempotent: layers already wrapped are left alone. ``suspend`` gives the context in which
    saved-tensor hooks of the activation manager are off (default: none).
    """
    suspend = suspend or contextlib.nullcontext
    n = 0
    for model in model_chunks:
        _validate(model)
        for layer in _layers(model):
            if not hasattr(layer, _MARK):
                _wrap(layer, suspend)
                n += 1
    return n


def remove_full_recompute(model_chunks: Iterable[torch.nn.Module]) -> None:
    """Undo :func:`apply_full_recompute`."""
    for model in model_chunks:
        for layer in _layers(model):
            if hasattr(layer, _MARK):
                del layer.forward
                delattr(layer, _MARK)


def is_full_recompute(model: torch.nn.Module) -> bool:
    """True when the layers of ``model`` recompute themselves."""
    return any(hasattr(layer, _MARK) for layer in _layers(model))


__all__ = ["FullRecomputeError", "apply_full_recompute", "is_full_recompute", "remove_full_recompute"]
