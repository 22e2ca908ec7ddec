"""Checkpoints Megatron-LM itself wrote: ``--load`` continues from them (torch_dist and ``--ckpt-format torch``).

Megatron-LM's ``save_checkpoint`` stores its whole ``args`` Namespace next to the state (``generate_state_dict``):
in ``common.pt`` for torch_dist (with ``iteration``, ``checkpoint_version``, ``opt_param_scheduler``,
``num_floating_point_operations_so_far``, ``rerun_state_machine`` and the optimizer's non-tensor part; the model
``model``/``model0``... and ``rng_state`` are sharded), in every ``mp_rank_TT[_PPP]/model_optim_rng.pt`` for the
legacy format. Those args carry what this driver's own ``'h3t'`` section of ``common.pt`` records (model shape,
padded vocabulary, layout) and the schedule and data position: :func:`megatron_written_common` derives this
driver's common part from them, so that :func:`~h3t_training.loop.checkpointing.find_checkpoint` checks a
Megatron-LM checkpoint exactly as one of its own (model shape, schedule, padding, legacy layout).

What is taken: the model weights, the iteration and consumed samples, the RNG states (where Megatron-LM itself
would restore them: torch_dist at the tensor and pipeline sizes that saved them; legacy always, at its layout),
and on a GPU the optimizer state. The optimizer state is megatron-core's: on a GPU this run's optimizer is
megatron-core's too (:mod:`h3t_training.loop.gpu_wrap`) and reads it through its ``sharded_state_dict`` (torch_dist,
with the checkpoint's content metadata, as Megatron-LM's ``load_checkpoint`` passes it) or ``load_state_dict`` /
``load_parameter_state`` (legacy), as it reads this driver's own GPU checkpoints; on CPU the optimizer is
:class:`~h3t_training.loop.optimizer.DataParallelAdamW`, whose state has another layout, so the load needs
``--no-load-optim`` or ``--finetune`` (refused in one line otherwise). Not taken: the FLOPs count, the rerun state
machine, the dataloader state (the data continues from the consumed samples, as for this driver's own checkpoints:
``checkpointing.find_checkpoint``).
"""
from __future__ import annotations

import math
import os
import random
from typing import Optional

import torch

from h3t_training.loop import legacy_checkpoint as legacy
from h3t_training.loop.checkpoint_common import (CHECKPOINT_VERSION, LAYOUT_FLAGS, MODEL_SHAPE_FLAGS,
                                                 MODEL_SWITCH_FLAGS, SCHEDULE_FLAGS, SCHEDULE_STEPS, WRITTEN_BY,
                                                 CheckpointError, window_values)

MODEL_ARGS = ("num_layers", "hidden_size", "num_attention_heads", "group_query_attention", "ffn_hidden_size",
              "tokenizer_type", "vocab_size", "padded_vocab_size")
"""The fields of Megatron-LM's ``args`` the model shape is derived from (``num_query_groups`` too with
``group_query_attention``: without it megatron-core takes the number of heads)."""
WEIGHT_DECAY_SCHEDULE_ARGS = ("start_weight_decay", "end_weight_decay", "weight_decay_incr_style")
OPTIONAL_SCHEDULE_ARGS = ("decoupled_lr", "decoupled_min_lr", *WEIGHT_DECAY_SCHEDULE_ARGS)
"""Schedule fields older Megatron-LM releases lack (their default, None, is the value they then had)."""


def _field(ns, name: str, path: str):
    if not hasattr(ns, name):
        raise CheckpointError(f"checkpoint file {path} (written by Megatron-LM) has no field {name!r} in its args; "
                              f"it cannot be checked against this run", alike=True)
    return getattr(ns, name)


