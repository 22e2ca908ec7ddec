"""The one activation-checkpointing enum (``--ckpt``), shared by the runtime, the cost model, the planner
and the driver.

``Ckpt`` is a ``str`` enum, so ``Ckpt.OURS == "ours"`` and a value prints and serialises as Megatron's
flag value; code compares members (``ckpt is Ckpt.OURS``), never spelled strings.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional, Union


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
    """Megatron's ``--recompute-granularity selective`` with its default module (the attention core): the
    shorthand of published runs for ``NO`` plus :class:`Recompute` ``('selective', modules=('core_attn',))``,
    which is what the runtime runs (:data:`RUNTIME_CKPTS` holds the per-layer base modes)."""

    def __str__(self) -> str:  # the flag value, not 'Ckpt.OURS'
        return self.value

    @classmethod
    def parse(cls, value: Union[str, "Ckpt"], *, flag: str = "--ckpt", choices: tuple["Ckpt", ...] = ()) -> "Ckpt":
        """``value`` as a member; ValueError naming ``flag`` and the valid values otherwise."""
        if not choices and isinstance(value, cls):  # already one (the cost model asks this of every plan it prices)
            return value
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


# --------------------------------------------------------------------------- Megatron's --recompute-* flags
RECOMPUTE_GRANULARITIES: tuple[str, ...] = ("full", "selective")
"""Megatron's ``--recompute-granularity`` values."""
RECOMPUTE_METHODS: tuple[str, ...] = ("uniform", "block")
"""Megatron's ``--recompute-method`` values."""
DENSE_RECOMPUTE_MODULES: tuple[str, ...] = ("core_attn", "layernorm", "mlp")
"""``--recompute-modules`` values of a dense model (megatron-core 0.16.1 ``TransformerConfig.recompute_modules``):
the core attention, the two norms (their outputs dropped, recomputed from their inputs) and the whole MLP."""
MOE_RECOMPUTE_MODULES: tuple[str, ...] = ("moe", "moe_act", "shared_experts")
"""``--recompute-modules`` values that act on MoE layers only (a dense model has none to recompute)."""
MLA_RECOMPUTE_MODULES: tuple[str, ...] = ("mla_up_proj",)
"""``--recompute-modules`` values that act on multi-latent attention only."""
RECOMPUTE_MODULES: tuple[str, ...] = DENSE_RECOMPUTE_MODULES + MOE_RECOMPUTE_MODULES + MLA_RECOMPUTE_MODULES
"""Every value megatron-core 0.16.1 accepts."""


