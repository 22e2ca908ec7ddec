"""What megatron-core's optimizer cannot do on the software a GPU run has, each found on a GPU and said in one line,
or worked around where megatron-core's own rule allows: TransformerEngine's FusedAdam for the precision-aware optimizer
(:func:`require_transformer_engine`), ``OptimizerConfig``'s TransformerEngine version check
(:func:`build_optimizer_config`), and the distributed optimizer's state with torch's Adam
(:func:`distributed_optimizer_load_blocker`)."""
from __future__ import annotations

from typing import Optional


def build_optimizer_config(config_cls, fields: dict):
    """megatron-core's ``OptimizerConfig`` (``config_cls``) of ``fields``.

    megatron-core 0.16's ``__post_init__`` asks TransformerEngine's version whenever
    ``use_precision_aware_optimizer`` is set, and fails where TE is not importable (``None >= Version``: a
    TypeError; 0.19 takes the version as 0.0.0 there). Under ``optimizer_cpu_offload`` its other precision-aware
    checks return at once (HybridDeviceOptimizer steps with torch's AdamW) and the driver has checked Adam and the
    distributed optimizer (feature_checks), so without TE the field is set after construction, with
    ``store_param_remainders`` False as ``__post_init__`` sets it below TE 2.1."""
    from h3t_training.config import feature_checks
    if not (fields.get("use_precision_aware_optimizer") and fields.get("optimizer_cpu_offload")) \
            or feature_checks.transformer_engine_available():
        return config_cls(**fields)
    cfg = config_cls(**{**fields, "use_precision_aware_optimizer": False})
    cfg.use_precision_aware_optimizer = True
    cfg.store_param_remainders = False
    return cfg


def require_transformer_engine(args) -> Optional[str]:
    """On a GPU ``--use-precision-aware-optimizer`` runs TransformerEngine's FusedAdam (megatron-core's
    OptimizerConfig); the one-line reason when TE is not importable, else None."""
    if not args.use_precision_aware_optimizer or args.optimizer_cpu_offload:
        return None  # with the offload megatron-core's HybridDeviceOptimizer steps with torch's AdamW
    from h3t_training.config import feature_checks
    if not feature_checks.transformer_engine_available():
        return (f"--use-precision-aware-optimizer needs TransformerEngine's FusedAdam on a GPU "
                f"({feature_checks.transformer_engine_reason()}); leave the flag out")
    return None


def distributed_optimizer_load_blocker(args) -> Optional[str]:
    """Why megatron-core's distributed optimizer cannot load its state here, or None. Without TransformerEngine or
    apex it steps torch's Adam (``distrib_optimizer.HAVE_APEX_OR_TE`` False), whose per-parameter ``step`` its
    loaders (every sharding type, and the legacy parameter state) leave out of the tensors they install while
    ``_set_main_param_and_optimizer_states`` copies every state key: a KeyError 'step' in megatron-core 0.16 to 0.19
    (measured on an H200). HybridDeviceOptimizer (--optimizer-cpu-offload) installs what it is given, and is not
    affected."""
    if not args.use_distributed_optimizer or args.optimizer_cpu_offload:
        return None
    from megatron.core.optimizer import distrib_optimizer
    if getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        return None
    return ("megatron-core's distributed optimizer steps torch's Adam here (neither TransformerEngine nor apex is "
            "importable), and megatron-core cannot load that optimizer's per-parameter step (KeyError 'step'); "
            "install TransformerEngine, or resume the weights alone with --no-load-optim")


__all__ = ["build_optimizer_config", "distributed_optimizer_load_blocker", "require_transformer_engine"]
