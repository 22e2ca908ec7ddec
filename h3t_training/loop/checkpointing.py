"""Save and resume through megatron-core's ``dist_checkpointing`` (``--ckpt-format torch_dist``).

Megatron-LM's layout under ``--save DIR``::

    latest_checkpointed_iteration.txt     the last complete iteration (the tracker)
    iter_0000010/metadata.json            megatron-core: backend torch_dist
    iter_0000010/common.pt                what every rank shares (iteration, schedule, model shape)
    iter_0000010/.metadata, *.distcp      the sharded tensors (PyTorch distributed checkpoint)

What is saved (Megatron's keys): ``model`` (``model0``, ``model1``, ... with a virtual pipeline)
from each chunk's ``sharded_state_dict()`` (with ``--use-torch-fsdp2``, the same entries cut to the rows of
this rank's DTensor shards: :func:`h3t_training.loop.fsdp.sharded_state_dict`; a load reads those rows into the
shards, :func:`h3t_training.loop.fsdp.load_state`), ``optimizer`` (the full Adam
state: fp32 weights where the optimizer keeps them, both moments, the step count; with the distributed optimizer
each shard from its owner), ``opt_param_scheduler``, ``rng_state`` (one object per rank: torch's
CPU generator, and the CUDA generator and model-parallel tracker on a GPU), ``iteration``,
``consumed_train_samples``, ``checkpoint_version``, and ``h3t`` (model shape and layout).

Because tensors are stored by their global keys and offsets, a run may load with another
t/p/c/v or data-parallel size than the one that saved (resharding); the RNG states are then
not restored (they belong to ranks that no longer exist) and a notice says so.

A save is atomic: every rank writes into ``iter_N.tmp``; after all have finished, rank 0 writes
``h3t_checksums.json`` (size and SHA-256 of every file, each rank hashing the files it wrote),
renames the directory to ``iter_N`` and then moves the tracker. A run killed mid-save leaves the
previous checkpoint as the latest. Everything that can be checked without process groups
(tracker, format, model shape, file sizes, and the checksums, each rank hashing its share of the
files) is checked by :func:`find_checkpoint` before any rank starts, with one line naming the file
and the reason (:class:`CheckpointError`).

A checkpoint Megatron-LM itself wrote (its ``args`` in ``common.pt`` and no ``'h3t'`` section, or legacy files
without ``common.pt``) is checked from its ``args`` (:mod:`h3t_training.loop.megatron_written`) with the same
checks, less the checksums it has none of, and loads its model weights, iteration and RNG states; its optimizer
state only on a GPU (megatron-core's, read by megatron-core's optimizer).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from h3t_training.config.checkpoint_args import megatron_args
from h3t_training.config.feature_checks import uses_gpu
from h3t_training.config.validation import check_layout_for
from h3t_training.errors import ArgumentError
from h3t_training.data.batch_schedule import schedule_of
from h3t_training.data.tokenizer import padded_vocab_size, run_padded_vocab_size
from h3t_training.loop import fsdp, legacy_checkpoint as legacy, megatron_written
from h3t_training.loop.checkpoint_common import (CHECKPOINT_VERSION, LAYOUT_FLAGS, MODEL_SHAPE_FLAGS,  # noqa: F401
                                                 MODEL_SWITCH_FLAGS, MODEL_WINDOW_FLAGS, SCHEDULE_FLAGS, SCHEDULE_STEPS,
                                                 WRITTEN_BY, CheckpointError, window_values)
from h3t_training.loop.checkpoint_files import (CHECKSUMS, TRACKER, file_digest, read_common,  # noqa: F401
                                                read_tracker, verify_files, verify_layout)
from h3t_training.loop.collectives import all_reduce_host
from h3t_training.loop.param_schedule import steps_before


@dataclass(frozen=True)
class FoundCheckpoint:
    """A complete checkpoint under ``--load`` (or ``--pretrained-checkpoint``), checked before any process group
    exists."""

    directory: str
    """The ``iter_NNNNNNN`` directory."""
    iteration: int
    same_layout: bool
    """Saved with this run's parallel layout (then RNG states are restored too)."""
    common: dict
    """The shared part (``common.pt``)."""
    adopted: dict = field(default_factory=dict)
    """The fields this run takes from the checkpoint: its LR schedule under
    ``--use-checkpoint-opt_param-scheduler``, and the ``--make-vocab-size-divisible-by`` that pads the vocabulary
    to the checkpoint's rows (:func:`adopted_padding`); the driver continues with ``args.replace(**found.adopted)``."""
    notices: tuple = ()
    """What rank 0 says of the adopted fields."""
    legacy: bool = False
    """Written with ``--ckpt-format torch`` (Megatron's per-rank files, :mod:`h3t_training.loop.legacy_checkpoint`)."""
    named_by: str = "--load"
    """The flag that named its directory: ``--load``, or ``--pretrained-checkpoint`` (:func:`find_load`)."""


def iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def adopted_padding(saved_padded: Optional[int], vocab_size: int, args, where: str) -> tuple[dict, tuple]:
    """The fields and notice with which this run pads its vocabulary to the checkpoint's ``saved_padded`` rows.

    Megatron pads the tokenizer's V up to a multiple of ``--make-vocab-size-divisible-by`` D x t, so the default
    padding changes with t (258 tokens: 384 rows at t=1, 512 at t=2) and Megatron refuses the load. The padding
    rows are part of the trained model (their logits are in every token's softmax), so the run takes the
    checkpoint's rows: D = P / t pads to P exactly when t divides P and P >= V. Otherwise no D at this t does, and
    the load is refused naming the tensor-parallel sizes that would."""
    t = args.tensor_model_parallel_size
    mine = padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by, t)
    if saved_padded == mine:
        return {}, ()
    if not isinstance(saved_padded, int) or saved_padded < vocab_size:
        raise CheckpointError(f"{where} has a vocabulary of {saved_padded} rows, fewer than the tokenizer's "
                              f"{vocab_size} tokens", alike=True)
    if saved_padded % t:
        sizes = [d for d in range(1, min(saved_padded, 64) + 1) if saved_padded % d == 0]
        raise CheckpointError(f"{where} has its vocabulary padded to {saved_padded} rows, which "
                              f"--tensor-model-parallel-size {t} does not divide; load it at a tensor-parallel size "
                              f"that does ({', '.join(map(str, sizes))})", alike=True)
    divisor = saved_padded // t
    return ({"make_vocab_size_divisible_by": divisor},
            (f"note: {where} has its vocabulary of {vocab_size} tokens padded to {saved_padded} rows, this run's flags "
             f"pad to {mine}: continuing with the checkpoint's {saved_padded} rows "
             f"(--make-vocab-size-divisible-by {divisor} at --tensor-model-parallel-size {t})",))


def _model_shape(args) -> dict:
    shape = {k: getattr(args, k) for k in MODEL_SHAPE_FLAGS + MODEL_SWITCH_FLAGS}
    shape.update(window_values(args))
    shape["padded_vocab_size"] = run_padded_vocab_size(args)
    return shape


def _layout(args) -> dict:
    return {k: getattr(args, k) for k in LAYOUT_FLAGS}


def _schedule(args) -> dict:
    return {k: getattr(args, k) for k in (*SCHEDULE_FLAGS, *SCHEDULE_STEPS)}



def find_load(args, *, rank: int) -> tuple[Any, Optional[FoundCheckpoint]]:
    """(the run's config, the checkpoint it starts from): ``--load``'s (:func:`find_checkpoint`); where that holds
    none and ``--pretrained-checkpoint`` is given, that one's, with ``finetune`` on (its weights at iteration 0), as
    Megatron-LM's ``load_checkpoint`` falls back to it; a ``--pretrained-checkpoint`` without a checkpoint is a
    one-line :class:`CheckpointError`, as Megatron-LM raises."""
    found = find_checkpoint(args, rank=rank)
    if found is not None or args.pretrained_checkpoint is None:
        return args, found
    tuned = args.replace(finetune=True)
    found = find_checkpoint(tuned, rank=rank, named_by="--pretrained-checkpoint")
    if found is None:
        raise CheckpointError(f"no checkpoint in --load {args.load} or --pretrained-checkpoint "
                              f"{args.pretrained_checkpoint}", alike=True)
    return tuned, found


