// pybind11 module h3t_ext.kernels._copy_cuda: async copies on a given CUDA stream.
//
// Built only where CUDA is present (see setup.py). Compiled by the host compiler: the
// CUDA parts live in copy_cuda.cu behind copy_cuda.h. Callers use h3t_ext.kernels.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <string>

#include "copy_cuda.h"
#include "copy_plan.h"

namespace py = pybind11;
using Sizes = std::vector<std::size_t>;
using Ptrs = std::vector<std::uintptr_t>;
namespace hc = h3t::cuda;

namespace {

std::size_t enqueue(const std::vector<h3t::CopyTask>& tasks, std::uintptr_t stream, int method) {
  if (method < 0 || method > 2) throw h3t::CopyError("method must be 0 (auto), 1 (loop) or 2 (kernel)");
  py::gil_scoped_release release;
  return hc::enqueue_tasks(tasks, stream, static_cast<hc::Method>(method));
}

std::size_t pack(bool gather, std::uintptr_t buffer, std::size_t buffer_nbytes, const Ptrs& ptrs,
                 const Sizes& offsets, const Sizes& row_bytes, const std::optional<Sizes>& rows,
                 const std::optional<Sizes>& pitches, std::uintptr_t stream, int method) {
  const Sizes r = rows ? *rows : Sizes(ptrs.size(), 1);
  const Sizes p = pitches ? *pitches : row_bytes;
  return enqueue(h3t::plan_pack(gather, buffer, buffer_nbytes, ptrs, offsets, row_bytes, r, p), stream, method);
}

// plan_batched's tasks, marked with the caller's `on_device` bytes (one a pair: kDstOnDevice | kSrcOnDevice).
std::vector<h3t::CopyTask> batched_tasks(const Ptrs& dsts, const Ptrs& srcs, const Sizes& nbytes,
                                         const std::optional<std::string>& on_device) {
  std::vector<h3t::CopyTask> tasks = h3t::plan_batched(dsts, srcs, nbytes);
  if (!on_device) return tasks;
  if (on_device->size() != tasks.size()) {
    throw h3t::CopyError("on_device has " + std::to_string(on_device->size()) + " bytes for " +
                         std::to_string(tasks.size()) + " copies (one a copy)");
  }
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    tasks[i].on_device = static_cast<std::uint8_t>((*on_device)[i]);
    h3t::check_on_device(tasks[i].on_device, h3t::at_index("on_device", i));
  }
  return tasks;
}

// The tasks of a plan packed as bytes (bindings_torch.cpp's cuda_copy_plan), checked as plan_batched checks its
// pointer lists: a whole number of tasks, on_device bits 0-3, each task valid (h3t::validate_task).
std::vector<h3t::CopyTask> planned_tasks(const std::string& packed) {
  if (packed.size() % sizeof(h3t::CopyTask)) {
    throw h3t::CopyError("tasks has " + std::to_string(packed.size()) + " bytes, not a multiple of a task's " +
                         std::to_string(sizeof(h3t::CopyTask)) + " (a plan from another build?)");
  }
  std::vector<h3t::CopyTask> tasks(packed.size() / sizeof(h3t::CopyTask));
  if (!tasks.empty()) std::memcpy(static_cast<void*>(tasks.data()), packed.data(), packed.size());
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    h3t::check_on_device(tasks[i].on_device, h3t::at_index("tasks", i) + ".on_device");
    h3t::validate_task(tasks[i], i);
  }
  return tasks;
}

struct PinnedBuffer {
  void* ptr = nullptr;
  std::size_t nbytes = 0;
  int device = 0;
  int numa_node = -1;
  bool registered = false;
  PinnedBuffer(std::size_t n, int dev, bool numa_local) : nbytes(n), device(dev) {
    ptr = hc::alloc_pinned(n, dev, numa_local, &numa_node, &registered);
  }
  ~PinnedBuffer() { hc::free_pinned(ptr, nbytes, registered); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
};

}  // namespace

