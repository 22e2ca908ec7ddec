"""Training data from megatron-core's GPT datasets (mock or indexed .bin/.idx).

Sample order follows Megatron's pretraining sampler: iteration ``it`` takes samples
``[it*B, (it+1)*B)``; microbatch ``j`` of data-parallel rank ``r`` takes
``it*B + j*(mbs*dp) + r*mbs + [0, mbs)``. The context-parallel ranks of a data-parallel rank read
the same samples and each keeps its two of the ``2c`` sequence chunks (megatron-core's
``get_batch_on_this_cp_rank``: chunks ``r`` and ``2c-1-r``). The position is a pure function of the iteration,
so a resumed run reads exactly the samples an uninterrupted run would.
"""
from __future__ import annotations

import inspect
import logging
from typing import Callable, Iterator, Optional

import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.utils import get_batch_on_this_cp_rank

from h3t_training.data.batch_schedule import BatchSchedule, schedule_of
from h3t_training.data.data_checks import parse_blend, parse_split
from h3t_training.data.eval_schedule import validation_samples
from h3t_training.data.samplers import DATALOADER_TYPES, cyclic_indices, single_indices
from h3t_training.launch.quiet_imports import DropMessages

_CP_SPLIT_TAKES_HYBRID = "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters
"""megatron-core 0.19's ``get_batch_on_this_cp_rank(batch, is_hybrid_cp, cp_group=None, ...)``; 0.16's
``(batch, cp_group=None)``."""


def batch_on_this_cp_rank(batch: dict, cp_group=None) -> dict:
    """megatron-core's load-balanced context-parallel split of ``batch`` (chunks r and 2c-1-r of the sequence on
    rank r), in the signature of the installed version (0.19: not hybrid context parallelism, per-sequence)."""
    if _CP_SPLIT_TAKES_HYBRID:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(batch, cp_group=cp_group)


def _blend(data_path: Optional[list[str]]):
    """A ``--data-path``-style list as megatron-core's blend (None stays None); the one reading of such lists is
    :func:`~h3t_training.data.data_checks.parse_blend` (checked with the config before any rank starts)."""
    return None if data_path is None else parse_blend(data_path)


# megatron-core warns on every rank that it cannot cache a dataset's sample index without --data-cache-path; the index
# is then built in memory, which is what a run without that flag asks for
logging.getLogger("megatron.core.datasets.gpt_dataset").addFilter(DropMessages("because path_to_cache is None"))


def split_sizes(args) -> list[int]:
    """Samples per split as Megatron-LM computes them: train, the samples of ``train_iters`` iterations
    (``train_iters*B`` at a constant batch size); valid, every evaluation's ``eval_iters * E`` samples
    (:func:`~h3t_training.data.eval_schedule.validation_samples`); test ``eval_iters * E``, with E
    ``--eval-global-batch-size``."""
    E = args.eval_global_batch_size
    valid = validation_samples(train_iters=args.train_iters, eval_interval=args.eval_interval,
                               eval_iters=args.eval_iters, eval_global_batch_size=E,
                               start_eval_at_iter=args.start_eval_at_iter, skip_train=args.skip_train)
    return [schedule_of(args).consumed_samples(args.train_iters), valid, args.eval_iters * E]


def _split_weights(split: str) -> list[float]:
    return list(parse_split(split, allow_no_train=True))


def splits_wanted(args) -> tuple[bool, bool]:
    """(valid, test): whether each held-out split exists: a nonzero part of ``--split`` (also with
    ``--mock-data``), or ``--valid-data-path`` / ``--test-data-path``; ``--eval-iters 0`` turns both off."""
    if args.eval_iters == 0:
        return False, False
    if args.train_data_path or args.valid_data_path or args.test_data_path:
        return args.valid_data_path is not None, args.test_data_path is not None
    w = _split_weights(args.split)
    return w[1] > 0, w[2] > 0


