"""Megatron's activation recompute (``--recompute-granularity full|selective`` with its method, number of layers and
modules, :class:`h3t_ext.ckpt.Recompute`) built into the model by the h3t layer spec; ``--ckpt full`` is full,
uniform, 1 layer. No module of a live model is changed afterwards.

Why not megatron-core's own implementation (the ``TransformerConfig`` fields, which ``TransformerBlock`` /
``TransformerLayer`` / ``Attention`` implement through ``tensor_parallel.checkpoint`` and
``CheckpointWithoutOutput``): both read the CUDA generator's state unconditionally
(``tensor_parallel.random._get_all_rng_states`` calls ``torch.cuda.get_rng_state``), so on a host without CUDA
every one of them raises "Torch not compiled with CUDA enabled". The spec keeps megatron-core's semantics,
module for module, on any device:

* full: :class:`RecomputedLayer` is megatron-core's TransformerLayer whose spec names its place in a *unit* of
  consecutive layers (``h3t_unit=(position, size)``, :meth:`Recompute.units`). The unit's layers run without a
  graph; the last one returns its output through one autograd node that keeps only the unit's input and, in
  backward, reruns the unit's layers with the forward's random generator states (CPU; on CUDA also the device
  generator and Megatron's RNG tracker), back-propagates through them and puts the generators back. This is
  megatron-core's ``_checkpointed_forward`` (``uniform``: units of N layers; ``block``: the first N layers
  alone), unit by unit.
* selective ``core_attn`` / ``mlp``: the core attention or MLP class of the spec is wrapped
  (:func:`recomputed_module`) so that its forward runs under :func:`checkpoint` (keeps the module's tensor
  inputs, reruns it in backward) -- megatron-core's ``Attention._checkpointed_attention_forward`` and
  ``TransformerLayer``'s ``recompute_mlp``.
* selective ``layernorm``: the norms save only their inputs and mark their outputs recomputable (the norms of
  ckpt=ours, :mod:`h3t_ext.runtime.modules.recompute_ours`); the activation manager stores the recipe where the
  next GEMM saves the output -- megatron-core's ``CheckpointWithoutOutput`` around the two norms.

Everything rerun in backward saves its tensors again for that backward (outside the activation manager: it
is suspended, :func:`recording_under`, so nothing recomputed is offloaded or counted); what the forward kept
(a unit's or module's inputs) is what the manager offloads and reloads like any other saved tensor.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..config import RuntimeConfigError
from .layer_boundary import H3TTransformerLayer, layer_starts
from .layer_mlp import with_layer_mlp_args

Suspend = Callable[[], ContextManager]
_SUSPEND: ContextVar[Suspend] = ContextVar("h3t_recompute_suspend", default=contextlib.nullcontext)
_OPEN_UNIT: ContextVar[Optional["_Unit"]] = ContextVar("h3t_recompute_unit", default=None)


class RecomputeError(RuntimeConfigError):
    """A layer that Megatron's recompute cannot run; the message is one line."""


@contextlib.contextmanager
def recording_under(suspend: Suspend) -> Iterator[None]:
    """Forwards run inside rerun their recompute under ``suspend()`` (the activation manager's ``suspended``):
    the manager's hooks leave alone what the rerun saves."""
    token = _SUSPEND.set(suspend)
    try:
        yield
    finally:
        _SUSPEND.reset(token)


# --------------------------------------------------------------------------- random generator states
def capture_rng(device: torch.device) -> dict[str, Any]:
    """The generator states a rerun must start from (CPU; on CUDA the device's and Megatron's tracker's)."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["cuda"] = torch.cuda.get_rng_state(device)
        state["tracker"] = get_cuda_rng_tracker().get_states()
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.cuda.set_rng_state(state["cuda"], device)
        get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})


@contextlib.contextmanager
def _rerun(rng: dict, device: torch.device, suspend: Suspend) -> Iterator[None]:
    after = capture_rng(device)
    restore_rng(rng, device)
    try:
        with torch.enable_grad(), suspend():
            yield
    finally:
        restore_rng(after, device)


def _device_of(tensors) -> torch.device:
    return next((t.device for t in tensors if isinstance(t, torch.Tensor)), torch.device("cpu"))


# --------------------------------------------------------------------------- one module: checkpoint()
class _Call:
    __slots__ = ("run", "args", "where", "rng", "device", "suspend", "structure")

    def __init__(self, run, args, where, device):
        self.run, self.args, self.where, self.device = run, args, where, device
        self.rng, self.suspend, self.structure = capture_rng(device), _SUSPEND.get(), None

    def call(self, tensors) -> Any:
        args = list(self.args)
        for i, t in zip(self.where, tensors):
            args[i] = t
        return self.run(*args)


class _Checkpoint(torch.autograd.Function):
    """``call.run(*args)`` keeping only its tensor arguments; rerun with the forward's generators in backward."""

    @staticmethod
    def forward(ctx, call: _Call, *tensors):
        with torch.no_grad():
            out = call.call(tensors)
        outs = out if isinstance(out, tuple) else (out,)
        call.structure = (isinstance(out, tuple), tuple(isinstance(o, torch.Tensor) for o in outs),
                          tuple(None if isinstance(o, torch.Tensor) else o for o in outs))
        ctx.call = call
        ctx.save_for_backward(*tensors)
        return tuple(o for o in outs if isinstance(o, torch.Tensor))

    @staticmethod
    def backward(ctx, *grads):
        call, saved = ctx.call, ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip(saved, ctx.needs_input_grad[1:])]
        with _rerun(call.rng, call.device, call.suspend):
            out = call.call(inputs)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ctx.call = None
        return (None, *(t.grad if t.requires_grad else None for t in inputs))


