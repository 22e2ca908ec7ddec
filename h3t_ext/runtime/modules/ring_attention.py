"""Context-parallel causal core attention on CPU: ring attention over the CPU SDPA (flash) kernel.

Layout (Megatron's load-balanced one, ``megatron.core.utils.get_batch_on_this_cp_rank``): the
sequence of length ``s`` is cut into ``2c`` chunks of ``n = s / (2c)`` tokens; context-parallel
rank ``r`` holds chunks ``r`` and ``2c-1-r``, in that order, so its ``2n`` local tokens are in
increasing position order and every rank does the same causal work.

Forward, on every rank: ``c`` steps; at step ``i`` the rank holds the K/V of rank
``src = (r - i) mod c`` and posts, in one ``batch_isend_irecv``, the send of that K/V to rank
``r+1`` and the receive of the next from rank ``r-1`` before computing with it. Per (query chunk,
key chunk) pair the mask is full (key chunk earlier), diagonal-causal (same chunk) or empty (key
chunk later), which gives three block shapes:

* ``i = 0`` (own K/V): causal attention of the ``2n`` local queries over the ``2n`` local keys;
* ``src < r``: all ``2n`` queries over the first ``n`` keys (chunk ``src``), no mask;
* ``src > r``: the last ``n`` queries (chunk ``2c-1-r``) over all ``2n`` keys, no mask.

Each block runs ``aten._scaled_dot_product_flash_attention_for_cpu`` (the kernel behind CPU
``scaled_dot_product_attention``; it takes GQA K/V as they are and returns the log-sum-exp), and
the blocks are merged with an online softmax on the log-sum-exp, in float32.

Backward is a custom autograd function (autograd cannot flow through isend/irecv): the K/V go
round the ring again, each block's gradient is computed by the kernel's backward from the
*final* output and log-sum-exp (which makes each block's contribution exact), dQ accumulates
locally, and dK/dV travel with their K/V and are sent back to their owner after the last step.

What is saved for backward is what flash-attention context parallelism saves: per local token
and batch element the rotated query (``heads*head_dim`` elements), key and value (``2 *
query_groups*head_dim``), the attention output (``heads*head_dim``, the same storage the output
projection saves) and the log-sum-exp (``heads`` float32). No gathered K/V is kept. Transient
(per layer, while its attention runs): the received K/V block (``2 * groups*head_dim`` per local
token, sent from and received into Megatron's contiguous layout, no copies); in backward also the
dK/dV accumulator being sent and the one being received (float32, ``2 * 2 * groups*head_dim``) and
a float32 dQ (float64 for float64 inputs: every accumulator is float32 or the inputs' dtype if wider).

Every send/receive wait has a deadline (``cp_timeout_s``) and fails with :class:`CPTimeoutError`,
one line naming the rank, the peer and the step.
"""
from __future__ import annotations

import datetime
import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class CPTimeoutError(RuntimeError):
    """A context-parallel K/V send or receive did not complete within ``cp_timeout_s``."""


class _Ring:
    """Send-to-next / receive-from-previous exchanges on the context-parallel group."""

    def __init__(self, group, timeout_s: float):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next, self.prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def post(self, tensors: Sequence[torch.Tensor], first_tag: int) -> tuple[list, list[torch.Tensor]]:
        """Send ``tensors`` (contiguous, sent without a copy) to the next rank and receive same-shaped
        ones from the previous rank, all in one ``batch_isend_irecv`` (each rank posts its send and its
        receive together, so NCCL's order matching cannot deadlock); returns (requests, buffers)."""
        ops, bufs = [], []
        for i, t in enumerate(tensors):
            buf = torch.empty_like(t)
            ops.append(dist.P2POp(dist.isend, t.contiguous(), group=self.group, group_peer=self.next,
                                  tag=first_tag + i))
            ops.append(dist.P2POp(dist.irecv, buf, group=self.group, group_peer=self.prev, tag=first_tag + i))
            bufs.append(buf)
        return dist.batch_isend_irecv(ops), bufs

    def wait(self, posted: tuple[list, list[torch.Tensor]], what: str) -> list[torch.Tensor]:
        works, bufs = posted
        for work in works:
            try:
                work.wait(self.timeout)
            except RuntimeError as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise CPTimeoutError(
                    f"context-parallel rank {self.rank}: {what} (to rank {self.next}, from rank {self.prev}) did not "
                    f"complete within {self.timeout.total_seconds():g}s (cp_timeout_s): {first}") from exc
        return bufs


