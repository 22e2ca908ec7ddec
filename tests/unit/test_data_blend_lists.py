"""Megatron's blend lists (``--data-path``, the per-split paths and the lines of its blend files) read as Megatron-LM
reads them: megatron-core's ``get_blend_from_list`` is the reference, and Megatron's blend files are checked in one
line each."""
from __future__ import annotations

import json

import pytest

from h3t_training.data.data_args_files import DataArgsFileError, read_data_args, read_per_split_data_args
from h3t_training.data.data_checks import DataFileError, parse_blend


@pytest.mark.parametrize("data_path", [
    ["a"],
    ["1", "a"],
    ["0.3", "a", "0.7", "b"],
    ["30", "a", "70", "b", "1e-3", "c"],
    ["a", "b"],  # prefixes alone: megatron-core weighs each dataset by its size
    ["a", "b", "c"],
    ["a", "b", "c", "d"],
    [" a", "b "],  # Megatron strips each prefix
])
def test_blend_lists_read_as_megatron_core_reads_them(data_path):
    from megatron.core.datasets.utils import get_blend_from_list

    prefixes, weights = get_blend_from_list(list(data_path))
    assert parse_blend(list(data_path)) == (prefixes, None if weights is None else [float(w) for w in weights])


@pytest.mark.parametrize("data_path, expected", [
    ([], "names no dataset prefix"),
    (["0.5", "a", "b", "c"], "'b' stands where a weight belongs"),  # megatron-core takes '0.5' for a prefix here
    (["-1", "a"], "weight -1 of a is outside (0, inf)"),
    (["0", "a", "1", "b"], "weight 0 of a is outside"),
    (["nan", "a"], "weight nan of a"),
    (["inf", "a"], "weight inf of a"),
])
def test_bad_blend_lists_are_one_line(data_path, expected):
    with pytest.raises(DataFileError, match="^--valid-data-path") as e:
        parse_blend(data_path, "--valid-data-path")
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_a_data_args_file_is_its_words(tmp_path):
    f = tmp_path / "blend.txt"
    f.write_text("0.3 /data/a_text_document\n\t0.7   /data/b_text_document\n\n")
    assert read_data_args(str(f)) == ["0.3", "/data/a_text_document", "0.7", "/data/b_text_document"]


def test_a_per_split_file_takes_lists_strings_and_null(tmp_path):
    f = tmp_path / "splits.json"
    f.write_text(json.dumps({"train": ["0.4", "a", "0.6", "b"], "valid": "c  d", "test": None, "note": 1}))
    assert read_per_split_data_args(str(f)) == {"train": ["0.4", "a", "0.6", "b"], "valid": ["c", "d"], "test": None}


@pytest.mark.parametrize("content, expected", [
    ("", "is not JSON (line 1"),
    ("[1, 2]", "holds a JSON list; expected an object with the keys train, valid, test"),
    ('{"train": "a", "valid": null}', "lacks the key(s) test"),
    ('{"train": ["a", 1], "valid": null, "test": null}', "'train' holds the JSON number 1; its items are strings"),
    ('{"train": 3, "valid": null, "test": null}', "'train' is a JSON number"),
    ('{"train": "a", "valid": [], "test": null}', "'valid' names no dataset prefix (give null for no valid data)"),
    ('{"train": "a", "valid": "  ", "test": null}', "'valid' names no dataset prefix"),
])
def test_bad_per_split_files_are_one_line(tmp_path, content, expected):
    f = tmp_path / "splits.json"
    f.write_text(content)
    with pytest.raises(DataArgsFileError) as e:
        read_per_split_data_args(str(f))
    assert str(e.value).startswith(f"--per-split-data-args-path {f}") and expected in str(e.value), str(e.value)


def test_unreadable_blend_files_are_one_line(tmp_path):
    (tmp_path / "empty.txt").write_text(" \n")
    (tmp_path / "latin1.txt").write_bytes(b"\xff\xfe a")
    cases = [(read_data_args, tmp_path / "missing.txt", "--data-args-path", "cannot be read (No such file"),
             (read_data_args, tmp_path, "--data-args-path", "is a directory, not a file"),
             (read_data_args, tmp_path / "empty.txt", "--data-args-path", "holds no dataset prefix"),
             (read_data_args, tmp_path / "latin1.txt", "--data-args-path", "cannot be read (UnicodeDecodeError)"),
             (read_per_split_data_args, tmp_path / "missing.json", "--per-split-data-args-path", "cannot be read")]
    for read, path, flag, expected in cases:
        with pytest.raises(DataArgsFileError) as e:
            read(str(path))
        assert str(e.value).startswith(f"{flag} {path}") and expected in str(e.value), str(e.value)
