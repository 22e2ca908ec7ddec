// pybind11 module h3t_ext.kernels._copy_cpu: the CPU copy kernels over raw pointers.
//
// Callers never import this module directly; h3t_ext.kernels validates torch tensors
// and passes data pointers, byte counts and pitches. The GIL is released while copying.
// The executor and its options are lent to the optional tensor front end (_copy_torch)
// through the `_api` capsule.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>

#include "copy_cpu.h"
#include "copy_plan.h"
#include "host_alloc.h"

namespace py = pybind11;
using Sizes = std::vector<std::size_t>;
using Ptrs = std::vector<std::uintptr_t>;

namespace {

h3t::CpuCopyOptions g_options;  // only touched while holding the GIL
h3t::CpuCopyApi g_api{&g_options, &h3t::run_tasks};

unsigned run(const std::vector<h3t::CopyTask>& tasks) {
  const h3t::CpuCopyOptions options = g_options;
  py::gil_scoped_release release;
  return h3t::run_tasks(tasks, options);
}

Sizes fill(const std::optional<Sizes>& given, std::size_t n, std::size_t value) {
  return given ? *given : Sizes(n, value);
}

// Pack/unpack: rows defaults to 1 per tensor, pitches default to the row width.
unsigned pack(bool gather, std::uintptr_t buffer, std::size_t buffer_nbytes, const Ptrs& ptrs,
              const Sizes& offsets, const Sizes& row_bytes, const std::optional<Sizes>& rows,
              const std::optional<Sizes>& pitches) {
  const Sizes r = fill(rows, ptrs.size(), 1);
  const Sizes p = pitches ? *pitches : row_bytes;
  return run(h3t::plan_pack(gather, buffer, buffer_nbytes, ptrs, offsets, row_bytes, r, p));
}

struct HostBuffer {
  void* ptr = nullptr;
  std::size_t nbytes = 0;
  int numa_node = -1;
  HostBuffer(std::size_t n, int node, bool populate)
      : ptr(h3t::alloc_host(n, node, populate)), nbytes(n), numa_node(node) {}
  ~HostBuffer() { h3t::free_host(ptr, nbytes); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
};

}  // namespace

PYBIND11_MODULE(_copy_cpu, m) {
  m.doc() = "h3t-ext CPU copy kernels (raw pointers; use h3t_ext.kernels instead)";
  py::register_exception<h3t::CopyError>(m, "CopyError", PyExc_ValueError);

  m.def("batched_copy",
        [](const Ptrs& dsts, const Ptrs& srcs, const Sizes& nbytes) {
          return run(h3t::plan_batched(dsts, srcs, nbytes));
        },
        py::arg("dsts"), py::arg("srcs"), py::arg("nbytes"),
        "Copies nbytes[i] bytes from srcs[i] to dsts[i] for all i; returns threads used.");
  m.def("copy_2d",
        [](const Ptrs& dsts, const Sizes& dst_pitches, const Ptrs& srcs, const Sizes& src_pitches,
           const Sizes& widths, const Sizes& heights) {
          return run(h3t::plan_2d(dsts, dst_pitches, srcs, src_pitches, widths, heights));
        },
        py::arg("dsts"), py::arg("dst_pitches"), py::arg("srcs"), py::arg("src_pitches"),
        py::arg("widths"), py::arg("heights"),
        "Row-strided copies (cudaMemcpy2D argument order); returns threads used.");
  m.def("gather",
        [](std::uintptr_t buffer, std::size_t buffer_nbytes, const Ptrs& srcs, const Sizes& offsets,
           const Sizes& row_bytes, const std::optional<Sizes>& rows, const std::optional<Sizes>& pitches) {
          return pack(true, buffer, buffer_nbytes, srcs, offsets, row_bytes, rows, pitches);
        },
        py::arg("buffer"), py::arg("buffer_nbytes"), py::arg("srcs"), py::arg("offsets"),
        py::arg("row_bytes"), py::arg("rows") = py::none(), py::arg("pitches") = py::none(),
        "Packs tensors into one buffer at offsets; returns threads used.");
  m.def("scatter",
        [](std::uintptr_t buffer, std::size_t buffer_nbytes, const Ptrs& dsts, const Sizes& offsets,
           const Sizes& row_bytes, const std::optional<Sizes>& rows, const std::optional<Sizes>& pitches) {
          return pack(false, buffer, buffer_nbytes, dsts, offsets, row_bytes, rows, pitches);
        },
        py::arg("buffer"), py::arg("buffer_nbytes"), py::arg("dsts"), py::arg("offsets"),
        py::arg("row_bytes"), py::arg("rows") = py::none(), py::arg("pitches") = py::none(),
        "Unpacks a buffer written by gather into tensors; returns threads used.");

  m.attr("_api") = py::capsule(&g_api, h3t::kCpuApiCapsule);
  m.def("set_num_threads", [](unsigned n) { g_options.max_threads = n; }, py::arg("n"),
        "Maximum copy threads (0 = hardware concurrency).");
  m.def("get_num_threads", [] { return g_options.max_threads; });
  m.def("set_parallel_threshold", [](std::size_t b) { g_options.parallel_threshold = b; }, py::arg("nbytes"),
        "Batches below this many bytes are copied on the calling thread only.");
  m.def("get_parallel_threshold", [] { return g_options.parallel_threshold; });
  m.def("set_streaming_threshold", [](std::size_t b) { g_options.streaming_threshold = b; }, py::arg("nbytes"),
        "Batches of at least this many bytes use non-temporal (cache-bypassing) stores.");
  m.def("get_streaming_threshold", [] { return g_options.streaming_threshold; });
  m.def("set_chunk_bytes", [](std::size_t b) { g_options.chunk_bytes = b; }, py::arg("nbytes"),
        "Threads take batches in chunks of this many bytes (0: one equal share per thread).");
  m.def("get_chunk_bytes", [] { return g_options.chunk_bytes; });
  m.def("plan_threads", [](std::size_t total) { return h3t::plan_threads(total, g_options); },
        py::arg("total_bytes"), "Threads a batch of total_bytes would use.");

  py::class_<HostBuffer>(m, "HostBuffer", py::buffer_protocol())
      .def_readonly("nbytes", &HostBuffer::nbytes)
      .def_readonly("numa_node", &HostBuffer::numa_node)
      .def_property_readonly("ptr", [](const HostBuffer& b) { return reinterpret_cast<std::uintptr_t>(b.ptr); })
      .def_buffer([](HostBuffer& b) {
        return py::buffer_info(b.ptr, 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes)}, {py::ssize_t{1}});
      });
  m.def("alloc_host",
        [](std::size_t nbytes, int numa_node, bool populate) {
          return std::make_unique<HostBuffer>(nbytes, numa_node, populate);
        },
        py::arg("nbytes"), py::arg("numa_node") = -1, py::arg("populate") = true,
        "Page-aligned host buffer, bound to numa_node when >= 0 (buffer protocol).");
  m.def("numa_node_of", [](std::uintptr_t p) { return h3t::numa_node_of(reinterpret_cast<void*>(p)); },
        py::arg("ptr"));
  m.def("pci_numa_node", &h3t::pci_numa_node, py::arg("pci_bus_id"));
}