def _block(step: int, rank: int, size: int) -> str:
    """Which block step ``step`` computes on ``rank``: 'causal', 'first_keys' or 'last_queries'."""
    if step == 0:
        return "causal"
    return "first_keys" if (rank - step) % size < rank else "last_queries"


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the running output, log-sum-exp and gradient accumulators: float32, or the inputs' own
    dtype when it is wider (float64 runs stay float64 end to end)."""
    return torch.promote_types(dtype, torch.float32)


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Online-softmax merge of a block's (output, lse) into the running float32 (out, lse), in place."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out.to(out.dtype) * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _forward_block(q, kv, out, lse, step: int, ring: _Ring, scale: float, p: float) -> None:
    """Merge step ``step``'s block (``step`` >= 1: an unmasked one) into the running (out, lse)."""
    n = q.size(2) // 2
    if _block(step, ring.rank, ring.size) == "first_keys":
        bo, bl = _flash(q, kv[0][:, :, :n], kv[1][:, :, :n], p, False, scale=scale)
        _merge(out, lse, bo, bl)
    else:
        bo, bl = _flash(q[:, :, n:], kv[0], kv[1], p, False, scale=scale)
        _merge(out[:, :, n:], lse[:, :, n:], bo, bl)


def _backward_block(go, q, kv, out, lse, dq, dkv, step: int, ring: _Ring, scale: float, p: float) -> None:
    """Add step ``step``'s block gradients to dq and to the travelling dK/dV (float32, in place).
    The kernel's backward with the final output and lse gives exactly this block's share."""
    n = q.size(2) // 2
    kind = _block(step, ring.rank, ring.size)
    if kind == "causal":
        gq, gk, gv = _flash_backward(go, q, kv[0], kv[1], out, lse, p, True, scale=scale)
        dq.add_(gq)
        dkv[0].add_(gk)
        dkv[1].add_(gv)
    elif kind == "first_keys":
        gq, gk, gv = _flash_backward(go, q, kv[0][:, :, :n], kv[1][:, :, :n], out, lse, p, False, scale=scale)
        dq.add_(gq)
        dkv[0][:, :, :n].add_(gk)
        dkv[1][:, :, :n].add_(gv)
    else:
        gq, gk, gv = _flash_backward(go[:, :, n:], q[:, :, n:], kv[0], kv[1], out[:, :, n:], lse[:, :, n:], p, False,
                                     scale=scale)
        dq[:, :, n:].add_(gq)
        dkv[0].add_(gk)
        dkv[1].add_(gv)


def _bhsd(t: torch.Tensor) -> torch.Tensor:
    """[s, b, heads, d] -> the kernel's [b, heads, s, d] (a view)."""
    return t.permute(1, 2, 0, 3)


class _RingAttention(torch.autograd.Function):
    """query [s, b, heads, d], key/value [s, b, groups, d] (local 2n tokens) -> [s, b, heads*d].

    K/V travel in Megatron's contiguous [s, b, groups, d] layout (no copy to send); the kernel reads
    [b, heads, s, d] views of them."""

    @staticmethod
    def forward(ctx, query, key, value, ring: _Ring, scale: float, dropout_p: float):
        s, b, heads, d = query.shape
        kv = (key.contiguous(), value.contiguous())
        posted = ring.post(kv, first_tag=0) if ring.size > 1 else None
        q = _bhsd(query)
        out, lse = _flash(q, _bhsd(kv[0]), _bhsd(kv[1]), dropout_p, True, scale=scale)  # step 0: own K/V, causal
        acc = _accumulation_dtype(query.dtype)
        out, lse = out.to(acc), lse.to(acc).clone()  # out is laid out like query: [s, b, heads, d] memory
        for step in range(1, ring.size):  # step i's K/V were posted while step i-1 computed
            kv = tuple(ring.wait(posted, f"forward K/V exchange, step {step}"))
            posted = ring.post(kv, first_tag=0) if step + 1 < ring.size else None
            _forward_block(q, (_bhsd(kv[0]), _bhsd(kv[1])), out, lse, step, ring, scale, dropout_p)
        # [s, b, heads, d] memory: the output projection saves the same storage as this function
        result = out.to(query.dtype).permute(2, 0, 1, 3).contiguous().view(s, b, heads * d)
        ctx.save_for_backward(query, key, value, result, lse)
        ctx.ring, ctx.scale, ctx.dropout_p = ring, scale, dropout_p
        return result

    @staticmethod
    def backward(ctx, grad_result):
        query, key, value, result, lse = ctx.saved_tensors
        ring, scale, p = ctx.ring, ctx.scale, ctx.dropout_p
        s, b, heads, d = query.shape
        q, out = _bhsd(query), _bhsd(result.view(s, b, heads, d))
        go = _bhsd(grad_result.reshape(s, b, heads, d))
        acc = _accumulation_dtype(query.dtype)
        dq = torch.zeros(query.shape, dtype=acc, device=query.device)
        kv = (key.contiguous(), value.contiguous())
        dkv = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in kv]
        for step in range(ring.size):
            posted = ring.post(kv, first_tag=0) if step + 1 < ring.size else None
            _backward_block(go, q, (_bhsd(kv[0]), _bhsd(kv[1])), out, lse, _bhsd(dq), [_bhsd(t) for t in dkv], step,
                            ring, scale, p)
            if ring.size > 1:  # dK/dV follow their K/V; after the last step they arrive at their owner
                returned = ring.post(dkv, first_tag=2)
                if posted is not None:
                    kv = tuple(ring.wait(posted, f"backward K/V exchange, step {step + 1}"))
                dkv = ring.wait(returned, f"backward dK/dV exchange, step {step + 1}")
        return dq.to(query.dtype), dkv[0].to(key.dtype), dkv[1].to(value.dtype), None, None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cp_group, *, softmax_scale: float,
                   dropout_p: float = 0.0, timeout_s: float = 300.0) -> torch.Tensor:
    """Causal attention of this rank's ``2n`` tokens (Megatron's 2c layout) over the whole sequence.

    ``query`` is ``[2n, b, heads, d]``, ``key``/``value`` ``[2n, b, groups, d]`` with ``groups``
    dividing ``heads``; returns ``[2n, b, heads*d]``. Collective over ``cp_group`` (every rank calls it
    in the same order)."""
    if query.size(0) % 2:
        raise ValueError(f"context-parallel attention needs an even number of local tokens (2 chunks), "
                         f"got {query.size(0)}")
    if query.size(2) % key.size(2):
        raise ValueError(f"{query.size(2)} query heads are not a multiple of {key.size(2)} key/value heads")
    return _RingAttention.apply(query, key, value, _Ring(cp_group, timeout_s), softmax_scale, dropout_p)


