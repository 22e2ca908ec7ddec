"""Megatron's ``--tokenizer-type TikTokenizer``: a tiktoken byte-level BPE read from Megatron's JSON vocabulary.

The file (``--tokenizer-model``, a ``.json``) is a list of ``{"rank", "token_bytes", "token_str"}`` objects, rank
``i`` at position ``i``, ``token_bytes`` the token's bytes in base64, the first 256 the single bytes 0..255. The
model's ids put ``--tiktoken-num-special-tokens`` (default 1000) special tokens first: the named ones, then
``<SPECIAL_i>`` fillers; the BPE ranks follow, shifted by that count and cut so that the ids fill ``--vocab-size``
(default 2**17). Documents end with ``</s>`` (id 2). Text is split by the ``--tiktoken-pattern`` regex (``v1`` or
``v2``, default ``v2``) before the merges. Megatron-LM's two tokenizer systems
(``megatron_release.CORE_TOKENIZERS_FROM``):

- ``megatron.core.tokenizers`` (0.17+, and 0.16 unless ``--legacy-tokenizer``): the named specials are ``<unk>``,
  ``<s>``, ``</s>``, ``<mask>``, ``<pad>``, ``<cls>``, ``<sep>``; a special token written in a text is that token's
  id; ``<pad>`` (id 4) is the padding id, whose labels the loss leaves out.
- 0.16's legacy ``CustomTikTokenizer`` (``--legacy-tokenizer``): the named specials are ``<unk>``, ``<s>``, ``</s>``;
  special tokens written in a text are plain text; the GPT datasets get no padding id. 0.16's pretraining builds it
  for the padded vocabulary even without the flag, and it asserts a ``--tiktoken-pattern`` (``pattern_required``).
"""
from __future__ import annotations

import base64
import binascii
import json
import os
from collections import OrderedDict
from typing import Optional

import numpy

DEFAULT_VOCAB_SIZE = 2 ** 17
"""Megatron's vocabulary when ``--vocab-size`` is not given (both releases)."""
DEFAULT_NUM_SPECIAL_TOKENS = 1000
"""Megatron-LM's ``--tiktoken-num-special-tokens`` default."""
LEGACY_SPECIALS = ("<unk>", "<s>", "</s>")
CORE_SPECIALS = LEGACY_SPECIALS + ("<mask>", "<pad>", "<cls>", "<sep>")

# The split before the merges. v1: an optional non-letter/digit (not a line break) glued to a run of letters, one
# digit, punctuation runs with an optional leading space and trailing line breaks, line breaks with the spaces
# before them, then spaces. v2 (o200k-style casing): a word is an optional leading non-letter, then upper-case
# letters followed by lower-case ones, or the reverse; digits one at a time; punctuation may keep a trailing "/".
_NOT_LETTER_DIGIT_BREAK = r"[^\r\n\p{L}\p{N}]"
_UPPERISH = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWERISH = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
PATTERNS = {
    "v1": "|".join((_NOT_LETTER_DIGIT_BREAK + r"?+\p{L}+", r"\p{N}", r" ?[^\s\p{L}\p{N}]++[\r\n]*", r"\s*[\r\n]",
                    r"\s+(?!\S)", r"\s+")),
    "v2": "|".join((_NOT_LETTER_DIGIT_BREAK + "?" + _UPPERISH + "*" + _LOWERISH + "+",
                    _NOT_LETTER_DIGIT_BREAK + "?" + _UPPERISH + "+" + _LOWERISH + "*", r"\p{N}",
                    r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+")),
}


class TikTokenError(ValueError):
    """A TikTokenizer file or setting that cannot be used; one line naming the flag."""


def read_ranks(path: str, max_entries: int) -> dict[bytes, int]:
    """The BPE ranks of Megatron's JSON vocabulary, its first ``max_entries`` entries (each checked)."""
    if not path.endswith(".json"):
        raise TikTokenError(f"--tokenizer-model {path}: TikTokenizer reads a .json vocabulary (Megatron's format)")
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, ValueError) as e:
        raise TikTokenError(f"--tokenizer-model {path} is not a JSON file ({str(e).splitlines()[0]})") from None
    if not isinstance(vocab, list):
        raise TikTokenError(f"--tokenizer-model {path}: a TikTokenizer vocabulary is a JSON list, got "
                            f"{type(vocab).__name__}")
    ranks: dict[bytes, int] = {}
    for i, entry in enumerate(vocab[:max_entries]):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"} or entry["rank"] != i:
            raise TikTokenError(f"--tokenizer-model {path}: entry {i} must be {{rank: {i}, token_bytes, token_str}}")
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, TypeError, ValueError):
            raise TikTokenError(f"--tokenizer-model {path}: entry {i}'s token_bytes is not base64") from None
        if i < 256 and token != bytes([i]):
            raise TikTokenError(f"--tokenizer-model {path}: entry {i} must be the single byte {i} (the first 256 "
                                "entries are the bytes)")
        if token in ranks:
            raise TikTokenError(f"--tokenizer-model {path}: entry {i} repeats entry {ranks[token]}'s bytes")
        ranks[token] = i
    return ranks


