"""Vocabulary-parallel cross entropy computed in the logits' own dtype (float64 runs).

megatron-core's ``vocab_parallel_cross_entropy`` casts the logits to float32 before the softmax, which is
right for bf16/fp16/fp32 training and caps a float64 run at float32 precision: a float64 comparison of
layouts (``--h3t-float64``) could then not tell roundoff from a bug. This is the same computation kept in
the logits' dtype: over the tensor-parallel group, the running max, the sum of exponentials and the
target's logit are all-reduced; the backward is ``softmax - one_hot(target)`` on this rank's vocabulary
slice, times the incoming gradient. :class:`~h3t_ext.runtime.modules.gpt.H3TGPTModel` uses it for float64
logits only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """logits [s, b, V/t] (this rank's vocabulary slice), target [s, b] -> per-token loss [s, b]."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group):
        rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
        part = logits.size(-1)
        first = rank * part
        logits_max = _all_reduce(logits.detach().amax(dim=-1), dist.ReduceOp.MAX, group)
        shifted = logits.detach() - logits_max.unsqueeze(-1)
        local = (target >= first) & (target < first + part)
        index = torch.where(local, target - first, torch.zeros_like(target))
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * local
        target_logit = _all_reduce(target_logit, dist.ReduceOp.SUM, group)
        exp = shifted.exp()
        sum_exp = _all_reduce(exp.sum(dim=-1), dist.ReduceOp.SUM, group)
        loss = sum_exp.log() - target_logit
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), index, local)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, index, local = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, index.unsqueeze(-1), -local.to(grad.dtype).unsqueeze(-1))
        return grad.mul_(grad_loss.unsqueeze(-1)), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group) -> torch.Tensor:
    """Per-token cross entropy of vocabulary-parallel ``logits`` ([s, b, V/t], rank r holding columns
    ``r V/t .. (r+1) V/t``) against ``target`` ([s, b] token ids), in the logits' dtype."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group)


__all__ = ["vocab_parallel_cross_entropy"]
