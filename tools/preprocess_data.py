#!/usr/bin/env python3
"""Tokenize a local corpus into megatron-core indexed data, with Megatron's flags.

JSON lines (one object per line, the text under each of ``--json-keys``) or, for a file not
named ``.json``/``.jsonl``, plain text split into documents at blank lines. Writes
``<output-prefix>_<key>_document.bin/.idx`` per key with megatron-core's ``IndexedDatasetBuilder``
(Megatron's naming and format). ``--append-eod`` ends every document with the tokenizer's
end-of-document id (off by default, as in Megatron). ``--workers N`` tokenizes in N processes;
a progress bar on stderr follows the bytes read.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from h3t_training.launch.quiet_imports import ignore_optional_accelerator_warnings  # noqa: E402

ignore_optional_accelerator_warnings()
import numpy  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path  # noqa: E402
from h3t_training.data.tokenizer import TokenizerError, add_tokenizer_flags, tokenizer_from_args  # noqa: E402

PROG = "preprocess_data.py"


class InputError(Exception):
    """A corpus line that cannot be read; one line naming the file and line."""


def _records(path: str, keys: list[str], plain: bool):
    """Yield (bytes consumed, {key: text}) per document."""
    with open(path, encoding="utf-8") as f:
        if plain:
            for doc in re.split(r"\n\s*\n", f.read()):
                if doc.strip():
                    yield len(doc.encode()) + 2, {keys[0]: doc}
            return
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                yield len(line.encode()), {k: obj[k] for k in keys}
            except (ValueError, KeyError, TypeError) as e:
                raise InputError(f"{path}:{n}: not a json object with key(s) {', '.join(map(repr, keys))} "
                                 f"({type(e).__name__}: {e})") from None


class _Encoder:
    """Tokenizes one record; built once per worker process."""

    tokenizer = None

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def initializer(self) -> None:
        _Encoder.tokenizer = tokenizer_from_args(self.args, pretraining=False)

    def encode(self, item):
        nbytes, texts = item
        tok = _Encoder.tokenizer
        out = {}
        for key, text in texts.items():
            ids = tok.tokenize(text)
            if self.args.append_eod:
                ids = list(ids) + [tok.eod]
            out[key] = ids
        return nbytes, out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Tokenize a corpus into megatron-core .bin/.idx files.")
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSON lines file, or plain text (documents at blank lines)")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys of the text in each JSON object")
    g.add_argument("--split-sentences", action="store_true", help="(refused: needs nltk's punkt data)")
    g.add_argument("--keep-newlines", action="store_true", help="kept for Megatron's command lines; newlines are kept")
    g = p.add_argument_group("tokenizer")
    add_tokenizer_flags(g)
    g.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document id")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True)
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--partitions", type=int, default=1, help="only 1 (one output file per key)")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between progress updates")
    g.add_argument("--no-progress-bar", action="store_true")
    return p


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace):
    if not os.path.isfile(args.input):
        p.error(f"--input {args.input} does not exist")
    for flag, value in (("--workers", args.workers), ("--log-interval", args.log_interval)):
        if value < 1:
            p.error(f"{flag} {value} is outside [1, inf)")
    if args.partitions != 1:
        p.error(f"--partitions {args.partitions}: only 1 is supported (one .bin/.idx pair per key)")
    if args.split_sentences:
        p.error("--split-sentences needs nltk's punkt sentence splitter, which is not available here; "
                "leave it out (documents are kept whole)")
    try:
        return tokenizer_from_args(args, pretraining=False)
    except TokenizerError as e:
        p.error(str(e))


class _Progress:
    """A progress bar on a terminal (rich), else one line per ``--log-interval`` documents."""

    def __init__(self, total_bytes: int, log_interval: int, bar: bool):
        self.total, self.log_interval, self.done, self.docs = total_bytes, log_interval, 0, 0
        self._bar = None
        if bar:
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(),
                                 TextColumn("{task.fields[docs]} docs"), TimeRemainingColumn(),
                                 console=Console(stderr=True))
            self._task = self._bar.add_task("tokenize", total=total_bytes, docs=0)
            self._bar.start()

    def advance(self, nbytes: int) -> None:
        self.done, self.docs = self.done + nbytes, self.docs + 1
        if self._bar is not None:
            self._bar.update(self._task, advance=nbytes, docs=self.docs)
        elif self.docs % self.log_interval == 0:
            sys.stderr.write(f"processed {self.docs} documents ({self.done / 2**20:.1f} of "
                             f"{self.total / 2**20:.1f} MiB)\n")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def main(argv=None) -> int:
    p = build_parser()
    p.error = lambda message: (sys.stderr.write(f"{PROG}: error: {message}\n"), sys.exit(2))  # one line
    args = p.parse_args(argv)
    tok = _validate(p, args)
    plain = not args.input.endswith((".json", ".jsonl"))
    if plain and len(args.json_keys) > 1:
        p.error("--json-keys takes one key for a plain-text --input")
    dtype = numpy.uint16 if tok.vocab_size < 65500 else numpy.int32
    prefixes = {k: f"{args.output_prefix}_{k}_document" for k in args.json_keys}
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)) or ".", exist_ok=True)
    builders = {k: IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype) for k, prefix in prefixes.items()}
    encoder = _Encoder(args)
    ndocs, ntok = 0, dict.fromkeys(args.json_keys, 0)
    records = _records(args.input, args.json_keys, plain)
    if args.workers > 1:
        pool = multiprocessing.get_context("fork").Pool(args.workers, initializer=encoder.initializer)
        encoded = pool.imap(encoder.encode, records, chunksize=32)
    else:
        pool = None
        encoder.initializer()
        encoded = map(encoder.encode, records)
    progress = _Progress(os.path.getsize(args.input), args.log_interval,
                         bar=not args.no_progress_bar and sys.stderr.isatty())
    try:
        for nbytes, out in encoded:
            for key, ids in out.items():
                builders[key].add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
                ntok[key] += len(ids)
            ndocs += 1
            progress.advance(nbytes)
    except InputError as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 2
    finally:
        progress.close()
        if pool is not None:
            pool.terminate()
    for key, builder in builders.items():
        builder.finalize(get_idx_path(prefixes[key]))
        print(f"wrote {ndocs} documents, {ntok[key]} tokens to {prefixes[key]}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
