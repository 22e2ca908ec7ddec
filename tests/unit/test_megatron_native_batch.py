"""Megatron's own loop takes each batch as the installed Megatron-LM does (h3t_training.loop.megatron_native
.batch_on_this_tp_rank): up to 0.18 through megatron.training.utils' iterator form; from 0.19 (which moved the
function to megatron.core.utils and has it take the batch tensor-parallel rank 0 read; an H200 run stopped at its
first batch before) rank 0 reads the iterator, moves the tensors to the device and megatron-core broadcasts them."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from h3t_training.loop import megatron_native
from tests.activation_harness import init_single_process_megatron

BATCH = {"tokens": torch.arange(8).view(2, 4), "labels": torch.ones(2, 4, dtype=torch.long),
         "loss_mask": torch.ones(2, 4), "position_ids": torch.arange(4).expand(2, 4), "attention_mask": None}


def _fake_megatron(monkeypatch, utils):
    args = SimpleNamespace(create_attention_mask_in_dataloader=False, context_parallel_size=1, micro_batch_size=2,
                           seq_length=4, pipeline_model_parallel_size=1)
    modules = {".utils": utils, "": SimpleNamespace(get_args=lambda: args)}
    monkeypatch.setattr(megatron_native, "_megatron", lambda name: modules[name])


def test_up_to_0_18_the_iterator_form(monkeypatch):
    seen = []
    _fake_megatron(monkeypatch, SimpleNamespace(get_batch_on_this_tp_rank=lambda it: seen.append(it) or "batch"))
    it = iter([BATCH])
    assert megatron_native.batch_on_this_tp_rank(it) == "batch" and seen == [it]


def test_from_0_19_rank_0_reads_moves_and_megatron_core_broadcasts(monkeypatch):
    from megatron.core import utils as core_utils

    init_single_process_megatron()
    calls = []

    def broadcast(batch, **kw):
        calls.append((batch, kw))
        return batch
    monkeypatch.setattr(core_utils, "get_batch_on_this_tp_rank", broadcast, raising=False)
    _fake_megatron(monkeypatch, SimpleNamespace())  # 0.19's megatron.training.utils: no such function
    moved = []
    got = megatron_native.batch_on_this_tp_rank(iter([dict(BATCH)]), to_device=lambda t: moved.append(t) or t)
    assert len(moved) == 4 and got["attention_mask"] is None and torch.equal(got["tokens"], BATCH["tokens"])
    ((_, kw),) = calls
    assert kw["tp_rank"] == 0 and kw["broadcast_src_rank"] == 0 and kw["seq_length"] == 4
    assert kw["micro_batch_size"] == 2 and not kw["has_cu_seqlens"] and not kw["mtp_on_this_rank"]
    assert kw["is_pipeline_first_stage"] and kw["is_pipeline_last_stage"]
