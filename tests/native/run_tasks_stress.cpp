// Stress driver for h3t::run_tasks, built by tests/integration/test_kernels_threads.py (under
// ThreadSanitizer when the compiler supports it): random batches of contiguous and
// row-strided tasks copied by up to three threads in odd-sized chunks, with and without
// non-temporal stores; every destination must equal its source and the gaps between
// strided rows must stay untouched. Exit 0 on success.
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "copy_cpu.h"

int main() {
  std::mt19937 rng(1);
  for (int round = 0; round < 200; ++round) {
    const int n = 1 + static_cast<int>(rng() % 48);
    h3t::CpuCopyOptions options;
    options.parallel_threshold = 0;
    options.min_bytes_per_thread = 1;
    options.max_threads = 3;
    options.chunk_bytes = round % 7 ? 1 + rng() % 5000 : 0;
    options.streaming_threshold = round % 2 ? 0 : SIZE_MAX;
    std::vector<std::vector<char>> src(n), dst(n);
    std::vector<h3t::CopyTask> tasks;
    for (int i = 0; i < n; ++i) {
      const std::size_t rows = 1 + rng() % 8, width = rng() % 9000;
      const std::size_t gap = rng() % 2 ? 0 : 1 + rng() % 64;
      src[i].resize(rows * width);
      dst[i].assign(rows * (width + gap), 0x5a);
      for (char& c : src[i]) c = static_cast<char>(rng());
      tasks.push_back(h3t::CopyTask{dst[i].data(), src[i].data(), rows, width, width + gap, width});
    }
    h3t::validate_tasks(tasks);
    h3t::run_tasks(tasks, options);
    for (int i = 0; i < n; ++i) {
      const h3t::CopyTask& t = tasks[i];
      for (std::size_t r = 0; r < t.rows; ++r) {
        const char* row = dst[i].data() + r * t.dst_pitch;
        bool ok = std::memcmp(row, src[i].data() + r * t.row_bytes, t.row_bytes) == 0;
        for (std::size_t g = t.row_bytes; g < t.dst_pitch; ++g) ok = ok && row[g] == 0x5a;
        if (!ok) {
          std::printf("round %d: task %d row %zu differs from its source or its gap was written\n", round, i, r);
          return 1;
        }
      }
    }
  }
  std::printf("ok\n");
  return 0;
}
