"""torchrun (``torch.distributed.run``) as the launch scripts start it, ending quietly on Ctrl-C.

    python -m h3t_training.launch.torchrun TORCHRUN FLAGS... pretrain_llama.py FLAGS...

On SIGINT (or SIGTERM, SIGHUP, SIGQUIT) torchrun forwards the signal to its workers, waits for them and
then raises its ``SignalException`` with a traceback and status 1. Under this wrapper the workers say what
happened (rank 0: ``interrupted at iteration N; last complete checkpoint: iteration M``,
:mod:`h3t_training.launch.failures`) and the launcher ends with the shell's status for the signal (130 for Ctrl-C),
without a traceback or torchrun's "Received ... death signal" warnings. Everything else is torchrun's own.
"""
from __future__ import annotations

import logging
import sys

from h3t_training.launch.quiet_imports import DropMessages


SIGNAL_NOTICES = ("death signal, shutting down workers", "Closing process", "Sending process", "Got termination signal")
"""torchrun's warnings about the signal it got and the workers it closes (the workers report instead)."""


def main(argv=None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    quiet = DropMessages(*SIGNAL_NOTICES)
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(quiet)
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
