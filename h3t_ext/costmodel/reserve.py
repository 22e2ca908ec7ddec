"""Device memory outside ``max_memory_allocated`` on a Megatron rank, and the default memory budget.

A rank runs out of memory when the caching allocator needs a new segment and the device has none left,
so what has to fit in the HBM is what the allocator has *reserved*, plus everything allocated outside it:

    HBM >= CUDA context + NCCL buffers of the communicators in use + reserved
    reserved = max_memory_allocated * (1 + allocator gap)

so the largest ``max_memory_allocated`` that fits (the default budget) is
``(HBM - context - NCCL) / (1 + allocator gap)``. The context and the allocator gap are per GPU (system file:
``cuda_context_bytes``, ``allocator_fragmentation_fraction``); the NCCL term depends on the layout, since
Megatron only creates NCCL buffers for the process groups a step runs a collective or p2p on, so the budget
is a function of (model, plan, system).

Communicators (megatron-core ``parallel_state.initialize_model_parallel`` creates many more process groups,
but torch creates an NCCL communicator lazily and NCCL connects buffers on the first operation; the groups
below are the ones a dense bf16 GPT training step uses; groups of one rank have no buffers):

* ``WORLD``                 the default group (barriers, timers): always, num_gpus > 1.
* ``INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP`` the distributed optimizer's grad-stats group (gradient
                            norm and zero count; with one optimizer instance it spans every rank: megatron-core
                            ``optimizer/__init__.py`` sets ``grad_stats_parallel_group`` to it); without the
                            distributed optimizer the ``MODEL_PARALLEL_GROUP`` (t * p > 1) does that reduction.
* ``TENSOR_MODEL_PARALLEL_GROUP`` t > 1: sequence-parallel all-gather / reduce-scatter, cross entropy.
* ``CONTEXT_PARALLEL_GROUP`` c > 1: TransformerEngine's ring exchange of K/V (p2p, 1 peer at c = 2, else 2).
* ``DATA_PARALLEL_GROUP_WITH_CP`` d > 1: gradient reduce-scatter / all-reduce, parameter all-gather, loss
                            averaging (megatron/training/training.py).
* ``PIPELINE_MODEL_PARALLEL_GROUP`` p > 1: activation and gradient send/recv (p2p, 1 peer at p = 2, else 2).
* ``EMBEDDING_GROUP``       p > 1 with tied embedding and output weights: the word-embedding gradient
                            all-reduce between the first and last stage (skipped when they are untied).
* MoE layers (:mod:`h3t_ext.costmodel.moe`): ``EXPERT_MODEL_PARALLEL_GROUP`` ep > 1, the all-to-all (p2p with
                            each of the ep - 1 others), ``EXPERT_TENSOR_PARALLEL_GROUP`` etp > 1 (its all-gather /
                            reduce-scatter), or with the allgather dispatcher one collective over the ep etp ranks;
                            ``EXPERT_DATA_PARALLEL_GROUP`` edp > 1, the experts' gradient reduce-scatter.

NCCL buffers (NCCL's defaults, ``src/include/device.h`` and the ``NCCL_BUFFSIZE`` documentation): one
connection of one channel holds a receive buffer per protocol, SIMPLE 4 MiB + LL128 4.6875 MiB + LL 0.5 MiB
= 9.19 MiB. A collective communicator connects ring (1 incoming) and tree (up to 2 incoming inside a node,
parent and child of the chain) on every channel: 3 connections x channels, which the system file's
``nccl_bytes_per_communicator`` holds (``systems/*.json`` ``source_structure``). A p2p peer over NVLink is
connected on every channel with one connection (a third of it); over the network NCCL uses
``NCCL_NCHANNELS_PER_NET_PEER`` = 2 channels per peer and the SIMPLE protocol only, send and receive.
"""
from __future__ import annotations

from dataclasses import dataclass

from h3t_ext.costmodel import moe
from h3t_ext.costmodel.plan import Plan
from h3t_ext.costmodel.specs import ModelSpec, SystemSpec

MIB = 1 << 20
NCCL_SIMPLE_BUFFER_BYTES = 4 * MIB
"""NCCL_BUFFSIZE's default (1 << 22): the SIMPLE protocol's buffer of one connection of one channel."""
NCCL_COLLECTIVE_CONNECTIONS_PER_CHANNEL = 3
"""Incoming connections of a collective communicator per channel: 1 ring + 2 tree (parent and child of the
intra-node chain). ``nccl_bytes_per_communicator`` = this x 9.19 MiB x channels."""
NCCL_CHANNELS_PER_NET_PEER = 2
"""NCCL_NCHANNELS_PER_NET_PEER's default: channels of a p2p peer reached over the network."""
NCCL_NET_P2P_PEER_BYTES = NCCL_CHANNELS_PER_NET_PEER * 2 * NCCL_SIMPLE_BUFFER_BYTES
"""One network p2p peer: 2 channels x (send + receive) x the SIMPLE buffer (p2p uses SIMPLE only): 16 MiB."""


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator a rank holds buffers for."""

    group: str
    """megatron-core's name of the process group (``group_desc``)."""
    kind: str
    """'collective' or 'p2p'."""
    peers: int
    """Ranks this rank connects to (p2p) or the group's size (collective)."""
    nvlink: bool
    """Every peer inside the rank's node."""
    bytes: int
    """Device bytes of its buffers."""


