"""``--use-checkpoint-args``: the model flags a run takes from the ``args`` its ``--load`` checkpoint saved.

Megatron-LM's ``load_args_from_checkpoint`` (``megatron/training/checkpointing.py``, the same list in core_v0.16.1
and core_v0.19.0) reads the ``args`` Namespace of the checkpoint ``--load`` (and ``--ckpt-step``) names before
``validate_args``, and sets each field of a fixed list on the run's ``args``: a *forced* field always (the checkpoint's
value wins over the command line's), the others only where the command line left them None. A field the checkpoint
does not hold (or holds as None) stays as given. ``--use-mp-args-from-checkpoint-args`` adds the parallel sizes,
``--no-use-tokenizer-model-from-checkpoint-args`` leaves out the tokenizer type and model. Without a checkpoint, or
with one that saved no ``args``, the command line is used as it is.

This module is that list and its rule, applied to the driver's parsed flags (an ``argparse.Namespace`` under the
parser's destinations) before the configuration is resolved, so every check a typed flag gets (ranges, the flag
table's refusals) applies to a value that came from the checkpoint. What it reads is a :class:`SavedArgs`, given by
the caller's reader (:func:`h3t_training.loop.saved_args.read_saved_args`: this folder reads no checkpoint files).
It also writes the other direction, :func:`megatron_args`: the Namespace this driver saves in its checkpoints under
Megatron-LM's field names, so that Megatron-LM's ``--use-checkpoint-args`` (and this one) read a driver checkpoint.
"""
from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from h3t_training.config.flag_table import TABLE, set_table_value, table_value
from h3t_training.errors import ArgumentError

USE_FLAG = "--use-checkpoint-args"

SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
"""The flags the driver's parser requires, optional under ``--use-checkpoint-args`` (Megatron-LM's parser requires
none of them; its ``validate_args`` asks for them after the checkpoint's were taken)."""

MODEL_FIELDS: tuple[tuple[str, bool], ...] = (
    ("num_layers", False), ("hidden_size", False), ("ffn_hidden_size", False), ("seq_length", False),
    ("num_attention_heads", False), ("num_query_groups", True), ("group_query_attention", True),
    ("kv_channels", False), ("max_position_embeddings", False), ("position_embedding_type", True),
    ("add_position_embedding", True), ("use_rotary_position_embeddings", True), ("rotary_base", True),
    ("rotary_percent", True), ("rotary_interleaved", True), ("add_bias_linear", True), ("add_qkv_bias", True),
    ("squared_relu", True), ("swiglu", True), ("untie_embeddings_and_output_weights", True),
    ("apply_layernorm_1p", True), ("normalization", True), ("attention_dropout", True), ("hidden_dropout", True),
)
"""Megatron-LM's model fields, in its order, with whether each is forced (its forced
``apply_query_key_layer_scaling`` is one of :data:`FEATURE_FIELDS`: a table flag)."""

FEATURE_FIELDS = ("apply_query_key_layer_scaling", "num_experts", "mtp_num_layers", "mtp_hybrid_override_pattern",
                  "spec", "hybrid_override_pattern", "hybrid_layer_pattern", "is_hybrid_model",
                  "heterogeneous_layers_config_path", "heterogeneous_layers_config_encoded_json", "moe_latent_size",
                  "tiktoken_pattern")
"""The fields of that list that turn on a model this driver does not build (or an fp16 attention scaling, or a
tokenizer setting), each off by default (None or False). Set in the checkpoint, each becomes its flag, which the
flag table refuses (or notices) as if it had been typed. The MoE and Mamba settings of the list (router, grouped
GEMM, state sizes) are read only with ``num_experts`` / a hybrid pattern, so they follow those two and are not
taken."""

TOKENIZER_FIELDS = ("tokenizer_model", "tokenizer_type")
"""Forced unless ``--no-use-tokenizer-model-from-checkpoint-args``."""

VOCABULARY_FIELDS = (("padded_vocab_size", False),)
"""Taken after the tokenizer's, whatever the tokenizer switch says (Megatron-LM's order)."""

RENAMED = {"add_bias_linear": ("disable_bias_linear", lambda v: not v),
           "add_position_embedding": ("no_position_embedding", lambda v: not v)}
"""Megatron-LM's fields the driver's parser stores inverted under another destination."""

LEFT_TO_THE_LOAD = ("ckpt_format",)
"""Taken by Megatron-LM only where the command line left it None, which it never is (torch_dist by default in
both parsers)."""


