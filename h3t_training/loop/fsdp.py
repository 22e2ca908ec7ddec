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
``--fp16``.

Checkpoints. ``--save`` writes each rank's
DTensor shards, not gathered, as ShardedTensors at their global offsets through the same ``dist_checkpointing``
path (:func:`sharded_state_dict`): before the wrap, :func:`wrap_chunks` records the chunk's own
``sharded_state_dict()`` (megatron-core's keys, tensor-parallel offsets and factories, exactly what a run without
FSDP2 writes and reads), each ShardedTensor as the rows [start, stop) of its whole (tensor-parallel-local) parameter
it covers (:class:`RowPiece`; a SwiGLU ``linear_fc1`` is two, its W and V halves). FSDP2 shards dim 0 as
``torch.chunk``: this rank holds rows [r*ceil(n/d), ...) of each parameter; at a save every piece is cut to those
rows, its global offset moved by as much, its replica id the main data-parallel one (each rank writes its own rows),
its grid marked irregular (``axis_fragmentations=None``: dim 0 need not divide by d; ``torch.distributed.checkpoint``
checks the coverage); Adam's moments are cut as their parameter (:func:`pieces_of`, over :func:`piece_index`: the
pieces by the storage they view, built once per save, so a save costs O(P) in the number of parameters P, not a scan
of all entries for each). The cost: no extra memory (the
pieces are views of the local shards) and no communication beyond ``dist_checkpointing``'s metadata exchange;
gathering with ``full_tensor()`` and writing one data-parallel replica instead would hold, at every save, the whole
parameters and both moments on each rank (3x the state FSDP2 keeps there, divided by d) and all-gather them. The
DTensor branch of megatron-core 0.16.1's ``make_*sharded_tensor_for_checkpoint`` is not used: it labels the local
shard as fragment r of d (wrong when d does not divide dim 0), and its SwiGLU factory then splits this rank's rows
into W and V halves (rank 0 holds all of W at d=2), a permuted ``linear_fc1`` for any run that loads the checkpoint
without FSDP2. On a GPU ``--save`` stays refused: megatron-core's optimizer there maps its Adam state to one
ShardedTensor per parameter, not to the row pieces of FSDP2's shards.

``--load`` (CPU) reads after the wrap through the same state dict: the row pieces, views of this rank's local shards
and of local-size Adam buffers, are what ``dist_checkpointing.load`` is asked for, so each rank reads only its rows,
in place (torch.distributed.checkpoint copies the overlap of every stored chunk into them), and its peak host memory
is its shard, not the model (:func:`load_state`; the optimizer's moments become DTensors laid out as their
parameters, :func:`from_local_like`). Every entry loads this way, SwiGLU's ``linear_fc1`` included: its W and V
halves are separate pieces of the layout. Stored chunks need not match the pieces (any driver checkpoint, FSDP2's or
not, at any layout: torch.distributed.checkpoint reads overlaps). On a GPU the wrap records no layout and loads only
the model (loading the optimizer state there is refused): it is read whole before the wrap, which shards it.

Megatron FSDP (``MegatronFSDP``, ``megatron/core/distributed/fsdp``) cannot run on CPU: megatron-core 0.16.1's
adapter takes ``torch.cuda.current_device()`` as its device and builds its device meshes with device type "cuda",
and ``MegatronFSDP.__init__`` creates ``torch.cuda.Stream``s; its flags are refused on the CPU path in one line.
On a GPU the driver wraps each chunk in megatron-core's ``FullyShardedDataParallel`` adapter, as Megatron-LM's
``get_model`` does (``loop/gpu_wrap.py``; the rules it runs under: ``config/feature_checks.check_megatron_fsdp``).
``--data-parallel-sharding-strategy no_shard`` (Megatron-LM's default in 0.16 and 0.17; from 0.18 it is
``optim_grads_params``, which a GPU run left without the flag takes: :mod:`h3t_training.megatron_release`) means no
sharding and is accepted.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Iterator, Optional

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
        reshard_after_forward=args.torch_fsdp2_reshard_after_forward,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad)
    layouts = [None if on_gpu else row_layout(c) for c in chunks]  # before fully_shard replaces the parameters
    with _mesh_device("cuda" if on_gpu else "cpu"):
        wrapped = [TorchFullyShardedDataParallel(config=config, ddp_config=ddp_config, module=c,
                                                 process_group=process_group, **kwargs) for c in chunks]
    for w, layout in zip(wrapped, layouts):
        w.h3t_row_layout = layout
    return wrapped


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds of a DTensor, else ``t``."""
    return t.to_local() if is_dtensor(t) else t


# ----------------------------------------------------------------------------------------- checkpoints
@dataclass(frozen=True)
class RowPiece:
    """One of the ShardedTensors a run without FSDP2 writes for a parameter (without its data): it holds the rows
    [start, stop) (dim 0) of the whole tensor-parallel-local parameter."""

    template: object
    """megatron-core's ShardedTensor, ``data=None``."""
    start: int
    stop: int


