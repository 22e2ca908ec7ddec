// Multithreaded host memory copies for h3t-ext (plain C++, no torch headers).
#pragma once

#include <cstddef>
#include <vector>

#include "copy_plan.h"

namespace h3t {

struct CpuCopyOptions {
  // Worker threads including the caller; 0 means the cores in this process's affinity mask.
  unsigned max_threads = 0;
  // Batches moving fewer bytes than this run on the calling thread only.
  std::size_t parallel_threshold = std::size_t{1} << 20;
  // Smallest share of bytes given to one thread.
  std::size_t min_bytes_per_thread = std::size_t{256} << 10;
  // Threads take the batch in chunks of this many bytes, dynamically (0: one per thread).
  std::size_t chunk_bytes = std::size_t{1} << 20;
  // Batches of at least this many bytes (about the size of the last-level cache) are
  // written with non-temporal stores, bypassing the caches. SIZE_MAX disables it.
  std::size_t streaming_threshold = std::size_t{32} << 20;
};

// Name of the capsule through which _copy_cpu shares its CpuCopyOptions with _copy_torch
// (both compiled from this header in one build; bump the suffix when the struct changes).
inline constexpr const char* kOptionsCapsule = "h3t_ext.kernels._copy_cpu.CpuCopyOptions.v1";

// Threads run_tasks() would use for `total_bytes` under `options`.
unsigned plan_threads(std::size_t total_bytes, const CpuCopyOptions& options);

// Executes validated tasks. The byte stream of all tasks (in order) is cut into chunks
// that the threads take one at a time, so a single large tensor is split as well as many
// small ones. Returns the number of threads used.
unsigned run_tasks(const std::vector<CopyTask>& tasks, const CpuCopyOptions& options);

}  // namespace h3t
