"""The one activation-checkpointing enum (``--ckpt``), shared by the runtime, the cost model, the planner
and the driver.

``Ckpt`` is a ``str`` enum, so ``Ckpt.OURS == "ours"`` and a value prints and serialises as Megatron's
flag value; code compares members (``ckpt is Ckpt.OURS``), never spelled strings.
"""
from __future__ import annotations

from enum import Enum
from typing import Union


class Ckpt(str, Enum):
    """What a layer keeps for its backward."""

    NO = "no"
    """Save everything the forward produced."""
    FULL = "full"
    """Keep only each layer's input; recompute the whole layer in backward (Megatron's
    ``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``)."""
    OURS = "ours"
    """Keep every GEMM output; recompute the two norm outputs and the MLP activation in backward
    (Megatron-Kwai's ``--kaimm-recompute-norm --kaimm-recompute-mlp-activation-func``)."""
    SELECTIVE = "selective"
    """Megatron's ``--recompute-granularity selective`` (the attention core recomputed): priced by the cost
    model for published runs; the runtime does not run it (:data:`RUNTIME_CKPTS`)."""

    def __str__(self) -> str:  # the flag value, not 'Ckpt.OURS'
        return self.value

    @classmethod
    def parse(cls, value: Union[str, "Ckpt"], *, flag: str = "--ckpt", choices: tuple["Ckpt", ...] = ()) -> "Ckpt":
        """``value`` as a member; ValueError naming ``flag`` and the valid values otherwise."""
        valid = choices or tuple(cls)
        try:
            member = cls(value)
        except ValueError:
            member = None
        if member is None or member not in valid:
            raise ValueError(f"{flag} {value!r} is not one of {{{','.join(m.value for m in valid)}}}")
        return member


RUNTIME_CKPTS: tuple[Ckpt, ...] = (Ckpt.NO, Ckpt.FULL, Ckpt.OURS)
"""The modes the runtime implements and the planner searches."""
CKPT_CHOICES: tuple[str, ...] = tuple(m.value for m in RUNTIME_CKPTS)
""":data:`RUNTIME_CKPTS` as flag values (argparse ``choices``)."""

__all__ = ["CKPT_CHOICES", "Ckpt", "RUNTIME_CKPTS"]
