// Copy plans shared by the CPU and CUDA copy kernels of h3t-ext.
//
// Everything here is plain C++17 over raw pointers and byte counts: no torch and no
// CUDA headers, so the same validation runs in front of both implementations.
//
// A copy task is a row-strided (2D) copy: `rows` rows of `row_bytes` bytes, the i-th
// row read from `src + i * src_pitch` and written to `dst + i * dst_pitch`. A plain
// contiguous copy of n bytes is the task {rows = 1, row_bytes = n}.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace h3t {

struct CopyTask {
  char* dst;
  const char* src;
  std::size_t rows;
  std::size_t row_bytes;
  std::size_t dst_pitch;
  std::size_t src_pitch;
  // CUDA only: bit 0 (kDstOnDevice) / bit 1 (kSrcOnDevice) when the caller knows dst / src is memory of the device
  // the copy runs on (a CUDA tensor of it), so the auto method need not ask the driver where the pointer lives.
  std::uint8_t on_device = 0;

  std::size_t bytes() const { return rows * row_bytes; }
};

constexpr std::uint8_t kDstOnDevice = 1;
constexpr std::uint8_t kSrcOnDevice = 2;

// The byte layout of CopyTask (its size, then each field's offset): a plan packed into bytes by one module (the tensor
// front end's cuda_copy_plan) is read by another (the CUDA module's batched_copy_planned) only where both report the
// same layout, i.e. were built alike.
inline std::vector<std::size_t> task_layout() {
  return {sizeof(CopyTask),           offsetof(CopyTask, dst),       offsetof(CopyTask, src),
          offsetof(CopyTask, rows),   offsetof(CopyTask, row_bytes), offsetof(CopyTask, dst_pitch),
          offsetof(CopyTask, src_pitch), offsetof(CopyTask, on_device)};
}

// One line naming the offending argument and index, raised as ValueError in Python.
class CopyError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

inline std::string at_index(const char* what, std::size_t i) {
  return std::string(what) + "[" + std::to_string(i) + "]";
}

// Checks a task's on_device marks (CopyTask::on_device), named `what` in the error: 0-3.
inline void check_on_device(std::uint8_t bits, const std::string& what) {
  if (bits > (kDstOnDevice | kSrcOnDevice)) {
    throw CopyError(what + " must be 0-3 (bit 0: dst, bit 1: src on the device), got " + std::to_string(bits));
  }
}

// Checked a * b + c for extents; throws (naming what[i]) when it does not fit in size_t.
// The name is built only on error: this runs once per tensor of every batch.
inline std::size_t checked_extent(std::size_t rows, std::size_t pitch, std::size_t row_bytes,
                                  const char* what, std::size_t i) {
  if (rows == 0 || row_bytes == 0) return 0;
  std::size_t span = 0;
  if (__builtin_mul_overflow(rows - 1, pitch, &span) ||
      __builtin_add_overflow(span, row_bytes, &span)) {
    throw CopyError(at_index(what, i) + ": extent overflows size_t");
  }
  return span;
}

// Validates one task: non-null pointers when bytes move, rows of the destination do not
// overlap each other, and source and destination regions do not overlap (memcpy rule).
inline void validate_task(const CopyTask& t, std::size_t i) {
  std::size_t bytes = 0;
  if (__builtin_mul_overflow(t.rows, t.row_bytes, &bytes)) {
    throw CopyError(at_index("task", i) + ": rows * row_bytes overflows size_t");
  }
  if (bytes == 0) return;
  if (t.dst == nullptr) throw CopyError(at_index("dsts", i) + " is a null pointer");
  if (t.src == nullptr) throw CopyError(at_index("srcs", i) + " is a null pointer");
  if (t.rows > 1 && t.dst_pitch < t.row_bytes) {
    throw CopyError(at_index("dst_pitches", i) + " is smaller than the row width: rows would overlap");
  }
  const std::size_t dst_span = checked_extent(t.rows, t.dst_pitch, t.row_bytes, "dsts", i);
  const std::size_t src_span = checked_extent(t.rows, t.src_pitch, t.row_bytes, "srcs", i);
  const auto d0 = reinterpret_cast<std::uintptr_t>(t.dst);
  const auto s0 = reinterpret_cast<std::uintptr_t>(t.src);
  if (d0 > UINTPTR_MAX - dst_span || s0 > UINTPTR_MAX - src_span) {
    throw CopyError(at_index("task", i) + ": address range wraps around");
  }
  if (d0 < s0 + src_span && s0 < d0 + dst_span) {
    throw CopyError(at_index("dsts", i) + " overlaps " + at_index("srcs", i));
  }
}

inline void validate_tasks(const std::vector<CopyTask>& tasks) {
  for (std::size_t i = 0; i < tasks.size(); ++i) validate_task(tasks[i], i);
}

// Checks that [offset, offset + nbytes) lies inside a buffer of buffer_nbytes bytes.
inline void validate_in_buffer(std::size_t offset, std::size_t nbytes, std::size_t buffer_nbytes,
                               std::size_t i) {
  std::size_t end = 0;
  if (__builtin_add_overflow(offset, nbytes, &end) || end > buffer_nbytes) {
    throw CopyError(at_index("offsets", i) + " = " + std::to_string(offset) + " with " +
                    std::to_string(nbytes) + " bytes runs past the buffer of " +
                    std::to_string(buffer_nbytes) + " bytes");
  }
}

// Rejects gather regions that overlap inside the buffer (concurrent writes would race).
void validate_disjoint(const std::vector<std::size_t>& offsets, const std::vector<std::size_t>& sizes);

// Builds tasks for a batch of contiguous copies; sizes must all be the same length.
std::vector<CopyTask> plan_batched(const std::vector<std::uintptr_t>& dsts,
                                   const std::vector<std::uintptr_t>& srcs,
                                   const std::vector<std::size_t>& nbytes);

// Builds tasks for a batch of row-strided copies (cudaMemcpy2D argument order).
std::vector<CopyTask> plan_2d(const std::vector<std::uintptr_t>& dsts,
                              const std::vector<std::size_t>& dst_pitches,
                              const std::vector<std::uintptr_t>& srcs,
                              const std::vector<std::size_t>& src_pitches,
                              const std::vector<std::size_t>& widths,
                              const std::vector<std::size_t>& heights);

// Builds tasks that pack (gather=true) or unpack (gather=false) row-strided tensors
// into/out of one contiguous buffer: tensor i occupies rows[i] * row_bytes[i] bytes at
// offsets[i]. `pitches` is the tensor-side pitch.
std::vector<CopyTask> plan_pack(bool gather, std::uintptr_t buffer, std::size_t buffer_nbytes,
                                const std::vector<std::uintptr_t>& ptrs,
                                const std::vector<std::size_t>& offsets,
                                const std::vector<std::size_t>& row_bytes,
                                const std::vector<std::size_t>& rows,
                                const std::vector<std::size_t>& pitches);

}  // namespace h3t
