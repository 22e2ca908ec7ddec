// CUDA copy kernels for h3t-ext: the host-side API, in plain C++ (no CUDA headers), so
// the pybind11 bindings compile with the host compiler and only copy_cuda.cu needs nvcc.
// Streams are passed as integer handles (torch.cuda.Stream.cuda_stream); 0 is the legacy
// default stream.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "copy_plan.h"

namespace h3t {
namespace cuda {

enum class Method {
  kAuto = 0,    // contiguous tasks of at most 1 MiB whose pointers a kernel may use: the SM copy kernel; the
                // other contiguous ones: one cudaMemcpyBatchAsync (CUDA >= 12.8, not the legacy stream), else a loop
  kLoop = 1,    // one cudaMemcpyAsync / cudaMemcpy2DAsync per task
  kKernel = 2,  // SM copy kernel; every pointer must be device-accessible (device or pinned)
};

// Enqueues validated tasks on `stream`; asynchronous with respect to the host. Returns
// the number of CUDA API calls issued. Throws std::runtime_error on a CUDA error.
std::size_t enqueue_tasks(const std::vector<CopyTask>& tasks, std::uintptr_t stream, Method method);

// For each task, whether the auto method copies it with the SM kernel (contiguous, at most 1 MiB, both pointers
// kernel-accessible from the current device), as enqueue_tasks decides it.
std::vector<bool> kernel_routes(const std::vector<CopyTask>& tasks);

// Pinned host memory of nbytes for `device`. With numa_local, pages are bound to the NUMA
// node of the GPU's PCI slot (when the platform reports one) and then registered;
// otherwise cudaHostAlloc. `numa_node` receives the node used (-1: none).
void* alloc_pinned(std::size_t nbytes, int device, bool numa_local, int* numa_node, bool* registered);
void free_pinned(void* ptr, std::size_t nbytes, bool registered);

// NUMA node of a GPU's PCI slot, -1 when unknown.
int device_numa_node(int device);

void stream_synchronize(std::uintptr_t stream);
int runtime_version();

}  // namespace cuda
}  // namespace h3t
