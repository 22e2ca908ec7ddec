"""Runtime: pipeline schedules with fractional activation offload and recompute (torch).

Three floors over ``config``: ``pipeline`` (executes the builder's action lists) over ``memory`` (where
saved activations live) over ``modules`` (megatron-core modules through layer specs); a floor imports
only the floors below it.
"""
