"""One plan with a resolved offload ratio: ``--offload-alpha FLOAT``, ``auto`` or ``balanced``.

``auto`` is the smallest single alpha (three decimals) that brings every stage under the budget;
``balanced`` gives each pipeline stage its own smallest alpha, which moves fewer bytes over PCIe
(stages with less activation memory offload less). Both come from the cost model's
``solve_offload_alpha``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Union

from h3t_ext.costmodel import (
    Estimate,
    InvalidPlanError,
    ModelSpec,
    Plan,
    SystemSpec,
    estimate,
    pcie_bytes_per_iteration,
    solve_offload_alpha,
)
from h3t_ext.costmodel.estimate import device_fits
from h3t_ext.costmodel.kernels import kernel_rates, priced_attention_kernel

AlphaMode = Union[float, tuple[float, ...], str]
"""A number in [0, 1], one number per pipeline stage, ``"auto"`` or ``"balanced"``."""

ALPHA_MODES = ("auto", "balanced")
FIRST_2025_STACK_COMPUTE_CAPABILITY = 10.0
"""GPUs from this compute capability on (Blackwell) ran only 2025-and-later software stacks: the 2024 stacks' fused
attention at FlashAttention-2's rate (NeMo 24.03's long-sequence runs on H100) says nothing of them."""


@dataclass(frozen=True)
class Evaluation:
    """The estimate of one plan, with alpha resolved, and for ``balanced`` the ``auto`` comparison."""

    plan: Plan
    """The plan with ``offload_alpha`` resolved to numbers."""
    estimate: Estimate
    """Cost-model estimate of ``plan``."""
    alpha_mode: AlphaMode
    """What the user asked for: a number, ``auto`` or ``balanced``."""
    auto_estimate: Optional[Estimate] = None
    """With ``balanced``: the estimate of the same plan with the single ``auto`` alpha."""
    pcie_bytes_saved_vs_auto: Optional[int] = None
    """With ``balanced``: host<->device bytes per iteration, summed over the pipeline stages of one
    model replica, that the per-stage alphas save compared with the single ``auto`` alpha."""


def _validate_mode(alpha_mode: AlphaMode) -> None:
    if isinstance(alpha_mode, str):
        if alpha_mode not in ALPHA_MODES:
            raise ValueError(f"offload alpha mode must be a number in [0, 1], auto or balanced, got {alpha_mode!r}")
        return
    for a in alpha_mode if isinstance(alpha_mode, tuple) else (alpha_mode,):
        if not 0.0 <= float(a) <= 1.0:
            raise ValueError(f"offload alpha {a} outside [0, 1]")


def with_fixed_alpha(plan: Plan, alpha_mode: Union[float, tuple[float, ...]]) -> Plan:
    """``plan`` with a fixed offload ratio: one number, or one per pipeline stage."""
    return plan.with_alpha(alpha_mode if isinstance(alpha_mode, tuple) else float(alpha_mode))


def evaluate(model: ModelSpec, plan: Plan, system: SystemSpec, *, alpha_mode: AlphaMode = "auto",
             memory_budget_bytes: Optional[int] = None, timeline: bool = True,
             host_memory_budget_bytes: Optional[int] = None) -> Evaluation:
    """Resolve alpha and estimate; raises the cost model's PlanError subclasses.

    With ``auto``/``balanced`` an InfeasiblePlanError means that even alpha = 1 does not fit.
    A fixed alpha that does not fit is returned with ``estimate.fits`` False. ``timeline=False``: the
    closed-form time only (the search's pruning; it runs the timeline for the plans it keeps).
    """
    _validate_mode(alpha_mode)
    if not isinstance(alpha_mode, str):
        resolved = with_fixed_alpha(plan, alpha_mode)
        return Evaluation(resolved, estimate(model, resolved, system, memory_budget_bytes=memory_budget_bytes, timeline=timeline,
                   host_memory_budget_bytes=host_memory_budget_bytes),
                          alpha_mode)
    zero_plan = plan.with_alpha(0.0)
    # the estimate at alpha 0 only where the device fits there (else it is not the answer; most of a tight search)
    if device_fits(model, zero_plan, system, memory_budget_bytes=memory_budget_bytes):
        zero_est = estimate(model, zero_plan, system, memory_budget_bytes=memory_budget_bytes, timeline=timeline,
                            host_memory_budget_bytes=host_memory_budget_bytes)
        if zero_est.fits:  # nothing to offload: auto and balanced are both 0
            return Evaluation(zero_plan, zero_est, alpha_mode,
                              auto_estimate=None if alpha_mode == "auto" else zero_est,
                              pcie_bytes_saved_vs_auto=None if alpha_mode == "auto" else 0)
    auto_alpha = solve_offload_alpha(model, plan, system, memory_budget_bytes=memory_budget_bytes, mode="auto")
    auto_plan = plan.with_alpha(auto_alpha)
    auto_est = estimate(model, auto_plan, system, memory_budget_bytes=memory_budget_bytes, timeline=timeline,
                   host_memory_budget_bytes=host_memory_budget_bytes)
    if alpha_mode == "auto":
        return Evaluation(auto_plan, auto_est, alpha_mode)
    bal_alpha = solve_offload_alpha(model, plan, system, memory_budget_bytes=memory_budget_bytes, mode="balanced")
    bal_plan = plan.with_alpha(bal_alpha)
    bal_est = estimate(model, bal_plan, system, memory_budget_bytes=memory_budget_bytes, timeline=timeline,
                   host_memory_budget_bytes=host_memory_budget_bytes)
    saved = (sum(pcie_bytes_per_iteration(model, plan, auto_plan.alphas()))
             - sum(pcie_bytes_per_iteration(model, plan, bal_plan.alphas())))
    return Evaluation(bal_plan, bal_est, alpha_mode, auto_estimate=auto_est, pcie_bytes_saved_vs_auto=int(saved))


def flash_rate_tokens_per_second(model: ModelSpec, ev: Evaluation, system: SystemSpec) -> Optional[float]:
    """Tokens/s of ``ev``'s plan with its cuDNN fused attention priced at FlashAttention-2's rate instead of the
    rate measured with a 2026 cuDNN (``fused_attention_gemm_ratio``): how fast the fused kernel ran on a 2024 stack
    (NeMo 24.03's published long-sequence runs are priced within -1% to +10% so, and +2% to +46% at the measured
    rate: :mod:`h3t_ext.costmodel.published_long_sequence`). None where the plan's attention is not that measured
    kernel, where FlashAttention cannot run it, or on a GPU no 2024 stack ran
    (:data:`FIRST_2025_STACK_COMPUTE_CAPABILITY`)."""
    if system.compute_capability >= FIRST_2025_STACK_COMPUTE_CAPABILITY:
        return None
    if priced_attention_kernel(ev.plan.attention_kernel(system), kernel_rates(system)) != "fused":
        return None
    try:
        return estimate(model, replace(ev.plan, attention_backend="flash"), system,
                        memory_budget_bytes=ev.estimate.memory_budget_bytes).tokens_per_second
    except InvalidPlanError:
        return None