def find_checkpoint(args, *, rank: int, named_by: str = "--load") -> Optional[FoundCheckpoint]:
    """The checkpoint ``--load`` (``named_by``: or ``--pretrained-checkpoint``; and ``--ckpt-step``) names, checked;
    None when there is none.

    A missing or empty ``--load`` directory means "start from scratch", as in Megatron. ``rank`` checks the
    SHA-256 of its share of the files (of ``args.world_size`` ranks).
    """
    root = args.load if named_by == "--load" else args.pretrained_checkpoint
    if root is None or not os.path.isdir(root):
        return None
    step = args.ckpt_step
    iteration = step if step is not None else read_tracker(root)
    if iteration is None:
        return None
    directory = iter_dir(root, iteration)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{named_by} {root}: {directory} does not exist"
                              + (" (--ckpt-step)" if step is not None else f" (named by {TRACKER})"), alike=True)
    common = read_common(directory)
    megatron = WRITTEN_BY in common  # Megatron-LM writes no checksum manifest
    if not megatron:
        verify_files(directory, rank, args.world_size)
    per_rank = bool(legacy.rank_dirs(directory))
    where = f"{named_by} {root}: checkpoint iteration {iteration}"
    if per_rank:
        reason = legacy.check_layout(common["h3t"]["layout"], args, where)
        if reason:
            raise CheckpointError(reason, alike=True)
        if args.use_torch_fsdp2:
            raise CheckpointError(f"{where} is a --ckpt-format torch checkpoint (whole tensor-parallel shards per "
                                  f"file), which loads without --use-torch-fsdp2; resume without it, save with "
                                  f"--ckpt-format torch_dist, then add it", alike=True)
    else:
        verify_layout(directory, rank, args.world_size)
    saved = common["h3t"]["model"]
    mine = {k: getattr(args, k) for k in MODEL_SHAPE_FLAGS}
    for k in MODEL_SHAPE_FLAGS:
        if saved.get(k) != mine[k]:
            raise CheckpointError(f"{where} was saved with --{k.replace('_', '-')} {saved.get(k)}, this run has "
                                  f"{mine[k]}", alike=True)
    kept = common["h3t"].get("saved", {})  # a checkpoint that predates the field holds both
    for part, what, skipped, flag in (("optimizer", "optimizer state", args.no_load_optim, "optim"),
                                      ("rng", "RNG states", args.no_load_rng, "rng")):
        if not kept.get(part, True) and not (args.finetune or skipped):
            raise CheckpointError(f"{where} was saved with --no-save-{flag} (no {what}); add --no-load-{flag} or "
                                  f"--finetune, as Megatron-LM asks", alike=True)
    for k in MODEL_SWITCH_FLAGS:  # absent from a checkpoint that predates the switch: saved without it
        if bool(saved.get(k, False)) != bool(getattr(args, k)):
            flag = "--" + k.replace("_", "-")
            raise CheckpointError(f"{where} was saved {'with' if saved.get(k) else 'without'} {flag}, this run "
                                  f"{'has' if getattr(args, k) else 'does not have'} it; give the same model flags",
                                  alike=True)
    windows = window_values(args)
    for k in MODEL_WINDOW_FLAGS:  # absent from a checkpoint that predates the window: saved without one
        if saved.get(k) != windows[k]:
            flag = "--" + k.replace("_", "-")
            theirs, ours = (", ".join(map(str, v)) if isinstance(v, list) else v for v in (saved.get(k), windows[k]))
            raise CheckpointError(f"{where} was saved with {flag} {theirs}, this run has {ours}; give the same model "
                                  f"flags", alike=True)
    adopted = _check_schedule(args, common.get("opt_param_scheduler", {}), iteration)
    padding, notices = adopted_padding(saved.get("padded_vocab_size"), args.tokenizer_vocab_size, args, where)
    if megatron:  # what this run cannot take (one line), and what it takes
        notices = (megatron_written.check_for_this_run(common, args, where, on_gpu=uses_gpu(args),
                                                       legacy_format=per_rank), *notices)
    data, note = _data_position(args, common.get("consumed_train_samples"), iteration, where)
    return FoundCheckpoint(directory, iteration, common["h3t"]["layout"] == _layout(args), common,
                           {**adopted, **padding, **data}, (*notices, *note), per_rank, named_by)


