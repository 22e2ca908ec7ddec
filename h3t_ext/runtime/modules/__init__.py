"""Modules: megatron-core modules through h3t layer specs (GPT model, attention, norms, MLPs, recompute).

Lowest floor of the runtime: may import ``h3t_ext.runtime.config`` and megatron-core only; never
``h3t_ext.runtime.memory`` or ``h3t_ext.runtime.pipeline``.
"""
