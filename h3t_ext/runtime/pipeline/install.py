"""Put the h3t-ext schedules in place of megatron-core's, and take them out again.

:func:`install` rebinds ``forward_backward_no_pipelining``,
``forward_backward_pipelining_without_interleaving`` and
``forward_backward_pipelining_with_interleaving`` in
``megatron.core.pipeline_parallel.schedules``, so every training loop that calls
``get_forward_backward_func()`` runs :class:`~h3t_ext.runtime.pipeline.schedules.H3TSchedules` with the
given :class:`H3TConfig`. :func:`uninstall` restores megatron-core's functions.
"""
from __future__ import annotations

from typing import Callable, Optional

from ..config import H3TConfig, RuntimeConfigError
from .schedules import H3TSchedules

SCHEDULE_NAMES = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)

_originals: Optional[dict[str, Callable]] = None
_installed: Optional[H3TSchedules] = None


def _megatron_schedules():
    from megatron.core.pipeline_parallel import schedules

    return schedules


def install(config: H3TConfig, *, manager_factory: Optional[Callable] = None) -> H3TSchedules:
    """Make megatron-core's ``get_forward_backward_func()`` return the h3t-ext schedules.

    Installing again replaces the previous configuration. ``manager_factory`` overrides how
    the activation manager of a stage is built (tests); by default
    ``h3t_ext.runtime.memory.activations.build_activation_manager``.
    """
    global _originals, _installed
    if not isinstance(config, H3TConfig):
        raise RuntimeConfigError(f"install() needs an H3TConfig, got {type(config).__name__}")
    mod = _megatron_schedules()
    if _originals is None:
        _originals = {name: getattr(mod, name) for name in SCHEDULE_NAMES}
    runtime = H3TSchedules(config, manager_factory=manager_factory)
    for name in SCHEDULE_NAMES:
        setattr(mod, name, getattr(runtime, name))
    _installed = runtime
    return runtime


def uninstall() -> None:
    """Restore megatron-core's own schedules (no-op when nothing is installed)."""
    global _originals, _installed
    if _originals is None:
        return
    mod = _megatron_schedules()
    for name, fn in _originals.items():
        setattr(mod, name, fn)
    _originals, _installed = None, None


def installed() -> Optional[H3TSchedules]:
    """The schedules currently installed, or None."""
    return _installed


__all__ = ["SCHEDULE_NAMES", "install", "installed", "uninstall"]
