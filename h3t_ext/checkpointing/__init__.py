"""Checkpoint pieces that extend megatron-core's ``dist_checkpointing`` (see :mod:`.host_strategy`)."""
from h3t_ext.checkpointing.host_strategy import HostTorchDistSaveStrategy, save_strategy

__all__ = ["HostTorchDistSaveStrategy", "save_strategy"]
