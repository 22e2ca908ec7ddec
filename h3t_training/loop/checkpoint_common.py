"""What this driver's checkpoint modules share: the fields a resume checks and the one-line error.

:mod:`h3t_training.loop.checkpointing` (torch_dist, and the checks of ``--load``),
:mod:`h3t_training.loop.legacy_checkpoint` (``--ckpt-format torch``) and :mod:`h3t_training.loop.megatron_written`
(checkpoints Megatron-LM wrote) import them from here; ``checkpointing`` re-exports them.
"""
from __future__ import annotations

CHECKPOINT_VERSION = 3.0
"""Megatron-LM's checkpoint version for dist_checkpointing checkpoints."""
WRITTEN_BY = "megatron_lm"
"""The key of a common part derived from a checkpoint Megatron-LM wrote
(:func:`h3t_training.loop.megatron_written.megatron_written_common`)."""
MODEL_SHAPE_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "tokenizer_type", "vocab_size")
"""What must match between the saving and the loading run (the parallel layout need not), with the padded
vocabulary (``--make-vocab-size-divisible-by`` x t rounds the tokenizer's up): the flag itself may differ."""
MODEL_SWITCH_FLAGS = ("qk_layernorm", "squared_relu")
"""Switches of the model's structure that must match too; a checkpoint that predates one (no such field) was saved
without it. A load reads only the tensors the run's model asks for, so a checkpoint with q/k norms would otherwise
lose them silently in a run without; the MLP activation has no tensor of its own to tell."""
MODEL_WINDOW_FLAGS = ("window_size", "window_attn_skip_freq")
"""The sliding window (--window-size, --window-attn-skip-freq) must match by value: a windowed checkpoint resumed
without the window (or with another) would train another model on the same tensors. A checkpoint that predates the
fields was saved without a window."""


def window_values(ns) -> dict:
    """The window fields of a run's flags or of Megatron-LM's saved args, comparable: lists for tuples, and no
    frequency without a window (Megatron-LM's no-op)."""
    size = getattr(ns, "window_size", None)
    freq = getattr(ns, "window_attn_skip_freq", None) if size is not None else None
    return {"window_size": None if size is None else [int(v) for v in size],
            "window_attn_skip_freq": [int(v) for v in freq] if isinstance(freq, (list, tuple)) else freq}


LAYOUT_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "context_parallel_size", "data_parallel_size", "world_size", "use_distributed_optimizer")
SCHEDULE_FLAGS = ("lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_decay_iters", "weight_decay", "decoupled_lr",
                  "decoupled_min_lr", "start_weight_decay", "end_weight_decay", "weight_decay_incr_style")
"""The learning-rate and weight-decay schedule a resumed run must agree on (Megatron's opt_param_scheduler checks
the weight decay's start, end and style too; a constant style's start and end are --weight-decay, as Megatron-LM
sets them). A checkpoint that predates a field is not checked on it."""
SCHEDULE_STEPS = ("lr_warmup_steps", "lr_decay_steps")
"""The warm-up and the decay in samples, as megatron-core's ``OptimizerParamScheduler`` checks a resume (its
``lr_warmup_steps``/``lr_decay_steps``: ``--lr-*-iters`` x ``--global-batch-size``, or ``--lr-*-samples``). Where the
checkpoint and the run both have them they are compared instead of ``lr_warmup_iters``/``lr_decay_iters``: a
sample-based run resumed at another batch keeps its schedule, an iteration-based one changes it (Megatron-LM
refuses that without ``--override-opt_param-scheduler`` or ``--use-checkpoint-opt_param-scheduler``)."""


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message is one line. ``alike``: every rank finds it alike (the
    tracker, the shared ``common.pt`` and what it says of the model), so rank 0 alone reports it."""

    def __init__(self, message: str, *, alike: bool = False):
        super().__init__(message)
        self.alike = alike


__all__ = ["CHECKPOINT_VERSION", "CheckpointError", "LAYOUT_FLAGS", "MODEL_SHAPE_FLAGS", "MODEL_SWITCH_FLAGS",
           "MODEL_WINDOW_FLAGS", "window_values",
           "SCHEDULE_FLAGS", "SCHEDULE_STEPS", "WRITTEN_BY"]
