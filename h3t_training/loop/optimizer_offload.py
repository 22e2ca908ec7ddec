"""Megatron-LM's optimizer CPU offload (``--optimizer-cpu-offload``, ``--optimizer-offload-fraction``,
``--overlap-cpu-optimizer-d2h-h2d``, ``--use-torch-optimizer-for-cpu-offload``, ``--no-pin-cpu-grads``,
``--no-pin-cpu-params``): the flags' checks and, for the CPU path, the host partition.

On a GPU the flags go to megatron-core's ``OptimizerConfig`` and ``get_megatron_optimizer`` builds its
``HybridDeviceOptimizer`` (``megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py``): the first
parameters of its parameter groups, up to the fraction of their elements, get an fp32 copy in (pinned)
host memory, a host gradient buffer and Adam states there, and a ``torch.optim.AdamW`` steps them on the
CPU; the copies go back to the GPU after the step.

On CPU (:class:`~h3t_training.loop.optimizer.DataParallelAdamW`) the same split (:func:`offloaded_prefix`) puts
the chosen parameters' fp32 master copies, gradient copies and Adam states in a :class:`HostPartition` of
their own, stepped with the same ``torch.optim.AdamW`` as the rest, so the numbers are those of the run
without offload, bit for bit. With ``--overlap-cpu-optimizer-d2h-h2d`` the host partition has one AdamW per
parameter and copies each gradient in, steps and copies the parameter back one parameter at a time, as
megatron-core's ``build_cpu_optimizer_list`` (without it: all gradients in, one step, all parameters back).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from h3t_ext.planner.translate import MEGATRON_DEFAULTS

DEFAULT_OFFLOAD_FRACTION = MEGATRON_DEFAULTS["optimizer_offload_fraction"]
"""Megatron-LM's default of ``--optimizer-offload-fraction`` (its arguments.py: ``default=1.0``), from the one
table of Megatron's defaults the planner's translation reads too."""


def offloaded_prefix(numels: Sequence[int], fraction: float) -> list[bool]:
    """Which parameters (in the optimizer's parameter-group order, element counts ``numels``) go to the host.

    megatron-core's rule (``HybridDeviceOptimizer._get_sub_optimizer_param_groups``, megatron-core 0.16.1):
    walk the parameters in order and offload each while the elements offloaded so far are below
    ``fraction x total``; so the offloaded set is the shortest prefix holding at least that share (the last
    parameter taken may overshoot it), nothing at 0, everything at 1."""
    threshold = sum(numels) * fraction
    taken, out = 0, []
    for n in numels:
        take = taken < threshold
        taken += n if take else 0
        out.append(take)
    return out


@dataclass(frozen=True)
class OptimizerOffload:
    """The offload the flags ask for: ``fraction`` of the optimizer's elements on the host (0 without
    ``--optimizer-cpu-offload``), and the megatron-core options that come with it."""

    fraction: float = 0.0
    overlap_d2h_h2d: bool = False
    use_torch_optimizer: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True

    @classmethod
    def from_args(cls, args) -> "OptimizerOffload":
        if not args.optimizer_cpu_offload:
            return cls()
        fraction = DEFAULT_OFFLOAD_FRACTION if args.optimizer_offload_fraction is None \
            else args.optimizer_offload_fraction
        return cls(fraction=fraction, overlap_d2h_h2d=args.overlap_cpu_optimizer_d2h_h2d,
                   use_torch_optimizer=args.use_torch_optimizer_for_cpu_offload,
                   pin_cpu_grads=args.pin_cpu_grads, pin_cpu_params=args.pin_cpu_params)

    @property
    def enabled(self) -> bool:
        return self.fraction > 0


def cpu_notes(args) -> list[str]:
    """What the CPU path does with these flags, where it differs from a GPU (printed once by rank 0)."""
    offload = OptimizerOffload.from_args(args)
    lines = []
    if args.use_precision_aware_optimizer:
        lines.append("note: --use-precision-aware-optimizer: on CPU the master weights and Adam states are "
                     "float32 (its default dtypes), as without it")
    if not offload.enabled:
        return lines
    lines.append(f"note: --optimizer-cpu-offload: the fp32 master weights, gradient copies and Adam states of "
                 f"{offload.fraction:g} of the optimizer's elements (megatron-core's split) live in a host partition")
    if offload.use_torch_optimizer:
        lines.append("note: --use-torch-optimizer-for-cpu-offload: on CPU both partitions step with "
                     "torch.optim.AdamW already")
    if not (offload.pin_cpu_grads and offload.pin_cpu_params):
        lines.append("note: --no-pin-cpu-grads/--no-pin-cpu-params: nothing is pinned without a GPU")
    return lines


class HostPartition:
    """The offloaded parameters' fp32 master copies, gradient buffers and AdamW states (the "host" side).

    ``groups`` are the optimizer's parameter groups restricted to the offloaded model parameters (their
    hyper-parameters kept); ``make_adamw`` builds an AdamW over groups exactly as the device side's."""

    def __init__(self, groups: list[dict], make_adamw: Callable[[list[dict]], torch.optim.Optimizer], *,
                 overlap: bool):
        self.model_params: list[torch.nn.Parameter] = [p for g in groups for p in g["params"]]
        self.master = {p: p.detach().clone() for p in self.model_params}
        """model parameter -> its fp32 master copy (the parameter the host AdamW updates)."""
        self.grads = {p: torch.empty_like(p) for p in self.model_params}
        """model parameter -> the host buffer its gradient is copied into (megatron-core's ``cpu_copy_map_grad``)."""
        host_groups = [{**g, "params": [self.master[p] for p in g["params"]]} for g in groups]
        if overlap:  # megatron-core's build_cpu_optimizer_list: one optimizer per parameter
            self.optimizers = [make_adamw([{**g, "params": [m]}]) for g in host_groups for m in g["params"]]
        else:
            self.optimizers = [make_adamw(host_groups)]
        self.overlap = overlap

    @property
    def param_groups(self) -> Iterator[dict]:
        for opt in self.optimizers:
            yield from opt.param_groups

    def _optimizer_of(self, p) -> torch.optim.Optimizer:
        if not self.overlap:
            return self.optimizers[0]
        return self.optimizers[next(i for i, q in enumerate(self.model_params) if q is p)]

    def state(self, p) -> dict:
        """AdamW's state of model parameter ``p`` (empty before the first step)."""
        return self._optimizer_of(p).state.get(self.master[p], {})

    def set_state(self, p, state: dict) -> None:
        self._optimizer_of(p).state[self.master[p]] = state

    def _d2h(self, p) -> None:
        self.grads[p].copy_(p.grad)
        self.master[p].grad = self.grads[p]

    def _h2d(self, p) -> None:
        p.data.copy_(self.master[p].data)

    def step(self) -> None:
        """Copy the (reduced, clipped) gradients in, step AdamW on the master copies, copy them back."""
        if self.overlap:
            for p, opt in zip(self.model_params, self.optimizers):
                self._d2h(p)
                opt.step()
                self._h2d(p)
            return
        for p in self.model_params:
            self._d2h(p)
        self.optimizers[0].step()
        for p in self.model_params:
            self._h2d(p)

    def reload_model_params(self) -> None:
        """The master copies from the model's parameters (after a checkpoint loaded them), as megatron-core's
        ``HybridDeviceOptimizer.update_fp32_param_by_new_param``."""
        for p in self.model_params:
            self.master[p].data.copy_(p.data)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(category, tensor) of everything this partition holds: master copies and AdamW states are
        ``optimizer``, gradient buffers ``grads``."""
        for p in self.model_params:
            yield "grads", self.grads[p]
            yield "optimizer", self.master[p]
            yield from (("optimizer", v) for v in self.state(p).values() if isinstance(v, torch.Tensor))


def split_groups(groups: list[dict], fraction: float) -> tuple[list[dict], list[dict]]:
    """``groups`` split into (device groups, host groups) by :func:`offloaded_prefix` over their parameters in
    order; a group keeps its hyper-parameters on both sides, empty groups are dropped."""
    flat = [p for g in groups for p in g["params"]]
    host = {id(p) for p, off in zip(flat, offloaded_prefix([p.numel() for p in flat], fraction)) if off}
    device_groups = [{**g, "params": [p for p in g["params"] if id(p) not in host]} for g in groups]
    host_groups = [{**g, "params": [p for p in g["params"] if id(p) in host]} for g in groups]
    return [g for g in device_groups if g["params"]], [g for g in host_groups if g["params"]]


def optimizer_config_fields(args) -> dict:
    """megatron-core ``OptimizerConfig`` fields of the offload flags (GPU path)."""
    offload = OptimizerOffload.from_args(args)
    return dict(use_precision_aware_optimizer=args.use_precision_aware_optimizer,
                optimizer_cpu_offload=args.optimizer_cpu_offload,
                optimizer_offload_fraction=offload.fraction if offload.enabled else 0.0,
                overlap_cpu_optimizer_d2h_h2d=offload.overlap_d2h_h2d,
                use_torch_optimizer_for_cpu_offload=offload.use_torch_optimizer,
                pin_cpu_grads=args.pin_cpu_grads, pin_cpu_params=args.pin_cpu_params)


__all__ = ["DEFAULT_OFFLOAD_FRACTION", "HostPartition", "OptimizerOffload", "cpu_notes", "offloaded_prefix",
           "optimizer_config_fields", "split_groups"]
