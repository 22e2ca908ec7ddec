"""torch FSDP2 checkpoints that scale with the number of parameters and the data-parallel size, in gloo worlds of
2 and 3 ranks (3: dim 0 of every parameter uneven, 64 rows are 22, 22, 20) over the driver's own model, wrap,
optimizer, save and load.

- ``fsdp.pieces_of`` (through ``fsdp.piece_index``) gives for every parameter's local shard exactly the pieces its
  row layout must give: the layout's pieces (megatron-core's keys and offsets, SwiGLU's two halves) that overlap the
  rows ``torch.chunk`` gives the rank, in layout order, each with the rows of the shard it covers.
- The load reads only this rank's rows: every model ShardedTensor handed to ``dist_checkpointing.load`` is a view
  of this rank's local shard of its parameter and is read in place (no tensor is allocated for it, none is whole;
  SwiGLU's ``linear_fc1`` comes as its two halves' pieces, no factory), the model entries
  together hold exactly the local shards' elements and the Adam entries twice that; what it loads equals, bit for
  bit, the shards and moments that were saved."""
from __future__ import annotations

import pytest

from driver_harness import TINY_MODEL
from h3t_ext.testing import run_distributed


def _argv(directory: str) -> list[str]:
    return [*TINY_MODEL, "--micro-batch-size", "1", "--global-batch-size", "6", "--train-iters", "2",
            "--make-vocab-size-divisible-by", "256", "--mock-data", "--use-torch-fsdp2", "--save", directory,
            "--load", directory]


def _expected_pieces(pieces, param) -> list[tuple]:
    """What the layout must give for this rank's shard of ``param``: (key, global offset, rows of the shard)."""
    n, d, r = param.shape[0], param.device_mesh.size(), param.device_mesh.get_local_rank()
    first = min(r * -(-n // d), n)
    last = first + param.to_local().shape[0]
    out = []
    for piece in pieces:
        lo, hi = max(first, piece.start), min(last, piece.stop)
        if lo < hi:
            offset = list(piece.template.global_offset)
            offset[piece.template.prepend_axis_num] += lo - piece.start
            out.append((piece.template.key, tuple(offset), lo - first, hi - first))
    return out


def _fake_step(optimizer, seed: int) -> None:
    """One AdamW step on seeded gradients (the moments become nonzero and differ per parameter)."""
    import torch

    from h3t_training.loop.fsdp import from_local_like, local

    g = torch.Generator().manual_seed(seed)
    for p in optimizer.params:
        p.grad = from_local_like(torch.randn(local(p).shape, generator=g), p)
    optimizer.step(0, 0)


def _worker(rank: int, world_size: int, directory: str) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from h3t_training.config.sections import parse_args
    from h3t_training.data.tokenizer import tokenizer_from_args
    from h3t_training.loop import checkpointing as ckpt_io
    from h3t_training.loop import fsdp, training
    from h3t_training.loop.model_provider import build_model_chunks

    args = parse_args(_argv(directory), world_size=world_size, rank=rank)
    ps.initialize_model_parallel()
    vocab = tokenizer_from_args(args).vocab_size
    chunks, optimizer = training._build_optimizer(args, build_model_chunks(args, on_gpu=False, vocab_size=vocab),
                                                  on_gpu=False)
    _fake_step(optimizer, 100 + rank)

    # pieces_of against the layout
    index = fsdp.piece_index([fsdp.sharded_state_dict(c) for c in chunks])
    swiglu_halves = 0
    for chunk in chunks:
        params = dict(chunk.module.named_parameters())
        for name, pieces in chunk.h3t_row_layout.values():
            p = params[name]
            got = [(sh.key, tuple(sh.global_offset), rows.start, rows.stop)
                   for sh, rows in fsdp.pieces_of(index, fsdp.local(p))]
            want = _expected_pieces(pieces, p)
            assert got == want and (want or fsdp.local(p).numel() == 0), (name, got, want)
            swiglu_halves += len(pieces) == 2
    assert swiglu_halves == 4  # one linear_fc1 per layer, its W and V halves

    ckpt_io.save_checkpoint(args, 2, chunks, optimizer, on_gpu=False)
    saved_params = [fsdp.local(p).clone() for p in optimizer.params]
    saved_moments = [{k: fsdp.local(optimizer.adam.state[p][k]).clone() for k in ("exp_avg", "exp_avg_sq")}
                     for p in optimizer.params]

    requested = {}
    real_load = dist_checkpointing.load

    def spy(template, *a, **kw):
        for part in ("model", "optimizer"):
            requested[part] = [sh for _, sh in fsdp._leaves(template[part])
                               if isinstance(sh, (ShardedTensor, ShardedTensorFactory))]
        requested["result"] = real_load(template, *a, **kw)
        return requested["result"]

    found = ckpt_io.find_checkpoint(args, rank=rank)
    fresh = build_model_chunks(args.replace(seed=args.seed + 1), on_gpu=False, vocab_size=vocab)
    dist_checkpointing.load = spy
    try:
        loaded, opt2, start, _ = training._build_and_load(args, fresh, found, on_gpu=False)
    finally:
        dist_checkpointing.load = real_load
    assert start == 2 and opt2.steps == optimizer.steps == 1

    shards = [fsdp.local(p) for p in opt2.params]
    storages = {s.untyped_storage().data_ptr(): s for s in shards}
    model = requested["model"]
    assert model and all(isinstance(sh, ShardedTensor) for sh in model)  # no factory: SwiGLU's halves are pieces
    for sh in model:
        shard = storages.get(sh.data.untyped_storage().data_ptr())
        assert shard is not None, f"{sh.key}: read into a tensor that is not this rank's shard"
        assert sh.data.numel() <= shard.numel(), (sh.key, tuple(sh.data.shape), tuple(shard.shape))
    read = [t for _, t in fsdp._leaves(requested["result"]["model"]) if isinstance(t, torch.Tensor)]
    assert len(read) == len(model) and all(t.untyped_storage().data_ptr() in storages for t in read)  # in place
    local_elements = sum(s.numel() for s in shards)
    assert sum(sh.data.numel() for sh in model) == local_elements
    assert sum(sh.data.numel() for sh in requested["optimizer"]) == 2 * local_elements

    for p, want_p, want_m in zip(opt2.params, saved_params, saved_moments):
        assert torch.equal(fsdp.local(p), want_p)
        for k in ("exp_avg", "exp_avg_sq"):
            got = opt2.adam.state[p][k]
            assert fsdp.is_dtensor(got) and got.placements == p.placements and got.shape == p.shape
            assert torch.equal(fsdp.local(got), want_m[k]) and want_m[k].abs().sum() > 0
    ps.destroy_model_parallel()
    return local_elements


@pytest.mark.parametrize("world_size", [2, 3], ids=["d2", "d3-uneven"])
def test_fsdp2_pieces_follow_the_layout_and_the_load_reads_only_this_ranks_rows(world_size, tmp_path):
    local_elements = run_distributed(_worker, world_size, args=(str(tmp_path),), timeout_s=300)
    assert len(set(local_elements)) == (1 if world_size == 2 else 2)  # d=3: the last rank holds fewer rows
