"""Megatron's optimizer-parameter schedule: the learning rate and weight decay of every update.

Megatron-LM builds megatron-core's ``OptimizerParamScheduler`` from its flags (``get_optimizer_param_scheduler``)
and steps it *after* each successful optimizer step by the samples that iteration consumed. So the update of
iteration k runs with the schedule at ``num_steps`` = the samples of the successful updates before it (0 for the
first: with a warm-up that update runs at ``--lr-warmup-init``), an update skipped by the fp16 loss scaler does
not advance it, and the learning rate Megatron logs for iteration k is the one of the step after (the scheduler
has stepped by then). :class:`ParamSchedule` is that function of ``num_steps``; the training loop holds the count
(:func:`increment`, :func:`resumed_steps`), and a checkpoint saves it as the scheduler's ``num_steps``.

Learning rate (``--lr-decay-style``): linear warm-up from ``--lr-warmup-init`` over the warm-up steps, then
``constant``, ``linear`` or ``cosine`` decay to ``--min-lr`` over the decay steps, ``inverse-square-root``
(``lr * sqrt(warm-up / steps)``, not below ``--min-lr``), or ``WSD`` (warm-up, stable at ``--lr``, then the last
``--lr-wsd-decay-iters``/``-samples`` anneal to ``--min-lr`` as ``--lr-wsd-decay-style``: exponential, linear,
cosine or minus_sqrt); ``--min-lr`` after the decay steps. Weight decay (``--weight-decay-incr-style``): constant
``--weight-decay``, or from ``--start-weight-decay`` to ``--end-weight-decay`` (linear or cosine) over the
training's steps, applied to the parameter groups that decay (``wd_mult``: 0 for biases and norm weights).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

from h3t_training.data.batch_schedule import schedule_of


@dataclass(frozen=True)
class ParamSchedule:
    """The learning-rate and weight-decay schedule over ``num_steps`` (samples, or iterations for a schedule
    given in iterations without the driver's sample counts)."""

    max_lr: float
    min_lr: float
    init_lr: float
    warmup_steps: float
    """Whole samples (or iterations), or --lr-warmup-fraction x the decay span, a float as Megatron-LM's."""
    decay_steps: int
    decay_style: str = "linear"
    wsd_decay_steps: Optional[int] = None
    wsd_decay_style: str = "exponential"
    start_wd: float = 0.0
    end_wd: float = 0.0
    wd_incr_steps: int = 1
    wd_incr_style: str = "constant"

    @classmethod
    def from_args(cls, args) -> "ParamSchedule":
        """The schedule of a resolved driver config (its weight decay's start and end set, --weight-decay for a
        constant style): in samples where it has them (``lr_decay_steps``), else in iterations."""
        if args.lr_decay_steps is not None:
            warm, decay = args.lr_warmup_steps, args.lr_decay_steps
        else:
            warm, decay = args.lr_warmup_iters, args.lr_decay_iters
        return cls(max_lr=args.lr, min_lr=args.min_lr, init_lr=args.lr_warmup_init, warmup_steps=warm,
                   decay_steps=decay, decay_style=args.lr_decay_style, wsd_decay_steps=args.lr_wsd_decay_steps,
                   wsd_decay_style=args.lr_wsd_decay_style, start_wd=args.start_weight_decay,
                   end_wd=args.end_weight_decay, wd_incr_steps=args.wd_incr_steps or 1,
                   wd_incr_style=args.weight_decay_incr_style)

    def lr(self, num_steps: int, max_lr: Optional[float] = None, min_lr: Optional[float] = None) -> float:
        """The learning rate at ``num_steps``; ``max_lr``/``min_lr`` of a parameter group of its own
        (--decoupled-lr) replace --lr/--min-lr."""
        peak = self.max_lr if max_lr is None else max_lr
        floor = self.min_lr if min_lr is None else min_lr
        warm = self.warmup_steps
        if warm > 0 and num_steps <= warm:
            return self.init_lr + (peak - self.init_lr) * float(num_steps) / float(warm)
        if self.decay_style == "constant":
            return peak
        if num_steps > self.decay_steps:
            return floor
        if self.decay_style == "inverse-square-root":
            return max(floor, peak * max(warm, 1) ** 0.5 / max(num_steps, 1) ** 0.5)
        return floor + self._decay_coeff(num_steps) * (peak - floor)

    def _decay_coeff(self, num_steps: int) -> float:
        if self.decay_style == "WSD":
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if num_steps <= anneal_start:
                return 1.0
            ratio = float(num_steps - anneal_start) / float(self.wsd_decay_steps)
            return _wsd_coeff(self.wsd_decay_style, ratio)
        ratio = float(num_steps - self.warmup_steps) / float(self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            return 1.0 - ratio
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)  # cosine

    def wd(self, num_steps: int) -> float:
        """The weight decay at ``num_steps`` (of the groups that decay)."""
        if num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = float(num_steps) / float(self.wd_incr_steps)
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def apply(self, param_groups: Iterable[dict], num_steps: int) -> float:
        """Set every group's ``lr`` (its own ``max_lr``/``min_lr`` where it has them) and ``weight_decay``
        (times its ``wd_mult``, 1 where absent) for the update at ``num_steps``; returns the default group's
        learning rate."""
        for g in param_groups:
            g["lr"] = self.lr(num_steps, g.get("max_lr"), g.get("min_lr"))
            g["weight_decay"] = self.wd(num_steps) * g.get("wd_mult", 1.0)
        return self.lr(num_steps)


def _wsd_coeff(style: str, ratio: float) -> float:
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    return 1.0 - math.sqrt(ratio)  # minus_sqrt


def increment(args, iteration: int) -> int:
    """What a successful update of (0-based) ``iteration`` adds to ``num_steps``: the samples it consumed (its
    global batch), or 1 for a schedule counted in iterations."""
    if args.lr_decay_steps is None:
        return 1
    return schedule_of(args).batch_size(iteration)


def steps_before(args, iteration: int) -> int:
    """``num_steps`` before (0-based) ``iteration`` when no update was skipped."""
    if args.lr_decay_steps is None:
        return iteration
    return schedule_of(args).consumed_samples(iteration)


def resumed_steps(args, saved_scheduler: Optional[dict], iteration: int) -> int:
    """``num_steps`` a run starts from: 0 from scratch or with --finetune (Megatron loads no scheduler then); a
    checkpoint's own ``num_steps`` where it saved one (megatron-core's scheduler restores it whatever
    --override-opt_param-scheduler says), else the samples before its iteration."""
    if args.finetune or iteration == 0:
        return 0
    saved = (saved_scheduler or {}).get("num_steps")
    return int(saved) if saved is not None else steps_before(args, iteration)


__all__ = ["ParamSchedule", "increment", "resumed_steps", "steps_before"]