def _data_position(args, consumed: Optional[int], iteration: int, where: str) -> tuple[dict, tuple[str, ...]]:
    """As Megatron-LM, a resume continues the data (and a sample-counted learning-rate schedule) from the
    checkpoint's consumed samples: where this run's batch schedule reaches the iteration after other samples (its
    global batch or ramp-up changed since the save), the run takes the schedule continued from the checkpoint
    (``BatchSchedule.resumed_at``; with --train-samples, the iterations that reach them), every batch size of it
    checked against the layout, and rank 0 says so. (fields to adopt, notices)"""
    schedule = schedule_of(args)
    expected = schedule.consumed_samples(iteration)
    if args.finetune or consumed is None or consumed == expected:
        return {}, ()
    fields = {"batch_schedule": schedule.resumed_at(iteration, consumed)}
    if args.train_samples is not None:
        fields["train_iters"] = fields["batch_schedule"].iterations_for_samples(args.train_samples)
    try:
        check_layout_for(args.replace(**fields))
    except ArgumentError as e:  # a batch size of the continued schedule the layout cannot take
        raise CheckpointError(f"{where}: continuing from its {consumed} consumed samples, {e}", alike=True) from None
    return fields, (f"note: {where} was saved after {consumed} consumed samples (this run's batch schedule reaches "
                    f"that iteration after {expected}): the data continues from sample {consumed}, as in "
                    f"Megatron-LM",)


def check_latest(root: str) -> Optional[int]:
    """The iteration ``root``'s tracker names, after checking that its checkpoint is complete (every file of
    the manifest there with its size and SHA-256, ``.metadata`` and ``common.pt`` readable); None when there is no
    tracker. A supervisor (``scripts/chaos_run.py``) calls it between a kill and the resume; a checkpoint that is
    not complete is a :class:`CheckpointError` naming the file."""
    iteration = read_tracker(root)
    if iteration is None:
        return None
    directory = iter_dir(root, iteration)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{root}: {TRACKER} names iteration {iteration}, but {directory} does not exist")
    if WRITTEN_BY not in read_common(directory):  # Megatron-LM writes no checksum manifest
        verify_files(directory, 0, 1)
    return iteration


def _check_schedule(args, saved: dict, iteration: int) -> dict:
    """Megatron refuses a resume whose schedule differs from the checkpoint's unless told which wins:
    ``--override-opt_param-scheduler`` (this command line) or ``--use-checkpoint-opt_param-scheduler``
    (the checkpoint: its values replace this run's, returned as the fields to replace)."""
    if args.finetune or args.override_opt_param_scheduler:
        return {}
    if args.use_checkpoint_opt_param_scheduler:
        return {k: saved[k] for k in (*SCHEDULE_FLAGS, *SCHEDULE_STEPS) if saved.get(k) is not None}
    mine = _schedule(args)
    in_samples = all(saved.get(k) is not None and mine[k] is not None for k in SCHEDULE_STEPS)
    keys = [k for k in SCHEDULE_FLAGS if not (in_samples and k in ("lr_warmup_iters", "lr_decay_iters"))]
    for k in (*keys, *(SCHEDULE_STEPS if in_samples else ())):
        if k in saved and saved[k] != mine[k] and not _truncated_warmup(k, saved[k], mine[k]):
            part = k.split("_")[1] if k in SCHEDULE_STEPS else ""  # lr_warmup_steps / lr_decay_steps
            what = (f"a learning-rate {part} of {saved[k]} samples, this run has {mine[k]} "
                    f"(--lr-{part}-iters x --global-batch-size, or --lr-{part}-samples)"
                    if k in SCHEDULE_STEPS else f"--{k.replace('_', '-')} {saved[k]}, this run has {mine[k]}")
            raise CheckpointError(f"--load {args.load}: checkpoint iteration {iteration} was trained with {what}; add "
                                  f"--override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler", alike=True)
    return {}


