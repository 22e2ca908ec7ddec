"""What a checkpoint directory holds on disk, read and checked without process groups: the tracker, the
checksum manifest (``h3t_checksums.json``: size and SHA-256 of every file), the place of every tensor in the
``.distcp`` files, and the common state (``common.pt``, or the shard files' own with megatron-core 0.19).

:mod:`h3t_training.loop.checkpointing` uses them to check ``--load`` before any rank starts and to write the
manifest of a save; every failure is a one-line :class:`CheckpointError` naming the file.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import torch

from h3t_training.loop import legacy_checkpoint as legacy, megatron_written
from h3t_training.loop.checkpoint_common import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
CHECKSUMS = "h3t_checksums.json"


def read_tracker(root: str) -> Optional[int]:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        raise CheckpointError(f"--load {root}: {TRACKER} says 'release' (a converted release checkpoint); "
                              f"load it with --finetune --ckpt-step 0 after renaming it to iter_0000000", alike=True)
    if not text.isdigit():
        raise CheckpointError(f"--load {root}: {TRACKER} holds {text!r}, not an iteration number", alike=True)
    return int(text)


def file_digest(path: str) -> list:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return [os.path.getsize(path), h.hexdigest()]


def verify_files(directory: str, rank: int, world_size: int) -> None:
    """Every file of the manifest is there with its size; this rank checks the SHA-256 of its share."""
    manifest = os.path.join(directory, CHECKSUMS)
    try:
        with open(manifest) as f:
            files = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {directory} is partial or corrupt: {CHECKSUMS} cannot be read "
                              f"({type(e).__name__})") from None
    for i, (name, (size, digest)) in enumerate(sorted(files.items())):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"checkpoint file {path} is missing")
        if os.path.getsize(path) != size:
            raise CheckpointError(f"checkpoint file {path} is corrupt (length {os.path.getsize(path)}, "
                                  f"{CHECKSUMS} says {size})")
        if i % world_size == rank and file_digest(path)[1] != digest:
            raise CheckpointError(f"checkpoint file {path} is corrupt (checksum mismatch)")


ZIP_LOCAL_HEADER = b"PK\x03\x04"
"""The first bytes of a zip archive: every tensor item of a .distcp file is one ``torch.save`` archive."""
ZIP_END_RECORD = b"PK\x05\x06"
ZIP_END_RECORD_BYTES = 22
"""A zip archive ends with its end-of-central-directory record, 22 bytes without a comment (torch writes none)."""


def verify_layout(directory: str, rank: int, world_size: int) -> None:
    """Every tensor that ``.metadata`` places in a ``.distcp`` file (file, offset, length) is a whole
    ``torch.save`` archive there: it starts with a zip header and ends with a zip end record. Checksums prove
    that the files are the ones that were written, not that they are where ``.metadata`` looks for them (a
    shard file swapped with another, the manifest fixed up, passes them). This rank checks its share of the files;
    two small reads per tensor."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as e:  # noqa: BLE001 - an unpickling failure can be of any type
        raise CheckpointError(f"checkpoint file {os.path.join(directory, '.metadata')} cannot be read "
                              f"({type(e).__name__})") from None
    items: dict[str, list] = {}
    for index, info in (metadata.storage_data or {}).items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), TensorStorageMetadata) and \
                not getattr(info, "transform_descriptors", None):
            items.setdefault(info.relative_path, []).append((index.fqn, info.offset, info.length))
    for i, name in enumerate(sorted(items)):
        if i % world_size != rank:
            continue
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                for fqn, offset, length in sorted(items[name], key=lambda x: x[1]):
                    end = offset + length
                    if end > size or length < ZIP_END_RECORD_BYTES or \
                            os.pread(f.fileno(), 4, offset) != ZIP_LOCAL_HEADER or \
                            os.pread(f.fileno(), 4, end - ZIP_END_RECORD_BYTES) != ZIP_END_RECORD:
                        raise CheckpointError(f"checkpoint file {path} is corrupt or misplaced: {fqn} is not where "
                                              f".metadata records it (bytes {offset}..{end}); was a shard file "
                                              f"swapped, renamed or rewritten?")
        except OSError as e:
            raise CheckpointError(f"checkpoint file {path} cannot be read ({e.strerror or type(e).__name__})") from None


