"""Megatron-LM's Python garbage-collection and CUDA cache flags, done where Megatron-LM's loop does them.

* ``--manual-gc``: the automatic collector is switched off when training starts (after one full collection), so
  no rank pauses at a moment of its own; ``--manual-gc-interval N`` (default 0: never) collects every N
  iterations; unless ``--no-manual-gc-eval`` / ``--disable-manual-gc-eval``, a full collection runs before each
  evaluation and a generation-0 one after it. The collector is switched back on when training ends.
* Megatron-Kwai's ``--kaimm-gc-interval N`` (N > 0; its ``megatron/training.py``): the same collector switch, a
  generation-0 collection every N iterations and none around evaluations (Kwai's fork also collects after each
  checkpoint save; here the save's own objects are freed by the next interval's collection).
* ``--empty-unused-memory-level L`` (0, 1 or 2): on a GPU, ``torch.cuda.empty_cache()`` after each
  forward-backward and each evaluation step at L >= 1, and after each optimizer step at L = 2. The caching
  allocator's free blocks are given back (less memory reserved, slower allocation); on CPU there is no cache.

Megatron-LM: ``megatron/training/training.py`` (``train``, ``train_step``, ``evaluate``) and the fields of
``megatron/training/config/training_config.py``. The values are checked when the flags are resolved
(:func:`check_memory_hygiene`); the training loop (``loop/training.py``, ``loop/evaluation.py``) calls the hooks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
from dataclasses import dataclass
from typing import Iterator

import torch

from h3t_training.config.flag_table import table_int, table_value
from h3t_training.errors import ArgumentError

EMPTY_CACHE_LEVELS = (0, 1, 2)


@dataclass(frozen=True)
class MemoryHygiene:
    """What the four flags ask for; ``on_gpu``: whether there is a CUDA cache to empty."""

    manual_gc: bool = False
    manual_gc_interval: int = 0
    manual_gc_eval: bool = True
    manual_gc_generation: int = 2
    """The generation collected every interval: 2 (all: Megatron-LM), 0 (the youngest: Megatron-Kwai)."""
    empty_unused_memory_level: int = 0
    on_gpu: bool = False

    @classmethod
    def from_args(cls, args, *, on_gpu: bool) -> "MemoryHygiene":
        """The flags' values (checked: ArgumentError names a bad one and its valid range)."""
        hygiene = cls(manual_gc=bool(table_value(args, "--manual-gc", False)),
                      manual_gc_interval=table_int(args, "--manual-gc-interval", 0),
                      manual_gc_eval=not (table_value(args, "--no-manual-gc-eval", False)
                                          or table_value(args, "--disable-manual-gc-eval", False)),
                      empty_unused_memory_level=table_int(args, "--empty-unused-memory-level", 0), on_gpu=on_gpu)
        kwai = table_int(args, "--kaimm-gc-interval", 0)
        if kwai and hygiene.manual_gc:
            raise ArgumentError(f"--kaimm-gc-interval {kwai} (Megatron-Kwai's) and --manual-gc (Megatron-LM's) both "
                                "ask for the garbage collector: give one of them")
        if kwai:
            hygiene = dataclasses.replace(hygiene, manual_gc=True, manual_gc_interval=kwai, manual_gc_eval=False,
                                          manual_gc_generation=0)
        if hygiene.empty_unused_memory_level not in EMPTY_CACHE_LEVELS:
            raise ArgumentError(f"--empty-unused-memory-level {hygiene.empty_unused_memory_level} is not one of "
                                f"{', '.join(map(str, EMPTY_CACHE_LEVELS))}")
        return hygiene

    def _empty_cache(self, level: int) -> None:
        if self.on_gpu and self.empty_unused_memory_level >= level:
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """The training loop: with --manual-gc, one full collection and the automatic collector off inside."""
        if not self.manual_gc:
            yield
            return
        was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()
        try:
            yield
        finally:
            if was_enabled:
                gc.enable()

    def after_forward_backward(self) -> None:
        self._empty_cache(1)

    def after_optimizer_step(self) -> None:
        self._empty_cache(2)

    def after_eval_step(self) -> None:
        self._empty_cache(1)

    def after_iteration(self, iteration: int) -> None:
        """``iteration``: the 1-based number of the iteration just done."""
        if self.manual_gc and self.manual_gc_interval and iteration % self.manual_gc_interval == 0:
            gc.collect(generation=self.manual_gc_generation)

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """An evaluation during training: a full collection before it, generation 0 after it (--manual-gc)."""
        collect = self.manual_gc and self.manual_gc_eval
        if collect:
            gc.collect()
        yield
        if collect:
            gc.collect(generation=0)


def check_memory_hygiene(config):
    """Resolve step: a bad value of the flags is one line before any process group."""
    MemoryHygiene.from_args(config, on_gpu=False)
    return config


__all__ = ["EMPTY_CACHE_LEVELS", "MemoryHygiene", "check_memory_hygiene"]
