"""Runtime: pipeline schedules with fractional activation offload and recompute (torch)."""
