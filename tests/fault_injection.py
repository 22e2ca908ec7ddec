"""pretrain_llama.py with one fault injected in-process (a test hook; under torchrun every rank runs it):

    python tests/fault_injection.py FAULT -- DRIVER FLAGS

FAULT is ``cpu-oom-stage-N`` (torch's CPU allocator fails in the forward of pipeline stage N, with the
RuntimeError text torch raises when malloc fails) or ``full-disk`` (every write of PyTorch DCP's file
writer raises ``OSError(ENOSPC)``, as on a full disk) or ``weight-flip-rank-R-iter-N`` (after the optimizer step of
iteration N, one bit of rank R's first weight flips: the lowest bit of its first element, as a memory fault would).
"""
from __future__ import annotations

import errno
import os
import sys
from contextlib import contextmanager

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
CPU_OOM_TEXT = ("[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate memory: you tried to "
                "allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)")
"""torch's words when malloc fails (c10/core/impl/alloc_cpu.cpp)."""


def _cpu_oom_at(stage: int) -> None:
    from megatron.core import parallel_state as ps

    import h3t_training.loop.training as training
    real = training.forward_step

    def forward_step(data_iterator, model):
        if ps.get_pipeline_model_parallel_rank() == stage:
            raise RuntimeError(CPU_OOM_TEXT)
        return real(data_iterator, model)

    training.forward_step = forward_step


class _FullDiskStream:
    def __init__(self, stream):
        self._stream = stream

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _full_disk() -> None:
    from torch.distributed.checkpoint.filesystem import FileSystem
    real = FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as stream:
            yield _FullDiskStream(stream) if "w" in mode else stream

    FileSystem.create_stream = create_stream


def _weight_flip(rank: int, iteration: int) -> None:
    import torch
    import torch.distributed as dist

    from h3t_training.loop.optimizer import DataParallelAdamW
    real = DataParallelAdamW.step

    def step(self, it, *schedule_and_tokens):
        out = real(self, it, *schedule_and_tokens)
        if dist.get_rank() == rank and it + 1 == iteration:
            with torch.no_grad():
                byte = self.params[0].data.view(-1)[:1].view(torch.uint8)
                byte[0] = byte[0] ^ 1
        return out

    DataParallelAdamW.step = step


def main() -> int:
    fault, sep, *argv = sys.argv[1:]
    assert sep == "--", __doc__
    if fault.startswith("cpu-oom-stage-"):
        _cpu_oom_at(int(fault.rsplit("-", 1)[1]))
    elif fault.startswith("weight-flip-rank-"):
        rank, iteration = fault[len("weight-flip-rank-"):].split("-iter-")
        _weight_flip(int(rank), int(iteration))
    elif fault == "full-disk":
        _full_disk()
    else:
        raise SystemExit(f"unknown fault {fault!r}")
    from pretrain_llama import main as driver_main
    return driver_main(argv)


if __name__ == "__main__":
    sys.exit(main())
