"""The one table of command-line flags: every flag of Megatron-LM's ``pretrain_gpt.py`` and of
Megatron-Kwai's ATC'24 scripts, with what this driver does with it.

Three classes:

* ``implemented``: the driver does what Megatron does with the flag;
* ``noticed``: accepted, and the driver prints one line at start-up saying why it cannot apply here
  (a GPU kernel, an I/O or performance setting, another model family's flag) -- the result is the same;
* ``refused``: one line naming the flag, why, and the alternative, exit status 2, before any process
  group -- only where running without the flag would give a different model or result.

:func:`add_table_flags` adds to a parser every table flag it does not define itself (consuming the
flag's values as Megatron's parser would), so a script's flags never fail as unknown; the parsed
values of those flags are then looked up by :func:`notices` and :func:`refusals`.
Each row also has a GPU class (:attr:`FlagEntry.gpu`, the column of :mod:`~h3t_training.config.gpu_flags`): what a
flag that CPU training notices does when the run uses a GPU -- passed to megatron-core, refused, or (where its
effect there is nil) noticed; :func:`reason_on` gives a row's class on a :class:`RunDevice`.
The rows themselves (the flags by reason, and the reasons) are data in :mod:`~h3t_training.config.flag_rows`.
``docs/flags.md`` is rendered from this table by ``scripts/render_flag_docs.py`` (:mod:`~h3t_training.config.flag_docs`;
a test keeps it in sync).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from h3t_training.config.flag_dormancy import inert_text
from h3t_training.config.flag_rows import (KWAI_SOURCE, MEGATRON_KWAI, MEGATRON_LM, MEGATRON_LM_SOURCE, REASONS,  # noqa: F401
                                           Reason)
from h3t_training.config.gpu_flags import GPU_BY_FLAG, GPU_BY_REASON, GpuRule
from h3t_training.errors import ArgumentError


@dataclass(frozen=True)
class FlagEntry:
    """One row of the table: the flag, its class and reason, how many values it takes (Megatron's nargs:
    '0', '1', '+', '*', or a count) and where it comes from ('megatron-lm' or 'megatron-kwai')."""

    flag: str
    key: str
    reason: Reason
    arity: str
    source: str

    @property
    def cls(self) -> str:
        return self.reason.cls

    @property
    def gpu(self) -> Optional[GpuRule]:
        """What the flag does when the run uses a GPU (:mod:`~h3t_training.config.gpu_flags`); None: as on CPU."""
        return GPU_BY_FLAG.get(self.flag) or GPU_BY_REASON.get(self.key)


TE_MISSING = "TransformerEngine is not importable here"
"""What a GPU run without TransformerEngine is told where a flag or the layer spec needs it."""


@dataclass(frozen=True)
class RunDevice:
    """Where a run trains: on a GPU (``uses_gpu``) and whether TransformerEngine is importable there (if not, why:
    ``feature_checks.transformer_engine_problem``)."""

    on_gpu: bool = False
    transformer_engine: bool = False
    transformer_engine_problem: str = TE_MISSING


CPU = RunDevice()


def reason_on(entry: FlagEntry, device: RunDevice, value=None) -> Reason:
    """The flag's class and reason on ``device`` (given ``value``, the flag's value on the command line)."""
    rule = entry.gpu if device.on_gpu else None
    if rule is None:
        return entry.reason
    te_needed = rule.needs_te or (str(value) in rule.te_values)
    if rule.cls == "implemented" and te_needed and not device.transformer_engine:
        what = f"with the value {value} " if rule.te_values else ""
        return Reason("refused", f"on a GPU {what}it runs through TransformerEngine (megatron-core's TE layers), and "
                      f"{device.transformer_engine_problem}", "install TransformerEngine, or leave the flag out")
    return Reason(rule.cls, rule.text, rule.alternative)




def _entries() -> dict[str, FlagEntry]:
    table: dict[str, FlagEntry] = {}
    for source, groups in (("megatron-lm", MEGATRON_LM), ("megatron-kwai", MEGATRON_KWAI)):
        for key, block in groups.items():
            for token in block.split():
                flag, arity = token.split("=")
                assert flag not in table, flag
                table[flag] = FlagEntry(flag, key, REASONS[key], arity, source)
    return table


TABLE: dict[str, FlagEntry] = _entries()
"""flag -> its row."""

_DEST_PREFIX = "_table_flag_"


def _dest(flag: str) -> str:
    return _DEST_PREFIX + flag[2:].replace("-", "_")


def add_table_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Add every table flag that ``parser`` does not define itself, taking as many values as Megatron's
    parser takes (as strings; they are reported, not used). Returns the flags added."""
    added = []
    group = parser.add_argument_group("other Megatron-LM / Megatron-Kwai flags (see docs/flags.md)")
    for flag, e in TABLE.items():
        if flag in parser._option_string_actions:  # noqa: SLF001 - argparse has no public lookup
            continue
        kw: dict = {"dest": _dest(flag), "default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
        if e.arity == "0":
            kw["action"] = "store_true"
        elif e.arity != "1":
            kw["nargs"] = int(e.arity) if e.arity.isdigit() else e.arity
        group.add_argument(flag, **kw)
        added.append(flag)
    return added


def given_table_flags(args: argparse.Namespace) -> list[FlagEntry]:
    """The rows of the table flags this command line gave that the parser has no explicit flag for."""
    return [TABLE[f] for f in TABLE if hasattr(args, _dest(f))]


def table_value(args: argparse.Namespace, flag: str, default=None):
    """The value (a string, list or True) a table-only flag was given, else ``default`` (a table flag's
    destination exists only when the flag was given: :func:`add_table_flags` defaults it to SUPPRESS)."""
    dest = _dest(flag)
    return getattr(args, dest) if hasattr(args, dest) else default


def set_table_value(args: argparse.Namespace, flag: str, value) -> None:
    """Give a table-only flag ``value`` as if the command line had (``--use-checkpoint-args`` takes some from a
    checkpoint): the table then refuses or notices it as a typed one."""
    setattr(args, _dest(flag), value)


def table_int(args: argparse.Namespace, flag: str, default: int, low: int = 0) -> int:
    """The integer a table-only flag was given (``default`` when it was not), checked to lie in ``[low, inf)``;
    :class:`~h3t_training.errors.ArgumentError` names the flag, its value and the range in one line."""
    value = table_value(args, flag, None)
    if value is None:
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ArgumentError(f"{flag} {value!r} is not an integer in [{low}, inf)") from None
    if number < low:
        raise ArgumentError(f"{flag} {number} is outside [{low}, inf)")
    return number


def _value(args, entry: FlagEntry):
    return None if args is None else table_value(args, entry.flag)


def dormant(entry: FlagEntry, args) -> Optional[Reason]:
    """The notice of a refused flag that this command line leaves unread, as Megatron-LM leaves it
    (:mod:`~h3t_training.config.flag_dormancy`: a MoE setting without ``--num-experts``, another optimizer's setting
    under Adam, a tokenizer setting of another ``--tokenizer-type``, a refused flag given Megatron-LM's default); None
    otherwise. Megatron-LM asserts expert parallelism above 1 without experts, so that one stays refused."""
    if args is None or entry.cls != "refused":
        return None
    if entry.flag == "--expert-model-parallel-size" and str(table_value(args, entry.flag)).strip() != "1":
        return None
    text = inert_text(entry.flag, args, lambda flag: table_value(args, flag))
    return None if text is None else Reason("noticed", text, "none needed")


def _reason(e: FlagEntry, device: RunDevice, args) -> Reason:
    return dormant(e, args) or reason_on(e, device, _value(args, e))


def refusal(entries: list[FlagEntry], device: RunDevice = CPU, args=None) -> Optional[str]:
    """One line naming every refused flag among ``entries`` on ``device`` (flags of one reason together, each
    reason with its alternative), so a command line's refusals are learnt in one launch; None when none is
    refused. ``args``: the parsed flags (a GPU rule may depend on a flag's value)."""
    by_reason: dict[Reason, list[str]] = {}
    for e in entries:
        reason = _reason(e, device, args)
        if reason.cls == "refused":
            by_reason.setdefault(reason, []).append(e.flag)
    if not by_reason:
        return None
    parts = [f"{', '.join(flags)} {'is' if len(flags) == 1 else 'are'} not supported: {reason.text} "
             f"(instead: {reason.alternative})" for reason, flags in by_reason.items()]
    return "; ".join(parts)


def without_refused(entries: list[FlagEntry], device: RunDevice = CPU, args=None) -> argparse.Namespace:
    """A copy of ``args`` without the table flags among ``entries`` that :func:`refusal` refuses on ``device``, as if
    the command line had left them out: the resolve steps then never read a refused flag, so a launch's line names
    each problem once (``--transformer-impl transformer_engine`` without TransformerEngine is the table's refusal,
    not also the layer-spec step's)."""
    kept = argparse.Namespace(**vars(args))
    for e in entries:
        if _reason(e, device, args).cls == "refused":
            delattr(kept, _dest(e.flag))
    return kept


def notice_lines(entries: list[FlagEntry], device: RunDevice = CPU, args=None) -> list[str]:
    """One line per flag noticed on ``device``; an implemented flag says nothing (each table-only one is read with
    :func:`table_value` where it acts: ``tests/unit/test_flag_table.py`` holds that true)."""
    return [f"note: {e.flag}: {reason.text}" for e in entries if (reason := _reason(e, device, args)).cls == "noticed"]


__all__ = ["CPU", "FlagEntry", "KWAI_SOURCE", "MEGATRON_LM_SOURCE", "REASONS", "Reason", "RunDevice", "TABLE",
           "add_table_flags", "dormant", "given_table_flags", "notice_lines", "reason_on", "refusal", "set_table_value",
           "table_int", "table_value", "without_refused"]
