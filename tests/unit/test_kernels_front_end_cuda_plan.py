"""The tensor front end's CUDA plan (csrc/bindings_torch.cpp, cuda_copy_plan) on a machine without a GPU: a batch
without a CUDA tensor, or anything the checked path must see, is not a CUDA batch (None), so batched_copy_ copies
it as before. tests/gpu/test_kernels_cuda.py checks the plan and the copy on a GPU."""
from __future__ import annotations

import pytest
import torch

from h3t_ext import kernels
from h3t_ext.kernels import _backend

front = _backend.tensor_module()
pytestmark = pytest.mark.skipif(front is None, reason="the tensor front end was not built")


@pytest.mark.parametrize("dsts, srcs", [
    ([torch.zeros(4)], [torch.ones(4)]),  # CPU only
    ([torch.zeros(4)], [torch.ones(4, dtype=torch.float64)]),  # dtypes differ
    ([torch.zeros(4)], [torch.ones(5)]),  # shapes differ
    ([torch.zeros(4, 4)[:, :2]], [torch.ones(4, 2)]),  # not contiguous
    ([torch.zeros(4, device="meta")], [torch.ones(4, device="meta")]),  # not CPU or CUDA
    ("not a list", [torch.ones(4)]),
    ([torch.zeros(4), torch.zeros(4)], [torch.ones(4)]),  # lengths differ
])
def test_not_a_cuda_batch(dsts, srcs):
    assert front.cuda_copy_plan(dsts, srcs) is None


def test_cpu_batches_still_copy_through_batched_copy_():
    dsts, srcs = [torch.zeros(300), torch.zeros(4, 4)[:, :2]], [torch.arange(300.0), torch.ones(4, 2)]
    kernels.batched_copy_(dsts, srcs)
    assert torch.equal(dsts[0], srcs[0]) and torch.equal(dsts[1], srcs[1])
