"""Self-contained tokenizers (no model hub): bytes, and Megatron's NullTokenizer.

They carry the attributes megatron-core's GPT datasets read (``vocab_size``, ``eod``, ``pad``,
``unique_identifiers``) and ``tokenize``/``detokenize`` for tools/preprocess_data.py.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy


class ByteTokenizer:
    """UTF-8 bytes 0..255, then end-of-document 256 and padding 257."""

    def __init__(self) -> None:
        self.vocab_size = 258
        self.eod = 256
        self.pad = 257
        self.unique_identifiers = OrderedDict(**{"class": type(self).__name__})

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class NullTokenizer:
    """Megatron's NullTokenizer: text is whitespace-separated integer ids; eod is the last id."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size + 1
        self.eod = vocab_size
        self.pad = vocab_size
        self.unique_identifiers = OrderedDict(**{"class": type(self).__name__, "vocab_size": vocab_size})

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in numpy.asarray(ids).ravel())


def build_tokenizer(tokenizer_type: str, vocab_size: int | None = None):
    """The tokenizer named by ``--tokenizer-type``."""
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    if tokenizer_type == "NullTokenizer":
        assert vocab_size is not None
        return NullTokenizer(vocab_size)
    raise ValueError(f"unknown tokenizer type {tokenizer_type!r}")


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_model_parallel_size: int) -> int:
    """Megatron's padding: a multiple of ``--make-vocab-size-divisible-by`` x TP size."""
    q = divisible_by * tensor_model_parallel_size
    return -(-vocab_size // q) * q
