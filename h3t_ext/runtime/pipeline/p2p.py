"""Point-to-point transfers between pipeline stages, device-agnostic, with timeouts.

Every transfer is posted as an asynchronous isend/irecv on the pipeline process group (on the
tensors' own device, so gloo on CPU and NCCL on GPU run the same code) and carries a tag that is
unique per (direction, microbatch, sending virtual stage, tensor index): a receive can only
match the send it was meant for. Consecutive transfers of an action list are posted together
with ``batch_isend_irecv`` (the runs between compute actions of the builder's list,
:func:`h3t_ext.schedule.posting.posting_batches`). Receives are waited for when their tensor is
needed, sends at the end of the iteration.

Waiting differs by backend. On gloo (CPU) every wait is a host wait with a deadline and fails
with :class:`P2PTimeoutError` naming the peer and the action instead of hanging. On NCCL a wait
is ``work.wait()`` without a timeout: it makes the current CUDA stream wait for the transfer and
returns at once, so a receive is not a host synchronisation (``work.wait(timeout)`` would make
the host poll until the transfer is done); the process group's own timeout and watchdog bound a
transfer that never completes.

``strict="group"|"pair"`` (``H3TConfig.strict_p2p``) executes the batches with NCCL's ordering
on gloo (:mod:`h3t_ext.runtime.pipeline.p2p_strict`), so a posting order that would deadlock on a GPU
cluster deadlocks in CPU tests too and ends with one :class:`P2PTimeoutError` line. NCCL groups
need no emulation: there the flag changes nothing.

``staging="host"`` (``H3TConfig.p2p_staging``) stages every transfer through host memory, for
pipelines of several processes on one GPU, where NCCL refuses to run and gloo cannot move CUDA
tensors: a send copies its tensor into a fresh host buffer (pinned for a CUDA tensor; a
synchronous copy, so the buffer is complete when gloo reads it) when it is queued, and a receive
lands in a host buffer that is copied into its device buffer when the receive is waited for (the
device buffer is allocated when the receive is posted, as NCCL's is, so the device holds over the
iteration what it holds under NCCL). Tags, batching, timeouts and strict ordering apply to the
host buffers unchanged. The copies are made on CPU tensors too (so CPU tests run this path);
:class:`StagingStats` counts them. Without staging, a non-CPU tensor meeting a gloo group is one
:class:`P2PStagingError` line instead of gloo's own error.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..config import P2P_STAGING_CHOICES
from .errors import P2PStagingError, P2PTimeoutError
from .p2p_strict import StrictP2P

FORWARD, BACKWARD = 0, 1
_MAX_TENSORS = 4


@dataclass
class StagingStats:
    """Copies made by host staging (``staging="host"``), for tests and reports."""

    sends: int = 0
    """Tensors copied into a host buffer before their send."""
    recvs: int = 0
    """Received host buffers copied to the receiving device."""
    bytes: int = 0
    """Bytes of all those copies."""


def uses_stream_waits(backend: str) -> bool:
    """True when waits on ``backend``'s works are device-stream waits (NCCL), not host waits."""
    return "nccl" in str(backend).lower()


def wait_work(work, timeout: datetime.timedelta, what: str, rank: int, *, stream_wait: bool) -> None:
    """Wait for one request: ``work.wait()`` on NCCL (the current stream waits; no host poll),
    ``work.wait(timeout)`` elsewhere; a failure is one :class:`P2PTimeoutError` line."""
    try:
        if stream_wait:
            work.wait()
        else:
            work.wait(timeout)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if peer_is_gone(first):
            raise P2PTimeoutError(f"pipeline rank {rank}: {what} failed: the peer process is gone ({first})") from exc
        limit = "the process group's timeout" if stream_wait else f"{timeout.total_seconds():g}s (p2p_timeout_s)"
        raise P2PTimeoutError(f"pipeline rank {rank}: {what} did not complete within {limit}: {first}") from exc


PEER_GONE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""What gloo's TCP transport says when the other process died (as opposed to a timeout)."""


def peer_is_gone(message: str) -> bool:
    """True when a transport error says the peer process ended rather than that a wait timed out."""
    return any(m in message for m in PEER_GONE_MARKERS)


