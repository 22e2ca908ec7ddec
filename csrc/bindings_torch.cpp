// pybind11 module h3t_ext.kernels._copy_torch: the tensor front end of the CPU copy kernels.
//
// Optional, and the only file here that includes torch's headers: setup.py builds it only
// when torch is importable at build time (an install with --no-build-isolation next to the
// pinned CPU torch), so the pointer kernels in _copy_cpu stay buildable without torch and
// an isolated build never pulls a torch in. It reads each tensor pair through torch's C++
// API in 0.15-0.4 µs (mostly cache misses on metadata last touched an offload ago), where
// the same fifteen reads through Python attributes cost 1-2 µs: on the offload batch of
// 2,000 x 64 KiB that is 0.3-0.8 ms instead of 2-4 ms next to a 6 ms copy.
//
// Callers never import this module directly; h3t_ext.kernels.batched_copy_ does. It copies
// with _copy_cpu's executor and options (lent through its `_api` capsule).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "copy_cpu.h"
#include "copy_plan.h"

namespace py = pybind11;

namespace {

const h3t::CpuCopyApi* g_cpu = nullptr;  // _copy_cpu's; its options are read while holding the GIL

// True when the bytes [storage_offset, storage_offset + nbytes) of t lie in its storage.
bool within_storage(const at::Tensor& t, std::size_t nbytes) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (!impl->has_storage() || !impl->storage().data()) return false;
  const std::size_t capacity = impl->storage().nbytes();
  const auto offset = static_cast<std::size_t>(impl->storage_offset()) * impl->itemsize();
  return offset <= capacity && nbytes <= capacity - offset;
}

// Where a pair's tensors may live: both on the CPU (the CPU kernels), or each on the CPU or on one CUDA device (the
// CUDA module; `device` is the batch's, -1 until its first CUDA tensor sets it).
struct Placement {
  bool cuda = false;
  int device = -1;

  bool admits(const at::Tensor& t) {
    const c10::Device dev = t.device();
    if (dev.is_cpu()) return true;
    if (!cuda || !dev.is_cuda()) return false;
    if (device < 0) device = dev.index();
    return dev.index() == device;
  }
};

// The fast-path decision for one pair; fills `task` and returns true when it applies:
// exact torch.Tensor (or Parameter) objects (a subclass may redefine attribute reads in
// Python, so it takes the checked path), defined, strided, placed as `where` admits, contiguous, of one dtype that
// is not quantized (copy_ also copies the quantizer), neither a lazily conjugated or negated
// view, of equal sizes, with storages that hold every byte copied, and a destination that
// is not an inference tensor (its version counter could not be bumped).
bool fast_pair(PyObject* d, PyObject* s, Placement& where, h3t::CopyTask& task) {
  if (!THPVariable_CheckExact(d) || !THPVariable_CheckExact(s)) return false;
  const at::Tensor& dt = THPVariable_Unpack(d);
  const at::Tensor& st = THPVariable_Unpack(s);
  if (!dt.defined() || !st.defined()) return false;
  if (dt.scalar_type() != st.scalar_type() || c10::isQIntType(dt.scalar_type())) return false;
  if (dt.layout() != c10::kStrided || st.layout() != c10::kStrided) return false;
  if (!where.admits(dt) || !where.admits(st)) return false;
  if (dt.is_inference()) return false;
  if (!dt.is_contiguous() || !st.is_contiguous()) return false;
  if (dt.is_conj() || st.is_conj() || dt.is_neg() || st.is_neg()) return false;
  if (!dt.sizes().equals(st.sizes())) return false;
  const std::size_t nbytes = dt.nbytes();
  task = h3t::CopyTask{nullptr, nullptr, 1, nbytes, nbytes, nbytes};
  // a CUDA tensor here is memory of the batch's one device (where.admits), on which the copy runs
  task.on_device = static_cast<std::uint8_t>((dt.is_cuda() ? h3t::kDstOnDevice : 0) |
                                             (st.is_cuda() ? h3t::kSrcOnDevice : 0));
  if (nbytes == 0) return true;
  if (!within_storage(dt, nbytes) || !within_storage(st, nbytes)) return false;
  task.dst = static_cast<char*>(dt.mutable_data_ptr());  // materializes a copy-on-write storage
  task.src = static_cast<const char*>(st.const_data_ptr());
  return true;
}

