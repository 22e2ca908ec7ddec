"""``h3t-plan calibrate``: measured runs in, a system file with fitted efficiencies out.

Runs come from the training driver's ``--metrics-json`` files (their ``config`` and the median
``tokens_per_second_per_gpu`` of the iterations after the first, which includes warm-up) or from a CSV
with one run per row and Megatron's field names as columns (``tokens_per_second_per_gpu`` required,
plus ``num_gpus`` or ``world_size``, ``seq_length``, ``global_batch_size`` and optionally
``micro_batch_size``, ``tensor_model_parallel_size``, ``context_parallel_size``,
``pipeline_model_parallel_size``, ``num_layers_per_virtual_pipeline_stage``, the uneven split's
``decoder_first/last_pipeline_num_layers``, ``pipeline_model_parallel_layout``, ``ckpt``, ``offload_alpha``,
and the 0/1 switches of :data:`SWITCHES` (the ``--account-for-*`` ones among them); a switch a run does not name is Megatron-LM's default, off for
sequence parallelism and the distributed optimizer). The model is the command line's (``--model`` or the shape flags).

The fit is applied pooled (``costmodel.pooling``): each fitted efficiency moves from the system file's value by
the weight the published sources give ``n`` runs (about half for one run), or by ``--calibration-weight``.
"""
from __future__ import annotations

import csv
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from h3t_ext.costmodel import ModelSpec, Plan, SystemSpec
from h3t_ext.costmodel.fit import FitResult, MeasuredRun, fit_system, mean_abs, relative_errors, with_efficiencies
from h3t_ext.costmodel.plan_checks import validate_plan
from h3t_ext.costmodel.pooling import calibration_prior, pooled
from h3t_ext.costmodel.schema import SchemaError, check_positive_rate
from h3t_ext.costmodel.efficiency_sets import efficiency_set_names, plausible_ranges, transferred_source
from h3t_ext.offload_alpha import OffloadAlpha
from h3t_ext.planner.translate import plan_from_args

INT_FIELDS = ("micro_batch_size", "tensor_model_parallel_size", "context_parallel_size",
              "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
              "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
              "microbatch_group_size_per_vp_stage", "expert_model_parallel_size", "expert_tensor_parallel_size",
              "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
SWITCHES = ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "overlap_p2p_comm",
            "sequence_parallel", "use_distributed_optimizer", "fp8_param_gather", "first_last_layers_bf16",
            "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split", "moe_grouped_gemm",
            "moe_shared_expert_overlap", "overlap_moe_expert_parallel_comm")
TEXT_FIELDS = ("fp8", "fp8_recipe", "pipeline_model_parallel_layout", "moe_token_dispatcher_type",
               "transformer_engine_version")
"""Megatron's --fp8-format (field ``fp8``; empty: BF16), --fp8-recipe, --pipeline-model-parallel-layout and
--moe-token-dispatcher-type, as the run names them, and the TransformerEngine it ran (empty: the newest rules)."""
_SPLIT_GIVEN = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
"""Split flags with which a run's model chunks per rank are Megatron's --num-virtual-stages-per-pipeline-rank."""


class RunFileError(ValueError):
    """A run file that cannot be read; the message names the file and the problem."""


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _switch(path: str, name: str, value) -> bool:
    """A 0/1 switch of a run: a JSON boolean or number 0/1, or text 1/true/yes/on or 0/false/no/off."""
    text = str(value).strip().lower()
    if text not in _TRUE + _FALSE:
        raise RunFileError(f"{path}: field {name} must be 0 or 1 (or true/false, yes/no, on/off), got {value!r}")
    return text in _TRUE


def _int(name: str, value) -> int:
    """An integer field of a run, given as a JSON integer (or an integral number) or as text."""
    if isinstance(value, bool) or (isinstance(value, float) and value != int(value)):
        raise ValueError(f"field {name} must be an integer, got {value!r}")
    try:
        return int(value)
    except (ValueError, TypeError, OverflowError):
        raise ValueError(f"field {name} must be an integer, got {value!r}") from None


