"""h3t_ext.testing's rank launcher on a GPU machine: its forkserver must not import anything that initialises CUDA
before it forks a rank (the second lease's GPU tier failed nine tests with "Cannot re-initialize CUDA in forked
subprocess": the server's preload of megatron-core had done so)."""
from __future__ import annotations

import multiprocessing.forkserver as forkserver

import torch

from h3t_ext import testing


def _preload_after_context(monkeypatch, cuda: bool) -> list:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(forkserver._forkserver, "_preload_modules", ["__main__"])
    testing._context()
    return list(forkserver._forkserver._preload_modules)


def test_the_forkserver_preloads_megatron_only_without_a_gpu(monkeypatch):
    assert _preload_after_context(monkeypatch, cuda=False) == list(testing.PRELOAD)
    assert _preload_after_context(monkeypatch, cuda=True) == []
