"""A GPU type and its cluster (:class:`SystemSpec`), from the data files under ``h3t_ext/data/systems`` or a
``--system-file``."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Optional

from h3t_ext.costmodel.data_files import DATA_DIR, read_json
from h3t_ext.costmodel.efficiency_sets import OPTIONAL_EFFICIENCIES, efficiency_set, efficiency_set_names, plausible_ranges
from h3t_ext.costmodel.errors import UnknownNameError
from h3t_ext.costmodel.schema import SchemaError, check_system_dict


@dataclass(frozen=True)
class SystemSpec:
    """One GPU type and its cluster (numbers from the data file ``systems/<name>.json``)."""

    name: str
    """Short name, e.g. ``h800``."""
    peak_bf16_flops: float
    """Dense bf16 tensor-core peak, FLOP/s per GPU."""
    hbm_bytes: int
    """HBM capacity per GPU."""
    hbm_bandwidth: float
    """HBM bandwidth, bytes/s."""
    default_memory_budget_bytes: int
    """A layout-free budget (five collective communicators, ``memory_budget_from_first_principles``); what
    ``estimate``, the alpha solver and ``search`` check a plan against is the plan's own,
    ``reserve.default_memory_budget_bytes(model, plan, system)`` (its communicators counted)."""
    nvlink_bandwidth: float
    """NVLink bandwidth per GPU and direction, bytes/s."""
    network_bandwidth: float
    """Inter-node network bandwidth per GPU and direction, bytes/s."""
    pcie_bandwidth: float
    """Host<->device PCIe bandwidth per GPU and direction, bytes/s."""
    gpus_per_node: int
    """GPUs sharing one NVLink domain."""
    peak_fp8_flops: float = 0.0
    """Dense FP8 tensor-core peak, FLOP/s per GPU (datasheet); 0 where the GPU has no FP8 (A100/A800)."""
    compute_capability: float = 0.0
    """CUDA compute capability (8.0 Ampere, 9.0 Hopper, 10.0 Blackwell): FP8 needs peak_fp8_flops > 0, MXFP8
    (block scales in the tensor cores) compute capability >= 10.0."""
    num_sms: int = 0
    """Streaming multiprocessors (GEMM tiles and attention blocks are quantized into waves over them)."""
    gemm_tile_m: int = 0
    """Rows of the output tile cuBLAS/CUTLASS use for large bf16 GEMMs on this GPU."""
    gemm_tile_n: int = 0
    """Columns of that tile."""
    kernel_launch_s: float = 0.0
    """Launch and tail cost of one kernel, seconds."""
    nvlink_latency_s: float = 0.0
    """Per-step latency of an NCCL ring step inside a node, seconds."""
    network_latency_s: float = 0.0
    """Per-step latency of an NCCL ring step across nodes, seconds."""
    cuda_context_bytes: int = 0
    """Device memory of the CUDA context and the loaded kernels (outside max_memory_allocated)."""
    allocator_fragmentation_fraction: float = 0.0
    """Caching-allocator bytes reserved beyond max_memory_allocated, as a fraction of it."""
    nccl_bytes_per_communicator: int = 0
    """NCCL receive buffers of one collective communicator: channels x 3 connections (ring + tree) x 9.19 MiB
    (SIMPLE + LL128 + LL); outside max_memory_allocated (``reserve.py``)."""
    host_memory_bytes: int = 0
    """Host DRAM of one node (the limit on what its ranks offload; 0: not stated, not checked)."""
    host_memory_bandwidth: float = 0.0
    """Host DRAM bandwidth of one node, bytes/s (CPU optimizer steps; 0: not stated, CPU offload not priced)."""
    host_gpus: int = 0
    """GPUs sharing one host (its DRAM, the DRAM's bandwidth and the host memory budget): the system file's
    ``gpus_per_host``; 0 where the file does not give it, one host per NVLink domain (:attr:`gpus_per_host`)."""
    efficiencies: Mapping[str, float] = field(default_factory=dict, hash=False)
    """Fitted efficiencies (fractions of the peaks above); see ``fitted_efficiencies.json``."""
    source: str = ""
    """Where the numbers come from."""
    efficiency_set: str = ""
    """Name of the efficiency set (GPU family and software stack) the efficiencies came from."""

    @property
    def gpus_per_host(self) -> int:
        """GPUs sharing one host: a DGX node's 8 are one NVLink domain and one host; a GB200 NVL72 rack is one
        NVLink domain of 72 GPUs over 18 hosts (compute trays) of 4."""
        return self.host_gpus or self.gpus_per_node

    def efficiency(self, key: str) -> float:
        """One fitted efficiency; a missing key is a data-file bug."""
        try:
            return self.efficiencies[key]
        except KeyError:
            raise KeyError(f"system {self.name!r}: no fitted efficiency {key!r}") from None


def list_systems() -> list[str]:
    """Names of the systems under ``data/systems``."""
    return sorted(p.stem for p in (DATA_DIR / "systems").glob("*.json"))


def _shipped_system(name: str) -> dict:
    """The data file of the shipped system ``name`` (a name, never a path: '../systems/h800' read a file by its
    path); raises UnknownNameError listing valid names."""
    if name.lower() not in list_systems():
        raise UnknownNameError("system", name, list_systems())
    return read_json(DATA_DIR / "systems" / f"{name.lower()}.json")


@functools.lru_cache(maxsize=None)
def get_system(name: str) -> SystemSpec:
    """The system ``name``; raises UnknownNameError listing valid names."""
    return system_from_dict(name.lower(), _shipped_system(name))


def system_file_dict(name: str) -> dict:
    """The raw data file of system ``name`` with its efficiency set inlined (what calibrate starts from)."""
    d = _shipped_system(name)
    d["efficiencies"] = {k: v for k, v in efficiency_set(d.get("efficiency_set", name)).items() if not k.startswith("_")}
    return d


def load_system_file(path: str | Path) -> SystemSpec:
    """A system file written by ``h3t-plan calibrate`` (or any file shaped like ``data/systems/*.json``;
    its ``efficiencies`` object, when present, replaces the named efficiency set)."""
    p = Path(path)
    if not str(path).strip():
        raise FileNotFoundError("--system-file: an empty path; give the path of a system file (JSON)")
    if not p.is_file():
        raise FileNotFoundError(f"--system-file {path}: " + (
            "a directory; give the path of a system file (JSON)" if p.is_dir() else
            "not a regular file; give the path of a system file (JSON)" if p.exists() else "no such file"))
    try:
        d = read_json(p)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SchemaError(f"--system-file {path}: not a JSON file ({str(e) or type(e).__name__})") from None
    where = f"--system-file {path}"
    check_system_dict(where, d, efficiency_set_names(), tuple(plausible_ranges()), OPTIONAL_EFFICIENCIES)
    return system_from_dict(str(d.get("name", p.stem)).lower(), d, where=where)


NCCL_COMMUNICATORS_IN_USE = 5
"""Collective communicators of the layout-free budget (``SystemSpec.default_memory_budget_bytes``): world,
distributed-optimizer grad stats, tensor, data(-with-context) and one more; a plan's own count is
``reserve.communicators``."""


def memory_budget_from_first_principles(d: dict, where: str = "system file") -> int:
    """(HBM - CUDA context - NCCL buffers of the communicators in use) / (1 + allocator fragmentation): the
    largest max_memory_allocated that fits, from a system file's numbers."""
    nccl = NCCL_COMMUNICATORS_IN_USE * int(d["nccl_bytes_per_communicator"])
    free = int(d["hbm_bytes"]) - int(d["cuda_context_bytes"]) - nccl
    if free <= 0:
        raise SchemaError(f"{where}: field hbm_bytes ({int(d['hbm_bytes'])}) must exceed cuda_context_bytes + "
                          f"{NCCL_COMMUNICATORS_IN_USE} x nccl_bytes_per_communicator ({int(d['cuda_context_bytes']) + nccl})")
    return int(free / (1.0 + float(d["allocator_fragmentation_fraction"])))


def system_from_dict(name: str, d: dict, *, where: Optional[str] = None) -> SystemSpec:
    """Build a SystemSpec from a system file's dict (efficiencies inline or by ``efficiency_set``), checked by
    :func:`h3t_ext.costmodel.schema.check_system_dict` (SchemaError, a ValueError, names the field)."""
    where = where or f"system {name}"
    check_system_dict(where, d, efficiency_set_names(), tuple(plausible_ranges()), OPTIONAL_EFFICIENCIES)
    eff_name = d.get("efficiency_set", name)
    eff = dict(d["efficiencies"]) if "efficiencies" in d else efficiency_set(eff_name)
    return SystemSpec(
        name=name,
        peak_bf16_flops=float(d["peak_bf16_flops"]),
        hbm_bytes=int(d["hbm_bytes"]),
        hbm_bandwidth=float(d["hbm_bandwidth"]),
        default_memory_budget_bytes=memory_budget_from_first_principles(d, where),
        nvlink_bandwidth=float(d["nvlink_bandwidth"]),
        network_bandwidth=float(d["network_bandwidth"]),
        pcie_bandwidth=float(d["pcie_bandwidth"]),
        gpus_per_node=int(d["gpus_per_node"]),
        peak_fp8_flops=float(d.get("peak_fp8_flops") or 0.0),
        compute_capability=float(d.get("compute_capability") or 0.0),
        num_sms=int(d["num_sms"]),
        gemm_tile_m=int(d["gemm_tile_m"]),
        gemm_tile_n=int(d["gemm_tile_n"]),
        kernel_launch_s=float(d["kernel_launch_s"]),
        nvlink_latency_s=float(d["nvlink_latency_s"]),
        network_latency_s=float(d["network_latency_s"]),
        cuda_context_bytes=int(d["cuda_context_bytes"]),
        allocator_fragmentation_fraction=float(d["allocator_fragmentation_fraction"]),
        nccl_bytes_per_communicator=int(d["nccl_bytes_per_communicator"]),
        host_memory_bytes=int(d.get("host_memory_bytes") or 0),
        host_memory_bandwidth=float(d.get("host_memory_bandwidth") or 0.0),
        host_gpus=int(d.get("gpus_per_host") or 0),
        efficiencies=MappingProxyType({k: float(v) for k, v in eff.items() if not k.startswith("_")}),
        source=d["source"],
        efficiency_set=eff_name,
    )
