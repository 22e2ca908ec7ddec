#!/usr/bin/env python
"""Save and load time of a torch FSDP2 (``--use-torch-fsdp2``) checkpoint on CPU, and what its load requests.

Every rank of a gloo world builds the driver's Llama-shaped model (``--num-layers`` layers: 6 parameters each, so
a deep model has many parameters), wraps it in FSDP2 as the driver does, builds the CPU optimizer, then:

- ``pieces_s``: the optimizer's ``sharded_state_dict`` over the model's (each Adam moment cut into the row pieces
  of its parameter's local shard: ``h3t_training.loop.fsdp.pieces_of``), the part of a save that grows with the
  number of parameters P;
- ``save_s``: the whole ``save_checkpoint`` (collective; the files on a temporary directory);
- ``load_s``: the driver's load of that checkpoint into freshly built chunks (``training._build_and_load``);
- ``load_model_bytes``: the bytes of the model ShardedTensors (and factories) that load hands
  ``dist_checkpointing.load``, next to this rank's local shards (``shard_bytes``) and the whole model (``model_bytes``).

Figures are the slowest rank's (times) and rank 0's (bytes). Nothing is asserted: this is a measurement.

    .venv/bin/python scripts/bench_fsdp2_checkpoint.py [--num-layers 48] [--nproc 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-layers", type=int, default=48)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--nproc", type=int, default=2, help="data-parallel ranks (FSDP2 shards over them)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    return ap.parse_args(argv)


def _driver_argv(opts, directory: str) -> list[str]:
    h = opts.hidden_size
    return ["--num-layers", str(opts.num_layers), "--hidden-size", str(h), "--num-attention-heads", "4",
            "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", str(2 * h),
            "--seq-length", "64", "--lr", "1e-3", "--micro-batch-size", "1", "--global-batch-size", str(opts.nproc),
            "--train-iters", "1", "--make-vocab-size-divisible-by", "256", "--mock-data", "--use-torch-fsdp2",
            "--save", directory, "--load", directory, "--seed", "7"]


def _worker(rank: int, world_size: int, opts, directory: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from h3t_training.config.sections import parse_args
    from h3t_training.data.tokenizer import tokenizer_from_args
    from h3t_training.loop import checkpointing as ckpt_io
    from h3t_training.loop import training
    from h3t_training.loop.fsdp import _leaves, local
    from h3t_training.loop.model_provider import build_model_chunks

    args = parse_args(_driver_argv(opts, directory), world_size=world_size, rank=rank)
    ps.initialize_model_parallel()
    vocab = tokenizer_from_args(args).vocab_size
    chunks, optimizer = training._build_optimizer(args, build_model_chunks(args, on_gpu=False, vocab_size=vocab),
                                                  on_gpu=False)
    model_sds = [ckpt_io.fsdp.sharded_state_dict(c) for c in chunks]
    dist.barrier()
    t0 = time.perf_counter()
    optimizer.sharded_state_dict(model_sds)
    pieces_s = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()
    ckpt_io.save_checkpoint(args, 1, chunks, optimizer, on_gpu=False)
    save_s = time.perf_counter() - t0

    requested = []
    real_load = dist_checkpointing.load

    def spy(template, *a, **kw):
        requested.extend(sh for _, sh in _leaves(template.get("model", {}))
                         if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) and sh.data is not None)
        return real_load(template, *a, **kw)

    found = ckpt_io.find_checkpoint(args, rank=rank)
    fresh = build_model_chunks(args, on_gpu=False, vocab_size=vocab)
    model_bytes = sum(p.numel() * p.element_size() for c in fresh for p in c.parameters())
    dist.barrier()
    dist_checkpointing.load = spy
    try:
        t0 = time.perf_counter()
        loaded, _, _, _ = training._build_and_load(args, fresh, found, on_gpu=False)
        load_s = time.perf_counter() - t0
    finally:
        dist_checkpointing.load = real_load
    shard_bytes = sum(local(p).numel() * p.element_size() for c in loaded for p in c.parameters())
    n_params = sum(1 for c in loaded for _ in c.parameters())
    ps.destroy_model_parallel()
    return {"parameters": n_params, "pieces_s": pieces_s, "save_s": save_s, "load_s": load_s,
            "load_model_bytes": sum(sh.data.numel() * sh.data.element_size() for sh in requested),
            "shard_bytes": shard_bytes, "model_bytes": model_bytes}


def main(argv=None) -> int:
    opts = _parse(argv)
    from h3t_ext.testing import run_distributed

    with tempfile.TemporaryDirectory() as directory:
        results = run_distributed(_worker, opts.nproc, args=(opts, directory), timeout_s=900)
    out = {"num_layers": opts.num_layers, "hidden_size": opts.hidden_size, "nproc": opts.nproc,
           "parameters": results[0]["parameters"],
           **{k: round(max(r[k] for r in results), 4) for k in ("pieces_s", "save_s", "load_s")},
           **{k: results[0][k] for k in ("load_model_bytes", "shard_bytes", "model_bytes")}}
    if opts.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>18}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