def _leaves(tree, path=()) -> Iterator[tuple[tuple, object]]:
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else None
    if items is None:
        yield path, tree
        return
    for k, v in items:
        yield from _leaves(v, (*path, k))


def _first_row(view: torch.Tensor, whole: torch.Tensor) -> Optional[int]:
    """The row of ``whole`` where ``view`` (a block of whole rows of it) starts, else None."""
    if view.dim() != whole.dim() or view.dim() == 0 or view.numel() == 0 or \
            view.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr() or \
            tuple(view.shape[1:]) != tuple(whole.shape[1:]) or view.stride() != whole.stride():
        return None
    offset = view.storage_offset() - whole.storage_offset()
    row = whole.stride(0)
    if offset < 0 or offset % row or offset // row + view.shape[0] > whole.shape[0]:
        return None
    return offset // row


def row_layout(chunk) -> dict[tuple, tuple[str, tuple[RowPiece, ...]]]:
    """For each parameter entry of ``chunk.sharded_state_dict()`` (its path in that dict) before the wrap: the
    parameter's name and its :class:`RowPiece` s (a factory, e.g. SwiGLU's, built into its ShardedTensors)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    names = {(p.data_ptr(), tuple(p.shape)): n for n, p in chunk.named_parameters()}
    layout = {}
    for path, leaf in _leaves(chunk.sharded_state_dict()):
        if not isinstance(leaf, (ShardedTensor, ShardedTensorFactory)) or leaf.data is None:
            continue
        whole = leaf.data
        name = names.get((whole.data_ptr(), tuple(whole.shape)))
        if name is None:
            continue
        built = leaf.build() if isinstance(leaf, ShardedTensorFactory) else leaf
        pieces = []
        for _, sh in _leaves(built):
            start = _first_row(sh.data, whole)
            if start is None:
                raise RuntimeError(f"FSDP2 save: {sh.key} is not a block of rows of parameter {name}")
            pieces.append(RowPiece(replace(sh, data=None), start, start + sh.local_shape[0]))
        layout[path] = (name, tuple(pieces))
    return layout


def _main_replica(replica_id):
    """Every data-parallel rank writes its own rows: the data-parallel part of the replica id (the last) is 0."""
    return replica_id[:-1] + (0,) if isinstance(replica_id, tuple) else 0


def _cut(pieces: tuple[RowPiece, ...], param) -> list:
    """The pieces of ``param`` (a DTensor sharded on dim 0) that fall in the rows this rank holds, as ShardedTensors
    over views of its local shard."""
    from torch.distributed.tensor import Shard

    assert tuple(param.placements) == (Shard(0),), param.placements
    shard = param.to_local()
    n, d, r = param.shape[0], param.device_mesh.size(), param.device_mesh.get_local_rank()
    first = min(r * -(-n // d), n)  # torch.chunk's rows: ceil(n/d) per rank, the last ones fewer (or none)
    last = first + shard.shape[0]
    assert last == min(first - (-n // d), n), (n, d, r, tuple(shard.shape))
    out = []
    for piece in pieces:
        lo, hi = max(first, piece.start), min(last, piece.stop)
        if lo >= hi:
            continue
        t = piece.template
        k = t.prepend_axis_num  # megatron-core's layer axis: held as leading axes of size 1 (same global tensor;
        offset = list(t.global_offset)  # DCP's chunks of an irregular grid have no prepended axes)
        offset[k] += lo - piece.start
        rows = shard[lo - first:hi - first]
        out.append(replace(t, data=rows.view(*(1,) * k, *rows.shape), local_shape=(*(1,) * k, *rows.shape),
                           global_offset=tuple(offset), axis_fragmentations=None, prepend_axis_num=0,
                           replica_id=_main_replica(t.replica_id)))
    return out


def is_fsdp2(chunk) -> bool:
    """Wrapped by :func:`wrap_chunks` on the CPU path (its checkpoint state comes from :func:`sharded_state_dict`)."""
    return getattr(chunk, "h3t_row_layout", None) is not None


def sharded_state_dict(chunk) -> dict:
    """The wrapped chunk's model state for ``dist_checkpointing.save``: megatron-core's ``sharded_state_dict()`` of
    the module, each parameter's entry replaced by this rank's rows of its pieces (a list, empty where it holds none
    of them)."""
    module = chunk.module
    sd = module.sharded_state_dict()
    params = dict(module.named_parameters())
    for path, (name, pieces) in chunk.h3t_row_layout.items():
        parent = sd
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = _cut(pieces, params[name])
    return sd


def load_state(chunk, loaded: dict) -> None:
    """Install in the wrapped ``chunk`` what ``dist_checkpointing.load`` read for :func:`sharded_state_dict`: each
    parameter's row pieces land in its local shard (the pieces are views of it, which torch.distributed.checkpoint
    reads into in place; a piece it returned elsewhere is copied there), the other entries (``_extra_state``) go
    through the module's ``load_state_dict``, strict: nothing but the parameters of the layout may be missing."""
    params = dict(chunk.module.named_parameters())
    rest = dict(loaded)
    for path, (name, pieces) in chunk.h3t_row_layout.items():
        parent = rest
        for k in path[:-1]:
            parent[k] = parent = dict(parent[k])
        got = parent.pop(path[-1])
        targets = _cut(pieces, params[name])
        if len(got) != len(targets):
            raise RuntimeError(f"FSDP2 load: {name} came back as {len(got)} pieces, {len(targets)} were asked")
        for t, g in zip(targets, got):
            if g.data_ptr() != t.data.data_ptr():
                t.data.copy_(g.view(t.data.shape))
    missing, unexpected = chunk.module.load_state_dict(rest, strict=False)
    expected = {name for name, _ in chunk.h3t_row_layout.values()}
    if unexpected or set(missing) != expected:
        raise RuntimeError(f"FSDP2 load: unexpected keys {sorted(unexpected)[:3]}, missing keys "
                           f"{sorted(set(missing) - expected)[:3]}")


