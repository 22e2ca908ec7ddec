// pybind11 module h3t_ext.kernels._copy_cpu: the CPU copy kernels over raw pointers.
//
// Callers never import this module directly; h3t_ext.kernels validates torch tensors
// and passes data pointers, byte counts and pitches. The GIL is released while copying.
// batched_copy_tensors reads the tensors' attributes itself (CPython API, no torch
// headers) for the common all-contiguous CPU batch, saving a Python pass per pair.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "copy_cpu.h"
#include "copy_plan.h"
#include "host_alloc.h"

namespace py = pybind11;
using Sizes = std::vector<std::size_t>;
using Ptrs = std::vector<std::uintptr_t>;

namespace {

h3t::CpuCopyOptions g_options;  // only touched while holding the GIL

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

// Attribute names of the tensor protocol read by batched_copy_tensors, interned once.
struct TensorNames {
  PyObject* dtype;
  PyObject* is_cpu;
  PyObject* is_contiguous;
  PyObject* shape;
  PyObject* nbytes;
  PyObject* data_ptr;
  PyObject* is_conj;
  PyObject* is_neg;
  PyObject* is_complex;
};
TensorNames g_names;  // created at module import, never freed (like any interned string)

PyObject* intern(const char* name) {
  PyObject* s = PyUnicode_InternFromString(name);
  if (s == nullptr) throw py::error_already_set();
  return s;
}

// Result of reading one (dst, src) pair: usable, not the fast case, or a Python error set.
enum class PairScan { kOk, kUnusual, kError };

py::object steal(PyObject* o) { return py::reinterpret_steal<py::object>(o); }

// bool(obj.name) (attribute) or bool(obj.name()) (method): 1, 0, or -1 with an error set.
int truth_of(PyObject* obj, PyObject* name, bool call) {
  PyObject* args[] = {obj};
  py::object v = steal(call ? PyObject_VectorcallMethod(name, args, 1, nullptr)
                            : PyObject_GetAttr(obj, name));
  return v ? PyObject_IsTrue(v.ptr()) : -1;
}

// An int attribute (call=false) or method result (call=true) as an unsigned 64-bit value.
PairScan read_u64(PyObject* obj, PyObject* name, bool call, std::uint64_t& out) {
  PyObject* args[] = {obj};
  py::object v = steal(call ? PyObject_VectorcallMethod(name, args, 1, nullptr)
                            : PyObject_GetAttr(obj, name));
  if (!v) return PairScan::kError;
  if (!PyLong_Check(v.ptr())) return PairScan::kUnusual;
  out = PyLong_AsUnsignedLongLong(v.ptr());
  if (out == static_cast<std::uint64_t>(-1) && PyErr_Occurred()) {
    PyErr_Clear();  // negative or too large: not a pointer or size; let the checked path decide
    return PairScan::kUnusual;
  }
  return PairScan::kOk;
}

// Tensors of a dtype whose is_complex is False never carry the conjugate bit, so is_conj()
// is asked only for others. torch dtypes are process-lifetime singletons; the cache holds a
// reference to each entry anyway.
std::vector<PyObject*> g_real_dtypes;

// 1 when tensors of `dtype` may be lazily conjugated, 0 when not, -1 with an error set.
int may_be_conj(PyObject* dtype) {
  for (PyObject* known : g_real_dtypes) {
    if (known == dtype) return 0;
  }
  const int complex = truth_of(dtype, g_names.is_complex, false);
  if (complex == 0 && g_real_dtypes.size() < 64) {
    Py_INCREF(dtype);
    g_real_dtypes.push_back(dtype);
  }
  return complex < 0 ? -1 : complex != 0;
}

// The checks of the fast path, in order: same dtype object, both on the CPU and contiguous,
// neither a conjugate or negative view, equal shapes; then nbytes and, when non-zero, both
// data pointers. On kOk, `task` is the pair's copy (zero bytes for empty tensors).
PairScan scan_pair(PyObject* d, PyObject* s, h3t::CopyTask& task) {
  const TensorNames& n = g_names;
  py::object dd = steal(PyObject_GetAttr(d, n.dtype));
  if (!dd) return PairScan::kError;
  py::object sd = steal(PyObject_GetAttr(s, n.dtype));
  if (!sd) return PairScan::kError;
  if (dd.ptr() != sd.ptr()) return PairScan::kUnusual;
  for (auto [obj, name, call] : {std::tuple{d, n.is_cpu, false}, std::tuple{s, n.is_cpu, false},
                                 std::tuple{d, n.is_contiguous, true}, std::tuple{s, n.is_contiguous, true}}) {
    const int t = truth_of(obj, name, call);
    if (t <= 0) return t < 0 ? PairScan::kError : PairScan::kUnusual;
  }
  // A lazily conjugated or negated view holds other bytes than its values: torch must copy it.
  const int conj = may_be_conj(dd.ptr());
  if (conj < 0) return PairScan::kError;
  for (auto [obj, name, ask] : {std::tuple{d, n.is_neg, true}, std::tuple{s, n.is_neg, true},
                                std::tuple{d, n.is_conj, conj == 1}, std::tuple{s, n.is_conj, conj == 1}}) {
    const int t = ask ? truth_of(obj, name, true) : 0;
    if (t != 0) return t < 0 ? PairScan::kError : PairScan::kUnusual;
  }
  py::object ds = steal(PyObject_GetAttr(d, n.shape));
  if (!ds) return PairScan::kError;
  py::object ss = steal(PyObject_GetAttr(s, n.shape));
  if (!ss) return PairScan::kError;
  const int differ = PyObject_RichCompareBool(ds.ptr(), ss.ptr(), Py_NE);
  if (differ != 0) return differ < 0 ? PairScan::kError : PairScan::kUnusual;
  std::uint64_t nbytes = 0, dp = 0, sp = 0;
  PairScan r = read_u64(d, n.nbytes, false, nbytes);
  if (r == PairScan::kOk && nbytes != 0 && (r = read_u64(d, n.data_ptr, true, dp)) == PairScan::kOk) {
    r = read_u64(s, n.data_ptr, true, sp);
  }
  task = h3t::CopyTask{reinterpret_cast<char*>(dp), reinterpret_cast<const char*>(sp), 1, nbytes, nbytes, nbytes};
  return r;
}

// kError with an attribute-protocol error (AttributeError, TypeError, ValueError) means
// "not a tensor we understand": cleared, the batch goes to the checked path. Other errors
// propagate.
bool clear_protocol_error() {
  if (!PyErr_ExceptionMatches(PyExc_AttributeError) && !PyErr_ExceptionMatches(PyExc_TypeError) &&
      !PyErr_ExceptionMatches(PyExc_ValueError)) {
    return false;
  }
  PyErr_Clear();
  return true;
}

// Pauses Python's cyclic garbage collector for the scan: each pair allocates two shape
// tuples, which would otherwise trigger a generation-0 collection every few hundred pairs
// (about 5% of the scan). Nothing the scan allocates outlives it, so refcounting frees it all.
class GcPause {
 public:
  GcPause() : was_enabled_(PyGC_Disable()) {}
  ~GcPause() {
    if (was_enabled_) PyGC_Enable();
  }
  GcPause(const GcPause&) = delete;
  GcPause& operator=(const GcPause&) = delete;

