"""Read the ``args`` a checkpoint saved, for ``--use-checkpoint-args`` (:mod:`h3t_training.config.checkpoint_args`).

Megatron-LM's ``load_args_from_checkpoint`` reads them from the checkpoint's common state, before any process
group: ``common.pt`` of a torch_dist checkpoint (megatron-core 0.19 may keep it inside the shard files), or the
first rank file of a ``--ckpt-format torch`` one. This driver's checkpoints carry the same entry
(:func:`h3t_training.config.checkpoint_args.megatron_args`); one written before it did holds none, and is read as
Megatron-LM reads such a checkpoint: the command line's arguments stay.

The entry points pass :func:`read_saved_args` to :func:`h3t_training.config.sections.parse_args`; torch and
megatron-core are imported only when it is called.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

from h3t_training.config.checkpoint_args import SavedArgs
from h3t_training.errors import ArgumentError


def _raw_state(directory: str) -> dict:
    """The common state of the checkpoint in ``directory`` as it was saved (not converted)."""
    from h3t_training.loop import checkpoint_files, legacy_checkpoint, megatron_written  # noqa: PLC0415
    from h3t_training.loop.checkpoint_common import CheckpointError  # noqa: PLC0415

    per_rank = legacy_checkpoint.rank_dirs(directory)
    if per_rank and not os.path.isfile(os.path.join(directory, "common.pt")):  # written by Megatron-LM
        return megatron_written.read_legacy_state(directory, per_rank[0])[0]
    state, path = checkpoint_files.read_saved_common(directory)
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {path} holds no state dictionary", alike=True)
    if "args" not in state and per_rank:  # this driver's legacy checkpoint from before its common.pt held args
        return {**state, "args": megatron_written.read_legacy_state(directory, per_rank[0])[0].get("args")}
    return state


def read_saved_args(root: Optional[str], step: Optional[int]) -> Optional[SavedArgs]:
    """The args saved with the checkpoint under ``root`` (``step``: ``--ckpt-step``, else the tracker's); None
    where ``root`` holds no checkpoint. A damaged one: :class:`~h3t_training.errors.ArgumentError`, one line."""
    from h3t_training.loop import checkpoint_files  # noqa: PLC0415 - torch and megatron-core: only when asked
    from h3t_training.loop.checkpoint_common import CheckpointError  # noqa: PLC0415
    from h3t_training.loop.checkpointing import iter_dir  # noqa: PLC0415

    if root is None or not os.path.isdir(root):
        return None
    try:
        iteration = step if step is not None else checkpoint_files.read_tracker(root)
        if iteration is None:
            return None
        directory = iter_dir(root, iteration)
        where = f"{root}: checkpoint iteration {iteration}"
        if not os.path.isdir(directory):
            named = "--ckpt-step" if step is not None else f"named by {checkpoint_files.TRACKER}"
            raise CheckpointError(f"{root}: {directory} does not exist ({named})", alike=True)
        state = _raw_state(directory)
    except CheckpointError as e:
        raise ArgumentError(str(e)) from None
    ns = state.get("args")
    if ns is None:
        return SavedArgs(where)
    if not isinstance(ns, argparse.Namespace):
        raise ArgumentError(f"{where} has an 'args' entry that is not an argparse Namespace ({type(ns).__name__})")
    return SavedArgs(where, dict(vars(ns)), float(state.get("checkpoint_version", 0)))


__all__ = ["read_saved_args"]
