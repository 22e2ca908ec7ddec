"""Save and resume: one file per rank, a metadata fingerprint, a checksum per file.

Layout under ``--save DIR``::

    latest_checkpointed_iteration.txt     the last complete iteration (Megatron's tracker file)
    iter_0000010/metadata.json            fingerprint: model shape and parallel layout
    iter_0000010/rank_00000.pt            header line ``H3TCKPT1 <sha256> <length>`` + torch.save payload

A checkpoint is refused, with one line, when its fingerprint differs from the run's (model shape
or parallel layout) or when a file's checksum or length does not match its header. Reading and
checking happen before any process group exists (:func:`read_checkpoint`), so a refused
checkpoint ends every rank at once. ``--ckpt`` and ``--offload-alpha`` are not part of the
fingerprint: a run may resume with another activation-memory setting.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Optional

import torch

MAGIC = b"H3TCKPT1"
TRACKER = "latest_checkpointed_iteration.txt"
FINGERPRINT_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "tokenizer_type", "vocab_size", "make_vocab_size_divisible_by", "tensor_model_parallel_size",
                     "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size", "context_parallel_size",
                     "world_size", "use_distributed_optimizer", "global_batch_size", "micro_batch_size")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message is one line."""


def fingerprint(args) -> dict:
    """What must match between the saving and the resuming run."""
    return {k: getattr(args, k) for k in FINGERPRINT_FLAGS}


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rank_file(root: str, iteration: int, rank: int) -> str:
    return os.path.join(_iter_dir(root, iteration), f"rank_{rank:05d}.pt")


def save_rank_file(root: str, iteration: int, rank: int, payload: dict) -> None:
    """Write this rank's file atomically (temporary name, then rename)."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    path = _rank_file(root, iteration, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    header = MAGIC + b" " + hashlib.sha256(data).hexdigest().encode() + b" " + str(len(data)).encode() + b"\n"
    with open(path + ".tmp", "wb") as f:
        f.write(header)
        f.write(data)
    os.replace(path + ".tmp", path)


def finish_save(root: str, iteration: int, args) -> None:
    """Rank 0, after every rank wrote its file: the metadata, then the tracker."""
    meta = {"iteration": iteration, "fingerprint": fingerprint(args)}
    path = os.path.join(_iter_dir(root, iteration), "metadata.json")
    with open(path + ".tmp", "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(path + ".tmp", path)
    with open(os.path.join(root, TRACKER + ".tmp"), "w") as f:
        f.write(f"{iteration}\n")
    os.replace(os.path.join(root, TRACKER + ".tmp"), os.path.join(root, TRACKER))


def _read_tracker(root: str) -> Optional[int]:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"--load {root}: {TRACKER} holds {text!r}, not an iteration number")
    return int(text)


def _check_fingerprint(root: str, iteration: int, args) -> None:
    path = os.path.join(_iter_dir(root, iteration), "metadata.json")
    try:
        with open(path) as f:
            saved = json.load(f)["fingerprint"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"--load {root}: cannot read {path} ({type(e).__name__})") from None
    mine = fingerprint(args)
    for k in FINGERPRINT_FLAGS:
        if saved.get(k) != mine[k]:
            name = "world size" if k == "world_size" else "--" + k.replace("_", "-")
            raise CheckpointError(f"--load {root}: checkpoint iteration {iteration} was saved with {name} "
                                  f"{saved.get(k)}, this run has {mine[k]}")


def _read_verified(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            header = f.readline()
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"checkpoint file {path} cannot be read ({e.strerror})") from None
    parts = header.split()
    if len(parts) != 3 or parts[0] != MAGIC or not parts[2].isdigit():
        raise CheckpointError(f"checkpoint file {path} is corrupt (bad header)")
    if int(parts[2]) != len(data):
        raise CheckpointError(f"checkpoint file {path} is corrupt (length {len(data)}, header says {int(parts[2])})")
    if hashlib.sha256(data).hexdigest().encode() != parts[1]:
        raise CheckpointError(f"checkpoint file {path} is corrupt (checksum mismatch)")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def read_checkpoint(args, rank: int) -> Optional[dict]:
    """This rank's verified payload of the latest checkpoint under ``--load`` (None: nothing to load)."""
    if args.load is None:
        return None
    iteration = _read_tracker(args.load)
    if iteration is None:
        return None
    _check_fingerprint(args.load, iteration, args)
    payload = _read_verified(_rank_file(args.load, iteration, rank))
    if payload.get("iteration") != iteration:
        raise CheckpointError(f"checkpoint file {_rank_file(args.load, iteration, rank)} holds iteration "
                              f"{payload.get('iteration')}, the tracker says {iteration}")
    return payload


def rng_state() -> dict:
    """This rank's RNG streams: torch's CPU generator and, on a GPU, the CUDA generator and
    megatron-core's model-parallel CUDA RNG tracker (dropout in tensor-parallel regions)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_tracker"] = get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` saved (CUDA parts only where saved and a GPU is in use)."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        torch.cuda.set_rng_state(state["cuda"])
        get_cuda_rng_tracker().set_states(state["cuda_tracker"])


def make_payload(iteration: int, chunks, optimizer) -> dict:
    """What one rank saves."""
    return {"iteration": iteration, "model": [c.state_dict() for c in chunks],
            "optimizer": optimizer.state_dict(), "rng": rng_state()}


def apply_payload(payload: dict, chunks, optimizer) -> int:
    """Load model, optimizer and RNG state; returns the iteration to continue from."""
    if len(payload["model"]) != len(chunks):
        raise CheckpointError(f"checkpoint has {len(payload['model'])} model chunks per rank, this run has "
                              f"{len(chunks)}")
    for chunk, state in zip(chunks, payload["model"]):
        chunk.load_state_dict(state, strict=True)
    optimizer.load_state_dict(payload["optimizer"])
    set_rng_state(payload["rng"])
    return int(payload["iteration"])
