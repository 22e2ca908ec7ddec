"""The state bytes the driver's tiny Llama (driver_harness.TINY_MODEL, vocabulary padded to 512) holds per rank by
megatron-core's rules, computed from its parameter shapes: what ``--metrics-json``'s measured ``state_bytes`` must
equal (tests/integration/test_optimizer_offload_driver.py) and what the cost model's terms are checked against
(tests/unit/test_costmodel_optimizer_offload.py)."""
from __future__ import annotations

import torch

from h3t_training.loop.optimizer_shards import owned_slices
from h3t_training.loop.optimizer_offload import offloaded_prefix

H, FFN, QKV, VOCAB, LAYERS = 64, 128, 128, 512, 4  # QKV rows: (4 heads + 2 x 2 query groups) x head dim 16


def _llama_shapes() -> list[tuple[int, ...]]:
    """The tiny Llama's parameters in megatron-core's registration order (untied, SwiGLU, RMSNorm, no biases):
    embedding; per layer input norm, linear_proj (registered before linear_qkv), linear_qkv, pre-MLP norm, fc1
    (gate and up), fc2; final norm; output layer."""
    layer = [(H,), (H, H), (QKV, H), (H,), (2 * FFN, H), (H, FFN)]
    return [(VOCAB, H), *layer * LAYERS, (H,), (VOCAB, H)]


def expected_state_bytes(dp: int, fraction: float) -> list[dict]:
    """Each data-parallel rank (optimizer offload fraction ``fraction``)'s state bytes by the rules: the distributed
    optimizer's share of megatron-core's gradient buffer (``optimizer_shards``: one chunk, one bucket, the driver's
    runs here do not overlap the gradient reduce), AdamW's groups (weights with decay first, then norms, each in the
    model's order), megatron-core's prefix split of each rank's share; device: the parameters and their float32
    gradients, Adam's moments and step count of the device share; host: the offloaded share's gradient copy,
    master copy, moments and step count."""
    shapes = _llama_shapes()
    numels = [torch.Size(s).numel() for s in shapes]
    slices = owned_slices([numels], dp, [None]) if dp > 1 else []
    model = 4 * sum(numels)
    out = []
    for r in range(dp):
        mine = {s.param: s.numel for s in slices if s.rank == r} if dp > 1 else dict(enumerate(numels))
        ordered = [mine[i] for i in sorted(mine) if len(shapes[i]) > 1] + \
            [mine[i] for i in sorted(mine) if len(shapes[i]) <= 1]
        host = [n for n, off in zip(ordered, offloaded_prefix(ordered, fraction)) if off]
        device = ordered[len(host):]
        out.append({"device": {"params": model, "grads": model, "optimizer": 8 * sum(device) + 4 * len(device)},
                    "host": {"params": 0, "grads": 4 * sum(host), "optimizer": 12 * sum(host) + 4 * len(host)}})
    return out