def from_local_like(shard: torch.Tensor, param) -> torch.Tensor:
    """``shard`` (this rank's rows) as a DTensor laid out as ``param`` (no communication)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(shard, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def piece_index(model_sharded_state_dicts: list) -> dict[int, list]:
    """The ShardedTensors of :func:`sharded_state_dict` by the storage their data views (one pass over the state;
    every piece of a parameter is a view of its local shard, whose storage FSDP2 allocates per parameter), each
    list in the order of the state dicts; built once per save or load for :func:`pieces_of`."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    index: dict[int, list] = {}
    for sd in model_sharded_state_dicts:
        for _, sh in _leaves(sd):
            if isinstance(sh, ShardedTensor) and sh.data is not None and sh.data.numel() > 0:
                index.setdefault(sh.data.untyped_storage().data_ptr(), []).append(sh)
    return index


def pieces_of(index: dict[int, list], shard: torch.Tensor) -> list[tuple[object, slice]]:
    """The ShardedTensors of :func:`sharded_state_dict` (``index``: :func:`piece_index` of them) that hold rows of
    ``shard`` (a parameter's local shard), each with the rows of ``shard`` it holds (Adam's moments are cut the
    same way: ``moment[rows]`` viewed as the ShardedTensor's ``local_shape``). Only the ShardedTensors over
    ``shard``'s storage are looked at, so all parameters together cost O(P), not a scan of the P entries each."""
    out = []
    if shard.dim() == 0 or shard.numel() == 0:
        return out
    for sh in index.get(shard.untyped_storage().data_ptr(), ()):
        lead = sh.data.dim() - shard.dim()
        if lead >= 0 and all(n == 1 for n in sh.data.shape[:lead]):
            row = _first_row(sh.data.view(sh.data.shape[lead:]), shard)
            if row is not None:
                out.append((sh, slice(row, row + sh.data.shape[lead])))
    return out


__all__ = ["RowPiece", "from_local_like", "is_dtensor", "is_fsdp2", "load_state", "local", "piece_index", "pieces_of",
           "row_layout", "sharded_state_dict", "wrap_chunks"]
