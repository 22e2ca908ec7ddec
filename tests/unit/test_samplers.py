"""Megatron-LM's --dataloader-type samplers as the driver reads them (h3t_training/data/samplers.py): the pure
function of the consumed samples against a stateful walk of the same rule (a loader restarted every epoch, as
Megatron's cyclic_iter restarts MegatronPretrainingRandomSampler), and the properties that make it a sampler."""
from __future__ import annotations

import itertools

import pytest
import torch

from h3t_training.data.samplers import cyclic_indices, single_indices


def _walk(total, mbs, dp, rank, steps):
    """A rank's microbatches over ``steps`` global steps: per epoch, its bucket in torch.randperm(bucket, seed=epoch)
    order, ``mbs`` at a time; a new epoch after the bucket is used up."""
    active = total - total % (mbs * dp)
    bucket = active // dp
    out = []
    for epoch in itertools.count():
        g = torch.Generator()
        g.manual_seed(epoch)
        order = torch.randperm(bucket, generator=g).tolist()
        for k in range(0, bucket - bucket % mbs, mbs):
            out.append([rank * bucket + i for i in order[k:k + mbs]])
            if len(out) == steps:
                return out


@pytest.mark.parametrize("total, mbs, dp", [(10, 1, 1), (17, 2, 2), (64, 4, 2), (100, 3, 4), (9, 1, 3)])
def test_cyclic_is_the_walk_of_each_ranks_bucket_over_epochs(total, mbs, dp):
    steps = 3 * (total // (mbs * dp)) + 1  # three epochs and one step into the fourth
    for rank in range(dp):
        got = [cyclic_indices(k * mbs * dp, total_samples=total, micro_batch_size=mbs, data_parallel_size=dp,
                              data_parallel_rank=rank) for k in range(steps)]
        assert got == _walk(total, mbs, dp, rank, steps)


def test_an_epoch_reads_every_sample_of_the_whole_steps_once_in_a_new_order():
    total, mbs, dp = 50, 2, 3
    active, per_epoch = 48, 8
    epochs = []
    for e in range(2):
        seen = [i for k in range(e * per_epoch, (e + 1) * per_epoch) for r in range(dp)
                for i in cyclic_indices(k * mbs * dp, total_samples=total, micro_batch_size=mbs, data_parallel_size=dp,
                                        data_parallel_rank=r)]
        assert sorted(seen) == list(range(active))
        epochs.append(seen)
    assert epochs[0] != epochs[1] and epochs[0] != list(range(active))


def test_single_is_the_split_in_order():
    got = [i for k in range(3) for r in range(2)
           for i in single_indices(k * 4, micro_batch_size=2, data_parallel_size=2, data_parallel_rank=r)]
    assert got == list(range(12))


def test_a_split_without_one_whole_step_and_an_unaligned_position_are_errors():
    with pytest.raises(ValueError, match="holds no step of 8"):
        cyclic_indices(0, total_samples=7, micro_batch_size=4, data_parallel_size=2, data_parallel_rank=0)
    with pytest.raises(ValueError, match="not a whole number of steps of 4"):
        cyclic_indices(2, total_samples=16, micro_batch_size=2, data_parallel_size=2, data_parallel_rank=0)