def megatron_written_common(ns, iteration, scheduler: Optional[dict], *, path: str,
                            consumed_train_samples=None, optimizer_saved: bool, rng_saved: bool) -> dict:
    """This driver's common part (``iteration``, ``consumed_train_samples``, ``opt_param_scheduler`` as
    :data:`SCHEDULE_FLAGS`, the ``'h3t'`` section: model shape with ``padded_vocab_size``, layout) of a checkpoint
    Megatron-LM wrote, from its ``args`` Namespace ``ns``, its ``iteration`` and its ``opt_param_scheduler``
    state (``scheduler``; None when Megatron-LM saved none, under ``--no-save-optim``).

    ``consumed_train_samples``: the file's own entry where it has one, else ``args.consumed_train_samples``
    (Megatron-LM's). The scheduler's ``max_lr``, ``min_lr`` and ``lr_decay_style`` are the ones the run trained
    with (they differ from its flags under ``--use-checkpoint-opt_param-scheduler``); a sample-based run's
    ``lr_decay_iters`` (None in its args) is its ``lr_decay_steps`` in global batches, as this driver counts it.
    A field missing is a one-line :class:`CheckpointError` naming ``path`` and the field."""
    if not hasattr(ns, "__dict__") or isinstance(ns, dict):
        raise CheckpointError(f"checkpoint file {path} has an 'args' entry that is not Megatron-LM's argparse "
                              f"Namespace ({type(ns).__name__})", alike=True)
    if not isinstance(iteration, int):
        raise CheckpointError(f"checkpoint file {path} (written by Megatron-LM) has no field 'iteration'", alike=True)
    model = {k: _field(ns, k, path) for k in MODEL_ARGS}
    gqa = model.pop("group_query_attention")
    model["num_query_groups"] = _field(ns, "num_query_groups", path) if gqa else model["num_attention_heads"]
    model = {k: model[k] for k in (*MODEL_SHAPE_FLAGS, "padded_vocab_size")}
    model.update({k: bool(getattr(ns, k, False)) for k in MODEL_SWITCH_FLAGS})  # Megatron-LM's default: off
    model.update(window_values(ns))
    layout = {k: _field(ns, k, path) for k in LAYOUT_FLAGS}
    schedule = {k: getattr(ns, k, None) if k in OPTIONAL_SCHEDULE_ARGS else _field(ns, k, path)
                for k in SCHEDULE_FLAGS}
    scheduler = scheduler if isinstance(scheduler, dict) else {}
    for mine, theirs in (("lr", "max_lr"), ("min_lr", "min_lr"), ("lr_decay_style", "lr_decay_style"),
                         ("start_weight_decay", "start_wd"), ("end_weight_decay", "end_wd"),
                         ("weight_decay_incr_style", "wd_incr_style"),
                         *((k, k) for k in SCHEDULE_STEPS)):  # megatron-core's scheduler counts samples
        if theirs in scheduler:
            schedule[mine] = scheduler[theirs]
    for k in WEIGHT_DECAY_SCHEDULE_ARGS:  # not checked where Megatron-LM recorded none
        if schedule.get(k) is None:
            schedule.pop(k, None)
    if scheduler.get("num_steps") is not None:  # where its schedule stands (fewer than the samples after fp16 skips)
        schedule["num_steps"] = scheduler["num_steps"]
    if schedule["lr_decay_iters"] is None and scheduler.get("lr_decay_steps"):
        schedule["lr_decay_iters"] = math.ceil(scheduler["lr_decay_steps"] / _field(ns, "global_batch_size", path))
    consumed = consumed_train_samples if consumed_train_samples is not None else \
        _field(ns, "consumed_train_samples", path)
    t, p = layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"]
    return dict(iteration=iteration, checkpoint_version=CHECKPOINT_VERSION, consumed_train_samples=consumed,
                skipped_train_samples=getattr(ns, "skipped_train_samples", 0) or 0,
                opt_param_scheduler=schedule, h3t={"model": model, "layout": layout},
                **{WRITTEN_BY: {"file": path, "optimizer_saved": optimizer_saved, "rng_saved": rng_saved,
                                "tensor_pipeline": (t, p),
                                "data_parallel_random_init": bool(getattr(ns, "data_parallel_random_init", False)),
                                "ckpt_fully_parallel_save": bool(getattr(ns, "ckpt_fully_parallel_save", False))}})


