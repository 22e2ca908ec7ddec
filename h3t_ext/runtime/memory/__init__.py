"""Memory: where saved activations live (activation manager, device layer, pinned host pool).

Middle floor of the runtime: may import ``h3t_ext.runtime.modules`` (recompute recipes) and
``h3t_ext.runtime.config``; never ``h3t_ext.runtime.pipeline``.
"""
