#!/usr/bin/env python3
"""Turn a local text corpus (jsonl with a text key, or plain text) into megatron-core indexed data.

Writes ``<output-prefix>_<json-key>_document.bin/.idx`` (Megatron's naming) with megatron-core's
``IndexedDatasetBuilder``; every document ends with the tokenizer's end-of-document id.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/stdlib \\
        --tokenizer-type ByteTokenizer
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import warnings  # noqa: E402

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
import numpy  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path  # noqa: E402
from megatron.training.tokenizer import build_tokenizer  # noqa: E402


def documents(path: str, json_key: str, plain: bool):
    """Yield the text of each document: one per jsonl line, or blank-line-separated paragraphs."""
    with open(path, encoding="utf-8") as f:
        if plain:
            text = f.read()
            for doc in re.split(r"\n\s*\n", text):
                if doc.strip():
                    yield doc
            return
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)[json_key]
            except (ValueError, KeyError) as e:
                raise SystemExit(f"preprocess_data.py: error: {path}:{n}: not a json object with key "
                                 f"{json_key!r} ({e})") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Tokenize a text corpus into megatron-core .bin/.idx files.")
    p.add_argument("--input", required=True, help="jsonl file (one {json-key: text} per line) or plain text")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--json-keys", default="text")
    p.add_argument("--tokenizer-type", choices=("ByteTokenizer", "NullTokenizer"), default="ByteTokenizer")
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--append-eod", action="store_true", default=True)
    args = p.parse_args(argv)
    if not os.path.isfile(args.input):
        p.error(f"--input {args.input} does not exist")
    plain = not args.input.endswith((".json", ".jsonl"))
    tok = build_tokenizer(args.tokenizer_type, args.vocab_size)
    prefix = f"{args.output_prefix}_{args.json_keys}_document"
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    dtype = numpy.uint16 if tok.vocab_size < 65500 else numpy.int32
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
    ndocs = ntok = 0
    for text in documents(args.input, args.json_keys, plain):
        ids = tok.tokenize(text) + ([tok.eod] if args.append_eod else [])
        builder.add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
        ndocs, ntok = ndocs + 1, ntok + len(ids)
    builder.finalize(get_idx_path(prefix))
    print(f"wrote {ndocs} documents, {ntok} tokens to {prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