PYBIND11_MODULE(_copy_cuda, m) {
  m.doc() = "h3t-ext CUDA copy kernels (raw pointers, stream handles; use h3t_ext.kernels instead)";
  py::register_exception<h3t::CopyError>(m, "CopyError", PyExc_ValueError);

  m.def("batched_copy",
        [](const Ptrs& dsts, const Ptrs& srcs, const Sizes& nbytes, std::uintptr_t stream, int method,
           const std::optional<std::string>& on_device) {
          return enqueue(batched_tasks(dsts, srcs, nbytes, on_device), stream, method);
        },
        py::arg("dsts"), py::arg("srcs"), py::arg("nbytes"), py::arg("stream"), py::arg("method") = 0,
        py::arg("on_device") = py::none(),
        "Enqueues nbytes[i] from srcs[i] to dsts[i] on stream; returns CUDA calls issued. on_device (bytes, one a "
        "copy): bit 0 / bit 1 when dsts[i] / srcs[i] is known to be memory of the current device.");
  m.def("batched_copy_planned",
        [](const py::bytes& tasks, std::uintptr_t stream, int method) {
          return enqueue(planned_tasks(tasks), stream, method);
        },
        py::arg("tasks"), py::arg("stream"), py::arg("method") = 0,
        "Enqueues the copies of a plan of the tensor front end (cuda_copy_plan's tasks as bytes) on stream; returns "
        "CUDA calls issued.");
  m.attr("TASK_LAYOUT") = py::tuple(py::cast(h3t::task_layout()));
  m.def("kernel_routes",
        [](const Ptrs& dsts, const Ptrs& srcs, const Sizes& nbytes, const std::optional<std::string>& on_device) {
          return hc::kernel_routes(batched_tasks(dsts, srcs, nbytes, on_device));
        },
        py::arg("dsts"), py::arg("srcs"), py::arg("nbytes"), py::arg("on_device") = py::none(),
        "For each copy, whether the auto method gives it to the SM kernel on the current device.");
  m.def("copy_2d",
        [](const Ptrs& dsts, const Sizes& dst_pitches, const Ptrs& srcs, const Sizes& src_pitches,
           const Sizes& widths, const Sizes& heights, std::uintptr_t stream) {
          return enqueue(h3t::plan_2d(dsts, dst_pitches, srcs, src_pitches, widths, heights), stream, 0);
        },
        py::arg("dsts"), py::arg("dst_pitches"), py::arg("srcs"), py::arg("src_pitches"), py::arg("widths"),
        py::arg("heights"), py::arg("stream"));
  m.def("gather",
        [](std::uintptr_t buffer, std::size_t buffer_nbytes, const Ptrs& srcs, const Sizes& offsets,
           const Sizes& row_bytes, const std::optional<Sizes>& rows, const std::optional<Sizes>& pitches,
           std::uintptr_t stream, int method) {
          return pack(true, buffer, buffer_nbytes, srcs, offsets, row_bytes, rows, pitches, stream, method);
        },
        py::arg("buffer"), py::arg("buffer_nbytes"), py::arg("srcs"), py::arg("offsets"), py::arg("row_bytes"),
        py::arg("rows") = py::none(), py::arg("pitches") = py::none(), py::arg("stream") = 0,
        py::arg("method") = 0);
  m.def("scatter",
        [](std::uintptr_t buffer, std::size_t buffer_nbytes, const Ptrs& dsts, const Sizes& offsets,
           const Sizes& row_bytes, const std::optional<Sizes>& rows, const std::optional<Sizes>& pitches,
           std::uintptr_t stream, int method) {
          return pack(false, buffer, buffer_nbytes, dsts, offsets, row_bytes, rows, pitches, stream, method);
        },
        py::arg("buffer"), py::arg("buffer_nbytes"), py::arg("dsts"), py::arg("offsets"), py::arg("row_bytes"),
        py::arg("rows") = py::none(), py::arg("pitches") = py::none(), py::arg("stream") = 0,
        py::arg("method") = 0);

  py::class_<PinnedBuffer>(m, "PinnedBuffer", py::buffer_protocol())
      .def_readonly("nbytes", &PinnedBuffer::nbytes)
      .def_readonly("device", &PinnedBuffer::device)
      .def_readonly("numa_node", &PinnedBuffer::numa_node)
      .def_property_readonly("ptr", [](const PinnedBuffer& b) { return reinterpret_cast<std::uintptr_t>(b.ptr); })
      .def_buffer([](PinnedBuffer& b) {
        return py::buffer_info(b.ptr, 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes)}, {py::ssize_t{1}});
      });
  m.def("alloc_pinned",
        [](std::size_t nbytes, int device, bool numa_local) {
          return std::make_unique<PinnedBuffer>(nbytes, device, numa_local);
        },
        py::arg("nbytes"), py::arg("device"), py::arg("numa_local") = true,
        "Pinned host buffer (buffer protocol), on the GPU's NUMA node when numa_local.");
  m.def("device_numa_node", &hc::device_numa_node, py::arg("device"));
  m.def("synchronize", [](std::uintptr_t stream) {
    py::gil_scoped_release release;
    hc::stream_synchronize(stream);
  }, py::arg("stream"));
  m.def("runtime_version", &hc::runtime_version);
}
