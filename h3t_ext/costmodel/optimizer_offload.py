"""Megatron's --optimizer-cpu-offload (megatron-core's ``HybridDeviceOptimizer``): what it moves off the GPU,
what it holds on the host, and what its step costs.

megatron-core 0.16.1 (``optimizer/cpu_offloading/hybrid_optimizer.py``, built by ``get_megatron_optimizer`` with
``param_update_in_fp32=True``) walks the optimizer's parameters (the rank's shard with the distributed optimizer)
in order and gives the CPU every parameter until their element count reaches ``--optimizer-offload-fraction``
of the total; priced here as exactly that fraction F of the shard. Per offloaded parameter:

* host: the fp32 master copy and Adam's m and v (``HOST_OPTIMIZER_BYTES_PER_PARAM``), and a pinned fp32 copy
  of its gradient (``HOST_GRAD_BYTES_PER_PARAM``); the device keeps neither (its optimizer states shrink by F);
* each step: the fp32 main gradient device -> host (``D2H_BYTES_PER_PARAM``), CPU Adam over the host copies
  (``CPU_ADAM_BYTES_PER_PARAM`` of host memory traffic, at the host's DRAM bandwidth shared by the
  ``gpus_per_host`` ranks that step at the same time), and the updated fp32 value host -> device into the
  model's parameter (``H2D_BYTES_PER_PARAM``; PyTorch copies across devices in the source dtype and casts on
  the device).

With --overlap-cpu-optimizer-d2h-h2d each parameter gets its own CPU optimizer, its gradient copy and its
update copy run on their own streams, so the three stages pipeline over the parameters: the step costs the
slowest of the three (plus one parameter's worth of the others, negligible); without it they run one after
the other. The GPU Adam of the rest (1 - F) runs first and is priced by ``data_parallel.optimizer_step_seconds``.
"""
from __future__ import annotations

from dataclasses import dataclass

from h3t_ext.costmodel.errors import InvalidPlanError
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec
from h3t_ext.dtypes import FP32

HOST_OPTIMIZER_BYTES_PER_PARAM = 3 * FP32
"""fp32 master weight, Adam m and v of an offloaded parameter, on the host (pinned, ``pin_cpu_params``)."""
HOST_GRAD_BYTES_PER_PARAM = FP32
"""The pinned fp32 gradient copy the CPU optimizer reads (``pin_cpu_grads``)."""
D2H_BYTES_PER_PARAM = FP32
"""The fp32 main gradient (Megatron's DDP grad buffer) copied to the host each step."""
H2D_BYTES_PER_PARAM = FP32
"""The updated fp32 master copied back into the device parameter each step."""
CPU_ADAM_BYTES_PER_PARAM = 4 * FP32 + 3 * FP32
"""torch's fused CPU Adam: reads gradient, master, m, v and writes master, m, v (fp32)."""


@dataclass(frozen=True)
class OptimizerOffloadTime:
    """Seconds of one step's offloaded part on the rank with most parameters."""

    d2h_seconds: float
    """Gradients device -> host over PCIe."""
    cpu_seconds: float
    """CPU Adam over the offloaded parameters."""
    h2d_seconds: float
    """Updated parameters host -> device over PCIe."""
    overlapped: bool
    """--overlap-cpu-optimizer-d2h-h2d: the three pipeline over the parameters."""

    @property
    def total(self) -> float:
        parts = (self.d2h_seconds, self.cpu_seconds, self.h2d_seconds)
        return max(parts) if self.overlapped else sum(parts)


def offload_fraction(plan: Plan) -> float:
    """F: the share of the rank's optimizer parameters stepped on the CPU (0 without --optimizer-cpu-offload)."""
    return float(plan.optimizer_offload_fraction) if plan.optimizer_cpu_offload else 0.0


def offloaded_params(shard_params: float, plan: Plan) -> float:
    """Parameters of a rank's optimizer shard (``shard_params``) stepped on the CPU."""
    return shard_params * offload_fraction(plan)


def device_params(shard_params: float, plan: Plan) -> float:
    """Parameters of a rank's optimizer shard stepped on the device (the rest of :func:`offloaded_params`)."""
    return shard_params * (1.0 - offload_fraction(plan))


def host_bytes(shard_params: float, plan: Plan) -> dict[str, int]:
    """Host bytes one rank holds for its offloaded optimizer share, by term."""
    n = offloaded_params(shard_params, plan)
    return {"optimizer_states": int(round(n * HOST_OPTIMIZER_BYTES_PER_PARAM)),
            "grads": int(round(n * HOST_GRAD_BYTES_PER_PARAM))}


def step_time(shard_params: float, plan: Plan, system: SystemSpec) -> OptimizerOffloadTime:
    """The offloaded part of one optimizer step of a rank whose optimizer shard has ``shard_params``."""
    n = offloaded_params(shard_params, plan)
    pcie = system.pcie_bandwidth * system.efficiency("pcie_fraction")
    if n and not system.host_memory_bandwidth:
        raise InvalidPlanError(f"optimizer_cpu_offload needs the system's host_memory_bandwidth (a number > 0, bytes/s "
                               f"of a host's DRAM), which system {system.name} does not give")
    host = (system.host_memory_bandwidth * system.efficiency("host_memory_fraction") / system.gpus_per_host
            if n else 1.0)
    return OptimizerOffloadTime(d2h_seconds=n * D2H_BYTES_PER_PARAM / pcie,
                                cpu_seconds=n * CPU_ADAM_BYTES_PER_PARAM / host,
                                h2d_seconds=n * H2D_BYTES_PER_PARAM / pcie,
                                overlapped=plan.overlap_cpu_optimizer_d2h_h2d)


def step_seconds(model: ModelSpec, plan: Plan, system: SystemSpec, shard_params: float) -> float:
    """The offloaded part's seconds (0 without --optimizer-cpu-offload)."""
    if not plan.optimizer_cpu_offload:
        return 0.0
    return step_time(shard_params, plan, system).total
