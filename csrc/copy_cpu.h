// Multithreaded host memory copies for h3t-ext (plain C++, no torch headers).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <thread>
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
  // Threads take the batch in chunks of at most this many bytes, dynamically (0: one per thread).
  std::size_t chunk_bytes = std::size_t{1} << 20;
  // Batches of at least this many bytes (about the size of the last-level cache) are
  // written with non-temporal stores, bypassing the caches. SIZE_MAX disables it.
  std::size_t streaming_threshold = std::size_t{32} << 20;
};

// Threads a batch of `total_bytes` uses under `options`.
unsigned plan_threads(std::size_t total_bytes, const CpuCopyOptions& options);

// One batch of copies that starts while its tasks are still being produced.
//
// The producer (one thread, e.g. the one reading tensor attributes under the GIL) add()s
// validated tasks and publish()es them; worker threads copy published bytes meanwhile, in
// chunks taken from the concatenated byte stream of all tasks, so one large tensor is
// split as well as many small ones are grouped. finish() makes the caller copy too and
// returns once every published byte has landed. The destructor does the same without
// the caller's help, so an exception between add() calls never leaves a thread running;
// whatever was published is copied, nothing else.
class CopyJob {
 public:
  // `capacity`: most tasks that will be added. `expected_bytes` (the batch total, or an
  // estimate) picks the thread count and whether stores bypass the caches.
  CopyJob(std::size_t capacity, std::size_t expected_bytes, const CpuCopyOptions& options);
  ~CopyJob();
  CopyJob(const CopyJob&) = delete;
  CopyJob& operator=(const CopyJob&) = delete;

  // Producer only. Zero-byte tasks are dropped; throws CopyError past `capacity`.
  void add(const CopyTask& task);
  // Producer only: lets the workers take every task added so far.
  void publish();
  // Producer only, once: publishes, copies alongside the workers, joins them. Returns the
  // threads used (0 when no bytes moved).
  unsigned finish();

 private:
  bool take(std::size_t& begin, std::size_t& end, std::size_t& tasks);
  void copy(std::size_t begin, std::size_t end, std::size_t tasks) const;
  void work();
  void stop();

  CpuCopyOptions options_;
  unsigned threads_;
  bool streaming_;
  // Fixed arrays, not vectors: workers read the published prefix while the producer
  // appends behind it.
  std::size_t capacity_;
  std::unique_ptr<CopyTask[]> tasks_;
  std::unique_ptr<std::size_t[]> starts_;  // starts_[i]: offset of task i in the byte stream
  std::size_t added_tasks_ = 0;            // producer only
  std::size_t added_bytes_ = 0;            // producer only
  std::mutex mutex_;
  std::condition_variable ready_;
  std::size_t published_tasks_ = 0;  // guarded by mutex_
  std::size_t published_bytes_ = 0;  // guarded by mutex_
  std::size_t cursor_ = 0;           // guarded by mutex_: next byte to hand out
  bool closed_ = false;              // guarded by mutex_: nothing more will be published
  std::vector<std::thread> workers_;
};

// Copies validated tasks as one batch (a CopyJob fed all at once); returns threads used.
unsigned run_tasks(const std::vector<CopyTask>& tasks, const CpuCopyOptions& options);

}  // namespace h3t
