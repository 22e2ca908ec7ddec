#!/usr/bin/env python3
"""Write a text corpus made of the Python standard library's documentation, as jsonl.

Every machine with Python has this text, so the tiny CPU run needs no download. One document
per module: the module docstring followed by the docstrings of its public classes, functions
and methods. Usage: ``python tools/make_stdlib_corpus.py --output corpus.jsonl [--min-bytes N]``.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import warnings

MODULES = (
    "abc argparse array ast asyncio base64 bisect calendar cmd codecs collections configparser contextlib copy "
    "csv dataclasses datetime decimal difflib dis doctest email enum fileinput fnmatch fractions ftplib "
    "functools gettext glob gzip hashlib heapq hmac html html.parser http.client http.cookies imaplib inspect "
    "io ipaddress itertools json locale logging lzma mailbox math mimetypes numbers operator optparse pathlib "
    "pickle pkgutil platform poplib pprint queue quopri random re reprlib sched secrets selectors shelve shlex "
    "shutil smtplib socket socketserver sqlite3 ssl statistics string struct subprocess symtable tarfile "
    "tempfile textwrap threading time timeit tokenize trace traceback types typing unittest urllib.parse "
    "urllib.request uuid warnings wave weakref xml.dom.minidom xml.etree.ElementTree zipfile zipimport zlib"
).split()


def _docs(obj, depth: int = 0):
    doc = inspect.getdoc(obj)
    if doc:
        yield doc
    if depth >= 2:
        return
    for name, member in sorted(vars(obj).items()) if hasattr(obj, "__dict__") else ():
        if name.startswith("_"):
            continue
        if inspect.isclass(member) or inspect.isfunction(member) or inspect.isbuiltin(member):
            if getattr(member, "__module__", None) in (None, getattr(obj, "__name__", None), getattr(obj, "__module__", None)):
                yield from _docs(member, depth + 1)


def module_text(name: str) -> str:
    """The documentation text of one module ('' when it cannot be imported)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module(name)
    except Exception:  # an optional stdlib module missing on this build
        return ""
    seen, parts = set(), []
    for doc in _docs(mod):
        if doc not in seen:
            seen.add(doc)
            parts.append(doc)
    return "\n\n".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", required=True)
    p.add_argument("--min-bytes", type=int, default=0, help="fail when the corpus is smaller")
    args = p.parse_args(argv)
    total = docs = 0
    with open(args.output, "w", encoding="utf-8") as f:
        for name in MODULES:
            text = module_text(name)
            if text:
                f.write(json.dumps({"text": text, "source": f"python-stdlib:{name}"}) + "\n")
                total += len(text.encode("utf-8"))
                docs += 1
    print(f"wrote {docs} documents, {total} bytes of text to {args.output}")
    if total < args.min_bytes:
        print(f"make_stdlib_corpus.py: error: only {total} bytes, --min-bytes is {args.min_bytes}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
