"""Start-up of the runtime on one rank: layout validation, model checks, activation manager.

:func:`validate_layout` checks an :class:`H3TConfig` against the pipeline schedule it will run
and fails with one line (:class:`RuntimeConfigError`) on every rank alike, so no rank is left
waiting on a peer that gave up; :func:`validate_parallel_layout` does so for every rank of a
:class:`h3t_ext.layout.ParallelLayout` at once (the driver's check before any process group). The
layout rules themselves (sizes, divisibility, interleaving) are :mod:`h3t_ext.layout`'s.
:class:`ModelPreparer` checks once per model chunk that it was built for the chosen ``ckpt``
(ckpt=ours and the fused saves of ckpt=no come from the h3t layer spec the model was built with,
:mod:`h3t_ext.runtime.modules.layer_specs`, and so do the recomputed layers of ckpt=full; nothing is
transformed), and owns the activation manager of this stage.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ...layout import ParallelLayout
from ...schedule.builder import PipelineSchedule, build_schedule
from ...schedule.offload_overlap import overlap_refusal, schedule_can_offload
from ..config import H3TConfig, RuntimeConfigError

_PREPARED = "_h3t_prepared_ckpt"


def _validate_stage_alphas(config: H3TConfig, pipeline_size: int) -> list[float]:
    return [config.stage_alpha(r, pipeline_size) for r in range(pipeline_size)]


def _validate_overlap(config: H3TConfig, schedule: PipelineSchedule, alphas: list[float]) -> None:
    """The one overlap rule (:func:`h3t_ext.schedule.offload_overlap.overlap_refusal`, which the cost model applies
    to the plans it prices) on the lists this rank will run."""
    cfg = schedule.config
    reason = overlap_refusal(config.offload_alpha if isinstance(config.offload_alpha, (int, float)) else alphas,
                             schedule_can_offload(schedule),
                             pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
                             virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
                             num_microbatches=cfg.num_microbatches, layer_granular=cfg.layer_granular,
                             num_layers_per_chunk=cfg.num_layers_per_chunk)
    if reason is not None:
        raise RuntimeConfigError(reason)


def validate_layout(config: H3TConfig, schedule: PipelineSchedule, pipeline_rank: int) -> None:
    """Fail with one line when ``config`` cannot run with ``schedule`` (same verdict on all ranks).

    Forward-only calls (evaluation) are accepted with offload configured: nothing is kept for a
    backward, so they run without offload.
    """
    cfg = schedule.config
    assert 0 <= pipeline_rank < cfg.pipeline_model_parallel_size
    alphas = _validate_stage_alphas(config, cfg.pipeline_model_parallel_size)
    if cfg.forward_only or not config.offloads:
        return
    _validate_overlap(config, schedule, alphas)


def validate_parallel_layout(config: H3TConfig, layout: ParallelLayout, *,
                             num_layers_per_chunk: Optional[int] = None) -> None:
    """The runtime's verdict on a whole job before any process starts: the schedule of ``layout`` (the one
    every pipeline rank will run) and ``config``'s offload on each of its ranks, as :func:`validate_layout`
    checks them at the first call. ``num_layers_per_chunk`` (the model's layers per model chunk) makes the
    offload of pipeline size 1 layer-granular, as the runtime runs it. ``layout`` was checked when it was built
    (``LayoutError``); this raises :class:`RuntimeConfigError` (one line) for what the runtime adds."""
    p = layout.pipeline_model_parallel_size
    schedule = build_schedule(p, layout.num_microbatches, layout.virtual_pipeline_model_parallel_size,
                              microbatch_group_size_per_vp_stage=layout.microbatch_group_size_per_vp_stage,
                              offload_alphas=_validate_stage_alphas(config, p),
                              num_layers_per_chunk=num_layers_per_chunk)
    for rank in range(layout.pipeline_model_parallel_size):
        validate_layout(config, schedule, rank)


def _default_manager_factory(config: H3TConfig, pipeline_rank: int, pipeline_size: int, device: torch.device):
    needs = config.stage_alpha(pipeline_rank, pipeline_size) > 0 or config.ckpt == "ours"
    try:
        from ..memory.activations import build_activation_manager
    except ImportError as exc:
        if needs:
            raise RuntimeConfigError(
                f"--offload-alpha/--ckpt ours need h3t_ext.runtime.memory.activations, which is not available: {exc}"
            ) from exc
        return None
    return build_activation_manager(config, pipeline_rank, pipeline_size, device)


def _check_built_for(model_chunks: list, ckpt: str) -> None:
    from ..modules.layer_specs import check_built_for

    check_built_for(model_chunks, ckpt)


class ModelPreparer:
    """Checks each model chunk once against ``ckpt`` and keeps one
    activation manager per stage."""

    def __init__(self, config: H3TConfig, *, manager_factory: Optional[Callable] = None):
        self.config = config
        self.manager_factory = manager_factory or _default_manager_factory
        self._managers: dict[tuple, object] = {}

    def manager(self, pipeline_rank: int, pipeline_size: int, device: torch.device):
        """The activation manager of this stage (None when neither offload nor ckpt=ours is on)."""
        key = (pipeline_rank, pipeline_size, str(device))
        if key not in self._managers:
            self._managers[key] = self.manager_factory(self.config, pipeline_rank, pipeline_size, device)
        return self._managers[key]

    def layers_per_chunk(self, model_chunks: list) -> int:
        """Transformer layers of the (one) model chunk of pipeline size 1, for layer-granular offload. Raises
        :class:`RuntimeConfigError` (one line) when its layers do not say where their forward starts (a model
        not built with the h3t layer spec)."""
        from ..modules.layer_boundary import count_layers, marks_layer_starts

        if not marks_layer_starts(model_chunks):
            raise RuntimeConfigError(
                "--offload-alpha > 0 at --pipeline-model-parallel-size 1 offloads layer by layer: build the model "
                "with h3t_ext.runtime.modules.layer_specs.h3t_layer_spec, whose layers mark where they start")
        return count_layers(model_chunks[0])

    @property
    def managers(self) -> list:
        """The activation managers built so far (None entries where none was needed)."""
        return list(self._managers.values())

    def prepare(self, model_chunks: list, pipeline_rank: int, pipeline_size: int):
        """Check ``model_chunks`` for ``config.ckpt`` (once) and return this stage's manager.

        Raises :class:`RuntimeConfigError` (one line) when they were built for another ckpt."""
        device = next(model_chunks[0].parameters()).device
        mgr = self.manager(pipeline_rank, pipeline_size, device)
        todo = []
        for m in model_chunks:
            mark = getattr(m, _PREPARED, None)
            if mark is None:
                todo.append(m)
                continue
            ckpt, _owner = mark
            if ckpt != self.config.ckpt:
                raise RuntimeConfigError(
                    f"model was prepared for --ckpt {ckpt} by an earlier install(); build a fresh model for "
                    f"--ckpt {self.config.ckpt}"
                )
        if todo:
            self._transform(todo, mgr)
        return mgr

    def _transform(self, chunks: list, mgr) -> None:
        _check_built_for(chunks, self.config.ckpt)
        for m in chunks:
            object.__setattr__(m, _PREPARED, (self.config.ckpt, id(self)))


__all__ = ["ModelPreparer", "validate_layout", "validate_parallel_layout"]
