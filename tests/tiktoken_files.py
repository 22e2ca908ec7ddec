"""A tiktoken vocabulary in Megatron's JSON format, trained here (byte-level BPE) on the texts a test gives."""
from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path

import regex


def train_ranks(texts: list[str], size: int, pattern: str) -> list[bytes]:
    """``size`` BPE tokens: the 256 bytes, then the most frequent adjacent pair of each round merged (ties broken
    by the pair's bytes, so the result is deterministic)."""
    words: Counter = Counter()
    for text in texts:
        for piece in regex.findall(pattern, text):
            words[tuple(bytes([b]) for b in piece.encode("utf-8"))] += 1
    ranks = [bytes([i]) for i in range(256)]
    known = set(ranks)
    while len(ranks) < size:
        pairs: Counter = Counter()
        for word, n in words.items():
            for a, b in zip(word, word[1:]):
                pairs[a, b] += n
        if not pairs:
            raise ValueError(f"the texts give only {len(ranks)} tokens")
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if a + b not in known:
            ranks.append(a + b)
            known.add(a + b)
        merged: Counter = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return ranks


def write_vocab(ranks: list[bytes], path: Path) -> Path:
    path.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode("ascii"),
                                 "token_str": t.decode("utf-8", errors="replace")} for i, t in enumerate(ranks)]))
    return path
