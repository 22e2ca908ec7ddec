"""Analytic cost model: per-stage memory, iteration time, throughput and MFU of a parallel plan.

Pure Python (no torch). Inputs are three orthogonal things: a ``ModelSpec``, a ``Plan`` and a
``SystemSpec`` (hardware numbers and fitted efficiencies from the data files).
"""
from h3t_ext.costmodel.activations import (
    activation_bytes_per_layer_token,
    layer_bytes_per_local_token,
    output_layer_bytes,
    residency_lines,
    stage_activation_peak_bytes,
)
from h3t_ext.costmodel.errors import InfeasiblePlanError, InvalidPlanError, PlanError, UnknownNameError
from h3t_ext.costmodel.estimate import Estimate, estimate, over_budget_error
from h3t_ext.costmodel.memory import StageMemory, chunk_activation_bytes, stage_memory, stage_params
from h3t_ext.costmodel.mfu import mfu, model_flops_per_token
from h3t_ext.costmodel.offload import balanced_pcie_savings, pcie_bytes_per_iteration, solve_offload_alpha
from h3t_ext.costmodel.plan import CKPT_CHOICES, Plan
from h3t_ext.costmodel.plan_checks import plan_layout, validate_plan
from h3t_ext.costmodel.fit import FitResult, MeasuredRun, fit_system
from h3t_ext.costmodel.specs import (
    ModelSpec,
    SystemSpec,
    get_model,
    get_system,
    list_models,
    list_systems,
    load_system_file,
)

__all__ = [
    "CKPT_CHOICES", "Estimate", "FitResult", "MeasuredRun", "fit_system", "load_system_file", "InfeasiblePlanError", "InvalidPlanError", "ModelSpec", "Plan", "PlanError",
    "StageMemory", "SystemSpec", "UnknownNameError", "activation_bytes_per_layer_token", "balanced_pcie_savings",
    "chunk_activation_bytes", "estimate", "get_model", "get_system", "layer_bytes_per_local_token", "list_models",
    "list_systems", "mfu", "model_flops_per_token", "output_layer_bytes", "over_budget_error", "pcie_bytes_per_iteration",
    "residency_lines", "solve_offload_alpha", "stage_activation_peak_bytes", "stage_memory", "stage_params",
    "plan_layout", "validate_plan",
]