def p2p_tag(direction: int, microbatch: int, sender_stage: int, num_stages: int, index: int = 0) -> int:
    """Tag of one transfer; distinct for distinct (direction, microbatch, sender stage, index)."""
    assert direction in (FORWARD, BACKWARD) and 0 <= sender_stage < num_stages and 0 <= index < _MAX_TENSORS
    return 1 + index + _MAX_TENSORS * (direction + 2 * (sender_stage + num_stages * microbatch))


@dataclass
class _Pending:
    works: list
    """Requests of the batch the transfer was posted in (one per op, or one for the batch)."""
    what: str
    """Human-readable action, for error messages."""
    tensors: list = field(default_factory=list)
    """Tensors kept alive until the transfer completes."""


class PipelineP2P:
    """Tagged asynchronous transfers on one pipeline group.

    ``num_stages`` is the number of virtual stages ``p * v``; ranks are ranks of ``pp_group``.
    ``strict`` (``"group"`` or ``"pair"``, the NCCL communicator mapping to emulate) runs the
    batches through :class:`~h3t_ext.runtime.pipeline.p2p_strict.StrictP2P`; ignored on NCCL groups.
    ``staging="host"`` copies every transfer through host buffers (module docstring); gloo only.
    """

    def __init__(self, pp_group, num_stages: int, timeout_s: float, strict: Optional[str] = None,
                 staging: str = "none"):
        self.group = pp_group
        self.rank = dist.get_rank(pp_group)
        self.size = dist.get_world_size(pp_group)
        self.num_stages = num_stages
        self.timeout = datetime.timedelta(seconds=timeout_s)
        backend = str(dist.get_backend(pp_group)).lower()
        self.stream_waits = uses_stream_waits(backend)
        self.gloo = "gloo" in backend and not self.stream_waits
        if staging not in P2P_STAGING_CHOICES:
            raise P2PStagingError(f"p2p_staging must be one of {{{','.join(P2P_STAGING_CHOICES)}}}, got {staging!r}")
        if staging == "host" and not self.gloo:
            raise P2PStagingError(f"p2p_staging='host' needs a gloo pipeline group, this one is {backend!r}")
        self.host_staging = staging == "host"
        self.staging_stats = StagingStats()
        """What host staging copied so far (all zero without staging)."""
        self.strict = None if strict is None or self.stream_waits else StrictP2P(pp_group, self.rank, strict, timeout_s)
        self.posted: list[tuple[str, ...]] = []
        """The ``what`` of every transfer of each posted batch, in posting order (for tests)."""
        self._queued: list[tuple[dist.P2POp, str, Optional[tuple]]] = []
        self._recvs: dict[tuple, tuple] = {}
        self._recv_targets: dict[tuple, list[torch.Tensor]] = {}
        self._sends: list[_Pending] = []

    # -- host staging ----------------------------------------------------------------------
    def _check_device(self, device: torch.device, what: str) -> None:
        if self.gloo and torch.device(device).type != "cpu":
            raise P2PStagingError(
                f"pipeline rank {self.rank}: {what} moves a {torch.device(device).type} tensor over a gloo group, "
                "which cannot send or receive device tensors; set p2p_staging='host' (H3TConfig) to stage "
                "transfers through host memory")

    def _stage_out(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` (a new buffer even for a CPU tensor), complete when this returns."""
        host = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        host.copy_(t)  # synchronous: gloo reads a finished copy
        self.staging_stats.sends += 1
        self.staging_stats.bytes += host.numel() * host.element_size()
        return host

    def _stage_in(self, host: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the device buffer allocated when the receive was posted) holding a received host buffer."""
        out.copy_(host)
        self.staging_stats.recvs += 1
        self.staging_stats.bytes += host.numel() * host.element_size()
        return out

    # -- posting ---------------------------------------------------------------------------
    def queue_send(self, tensors: Sequence[torch.Tensor], peer: int, direction: int, microbatch: int,
                   sender_stage: int, what: str) -> None:
        """Queue sends of ``tensors`` to pipeline rank ``peer``; posted at :meth:`flush`.

        A detached alias is sent, so the caller may pseudo-free the tensor's ``.data`` right
        after (Megatron's ``deallocate_pipeline_outputs``) while the send still reads the storage.
        """
        for i, t in enumerate(tensors):
            tag = p2p_tag(direction, microbatch, sender_stage, self.num_stages, i)
            if self.host_staging:
                payload = self._stage_out(t.detach())
            else:
                self._check_device(t.device, what)
                payload = t.detach().contiguous()
            op = dist.P2POp(dist.isend, payload, group=self.group, group_peer=peer, tag=tag)
            self._queued.append((op, what, None))

    def queue_recv(self, key: tuple, shapes: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device,
                   peer: int, direction: int, microbatch: int, sender_stage: int, what: str) -> None:
        """Queue receives of tensors of ``shapes`` from pipeline rank ``peer`` under ``key``."""
        assert key not in self._recvs, f"receive {what} posted twice"
        device = torch.device(device)
        if self.host_staging:  # lands on the host; copied by wait_recv into a device buffer allocated now,
            # so the device holds what it holds under NCCL (a posted receive's buffer) from posting on
            self._recv_targets[key] = [torch.empty(tuple(s), dtype=dtype, device=device) for s in shapes]
        else:
            self._check_device(device, what)
        for i, shape in enumerate(shapes):
            buf = torch.empty(tuple(shape), dtype=dtype, requires_grad=False,
                              device="cpu" if self.host_staging else device,
                              pin_memory=self.host_staging and device.type == "cuda")
            tag = p2p_tag(direction, microbatch, sender_stage, self.num_stages, i)
            op = dist.P2POp(dist.irecv, buf, group=self.group, group_peer=peer, tag=tag)
            self._queued.append((op, what, (key, i, len(shapes))))

    def flush(self) -> None:
        """Post every queued transfer in one ``batch_isend_irecv``; drop sends that have completed."""
        if self.strict is not None:
            return self._flush_strict()
        self._reap_sends()
        if not self._queued:
            return
        self.posted.append(tuple(what for _, what, _ in self._queued))
        ops = [op for op, _, _ in self._queued]
        works = dist.batch_isend_irecv(ops)
        per_op = len(works) == len(ops)
        for j, (op, what, recv) in enumerate(self._queued):
            pending = _Pending([works[j]] if per_op else list(works), what, [op.tensor])
            if recv is None:
                self._sends.append(pending)
                continue
            key, i, n = recv
            entry = self._recvs.setdefault(key, (_Pending([], what), [None] * n))
            entry[0].works.extend(pending.works)
            entry[1][i] = op.tensor
        self._queued.clear()

    def _flush_strict(self) -> None:
        if not self._queued:
            self.strict.progress()
            return
        self.posted.append(tuple(what for _, what, _ in self._queued))
        batch = self.strict.post([(op.op is dist.isend, op.tensor, op.group_peer, op.tag, what)
                                  for op, what, _ in self._queued])
        for op, what, recv in self._queued:
            if recv is None:
                continue
            key, i, n = recv
            entry = self._recvs.setdefault(key, (batch, what, [None] * n))
            entry[2][i] = op.tensor
        self._queued.clear()

    def _reap_sends(self) -> None:
        """Forget completed sends, so their buffers (e.g. pseudo-freed stage outputs) can go."""
        still = []
        for pending in self._sends:
            if all(w.is_completed() for w in pending.works):
                self._wait(pending)  # returns at once; raises if the send failed
            else:
                still.append(pending)
        self._sends = still

    # -- waiting ---------------------------------------------------------------------------
    def wait_recv(self, key: tuple) -> list[torch.Tensor]:
        """The tensors received under ``key`` (posted earlier), after waiting for them."""
        self.flush()
        if self.strict is not None:
            batch, what, tensors = self._recvs.pop(key)
            self.strict.wait_batch(batch, what)
        else:
            pending, tensors = self._recvs.pop(key)
            self._wait(pending)
        targets = self._recv_targets.pop(key, None)
        if targets is not None:
            tensors = [self._stage_in(t, out) for t, out in zip(tensors, targets)]
        return tensors

    def wait_all(self) -> None:
        """Wait for every posted send; receives nobody consumed are an error."""
        self.flush()
        assert not self._recvs, f"receives posted but never consumed: {sorted(self._recvs)}"
        if self.strict is not None:
            self.strict.wait_all()
            return
        for pending in self._sends:
            self._wait(pending)
        self._sends.clear()

    def _wait(self, pending: _Pending) -> None:
        for work in pending.works:
            wait_work(work, self.timeout, pending.what, self.rank, stream_wait=self.stream_waits)


__all__ = ["BACKWARD", "FORWARD", "PipelineP2P", "StagingStats", "p2p_tag",
           "uses_stream_waits", "wait_work"]
