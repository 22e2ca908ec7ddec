"""The native copy kernels' sources and their sysfs reader.

No iostreams in csrc/: the first GPU run crashed in ``std::ifstream >> int`` inside the CUDA module
(``std::codecvt::do_unshift``, the iostream code of another libstdc++ already in the Python process); the NUMA node of
a GPU's PCI slot is read with POSIX ``read`` and ``strtol`` (docs/gpu-reports/)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from h3t_ext.kernels import _backend

CSRC = Path(__file__).resolve().parents[2] / "csrc"
PCI = Path("/sys/bus/pci/devices")


def test_native_sources_use_no_iostreams():
    found = {p.name: m.group(0) for p in sorted(CSRC.iterdir()) if p.suffix in (".cpp", ".cu", ".h")
             for m in [re.search(r"#include\s*<(fstream|iostream|sstream|istream|ostream)>|std::(cout|cerr|ifstream)",
                                 p.read_text())] if m}
    assert found == {}


cpu = _backend.cpu_module()


@pytest.mark.skipif(cpu is None, reason="the native CPU module is not built (setup.py build_ext)")
def test_pci_numa_node_reads_sysfs():
    devices = sorted(os.listdir(PCI))[:8] if PCI.is_dir() else []
    for d in devices:
        assert cpu.pci_numa_node(d) == int((PCI / d / "numa_node").read_text().strip()), d
    assert cpu.pci_numa_node("0000:ff:ff.7") == -1  # no such device
    assert cpu.pci_numa_node("../../etc/passwd") == -1  # not a bus id: never a path outside sysfs
