"""Checks of megatron-core indexed datasets (``PREFIX.idx`` + ``PREFIX.bin``) before any rank starts.

megatron-core reads a damaged file with asserts and numpy errors deep in its dataset builder, on
every rank. :func:`check_indexed_dataset` reads only the index header and arrays and answers in
one line what is wrong, naming the file.

The index format (megatron-core's ``IndexedDatasetBuilder``): the 9-byte magic ``MMIDIDX\\0\\0``,
a little-endian uint64 version (1), a uint8 token dtype code, uint64 sequence and document
counts, then int32 sequence lengths, int64 byte pointers into the ``.bin`` file, int64 document
boundaries (and, in multimodal data, int8 sequence modes).
"""
from __future__ import annotations

import os
import struct
from typing import Optional

import numpy

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_BYTES = len(INDEX_MAGIC) + 8 + 1 + 8 + 8
"""Magic, version, dtype code, sequence count, document count."""
TOKEN_DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64, 6: numpy.float64,
                7: numpy.float32, 8: numpy.uint16}
"""megatron-core's dtype codes of the token ids (``DType``)."""


class DataFileError(ValueError):
    """An indexed dataset that cannot be read; one line naming the file and what is wrong."""


def check_indexed_dataset(prefix: str, vocab_size: int | None = None) -> int:
    """Check ``prefix.idx``/``prefix.bin``; returns the number of documents."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_):
        if not os.path.isfile(path):
            raise DataFileError(f"--data-path {prefix}: {path} does not exist (make it with tools/preprocess_data.py)")
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise DataFileError(f"{idx} is not a megatron-core index file (bad or missing header)")
        version, code, sequences, documents = struct.unpack("<QBQQ", head[len(INDEX_MAGIC):])
        if version != INDEX_VERSION:
            raise DataFileError(f"{idx} has index version {version}; this reader knows version {INDEX_VERSION}")
        if code not in TOKEN_DTYPES:
            raise DataFileError(f"{idx} names token dtype code {code}, which megatron-core does not define")
        arrays = sequences * (4 + 8) + documents * 8
        if size < HEADER_BYTES + arrays:
            raise DataFileError(f"{idx} is truncated: {size} bytes, its header announces {HEADER_BYTES + arrays}")
        if sequences == 0 or documents < 2:
            raise DataFileError(f"{idx} holds no documents")
        lengths = numpy.frombuffer(f.read(sequences * 4), dtype=numpy.int32)
        pointers = numpy.frombuffer(f.read(sequences * 8), dtype=numpy.int64)
        bounds = numpy.frombuffer(f.read(documents * 8), dtype=numpy.int64)
    itemsize = numpy.dtype(TOKEN_DTYPES[code]).itemsize
    if (lengths < 0).any() or pointers[0] != 0 or (numpy.diff(pointers) != lengths[:-1].astype(numpy.int64) * itemsize).any():
        raise DataFileError(f"{idx} is corrupt: its sequence lengths and byte offsets disagree")
    if bounds[0] != 0 or bounds[-1] != sequences or (numpy.diff(bounds) < 0).any():
        raise DataFileError(f"{idx} is corrupt: its document boundaries are not increasing from 0 to {sequences}")
    need = int(pointers[-1]) + int(lengths[-1]) * itemsize
    have = os.path.getsize(bin_)
    if have != need:
        raise DataFileError(f"{bin_} has {have} bytes, its index {idx} describes {need} (truncated or not its pair)")
    if vocab_size is not None and have and numpy.issubdtype(TOKEN_DTYPES[code], numpy.integer):
        tokens = numpy.memmap(bin_, dtype=TOKEN_DTYPES[code], mode="r")
        top = int(tokens.max())
        if top >= vocab_size or int(tokens.min()) < 0:
            raise DataFileError(f"{bin_} holds token id {top}, outside the tokenizer's vocabulary of {vocab_size} "
                                f"(made with another tokenizer?)")
    return documents - 1


def _number(token: str) -> Optional[float]:
    try:
        return float(token)
    except ValueError:
        return None


Blend = tuple[list[str], Optional[list[float]]]
"""megatron-core's blend: the dataset prefixes and their weights, or None (each dataset's size weighs it)."""


def parse_blend(data_path: list[str], flag: str = "--data-path") -> Blend:
    """Megatron's ``--data-path`` list as megatron-core's blend, read as Megatron-LM's ``get_blend_from_list`` reads
    it: an odd count is prefixes alone; an even count is ``weight prefix`` pairs when every first of a pair is a
    number and prefixes alone when none is (megatron-core then weighs each dataset by its size and builds one epoch
    of each). A mix of the two, a weight that is not positive and finite, or an empty list is one line naming
    ``flag``."""
    if not data_path:
        raise DataFileError(f"{flag} names no dataset prefix")
    weights = None if len(data_path) % 2 else [_number(token) for token in data_path[0::2]]
    if weights is None or all(w is None for w in weights):
        return [p.strip() for p in data_path], None
    if any(w is None for w in weights):
        bad = next(t for t, w in zip(data_path[0::2], weights) if w is None)
        raise DataFileError(f"{flag}: {bad!r} stands where a weight belongs: give weight prefix pairs, or prefixes "
                            f"alone ({len(data_path)} items)")
    for w, prefix in zip(weights, data_path[1::2]):
        if not w > 0 or w == float("inf"):
            raise DataFileError(f"{flag} weight {w:g} of {prefix} is outside (0, inf)")
    return [p.strip() for p in data_path[1::2]], weights


def parse_split(text: str, *, allow_no_train: bool = False) -> tuple[float, float, float]:
    """Megatron's ``--split 969,30,1`` (or ``98/2/0``) as three non-negative shares (with training data
    unless ``allow_no_train``: evaluation alone)."""
    parts = [p for p in text.replace("/", ",").split(",")]
    try:
        shares = [float(p) for p in parts]
    except ValueError:
        raise DataFileError(f"--split {text!r} is not comma-separated numbers (e.g. 969,30,1)") from None
    if not 1 <= len(shares) <= 3 or any(s < 0 or s != s or s == float("inf") for s in shares):
        raise DataFileError(f"--split {text!r} takes up to three finite non-negative shares (train,valid,test)")
    shares += [0.0] * (3 - len(shares))
    if shares[0] <= 0 and not allow_no_train:
        raise DataFileError(f"--split {text} leaves no training data (its first share is 0)")
    return shares[0], shares[1], shares[2]


__all__ = ["Blend", "DataFileError", "check_indexed_dataset", "parse_blend", "parse_split"]
