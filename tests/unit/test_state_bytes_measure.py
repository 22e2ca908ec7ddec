"""state_bytes counts each byte of a storage once, in the first category whose tensors span it."""
from __future__ import annotations

import torch

from h3t_training.telemetry.state_bytes import byte_range, measure


def test_slices_of_one_storage_count_in_their_own_categories():
    # Megatron FSDP's buffer_all_in_one: main weights and main gradients as slices of one float32 storage
    flat = torch.zeros(300)
    weights, grads = flat[:100], flat[100:300]
    got = measure([("optimizer", "device", weights), ("grads", "device", grads)])
    assert (got.device.grads, got.device.optimizer, got.device.params) == (800, 400, 0)


def test_views_of_a_reported_buffer_add_nothing_and_the_buffer_counts_whole():
    buffer = torch.zeros(64, dtype=torch.bfloat16)  # megatron-core DDP's parameter buffer, padded
    params = [buffer[:20].view(4, 5), buffer[20:50]]
    got = measure([*(("params", "device", p) for p in params), ("params", "device", buffer)])
    assert got.device.params == 128


def test_the_first_category_keeps_the_bytes_it_shares():
    w = torch.zeros(10)
    got = measure([("optimizer", "host", w), ("params", "host", w[2:6]), ("grads", "host", w[4:8])])
    assert (got.host.params, got.host.grads, got.host.optimizer) == (16, 8, 16)


def test_byte_range_spans_a_strided_view():
    m = torch.zeros(4, 6)
    assert byte_range(m[1:3, 2:4]) == (4 * 8, 4 * (8 + 6 + 2))
    assert byte_range(m.t()) == (0, 96)
    assert byte_range(m[:0]) == (0, 0)
