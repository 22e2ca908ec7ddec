"""Bad data files and data flags end in one line naming the file or flag (exit 2), before any rank starts."""
from __future__ import annotations

import shutil
import struct
import subprocess

import pytest

from driver_harness import PYTHON, REPO, TINY_MODEL, _env, corpus_prefix  # noqa: F401
from h3t_training.data.data_checks import DataFileError, check_indexed_dataset, parse_split


def _run(argv):
    return subprocess.run([PYTHON, str(REPO / "pretrain_llama.py"), *TINY_MODEL, "--global-batch-size", "2",
                           "--train-iters", "1", *argv], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=120)


def _one_line(proc) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture()
def copy(corpus_prefix, tmp_path):  # noqa: F811
    dst = tmp_path / "d"
    for ext in (".bin", ".idx"):
        shutil.copy(corpus_prefix + ext, str(dst) + ext)
    return str(dst)


def _damage(prefix: str, how: str) -> None:
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    if how == "empty idx":
        open(idx, "wb").close()
    elif how == "garbage idx":
        open(idx, "wb").write(b"garbage" * 100)
    elif how == "truncated idx":
        data = open(idx, "rb").read()
        open(idx, "wb").write(data[:len(data) // 2])
    elif how == "truncated bin":
        data = open(bin_, "rb").read()
        open(bin_, "wb").write(data[:-10])
    elif how == "bad version":
        data = bytearray(open(idx, "rb").read())
        data[9:17] = struct.pack("<Q", 7)
        open(idx, "wb").write(bytes(data))
    elif how == "empty bin":
        open(bin_, "wb").close()


@pytest.mark.parametrize("how, expected", [
    ("empty idx", "is not a megatron-core index file"),
    ("garbage idx", "is not a megatron-core index file"),
    ("truncated idx", "is truncated"),
    ("truncated bin", "(truncated or not its pair)"),
    ("empty bin", "has 0 bytes"),
    ("bad version", "has index version 7"),
])
def test_damaged_dataset_is_one_line(copy, how, expected):
    _damage(copy, how)
    with pytest.raises(DataFileError, match=r"\.(idx|bin)"):
        check_indexed_dataset(copy)
    line = _one_line(_run(["--data-path", copy]))
    assert expected in line and (copy + ".idx" in line or copy + ".bin" in line)


@pytest.mark.parametrize("argv, expected", [
    (["--split", "abc"], "--split 'abc' is not comma-separated numbers"),
    (["--split", "0,100,0"], "--split 0,100,0 leaves no training data"),
    (["--split", "1,-1,0"], "takes up to three finite non-negative shares"),
])
def test_bad_split_is_one_line(corpus_prefix, argv, expected):  # noqa: F811
    assert expected in _one_line(_run(["--data-path", corpus_prefix, *argv]))


def test_odd_blends_are_one_line(corpus_prefix):  # noqa: F811
    assert "takes a weight before each" in _one_line(_run(["--data-path", "0.5", corpus_prefix, corpus_prefix]))
    assert "stands where a weight belongs" in _one_line(_run(["--data-path", corpus_prefix, corpus_prefix]))
    assert "weight -1 of" in _one_line(_run(["--data-path", "-1", corpus_prefix]))


def test_token_ids_beyond_the_vocabulary_are_named(corpus_prefix):  # noqa: F811
    line = _one_line(_run(["--data-path", corpus_prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]))
    assert "outside the tokenizer's vocabulary of 101" in line


def test_a_good_dataset_passes(corpus_prefix):  # noqa: F811
    assert check_indexed_dataset(corpus_prefix) > 10
    assert parse_split("969,30,1") == (969.0, 30.0, 1.0) and parse_split("98/2") == (98.0, 2.0, 0.0)
