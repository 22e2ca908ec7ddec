"""megatron-core's ``torch_dist`` checkpoint format written on hosts without CUDA.

megatron-core 0.16's ``TorchDistSaveShardedStrategy`` writes through its asynchronous file
writer, which calls ``torch.cuda.synchronize()`` after staging tensors (so it fails on a
CPU-only torch). :class:`HostTorchDistSaveStrategy` is a save strategy of its own, plugged into
``dist_checkpointing.save(..., sharded_strategy=...)``: it translates the sharded state dict with
megatron-core's own functions (ShardedTensors to PyTorch sharded tensors, keys to sharded keys,
only main replicas kept) and writes it with PyTorch's synchronous distributed-checkpoint writer
and megatron-core's save planner. The files are the same format (``.metadata``, ``*.distcp``,
and megatron's ``metadata.json``/``common.pt`` written by ``dist_checkpointing.save``), read back
by megatron-core's stock ``torch_dist`` load strategy, with resharding.
"""
from __future__ import annotations

from pathlib import Path

import torch
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save

BACKEND, VERSION = "torch_dist", 1
"""The format megatron-core records in ``metadata.json`` (its default torch_dist strategy's)."""


class HostTorchDistSaveStrategy(SaveShardedStrategy):
    """Synchronous ``torch_dist`` save that needs no CUDA (format identical to megatron-core's)."""

    def __init__(self) -> None:
        super().__init__(BACKEND, VERSION)

    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
        dcp_save(mcore_to_pyt_state_dict(state, False), storage_writer=FileSystemWriter(str(checkpoint_dir)),
                 planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))


def save_strategy(on_gpu: bool):
    """The save strategy to hand ``dist_checkpointing.save``: megatron-core's default on a GPU,
    :class:`HostTorchDistSaveStrategy` where CUDA is absent."""
    if on_gpu and torch.cuda.is_available():
        return None
    return HostTorchDistSaveStrategy()