def read_legacy_state(directory: str, first: str) -> tuple[dict, str]:
    """The state of the first rank directory's file of a ``--ckpt-format torch`` checkpoint (memory-mapped: its
    tensors are not read) and its path."""
    path = os.path.join(directory, first, legacy.MODEL_FILE)
    state, error = None, None
    for mmap in (True, False):  # a file from before torch's zip format cannot be mapped
        try:
            state = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
            break
        except Exception as e:  # noqa: BLE001 - torch raises several unrelated types for a damaged file
            error = e
    if state is None:
        kind = "missing" if isinstance(error, FileNotFoundError) else f"corrupt or partial ({type(error).__name__})"
        raise CheckpointError(f"checkpoint file {path} is {kind}", alike=True)
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {path} holds no state dictionary", alike=True)
    return state, path


def read_legacy_common(directory: str, first: str) -> dict:
    """The common part of a ``--ckpt-format torch`` checkpoint Megatron-LM wrote (no ``common.pt``): from the
    ``args``, ``iteration`` and ``opt_param_scheduler`` of the first rank directory's file (memory-mapped: its
    tensors are not read)."""
    state, path = read_legacy_state(directory, first)
    if "args" not in state:
        raise CheckpointError(f"{directory} is a --ckpt-format torch checkpoint ({first}/...) without this driver's "
                              f"common.pt, and {path} has no Megatron-LM 'args' entry", alike=True)
    ns = state["args"]
    return megatron_written_common(ns, state.get("iteration"), state.get("opt_param_scheduler"), path=path,
                                   consumed_train_samples=state.get("consumed_train_samples"),
                                   optimizer_saved=not getattr(ns, "no_save_optim", False),
                                   rng_saved="rng_state" in state)


def check_for_this_run(common: dict, args, where: str, *, on_gpu: bool, legacy_format: bool) -> str:
    """Refuses (one line) what this run cannot take from a Megatron-LM checkpoint; returns rank 0's notice of what
    it takes. ``legacy_format``: a ``--ckpt-format torch`` checkpoint (without RNG states Megatron-LM's load fails on it, where it
    starts a torch_dist one from the seed)."""
    meta = common[WRITTEN_BY]
    finetune = bool(args.finetune)
    if legacy_format and not (finetune or args.no_load_rng) and not meta["rng_saved"]:
        raise CheckpointError(f"{where} was written by Megatron-LM without RNG states ({meta['file']} has no "
                              f"'rng_state'); add --no-load-rng, as Megatron-LM asks", alike=True)
    if (args.data_parallel_random_init and not (finetune or args.no_load_rng) and meta["rng_saved"]
            and not meta.get("data_parallel_random_init", False)):
        raise CheckpointError(f"{where} was written by Megatron-LM without --data-parallel-random-init (one RNG state, "
                              f"not one per data-parallel rank), this run has it; Megatron-LM refuses that too: drop "
                              f"the flag or add --no-load-rng", alike=True)
    with_optimizer = not (finetune or args.no_load_optim) and meta["optimizer_saved"]
    if with_optimizer and not on_gpu:
        raise CheckpointError(f"{where} was written by Megatron-LM: its optimizer state ({meta['file']}) is "
                              f"megatron-core's, which this run's CPU optimizer does not read; add --no-load-optim "
                              f"(or --finetune) to continue from its model weights with a fresh optimizer",
                              alike=True)
    consumed = common["consumed_train_samples"]  # checked against this run's schedule by find_checkpoint
    taken = ["the model weights"]
    if not finetune:
        taken.append(f"the iteration and its {consumed} consumed samples")
    if with_optimizer:
        taken.append("the optimizer state (megatron-core's, read by megatron-core's optimizer)")
    not_taken = ["the FLOPs count", "the rerun state machine"]
    if not with_optimizer:
        not_taken.insert(0, "the optimizer state" + (" (none saved)" if not meta["optimizer_saved"] else
                                                     " (--finetune)" if finetune else " (--no-load-optim)"))
    fresh = "" if with_optimizer else "; the optimizer starts from the loaded weights"
    return (f"note: {where} was written by Megatron-LM: taking {', '.join(taken)} (its args checked as this "
            f"driver's own checkpoints are: model shape, schedule, padding, layout); not taking "
            f"{', '.join(not_taken)}{fresh}")


