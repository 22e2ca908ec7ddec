"""How a TransformerLayer hands its process groups to an MLP subclass of a layer spec, across megatron-core versions.

megatron-core 0.16-0.18 build a dense ``MLP`` spec with ``tp_group=pg_collection.tp``. From 0.19 the layer calls its
mlp submodule with ``pg_collection``, ``is_mtp_layer`` and ``name``, and routes only megatron-core's own ``MLP`` and
``TEFusedMLP`` classes (compared by identity) through ``MLP.as_mlp_submodule``, which turns them into ``tp_group``;
a subclass in a spec gets them as they are, and ``MLP.__init__`` refuses ``pg_collection``. :class:`LayerMLPArgs`
takes both conventions, as ``as_mlp_submodule`` does, for every MLP subclass h3t-ext's specs use.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable


class LayerMLPArgs:
    """Mixin before an ``MLP`` base: ``pg_collection`` becomes ``tp_group``; ``is_mtp_layer`` is dropped (a dense MLP
    is the same in a multi-token-prediction layer, as megatron-core's ``as_mlp_submodule`` says)."""

    def __init__(self, config, submodules, *args, pg_collection=None, is_mtp_layer=None, **kwargs):
        del is_mtp_layer
        if pg_collection is not None and kwargs.get("tp_group") is None:
            kwargs["tp_group"] = pg_collection.tp
        super().__init__(config, submodules, *args, **kwargs)


def with_layer_mlp_args(base: type) -> tuple:
    """The bases of a subclass of ``base`` that a TransformerLayer of any supported megatron-core can build: ``base``
    alone unless it is an MLP without :class:`LayerMLPArgs`."""
    from megatron.core.transformer.mlp import MLP  # noqa: PLC0415

    if issubclass(base, MLP) and not issubclass(base, LayerMLPArgs):
        return (LayerMLPArgs, base)
    return (base,)


def replace_mlp_class(mlp: Any, wrap: Callable[[type], type]) -> Any:
    """A layer spec's ``mlp`` submodule with its class replaced by ``wrap(cls)``: a ``ModuleSpec`` (megatron-core
    0.16-0.18, and h3t-ext's own specs) gets the wrapped module; megatron-core 0.19's stock specs give the dense MLP
    as ``functools.partial(cls.as_mlp_submodule, submodules=...)``, which becomes the same partial of the wrapped
    class's ``as_mlp_submodule`` (a classmethod, so it builds the wrapped class)."""
    if isinstance(mlp, functools.partial) and getattr(mlp.func, "__name__", None) == "as_mlp_submodule":
        cls = mlp.func.__self__
        return functools.partial(wrap(cls).as_mlp_submodule, *mlp.args, **mlp.keywords)
    if not dataclasses.is_dataclass(mlp) or not hasattr(mlp, "module"):
        raise TypeError(f"cannot wrap the MLP of this layer spec: {mlp!r} is neither a ModuleSpec nor "
                        "megatron-core's partial(MLP.as_mlp_submodule, ...)")
    return dataclasses.replace(mlp, module=wrap(mlp.module))


__all__ = ["LayerMLPArgs", "replace_mlp_class", "with_layer_mlp_args"]
