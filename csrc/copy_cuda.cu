// CUDA copy kernels for h3t-ext (see copy_cuda.h). Compiled only where CUDA is present.
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "copy_cuda.h"
#include "host_alloc.h"

namespace h3t {
namespace cuda {

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("h3t copy kernels: ") + what + ": " + cudaGetErrorString(err));
  }
}

bool contiguous(const CopyTask& t) {
  return t.rows == 1 || (t.dst_pitch == t.row_bytes && t.src_pitch == t.row_bytes);
}

// Up to kPerLaunch contiguous copies passed by value as the kernel parameter (< 4 KiB).
constexpr int kPerLaunch = 128;
struct KernelBatch {
  const char* src[kPerLaunch];
  char* dst[kPerLaunch];
  std::size_t bytes[kPerLaunch];
  int n;
};

// blockIdx.y selects the copy; the blocks along x stride over its bytes, 16 at a time
// when both pointers are 16-byte aligned.
__global__ void batched_copy_kernel(KernelBatch b) {
  const int t = blockIdx.y;
  if (t >= b.n) return;
  const char* s = b.src[t];
  char* d = b.dst[t];
  const std::size_t n = b.bytes[t];
  const std::size_t first = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  std::size_t done = 0;
  if (((reinterpret_cast<std::uintptr_t>(s) | reinterpret_cast<std::uintptr_t>(d)) & 15) == 0) {
    const std::size_t words = n / 16;
    const uint4* s4 = reinterpret_cast<const uint4*>(s);
    uint4* d4 = reinterpret_cast<uint4*>(d);
    for (std::size_t i = first; i < words; i += stride) d4[i] = s4[i];
    done = words * 16;
  }
  for (std::size_t i = done + first; i < n; i += stride) d[i] = s[i];
}

std::size_t enqueue_kernel(const std::vector<const CopyTask*>& tasks, cudaStream_t stream) {
  std::size_t launches = 0;
  for (std::size_t base = 0; base < tasks.size(); base += kPerLaunch) {
    KernelBatch b{};
    std::size_t largest = 0;
    b.n = static_cast<int>(std::min<std::size_t>(kPerLaunch, tasks.size() - base));
    for (int i = 0; i < b.n; ++i) {
      const CopyTask& t = *tasks[base + i];
      b.src[i] = t.src;
      b.dst[i] = t.dst;
      b.bytes[i] = t.bytes();
      largest = std::max(largest, b.bytes[i]);
    }
    constexpr unsigned kThreads = 256;
    const std::size_t want = (largest + kThreads * 16 - 1) / (kThreads * 16);
    const dim3 grid(static_cast<unsigned>(std::clamp<std::size_t>(want, 1, 64)), static_cast<unsigned>(b.n));
    batched_copy_kernel<<<grid, kThreads, 0, stream>>>(b);
    check(cudaGetLastError(), "batched_copy_kernel launch");
    ++launches;
  }
  return launches;
}

// One cudaMemcpyBatchAsync for all contiguous tasks; false when the runtime or the stream
// does not support it (the caller then loops).
bool enqueue_batch_api(const std::vector<const CopyTask*>& tasks, cudaStream_t stream) {
#if CUDART_VERSION >= 12080
  if (stream == nullptr || tasks.empty()) return false;  // the legacy stream is not allowed
  std::vector<void*> dsts(tasks.size());
  std::vector<const void*> srcs(tasks.size());
  std::vector<std::size_t> sizes(tasks.size());
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    dsts[i] = tasks[i]->dst;
    srcs[i] = tasks[i]->src;
    sizes[i] = tasks[i]->bytes();
  }
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  std::size_t attr_index = 0;
#if CUDART_VERSION >= 13000
  const cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), tasks.size(), &attr,
                                               &attr_index, 1, stream);
#else
  std::size_t fail_index = 0;
  const cudaError_t err = cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(),
                                               tasks.size(), &attr, &attr_index, 1, &fail_index, stream);
