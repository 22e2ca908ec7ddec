"""Megatron-LM's data-blend files: ``--data-args-path`` and ``--per-split-data-args-path``.

A blend of thousands of datasets does not fit a command line, so Megatron-LM reads it from a file
(``get_blend_and_blend_per_split`` in megatron/training/utils.py, 0.16; utils/common_utils.py, 0.19):

* ``--data-args-path FILE``: the file's text, split on whitespace, is the ``--data-path`` list
  (``[weight] prefix ...``);
* ``--per-split-data-args-path FILE``: a JSON object whose ``train``, ``valid`` and ``test`` keys are
  each a list of strings, one whitespace-separated string, or null (no data for that split): the
  ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` lists.

The lists read here are then what the corresponding flags would have been, checked by the same
rules (:func:`~h3t_training.data.data_checks.parse_blend`). A file that cannot be read, is not the
right shape or names no prefix is a :class:`DataArgsFileError`, one line naming the flag and file.
"""
from __future__ import annotations

import json
from typing import Optional

SPLIT_KEYS = ("train", "valid", "test")
"""The keys of a ``--per-split-data-args-path`` file, in Megatron's split order; each is required."""


_JSON_TYPES = {bool: "boolean", int: "number", float: "number", str: "string", list: "list", dict: "object"}


def _json_type(value) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


class DataArgsFileError(ValueError):
    """A data-blend file that cannot be used; one line naming the flag, the file and what is wrong."""


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except IsADirectoryError:
        raise DataArgsFileError(f"{flag} {path} is a directory, not a file") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise DataArgsFileError(f"{flag} {path} cannot be read ({reason})") from None


def read_data_args(path: str) -> list[str]:
    """The ``--data-path`` list held by a ``--data-args-path`` file (its whitespace-separated words)."""
    words = _read_text(path, "--data-args-path").split()
    if not words:
        raise DataArgsFileError(f"--data-args-path {path} holds no dataset prefix (expected '[weight] prefix ...')")
    return words


def _split_list(value, key: str, path: str) -> Optional[list[str]]:
    where = f"--per-split-data-args-path {path}: {key!r}"
    if value is None:
        return None
    if isinstance(value, str):
        value = value.split()
    elif isinstance(value, list) and not all(isinstance(v, str) for v in value):
        bad = next(v for v in value if not isinstance(v, str))
        raise DataArgsFileError(f"{where} holds the JSON {_json_type(bad)} {json.dumps(bad)}; its items are strings "
                                "('weight', 'prefix', ...)")
    elif not isinstance(value, list):
        raise DataArgsFileError(f"{where} is a JSON {_json_type(value)}; expected a list of strings, one string "
                                "'[weight] prefix ...', or null")
    if not value:
        raise DataArgsFileError(f"{where} names no dataset prefix (give null for no {key} data)")
    return list(value)


def read_per_split_data_args(path: str) -> dict[str, Optional[list[str]]]:
    """``{"train": list or None, "valid": ..., "test": ...}`` from a ``--per-split-data-args-path`` JSON file."""
    flag = "--per-split-data-args-path"
    text = _read_text(path, flag)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        reason = f"line {e.lineno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else "nested too deep"
        raise DataArgsFileError(f"{flag} {path} is not JSON ({reason})") from None
    if not isinstance(data, dict):
        raise DataArgsFileError(f"{flag} {path} holds a JSON {_json_type(data)}; expected an object with the "
                                f"keys {', '.join(SPLIT_KEYS)}")
    missing = [k for k in SPLIT_KEYS if k not in data]
    if missing:
        raise DataArgsFileError(f"{flag} {path} lacks the key(s) {', '.join(missing)} (Megatron-LM reads all of "
                                f"{', '.join(SPLIT_KEYS)}; null for a split without data)")
    return {k: _split_list(data[k], k, path) for k in SPLIT_KEYS}


__all__ = ["DataArgsFileError", "SPLIT_KEYS", "read_data_args", "read_per_split_data_args"]
