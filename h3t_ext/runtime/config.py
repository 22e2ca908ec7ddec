"""Configuration of the h3t-ext runtime (recompute mode, offload ratio, device layer)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from h3t_ext.ckpt import CKPT_CHOICES, RUNTIME_CKPTS, Ckpt
from h3t_ext.offload_alpha import check_alpha
DEVICE_MODES = ("auto", "cuda", "cpu-sync", "cpu-thread")
STRICT_P2P_COMM_CHOICES = ("group", "pair")
P2P_STAGING_CHOICES = ("none", "host")


class RuntimeConfigError(ValueError):
    """A runtime setting that cannot run; the message is one line naming the setting."""


@dataclass(frozen=True)
class H3TConfig:
    """What :func:`h3t_ext.install` installs into megatron-core's pipeline schedules."""

    ckpt: Ckpt = Ckpt.NO
    """Activation recompute (its flag text is coerced to the :class:`~h3t_ext.ckpt.Ckpt` member): ``no`` (keep all), ``full`` (each layer from its input),
    ``ours`` (keep GEMM outputs, recompute the two RMSNorm outputs and the SwiGLU output)."""
    offload_alpha: Union[float, Sequence[float]] = 0.0
    """Fraction of each microbatch-chunk's saved activation bytes sent to host memory after its
    forward and brought back before its backward; one value, or one per pipeline stage."""
    device_mode: str = "auto"
    """Device layer: ``cuda`` streams and events, ``cpu-sync`` (copies done in place), or
    ``cpu-thread`` (each stream is a worker thread, so a missing wait shows up in tests);
    ``auto`` picks ``cuda`` when the model is on a CUDA device, else ``cpu-sync``."""
    p2p_timeout_s: float = 300.0
    """Longest wait for one pipeline send/receive before failing with an error."""
    min_offload_bytes: int = 4096
    """Saved tensors smaller than this stay on the device (not worth a copy)."""
    strict_p2p: bool = False
    """Run pipeline sends/receives on gloo with NCCL's semantics (``--strict-p2p``): a rank's
    batches complete in order and a send completes only once the peer has started the batch
    with the matching receive, so a posting order that would deadlock under NCCL ends with a
    one-line ``P2PTimeoutError`` within ``p2p_timeout_s`` instead of passing on CPU. Costs one
    small handshake message per transfer; no effect on NCCL groups (already strict)."""
    strict_p2p_comm: str = "group"
    """How strict mode maps transfers onto NCCL communicators: ``group`` (one communicator per
    process group: all of a rank's batches in one order, the stricter) or ``pair`` (one per rank
    pair: only the batches to the same peer are ordered)."""
    p2p_staging: str = "none"
    """``host`` stages every pipeline send and receive through host buffers: a device tensor is
    copied into a host buffer before its gloo ``isend``, and a receive lands in a host buffer that
    is copied to the device when it is waited for. Gloo cannot send or receive CUDA tensors and
    NCCL refuses two ranks on one GPU, so this is what runs a pipeline of several processes on
    one GPU (over gloo). ``none`` (default) sends the tensors themselves. Gloo groups only."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ckpt", _validate_ckpt(self.ckpt))
        _validate_alpha(self.offload_alpha)
        _validate_device_mode(self.device_mode)
        if self.strict_p2p_comm not in STRICT_P2P_COMM_CHOICES:
            raise RuntimeConfigError(
                f"strict_p2p_comm must be one of {{{','.join(STRICT_P2P_COMM_CHOICES)}}}, got {self.strict_p2p_comm!r}")
        if self.p2p_staging not in P2P_STAGING_CHOICES:
            raise RuntimeConfigError(
                f"p2p_staging must be one of {{{','.join(P2P_STAGING_CHOICES)}}}, got {self.p2p_staging!r}")
        if not self.p2p_timeout_s > 0:
            raise RuntimeConfigError(f"p2p_timeout_s must be > 0, got {self.p2p_timeout_s}")

    def stage_alpha(self, pipeline_rank: int, pipeline_size: int) -> float:
        """The offload ratio of one pipeline stage."""
        if isinstance(self.offload_alpha, (int, float)):
            return float(self.offload_alpha)
        alphas = tuple(self.offload_alpha)
        if len(alphas) != pipeline_size:
            raise RuntimeConfigError(
                f"--offload-alpha has {len(alphas)} per-stage values but --pipeline-model-parallel-size is "
                f"{pipeline_size}"
            )
        return float(alphas[pipeline_rank])

    @property
    def offloads(self) -> bool:
        """True when any stage offloads a positive fraction."""
        if isinstance(self.offload_alpha, (int, float)):
            return self.offload_alpha > 0
        return any(a > 0 for a in self.offload_alpha)


def _validate_ckpt(ckpt: str) -> Ckpt:
    try:
        return Ckpt.parse(ckpt, choices=RUNTIME_CKPTS)
    except ValueError as e:
        raise RuntimeConfigError(str(e)) from None


def _validate_alpha(alpha: Union[float, Sequence[float]]) -> None:
    try:
        check_alpha(alpha if isinstance(alpha, (int, float)) else tuple(alpha))
    except ValueError as e:
        raise RuntimeConfigError(str(e)) from None


def _validate_device_mode(mode: str) -> None:
    if mode not in DEVICE_MODES:
        raise RuntimeConfigError(f"device_mode must be one of {{{','.join(DEVICE_MODES)}}}, got {mode!r}")


def resolve_device_mode(mode: str, device_type: str) -> str:
    """The concrete device layer for a model living on ``device_type``."""
    if mode == "auto":
        return "cuda" if device_type == "cuda" else "cpu-sync"
    if mode == "cuda" and device_type != "cuda":
        raise RuntimeConfigError(f"device_mode 'cuda' needs the model on a CUDA device, it is on {device_type!r}")
    return mode


__all__ = ["CKPT_CHOICES", "DEVICE_MODES", "P2P_STAGING_CHOICES", "STRICT_P2P_COMM_CHOICES", "H3TConfig",
           "RuntimeConfigError", "resolve_device_mode"]