@dataclass(frozen=True)
class MemoryReserve:
    """What lies outside ``max_memory_allocated`` for one plan on one GPU, and the budget that leaves."""

    hbm_bytes: int
    cuda_context_bytes: int
    communicators: tuple[Communicator, ...]
    allocator_gap_fraction: float
    """Bytes the caching allocator holds reserved beyond the allocated peak, as a fraction of it."""

    @property
    def nccl_bytes(self) -> int:
        return sum(c.bytes for c in self.communicators)

    @property
    def free_bytes(self) -> int:
        """HBM less the CUDA context and the NCCL buffers: what the caching allocator may reserve."""
        return self.hbm_bytes - self.cuda_context_bytes - self.nccl_bytes

    @property
    def budget_bytes(self) -> int:
        """The largest ``max_memory_allocated`` that fits."""
        return int(self.free_bytes / (1.0 + self.allocator_gap_fraction))

    def to_dict(self) -> dict:
        return {"hbm_bytes": self.hbm_bytes, "cuda_context_bytes": self.cuda_context_bytes,
                "nccl_bytes": self.nccl_bytes, "allocator_gap_fraction": self.allocator_gap_fraction,
                "budget_bytes": self.budget_bytes,
                "communicators": [{"group": c.group, "kind": c.kind, "peers": c.peers, "nvlink": c.nvlink,
                                   "bytes": c.bytes} for c in self.communicators]}


def _p2p(group: str, peers: int, nvlink: bool, system: SystemSpec) -> Communicator:
    per_peer = (system.nccl_bytes_per_communicator // NCCL_COLLECTIVE_CONNECTIONS_PER_CHANNEL if nvlink
                else NCCL_NET_P2P_PEER_BYTES)
    return Communicator(group, "p2p", peers, nvlink, peers * per_peer)


def communicators(model: ModelSpec, plan: Plan, system: SystemSpec) -> tuple[Communicator, ...]:
    """The NCCL communicators a rank of ``plan`` holds buffers for (module docstring)."""
    t, c, p = plan.tensor_model_parallel_size, plan.context_parallel_size, plan.pipeline_model_parallel_size
    d, n, node = plan.data_parallel_size, plan.num_gpus, system.gpus_per_node
    coll = system.nccl_bytes_per_communicator
    out = []

    def collective(group: str, size: int, span: int) -> None:
        if size > 1:
            out.append(Communicator(group, "collective", size, span <= node, coll))

    collective("WORLD", n, n)
    if plan.use_distributed_optimizer:
        collective("INTRA_DISTRIBUTED_OPTIMIZER_INSTANCE_GROUP", n, n)
    else:
        collective("MODEL_PARALLEL_GROUP", t * p, n)
    collective("TENSOR_MODEL_PARALLEL_GROUP", t, t)
    if c > 1:
        out.append(_p2p("CONTEXT_PARALLEL_GROUP", 1 if c == 2 else 2, t * c <= node, system))
    collective("DATA_PARALLEL_GROUP_WITH_CP", d, t * d)
    if p > 1:
        # rank order tensor, context, data, pipeline: pipeline neighbours are t * d ranks apart
        out.append(_p2p("PIPELINE_MODEL_PARALLEL_GROUP", 1 if p == 2 else 2, 2 * t * d <= node, system))
        if not model.untie_embeddings_and_output_weights:
            collective("EMBEDDING_GROUP", 2, n)
    if model.is_moe:
        ep, etp = plan.expert_model_parallel_size, moe.expert_tensor_parallel_size(plan)
        if plan.moe_token_dispatcher_type == "allgather":
            collective("EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP", ep * etp, ep * etp)
        elif ep > 1:  # the all-to-all: send/recv with every other member
            out.append(_p2p("EXPERT_MODEL_PARALLEL_GROUP", ep - 1, ep * etp <= node, system))
        if plan.moe_token_dispatcher_type != "allgather" and etp > 1:
            collective("EXPERT_TENSOR_PARALLEL_GROUP", etp, etp)
        collective("EXPERT_DATA_PARALLEL_GROUP", moe.expert_data_parallel_size(plan), t * c * d)
    return tuple(out)


ALLOCATOR_GAP_RANGE = (0.03, 0.08)
"""What PyTorch's caching allocator reserves beyond ``max_memory_allocated`` in steady-state training loops, as a
fraction of it (``torch.cuda.memory_stats`` reserved against allocated: 2 MiB rounding of large blocks, split blocks
that cannot be reused; the system files' source for ``allocator_fragmentation_fraction``, which assumes 5%). A peak
whose verdict would change inside this range is marginal: ``Estimate.allocator_gap_left`` says how much it leaves."""


def allocator_gap_left(free_bytes: int, peak_bytes: int) -> float:
    """The largest reserve beyond ``peak_bytes``, as a fraction of it, that still fits ``free_bytes``."""
    return free_bytes / peak_bytes - 1.0 if peak_bytes > 0 else float("inf")


def memory_reserve(model: ModelSpec, plan: Plan, system: SystemSpec) -> MemoryReserve:
    """Context, NCCL buffers and allocator gap of one rank of ``plan`` on ``system``."""
    return MemoryReserve(hbm_bytes=system.hbm_bytes, cuda_context_bytes=system.cuda_context_bytes,
                         communicators=communicators(model, plan, system),
                         allocator_gap_fraction=system.allocator_fragmentation_fraction)


def default_memory_budget_bytes(model: ModelSpec, plan: Plan, system: SystemSpec) -> int:
    """The budget ``estimate``, ``solve_offload_alpha`` and ``search`` check a plan against when none is
    given: ``memory_reserve(model, plan, system).budget_bytes``."""
    return memory_reserve(model, plan, system).budget_bytes
