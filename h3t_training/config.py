"""The run's configuration: parsed once, resolved by pure steps, then frozen.

:func:`parse_args` turns the command line into a :class:`TrainConfig` through a fixed sequence of
steps, each a function ``TrainConfig -> TrainConfig`` that returns a new config (nothing is changed
in place): Megatron-LM's flag semantics, derived model sizes, ``--auto-plan`` (a new config with the
planner's layout), parallel defaults, and validation with the derived sizes (data-parallel size,
microbatches, virtual stages). A bad flag ends the program with one Megatron-style line
(``pretrain_llama.py: error: ...``, exit status 2) before any process group exists.

Later changes are new configs too: a checkpoint's schedule under
``--use-checkpoint-opt_param-scheduler`` is ``config.replace(...)``.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from h3t_training import arguments, auto_plan, megatron_compat, validation
from h3t_training.errors import ArgumentError
from h3t_training.flag_table import given_table_flags, notice_lines, refusal
from h3t_training.tokenizer import TokenizerError


class FrozenConfigError(AttributeError):
    """An attempt to change a field of a :class:`TrainConfig` (use :meth:`TrainConfig.replace`)."""


class TrainConfig:
    """The resolved flags of one run under Megatron's field names (``config.num_layers``, ...).

    Read like Megatron's ``args``; immutable: :meth:`replace` returns a changed copy. A field that
    the flags do not define raises AttributeError, so ``getattr(config, name, default)`` works."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]):
        object.__setattr__(self, "_values", dict(values))

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace, **extra: Any) -> "TrainConfig":
        return cls({**vars(namespace), **extra})

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"TrainConfig has no field {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenConfigError(f"TrainConfig is frozen: {name} cannot be set (use config.replace({name}=...))")

    def __delattr__(self, name: str) -> None:
        raise FrozenConfigError(f"TrainConfig is frozen: {name} cannot be deleted")

    def replace(self, **changes: Any) -> "TrainConfig":
        """A new config with ``changes`` applied (fields may be added, e.g. derived sizes)."""
        return TrainConfig({**self._values, **changes})

    def as_dict(self) -> dict:
        """A copy of every field (for logging and for APIs that want a plain mapping)."""
        return dict(self._values)

    def as_namespace(self) -> argparse.Namespace:
        """An ``argparse.Namespace`` copy, for APIs that want Megatron's mutable ``args``."""
        return argparse.Namespace(**self._values)

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TrainConfig) and self._values == other._values

    __hash__ = None  # fields may be lists

    def __repr__(self) -> str:
        return f"TrainConfig({len(self._values)} fields, num_layers={self._values.get('num_layers')})"

    def __reduce__(self):
        return TrainConfig, (self._values,)


Step = Callable[[TrainConfig], TrainConfig]


def resolve(config: TrainConfig) -> TrainConfig:
    """Every step after parsing, in order (later steps read what earlier ones derived)."""
    steps: list[Step] = [arguments.check_finite, arguments.check_positive, megatron_compat.apply_megatron_behaviours,
                         arguments.fill_model_defaults, arguments.check_positive, arguments.resolve_ckpt]
    if config.auto_plan:
        steps.append(auto_plan.plan_config)
    steps += [arguments.fill_parallel_defaults, validation.validate_args]
    for step in steps:
        config = step(config)
        assert isinstance(config, TrainConfig), f"{step.__name__} must return a TrainConfig"
    return config


def parse_args(argv: Optional[Sequence[str]] = None, prog: str = "pretrain_llama.py",
               defaults: Optional[dict] = None, world_size: Optional[int] = None) -> TrainConfig:
    """Parse and resolve the command line; exit 2 with one line on a bad flag.

    ``defaults`` overrides the parser's (Megatron-LM's) defaults; pretrain_llama.py gets
    :data:`~h3t_training.arguments.LLAMA_DEFAULTS`. ``world_size`` defaults to ``$WORLD_SIZE`` (1)."""
    if defaults is None and prog == "pretrain_llama.py":
        defaults = arguments.LLAMA_DEFAULTS
    parser = arguments.build_parser(prog, defaults)
    namespace = parser.parse_args(argv)
    given = given_table_flags(namespace)
    refused = refusal(given)
    if refused:
        parser.error(refused)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    config = TrainConfig.from_namespace(namespace, world_size=world_size, flag_notices=tuple(notice_lines(given)))
    try:
        return resolve(config)
    except (ArgumentError, TokenizerError) as e:
        parser.error(str(e))
    raise AssertionError("unreachable: parser.error exits")


__all__ = ["FrozenConfigError", "TrainConfig", "parse_args", "resolve"]