@dataclass(frozen=True)
class Recompute:
    """Megatron's activation recompute (``--recompute-granularity``, ``--recompute-method``,
    ``--recompute-num-layers``, ``--recompute-modules``; megatron-core's ``TransformerConfig`` fields of the
    same names), on top of a per-layer :class:`Ckpt` base (``no`` or ``ours``).

    * ``full``: a *unit* of consecutive layers keeps only its input and is rerun whole in backward.
      ``uniform``: every model chunk's layers split into units of ``num_layers`` (which must divide them);
      ``block``: the first ``num_layers`` layers of every model chunk, one unit each, the rest not recomputed.
    * ``selective``: inside every layer the ``modules`` are recomputed: ``core_attn`` (keeps q, k, v),
      ``layernorm`` (the two norm outputs and their statistics), ``mlp`` (keeps the MLP input).

    :meth:`parse` gives the one-line errors of bad values; construct through it.
    """

    granularity: Optional[str] = None
    method: Optional[str] = None
    num_layers: Optional[int] = None
    modules: tuple[str, ...] = ()

    @classmethod
    def parse(cls, granularity: Optional[str] = None, method: Optional[str] = None,
              num_layers: Optional[int] = None, modules=None, *, moe: bool = False) -> "Recompute":
        """The record of Megatron's four flags; ValueError (one line, naming the flag and the valid values)
        otherwise. ``full`` without a method is ``uniform`` with 1 layer; ``selective`` without modules is
        Megatron's default ``core_attn``; MLA-only modules are refused, and MoE-only ones unless ``moe`` (the model has
        MoE layers: the cost model prices them; the runtime has none). Without a
        granularity the other three are ignored, as Megatron-LM and megatron-core ignore them (no recompute: the
        CI recipe gpt3_mcore_reruns_resume_check_grads passes ``--recompute-num-layers 1`` alone)."""
        if granularity is None:
            return cls()
        if granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"--recompute-granularity {granularity!r} is not one of "
                             f"{{{','.join(RECOMPUTE_GRANULARITIES)}}}")
        if method is not None and method not in RECOMPUTE_METHODS:
            raise ValueError(f"--recompute-method {method!r} is not one of {{{','.join(RECOMPUTE_METHODS)}}}")
        if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int)
                                       or num_layers < 1):
            raise ValueError(f"--recompute-num-layers {num_layers!r} is outside [1, inf)")
        if granularity == "full":
            if modules:
                raise ValueError("--recompute-modules needs --recompute-granularity selective (full recomputes "
                                 "whole layers)")
            return cls("full", method or "uniform", 1 if num_layers is None else num_layers)
        if num_layers is not None:
            raise ValueError("--recompute-num-layers needs --recompute-granularity full (selective recomputes "
                             "its --recompute-modules in every layer)")
        if method is not None:
            raise ValueError(f"--recompute-method {method} needs --recompute-granularity full (Megatron-LM asserts "
                             "that selective recompute takes no method)")
        names = tuple(dict.fromkeys(modules or ("core_attn",)))
        valid = DENSE_RECOMPUTE_MODULES + (MOE_RECOMPUTE_MODULES if moe else ())
        for name in names:
            if name in MOE_RECOMPUTE_MODULES and moe:
                continue
            if name in MOE_RECOMPUTE_MODULES:
                raise ValueError(f"--recompute-modules {name} recomputes MoE layers; the model is dense (valid: "
                                 f"{{{','.join(DENSE_RECOMPUTE_MODULES)}}})")
            if name in MLA_RECOMPUTE_MODULES:
                raise ValueError(f"--recompute-modules {name} needs multi-latent attention, which is not implemented"
                                 f" (valid: {{{','.join(DENSE_RECOMPUTE_MODULES)}}})")
            if name not in DENSE_RECOMPUTE_MODULES:
                raise ValueError(f"--recompute-modules {name!r} is not one of {{{','.join(DENSE_RECOMPUTE_MODULES)}}}")
        return cls("selective", None, None, tuple(m for m in valid if m in names))

    @property
    def full(self) -> bool:
        return self.granularity == "full"

    @property
    def selective(self) -> bool:
        return self.granularity == "selective"

    def recomputes(self, module: str) -> bool:
        """True when selective recompute covers ``module`` (one of :data:`DENSE_RECOMPUTE_MODULES`)."""
        return self.selective and module in self.modules

    def units(self, layers: int) -> tuple[tuple[int, int], ...]:
        """The full-recompute units ``(start, end)`` of a model chunk of ``layers`` layers (none unless full);
        ValueError (one line) when ``uniform``'s ``num_layers`` does not divide ``layers`` (megatron-core's
        ``TransformerBlock._checkpointed_forward`` would index past its last layer)."""
        if not self.full or layers == 0:
            return ()
        n = self.num_layers
        if self.method == "block":
            return tuple((i, i + 1) for i in range(min(n, layers)))
        if layers % n:
            raise ValueError(f"--recompute-num-layers {n} must divide the {layers} layers of each model chunk with "
                             "--recompute-method uniform")
        return tuple((i, i + n) for i in range(0, layers, n))

    def unit_shape(self, layers: int) -> tuple[int, int, int]:
        """(units, layers inside units, layers of the largest unit) of :meth:`units`, without listing them (a chunk
        of a million layers is one line of arithmetic); the same ValueError where :meth:`units` raises one."""
        if not self.full or layers == 0:
            return 0, 0, 0
        n = self.num_layers
        if self.method == "block":
            k = min(n, layers)
            return k, k, 1 if k else 0
        if layers % n:
            self.units(layers)  # raises its one-line ValueError
        return layers // n, layers, n

    def flags(self) -> tuple[str, ...]:
        """Megatron's flags of this record (empty without recompute)."""
        if self.granularity is None:
            return ()
        if self.full:
            return ("--recompute-granularity", "full", "--recompute-method", self.method,
                    "--recompute-num-layers", str(self.num_layers))
        return ("--recompute-granularity", "selective", "--recompute-modules", *self.modules)


