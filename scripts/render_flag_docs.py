#!/usr/bin/env python3
"""Write docs/flags.md from the flag table (h3t_training/config/flag_table.py)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from h3t_training.config.flag_table import render_markdown  # noqa: E402

if __name__ == "__main__":
    with open(os.path.join(ROOT, "docs", "flags.md"), "w") as f:
        f.write(render_markdown() + "\n")
