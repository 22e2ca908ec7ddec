"""``docs/flags.md``: the flag table (:mod:`h3t_training.config.flag_table`) rendered by class and reason, with
what each flag does when the run uses a GPU (:mod:`h3t_training.config.gpu_flags`)."""
from __future__ import annotations

from h3t_training.config.flag_dormancy import DORMANCIES, DORMANT_EXPERTS, DORMANT_OPTIMIZER, SAME_AS_DEFAULT
from h3t_training.config.flag_table import KWAI_SOURCE, MEGATRON_LM_SOURCE, REASONS, TABLE, FlagEntry, RunDevice, \
    reason_on
from h3t_training.config.gpu_flags import GPU_BY_REASON, GpuRule

CLASSES = ("implemented", "noticed", "refused")


def _rule(rule: GpuRule) -> str:
    te = (" -- needs TransformerEngine" + (f" for {', '.join(rule.te_values)}" if rule.te_values else "")
          + ", refused without it") if rule.needs_te or rule.te_values else ""
    instead = f" -- instead: {rule.alternative}" if rule.alternative and rule.cls == "refused" else ""
    return f"**{rule.cls}**: {rule.text}{instead}{te}"


def _name(e: FlagEntry) -> str:
    return f"`{e.flag}`" + ("" if e.source == "megatron-lm" else " (Kwai)")


def _counts(device: RunDevice) -> str:
    counts = {c: sum(1 for e in TABLE.values() if reason_on(e, device).cls == c) for c in CLASSES}
    return ", ".join(f"{n} {c}" for c, n in counts.items())


def render_markdown() -> str:
    """docs/flags.md: the table, by class and reason, each reason with its GPU class."""
    out = ["# Command-line flags of pretrain_gpt.py / pretrain_llama.py", "",
           "Generated from `h3t_training/config/flag_table.py` and `h3t_training/config/gpu_flags.py` by "
           "`scripts/render_flag_docs.py`; do not edit.", "",
           f"Sources: Megatron-LM {MEGATRON_LM_SOURCE}; Megatron-Kwai {KWAI_SOURCE}.", "",
           "* **implemented**: does what Megatron does.",
           "* **noticed**: accepted; one line at start-up says why it cannot apply here (same result).",
           "* **refused**: one-line error (exit 2) with the reason and the alternative, only where running "
           "without it would give a different model or result.", "",
           "The classes below are CPU training's. A flag that changes memory, speed or numerics on a GPU is never "
           "accepted and ignored there: where a run uses a GPU (`--distributed-backend nccl` with CUDA), the "
           "\"on a GPU\" line of a reason (or of a flag) says what it does instead -- passed to megatron-core "
           "(implemented), refused in one line, or noticed where its effect on a GPU is nil.", "",
           "A refused flag that the command line leaves unread is noticed instead, as Megatron-LM ignores it "
           "(`h3t_training/config/flag_dormancy.py`, each group with the Megatron-LM code that reads it): "
           f"the MoE settings without `--num-experts` ({len(DORMANT_EXPERTS)} flags; `--expert-model-parallel-size` "
           "above 1 stays refused, as Megatron-LM asserts), the Lion, SGD and Muon settings under "
           f"`--optimizer adam` ({len(DORMANT_OPTIMIZER)} flags), and:", ""]
    out += [f"* {' '.join(f'`{f}`' for f in d.flags)}: {d.text}" for key, d in DORMANCIES.items()
            if key not in ("experts", "optimizer")]
    out += ["* given Megatron-LM's default, what this driver does: "
            + ", ".join(f"`{f} {v}`" for f, v in SAME_AS_DEFAULT.items()), ""]
    out += [f"{len(TABLE)} flags: {_counts(RunDevice())} on CPU; {_counts(RunDevice(True, True))} on a GPU with "
            f"TransformerEngine; {_counts(RunDevice(True, False))} on a GPU without it.", ""]
    for cls in CLASSES:
        out += [f"## {cls}", ""]
        for key, reason in REASONS.items():
            flags = [e for e in TABLE.values() if e.key == key and e.cls == cls]
            if not flags:
                continue
            what = reason.text + (f" -- instead: {reason.alternative}" if reason.alternative else "")
            out += [f"### {key}: {what}", ""]
            out += [" ".join(_name(e) for e in flags), ""]
            by_reason = [e for e in flags if e.gpu is not None and e.gpu == GPU_BY_REASON.get(key)]
            if by_reason:
                out += [f"On a GPU: {_rule(by_reason[0].gpu)} ({len(by_reason)} of these flags)", ""]
            own = [e for e in flags if e.gpu is not None and e.gpu != GPU_BY_REASON.get(key)]
            if own:
                out += ["On a GPU, by flag:", ""] + [f"* {_name(e)}: {_rule(e.gpu)}" for e in own] + [""]
    return "\n".join(out)


__all__ = ["render_markdown"]