def rng_template(common: dict, args):
    """Megatron-LM's torch_dist ``rng_state`` entry to load into (its ``get_rng_state``: one ShardedObject per
    (pipeline, tensor) rank holding a list with one state per data-parallel rank under
    ``--data-parallel-random-init``, else one), or the reason it is not restored, as Megatron-LM's
    ``load_checkpoint`` decides: saved with other tensor or pipeline sizes (a notice), or not saved."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    meta = common[WRITTEN_BY]
    if not meta["rng_saved"]:
        return None, "it holds no RNG states (--no-save-rng): RNG states start from --seed"
    run = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    if tuple(meta["tensor_pipeline"]) != run:
        return None, (f"it was saved at (tensor, pipeline) sizes {tuple(meta['tensor_pipeline'])}, this run has "
                      f"{run}: its RNG states are ignored, as in Megatron-LM; RNG states start from --seed")
    pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    return ShardedObject("rng_state", None, (pp, tp), (ps.get_pipeline_model_parallel_rank(),
                                                     ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True)), None


def set_rng_state(saved, *, data_parallel_random_init: bool) -> None:
    """Restore Megatron-LM's RNG state of this rank: its list's entry of this data-parallel rank under
    ``--data-parallel-random-init``, else the first, as Megatron-LM's ``load_checkpoint`` picks: Python's,
    NumPy's and torch's CPU generators, and on a GPU the CUDA generator and the model-parallel tracker. ValueError
    (one line) where the list has no entry for this rank."""
    from megatron.core import parallel_state as ps

    index = ps.get_data_parallel_rank() if data_parallel_random_init else 0
    if isinstance(saved, (list, tuple)) and index >= len(saved):
        raise ValueError(f"it holds {len(saved)} RNG state(s) per model-parallel rank, this run's "
                         f"--data-parallel-random-init asks for data-parallel rank {index}'s: saved without the flag")
    state = saved[index] if isinstance(saved, (list, tuple)) else saved
    random.setstate(state["random_rng_state"])
    if "np_rng_state" in state:
        import numpy as np
        np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from megatron.core.tensor_parallel.random import (convert_cuda_rng_state, get_cuda_rng_tracker,
                                                          is_graph_safe_cuda_rng_tracker)
        torch.cuda.set_rng_state(state["cuda_rng_state"])
        tracker = get_cuda_rng_tracker()
        graph_safe = is_graph_safe_cuda_rng_tracker(tracker)
        tracker.set_states({k: convert_cuda_rng_state(v, to_graphable=graph_safe)
                            for k, v in state["rng_tracker_states"].items()})


def optimizer_metadata(directory: str, common: dict, args) -> dict:
    """The content metadata megatron-core's optimizer builds its sharded state with, as Megatron-LM's
    ``load_checkpoint`` passes it: the checkpoint's own (``distrib_optim_sharding_type``, ...), or for one written
    before megatron-core 0.13 the sharding type of that time, and the data-parallel group."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    metadata = dist_checkpointing.load_content_metadata(directory)
    if metadata is None and args.use_distributed_optimizer:
        metadata = {"distrib_optim_sharding_type": "fully_sharded_model_space"
                    if common[WRITTEN_BY].get("ckpt_fully_parallel_save") else "dp_zero_gather_scatter"}
    return {**(metadata or {}), "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}


__all__ = ["check_for_this_run", "megatron_written_common", "optimizer_metadata", "read_legacy_common",
           "read_legacy_state", "rng_template",
           "set_rng_state"]
