// Builds and validates copy plans (see copy_plan.h). No torch, no CUDA.
#include "copy_plan.h"

#include <algorithm>
#include <numeric>

namespace h3t {

namespace {

void require_same_length(std::size_t expected, std::size_t got, const char* name) {
  if (got != expected) {
    throw CopyError(std::string(name) + " has " + std::to_string(got) + " entries, expected " +
                    std::to_string(expected));
  }
}

}  // namespace

void validate_disjoint(const std::vector<std::size_t>& offsets, const std::vector<std::size_t>& sizes) {
  std::vector<std::size_t> order(offsets.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return offsets[a] < offsets[b]; });
  std::size_t prev_end = 0;
  std::size_t prev = SIZE_MAX;
  for (std::size_t k : order) {
    if (sizes[k] == 0) continue;
    if (prev != SIZE_MAX && offsets[k] < prev_end) {
      throw CopyError(at_index("offsets", k) + " overlaps the region of " + at_index("offsets", prev));
    }
    prev_end = offsets[k] + sizes[k];  // validated against the buffer already: no overflow
    prev = k;
  }
}

std::vector<CopyTask> plan_batched(const std::vector<std::uintptr_t>& dsts,
                                   const std::vector<std::uintptr_t>& srcs,
                                   const std::vector<std::size_t>& nbytes) {
  require_same_length(dsts.size(), srcs.size(), "srcs");
  require_same_length(dsts.size(), nbytes.size(), "nbytes");
  std::vector<CopyTask> tasks;
  tasks.reserve(dsts.size());
  for (std::size_t i = 0; i < dsts.size(); ++i) {
    tasks.push_back(CopyTask{reinterpret_cast<char*>(dsts[i]), reinterpret_cast<const char*>(srcs[i]),
                             1, nbytes[i], nbytes[i], nbytes[i]});
  }
  validate_tasks(tasks);
  return tasks;
}

std::vector<CopyTask> plan_2d(const std::vector<std::uintptr_t>& dsts,
                              const std::vector<std::size_t>& dst_pitches,
                              const std::vector<std::uintptr_t>& srcs,
                              const std::vector<std::size_t>& src_pitches,
                              const std::vector<std::size_t>& widths,
                              const std::vector<std::size_t>& heights) {
  const std::size_t n = dsts.size();
  require_same_length(n, dst_pitches.size(), "dst_pitches");
  require_same_length(n, srcs.size(), "srcs");
  require_same_length(n, src_pitches.size(), "src_pitches");
  require_same_length(n, widths.size(), "widths");
  require_same_length(n, heights.size(), "heights");
  std::vector<CopyTask> tasks;
  tasks.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    tasks.push_back(CopyTask{reinterpret_cast<char*>(dsts[i]), reinterpret_cast<const char*>(srcs[i]),
                             heights[i], widths[i], dst_pitches[i], src_pitches[i]});
  }
  validate_tasks(tasks);
  return tasks;
}

std::vector<CopyTask> plan_pack(bool gather, std::uintptr_t buffer, std::size_t buffer_nbytes,
                                const std::vector<std::uintptr_t>& ptrs,
                                const std::vector<std::size_t>& offsets,
                                const std::vector<std::size_t>& row_bytes,
                                const std::vector<std::size_t>& rows,
                                const std::vector<std::size_t>& pitches) {
  const std::size_t n = ptrs.size();
  require_same_length(n, offsets.size(), "offsets");
  require_same_length(n, row_bytes.size(), "row_bytes");
  require_same_length(n, rows.size(), "rows");
  require_same_length(n, pitches.size(), "pitches");
  if (buffer == 0 && buffer_nbytes != 0) throw CopyError("buffer is a null pointer");
  std::vector<std::size_t> sizes(n);
  std::vector<CopyTask> tasks;
  tasks.reserve(n);
  char* base = reinterpret_cast<char*>(buffer);
  for (std::size_t i = 0; i < n; ++i) {
    if (__builtin_mul_overflow(rows[i], row_bytes[i], &sizes[i])) {
      throw CopyError(at_index("rows", i) + " * row_bytes overflows size_t");
    }
    validate_in_buffer(offsets[i], sizes[i], buffer_nbytes, i);
    char* packed = base + offsets[i];
    char* tensor = reinterpret_cast<char*>(ptrs[i]);
    if (gather) {
      tasks.push_back(CopyTask{packed, tensor, rows[i], row_bytes[i], row_bytes[i], pitches[i]});
    } else {
      tasks.push_back(CopyTask{tensor, packed, rows[i], row_bytes[i], pitches[i], row_bytes[i]});
    }
  }
  if (gather) validate_disjoint(offsets, sizes);
  validate_tasks(tasks);
  return tasks;
}

}  // namespace h3t
