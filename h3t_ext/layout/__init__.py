"""The parallel layout of a Megatron job and every rule on it, in one place.

A :class:`ParallelLayout` is the tensor, context, pipeline, virtual-pipeline and data-parallel
sizes plus the microbatches per iteration, under Megatron's names. Its rules are those Megatron-LM
and megatron-core 0.16.1 enforce:

* the world size is t x c x p x d (``args.data_parallel_size = world_size // (t p c)``);
* the global batch is a whole number of micro batches per data-parallel rank
  (``num_microbatches = global_batch_size // (micro_batch_size x d)``);
* the layers split evenly over the p pipeline ranks (or, with uneven first/last stages, the rest
  splits evenly over the middle ranks; with --account-for-embedding/loss-in-pipeline-split the embedding
  and the loss count as one layer each), and over the v model chunks of each rank (:class:`PipelineSplit`,
  megatron-core's ``get_num_layers_to_build`` / ``get_transformer_layer_offset``);
* or, with megatron-core's ``--pipeline-model-parallel-layout`` (a string such as ``Ett|(tt|)*6tL``: one
  ``|``-separated stage per pipeline rank and model chunk, 'E' the embedding, 't' a transformer layer, 'L' the loss),
  each model chunk's layers as written (:func:`parse_pipeline_layout`, megatron-core's
  ``PipelineParallelLayerLayout``);
* interleaving (v > 1) needs p > 1 and megatron-core's microbatch grouping of
  ``forward_backward_pipelining_with_interleaving``: with ``microbatch_group_size_per_vp_stage`` g
  (default p), p <= g <= m and m mod g is 0 or >= p (so with the default, m a multiple of p);
* the tensor-parallel split: t divides the attention heads, the query groups and the MLP columns;
* the sequence split: with c > 1 the sequence is 2c equal chunks, and with sequence parallelism each
  context shard splits over t (s a multiple of c x t).

Every broken rule raises :class:`LayoutError` with one line naming the Megatron flag(s) and the
valid values. The cost model (``h3t_ext.costmodel.plan``), the schedule builder
(``h3t_ext.schedule.builder``), the runtime (``h3t_ext.runtime.pipeline.schedules``) and the driver take their
verdicts from here, so a layout one of them refuses is refused by all with the same reason.

This package imports nothing from the rest of h3t_ext (no cycles; pure arithmetic): :mod:`.rules` holds
:class:`LayoutError` and the checks both parts apply, :mod:`.pipeline_split` the layer split and the layout
strings, :mod:`.parallel` the :class:`ParallelLayout`.
In formulas t, c, p, v, d, m are the six sizes; public names are Megatron's.
"""
from h3t_ext.layout.parallel import ParallelLayout
from h3t_ext.layout.pipeline_split import (LAYOUT_FLAG, PipelineSplit, layout_stage_count, parse_pipeline_layout,
                                           pipeline_split, virtual_pipeline_size)
from h3t_ext.layout.rules import RULES, LayoutError

__all__ = ["LAYOUT_FLAG", "RULES", "LayoutError", "ParallelLayout", "PipelineSplit", "layout_stage_count",
           "parse_pipeline_layout", "pipeline_split", "virtual_pipeline_size"]