def checkpoint(run: Callable, *args):
    """``run(*args)`` that keeps only the tensors among ``args`` for backward and reruns itself there (with the
    forward's random generator states). Plain ``run(*args)`` without grad or without an input needing one."""
    where = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    tensors = [args[i] for i in where]
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return run(*args)
    call = _Call(run, args, where, _device_of(tensors))
    got = iter(_Checkpoint.apply(call, *tensors))
    is_tuple, is_tensor, others = call.structure
    outs = tuple(next(got) if t else o for t, o in zip(is_tensor, others))
    return outs if is_tuple else outs[0]


_WRAPPED: dict[type, type] = {}


def recomputed_module(base: type) -> type:
    """``base`` (a core attention or MLP class of a spec) whose forward runs under :func:`checkpoint` in
    training: megatron-core's selective recompute of ``core_attn`` / ``mlp``."""
    if base not in _WRAPPED:
        def forward(self, *args, **kwargs):
            if not self.training:
                return base.forward(self, *args, **kwargs)
            names = tuple(kwargs)
            return checkpoint(lambda *a: base.forward(self, *a[:len(args)], **dict(zip(names, a[len(args):]))),
                              *args, *kwargs.values())

        _WRAPPED[base] = type(f"Recomputed{base.__name__}", with_layer_mlp_args(base), {
            "forward": forward, "h3t_recomputed": True, "__module__": __name__,
            "__doc__": f"{base.__name__} recomputed in backward (Megatron's selective recompute)."})
    return _WRAPPED[base]


# --------------------------------------------------------------------------- full: units of layers
class _Unit:
    """The layers of one full-recompute unit in one forward: its input, the generators at its start, and how to
    rerun each layer."""

    __slots__ = ("x", "rng", "device", "suspend", "runs", "last_out", "size")

    def __init__(self, x: torch.Tensor, size: int):
        self.x, self.size, self.device = x, size, x.device
        self.rng, self.suspend = capture_rng(x.device), _SUSPEND.get()
        self.runs: list[Callable] = []
        self.last_out: Optional[torch.Tensor] = None


class _UnitRecompute(torch.autograd.Function):
    """The output of a unit (computed without a graph) keeping only the unit's input; backward reruns the unit."""

    @staticmethod
    def forward(ctx, unit: _Unit, x: torch.Tensor):
        ctx.unit = unit
        ctx.save_for_backward(x)
        out, unit.last_out = unit.last_out, None
        return out

    @staticmethod
    def backward(ctx, grad):
        unit = ctx.unit
        (x,) = ctx.saved_tensors
        h = x.detach().requires_grad_(True)
        with _rerun(unit.rng, unit.device, unit.suspend):
            out = h
            for run in unit.runs:
                out = run(out)
        if out.requires_grad:
            torch.autograd.backward(out, grad)
        ctx.unit = None
        return None, h.grad


class RecomputedLayer(H3TTransformerLayer):
    """megatron-core's TransformerLayer at ``h3t_unit=(position, size)`` of a full-recompute unit: in training it
    runs without a graph and the unit's last layer returns the unit's output through one node that keeps only
    the unit's input (module docstring)."""

    def __init__(self, *args, h3t_unit: tuple[int, int] = (0, 1), **kwargs):
        super().__init__(*args, **kwargs)
        self.h3t_unit = tuple(h3t_unit)

    def forward(self, *args, **kwargs):
        layer_starts()
        hidden = args[0] if args else kwargs.pop("hidden_states")
        args = args[1:]
        position, size = self.h3t_unit
        if not (self.training and torch.is_grad_enabled()):
            return TransformerLayer.forward(self, hidden, *args, **kwargs)
        if kwargs.get("context") is not None or kwargs.get("inference_context") is not None:
            raise RecomputeError("--recompute-granularity full supports self-attention training layers only "
                                 "(got a context input)")
        if position == 0:
            unit = _Unit(hidden, size) if hidden.requires_grad else None
            _OPEN_UNIT.set(unit)
        else:
            unit = _OPEN_UNIT.get()
        if unit is None:  # an input needing no grad: Megatron's checkpoint could not run it either; keep the graph
            if position == size - 1:
                _OPEN_UNIT.set(None)
            return TransformerLayer.forward(self, hidden, *args, **kwargs)
        context: list = [kwargs.get("context")]

        def run(h, args=args, kwargs=kwargs):
            out = TransformerLayer.forward(self, h, *args, **kwargs)
            if isinstance(out, tuple):
                context[0] = out[1]
                return out[0]
            return out

        unit.runs.append(run)
        with torch.no_grad():
            out = run(hidden)
        if position < size - 1:
            return out, context[0]
        _OPEN_UNIT.set(None)
        unit.last_out = out
        return _UnitRecompute.apply(unit, unit.x), context[0]


def is_recomputed(layer: torch.nn.Module) -> bool:
    """True when ``layer`` is part of a full-recompute unit."""
    return isinstance(layer, RecomputedLayer)


__all__ = ["RecomputeError", "RecomputedLayer", "capture_rng", "checkpoint", "is_recomputed", "recomputed_module",
           "recording_under", "restore_rng"]