class TikTokenizer:
    """Megatron's TikTokenizer: ``legacy``, 0.16's legacy system (``--legacy-tokenizer``), else
    ``megatron.core.tokenizers``'; ``pattern_required``: Megatron-LM builds the legacy one too (0.16's
    pretraining), which needs ``--tiktoken-pattern``."""

    def __init__(self, path: str, *, pattern: Optional[str] = None, vocab_size: Optional[int] = None,
                 num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS, legacy: bool = False,
                 pattern_required: bool = False) -> None:
        import tiktoken

        if pattern is None and (legacy or pattern_required):
            raise TikTokenError("--tokenizer-type TikTokenizer needs --tiktoken-pattern {v1,v2} (Megatron-LM 0.16's "
                                "legacy tokenizer requires it; its pretraining builds that one for the vocabulary)")
        pattern = "v2" if pattern is None else pattern
        if pattern not in PATTERNS:
            raise TikTokenError(f"--tiktoken-pattern {pattern!r} is not one of v1, v2")
        self.vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
        named = LEGACY_SPECIALS if legacy else CORE_SPECIALS
        if not len(named) <= num_special_tokens < self.vocab_size:
            raise TikTokenError(f"--tiktoken-num-special-tokens {num_special_tokens} is outside [{len(named)}, "
                                f"{self.vocab_size - 1}] (the named special tokens up to --vocab-size - 1)")
        inner = self.vocab_size - num_special_tokens
        ranks = read_ranks(path, inner)
        if len(ranks) < inner:
            raise TikTokenError(f"--tokenizer-model {path} has {len(ranks)} entries; --vocab-size {self.vocab_size} "
                                f"with {num_special_tokens} special tokens needs {inner}")
        specials = list(named) + [f"<SPECIAL_{i}>" for i in range(len(named), num_special_tokens)]
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))), pat_str=PATTERNS[pattern],
            mergeable_ranks={t: r + num_special_tokens for t, r in ranks.items()},
            special_tokens={t: i for i, t in enumerate(specials)})
        self._legacy = legacy
        self.bos = specials.index("<s>")
        self.eod = specials.index("</s>")
        self.pad = -1 if legacy else specials.index("<pad>")
        self.unique_identifiers = OrderedDict(**{"class": "TikTokenizer", "source": os.path.abspath(path),
                                                 "pattern": pattern, "vocab_size": self.vocab_size,
                                                 "num_special_tokens": num_special_tokens, "legacy": legacy})

    def tokenize(self, text: str) -> list[int]:
        if self._legacy:
            return self._encoding.encode_ordinary(text)
        return self._encoding.encode(text, allowed_special="all")

    def detokenize(self, ids) -> str:
        return self._encoding.decode([int(i) for i in numpy.asarray(ids).ravel() if int(i) != self.eod])


__all__ = ["DEFAULT_NUM_SPECIAL_TOKENS", "DEFAULT_VOCAB_SIZE", "PATTERNS", "TikTokenError", "TikTokenizer",
           "read_ranks"]
