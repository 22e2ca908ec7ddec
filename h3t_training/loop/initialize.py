"""Process groups: torch.distributed from the launcher's environment, then megatron-core's groups.

torchrun, our mpirun launcher and srun all provide RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; a plain ``python pretrain_llama.py`` runs as a single rank on a free local port.
The backend is NCCL on GPUs and gloo on CPU; ``--distributed-backend`` overrides, as the flags resolved it
(``nccl`` on a machine without CUDA became gloo, with a notice, in :mod:`h3t_training.config.megatron_compat`).
"""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from h3t_training.config.feature_checks import uses_gpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dist_rank_from_env() -> int:
    """This process's global rank as the launcher set it (0 for a plain single-process run)."""
    return int(os.environ.get("RANK", "0"))


def attempt_prefix() -> str:
    """The key prefix of this start of the worker group in the launcher's store: ``h3t_attempt_N/`` under
    torchrun's agent store (N: ``TORCHELASTIC_RESTART_COUNT``), empty otherwise.

    torchrun's static rendezvous (``--master-addr``/``--master-port``, one node) keeps one store for the whole job,
    and the workers of every start of the group connect to it directly (``TORCHELASTIC_USE_AGENT_STORE``). gloo
    publishes each rank's address there under the same keys at every start, so after ``--max-restarts`` restarts a
    group the new ranks read the dead ranks' addresses and fail to connect ("Gloo connectFullMesh failed ...
    Connection refused"). One prefix per start keeps the starts apart."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return ""
    return f"h3t_attempt_{int(os.environ.get('TORCHELASTIC_RESTART_COUNT', '0'))}/"


def attempt_store(timeout: datetime.timedelta, store=None):
    """The launcher's store (a new client, or ``store``) under :func:`attempt_prefix`; None where there is no
    agent store (rank 0 hosts the store: mpirun, srun, a plain start) and ``store`` is None."""
    prefix = attempt_prefix()
    if not prefix:
        return store
    if store is None:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(prefix, store)


def initialize_distributed(args) -> None:
    """Create the default process group and megatron-core's model/data-parallel groups."""
    if "MASTER_ADDR" not in os.environ:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    on_gpu = uses_gpu(args)
    backend = args.distributed_backend or ("nccl" if on_gpu else "gloo")
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(minutes=args.distributed_timeout_minutes)
    store = attempt_store(timeout)
    dist.init_process_group(backend=backend, timeout=timeout, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), **({"store": store} if store else {}))
    ps.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        create_gloo_process_groups=on_gpu,
    )


def set_random_seed(seed: int, *, on_gpu: bool, data_parallel_random_init: bool = False) -> None:
    """Megatron's seeding, after the groups exist: ``seed + 100 * pipeline rank`` for torch's
    generators (every data-parallel replica draws the same weights; with --data-parallel-random-init also
    ``+ 10 * data-parallel rank``, so each replica draws its own dropout masks) and, on a GPU, megatron-core's
    model-parallel CUDA RNG tracker, which weight init, dropout in tensor-parallel regions and
    full recompute read (megatron-core raises "cuda rng state model-parallel-rng is not added"
    without it)."""
    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    if data_parallel_random_init:
        seed += 10 * ps.get_data_parallel_rank()
    torch.manual_seed(seed)
    if on_gpu:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    """Tear down megatron-core's groups and the default group."""
    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
