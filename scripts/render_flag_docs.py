#!/usr/bin/env python3
"""Write docs/flags.md from the flag table (h3t_training/config/flag_table.py); ``--check``: write nothing, exit 1 with
one line when docs/flags.md differs from what the table renders."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from h3t_training.config.flag_docs import render_markdown  # noqa: E402

PATH = os.path.join(ROOT, "docs", "flags.md")

if __name__ == "__main__":
    text = render_markdown() + "\n"
    if sys.argv[1:] == ["--check"]:
        with open(PATH) as f:
            if f.read() != text:
                sys.exit("render_flag_docs.py: docs/flags.md is out of date; run scripts/render_flag_docs.py")
        sys.exit(0)
    if sys.argv[1:]:
        sys.exit(f"render_flag_docs.py: error: unknown arguments {' '.join(sys.argv[1:])} (only --check)")
    with open(PATH, "w") as f:
        f.write(text)