// The batch's tasks when every pair takes the fast path placed as `where` admits (zero-byte pairs left out), or
// nothing; with `validate`, each checked as it is read (h3t::validate_task, named by its index in the batch: a
// CopyError when a destination overlaps its own source). `held` keeps the batch as tuples, which hold a reference
// to every tensor while the GIL is released for a copy: another thread emptying the caller's list cannot free a
// tensor being copied.
std::optional<std::vector<h3t::CopyTask>> fast_tasks(py::handle dsts, py::handle srcs, Placement& where,
                                                     bool validate, std::pair<py::tuple, py::tuple>& held) {
  const auto is_seq = [](py::handle o) { return PyList_Check(o.ptr()) || PyTuple_Check(o.ptr()); };
  if (!is_seq(dsts) || !is_seq(srcs)) return std::nullopt;
  held.first = py::reinterpret_steal<py::tuple>(PySequence_Tuple(dsts.ptr()));
  held.second = py::reinterpret_steal<py::tuple>(PySequence_Tuple(srcs.ptr()));
  if (!held.first || !held.second) throw py::error_already_set();
  const Py_ssize_t count = PyTuple_GET_SIZE(held.first.ptr());
  if (PyTuple_GET_SIZE(held.second.ptr()) != count) return std::nullopt;
  std::vector<h3t::CopyTask> tasks;
  tasks.reserve(static_cast<std::size_t>(count));
  try {
    for (Py_ssize_t i = 0; i < count; ++i) {
      h3t::CopyTask task{};
      if (!fast_pair(PyTuple_GET_ITEM(held.first.ptr(), i), PyTuple_GET_ITEM(held.second.ptr(), i), where, task)) {
        return std::nullopt;
      }
      if (validate) h3t::validate_task(task, static_cast<std::size_t>(i));
      if (task.bytes()) tasks.push_back(task);
    }
  } catch (const c10::Error&) {
    return std::nullopt;  // torch refused a read: its own copy_ will say why
  }
  return tasks;
}

// Copies srcs[i] into dsts[i] for all i when every pair takes the fast path with both tensors on the CPU (see
// fast_pair); returns the threads used (0: no bytes), or None, having written nothing,
// for any other batch (the caller then validates it in Python and copies or raises).
// Raises ValueError (CopyError) when a destination overlaps its own source.
py::object batched_copy_tensors(py::handle dsts, py::handle srcs) {
  Placement cpu;
  std::pair<py::tuple, py::tuple> held;
  std::optional<std::vector<h3t::CopyTask>> tasks = fast_tasks(dsts, srcs, cpu, true, held);
  if (!tasks) return py::none();
  // Like copy_, the write is an in-place change of each destination for autograd.
  const Py_ssize_t count = PyTuple_GET_SIZE(held.first.ptr());
  for (Py_ssize_t i = 0; i < count; ++i) {
    THPVariable_Unpack(PyTuple_GET_ITEM(held.first.ptr(), i)).unsafeGetTensorImpl()->bump_version();
  }
  if (tasks->empty()) return py::int_(0);
  const h3t::CpuCopyOptions options = *g_cpu->options;
  unsigned used = 0;
  {
    py::gil_scoped_release release;
    used = g_cpu->run_tasks(*tasks, options);
  }
  return py::int_(used);
}

// The plan of a CUDA batch for _copy_cuda.batched_copy_planned: (device, tasks) when every pair takes the fast path
// with each tensor on the CPU or one CUDA device, and one tensor at least on it; None otherwise, for the checked path.
// `tasks` is the CopyTask array as bytes (h3t::task_layout; zero-byte pairs left out), each task's on_device marking
// which of its pointers are that device's memory, so the copy need not ask the driver: no Python list of pointers is
// built and read back. Writes nothing and bumps no version: the caller enqueues the copy (which validates the tasks),
// then bumps the destinations' versions.
py::object cuda_copy_plan(py::handle dsts, py::handle srcs) {
  Placement cuda{true, -1};
  std::pair<py::tuple, py::tuple> held;
  std::optional<std::vector<h3t::CopyTask>> tasks = fast_tasks(dsts, srcs, cuda, false, held);
  if (!tasks || cuda.device < 0) return py::none();  // no CUDA tensor: not a CUDA batch
  return py::make_tuple(cuda.device, py::bytes(reinterpret_cast<const char*>(tasks->data()),
                                               tasks->size() * sizeof(h3t::CopyTask)));
}

}  // namespace

PYBIND11_MODULE(_copy_torch, m) {
  m.doc() = "h3t-ext tensor front end of the CPU copy kernels (use h3t_ext.kernels instead)";
  py::module_::import("torch");
  py::module_ cpu = py::module_::import("h3t_ext.kernels._copy_cpu");
  py::capsule api = cpu.attr("_api");
  if (api.name() == nullptr || std::strcmp(api.name(), h3t::kCpuApiCapsule) != 0) {
    throw py::import_error("h3t_ext.kernels._copy_cpu is from another build (_api capsule mismatch)");
  }
  g_cpu = api.get_pointer<h3t::CpuCopyApi>();
  m.attr("_cpu") = cpu;  // keeps the module owning the executor and options alive
  py::register_exception<h3t::CopyError>(m, "CopyError", PyExc_ValueError);
  m.def("batched_copy_tensors", &batched_copy_tensors, py::arg("dsts"), py::arg("srcs"),
        "Copies lists of CPU, contiguous torch.Tensor pairs of one dtype and shape in one native call "
        "(threads used), or returns None having written nothing for any other input.");
  m.def("cuda_copy_plan", &cuda_copy_plan, py::arg("dsts"), py::arg("srcs"),
        "(device, tasks as bytes) of lists of contiguous tensor pairs of one dtype and shape on the CPU or one CUDA "
        "device (at least one CUDA tensor), for _copy_cuda.batched_copy_planned; None for any other input.");
  m.attr("TASK_LAYOUT") = py::tuple(py::cast(h3t::task_layout()));
}
