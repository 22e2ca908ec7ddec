"""Training data from megatron-core's GPT datasets (mock or indexed .bin/.idx).

Sample order follows Megatron's pretraining sampler: iteration ``it`` takes samples
``[it*B, (it+1)*B)``; microbatch ``j`` of data-parallel rank ``r`` takes
``it*B + j*(mbs*dp) + r*mbs + [0, mbs)``. The context-parallel ranks of a data-parallel rank read
the same samples and each keeps its two of the ``2c`` sequence chunks (megatron-core's
``get_batch_on_this_cp_rank``: chunks ``r`` and ``2c-1-r``). The position is a pure function of the iteration,
so a resumed run reads exactly the samples an uninterrupted run would.
"""
from __future__ import annotations

import logging
from typing import Iterator, Optional

import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.utils import get_batch_on_this_cp_rank


def _blend(data_path: Optional[list[str]]):
    """Megatron's ``--data-path [w1] p1 [w2] p2 ...`` -> (prefixes, weights or None)."""
    if data_path is None:
        return None
    if len(data_path) == 1:
        return [data_path[0]], None
    if len(data_path) % 2:
        raise ValueError("--data-path with several prefixes needs a weight before each")
    weights = [float(w) for w in data_path[0::2]]
    return list(data_path[1::2]), weights


def build_train_dataset(args, tokenizer) -> GPTDataset:
    """The training split, with enough samples for ``--train-iters`` iterations."""
    logging.getLogger("megatron.core.datasets").setLevel(logging.WARNING)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=_blend(args.data_path),
        split=args.split if args.data_path else None,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,
    )
    if config.split_matrix is not None:  # only the training range is built here (as Megatron's split puts it);
        # megatron-core loops forever on a requested split that holds no document (e.g. the 1 of 949,50,1)
        config.split_matrix = [config.split_matrix[0], None, None]
    cls = MockGPTDataset if args.mock_data else GPTDataset
    sizes = [args.train_iters * args.global_batch_size, 0, 0]
    train, _, _ = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
    if train is None or len(train) < sizes[0]:
        raise RuntimeError(f"the training split has {0 if train is None else len(train)} samples, "
                           f"{sizes[0]} needed (check --split)")
    return train


class MicrobatchIterator:
    """Yields this data-parallel rank's microbatches, iteration after iteration."""

    def __init__(self, dataset, *, start_iteration: int, global_batch_size: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, device: torch.device, cp_group=None):
        self.dataset = dataset
        self.cp_group = cp_group
        self.B, self.mbs = global_batch_size, micro_batch_size
        self.dp_rank, self.dp = data_parallel_rank, data_parallel_size
        self.num_microbatches = global_batch_size // (micro_batch_size * data_parallel_size)
        self.iteration, self.microbatch = start_iteration, 0
        self.device = device

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        first = (self.iteration * self.B + self.microbatch * self.mbs * self.dp + self.dp_rank * self.mbs)
        samples = [self.dataset[first + i] for i in range(self.mbs)]
        self.microbatch += 1
        if self.microbatch == self.num_microbatches:
            self.iteration, self.microbatch = self.iteration + 1, 0
        batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples]).to(self.device)
                 for k in ("tokens", "labels", "loss_mask", "position_ids")}
        if self.cp_group is not None and self.cp_group.size() > 1:
            batch = get_batch_on_this_cp_rank(batch, cp_group=self.cp_group)
        return batch


def build_data_iterators(args, dataset, *, start_iteration: int, num_chunks: int, data_parallel_rank: int,
                         device: torch.device, cp_group=None) -> list[MicrobatchIterator]:
    """One iterator per model chunk (each chunk's forward consumes its own, in the same order); with a
    context-parallel group of size c > 1 each yields this rank's two sequence chunks."""
    return [MicrobatchIterator(dataset, start_iteration=start_iteration, global_batch_size=args.global_batch_size,
                               micro_batch_size=args.micro_batch_size, data_parallel_rank=data_parallel_rank,
                               data_parallel_size=args.data_parallel_size, device=device, cp_group=cp_group)
            for _ in range(num_chunks)]
