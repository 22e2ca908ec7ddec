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

// Threads run_tasks() would use for `total_bytes` under `options`.
unsigned plan_threads(std::size_t total_bytes, const CpuCopyOptions& options);

// Executes validated tasks. The byte stream of all tasks (in order) is cut into chunks
// that the threads take one at a time, so a single large tensor is split as well as many
// small ones. Returns the number of threads used.
unsigned run_tasks(const std::vector<CopyTask>& tasks, const CpuCopyOptions& options);

// What _copy_cpu lends its tensor front end (_copy_torch) through the capsule named
// kCpuApiCapsule: its one copy executor and the options its setters change, so both
// modules copy with the same code and knobs. Both are compiled from this header in one
// build; bump the suffix when the struct changes.
struct CpuCopyApi {
  const CpuCopyOptions* options;
  unsigned (*run_tasks)(const std::vector<CopyTask>& tasks, const CpuCopyOptions& options);
};
inline constexpr const char* kCpuApiCapsule = "h3t_ext.kernels._copy_cpu.CpuCopyApi.v1";

}  // namespace h3t
