"""The launch environment Megatron-LM 0.16-0.19 assert for a GPU run: ``CUDA_DEVICE_MAX_CONNECTIONS``.

Megatron-LM's ``validate_args`` checks the variable against the run's parallelism:

* with Megatron FSDP or torch FSDP2 it must be unset or above 1 (FSDP's collectives run beside the compute on streams
  of their own);
* else, with tensor or context parallelism on a GPU before Blackwell (compute capability below 10), it must be 1, so
  that the sequence-parallel collectives are queued ahead of the GEMMs they overlap (with either FSDP Megatron-LM only
  warns).

One rule for both readers: the planner prints what a plan needs beside its flags (:func:`launch_env_words`), and the
training driver refuses a launch that breaks it (``h3t_training.config.feature_checks.cuda_connections_refusal``).
"""
from __future__ import annotations

from typing import Optional

CONNECTIONS_VAR = "CUDA_DEVICE_MAX_CONNECTIONS"
"""The CUDA setting Megatron-LM 0.16-0.19's ``validate_args`` asserts on a GPU run's launch environment."""
UNORDERED_ARCH_MAJOR = 10
"""The first compute capability (Blackwell) on which Megatron-LM asks nothing of the variable with tensor or context
parallelism."""
ONE, UNSET = "1", "unset"
"""What :func:`required_connections` asks: exactly 1, or unset (or above 1)."""


def required_connections(*, tensor_or_context_parallel: bool, fsdp: bool, arch_major: Optional[int]) -> Optional[str]:
    """:data:`ONE`, :data:`UNSET` or None (no requirement) for a run with or without tensor or context parallelism
    and an FSDP, on a GPU of compute capability ``arch_major``.x (None: not known, nothing asked of the sizes)."""
    if fsdp:
        return UNSET
    if tensor_or_context_parallel and arch_major is not None and arch_major < UNORDERED_ARCH_MAJOR:
        return ONE
    return None


def connections_refusal(value: Optional[str], *, sizes: tuple[tuple[str, int], ...], fsdp_flag: Optional[str],
                        arch_major: Optional[int]) -> Optional[str]:
    """Why Megatron-LM would not start with the variable at ``value`` (None: unset), or None. ``sizes``: (flag,
    size) of the tensor and context parallelism (a None size: not filled yet, asks nothing); ``fsdp_flag``: the
    FSDP flag the run gives, if any."""
    given = tuple((flag, n) for flag, n in sizes if n is not None and n > 1)
    need = required_connections(tensor_or_context_parallel=bool(given), fsdp=fsdp_flag is not None,
                                arch_major=arch_major)
    if need == UNSET and value == ONE:
        return (f"{fsdp_flag} needs {CONNECTIONS_VAR} unset or above 1 (Megatron-LM asserts it: FSDP's collectives "
                f"run beside the compute on streams of their own), got 1; unset it")
    if need == ONE and value != ONE:
        return (f"{' and '.join(f'{flag} {n}' for flag, n in given)} on a GPU of compute capability {arch_major}.x "
                f"needs {CONNECTIONS_VAR}=1 in the launch environment (Megatron-LM asserts it before Blackwell: the "
                f"sequence-parallel collectives must be queued ahead of the GEMMs they overlap), got "
                f"{value or 'unset'}; export {CONNECTIONS_VAR}=1")
    return None


def launch_env_words(plan, system) -> tuple[str, ...]:
    """The ``env`` arguments that give ``plan`` on ``system`` the environment Megatron-LM asserts:
    ``CUDA_DEVICE_MAX_CONNECTIONS=1``, ``-u CUDA_DEVICE_MAX_CONNECTIONS`` (unset), or nothing."""
    arch = int(system.compute_capability) if system.compute_capability else None
    need = required_connections(
        tensor_or_context_parallel=plan.tensor_model_parallel_size > 1 or plan.context_parallel_size > 1,
        fsdp=plan.data_parallel_sharding_strategy is not None or plan.use_torch_fsdp2, arch_major=arch)
    if need == ONE:
        return (f"{CONNECTIONS_VAR}={ONE}",)
    if need == UNSET:
        return ("-u", CONNECTIONS_VAR)
    return ()


def describe_launch_env(words: tuple[str, ...]) -> str:
    """``env`` with :func:`launch_env_words`' arguments and why Megatron-LM asks for them ('' for none)."""
    if not words:
        return ""
    why = ("is unset or above 1 with an FSDP" if words[0] == "-u" else
           "is 1 with tensor or context parallelism before Blackwell")
    return f"env {' '.join(words)} (Megatron-LM asserts {CONNECTIONS_VAR} {why})"


__all__ = ["CONNECTIONS_VAR", "ONE", "UNORDERED_ARCH_MAJOR", "UNSET", "connections_refusal", "describe_launch_env",
           "launch_env_words", "required_connections"]
