"""Which samples of a split a data-parallel rank's microbatch reads, as Megatron-LM's ``--dataloader-type`` samples
them, written as pure functions of the samples the run has consumed (so a resume continues exactly).

* ``single`` (Megatron's ``MegatronPretrainingSampler``, the default): the split in order; a global step of
  ``micro_batch_size x data-parallel size`` samples gives rank r its r-th ``micro_batch_size`` run of them.
* ``cyclic`` (``MegatronPretrainingRandomSampler`` with data sharding, Megatron's default): the first
  ``total - total mod (micro_batch_size x d)`` samples are cut into d contiguous buckets, one per data-parallel rank,
  and every epoch visits each bucket in the order of ``torch.randperm`` seeded with the epoch number; a rank's
  microbatches walk its bucket's permutation ``micro_batch_size`` at a time, and after the last the next epoch begins
  (Megatron's ``cyclic_iter``).
"""
from __future__ import annotations

from functools import lru_cache

DATALOADER_TYPES = ("single", "cyclic")
"""The ``--dataloader-type`` values this driver samples (Megatron-LM's ``external``, a user's own loader, is not)."""


def single_indices(consumed: int, *, micro_batch_size: int, data_parallel_size: int, data_parallel_rank: int
                   ) -> list[int]:
    """The samples of this rank's microbatch that starts after ``consumed`` samples (all ranks' together)."""
    first = consumed + data_parallel_rank * micro_batch_size
    return list(range(first, first + micro_batch_size))


@lru_cache(maxsize=4)
def _epoch_order(bucket: int, epoch: int) -> tuple[int, ...]:
    import torch  # here: the flags' parser reads DATALOADER_TYPES without importing torch

    g = torch.Generator()
    g.manual_seed(epoch)
    return tuple(torch.randperm(bucket, generator=g).tolist())


def cyclic_indices(consumed: int, *, total_samples: int, micro_batch_size: int, data_parallel_size: int,
                   data_parallel_rank: int) -> list[int]:
    """The samples of this rank's microbatch that starts after ``consumed`` samples, sampled as Megatron's cyclic
    loader samples a split of ``total_samples`` (its ``len(dataset)``)."""
    step = micro_batch_size * data_parallel_size
    active = total_samples - total_samples % step
    if active <= 0:
        raise ValueError(f"a split of {total_samples} samples holds no step of {step} (micro batch x data-parallel "
                         f"size) for --dataloader-type cyclic")
    epoch, offset = divmod(consumed, active)
    if offset % step:
        raise ValueError(f"{consumed} consumed samples is not a whole number of steps of {step}")
    bucket = active // data_parallel_size
    order = _epoch_order(bucket, epoch)
    start = offset // data_parallel_size
    return [data_parallel_rank * bucket + i for i in order[start:start + micro_batch_size]]