def _fields(path: str, cfg: dict) -> dict:
    """The run's Megatron fields as numbers and switches (what the translation reads)."""
    try:
        out = {"num_gpus": _int("num_gpus", cfg.get("num_gpus") or cfg["world_size"]),
               "seq_length": _int("seq_length", cfg["seq_length"]),
               "global_batch_size": _int("global_batch_size", cfg["global_batch_size"])}
    except (KeyError, ValueError) as e:
        raise RunFileError(f"{path}: needs num_gpus (or world_size), seq_length and global_batch_size ({e})") from None
    try:
        for k in INT_FIELDS:
            if cfg.get(k) not in (None, ""):
                out[k] = _int(k, cfg[k])
        vpp = cfg.get("virtual_pipeline_model_parallel_size")
        if vpp not in (None, "", 1, "1") and "num_layers_per_virtual_pipeline_stage" not in out:
            out["_virtual"] = _int("virtual_pipeline_model_parallel_size", vpp)
            if out["_virtual"] < 1:
                raise ValueError(f"field virtual_pipeline_model_parallel_size must be an integer >= 1, got {vpp!r}")
        if cfg.get("ckpt") not in (None, ""):
            out["ckpt"] = str(cfg["ckpt"])
        if cfg.get("offload_alpha") not in (None, ""):
            out["offload_alpha"] = OffloadAlpha.parse(cfg["offload_alpha"]).alpha
    except (ValueError, TypeError) as e:
        raise RunFileError(f"{path}: {e}") from None
    for k in SWITCHES:
        if cfg.get(k) not in (None, ""):
            out[k] = _switch(path, k, cfg[k])
    for k in TEXT_FIELDS:
        if cfg.get(k) not in (None, ""):
            out[k] = str(cfg[k])
    return out


def _rate(where: str, value) -> float:
    """A measured tokens/s per GPU: a finite number > 0 (the schema's one-line error otherwise)."""
    try:
        return check_positive_rate(where, "tokens_per_second_per_gpu", value)
    except SchemaError as e:
        raise RunFileError(str(e)) from None


def check_output_path(path: str) -> None:
    """``--output``: its parent exists, is a directory and is writable, and the target is not a directory
    (checked before any fitting)."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if not str(path).strip():
        raise RunFileError("--output: an empty path; give a file path")
    if p.is_dir():
        raise RunFileError(f"--output {path}: is a directory; give a file path")
    if not parent.is_dir():
        raise RunFileError(f"--output {path}: parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise RunFileError(f"--output {path}: not writable")


def _finish(where: str, fields: dict, model: ModelSpec, system: SystemSpec) -> Plan:
    """The run's plan through the one translation (a field the run does not name is Megatron's default: no
    recompute, no sequence parallelism, no distributed optimizer), checked against the model and system
    (:func:`~h3t_ext.costmodel.plan_checks.validate_plan`); a plan refused by either is a RunFileError naming
    ``where`` (the file, and the row of a CSV)."""
    virtual = fields.pop("_virtual", None)
    if virtual is not None and fields.get("pipeline_model_parallel_layout") is None:  # a layout says v itself
        if any(fields.get(k) for k in _SPLIT_GIVEN):
            fields["num_virtual_stages_per_pipeline_rank"] = virtual
        else:
            p = fields.get("pipeline_model_parallel_size", 1)
            fields["num_layers_per_virtual_pipeline_stage"] = model.num_layers // (p * virtual)
    try:
        plan = plan_from_args(fields, num_gpus=fields["num_gpus"], offload_alpha=fields.get("offload_alpha", 0.0),
                              model=model)
        validate_plan(model, plan, system)
        return plan
    except ValueError as e:  # the translation's one-line refusals, PlanError among them
        raise RunFileError(f"{where}: {' '.join(str(e).split())}") from None


def read_runs(paths: Sequence[str], model: ModelSpec, system: SystemSpec) -> list[MeasuredRun]:
    """Measured runs of every file (``.json``: --metrics-json, ``.csv``: one run per row) of ``model`` on
    ``system``."""
    runs: list[MeasuredRun] = []
    for path in paths:
        p = Path(path)
        if not p.is_file():
            raise RunFileError(f"--runs {path}: " + ("a directory; give a --metrics-json or CSV file" if p.is_dir() else
                                                     "not a regular file" if p.exists() else "no such file"))
        if p.suffix == ".csv":
            with open(p, newline="", encoding="utf-8") as f:
                for i, row in enumerate(csv.DictReader(f), 2):
                    if not row.get("tokens_per_second_per_gpu"):
                        raise RunFileError(f"{path}:{i}: needs a tokens_per_second_per_gpu column")
                    plan = _finish(f"{path}:{i}", _fields(f"{path}:{i}", row), model, system)
                    rate = _rate(f"{path}:{i}", row["tokens_per_second_per_gpu"])
                    runs.append(MeasuredRun(model, plan, rate, f"{p.name}:{i}"))
            continue
        try:
            with open(p, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, ValueError, RecursionError) as e:
            raise RunFileError(f"--runs {path}: not a --metrics-json file ({e})") from None
        if not isinstance(d, dict) or "config" not in d or "iterations" not in d:
            raise RunFileError(f"--runs {path}: not a --metrics-json file (a JSON object with config and iterations, "
                               f"got {type(d).__name__}{' without them' if isinstance(d, dict) else ''})")
        cfg, iters = d["config"], d["iterations"]
        if not isinstance(cfg, dict) or not isinstance(iters, list) or not all(isinstance(r, dict) for r in iters):
            raise RunFileError(f"--runs {path}: not a --metrics-json file (config must be an object, iterations "
                               f"a list of objects)")
        rates = [_rate(f"--runs {path}", r["tokens_per_second_per_gpu"]) for r in iters[1:] or iters
                 if r.get("tokens_per_second_per_gpu") is not None]
        if not rates:
            raise RunFileError(f"--runs {path}: no iteration with tokens_per_second_per_gpu")
        plan = _finish(f"--runs {path}", _fields(path, cfg), model, system)
        runs.append(MeasuredRun(model, plan, statistics.median(rates), p.name))
    if not runs:
        raise RunFileError("--runs: no runs in the given files")
    return runs


@dataclass(frozen=True)
class Calibration:
    """A calibration's result and the system file it writes."""

    fit: FitResult
    """The fit to the runs, taken whole."""
    weight: float
    """The share of the fit applied (``pooling``)."""
    weight_from: str
    applied: dict[str, float]
    """The efficiencies written: each fitted one moved ``weight`` of the way from the system file's value."""
    mae_applied: float
    """The runs' tokens/s MAE with ``applied``."""
    system_file: dict