def _splits_with_documents(args, split_matrix, valid_on: bool, test_on: bool, notify) -> tuple[bool, bool]:
    """A held-out split that gets no document of some blended dataset is dropped, with a notice on rank
    0 (megatron-core would loop forever building it); a split's documents are the range
    ``round(beg * n) .. round(end * n)`` of each dataset's n documents, as megatron-core cuts them."""
    from h3t_training.data.data_checks import check_indexed_dataset

    counts = [check_indexed_dataset(prefix) for prefix in parse_blend(args.data_path)[0]]
    wanted = [True, valid_on, test_on]
    for i, name in ((1, "validation"), (2, "test")):
        if not wanted[i] or split_matrix[i] is None:
            continue
        beg, end = split_matrix[i]
        if any(int(round(end * n)) <= int(round(beg * n)) for n in counts):
            wanted[i] = False
            notify(f"note: --split {args.split} leaves the {name} split no document of the "
                   f"{min(counts)} in --data-path; no {name} evaluation")
    return wanted[1], wanted[2]


def _silent(line: str) -> None:
    del line


def build_datasets(args, tokenizer, *, notify: Callable[[str], None] = _silent) -> tuple:
    """(train, valid, test) through megatron-core's BlendedMegatronDatasetBuilder; a split that is
    not wanted (see :func:`splits_wanted`) is None. The training split depends only on its own size,
    so evaluation flags never change the training samples. ``notify`` gets the notices (the caller
    passes its rank-0 printer)."""
    logging.getLogger("megatron.core.datasets").setLevel(logging.WARNING)
    per_split = bool(args.train_data_path or args.valid_data_path or args.test_data_path)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if per_split else _blend(args.data_path),
        blend_per_split=[_blend(args.train_data_path), _blend(args.valid_data_path),
                         _blend(args.test_data_path)] if per_split else None,
        split=args.split if args.data_path or args.mock_data else None,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=False,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,
    )
    valid_on, test_on = splits_wanted(args)
    if config.split_matrix is not None and not args.mock_data and not per_split:
        valid_on, test_on = _splits_with_documents(args, config.split_matrix, valid_on, test_on, notify)
    if config.split_matrix is not None:  # only the ranges evaluation asks for are built: megatron-core loops
        # forever on a requested split that holds no document (e.g. the 1 of 949,50,1 on a small corpus)
        config.split_matrix = [config.split_matrix[0], config.split_matrix[1] if valid_on else None,
                               config.split_matrix[2] if test_on else None]
    cls = TrainingMockGPTDataset if args.mock_data else TrainingGPTDataset
    train_needed = not args.skip_train
    sizes = split_sizes(args)
    sizes = [sizes[0] if (train_needed or not per_split or args.train_data_path) else None,
             sizes[1] if valid_on else (0 if not per_split else None),
             sizes[2] if test_on else (0 if not per_split else None)]
    train, valid, test = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
    blends = [b for b in (config.blend, *(config.blend_per_split or ())) if b is not None]
    hint = "a blend without weights holds one epoch of each dataset's split, as in megatron-core" \
        if any(w is None and len(p) > 1 for p, w in blends) else "check --split"
    if train_needed and (train is None or len(train) < sizes[0]):
        raise RuntimeError(f"the training split has {0 if train is None else len(train)} samples, "
                           f"{sizes[0]} needed ({hint})")
    for name, on, ds, n in (("validation", valid_on, valid, sizes[1]), ("test", test_on, test, sizes[2])):
        if on and (ds is None or len(ds) < n):
            raise RuntimeError(f"the {name} split has {0 if ds is None else len(ds)} samples, {n} needed "
                               f"({hint})")
    return train, (valid if valid_on else None), (test if test_on else None)


class _UncachedMasks:
    """megatron-core's GPT datasets without their mask cache. In megatron-core 0.16.1 ``GPTDataset.__getitem__``
    caches the loss mask of the first sample a process reads and then, on that same tensor, zeroes the positions
    whose label is the pad token (``loss_mask[labels == pad] = 0``): every later sample of the process inherits the
    first one's padding zeros. The loss then depends on which sample each rank happened to read first, so the same
    model and data give different losses at another data-parallel size, micro batch size or after a resume
    (found as a 1.4e-4 relative loss difference after resuming a d=2 run). Computing the masks for every sample
    (cheap: a comparison per token, no attention mask is built) makes each sample's mask its own."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.masks_and_position_ids_are_cacheable = False


class TrainingGPTDataset(_UncachedMasks, GPTDataset):
    """:class:`GPTDataset` with each sample's own loss mask (:class:`_UncachedMasks`)."""


