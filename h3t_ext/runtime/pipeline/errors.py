"""Errors of the pipeline's point-to-point layer, shared by :mod:`.p2p` and :mod:`.p2p_strict`."""
from __future__ import annotations


class P2PTimeoutError(RuntimeError):
    """A pipeline send or receive did not complete within ``p2p_timeout_s``."""


class P2PStagingError(ValueError):
    """A transfer the pipeline group's backend cannot carry as configured (one line naming ``p2p_staging``)."""


__all__ = ["P2PStagingError", "P2PTimeoutError"]
