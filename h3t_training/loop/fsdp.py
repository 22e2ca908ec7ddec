"""Sharded data parallelism: torch FSDP2 (``--use-torch-fsdp2``) through megatron-core's
``TorchFullyShardedDataParallel``, and Megatron FSDP's flags (``--use-megatron-fsdp``,
``--data-parallel-sharding-strategy``), refused in one line.

Torch FSDP2. Each model chunk is wrapped as Megatron-LM's ``get_model`` wraps it: megatron-core 0.16.1's
``TorchFullyShardedDataParallel`` with a ``TorchFullyShardedDataParallelConfig(reshard_after_forward=...)``
(``--torch-fsdp2-no-reshard-after-forward`` keeps the gathered parameters from forward to backward). That wrapper
calls ``fully_shard`` on every TransformerLayer, the embedding, the rotary embedding (and the output layer with
TransformerEngine; on CPU the layers' linears are megatron-core's local ColumnParallelLinears, so the set is the one
megatron-core uses for ``transformer_impl='local'``), then on the chunk, over the data-parallel group (context ranks included): every parameter
becomes a DTensor holding one dim-0 shard per data-parallel rank, gathered just in time in forward and backward;
gradients arrive reduce-scattered (averaged over the group) into the same shards. megatron-core builds its device
mesh with device type "cuda"; on the CPU path (gloo) :func:`wrap_chunks` builds the same wrapper with a "cpu"
mesh (``torch.distributed.fsdp.fully_shard`` trains on CPU with torch 2.13).

The optimizer then runs over the DTensor parameters, as Megatron-LM's (it builds megatron-core's optimizer over
the wrapped chunks, never the distributed optimizer): on a GPU megatron-core's ``get_megatron_optimizer``; on CPU
:class:`~h3t_training.loop.optimizer.DataParallelAdamW` with ``fsdp=True`` (no gradient all-reduce: the shards are
reduced already; the gradient norm sums the local shards over the data-parallel group; AdamW steps the shards).

Megatron-LM's rules for ``--use-torch-fsdp2`` (its ``arguments.py``) are one-line refusals here: no pipeline
parallelism, no distributed optimizer (so no optimizer CPU offload), untied embedding and output weights, no
``--fp16``. The driver's checkpoint code writes whole-parameter state: ``--load`` is read into the model and a
whole-parameter optimizer before the wrap, which then shards both (:func:`shard_optimizer_state`; on a GPU only the
model: loading the optimizer state there is refused); ``--save`` is refused.

Megatron FSDP (``MegatronFSDP``, ``megatron/core/distributed/fsdp``) cannot run on CPU: megatron-core 0.16.1's
adapter takes ``torch.cuda.current_device()`` as its device and builds its device meshes with device type "cuda",
and ``MegatronFSDP.__init__`` creates ``torch.cuda.Stream``s; this driver does not wire it on a GPU either, so
its flags are refused everywhere (``--data-parallel-sharding-strategy no_shard``, Megatron-LM's default, means
no sharding and is accepted).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def _mesh_device(device_type: str) -> Iterator[None]:
    """megatron-core's wrapper with its device mesh on ``device_type`` (it names "cuda"; "cpu" on the CPU path)."""
    from megatron.core.distributed import torch_fully_sharded_data_parallel as tfsdp
    from torch.distributed import DeviceMesh

    if device_type == "cuda":
        yield
        return

    class _Mesh:
        @staticmethod
        def from_group(group, _device_type, *a, **kw):
            return DeviceMesh.from_group(group, device_type, *a, **kw)

    saved = tfsdp.DeviceMesh
    tfsdp.DeviceMesh = _Mesh
    try:
        yield
    finally:
        tfsdp.DeviceMesh = saved


def wrap_chunks(args, chunks, *, on_gpu: bool, process_group=None) -> list:
    """Each chunk wrapped in megatron-core's ``TorchFullyShardedDataParallel`` (its parameters become DTensor
    shards over the data-parallel group with context ranks, or ``process_group``)."""
    from megatron.core.distributed import TorchFullyShardedDataParallel
    from megatron.core.distributed.torch_fully_sharded_data_parallel_config import (
        TorchFullyShardedDataParallelConfig)

    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer

    config = chunks[0].config
    kwargs = {}
    if not on_gpu:  # the local backend's linears are ColumnParallelLinears inside the layers: megatron-core's set
        kwargs["sub_modules_to_wrap"] = {TransformerLayer, LanguageModelEmbedding, RotaryEmbedding}  # for 'local'
    ddp_config = TorchFullyShardedDataParallelConfig(
        reshard_after_forward=not args.torch_fsdp2_no_reshard_after_forward,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad)
    with _mesh_device("cuda" if on_gpu else "cpu"):
        wrapped = [TorchFullyShardedDataParallel(config=config, ddp_config=ddp_config, module=c,
                                                 process_group=process_group, **kwargs) for c in chunks]
    return wrapped


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds of a DTensor, else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def shard_like(full: torch.Tensor, param) -> torch.Tensor:
    """``full`` (a whole-parameter tensor every rank holds) as a DTensor laid out as ``param``; each rank keeps its
    own shard (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def shard_optimizer_state(whole, sharded, names_whole: list[str], names_sharded: list[str]) -> None:
    """Move a whole-parameter :class:`~h3t_training.loop.optimizer.DataParallelAdamW`'s Adam state (read from a
    checkpoint before the wrap) into the FSDP2 one, each moment sharded as its parameter (matched by name)."""
    by_name = dict(zip(names_whole, whole.params))
    sharded.steps = whole.steps
    for name, p in zip(names_sharded, sharded.params):
        held = whole.adam.state.get(by_name[name])
        if not held:
            continue
        sharded.adam.state[p] = {"step": held["step"].clone(),
                                 **{k: shard_like(held[k], p) for k in ("exp_avg", "exp_avg_sq")}}


__all__ = ["is_dtensor", "local", "shard_like",
           "shard_optimizer_state", "wrap_chunks"]
