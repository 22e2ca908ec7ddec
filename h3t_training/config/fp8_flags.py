"""Megatron-LM's FP8 flags and the megatron-core 0.16.1 ``TransformerConfig`` field each one sets: the one list. The
flag table's GPU column (:mod:`h3t_training.config.gpu_flags`) renders its FP8 rows from it and
:func:`h3t_training.config.megatron_fields.fp8_fields` builds the fields from it, so an FP8 flag is added here once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union, get_args

from h3t_ext.costmodel.fp8 import DEFAULT_FP8_RECIPE, FP8_FORMATS, FP8_RECIPES as PRICED_FP8_RECIPES

FP8_RECIPES = PRICED_FP8_RECIPES + ("custom",)
"""megatron-core 0.16.1's ``TransformerConfig.fp8_recipe`` literals: the recipes the cost model prices and 'custom'
(a user's quantizer factory, passed to megatron-core; a logged prediction cannot price it)."""
AMAX_COMPUTE_ALGOS = ("most_recent", "max")
"""megatron-core 0.16.1's ``TransformerConfig.fp8_amax_compute_algo`` literals (``fp8``: ``FP8_FORMATS``, the
cost model's)."""

Fp8Read = Literal["choice", "int", "switch", "off_switch", "value"]
"""How a flag's value becomes its field: one of ``choices`` (else ``default``); an integer >= ``low`` (else
``default``); True when given (``switch``); False when given (``off_switch``; several such flags of one field
must all be absent for True); the given text, the field left out when the flag is not given (``value``)."""


@dataclass(frozen=True)
class Fp8Flag:
    """One FP8 flag: its ``TransformerConfig`` ``field``, how its value is read (``read``, :data:`Fp8Read`),
    whether it needs ``--fp8-format`` (``needs_format``: a ValueError without it, as megatron-core refuses it) and
    another megatron-core field it sets too (``also``, named in the GPU column)."""

    flag: str
    field: str
    read: Fp8Read
    choices: tuple[str, ...] = ()
    default: Union[str, int, None] = None
    low: int = 0
    needs_format: bool = False
    also: str = ""

    def __post_init__(self):
        if self.read not in get_args(Fp8Read):
            raise ValueError(f"{self.flag}: read {self.read!r} is not one of {', '.join(get_args(Fp8Read))}")
        if (self.read == "choice") != bool(self.choices):
            raise ValueError(f"{self.flag}: choices are for read='choice' and it needs them")

    @property
    def gpu_column(self) -> str:
        """What the flag sets in megatron-core, as the flag table's GPU column names it."""
        text = f"TransformerConfig.{self.field}" + (" (False)" if self.read == "off_switch" else "")
        return f"{text} and {self.also}" if self.also else text


FP8_FLAGS: tuple[Fp8Flag, ...] = (
    Fp8Flag("--fp8-format", "fp8", "choice", FP8_FORMATS),
    Fp8Flag("--fp8-recipe", "fp8_recipe", "choice", FP8_RECIPES, DEFAULT_FP8_RECIPE),
    Fp8Flag("--fp8-margin", "fp8_margin", "int", default=0),
    Fp8Flag("--fp8-interval", "fp8_interval", "int", default=1, low=1),
    Fp8Flag("--fp8-amax-history-len", "fp8_amax_history_len", "int", default=1, low=1),
    Fp8Flag("--fp8-amax-compute-algo", "fp8_amax_compute_algo", "choice", AMAX_COMPUTE_ALGOS, "most_recent"),
    Fp8Flag("--fp8-param-gather", "fp8_param", "switch", needs_format=True,
            also="DistributedDataParallelConfig.fp8_param_gather"),
    Fp8Flag("--fp8-quantizer-factory", "fp8_quantizer_factory", "value"),
    Fp8Flag("--no-fp8-wgrad", "fp8_wgrad", "off_switch"),
    Fp8Flag("--disable-fp8-wgrad", "fp8_wgrad", "off_switch"),
    Fp8Flag("--first-last-layers-bf16", "first_last_layers_bf16", "switch", needs_format=True),
    Fp8Flag("--num-layers-at-start-in-bf16", "num_layers_at_start_in_bf16", "int", default=1),
    Fp8Flag("--num-layers-at-end-in-bf16", "num_layers_at_end_in_bf16", "int", default=1),
)
"""Every FP8 flag a GPU run with TransformerEngine passes to megatron-core, in the GPU column's order; the first is
``--fp8-format`` (without it the others set nothing)."""


def fp8_flag(flag: str) -> Fp8Flag:
    """The entry of :data:`FP8_FLAGS` for ``flag`` (its field, choices and default); a KeyError names the list."""
    for entry in FP8_FLAGS:
        if entry.flag == flag:
            return entry
    raise KeyError(f"{flag} is not one of FP8_FLAGS: {', '.join(f.flag for f in FP8_FLAGS)}")


__all__ = ["AMAX_COMPUTE_ALGOS", "FP8_FLAGS", "FP8_FORMATS", "FP8_RECIPES", "Fp8Flag", "Fp8Read", "fp8_flag"]