@dataclass(frozen=True)
class SavedArgs:
    """What a reader found under ``--load``: the ``args`` a checkpoint saved, as a mapping of Megatron-LM's fields."""

    where: str
    """``DIR: checkpoint iteration N`` (notices and errors put the flag that named DIR before it)."""
    values: Optional[Mapping[str, Any]] = None
    """The saved ``args`` (``vars`` of its Namespace); None: the checkpoint saved none."""
    checkpoint_version: float = 3.0
    """Megatron-LM's ``checkpoint_version`` (below 3.0 the tensor-parallel size is ``model_parallel_size``)."""


Reader = Callable[[Optional[str], Optional[int]], Optional[SavedArgs]]
"""(``--load``, ``--ckpt-step``) -> the checkpoint's saved args, None where ``--load`` holds no checkpoint; a
damaged checkpoint raises :class:`~h3t_training.errors.ArgumentError` (one line)."""


class MissingCheckpointExit(Exception):
    """``--exit-on-missing-checkpoint`` where a directory ``--use-checkpoint-args`` reads holds no checkpoint:
    Megatron-LM's ``load_args_from_checkpoint`` exits there (status 0), before anything else is checked."""

    def __init__(self, flag: str, root: str):
        super().__init__(f"note: no checkpoint in {flag} {root}; --exit-on-missing-checkpoint: exiting ({USE_FLAG} "
                         f"reads the checkpoint's arguments first, as Megatron-LM does)")


@dataclass
class _Taken:
    """What one checkpoint changed: ``field=value`` under Megatron-LM's field names, and the destinations set."""

    fields: list[str] = field(default_factory=list)
    dests: list[str] = field(default_factory=list)

    def note(self, name: str, value: Any, dest: Optional[str] = None) -> None:
        if dest is not None:
            self.dests.append(dest)
        shown = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
        self.fields.append(f"{name}={shown}")


def requested(argv) -> bool:
    """Whether a command line asks for ``--use-checkpoint-args`` (the parser then leaves the shape flags optional)."""
    return USE_FLAG in argv


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _set_parsed(ns: argparse.Namespace, name: str, value: Any, force: bool, taken: _Taken) -> None:
    """Megatron-LM's ``_set_arg`` on one of the driver's own destinations."""
    dest, convert = RENAMED.get(name, (name, None))
    parsed = value if convert is None else convert(value)
    if not force and getattr(ns, dest) is not None:
        return
    if getattr(ns, dest) != parsed:
        setattr(ns, dest, parsed)
        taken.note(name, value, dest)


def _set_feature(ns: argparse.Namespace, name: str, value: Any, taken: _Taken) -> None:
    """A feature the driver does not build, set in the checkpoint: its flag as if it had been typed."""
    flag = _flag(name)
    if flag not in TABLE:
        raise ArgumentError(f"{USE_FLAG}: the checkpoint's args set {name} = {value!r} (a model this driver does not "
                            f"build); load it with Megatron-LM")
    text = True if value is True else [str(v) for v in value] if isinstance(value, (list, tuple)) else str(value)
    if table_value(ns, flag) != text:
        set_table_value(ns, flag, text)
        taken.note(name, value)


def apply(ns: argparse.Namespace, parser: argparse.ArgumentParser,
          found: Sequence[tuple[str, Optional[SavedArgs]]]) -> tuple[argparse.Namespace, tuple[str, ...]]:
    """The flags with the checkpoints' fields taken as Megatron-LM takes them, and the notices that list them.

    ``ns`` is ``parser``'s Namespace (a changed copy is returned); ``found``: (the flag that names the directory,
    what the reader found there) for ``--pretrained-checkpoint`` and then ``--load``, in Megatron-LM's order (so a
    forced field is ``--load``'s, another the first one's that holds it). Raises :class:`ArgumentError` for a value
    the flag's choices do not hold and where a flag the driver requires is neither given nor in a checkpoint."""
    if ns.load is None and ns.pretrained_checkpoint is None:
        raise ArgumentError(f"{USE_FLAG} requires --load or --pretrained-checkpoint (the checkpoint to take the "
                            f"model's arguments from)")
    ns = argparse.Namespace(**vars(ns))
    choices = {a.dest: a.choices for a in parser._actions if a.choices}  # noqa: SLF001 - argparse has no public list
    notes, sources = [], []
    for flag, saved in found:
        if saved is None:
            notes.append(f"note: {USE_FLAG}: {flag} {getattr(ns, flag[2:].replace('-', '_'))} holds no checkpoint")
            sources.append(f"{flag} holds no checkpoint")
        elif saved.values is None:
            notes.append(f"note: {USE_FLAG}: {flag} {saved.where} saved no arguments; using the command line's")
            sources.append(f"{flag} {saved.where} saved no arguments")
        else:
            taken = _Taken()
            _take(ns, dict(saved.values), saved.checkpoint_version, taken)
            for dest in taken.dests:
                if dest in choices and getattr(ns, dest) not in choices[dest]:
                    raise ArgumentError(f"{USE_FLAG}: {flag} {saved.where} has {_flag(dest)} {getattr(ns, dest)!r}, "
                                        f"which this driver does not build (choose from "
                                        f"{', '.join(map(str, choices[dest]))})")
            notes.append(f"note: {USE_FLAG}: from {flag} {saved.where}: "
                         + (", ".join(taken.fields) or "nothing this command line did not already say"))
            sources.append(f"{flag} {saved.where} does not hold them")
    missing = [_flag(n) for n in SHAPE_FLAGS if getattr(ns, n) is None]
    if missing:
        raise ArgumentError(f"the following arguments are required: {', '.join(missing)} ({USE_FLAG}: "
                            f"{'; '.join(sources)})")
    return ns, tuple(notes)


