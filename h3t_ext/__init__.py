"""h3t-ext: activation rematerialization, fractional offload and an analytic planner for Megatron-LM."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .runtime.config import H3TConfig


def install(config: "H3TConfig", **kwargs: Any):
    """Route megatron-core's ``get_forward_backward_func()`` to the h3t-ext schedules.

    Thin lazy wrapper (importing :mod:`h3t_ext` stays torch-free); see
    :func:`h3t_ext.runtime.pipeline.install.install`.
    """
    from .runtime.pipeline.install import install as _install

    return _install(config, **kwargs)


def uninstall() -> None:
    """Restore megatron-core's own schedules; see :func:`h3t_ext.runtime.pipeline.install.uninstall`."""
    from .runtime.pipeline.install import uninstall as _uninstall

    _uninstall()


__all__ = ["install", "uninstall"]
