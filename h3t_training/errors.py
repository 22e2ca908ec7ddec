"""The driver's errors for a flag value that cannot run (imported by every resolution step)."""
import socket


class ArgumentError(Exception):
    """A flag value that cannot run; the message is one line naming the flag and the valid range."""


class NodeArgumentError(ArgumentError):
    """A problem of this rank's node, not of the command line: its devices (more ranks than GPUs) or its launch
    environment (``CUDA_DEVICE_MAX_CONNECTIONS``, which a multi-node torchrun sets node by node). Nodes may differ,
    so the first rank of each node says it (:func:`node_line`), not rank 0 alone, who may not share it."""


def said_by_its_node(error: Exception, rank: int, local_rank: int) -> bool:
    """Whether this rank, other than rank 0, writes ``error``: a :class:`NodeArgumentError` on its node's first rank
    (rank 0 writes every error; the others stay silent)."""
    return isinstance(error, NodeArgumentError) and rank != 0 and local_rank == 0


def node_line(message: str, rank: int) -> str:
    """``message`` as said by a node's first rank other than rank 0: the host and rank it is about."""
    return f"on {socket.gethostname()} (rank {rank}): {message}"