class TrainingMockGPTDataset(_UncachedMasks, MockGPTDataset):
    """:class:`MockGPTDataset` with each sample's own loss mask (:class:`_UncachedMasks`)."""


def build_train_dataset(args, tokenizer) -> GPTDataset:
    """The training split, with enough samples for ``--train-iters`` iterations."""
    return build_datasets(args, tokenizer)[0]


class MicrobatchIterator:
    """Yields this data-parallel rank's microbatches, iteration after iteration (``global_batch_size``: an int,
    or a :class:`~h3t_training.data.batch_schedule.BatchSchedule` whose batch size changes with the iteration),
    with the samples Megatron-LM's ``--dataloader-type`` (``sampling``) gives the rank (:mod:`samplers`)."""

    def __init__(self, dataset, *, start_iteration: int, global_batch_size, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, device: torch.device, cp_group=None,
                 sampling: str = "single"):
        if sampling not in DATALOADER_TYPES:
            raise ValueError(f"sampling {sampling!r} is not one of {DATALOADER_TYPES}")
        self.dataset = dataset
        self.sampling = sampling
        self.cp_group = cp_group
        self.schedule = global_batch_size if isinstance(global_batch_size, BatchSchedule) \
            else BatchSchedule.constant(global_batch_size)
        self.mbs = micro_batch_size
        self.dp_rank, self.dp = data_parallel_rank, data_parallel_size
        self.microbatch = 0
        self.device = device
        self._start(start_iteration)

    def _start(self, iteration: int) -> None:
        self.iteration = iteration
        self.first_sample = self.schedule.consumed_samples(iteration)
        self.num_microbatches = self.schedule.batch_size(iteration) // (self.mbs * self.dp)

    def __iter__(self) -> Iterator[dict]:
        return self

    def skip_iteration(self) -> None:
        """Read past the rest of this iteration's microbatches (``--iterations-to-skip``: Megatron-LM's
        ``dummy_train_step`` reads them and trains on nothing); the next one is the following iteration's first."""
        self.microbatch = 0
        self._start(self.iteration + 1)

    def __next__(self) -> dict:
        consumed = self.first_sample + self.microbatch * self.mbs * self.dp
        if self.sampling == "cyclic":
            indices = cyclic_indices(consumed, total_samples=len(self.dataset), micro_batch_size=self.mbs,
                                     data_parallel_size=self.dp, data_parallel_rank=self.dp_rank)
        else:
            indices = single_indices(consumed, micro_batch_size=self.mbs, data_parallel_size=self.dp,
                                     data_parallel_rank=self.dp_rank)
        samples = [self.dataset[i] for i in indices]
        self.microbatch += 1
        if self.microbatch == self.num_microbatches:
            self.microbatch = 0
            self._start(self.iteration + 1)
        batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]).to(self.device)
                 for k in ("tokens", "labels", "loss_mask", "position_ids")}
        if self.cp_group is not None and self.cp_group.size() > 1:
            batch = batch_on_this_cp_rank(batch, cp_group=self.cp_group)
        return batch


def build_data_iterators(args, dataset, *, start_iteration: int, num_chunks: int, data_parallel_rank: int,
                         device: torch.device, cp_group=None, global_batch_size: Optional[int] = None,
                         micro_batch_size: Optional[int] = None) -> list[MicrobatchIterator]:
    """One iterator per model chunk (each chunk's forward consumes its own, in the same order); with a
    context-parallel group of size c > 1 each yields this rank's two sequence chunks. Batches follow the training's
    batch schedule and micro batch, or ``global_batch_size`` (constant) and ``micro_batch_size`` (evaluation's)."""
    return [MicrobatchIterator(dataset, start_iteration=start_iteration,
                               global_batch_size=schedule_of(args) if global_batch_size is None else global_batch_size,
                               micro_batch_size=micro_batch_size or args.micro_batch_size,
                               data_parallel_rank=data_parallel_rank,
                               data_parallel_size=args.data_parallel_size, device=device, cp_group=cp_group,
                               sampling=args.dataloader_type)
            for _ in range(num_chunks)]
