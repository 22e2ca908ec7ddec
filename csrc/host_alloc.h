// Page-aligned host allocations placed on a NUMA node (plain C++, Linux syscalls only;
// no libnuma). Used for offload buffers; the CUDA module pins them with cudaHostRegister.
#pragma once

#include <cstddef>
#include <string>

namespace h3t {

// mmap()s nbytes (rounded up to whole pages) and, when numa_node >= 0, binds the range to
// that node (mbind, MPOL_PREFERRED) before first touch; touches every page when populate.
// Throws std::runtime_error on failure.
void* alloc_host(std::size_t nbytes, int numa_node, bool populate);

// Releases a range from alloc_host (same nbytes).
void free_host(void* ptr, std::size_t nbytes);

// NUMA node of a PCI device ("0000:3b:00.0"), -1 when unknown (no sysfs entry, or the
// platform reports -1).
int pci_numa_node(const std::string& pci_bus_id);

// NUMA node that currently backs the page holding ptr, -1 when it cannot be queried.
int numa_node_of(const void* ptr);

}  // namespace h3t
