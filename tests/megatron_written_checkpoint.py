"""Rewrite a checkpoint the driver saved (torch_dist, one rank) into the layout Megatron-LM itself writes.

Megatron-LM's ``save_checkpoint`` (``megatron/training/checkpointing.py``: ``generate_state_dict``) stores
``args`` (its argparse Namespace), ``checkpoint_version`` 3.0, ``iteration``, ``model`` (the model's
``sharded_state_dict()`` for torch_dist, ``state_dict_for_save_checkpoint()`` for ``--ckpt-format torch``),
``opt_param_scheduler`` (its ``OptimizerParamScheduler.state_dict()``), ``rng_state`` (a list with one dict of
Python's, NumPy's, torch's and CUDA's generators; for torch_dist a ShardedObject over (pipeline, tensor) ranks) and
``num_floating_point_operations_so_far``; the consumed samples are in its args. No ``'h3t'`` section, no checksum
manifest, no ``common.pt`` for the legacy format. The optimizer state is left out (megatron-core's optimizer is
GPU-only; the tests load with --no-load-optim).

Run as a script (it needs a process group)::

    python tests/megatron_written_checkpoint.py SRC DST {torch_dist,torch} [--set FIELD=VALUE] [--drop FIELD]
        [--rng-copies {one,same,distinct}] -- DRIVER FLAGS

SRC is the driver's ``--save`` directory, DST the new ``--load`` directory; ``--set``/``--drop`` change or remove
a field of Megatron's args; the driver flags are those of the run that saved SRC.
"""
from __future__ import annotations

import argparse
import ast
import os
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MEGATRON_ARG_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "group_query_attention", "num_query_groups",
    "ffn_hidden_size", "kv_channels", "seq_length", "max_position_embeddings", "swiglu", "normalization",
    "tokenizer_type", "vocab_size", "make_vocab_size_divisible_by", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "context_parallel_size",
    "data_parallel_size", "world_size", "use_distributed_optimizer", "micro_batch_size", "global_batch_size",
    "train_iters", "lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_decay_iters", "lr_warmup_init",
    "weight_decay", "decoupled_lr", "decoupled_min_lr", "seed", "ckpt_format")
"""The Megatron-LM args fields (its argparse destinations) this rewrite copies from the driver's run."""


def megatron_args(args, *, padded_vocab: int, consumed: int, ckpt_format: str, sets: dict,
                  drops: list) -> argparse.Namespace:
    """Megatron-LM's args of the run: its flags, the fields its ``validate_args`` and training fill in
    (``padded_vocab_size``, ``consumed_train_samples``, ``lr_decay_iters``), then ``sets`` and ``drops``."""
    fields = {k: getattr(args, k) for k in MEGATRON_ARG_FIELDS}
    fields.update(padded_vocab_size=padded_vocab, consumed_train_samples=consumed, ckpt_format=ckpt_format,
                  no_save_optim=False, no_save_rng=False)
    if fields["lr_decay_iters"] is None:  # Megatron's get_optimizer_param_scheduler sets it to --train-iters
        fields["lr_decay_iters"] = args.train_iters
    fields.update(sets)
    for k in drops:
        del fields[k]
    return argparse.Namespace(**fields)


def scheduler_state(args, consumed: int) -> dict:
    """Megatron's ``OptimizerParamScheduler.state_dict()`` of an iteration-based run (steps in samples)."""
    gbs = args.global_batch_size
    decay = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    return {"max_lr": args.lr, "lr_warmup_steps": args.lr_warmup_iters * gbs, "num_steps": consumed,
            "lr_decay_style": args.lr_decay_style, "lr_decay_steps": decay * gbs, "min_lr": args.min_lr,
            "start_wd": args.weight_decay, "end_wd": args.weight_decay, "wd_incr_style": "constant",
            "wd_incr_steps": args.train_iters * gbs}


def main(argv: list[str]) -> int:
    split = argv.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("format", choices=("torch_dist", "torch"))
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--drop", action="append", default=[])
    p.add_argument("--rng-copies", choices=("one", "same", "distinct"), default="one",
                   help="the rng_state list: one state (Megatron-LM's default), or one per data-parallel rank of a "
                        "2-replica run under --data-parallel-random-init: the same state twice, or the second drawn "
                        "from another seed")
    opts = p.parse_args(argv[:split])
    flags = argv[split + 1:]

    import numpy as np
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from h3t_training.config.sections import parse_args
    from h3t_training.data.tokenizer import run_padded_vocab_size, tokenizer_from_args
    from h3t_training.loop.initialize import initialize_distributed, shutdown
    from h3t_training.loop.model_provider import build_model_chunks

    args = parse_args(flags, world_size=1)
    src_root = Path(opts.src)
    iteration = int((src_root / "latest_checkpointed_iteration.txt").read_text())
    src = src_root / f"iter_{iteration:07d}"
    from driver_harness import read_common  # common.pt, or the shard files' common state (megatron-core 0.19)
    common = read_common(src)
    consumed = common["consumed_train_samples"]

    initialize_distributed(args)
    try:
        (chunk,) = build_model_chunks(args, on_gpu=False, vocab_size=tokenizer_from_args(args).vocab_size)
        loaded = dist_checkpointing.load({"model": chunk.sharded_state_dict(),
                                          "rng_state": ShardedObject("rng_state", None, (1,), (0,), replica_id=0)},
                                         str(src))
        chunk.load_state_dict(loaded["model"], strict=True)
        rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
               "torch_rng_state": loaded["rng_state"]["torch"], "cuda_rng_state": torch.ByteTensor(),
               "rng_tracker_states": {}}
        states = [rng]
        if opts.rng_copies != "one":
            other = dict(rng, torch_rng_state=torch.Generator().manual_seed(12345).get_state())
            states = [rng, rng if opts.rng_copies == "same" else other]
        sets = {k: ast.literal_eval(v) for k, v in (s.split("=", 1) for s in opts.set)}
        ns = megatron_args(args, padded_vocab=run_padded_vocab_size(args), consumed=consumed,
                           ckpt_format=opts.format, sets=sets, drops=opts.drop)
        state = {"args": ns, "checkpoint_version": 3.0, "iteration": iteration,
                 "opt_param_scheduler": scheduler_state(args, consumed), "num_floating_point_operations_so_far": 0.0}
        dst = Path(opts.dst) / f"iter_{iteration:07d}"
        if opts.format == "torch_dist":
            metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
            state["model"] = chunk.sharded_state_dict(
                metadata={**metadata, "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)})
            state["rng_state"] = ShardedObject("rng_state", states, (1, 1), (0, 0), replica_id=0)
            os.makedirs(dst)
            from h3t_ext.checkpointing import save_strategy  # megatron-core's strategy, without its CUDA sync
            dist_checkpointing.save(state, str(dst), sharded_strategy=save_strategy(False), content_metadata=metadata)
        else:
            state["model"] = chunk.state_dict_for_save_checkpoint()
            state["rng_state"] = states
            os.makedirs(dst / "mp_rank_00")
            torch.save(state, dst / "mp_rank_00" / "model_optim_rng.pt")
        (Path(opts.dst) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