NO_RECOMPUTE = Recompute()
FULL_UNIFORM_1 = Recompute("full", "uniform", 1)
"""``--ckpt full``: every layer its own unit."""
SELECTIVE_CORE_ATTN = Recompute("selective", None, None, ("core_attn",))
"""``--recompute-granularity selective`` with Megatron's default module (``Ckpt.SELECTIVE``)."""


def split_ckpt(ckpt: Union[str, Ckpt], recompute: Recompute = NO_RECOMPUTE) -> tuple[Ckpt, Recompute]:
    """(per-layer base ``NO``/``OURS``, Megatron's recompute) of a ``--ckpt`` value with Megatron's flags:
    ``full`` is ``NO`` with :data:`FULL_UNIFORM_1`, ``selective`` is ``NO`` with selective ``core_attn``.
    ValueError (one line) when ``ckpt`` and ``recompute`` say different things."""
    ckpt = Ckpt.parse(ckpt)
    if ckpt in (Ckpt.FULL, Ckpt.SELECTIVE):
        implied = FULL_UNIFORM_1 if ckpt is Ckpt.FULL else SELECTIVE_CORE_ATTN
        if recompute.granularity is not None and recompute != implied:
            raise ValueError(f"--ckpt {ckpt} contradicts {' '.join(recompute.flags())} (give one of them)")
        return Ckpt.NO, implied
    if ckpt is Ckpt.OURS and recompute.full and recompute.method == "uniform":
        raise ValueError("--ckpt ours contradicts --recompute-granularity full --recompute-method uniform (every layer "
                         "is recomputed whole); "
                         "use --recompute-method block to recompute some layers whole and the rest as ours")
    return ckpt, recompute


def combined_ckpt(base: Ckpt, recompute: Recompute) -> Ckpt:
    """The one :class:`Ckpt` value that names ``base`` with ``recompute`` where one does (``full`` for uniform/1
    on ``no``), else ``base``."""
    if base is Ckpt.NO and recompute == FULL_UNIFORM_1:
        return Ckpt.FULL
    return base


def normal_form(ckpt: Union[str, Ckpt], recompute: Recompute = NO_RECOMPUTE) -> tuple[Ckpt, Recompute]:
    """One spelling of a recompute setting, so that equal settings make equal plans: ``ckpt`` full / selective
    where Megatron's flags say exactly that (their ``Recompute`` then empty), else the base with the record.
    ValueError (one line) where ``ckpt`` and ``recompute`` contradict (:func:`split_ckpt`)."""
    base, recompute = split_ckpt(ckpt, recompute)
    if base is Ckpt.NO and recompute == FULL_UNIFORM_1:
        return Ckpt.FULL, NO_RECOMPUTE
    if base is Ckpt.NO and recompute == SELECTIVE_CORE_ATTN:
        return Ckpt.SELECTIVE, NO_RECOMPUTE
    return base, recompute


def recompute_fields(ckpt: Union[str, Ckpt], recompute: Recompute = NO_RECOMPUTE) -> dict:
    """Megatron's recompute fields of a ckpt and recompute pair (megatron-core's ``TransformerConfig`` names:
    ``recompute_granularity``, ``recompute_method``, ``recompute_num_layers``, ``recompute_modules``; None/[] when
    off). The planner prints them as flags and ``--auto-plan`` writes them into the driver's config."""
    _, rec = split_ckpt(ckpt, recompute)
    return {"recompute_granularity": rec.granularity, "recompute_method": rec.method,
            "recompute_num_layers": rec.num_layers, "recompute_modules": list(rec.modules)}


__all__ = ["CKPT_CHOICES", "Ckpt", "DENSE_RECOMPUTE_MODULES", "FULL_UNIFORM_1", "NO_RECOMPUTE", "RECOMPUTE_METHODS",
           "recompute_fields",
           "RECOMPUTE_MODULES", "RUNTIME_CKPTS", "Recompute", "SELECTIVE_CORE_ATTN", "combined_ckpt", "normal_form",
           "split_ckpt"]