 private:
  int was_enabled_;
};

// Bytes handed to the copy threads at a time while the scan goes on.
constexpr std::size_t kPublishBytes = std::size_t{256} << 10;

// The fast batched copy over tensor objects: None when the batch is not lists/tuples of
// equal length whose pairs are all CPU, contiguous, of one dtype and shape (or reading an
// attribute raised AttributeError, TypeError or ValueError): the caller then takes its fully
// validated path. Otherwise returns the threads used (0: no bytes). Other Python errors
// propagate.
//
// Copying overlaps the scan: pairs already read (and validated) are copied by worker
// threads while the rest are read, so a pair that sends the batch to the checked path, or
// an error, may come after earlier pairs were copied. No byte outside a destination is
// ever written.
py::object batched_copy_tensors(py::handle dsts, py::handle srcs) {
  const auto is_seq = [](py::handle o) { return PyList_Check(o.ptr()) || PyTuple_Check(o.ptr()); };
  if (!is_seq(dsts) || !is_seq(srcs)) return py::none();
  // Tuples: attribute reads may run Python code that mutates a list being walked.
  py::object dt = steal(PySequence_Tuple(dsts.ptr()));
  if (!dt) throw py::error_already_set();
  py::object st = steal(PySequence_Tuple(srcs.ptr()));
  if (!st) throw py::error_already_set();
  const Py_ssize_t count = PyTuple_GET_SIZE(dt.ptr());
  if (PyTuple_GET_SIZE(st.ptr()) != count) return py::none();
  // The batch's bytes first (one cheap read per pair): they size the threads and store
  // mode. This pass decides nothing: at the first read that fails it stops (error cleared)
  // and the scan below meets that pair in order and decides as documented.
  std::size_t expected = 0;
  for (Py_ssize_t i = 0; i < count; ++i) {
    std::uint64_t nbytes = 0;
    const PairScan r = read_u64(PyTuple_GET_ITEM(dt.ptr(), i), g_names.nbytes, false, nbytes);
    if (r != PairScan::kOk) {
      PyErr_Clear();
      break;
    }
    expected += nbytes;
  }
  h3t::CopyJob job(static_cast<std::size_t>(count), expected, g_options);
  const GcPause gc_paused;
  std::size_t pending = 0;
  for (Py_ssize_t i = 0; i < count; ++i) {
    h3t::CopyTask task{};
    const PairScan r = scan_pair(PyTuple_GET_ITEM(dt.ptr(), i), PyTuple_GET_ITEM(st.ptr(), i), task);
    if (r == PairScan::kUnusual || (r == PairScan::kError && clear_protocol_error())) return py::none();
    if (r == PairScan::kError) throw py::error_already_set();
    h3t::validate_task(task, static_cast<std::size_t>(i));
    job.add(task);
    if ((pending += task.bytes()) >= kPublishBytes) {
      job.publish();
      pending = 0;
    }
  }
  unsigned used = 0;
  {
    py::gil_scoped_release release;
    used = job.finish();
  }
  return py::int_(used);
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
  g_names = {intern("dtype"), intern("is_cpu"), intern("is_contiguous"), intern("shape"), intern("nbytes"),
             intern("data_ptr"), intern("is_conj"), intern("is_neg"), intern("is_complex")};
  m.def("batched_copy_tensors", &batched_copy_tensors, py::arg("dsts"), py::arg("srcs"),
        "batched_copy of lists of tensor-like objects (dtype, is_cpu, is_contiguous(), shape, nbytes, "
        "data_ptr()) when all are CPU, contiguous and pairwise of one dtype and shape; returns threads "
        "used, or None for any other input (pairs read before the unusual one may already be copied).");
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