#endif
  if (err == cudaErrorNotSupported || err == cudaErrorInvalidValue) {
    cudaGetLastError();  // clear the (non-sticky) error and fall back to a loop
    return false;
  }
  check(err, "cudaMemcpyBatchAsync");
  return true;
#else
  (void)tasks;
  (void)stream;
  return false;
#endif
}

// A copy engine's transfer costs a few microseconds to set up whatever its size, so copies of at most this many bytes
// go through the SM kernel instead, where both pointers allow it. H200, second lease (scripts/gpu/
// bench_copy_cuda.py, side stream): 2,000 x 64 KiB between device and pinned host moved at 30 GB/s through one
// cudaMemcpyBatchAsync and 47-48 GB/s through the kernel (one 128 MiB copy: 55 GB/s); 16 x 64 MiB moved at
// 55 GB/s through the batch and 51-52 GB/s through the kernel, which also takes SMs from the compute it overlaps.
constexpr std::size_t kKernelMaxBytes = std::size_t(1) << 20;

// The pinned buffers alloc_pinned made, by address range, with whether kernels may use their host pointers. Read
// once when a buffer is made: the auto method then routes copies into and out of them without asking the driver.
// On the H200 (third lease) auto moved 2,000 x 64 KiB at 38-39 GB/s and the kernel for all at 48-49 GB/s: the
// difference, ~0.7 ms a batch, is auto's 4,000 cudaPointerGetAttributes calls (~0.18 us each).
class PinnedRegistry {
 public:
  void add(const void* p, std::size_t nbytes, bool kernel_ok) {
    std::lock_guard<std::mutex> lock(mu_);
    ranges_[reinterpret_cast<std::uintptr_t>(p)] = Range{nbytes, kernel_ok};
  }
  void remove(const void* p) {
    std::lock_guard<std::mutex> lock(mu_);
    ranges_.erase(reinterpret_cast<std::uintptr_t>(p));
  }
  // 1: inside a buffer kernels may use, 0: inside one they may not, -1: not a buffer of alloc_pinned.
  int lookup(const void* p) const {
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.upper_bound(a);
    if (it == ranges_.begin()) return -1;
    --it;
    return a - it->first < std::max<std::size_t>(it->second.nbytes, 1) ? int(it->second.kernel_ok) : -1;
  }

 private:
  struct Range {
    std::size_t nbytes;
    bool kernel_ok;
  };
  mutable std::mutex mu_;
  std::map<std::uintptr_t, Range> ranges_;
};

PinnedRegistry& pinned_registry() {
  static PinnedRegistry* registry = new PinnedRegistry();  // never destroyed: buffers may outlive static teardown
  return *registry;
}

// What the driver says: true when a kernel on `device` may read or write `p`: memory of this device, managed
// memory, or pinned host memory mapped at the same address (cudaHostAlloc under unified addressing;
// cudaHostRegister where the device can use the host pointer). Pageable host memory and other devices' memory are
// not.
bool query_kernel_accessible(const void* p, int device) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // not a pointer CUDA knows: leave it to the copy engines
    return false;
  }
  switch (a.type) {
    case cudaMemoryTypeDevice: return a.device == device;
    case cudaMemoryTypeManaged: return true;
    case cudaMemoryTypeHost: return a.devicePointer == p;
    default: return false;
  }
}

// query_kernel_accessible, answered without the driver for what the caller marked as this device's memory
// (`known`) and for the buffers of alloc_pinned.
bool kernel_accessible(const void* p, bool known, int device) {
  if (known) return true;
  const int pinned = pinned_registry().lookup(p);
  if (pinned >= 0) return pinned == 1;
  return query_kernel_accessible(p, device);
}

bool to_kernel(const CopyTask& t, int device) {
  return t.bytes() <= kKernelMaxBytes && kernel_accessible(t.src, t.on_device & kSrcOnDevice, device) &&
         kernel_accessible(t.dst, t.on_device & kDstOnDevice, device);
}

