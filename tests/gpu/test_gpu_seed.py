"""Megatron's seeding on a GPU: the model-parallel CUDA RNG tracker exists before weights are drawn."""
from __future__ import annotations

import pytest
import torch

from h3t_ext.testing import run_distributed


def _seed_and_record(rank: int, world_size: int, on_gpu: bool):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mp_random

    from h3t_training.loop.initialize import set_random_seed

    ps.initialize_model_parallel(pipeline_model_parallel_size=2)
    calls = []
    real = mp_random.model_parallel_cuda_manual_seed
    mp_random.model_parallel_cuda_manual_seed = lambda seed, **kw: calls.append(seed)  # recorder (CPU only)
    try:
        set_random_seed(1234, on_gpu=on_gpu)
    finally:
        mp_random.model_parallel_cuda_manual_seed = real
    first = torch.rand(1).item()
    ps.destroy_model_parallel()
    return calls, first


def test_seed_per_pipeline_rank_and_cuda_tracker_on_gpu():
    cpu = run_distributed(_seed_and_record, 2, (False,), timeout_s=120)
    gpu = run_distributed(_seed_and_record, 2, (True,), timeout_s=120)
    assert [c for c, _ in cpu] == [[], []]  # no CUDA calls on CPU
    assert [c for c, _ in gpu] == [[1234], [1334]]  # seed + 100 * pipeline rank, as Megatron
    assert cpu[0][1] == gpu[0][1] != cpu[1][1]  # torch's generator: per pipeline rank


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpt_model_builds_on_gpu_after_set_random_seed():
    (n,) = run_distributed(_build_on_gpu, 1, (), timeout_s=300)
    assert n > 0


def _build_on_gpu(rank: int, world_size: int):
    from megatron.core import parallel_state as ps

    from h3t_ext.runtime.modules.gpt import build_gpt_model, tiny_llama_config
    from h3t_training.loop.initialize import set_random_seed

    ps.initialize_model_parallel()
    set_random_seed(1234, on_gpu=True)
    config = tiny_llama_config(use_cpu_initialization=False)
    model = build_gpt_model(config, vocab_size=128, max_sequence_length=32, device_type="cuda").cuda()
    n = sum(p.numel() for p in model.parameters())
    ps.destroy_model_parallel()
    return n
