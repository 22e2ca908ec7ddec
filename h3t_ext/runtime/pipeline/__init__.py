"""Pipeline: executes the schedule builder's action lists (schedules, P2P, model preparation, install).

Top floor of the runtime: may import ``h3t_ext.runtime.memory``, ``h3t_ext.runtime.modules``,
``h3t_ext.runtime.config`` and ``h3t_ext.schedule``; nothing in the runtime imports it.
"""