int current_device() {
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

// Splits contiguous tasks into those for the SM kernel (small, both sides kernel-accessible) and the rest.
void split_small(const std::vector<const CopyTask*>& tasks, std::vector<const CopyTask*>* small,
                 std::vector<const CopyTask*>* dma) {
  const int device = current_device();
  for (const CopyTask* t : tasks) (to_kernel(*t, device) ? small : dma)->push_back(t);
}

}  // namespace

std::vector<bool> kernel_routes(const std::vector<CopyTask>& tasks) {
  const int device = current_device();
  std::vector<bool> routes;
  routes.reserve(tasks.size());
  for (const CopyTask& t : tasks) routes.push_back(t.bytes() > 0 && contiguous(t) && to_kernel(t, device));
  return routes;
}

std::size_t enqueue_tasks(const std::vector<CopyTask>& tasks, std::uintptr_t stream_handle, Method method) {
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  std::vector<const CopyTask*> flat;
  std::size_t calls = 0;
  for (const CopyTask& t : tasks) {
    if (t.bytes() == 0) continue;
    if (contiguous(t)) {
      flat.push_back(&t);
    } else {
      check(cudaMemcpy2DAsync(t.dst, t.dst_pitch, t.src, t.src_pitch, t.row_bytes, t.rows, cudaMemcpyDefault,
                              stream),
            "cudaMemcpy2DAsync");
      ++calls;
    }
  }
  if (flat.empty()) return calls;
  if (method == Method::kKernel) return calls + enqueue_kernel(flat, stream);
  if (method == Method::kAuto) {
    std::vector<const CopyTask*> small, dma;
    split_small(flat, &small, &dma);
    if (!small.empty()) calls += enqueue_kernel(small, stream);
    if (dma.empty()) return calls;
    if (enqueue_batch_api(dma, stream)) return calls + 1;
    flat.swap(dma);
  }
  for (const CopyTask* t : flat) {
    check(cudaMemcpyAsync(t->dst, t->src, t->bytes(), cudaMemcpyDefault, stream), "cudaMemcpyAsync");
  }
  return calls + flat.size();
}

int device_numa_node(int device) {
  char bus_id[32] = {0};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return pci_numa_node(bus_id);
}

namespace {
// Makes `device` current for its lifetime and restores the caller's device on every exit path,
// so allocating pinned memory "for" a GPU never changes which GPU the caller's thread works on.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};
}  // namespace

void* alloc_pinned(std::size_t nbytes, int device, bool numa_local, int* numa_node, bool* registered) {
  const std::size_t n = std::max<std::size_t>(nbytes, 1);
  *numa_node = numa_local ? device_numa_node(device) : -1;
  *registered = false;
  DeviceGuard guard(device);
  if (*numa_node >= 0) {
    void* p = alloc_host(n, *numa_node, /*populate=*/true);
    const cudaError_t err = cudaHostRegister(p, n, cudaHostRegisterPortable);
    if (err != cudaSuccess) {
      free_host(p, n);
      check(err, "cudaHostRegister");
    }
    *registered = true;
    pinned_registry().add(p, n, query_kernel_accessible(p, device));
    return p;
  }
  void* p = nullptr;
  check(cudaHostAlloc(&p, n, cudaHostAllocPortable), "cudaHostAlloc");
  pinned_registry().add(p, n, query_kernel_accessible(p, device));
  return p;
}

void free_pinned(void* ptr, std::size_t nbytes, bool registered) {
  if (ptr == nullptr) return;
  pinned_registry().remove(ptr);
  if (registered) {
    cudaHostUnregister(ptr);
    free_host(ptr, std::max<std::size_t>(nbytes, 1));
  } else {
    cudaFreeHost(ptr);
  }
}

void stream_synchronize(std::uintptr_t stream) {
  check(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)), "cudaStreamSynchronize");
}

int runtime_version() {
  int v = 0;
  check(cudaRuntimeGetVersion(&v), "cudaRuntimeGetVersion");
  return v;
}

}  // namespace cuda
}  // namespace h3t