def _truncated_warmup(key: str, saved, mine) -> bool:
    """A checkpoint of an earlier version of this driver, which saved a --lr-warmup-fraction warm-up truncated to
    whole samples (Megatron-LM and this driver now keep the fraction's product): the same schedule."""
    return key == "lr_warmup_steps" and isinstance(saved, int) and isinstance(mine, float) and saved == int(mine)


# ----------------------------------------------------------------------------------------- state
def unwrap(chunk):
    """The model chunk inside a data-parallel wrapper (DDP, FSDP2), else ``chunk``."""
    return getattr(chunk, "module", chunk)


def _model_keys(chunks) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _unwrapped_by_key(chunks) -> dict:
    """The model chunks, unwrapped, by Megatron's checkpoint key (``model``, or ``model0``, ``model1``, ...)."""
    return {key: unwrap(chunk) for key, chunk in zip(_model_keys(chunks), chunks)}


def rng_state() -> dict:
    """This rank's RNG streams: torch's CPU generator and, on a GPU, the CUDA generator and
    megatron-core's model-parallel CUDA RNG tracker (dropout in tensor-parallel regions)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_tracker"] = get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` saved (CUDA parts only where saved and a GPU is in use)."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        torch.cuda.set_rng_state(state["cuda"])
        get_cuda_rng_tracker().set_states(state["cuda_tracker"])


def _rng_object(state):
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    return ShardedObject("rng_state", state, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _sharded_state(args, iteration: int, chunks, optimizer, *, loading: bool, with_optimizer: bool = True,
                   with_rng: bool = True, optimizer_metadata: Optional[dict] = None,
                   schedule_steps: Optional[int] = None, skipped_samples: int = 0) -> dict:
    state: dict = {}
    model_sds = []
    for key, chunk in zip(_model_keys(chunks), chunks):
        sd = fsdp.sharded_state_dict(chunk) if fsdp.is_fsdp2(chunk) else unwrap(chunk).sharded_state_dict()
        state[key] = sd
        model_sds.append(sd)
    if with_optimizer:
        state["optimizer"] = (optimizer.sharded_state_dict(model_sds, is_loading=loading) if optimizer_metadata is None
                              else optimizer.sharded_state_dict(model_sds, is_loading=loading,
                                                                metadata=optimizer_metadata))
    if with_rng:
        state["rng_state"] = _rng_object(None if loading else rng_state())
    if not loading:
        state.update(_common_state(args, iteration, schedule_steps, skipped_samples))
    return state


def _common_state(args, iteration: int, schedule_steps: Optional[int] = None, skipped_samples: int = 0) -> dict:
    """What every rank shares (``common.pt``): iteration, samples, schedule (with its ``num_steps``, as
    megatron-core's scheduler saves it: ``schedule_steps``, default the samples before ``iteration``), model shape
    and layout, and the flags as Megatron-LM's ``args`` (its ``--use-checkpoint-args`` and this driver's read
    them)."""
    steps = steps_before(args, iteration) if schedule_steps is None else schedule_steps
    saved_args = megatron_args(args, run_padded_vocab_size(args))
    saved_args.skipped_train_samples = skipped_samples  # where Megatron-LM keeps it
    return dict(iteration=iteration, checkpoint_version=CHECKPOINT_VERSION, args=saved_args,
                skipped_train_samples=skipped_samples,
                consumed_train_samples=schedule_of(args).consumed_samples(iteration),
                opt_param_scheduler={**_schedule(args), "num_steps": steps},
                h3t={"model": _model_shape(args), "layout": _layout(args),
                     "saved": {"optimizer": not args.no_save_optim, "rng": not args.no_save_rng}})


# ----------------------------------------------------------------------------------------- save / load
def save_checkpoint(args, iteration: int, chunks, optimizer, *, on_gpu: bool,
                    schedule_steps: Optional[int] = None, skipped_samples: int = 0) -> None:
    """Write ``iter_N`` under ``--save`` (collective: every rank calls it); ``schedule_steps``: the learning-rate
    schedule's ``num_steps`` (:mod:`h3t_training.loop.param_schedule`); ``skipped_samples``: the samples
    ``--iterations-to-skip`` read past so far (Megatron-LM's ``skipped_train_samples``)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    from h3t_ext.checkpointing import save_strategy

    finite = torch.tensor([all(bool(torch.isfinite(fsdp.local(p)).all()) for c in chunks for p in c.parameters())],
                          dtype=torch.int)
    finite = all_reduce_host(finite, op=dist.ReduceOp.MIN)
    if not finite.item():
        raise CheckpointError(f"iteration {iteration}: the model holds non-finite weights; no checkpoint written, "
                              f"the latest stays the previous one")
    final = iter_dir(args.save, iteration)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-save
        os.makedirs(tmp)
    dist.barrier()
    error = ""
    try:
        if args.ckpt_format == "torch":  # Megatron-LM's legacy per-rank files
            common = _common_state(args, iteration, schedule_steps, skipped_samples)
            written = legacy.save(tmp, args, iteration, _unwrapped_by_key(chunks), optimizer, common=common,
                                  rng=rng_state())
            dist.barrier()
            _write_checksums(tmp, written)
        else:
            dist_checkpointing.save(_sharded_state(args, iteration, chunks, optimizer, loading=False,
                                                   with_optimizer=not args.no_save_optim,
                                                   with_rng=not args.no_save_rng, schedule_steps=schedule_steps,
                                                   skipped_samples=skipped_samples), tmp,
                                    sharded_strategy=save_strategy(on_gpu))
            dist.barrier()
            _write_checksums(tmp)
    except (Exception, CheckpointException) as e:  # disk full, permissions, quota: abandoned on every rank
        error = _first_line(e)
    failed = [None] * dist.get_world_size()
    dist.all_gather_object(failed, error)
    if any(failed):  # the rank whose own write failed (its error names the file), else the first
        rank = min((r for r, e in enumerate(failed) if e), key=lambda r: ("[Errno " not in failed[r], r))
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        raise CheckpointError(f"iteration {iteration}: the checkpoint could not be written to {args.save} (rank "
                              f"{rank}: {failed[rank]}); its temporary files are removed and the latest "
                              f"checkpoint is unchanged")
    if dist.get_rank() == 0:
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        tracker = os.path.join(args.save, TRACKER)
        with open(tracker + ".tmp", "w") as f:
            f.write(f"{iteration}\n")
        os.replace(tracker + ".tmp", tracker)
    dist.barrier()


def _first_line(e: BaseException) -> str:
    """The innermost cause of ``e`` in one line (DCP gathers each rank's failure into its own exception)."""
    failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if failures:
        wrapped = next(iter(failures.values()))
        e = wrapped[0] if isinstance(wrapped, tuple) else wrapped
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _write_checksums(directory: str, written: Optional[list] = None) -> None:
    """Each rank hashes the files it wrote (``written``, paths relative to ``directory``; by default its
    ``__<rank>_*.distcp`` tensor files, and rank 0 the shared ones too), and rank 0 writes the manifest
    (collective)."""
    rank = dist.get_rank()
    if written is None:
        written = [name for name in sorted(os.listdir(directory)) if name != CHECKSUMS and
                   (name.startswith(f"__{rank}_") or (rank == 0 and not name.startswith("__")))]
    mine = {name: file_digest(os.path.join(directory, name)) for name in written}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        files = {k: v for part in everyone for k, v in part.items()}
        with open(os.path.join(directory, CHECKSUMS), "w") as f:
            json.dump(files, f, indent=0, sort_keys=True)


def load_checkpoint(found: FoundCheckpoint, args, chunks, optimizer) -> tuple[int, list[str]]:
    """Load ``found`` into the model (and optimizer, RNG); returns (start iteration, notices)."""
    from megatron.core import dist_checkpointing

    notes = []
    finetune = bool(args.finetune)
    megatron = WRITTEN_BY in found.common
    with_optimizer = not (finetune or args.no_load_optim) and (not megatron or
                                                               found.common[WRITTEN_BY]["optimizer_saved"])
    with_rng = not (finetune or args.no_load_rng)
    blocker = optimizer.load_blocker() if with_optimizer else None
    if blocker:
        raise CheckpointError(f"checkpoint {found.directory}: {blocker}", alike=True)
    if found.legacy:
        return _load_legacy(found, args, chunks, optimizer, with_optimizer, with_rng)
    rng_template, metadata = None, None
    if megatron:
        # A checkpoint Megatron-LM wrote: its RNG states in Megatron's ShardedObject (restored where Megatron-LM
        # restores them); its optimizer state is megatron-core's, which only megatron-core's optimizer reads (a
        # GPU run: find_checkpoint refused a CPU run without --no-load-optim), with the checkpoint's content
        # metadata (its distrib_optim_sharding_type), as Megatron-LM's load_checkpoint builds the request.
        if with_rng:
            rng_template, reason = megatron_written.rng_template(found.common, args)
            if reason:
                notes.append(f"checkpoint iteration {found.iteration}: {reason}")
        if with_optimizer:
            metadata = megatron_written.optimizer_metadata(found.directory, found.common, args)
    elif with_rng and not found.same_layout:
        with_rng = False
        notes.append(f"checkpoint iteration {found.iteration} was saved with another parallel layout: resharded; "
                     f"RNG states start from --seed")
    template = _sharded_state(args, found.iteration, chunks, optimizer, loading=True, with_optimizer=with_optimizer,
                              with_rng=with_rng and not megatron, optimizer_metadata=metadata)
    if rng_template is not None:
        template["rng_state"] = rng_template
    try:
        loaded = dist_checkpointing.load(template, found.directory)
        for key, chunk in zip(_model_keys(chunks), chunks):
            if fsdp.is_fsdp2(chunk):  # this rank's rows only, read into its shards
                fsdp.load_state(chunk, loaded[key])
            else:
                unwrap(chunk).load_state_dict(loaded[key], strict=True)
        if with_optimizer:
            optimizer.load_sharded_state_dict(loaded["optimizer"])
        else:  # as Megatron-LM: the optimizer's own copies of the weights follow the loaded model
            optimizer.reload_model_params()
        if rng_template is not None:
            megatron_written.set_rng_state(loaded["rng_state"],
                                           data_parallel_random_init=args.data_parallel_random_init)
        elif with_rng and not megatron:
            set_rng_state(loaded["rng_state"])
    except BaseException as e:  # DCP's CheckpointException is a BaseException; only an interrupt or exit passes
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        verify_layout(found.directory, 0, 1)  # every file, now: names the file when one is misplaced
        raise CheckpointError(f"checkpoint {found.directory} cannot be loaded into this model: "
                              f"{_first_line(e)}") from None
    return (0 if finetune else found.iteration), notes


def _load_legacy(found: FoundCheckpoint, args, chunks, optimizer, with_optimizer: bool,
                 with_rng: bool) -> tuple[int, list[str]]:
    """:func:`load_checkpoint` of a ``--ckpt-format torch`` checkpoint (its layout was checked by
    :func:`find_checkpoint`); RNG states where it has one for this data-parallel rank."""
    megatron = WRITTEN_BY in found.common
    try:
        rng = legacy.load(found.directory, _unwrapped_by_key(chunks), optimizer, with_optimizer=with_optimizer,
                          with_rng=with_rng, megatron=megatron)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # noqa: BLE001 - a file that does not fit this model, in one line
        raise CheckpointError(f"checkpoint {found.directory} cannot be loaded into this model: "
                              f"{_first_line(e)}") from None
    notes = []
    if rng is not None and megatron:
        try:
            megatron_written.set_rng_state(rng, data_parallel_random_init=args.data_parallel_random_init)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {found.directory}: {e}") from None
    elif rng is not None:
        set_rng_state(rng)
    elif with_rng:
        notes.append(f"checkpoint iteration {found.iteration} was saved at another data-parallel size; RNG states "
                     f"start from --seed")
    return (0 if args.finetune else found.iteration), notes


__all__ = ["CheckpointError", "FoundCheckpoint", "check_latest", "find_checkpoint", "find_load", "load_checkpoint",
           "rng_state", "save_checkpoint", "set_rng_state"]
