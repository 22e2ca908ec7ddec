"""Check a training command line once, before a launcher starts any rank.

    python -m h3t_training.launch.preflight --world-size 16 [--entry pretrain_gpt.py] [--ranks-per-node 8] \
        -- <the entry's flags>

Runs every check the driver makes before its process groups exist (flags, layout for this world
size, GPUs for the ranks a node starts where the launcher knows that number, tokenizer and data files, the
checkpoint under ``--load``, writable output directories) and
exits 0 silently, or with the driver's one-line error and status 2. The launch scripts call it,
so a bad flag is one line there too, not one line per rank followed by the launcher's report.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Optional


ENTRIES = ("pretrain_llama.py", "pretrain_gpt.py")
"""The entry points whose command lines this checks, each with its defaults (Llama's; Megatron-LM's GPT)."""
USAGE = ("preflight: usage: python -m h3t_training.launch.preflight --world-size N [--entry "
         + "|".join(ENTRIES) + "] [--ranks-per-node N] -- FLAGS...")


def _options(argv: list) -> Optional[tuple[int, str, int, list]]:
    """(world size, entry, ranks per node, the entry's flags), or None for a malformed command line."""
    if "--" not in argv:
        return None
    cut = argv.index("--")
    head, flags = argv[:cut], argv[cut + 1:]
    if len(head) % 2:
        return None
    given = dict(zip(head[::2], head[1::2]))
    if len(given) != len(head) // 2 or not set(given) <= {"--world-size", "--entry", "--ranks-per-node"}:
        return None
    sizes = [given.get("--world-size"), given.get("--ranks-per-node", "1")]
    if sizes[0] is None or not all(v.isdigit() and int(v) >= 1 for v in sizes):
        return None
    entry = given.get("--entry", ENTRIES[0])
    if entry not in ENTRIES:
        return None
    return int(sizes[0]), entry, int(sizes[1]), flags


def main(argv=None) -> int:
    options = _options(list(sys.argv[1:] if argv is None else argv))
    if options is None:
        sys.stderr.write(USAGE + "\n")
        return 2
    world_size, prog, ranks_per_node, flags = options
    from h3t_training.launch.quiet_imports import ignore_optional_accelerator_warnings
    ignore_optional_accelerator_warnings()
    from h3t_training.config.arguments import MEGATRON_GPT_DEFAULTS
    from h3t_training.config.sections import parse_args
    from h3t_training.loop.saved_args import read_saved_args

    defaults = MEGATRON_GPT_DEFAULTS if prog == "pretrain_gpt.py" else None
    with contextlib.redirect_stdout(io.StringIO()):
        args = parse_args(flags, prog=prog, defaults=defaults, world_size=world_size, ranks_per_node=ranks_per_node,
                          read_checkpoint_args=read_saved_args)  # bad flag: one line, exit 2
        if not any(d is not None and os.path.isdir(d) for d in (args.load, args.pretrained_checkpoint)):
            return 0  # nothing to check: find_load would say None (or the missing --pretrained-checkpoint)
        from h3t_training.loop.checkpointing import CheckpointError, find_load  # megatron-core: 3 s to import

        try:
            find_load(args, rank=0)
        except CheckpointError as e:
            sys.stderr.write(f"{prog}: error: {e}\n")
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
