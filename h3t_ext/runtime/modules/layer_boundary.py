"""Where each transformer layer's forward starts, told to whoever listens (the activation manager).

The layers of the h3t layer spec (:class:`H3TTransformerLayer`, a megatron-core ``TransformerLayer`` that
megatron-core builds from the spec like any other) call :func:`layer_starts` first thing in their forward.
:func:`listening` installs the callback for the forward of one microbatch-chunk (a context variable, so it is
scoped to that forward and to this thread); outside it the call does nothing. Layer-granular activation
offload (:mod:`h3t_ext.runtime.memory.activations`) splits a chunk's saved tensors into layers by it.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Callable, Iterator, Optional

from megatron.core.transformer.transformer_layer import TransformerLayer

_LISTENER: ContextVar[Optional[Callable[[], None]]] = ContextVar("h3t_layer_listener", default=None)


@contextlib.contextmanager
def listening(callback: Callable[[], None]) -> Iterator[None]:
    """Call ``callback`` whenever a layer's forward starts inside this context."""
    token = _LISTENER.set(callback)
    try:
        yield
    finally:
        _LISTENER.reset(token)


def layer_starts() -> None:
    """A transformer layer's forward starts (called by :class:`H3TTransformerLayer`)."""
    callback = _LISTENER.get()
    if callback is not None:
        callback()


class H3TTransformerLayer(TransformerLayer):
    """megatron-core's TransformerLayer that says where its forward starts (:func:`layer_starts`)."""

    def forward(self, *args, **kwargs):
        layer_starts()
        return super().forward(*args, **kwargs)


def marks_layer_starts(chunks) -> bool:
    """True when every transformer layer of ``chunks`` (model chunks) says where its forward starts."""
    layers = [m for c in chunks for m in c.modules() if isinstance(m, TransformerLayer)]
    return all(isinstance(m, H3TTransformerLayer) for m in layers)


def count_layers(chunk) -> int:
    """Transformer layers of one model chunk."""
    return sum(isinstance(m, TransformerLayer) for m in chunk.modules())


__all__ = ["H3TTransformerLayer", "count_layers", "layer_starts", "listening", "marks_layer_starts"]