class RingSDPACoreAttention(MegatronModule):
    """megatron-core core attention with context parallelism: causal ring attention (see module doc).

    Constructor as megatron-core's core attention; the context-parallel group is ``pg_collection.cp``
    (megatron's ``parallel_state`` only when no collection is given). ``cp_comm_type`` may be None or
    ``"p2p"`` (what this is). ``cp_timeout_s`` (a ModuleSpec param) bounds every ring wait.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        *,
        cp_timeout_s: float = 300.0,
    ):
        super().__init__(config=config)
        if cp_comm_type not in (None, "p2p"):
            raise ValueError(f"RingSDPACoreAttention implements cp_comm_type 'p2p', got {cp_comm_type!r}")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"RingSDPACoreAttention supports causal masks only, got {attn_mask_type}")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("RingSDPACoreAttention has no sliding window (--window-size): its blocks are causal or "
                             "full; train windowed attention with --context-parallel-size 1")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"RingSDPACoreAttention does not support --attention-dropout {dropout} (use 0)")
        if not cp_timeout_s > 0:
            raise ValueError(f"cp_timeout_s must be > 0, got {cp_timeout_s}")
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if cp_group is None:
            from megatron.core import parallel_state

            cp_group = parallel_state.get_context_parallel_group()
        self.cp_group = cp_group
        self.cp_timeout_s = float(cp_timeout_s)
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("RingSDPACoreAttention supports neither packed sequences nor attention bias")
        if (attn_mask_type or AttnMaskType.causal) != AttnMaskType.causal:
            raise ValueError(f"RingSDPACoreAttention supports causal masks only, got {attn_mask_type}")
        # value is a view of the fused QKV GEMM output; saving it would keep that whole buffer alive
        return ring_attention(query, key, value.contiguous(), self.cp_group, softmax_scale=self.softmax_scale,
                              timeout_s=self.cp_timeout_s)


def cp_chunk_indices(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two of ``2 * cp_size`` sequence chunks context-parallel rank ``cp_rank`` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard_sequence(t: torch.Tensor, dim: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """This rank's two chunks of ``t`` along ``dim`` (Megatron's load-balanced layout)."""
    if cp_size == 1:
        return t
    if t.size(dim) % (2 * cp_size):
        raise ValueError(f"sequence length {t.size(dim)} is not a multiple of 2 x context-parallel size {cp_size}")
    chunks = t.chunk(2 * cp_size, dim=dim)
    a, b = cp_chunk_indices(cp_rank, cp_size)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The full sequence from every rank's shard (``shards[r]`` of rank ``r``), inverse of
    :func:`shard_sequence`."""
    c = len(shards)
    parts: list[Optional[torch.Tensor]] = [None] * (2 * c)
    for r, t in enumerate(shards):
        first, second = t.chunk(2, dim=dim)
        a, b = cp_chunk_indices(r, c)
        parts[a], parts[b] = first, second
    return torch.cat(parts, dim=dim)


__all__ = ["CPTimeoutError", "RingSDPACoreAttention", "cp_chunk_indices", "ring_attention", "shard_sequence",
           "unshard_sequence"]
