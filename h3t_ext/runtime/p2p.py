"""Point-to-point transfers between pipeline stages, device-agnostic, with timeouts.

Every transfer is posted as an asynchronous isend/irecv on the pipeline process group (on the
tensors' own device, so gloo on CPU and NCCL on GPU run the same code) and carries a tag that is
unique per (direction, microbatch, sending virtual stage, tensor index): a receive can only
match the send it was meant for. Consecutive transfers of an action list are posted together
with ``batch_isend_irecv``. Receives are waited for when their tensor is needed, sends at the
end of the iteration; every wait has a deadline and fails with :class:`P2PTimeoutError`
naming the peer and the action instead of hanging.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

FORWARD, BACKWARD = 0, 1
_MAX_TENSORS = 4


class P2PTimeoutError(RuntimeError):
    """A pipeline send or receive did not complete within ``p2p_timeout_s``."""


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
    """

    def __init__(self, pp_group, num_stages: int, timeout_s: float):
        self.group = pp_group
        self.rank = dist.get_rank(pp_group)
        self.size = dist.get_world_size(pp_group)
        self.num_stages = num_stages
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._queued: list[tuple[dist.P2POp, str, Optional[tuple]]] = []
        self._recvs: dict[tuple, tuple[_Pending, list[torch.Tensor]]] = {}
        self._sends: list[_Pending] = []

    # -- posting ---------------------------------------------------------------------------
    def queue_send(self, tensors: Sequence[torch.Tensor], peer: int, direction: int, microbatch: int,
                   sender_stage: int, what: str) -> None:
        """Queue sends of ``tensors`` to pipeline rank ``peer``; posted at :meth:`flush`.

        A detached alias is sent, so the caller may pseudo-free the tensor's ``.data`` right
        after (Megatron's ``deallocate_pipeline_outputs``) while the send still reads the storage.
        """
        for i, t in enumerate(tensors):
            tag = p2p_tag(direction, microbatch, sender_stage, self.num_stages, i)
            op = dist.P2POp(dist.isend, t.detach().contiguous(), group=self.group, group_peer=peer, tag=tag)
            self._queued.append((op, what, None))

    def queue_recv(self, key: tuple, shapes: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device,
                   peer: int, direction: int, microbatch: int, sender_stage: int, what: str) -> None:
        """Queue receives of tensors of ``shapes`` from pipeline rank ``peer`` under ``key``."""
        assert key not in self._recvs, f"receive {what} posted twice"
        for i, shape in enumerate(shapes):
            buf = torch.empty(tuple(shape), dtype=dtype, device=device, requires_grad=False)
            tag = p2p_tag(direction, microbatch, sender_stage, self.num_stages, i)
            op = dist.P2POp(dist.irecv, buf, group=self.group, group_peer=peer, tag=tag)
            self._queued.append((op, what, (key, i, len(shapes))))

    def flush(self) -> None:
        """Post every queued transfer in one ``batch_isend_irecv``; drop sends that have completed."""
        self._reap_sends()
        if not self._queued:
            return
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
        pending, tensors = self._recvs.pop(key)
        self._wait(pending)
        return tensors

    def wait_all(self) -> None:
        """Wait for every posted send; receives nobody consumed are an error."""
        self.flush()
        assert not self._recvs, f"receives posted but never consumed: {sorted(self._recvs)}"
        for pending in self._sends:
            self._wait(pending)
        self._sends.clear()

    def _wait(self, pending: _Pending) -> None:
        for work in pending.works:
            try:
                work.wait(self.timeout)
            except RuntimeError as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise P2PTimeoutError(
                    f"pipeline rank {self.rank}: {pending.what} did not complete within "
                    f"{self.timeout.total_seconds():g}s (p2p_timeout_s): {first}"
                ) from exc


__all__ = ["BACKWARD", "FORWARD", "P2PTimeoutError", "PipelineP2P", "p2p_tag"]
