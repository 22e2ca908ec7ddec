"""--auto-plan's system when --gpu is not given: the CUDA device's system file, matched on its model name as a whole
word, else the default, said on the auto-plan line."""
from __future__ import annotations

import types

import pytest

from h3t_training.config import auto_plan


@pytest.mark.parametrize("device, name", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-sxm"), ("NVIDIA H800", "h800"),
    ("NVIDIA H200", "h200"), ("NVIDIA B200", "b200"), ("NVIDIA A800-SXM4-80GB", "a800"),
    ("NVIDIA A100-SXM4-80GB", "a100-80g"), ("NVIDIA A100-SXM4-40GB", "a100-40g"), ("NVIDIA A100-PCIE-40GB", "a100-40g"),
    ("NVIDIA GB200", "gb200"), ("NVIDIA GB300", "gb300"), ("NVIDIA GB300 SXM6 AC", "gb300"),
    ("NVIDIA B300 SXM6 AC", None), ("NVIDIA GeForce RTX 4090", None),
])
def test_cuda_device_names_map_to_their_system_files(device, name):
    assert auto_plan.cuda_system_name(device) == name


def _fake_cuda(monkeypatch, device):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device is not None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: device)


@pytest.mark.parametrize("device, gpu, want", [
    ("NVIDIA B200", None, ("b200", "the CUDA device 'NVIDIA B200'")),
    ("NVIDIA GB200", None, ("gb200", "the CUDA device 'NVIDIA GB200'")),
    ("NVIDIA GB300", None, ("gb300", "the CUDA device 'NVIDIA GB300'")),
    ("NVIDIA B300 SXM6 AC", None,
     ("h800", "the default: no system file for the CUDA device 'NVIDIA B300 SXM6 AC'; give --gpu")),
    ("NVIDIA B300 SXM6 AC", "b200", ("b200", "")),
    (None, None, ("h800", "")),
])
def test_the_system_and_why(monkeypatch, device, gpu, want):
    _fake_cuda(monkeypatch, device)
    args = types.SimpleNamespace(gpu=gpu)
    assert auto_plan.system_choice(args) == want and auto_plan.system_name(args) == want[0]
