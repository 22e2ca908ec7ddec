"""Each training sample carries its own loss mask, whatever a process read before it: megatron-core 0.16.1's
GPTDataset writes the first sample's padding zeros into the loss mask it caches, which made losses depend on the
data-parallel size, the micro batch size and resumes (h3t_training.data.datasets._UncachedMasks)."""
from __future__ import annotations

import pytest
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

from h3t_training.data.datasets import TrainingMockGPTDataset
from h3t_training.data.tokenizer import ByteTokenizer


def _build(cls):
    config = GPTDatasetConfig(random_seed=7, sequence_length=64, split="100,0,0", tokenizer=ByteTokenizer(),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              create_attention_mask=False, path_to_cache=None)
    return BlendedMegatronDatasetBuilder(cls, [64, 0, 0], lambda: True, config).build()[0]


def _masks(dataset, order):
    return {i: dataset[i]["loss_mask"].clone() for i in order}


def _padded() -> list[int]:
    """Samples of the mock data whose labels hold the pad token (their own masks have zeros)."""
    fixed = _build(TrainingMockGPTDataset)
    return [i for i in range(32) if bool((fixed[i]["loss_mask"] == 0).any())]


@pytest.mark.parametrize("cls,independent", [(TrainingMockGPTDataset, True), (MockGPTDataset, False)])
def test_a_samples_mask_does_not_depend_on_what_was_read_before(cls, independent):
    """Read a padded sample first, then the rest: with the fix every mask is the one read in index order; with
    megatron-core's own class (the guard: when it stops failing, upstream fixed it) some are not."""
    padded = _padded()
    assert padded and len(padded) < 32, "the mock data must hold padded and unpadded samples for this test"
    first = padded[-1]
    order = [first, *[i for i in range(32) if i != first]]
    in_order = _masks(_build(cls), range(32)) if independent else _masks(_build(TrainingMockGPTDataset), range(32))
    mixed = _masks(_build(cls), order)
    assert all(torch.equal(in_order[i], mixed[i]) for i in range(32)) is independent
