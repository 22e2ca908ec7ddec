"""Pipeline schedules as data (pure Python, no torch)."""
from h3t_ext.schedule.builder import (
    COMM_KINDS,
    COMPUTE_KINDS,
    Action,
    ActionKind,
    PipelineSchedule,
    ScheduleConfig,
    build_rank_actions,
    build_schedule,
    offloaded_chunk_count,
    reload_counts,
    schedule_table,
)
from h3t_ext.schedule.actions import layer_offload_fractions, offloaded_layers
from h3t_ext.schedule.posting import posting_batches

__all__ = [
    "Action",
    "ActionKind",
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "PipelineSchedule",
    "ScheduleConfig",
    "build_rank_actions",
    "build_schedule",
    "layer_offload_fractions",
    "offloaded_chunk_count",
    "offloaded_layers",
    "posting_batches",
    "reload_counts",
    "schedule_table",
]