def calibrate(system: SystemSpec, base_file: dict, runs: Sequence[MeasuredRun],
              weight: Optional[float] = None) -> Calibration:
    """Fit ``system``'s identifiable efficiencies to ``runs`` and apply the fit pooled: by ``weight`` (in [0, 1])
    or, when None, by the weight the published sources' prior gives ``len(runs)`` runs. The new system file is
    ``base_file`` with an inline ``efficiencies`` object, the GPU family it was calibrated from (``efficiency_set``)
    and a ``calibration`` record (rows, weight, fitted and applied values, unidentified, errors)."""
    fit = fit_system(system, runs)
    if weight is None:
        prior = calibration_prior(system.efficiency_set)
        weight = prior.weight(len(runs))
        whose = ("its GPU family's held-out published runs' spread" if transferred_source(system.efficiency_set)
                 else "the published sources' spread")
        weight_from = (f"{len(runs)} run(s) against {whose}: across clusters {prior.between_source_sd:.2%}, "
                       f"within one {prior.within_source_sd:.2%} (data/uncertainty.json)")
    else:
        weight_from = "--calibration-weight"
    applied = pooled(system, fit.fitted, weight)
    calibrated = with_efficiencies(system, applied)
    mae_applied = mean_abs(relative_errors(runs, calibrated))
    ranges = plausible_ranges()
    out = dict(base_file)
    # the family stays named: the inline efficiencies are priced, the family keeps the interval, the MFU ceilings and
    # the calibration prior of its GPUs (a calibrated B200 is still carried over from Hopper)
    if system.efficiency_set in efficiency_set_names():
        out["efficiency_set"] = system.efficiency_set
    else:  # a file's own inline efficiencies: no family to name
        out.pop("efficiency_set", None)
    out["name"] = system.name
    out["efficiencies"] = dict(calibrated.efficiencies)
    out["calibration"] = {
        "rows": fit.rows,
        "weight": weight,
        "weight_from": weight_from,
        "fitted": {k: {"value": applied[k], "fit_to_runs": v, "prior": system.efficiency(k),
                       "plausible_range": list(ranges[k])} for k, v in fit.fitted.items()},
        "not_identified": dict(fit.unidentified),
        "tokens_per_s_mae_before": fit.mae_before,
        "tokens_per_s_mae_after": mae_applied,
        "tokens_per_s_mae_fit_whole": fit.mae_after,
        "runs": [r.label for r in runs],
    }
    return Calibration(fit, weight, weight_from, applied, mae_applied, out)
