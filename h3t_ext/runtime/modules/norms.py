"""Norm modules for megatron-core layer specs that also work under sequence parallelism.

megatron-core's ``WrappedTorchNorm`` (the local spec's norm without Apex/TransformerEngine)
refuses ``config.sequence_parallel``. A norm is per token, so with the sequence split over the
tensor-parallel ranks it computes the same thing on each rank's tokens; only its weight (and bias)
gradient is partial. These modules are ``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm`` (same
parameters, same state-dict keys, same ops), built by megatron-core from the spec with
``(config, hidden_size, eps)``, whose parameters carry Megatron's ``sequence_parallel`` attribute,
so the gradient all-reduce over the tensor-parallel group (``finalize_model_grads`` on GPU,
:func:`~h3t_ext.runtime.modules.sequence_parallel.allreduce_sequence_parallel_grads` on CPU) includes them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import RuntimeConfigError
from .sequence_parallel import mark_sequence_parallel


def _check(config, what: str) -> None:
    if config.persist_layer_norm:  # Megatron-LM's loop turns it on unless --no-persist-layer-norm is given
        raise RuntimeConfigError(f"persist_layer_norm (Apex's persistent kernel) is not supported by h3t-ext's torch "
                                 f"{what}, nor by megatron-core's: pass --no-persist-layer-norm")
    if config.memory_efficient_layer_norm:
        raise RuntimeConfigError(f"--memory-efficient-layer-norm is not supported by h3t-ext's torch {what}; "
                                 f"leave it off")


def _zero_centered(module, config) -> None:
    """Megatron's ``--apply-layernorm-1p``: the weight is stored as gamma - 1 (zero at init)."""
    module.zero_centered_gamma = bool(config.layernorm_zero_centered_gamma)
    if module.zero_centered_gamma:
        with torch.no_grad():
            module.weight.zero_()


class _SpecNorm:
    """What both norms add to torch's: construction from a megatron-core spec (``config`` checked for
    this normalization), the sequence-parallel mark on the weights, and ``--apply-layernorm-1p``."""

    def _from_spec(self, config, kind: str) -> None:
        _check(config, kind)
        mark_sequence_parallel(self, config.sequence_parallel)
        _zero_centered(self, config)

    def gamma(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered_gamma else self.weight


class RMSNorm(_SpecNorm, torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built from a megatron-core spec; sequence-parallel aware; gamma = 1 + weight
    with ``--apply-layernorm-1p``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self._from_spec(config, "RMSNorm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, tuple(self.normalized_shape), self.gamma(), self.eps)


class LayerNorm(_SpecNorm, torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` built from a megatron-core spec; sequence-parallel aware; gamma = 1 + weight
    with ``--apply-layernorm-1p``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self._from_spec(config, "LayerNorm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, tuple(self.normalized_shape), self.gamma(), self.bias, self.eps)


__all__ = ["LayerNorm", "RMSNorm"]
