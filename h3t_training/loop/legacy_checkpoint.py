"""Megatron-LM's legacy ``--ckpt-format torch``: one file per model-parallel rank.

Under ``iter_NNNNNNN`` (the same tracker, atomic rename and checksum manifest as torch_dist,
:mod:`h3t_training.loop.checkpointing`)::

    mp_rank_TT[_PPP]/model_optim_rng.pt    written by data-parallel rank 0 of tensor rank TT, pipeline rank PPP
                                           (``_PPP`` only with a pipeline), Megatron-LM's keys: ``args``,
                                           ``checkpoint_version``, ``iteration``, ``model`` (``model0``, ``model1``,
                                           ... with a virtual pipeline: each chunk's own ``state_dict()``),
                                           ``optimizer``, ``opt_param_scheduler``, ``rng_state`` (a list, one entry
                                           per data-parallel rank), ``num_floating_point_operations_so_far``
    mp_rank_TT[_PPP]/distrib_optim.pt      with ``--use-distributed-optimizer``: every shard's Adam state, gathered
                                           on data-parallel rank 0 (Megatron's ``save_parameter_state``)
    common.pt                              what ``--load`` checks before any process group (iteration, model
                                           shape, layout, schedule): the torch_dist checkpoint's shared part

The files hold each rank's own tensor-parallel shards, so, as in Megatron-LM, such a checkpoint loads only with
the tensor, pipeline and virtual-pipeline sizes it was saved with (the data-parallel size may change: the Adam
state of every shard is in ``distrib_optim.pt``); :func:`check_layout` refuses another in one line that names
the sizes and torch_dist, which reshards. A legacy checkpoint without ``common.pt`` was written by Megatron-LM
itself: its common part is derived from the ``args`` of the first rank directory's file
(:mod:`h3t_training.loop.megatron_written`), its model and RNG states load here, and its optimizer state on a
GPU only (megatron-core's ``load_state_dict`` / ``load_parameter_state``, as for this driver's GPU checkpoints).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

MODEL_FILE = "model_optim_rng.pt"
OPTIMIZER_FILE = "distrib_optim.pt"
RESHARD_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")
"""The layout a legacy checkpoint must be loaded at (its files are these ranks' shards)."""


def rank_dir(directory: str, tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """Megatron-LM's per-rank directory: ``mp_rank_TT`` without a pipeline, ``mp_rank_TT_PPP`` with one."""
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return os.path.join(directory, name)


def rank_dirs(directory: str) -> list[str]:
    """The per-rank directories of a legacy checkpoint under ``directory`` (sorted; empty for torch_dist)."""
    return sorted(n for n in os.listdir(directory) if n.startswith("mp_rank_"))


def check_layout(saved_layout: dict, args, where: str) -> Optional[str]:
    """None when ``args`` loads a legacy checkpoint saved at ``saved_layout``; else the one-line reason."""
    differ = [k for k in RESHARD_FLAGS if saved_layout.get(k) != getattr(args, k)]
    if not differ:
        return None
    saved = " ".join(f"--{k.replace('_', '-')} {saved_layout.get(k)}" for k in differ)
    return (f"{where} is a --ckpt-format torch checkpoint (one file per model-parallel rank), saved with {saved}; "
            f"it loads only at that layout, as in Megatron-LM (torch_dist checkpoints reshard: save with "
            f"--ckpt-format torch_dist)")


def _my_dir(directory: str) -> str:
    return rank_dir(directory, ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
                    ps.get_pipeline_model_parallel_world_size())


def _dp_group():
    return ps.get_data_parallel_group(with_context_parallel=True)


def save(directory: str, args, iteration: int, chunks: dict, optimizer, *, common: dict, rng: dict,
         flops_so_far: float = 0.0) -> list[str]:
    """Write this rank's part of a legacy checkpoint into ``directory`` (collective over every rank); returns the
    paths (relative to ``directory``) this rank wrote, for the checksum manifest. ``chunks``: the model chunks
    (unwrapped from their data-parallel wrapper) by Megatron's key (``model``, or ``model0``, ``model1``, ...)."""
    group = _dp_group()
    dp_rank, dp_size = dist.get_rank(group), dist.get_world_size(group)
    rngs = [None] * dp_size
    dist.all_gather_object(rngs, rng, group=group)
    mine = _my_dir(directory)
    if dp_rank == 0:
        os.makedirs(mine, exist_ok=True)
    dist.barrier(group=group)
    written = []
    if not args.no_save_optim and optimizer.save_parameter_state(os.path.join(mine, OPTIMIZER_FILE)):  # collective
        written.append(os.path.relpath(os.path.join(mine, OPTIMIZER_FILE), directory))
    if dp_rank == 0:  # Megatron-LM leaves 'optimizer' and 'rng_state' out under --no-save-optim / --no-save-rng
        state = {"args": common["args"], "checkpoint_version": common["checkpoint_version"], "iteration": iteration,
                 "opt_param_scheduler": common["opt_param_scheduler"],
                 "num_floating_point_operations_so_far": flops_so_far,
                 "consumed_train_samples": common["consumed_train_samples"]}
        if not args.no_save_optim:
            state["optimizer"] = optimizer.legacy_state_dict()
        if not args.no_save_rng:
            state["rng_state"] = rngs
        for key, chunk in chunks.items():
            state[key] = chunk.state_dict()
        torch.save(state, os.path.join(mine, MODEL_FILE))
        written.append(os.path.relpath(os.path.join(mine, MODEL_FILE), directory))
    if dist.get_rank() == 0:
        torch.save(common, os.path.join(directory, "common.pt"))
        written.append("common.pt")
    return written


def load(directory: str, chunks: dict, optimizer, *, with_optimizer: bool, with_rng: bool,
         megatron: bool = False):
    """Load this rank's file into the (unwrapped) chunks, by key as :func:`save` takes them, and the optimizer;
    returns this data-parallel rank's RNG state when ``with_rng`` and the checkpoint has one for it (same
    data-parallel size), else None. ``megatron``: written by Megatron-LM, whose list holds one state (or one per
    data-parallel rank under its ``--data-parallel-random-init``): the whole list is returned for
    :func:`h3t_training.loop.megatron_written.set_rng_state`."""
    mine = _my_dir(directory)
    state = torch.load(os.path.join(mine, MODEL_FILE), map_location="cpu", weights_only=False)
    for key, chunk in chunks.items():
        chunk.load_state_dict(state[key], strict=True)
    if with_optimizer:
        optimizer.load_legacy_state_dict(state["optimizer"], os.path.join(mine, OPTIMIZER_FILE))
    else:
        optimizer.reload_model_params()
    rngs = state.get("rng_state")
    if megatron:
        return rngs if with_rng else None
    group = _dp_group()
    if with_rng and len(rngs) == dist.get_world_size(group):
        return rngs[dist.get_rank(group)]
    return None


__all__ = ["MODEL_FILE", "OPTIMIZER_FILE", "RESHARD_FLAGS", "check_layout", "load", "rank_dir", "rank_dirs", "save"]
