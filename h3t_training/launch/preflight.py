"""Check a training command line once, before a launcher starts any rank.

    python -m h3t_training.launch.preflight --world-size 16 -- <pretrain_llama.py flags>

Runs every check the driver makes before its process groups exist (flags, layout for this world
size, tokenizer and data files, the checkpoint under ``--load``, writable output directories) and
exits 0 silently, or with the driver's one-line error and status 2. The launch scripts call it,
so a bad flag is one line there too, not one line per rank followed by the launcher's report.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[0] != "--world-size" or argv[2] != "--" or not argv[1].isdigit() or int(argv[1]) < 1:
        sys.stderr.write("preflight: usage: python -m h3t_training.launch.preflight --world-size N -- FLAGS...\n")
        return 2
    from h3t_training.config.sections import parse_args
    from h3t_training.loop.checkpointing import CheckpointError, find_checkpoint

    prog = os.environ.get("H3T_PROG", "pretrain_llama.py")
    with contextlib.redirect_stdout(io.StringIO()):
        args = parse_args(argv[3:], prog=prog, world_size=int(argv[1]))  # exits 2 with one line on a bad flag
        try:
            find_checkpoint(args, rank=0)
        except CheckpointError as e:
            sys.stderr.write(f"{prog}: error: {e}\n")
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
