"""megatron-core's ``torch_dist`` checkpoint format written on hosts without CUDA.

megatron-core 0.16's ``TorchDistSaveShardedStrategy`` writes through its asynchronous file
writer, which calls ``torch.cuda.synchronize()`` after staging tensors (so it fails on a
CPU-only torch). :class:`HostTorchDistSaveStrategy` is that strategy with its own ``save``, plugged into
``dist_checkpointing.save(..., sharded_strategy=...)`` (a subclass: megatron-core 0.19's ``save`` takes only
``TorchDistSaveShardedStrategy`` instances and replaces anything else by its default, and 0.19 has no
``strategies.base``); it translates the sharded state dict with
megatron-core's own functions (ShardedTensors to PyTorch sharded tensors, keys to sharded keys,
only main replicas kept) and writes it with PyTorch's synchronous distributed-checkpoint writer
and megatron-core's save planner. The files are the same format (``.metadata``, ``*.distcp``,
and megatron's ``metadata.json``/``common.pt`` written by ``dist_checkpointing.save``), read back
by megatron-core's stock ``torch_dist`` load strategy, with resharding.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.filesystem import FileSystem

BACKEND, VERSION = "torch_dist", 1
"""The format megatron-core records in ``metadata.json`` (its default torch_dist strategy's)."""


class HostTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
    """Synchronous ``torch_dist`` save that needs no CUDA (format identical to megatron-core's)."""

    def __init__(self) -> None:
        super().__init__(BACKEND, VERSION)

    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        """Write the tensors; a write that failed on this rank (disk full, quota, file size limit) is raised as
        that ``OSError`` naming its file, not as what torch's zip writer and DCP make of it."""
        state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
        writer = FileSystemWriter(str(checkpoint_dir))
        writer.fs = recorder = WriteErrorRecorder()
        try:
            dcp_save(mcore_to_pyt_state_dict(state, False), storage_writer=writer,
                     planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))
        except BaseException:
            if recorder.error is not None:
                raise recorder.error from None
            raise


class WriteErrorRecorder(FileSystem):
    """PyTorch DCP's file system, remembering the first ``OSError`` a write raised, with its file.

    Without it a full disk reads as a zip-writer assertion: ``torch.save`` into a stream whose ``write`` fails
    raises ``[enforce fail at inline_container.cc] unexpected pos`` (the ``OSError`` only its ``__context__``),
    and DCP gathers every rank's failure through pickling, which drops the context."""

    def __init__(self) -> None:
        super().__init__()
        self.error: Optional[OSError] = None

    @contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            yield _RecordingStream(stream, str(path), self) if ("w" in mode or "a" in mode) else stream


class _RecordingStream:
    """A write stream that hands its first ``OSError`` (with the file's path) to its recorder."""

    def __init__(self, stream, path: str, recorder: WriteErrorRecorder):
        self._stream, self._path, self._recorder = stream, path, recorder

    def write(self, data):
        try:
            return self._stream.write(data)
        except OSError as e:
            if self._recorder.error is None:
                self._recorder.error = OSError(e.errno, e.strerror, self._path)
            raise

    def __getattr__(self, name):
        return getattr(self._stream, name)


def save_strategy(on_gpu: bool):
    """The save strategy to hand ``dist_checkpointing.save``: megatron-core's default on a GPU,
    :class:`HostTorchDistSaveStrategy` where CUDA is absent."""
    if on_gpu and torch.cuda.is_available():
        return None
    return HostTorchDistSaveStrategy()
