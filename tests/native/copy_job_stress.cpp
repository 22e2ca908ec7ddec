// Stress driver for h3t::CopyJob, built by tests/test_kernels_threads.py (under
// ThreadSanitizer when the compiler supports it): random batches added and published in
// random steps while up to three threads copy, with tiny odd chunks; every finished batch
// must equal its sources, and a job destroyed mid-batch must stop cleanly. Exit 0 on success.
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "copy_cpu.h"

int main() {
  std::mt19937 rng(1);
  for (int round = 0; round < 200; ++round) {
    const int n = 1 + static_cast<int>(rng() % 64);
    std::vector<std::vector<char>> src(n), dst(n);
    h3t::CpuCopyOptions options;
    options.parallel_threshold = 0;
    options.min_bytes_per_thread = 1;
    options.max_threads = 3;
    options.chunk_bytes = 1 + rng() % 5000;
    options.streaming_threshold = round % 2 ? 0 : SIZE_MAX;
    std::size_t total = 0;
    for (int i = 0; i < n; ++i) {
      const std::size_t bytes = rng() % 20000;
      src[i].resize(bytes);
      dst[i].assign(bytes, 0);
      for (char& c : src[i]) c = static_cast<char>(rng());
      total += bytes;
    }
    const bool abandon = round % 5 == 0;  // destroyed without finish(): must join and return
    {
      h3t::CopyJob job(n, total, options);
      for (int i = 0; i < n; ++i) {
        const std::size_t bytes = src[i].size();
        job.add(h3t::CopyTask{dst[i].data(), src[i].data(), 1, bytes, bytes, bytes});
        if (rng() % 3 == 0) job.publish();
      }
      if (!abandon && job.finish() == 0 && total != 0) {
        std::printf("round %d: finish() reported no threads for %zu bytes\n", round, total);
        return 1;
      }
    }
    for (int i = 0; i < n && !abandon; ++i) {
      if (std::memcmp(dst[i].data(), src[i].data(), src[i].size()) != 0) {
        std::printf("round %d: task %d differs from its source\n", round, i);
        return 1;
      }
    }
  }
  std::printf("ok\n");
  return 0;
}
