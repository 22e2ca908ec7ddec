"""Megatron-LM's silent-data-corruption guards.

* ``--check-weight-hash-across-dp-replicas-interval N``: every N iterations, after the optimizer step, each rank
  hashes its weights (SHA-256 over every parameter's name and bytes); the ranks that hold replicas of the same
  weights (the same pipeline stage and tensor rank: the data-parallel ranks, context-parallel ones included)
  must agree. A bit that flipped in one replica's memory (or a step that went wrong on one device) shows as a
  mismatch: one line naming the iteration and the ranks, on every rank alike (rank 0 says it), exit status
  :data:`h3t_training.launch.failures.EXIT_SILENT_DATA_CORRUPTION`, before the iteration's checkpoint is written.
  Megatron-LM asserts the same (``check_param_hashes_across_dp_replicas``) at the same point of its loop.
* ``--rerun-mode``: Megatron-LM's default is ``validate_results`` (its rerun state machine re-executes an
  iteration's forward and backward, on the same device, then on another, when a result check fails, to tell a
  transient hardware fault from a persistent one or a bug; ``report_stats`` also reruns to measure the spread).
  This driver does not replay iterations: a non-finite loss or gradient norm stops the run instead
  (``--check-for-nan-in-loss-and-grad``, the default), so without a fault the run is the same. Given, either mode is a
  notice (``config.feature_checks.check_sdc_flags``); ``disabled`` is what the driver does.
"""
from __future__ import annotations

import hashlib


class WeightHashMismatchError(RuntimeError):
    """Data-parallel replicas hold different weights (raised on every rank alike; the message is one line)."""


def weight_digest(chunks) -> str:
    """SHA-256 of this rank's parameters (names and bytes, in module order)."""
    import torch

    from h3t_training.loop.checkpointing import unwrap

    h = hashlib.sha256()
    for i, chunk in enumerate(chunks):
        for name, p in unwrap(chunk).named_parameters():
            t = p.detach()
            t = getattr(t, "_local_tensor", t)  # a DTensor's shard (FSDP2 is refused; kept for safety)
            h.update(f"{i}.{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def mismatch_line(iteration: int, interval: int, digests: list[tuple[int, tuple, str]]) -> str | None:
    """The one line for ``digests`` ((global rank, replica key, digest) of every rank; the replica key names the
    weights a rank holds), or None when every replica agrees. Within a set of replicas the digest most ranks share
    is taken as the right one (the lowest rank's on a tie)."""
    groups: dict[tuple, list[tuple[int, str]]] = {}
    for rank, key, digest in sorted(digests):
        groups.setdefault(key, []).append((rank, digest))
    parts = []
    for key, members in sorted(groups.items()):
        by_digest: dict[str, list[int]] = {}
        for rank, digest in members:
            by_digest.setdefault(digest, []).append(rank)
        if len(by_digest) == 1:
            continue
        ref = max(by_digest.values(), key=lambda ranks: (len(ranks), -ranks[0]))
        odd = sorted(r for ranks in by_digest.values() if ranks is not ref for r in ranks)
        stage, tensor = key
        parts.append(f"pipeline stage {stage}, tensor rank {tensor}: rank{'s' if len(odd) > 1 else ''} "
                     f"{', '.join(map(str, odd))} hold{'' if len(odd) > 1 else 's'} other weights than rank"
                     f"{'s' if len(ref) > 1 else ''} {', '.join(map(str, ref))}")
    if not parts:
        return None
    return (f"iteration {iteration}: the weights differ across data-parallel replicas "
            f"(--check-weight-hash-across-dp-replicas-interval {interval}): {'; '.join(parts)}; stopped before "
            f"saving (silent data corruption: check the hardware of the ranks named)")


def check_weight_hashes(args, chunks, iteration: int) -> None:
    """Collective (every rank): raise :class:`WeightHashMismatchError` when replicas disagree."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if args.overlap_param_gather:  # megatron-core DDP gathers the parameters in the next forward: finish it now
        for chunk in chunks:
            if hasattr(chunk, "disable_forward_pre_hook"):
                chunk.disable_forward_pre_hook(param_sync=True)
                chunk.enable_forward_pre_hook()
    mine = (dist.get_rank(), (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
            weight_digest(chunks))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    line = mismatch_line(iteration, args.check_weight_hash_across_dp_replicas_interval, everyone)
    if line is not None:
        raise WeightHashMismatchError(line)


__all__ = ["WeightHashMismatchError", "check_weight_hashes", "mismatch_line",
           "weight_digest"]