def read_common(directory: str) -> dict:
    meta = os.path.join(directory, "metadata.json")
    names = os.listdir(directory)
    per_rank = legacy.rank_dirs(directory)
    if per_rank and "common.pt" in names:  # --ckpt-format torch, written by this driver
        return _read_common_pt(directory)
    if per_rank:  # written by Megatron-LM: its args are in every rank's file
        return megatron_written.read_legacy_common(directory, per_rank[0])
    if any(n.startswith("rank_") and n.endswith(".pt") for n in names):
        raise CheckpointError(f"{directory} is in h3t-ext's former per-rank format (rank_*.pt), which this "
                              f"release does not read; train again or convert it with the previous release", alike=True)
    try:
        with open(meta) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {meta} cannot be read ({type(e).__name__})", alike=True) from None
    if backend != "torch_dist":
        raise CheckpointError(f"checkpoint file {meta} names backend {backend!r}; --ckpt-format torch_dist "
                              f"is what this driver reads", alike=True)
    common = _read_common_pt(directory)
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise CheckpointError(f"checkpoint {directory} is partial: its .metadata file is missing", alike=True)
    return common


def _blame_a_damaged_shard(directory: str) -> None:
    """Where the common state came from the shard files (megatron-core 0.19) and did not read as one: a
    :class:`CheckpointError` naming the damaged or misplaced shard, as a damaged ``common.pt`` is named, when the
    manifest finds one; nothing otherwise."""
    if os.path.isfile(os.path.join(directory, CHECKSUMS)):
        verify_files(directory, 0, 1)
        verify_layout(directory, 0, 1)


def load_common_state(directory: str):
    """The common state of a torch_dist checkpoint: ``common.pt`` (megatron-core 0.16-0.18 write it), else the
    ``common_state`` object megatron-core 0.19 keeps inside the checkpoint's own files, read with its
    ``load_common_state_dict`` (no process group needed). Returns (state, the path named in errors)."""
    path = os.path.join(directory, "common.pt")
    if os.path.isfile(path) or not os.path.isfile(os.path.join(directory, ".metadata")):
        return torch.load(path, map_location="cpu", weights_only=False), path
    from megatron.core import dist_checkpointing  # noqa: PLC0415
    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415 (a BaseException)

    source = os.path.join(directory, ".metadata")
    try:
        return dist_checkpointing.load_common_state_dict(directory), source
    except (Exception, CheckpointException) as e:  # noqa: BLE001 (megatron-core 0.16 looks for common.pt, 0.19 in
        # the shard files, read through torch.distributed.checkpoint, whose CheckpointException is no Exception)
        _blame_a_damaged_shard(directory)
        raise CheckpointError(f"checkpoint {directory} has no common.pt and its common state cannot be read from its "
                              f"shard files by this megatron-core ({type(e).__name__}: {str(e).splitlines()[0][:160]})",
                              alike=True) from None


def read_saved_common(directory: str) -> tuple[object, str]:
    """:func:`load_common_state` as it was saved (not converted), a damaged file a one-line :class:`CheckpointError`:
    (state, the path named in errors)."""
    path = os.path.join(directory, "common.pt")
    try:
        return load_common_state(directory)
    except CheckpointError:
        raise
    except Exception as e:  # torch raises several unrelated types for a damaged file
        raise CheckpointError(f"checkpoint file {path} is corrupt or partial ({type(e).__name__})",
                              alike=True) from None


def _read_common_pt(directory: str) -> dict:
    common, path = read_saved_common(directory)
    if isinstance(common, dict) and "h3t" not in common and "args" in common:  # torch_dist written by Megatron-LM
        ns = common["args"]
        return megatron_written.megatron_written_common(
            ns, common.get("iteration"), common.get("opt_param_scheduler"), path=path,
            optimizer_saved=not getattr(ns, "no_save_optim", False), rng_saved=not getattr(ns, "no_save_rng", False))
    if not isinstance(common, dict) or "h3t" not in common or "iteration" not in common:
        if not path.endswith("common.pt"):
            _blame_a_damaged_shard(directory)
        raise CheckpointError(f"checkpoint file {path} was written neither by this driver (no 'h3t' section) nor by "
                              f"Megatron-LM (no 'args' entry)", alike=True)
    return common
