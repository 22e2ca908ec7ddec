"""Seconds of NCCL collectives and point-to-point transfers: latency plus bytes over the link they use.

Ring algorithms (NCCL's default for the sizes of LLM training): an all-gather or reduce-scatter over n
ranks takes n - 1 steps, each moving 1/n of the (gathered) buffer per rank, so a rank sends
(n - 1)/n of the buffer at the ring's bus bandwidth; an all-reduce is a reduce-scatter plus an
all-gather (2 (n - 1)/n). Each step also costs one link latency (``nvlink_latency_s`` inside a node,
``network_latency_s`` across nodes; NCCL's LL128/Simple protocol base latencies).

Bus bandwidth of a group (``group_bus_bandwidth``): inside one node every GPU drives its NVLink port
(NVSwitch: any pair at full port speed), ``nvlink_bandwidth * nvlink_fraction``. Across nodes NCCL runs one
ring channel per NIC; the boundary between two nodes is crossed once per channel, so a node holding k
members of the group drives k NICs and the ring's bus bandwidth is min(NVLink, k * NIC) where the node with
the fewest members sets the pace. Group placement follows Megatron's rank order (tensor fastest, then
context, data, pipeline).
"""
from __future__ import annotations

import collections
import functools
import math
from dataclasses import dataclass

from h3t_ext.costmodel.specs import SystemSpec


@dataclass(frozen=True)
class Link:
    """Bus bandwidth (bytes/s per rank) and per-step latency (s) of one group's ring."""

    bandwidth: float
    latency: float


@functools.lru_cache(maxsize=4096)
def group_node_spread(stride: int, size: int, gpus_per_node: int) -> int:
    """Fewest members any group of this dimension has in one of its nodes; 0 when every group lies inside
    one node. Groups are ``inner + outer * stride * size + j * stride`` (j < size); the layout repeats
    every lcm(block, node).

    A group's members per node depend only on where it starts within a node (its first rank modulo
    ``gpus_per_node``), so each distinct start is counted once, node by node: the work is about
    ``gpus_per_node ** 2 + stride * size``, not the ``gpus_per_node * stride * size`` of walking every member of
    every group of the period (a million GPUs with 1024 per node hung it)."""
    g = gpus_per_node
    if size == 1:
        return 0  # one member: inside one node
    if stride >= g:
        return 1  # consecutive members lie in different nodes: every node holds one member
    step = math.gcd(stride * size, g)  # the group starts of one period cover these offsets within a node
    starts = {(k * step + inner) % g for k in range(g // step) for inner in range(min(stride, g))}
    fewest, crosses = size, False
    for r in starts:
        last = (r + (size - 1) * stride) // g  # node of the last member (the first member's is node 0)
        if last == 0:
            continue
        crosses = True
        for node in range(last + 1):
            lo = max(0, -(-(node * g - r) // stride))
            hi = min(size - 1, ((node + 1) * g - 1 - r) // stride)
            if hi >= lo:
                fewest = min(fewest, hi - lo + 1)
        if fewest == 1:
            break
    return fewest if crosses else 0


def _group_node_spread_walk(stride: int, size: int, gpus_per_node: int) -> int:
    """:func:`group_node_spread` by walking every member of every group of one period (the reference the
    regression test compares it with on small layouts)."""
    block = stride * size
    period = block * gpus_per_node // math.gcd(block, gpus_per_node)
    fewest, crosses = size, False
    for base in range(0, period, block):
        for inner in range(stride):
            nodes = collections.Counter((base + inner + j * stride) // gpus_per_node for j in range(size))
            if len(nodes) > 1:
                crosses = True
                fewest = min(fewest, min(nodes.values()))
    return fewest if crosses else 0


def nvlink_rate(system: SystemSpec) -> float:
    """Bytes/s one GPU drives over its NVLink port: ``nvlink_bandwidth`` x ``nvlink_fraction``."""
    return system.nvlink_bandwidth * system.efficiency("nvlink_fraction")


def nic_rate(system: SystemSpec) -> float:
    """Bytes/s one GPU drives through its NIC: ``network_bandwidth`` x ``network_fraction``."""
    return system.network_bandwidth * system.efficiency("network_fraction")


def group_link(stride: int, size: int, system: SystemSpec) -> Link:
    """The ring of a group of ``size`` ranks ``stride`` apart."""
    k = group_node_spread(stride, size, system.gpus_per_node)
    if k == 0:
        return Link(nvlink_rate(system), system.nvlink_latency_s)
    return Link(min(nvlink_rate(system), k * nic_rate(system)), system.network_latency_s)


def p2p_link(stride: int, size: int, system: SystemSpec) -> Link:
    """A transfer between pipeline neighbours ``stride`` apart: one NIC when any neighbour pair crosses a
    node (the fill/drain critical path goes through every pair), NVLink otherwise."""
    if group_node_spread(stride, size, system.gpus_per_node) == 0:
        return Link(nvlink_rate(system), system.nvlink_latency_s)
    return Link(nic_rate(system), system.network_latency_s)


def all_gather_seconds(nbytes: float, size: int, link: Link) -> float:
    """Ring all-gather producing ``nbytes`` on every rank (reduce-scatter of an ``nbytes`` input: same)."""
    if size <= 1:
        return 0.0
    return (size - 1) * link.latency + (size - 1) / size * nbytes / link.bandwidth


reduce_scatter_seconds = all_gather_seconds


def all_reduce_seconds(nbytes: float, size: int, link: Link) -> float:
    """Ring all-reduce of ``nbytes``: reduce-scatter + all-gather."""
    return 2 * all_gather_seconds(nbytes, size, link)


def all_to_all_seconds(nbytes: float, size: int, stride: int, system: SystemSpec) -> float:
    """An all-to-all over ``size`` ranks ``stride`` apart in which every rank sends ``nbytes`` in ``size`` equal parts
    (one it keeps). The parts for members in its node go over NVLink, the others over the rank's NIC, at once; the
    node with the fewest members (:func:`group_node_spread`) sends most over the network."""
    if size <= 1:
        return 0.0
    k = group_node_spread(stride, size, system.gpus_per_node)
    if k == 0:
        return system.nvlink_latency_s + (size - 1) / size * nbytes / nvlink_rate(system)
    return system.network_latency_s + max((k - 1) / size * nbytes / nvlink_rate(system),
                                          (size - k) / size * nbytes / nic_rate(system))


def p2p_seconds(nbytes: float, link: Link) -> float:
    """One send/recv of ``nbytes``."""
    return link.latency + nbytes / link.bandwidth


def host_copy_seconds(nbytes: float, system: SystemSpec) -> float:
    """A host<->device copy of ``nbytes`` between pinned host memory and the GPU, one direction: bytes over
    the PCIe per-direction rate times ``pcie_fraction`` (the offload copies and reloads of activations)."""
    return nbytes / (system.pcie_bandwidth * system.efficiency("pcie_fraction"))