def _take(ns: argparse.Namespace, saved: dict, version: float, taken: _Taken) -> None:
    if "disable_bias_linear" in saved:  # Megatron-LM's one-off conversion of foundation-model checkpoints
        saved["add_bias_linear"] = not saved["disable_bias_linear"]
    # this driver's own files from before it saved Megatron-LM's name for the switch too
    if saved.get("add_position_embedding") is None and saved.get("no_position_embedding") is not None:
        saved["add_position_embedding"] = not saved["no_position_embedding"]
    for name, force in MODEL_FIELDS:
        value = saved.get(name)
        if value is None and name != "num_query_groups":
            continue
        if name == "num_query_groups" and not saved.get("group_query_attention"):
            # read by Megatron-LM only with group_query_attention (its default, 1, is saved either way); the
            # driver's parser holds None for "not given" and refuses a number without the switch
            _set_parsed(ns, name, None, True, taken)
        elif name == "use_rotary_position_embeddings":  # validate_args: the older switch means rope
            if value:
                _set_parsed(ns, "position_embedding_type", "rope", True, taken)
        else:
            _set_parsed(ns, name, value, force, taken)
    for name in FEATURE_FIELDS:
        value = saved.get(name)
        if value not in (None, False, (), []):
            _set_feature(ns, name, value, taken)
    if ns.use_tokenizer_model_from_checkpoint_args:
        for name in TOKENIZER_FIELDS:
            if saved.get(name) is not None:
                _set_parsed(ns, name, saved[name], True, taken)
    for name, force in VOCABULARY_FIELDS:
        if saved.get(name) is not None:
            _set_parsed(ns, name, saved[name], force, taken)
    if ns.use_mp_args_from_checkpoint_args:
        if version < 3.0:
            if saved.get("model_parallel_size") is not None:
                _set_parsed(ns, "tensor_model_parallel_size", saved["model_parallel_size"], False, taken)
            return
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
            if saved.get(name) is not None:
                _set_parsed(ns, name, saved[name], True, taken)
        if saved.get("num_layers_per_virtual_pipeline_stage") is not None:  # the virtual size follows from it
            _set_parsed(ns, "num_layers_per_virtual_pipeline_stage", saved["num_layers_per_virtual_pipeline_stage"],
                        False, taken)
        if (saved.get("expert_model_parallel_size") or 1) > 1:
            _set_feature(ns, "expert_model_parallel_size", saved["expert_model_parallel_size"], taken)


_PLAIN = (type(None), bool, int, float, str)


def _plain(value: Any) -> bool:
    """A value any reader unpickles (``torch.load``'s weights-only one too): exact built-in types, so a str enum is
    not one."""
    if type(value) in (list, tuple):
        return all(type(v) in _PLAIN for v in value)
    return type(value) in _PLAIN


def megatron_args(config, padded_vocab_size: int) -> argparse.Namespace:
    """The ``args`` entry this driver saves with a checkpoint: every flag under its destination (plain values
    only, an enum as its value, so reading it needs neither this package nor megatron-core), with Megatron-LM's
    names for the fields the driver's parser stores otherwise (``add_bias_linear``, ``add_position_embedding``) and
    the padded vocabulary."""
    values = {k: v.value if isinstance(v, enum.Enum) else v for k, v in config.as_dict().items()
              if not k.startswith("_")}
    values = {k: v for k, v in values.items() if _plain(v)}
    for megatron_name, (dest, convert) in RENAMED.items():
        values[megatron_name] = convert(values[dest])
    values.update(padded_vocab_size=padded_vocab_size, use_rotary_position_embeddings=False)
    return argparse.Namespace(**values)


__all__ = ["FEATURE_FIELDS", "LEFT_TO_THE_LOAD", "MODEL_FIELDS", "MissingCheckpointExit", "Reader", "SHAPE_FLAGS",
           "SavedArgs", "TOKENIZER_FIELDS", "USE_FLAG", "VOCABULARY_FIELDS", "apply", "megatron_args", "requested"]
