// The one file that sees Python: turns plain integers (pointers, counts,
// dtype codes, stream handles) into core arguments and core exceptions into
// Python exceptions. Array-framework knowledge lives in adaptive_amp/_native.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core.h"
#include "dlpack_abi.h"
#include "optim.h"
#include "scale_update.h"
#include "sround.h"
#include "stats.h"
#include "unscale.h"

namespace py = pybind11;

namespace {

std::vector<aamp::TensorRef> tensor_refs(const std::vector<std::uintptr_t>& ptrs,
                                         const std::vector<std::int64_t>& numels, const std::vector<int>& dtypes) {
  if (numels.size() != ptrs.size() || dtypes.size() != ptrs.size()) {
    throw aamp::ArgumentError("tensors: pointer, size and dtype lists differ in length");
  }
  std::vector<aamp::TensorRef> refs(ptrs.size());
  for (std::size_t i = 0; i < ptrs.size(); ++i) {
    refs[i].data = reinterpret_cast<void*>(ptrs[i]);
    refs[i].numel = numels[i];
    refs[i].dtype = aamp::dtype_from_code(dtypes[i], aamp::item_name("tensors", i));
  }
  return refs;
}

template <class T>
T* as_ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// obj.name and obj.name() as owned objects (null, with the Python error set, on failure).
py::object get_attr(PyObject* obj, PyObject* name) {
  return py::reinterpret_steal<py::object>(PyObject_GetAttr(obj, name));
}
py::object call_method(PyObject* obj, PyObject* name) {
  return py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(obj, name));
}
// An unbound method (a method descriptor) called on `obj`, and a data descriptor's value for `obj`.
py::object call_descr(PyObject* method, PyObject* obj) {
  return py::reinterpret_steal<py::object>(PyObject_Vectorcall(method, &obj, 1, nullptr));
}
py::object get_descr(PyObject* descr, PyObject* obj) {
  return py::reinterpret_steal<py::object>(
      Py_TYPE(descr)->tp_descr_get(descr, obj, reinterpret_cast<PyObject*>(Py_TYPE(obj))));
}

// ---- Pointers read before the launching call
// The Python side reads each tensor's data_ptr() when it describes the arguments, then runs more Python
// (output and workspace allocations, the stream lookup, checks): thread switch points, where another
// thread's x.resize_(), x.set_() or x.untyped_storage().resize_(0) gives a tensor new memory and frees the
// old. So every launching call reads the pointer of each torch tensor it was handed again, with the GIL held
// from there to the end of the launch (see "The GIL stays held"), and refuses, with nothing written, if one
// moved. Numpy arrays keep their buffer while referenced (ndarray.resize refuses while another reference
// exists, except with refcheck=False, which numpy documents as unsafe), and a DLPack capsule, held by the
// caller until the call returns, keeps its producer's memory by the DLPack contract: the Python side passes
// None for those, and outputs and workspaces it allocated for this call, which no other thread can reach.
// (A tensor subclass whose data_ptr() runs Python code could let a thread run between two of these reads.)

// x.data_ptr() through the method of x's exact type, looked up once per type (a lookup per read costs about
// as much as the read itself).
class DataPtrReader {
 public:
  std::uintptr_t operator()(PyObject* x) {
    static PyObject* data_ptr_name = PyUnicode_InternFromString("data_ptr");
    if (Py_TYPE(x) != type_) {
      py::object type = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(Py_TYPE(x)));
      py::object fn = get_attr(type.ptr(), data_ptr_name);
      if (!fn) throw py::error_already_set();
      type_object_ = std::move(type);
      fn_ = std::move(fn);
      type_ = Py_TYPE(x);
    }
    py::object ptr = call_descr(fn_.ptr(), x);
    if (!ptr) throw py::error_already_set();
    const std::uintptr_t p = PyLong_AsUnsignedLongLong(ptr.ptr());
    if (PyErr_Occurred()) throw py::error_already_set();
    return p;
  }

 private:
  PyTypeObject* type_ = nullptr;  // held by type_object_
  py::object type_object_, fn_;
};

[[noreturn]] void refuse_new_memory(const std::string& item, const char* outcome, const char* advice) {
  throw std::runtime_error(item + " was given new memory (resize_, set_ or a storage resize) while this call ran, "
                           "by another thread; " + outcome + ". " + advice);
}

// A launch's `watch` argument: per pointer argument (in the order each launch states), the torch tensor its
// pointer was read from (a tuple of them for a list argument), or None where nothing is to be re-read. (The
// plans re-read the tensors they hold themselves; their launches watch only the per-call scalars.)
class Watch {
 public:
  Watch(py::object watch, std::size_t count, const char* what) : watch_(std::move(watch)) {
    if (!PyTuple_Check(watch_.ptr()) || static_cast<std::size_t>(PyTuple_GET_SIZE(watch_.ptr())) != count) {
      throw aamp::ArgumentError(std::string("watch: expected a tuple of ") + std::to_string(count) + " (" + what +
                                ")");
    }
  }

  // The k-th argument, one tensor that the launch uses at `ptr` (0: none).
  void one(std::size_t k, std::uintptr_t ptr, const char* name) {
    PyObject* x = PyTuple_GET_ITEM(watch_.ptr(), k);
    if (x != Py_None && ptr != 0 && read_(x) != ptr) refuse(name);
  }

  // The k-th argument, a list whose tensors the launch uses as `refs` (empty ones are not touched).
  void list(std::size_t k, const std::vector<aamp::TensorRef>& refs, const char* name) {
    PyObject* xs = PyTuple_GET_ITEM(watch_.ptr(), k);
    if (xs == Py_None) return;
    // A tuple: its items stay referenced, whatever a data_ptr() call does.
    if (!PyTuple_Check(xs) || static_cast<std::size_t>(PyTuple_GET_SIZE(xs)) != refs.size()) {
      throw aamp::ArgumentError(std::string("watch: ") + name + " must come as a tuple as long as its pointers");
    }
    for (std::size_t i = 0; i < refs.size(); ++i) {
      PyObject* x = PyTuple_GET_ITEM(xs, i);
      if (x != Py_None && refs[i].numel > 0 && read_(x) != reinterpret_cast<std::uintptr_t>(refs[i].data)) {
        refuse(aamp::item_name(name, i));
      }
    }
  }

 private:
  [[noreturn]] static void refuse(const std::string& item) {
    refuse_new_memory(item, "nothing was written",
                      "Do not resize, set_ or free a tensor on another thread while an op uses it");
  }

  py::object watch_;
  DataPtrReader read_;
};

// The GIL stays held during native work (CPU kernels, CUDA enqueues). A
// reference to a tensor or its storage does not keep its memory: another
// Python thread's x.resize_(), x.untyped_storage().resize_(0) or set_()
// frees it (FSDP frees parameters that way), and with the GIL released a CPU
// kernel then reads and writes freed memory (a segfault on a 64 MiB tensor,
// tests/test_hostile.py), or a CUDA launch not yet enqueued is ordered after
// work on a new allocation that reused the block. CUDA enqueues take
// microseconds; CPU kernels keep other Python threads waiting while they run.

// One unscale pass over tensors already described.
void run_unscale(std::vector<aamp::TensorRef> tensors, std::uintptr_t found_inf, std::uintptr_t inv_scale,
                 bool check_only, std::uintptr_t sumsq, std::uintptr_t amax, std::uintptr_t workspace,
                 std::size_t workspace_bytes, int device, std::uintptr_t stream) {
  aamp::UnscaleArgs a;
  a.tensors = std::move(tensors);
  a.found_inf = as_ptr<float>(found_inf);
  a.inv_scale = as_ptr<const float>(inv_scale);
  a.check_only = check_only;
  a.sumsq = as_ptr<float>(sumsq);
  a.amax = as_ptr<float>(amax);
  a.workspace = as_ptr<void>(workspace);
  a.workspace_bytes = workspace_bytes;
  a.place.device = device;
  a.place.stream = stream;
  // With the GIL (see "The GIL stays held"): every caller holds
  // references to the arrays behind these pointers until this returns (ops
  // keep their _native.Batch, plans their lists), has just read the torch
  // tensors' pointers again (see "Pointers read before the launching call"),
  // and `a` is this call's own copy.
  aamp::unscale_and_check(a);
}

void unscale_and_check(const std::vector<std::uintptr_t>& ptrs, const std::vector<std::int64_t>& numels,
                       const std::vector<int>& dtypes, std::uintptr_t found_inf, std::uintptr_t inv_scale,
                       bool check_only, std::uintptr_t sumsq, std::uintptr_t amax, std::uintptr_t workspace,
                       std::size_t workspace_bytes, int device, std::uintptr_t stream, py::object watch) {
  std::vector<aamp::TensorRef> refs = tensor_refs(ptrs, numels, dtypes);
  Watch w(std::move(watch), 3, "tensors, found_inf, inv_scale");
  w.list(0, refs, "tensors");
  w.one(1, found_inf, "found_inf");
  w.one(2, inv_scale, "inv_scale");
  run_unscale(std::move(refs), found_inf, inv_scale, check_only, sumsq, amax, workspace, workspace_bytes, device,
              stream);
}

std::size_t unscale_workspace_bytes(const std::vector<std::int64_t>& numels, bool stats) {
  std::vector<aamp::TensorRef> refs(numels.size());
  for (std::size_t i = 0; i < numels.size(); ++i) refs[i].numel = numels[i];
  return aamp::unscale_workspace_bytes(refs, stats);
}

void update_scale(std::uintptr_t scale, std::uintptr_t growth_tracker, std::uintptr_t found_inf,
                  std::uintptr_t counters, double growth_factor, double backoff_factor, int growth_interval,
                  int hysteresis, float min_scale, float max_scale, bool predictive, std::uintptr_t step_amax,
                  std::uintptr_t amax_history, int history, int margin, float fmt_max, std::uintptr_t inv_scale,
                  int device, std::uintptr_t stream, py::object watch) {
  Watch w(std::move(watch), 7, "scale, growth_tracker, found_inf, counters, step_amax, amax_history, inv_scale");
  w.one(0, scale, "scale");
  w.one(1, growth_tracker, "growth_tracker");
  w.one(2, found_inf, "found_inf");
  w.one(3, counters, "counters");
  w.one(4, step_amax, "step_amax");
  w.one(5, amax_history, "amax_history");
  w.one(6, inv_scale, "inv_scale");
  aamp::ScaleUpdateArgs a;
  a.scale = as_ptr<float>(scale);
  a.growth_tracker = as_ptr<std::int32_t>(growth_tracker);
  a.found_inf = as_ptr<const float>(found_inf);
  a.counters = as_ptr<std::int32_t>(counters);
  a.growth_factor = growth_factor;
  a.backoff_factor = backoff_factor;
  a.growth_interval = growth_interval;
  a.hysteresis = hysteresis;
  a.min_scale = min_scale;
  a.max_scale = max_scale;
  a.predictive = predictive;
  a.step_amax = as_ptr<const float>(step_amax);
  a.amax_history = as_ptr<float>(amax_history);
  a.history = history;
  a.margin = margin;
  a.fmt_max = fmt_max;
  a.inv_scale = as_ptr<float>(inv_scale);
  a.place.device = device;
  a.place.stream = stream;
  aamp::update_scale(a);
}

// The fast path of _native.describe_many for lists of torch tensors: one C++
// loop asks each object for .dtype, .is_contiguous(), .requires_grad,
// .get_device(), .numel() and .data_ptr(), instead of one Python pass per
// question. `codes` maps the allowed dtype objects to dtype codes. Returns
// (ptrs, numels, codes, device), or None when anything is unusual (another
// dtype, a sparse, non-contiguous or lazily negated tensor, two devices, a tensor that
// requires grad in a writing call, no memory): the Python path then finds and
// names the problem.
py::object describe_tensors(py::object seq, py::dict codes, bool writable) {
  static PyObject* dtype_name = PyUnicode_InternFromString("dtype");
  static PyObject* contiguous_name = PyUnicode_InternFromString("is_contiguous");
  static PyObject* neg_name = PyUnicode_InternFromString("is_neg");
  static PyObject* requires_grad_name = PyUnicode_InternFromString("requires_grad");
  static PyObject* device_name = PyUnicode_InternFromString("get_device");
  static PyObject* numel_name = PyUnicode_InternFromString("numel");
  static PyObject* data_ptr_name = PyUnicode_InternFromString("data_ptr");
  // A tuple (a list is copied into one): torch's methods called below may release the GIL, and another
  // thread could then shrink a list under the loop; a tuple cannot change.
  if (!PyList_Check(seq.ptr()) && !PyTuple_Check(seq.ptr())) throw py::type_error("xs: expected a list or tuple");
  py::object xs = py::reinterpret_steal<py::object>(PySequence_Tuple(seq.ptr()));
  if (!xs) throw py::error_already_set();
  const Py_ssize_t n = PyTuple_GET_SIZE(xs.ptr());
  py::list ptrs(n), numels(n), out_codes(n);
  long device = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    // Owned: torch's methods may release the GIL, and another thread may then change a list.
    py::object xo = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(xs.ptr(), i));
    PyObject* x = xo.ptr();
    py::object dtype = get_attr(x, dtype_name);
    if (!dtype) {
      PyErr_Clear();
      return py::none();
    }
    PyObject* code = PyDict_GetItem(codes.ptr(), dtype.ptr());  // borrowed; null when not allowed
    if (code == nullptr) return py::none();
    py::object contiguous = call_method(x, contiguous_name);
    if (!contiguous || contiguous.ptr() != Py_True) {  // sparse layouts raise
      PyErr_Clear();
      return py::none();
    }
    // torch's lazy negation: the memory holds -x (real dtypes have no lazy conjugation).
    py::object neg = call_method(x, neg_name);
    if (!neg || neg.ptr() != Py_False) {
      PyErr_Clear();
      return py::none();
    }
    if (writable) {
      py::object requires_grad = get_attr(x, requires_grad_name);
      if (!requires_grad || requires_grad.ptr() != Py_False) {
        PyErr_Clear();
        return py::none();
      }
    }
    py::object dev = call_method(x, device_name), numel = call_method(x, numel_name), ptr = call_method(x, data_ptr_name);
    if (!dev || !numel || !ptr) {
      PyErr_Clear();
      return py::none();
    }
    const long d = PyLong_AsLong(dev.ptr());
    if (i == 0) device = d;
    if (d != device) return py::none();
    if (PyLong_AsLongLong(numel.ptr()) > 0 && PyLong_AsUnsignedLongLong(ptr.ptr()) == 0) return py::none();
    PyList_SET_ITEM(ptrs.ptr(), i, ptr.release().ptr());
    PyList_SET_ITEM(numels.ptr(), i, numel.release().ptr());
    Py_INCREF(code);
    PyList_SET_ITEM(out_codes.ptr(), i, code);
  }
  return py::make_tuple(ptrs, numels, out_codes, device);
}

// The fixed part of one optimizer's gradients on one device, kept between
// steps: where each parameter sits in its param group's list, and its element
// count, dtype and device. A step then reads each parameter's .grad and its
// pointer in one C++ loop instead of several Python passes. Objects are only
// asked for `.grad`, `.dtype`, `.numel()`, `.get_device()`,
// `.is_contiguous()` and `.data_ptr()`; no framework header is involved.
//
// A parameter without a gradient (frozen, or unused this step) is skipped, as
// torch's scaler skips it; collect() lists which ones it found, every step.
//
// Every step checks that the plan still holds: the same parameter object at
// the same place, a gradient of the planned dtype, size and device. Anything
// else (a model moved with .half() or .to(), a resized .data, a parameter
// replaced in its group) makes the step report kStale and the caller builds
// a new plan, so a stale plan never hands a wrong pointer to the kernels.
class GradPlan {
 public:
  enum Outcome { kDone = 0, kGeneral = 1, kStale = 2 };

  // slots: (group's params list, index) per parameter; dtypes: the dtype
  // objects the gradients must have, codes their native codes.
  GradPlan(const std::vector<std::pair<py::list, std::size_t>>& slots, py::list params,
           const std::vector<std::int64_t>& numels, py::list dtypes, const std::vector<int>& codes, int device)
      : slots_(slots), params_(std::move(params)), dtypes_(std::move(dtypes)), device_(device) {
    std::vector<std::uintptr_t> none(numels.size(), 0);
    refs_ = tensor_refs(none, numels, codes);
    const std::size_t n = refs_.size();
    if (slots_.size() != n || static_cast<std::size_t>(py::len(params_)) != n ||
        static_cast<std::size_t>(py::len(dtypes_)) != n) {
      throw aamp::ArgumentError("params: slots, params, numels and dtypes differ in length");
    }
    workspace_bytes_ = aamp::unscale_workspace_bytes(refs_, true);
  }

  std::size_t workspace_bytes() const { return workspace_bytes_; }
  std::size_t size() const { return refs_.size(); }
  // Positions (in the plan) of the gradients the last collect() found, in launch order.
  const std::vector<std::size_t>& collected() const { return live_at_; }
  std::size_t collected_count() const { return live_at_.size(); }

  Outcome collect() {
    static PyObject* grad_name = PyUnicode_InternFromString("grad");
    static PyObject* dtype_name = PyUnicode_InternFromString("dtype");
    static PyObject* numel_name = PyUnicode_InternFromString("numel");
    static PyObject* device_name = PyUnicode_InternFromString("get_device");
    static PyObject* contiguous_name = PyUnicode_InternFromString("is_contiguous");
    static PyObject* neg_name = PyUnicode_InternFromString("is_neg");
    static PyObject* data_ptr_name = PyUnicode_InternFromString("data_ptr");
    collected_ = false;
    live_.clear();
    live_at_.clear();
    py::list grads(refs_.size());
    for (std::size_t i = 0; i < refs_.size(); ++i) {
      PyObject* list = slots_[i].first.ptr();
      const std::size_t at = slots_[i].second;
      PyObject* param = params_[i].ptr();
      if (at >= static_cast<std::size_t>(PyList_GET_SIZE(list)) || PyList_GET_ITEM(list, at) != param) return kStale;
      py::object grad = get_attr(param, grad_name);
      if (!grad) throw py::error_already_set();
      if (grad.is_none()) {
        PyList_SET_ITEM(grads.ptr(), i, grad.release().ptr());
        continue;
      }
      py::object dtype = get_attr(grad.ptr(), dtype_name);
      if (!dtype) throw py::error_already_set();
      if (dtype.ptr() != dtypes_[i].ptr()) return kStale;
      py::object contiguous = call_method(grad.ptr(), contiguous_name);
      if (!contiguous) {  // sparse layouts raise here
        PyErr_Clear();
        return kGeneral;
      }
      if (contiguous.ptr() != Py_True) return kGeneral;
      py::object neg = call_method(grad.ptr(), neg_name);  // torch's lazy negation: the memory holds -grad
      if (!neg) throw py::error_already_set();
      if (neg.ptr() != Py_False) return kGeneral;
      py::object numel = call_method(grad.ptr(), numel_name);
      py::object device = call_method(grad.ptr(), device_name);
      if (!numel || !device) throw py::error_already_set();
      if (PyLong_AsLongLong(numel.ptr()) != refs_[i].numel || PyLong_AsLong(device.ptr()) != device_) return kStale;
      py::object ptr = call_method(grad.ptr(), data_ptr_name);
      if (!ptr) throw py::error_already_set();
      aamp::TensorRef ref = refs_[i];
      ref.data = reinterpret_cast<void*>(PyLong_AsUnsignedLongLong(ptr.ptr()));
      if (ref.numel > 0 && ref.data == nullptr) return kGeneral;
      live_.push_back(ref);
      live_at_.push_back(i);
      PyList_SET_ITEM(grads.ptr(), i, grad.release().ptr());
    }
    grads_ = std::move(grads);
    collected_ = true;
    return kDone;
  }

  // One native pass over the gradients that the last collect() found. The
  // gradients stay referenced (a local list, which another thread's collect()
  // cannot replace) between collect() and the launch, so p.grad = None or
  // zero_grad() on another thread cannot free them before the kernel. The plan
  // lets go of them when the launch returns: held until the next step's
  // collect(), they outlived zero_grad(set_to_none=True) and kept a second set
  // of gradients allocated through every forward and backward (the size of the
  // parameters, over torch's GradScaler). A launch uses its collect() once.
  void launch(std::uintptr_t found_inf, std::uintptr_t inv_scale, bool check_only, std::uintptr_t sumsq,
              std::uintptr_t amax, std::uintptr_t workspace, std::size_t workspace_bytes, std::uintptr_t stream,
              py::object watch) {
    if (!collected_) throw aamp::ArgumentError("plan: launch() before a collect() that held");
    collected_ = false;  // live_'s pointers are valid only while grads holds their gradients
    const py::list grads = std::exchange(grads_, py::list());
    // The caller's allocations since collect() release the GIL: a gradient another thread gave new memory
    // there would have its old, maybe freed, memory touched (see "Pointers read before the launching call").
    DataPtrReader read;
    for (std::size_t k = 0; k < live_.size(); ++k) {
      if (read(PyList_GET_ITEM(grads.ptr(), live_at_[k])) != reinterpret_cast<std::uintptr_t>(live_[k].data)) {
        refuse_new_memory(aamp::item_name("tensors", k), "nothing was unscaled on this device",
                          "Do not change gradients while the scaler unscales them");
      }
    }
    Watch w(std::move(watch), 2, "found_inf, inv_scale");
    w.one(0, found_inf, "found_inf");
    w.one(1, inv_scale, "inv_scale");
    run_unscale(live_, found_inf, inv_scale, check_only, sumsq, amax, workspace, workspace_bytes, device_, stream);
  }

 private:
  std::vector<std::pair<py::list, std::size_t>> slots_;
  py::list params_;
  py::list dtypes_;
  int device_;
  std::vector<aamp::TensorRef> refs_;  // planned sizes and dtypes; no pointers
  std::vector<aamp::TensorRef> live_;  // the gradients found by the last collect(), with their pointers
  std::vector<std::size_t> live_at_;   // their positions in the plan
  std::size_t workspace_bytes_ = 0;    // for every planned gradient: enough for any subset
  py::list grads_;  // from collect() to launch(): the gradients whose pointers live_ holds (None where none)
  bool collected_ = false;
};

// A fixed list of torch tensors described once (adaptive_amp.UnscalePlan):
// each call re-checks only what decides the memory the kernels touch, three
// attribute reads per tensor instead of the seven of a fresh description.
//
// The plan holds the tensors and, from the build, their storages: a storage
// held here can only change its memory by a reallocation, which moves the
// tensor's data_ptr(). So while a tensor keeps the planned data pointer,
// element count and dtype, [data_ptr, data_ptr + numel * itemsize) is memory
// the tensor had when it was described (contiguous and unnegated then; a
// tensor's layout flags cannot change in place without changing these, except
// by as_strided_-style calls on the same memory). Anything else makes check()
// fail and the caller describes the tensors again.
class TensorsPlan {
 public:
  TensorsPlan(py::tuple tensors, py::tuple storages, const std::vector<std::uintptr_t>& ptrs,
              const std::vector<std::int64_t>& numels, const std::vector<int>& codes, py::tuple dtypes, int device)
      : tensors_(std::move(tensors)), storages_(std::move(storages)), dtypes_(std::move(dtypes)), device_(device) {
    refs_ = tensor_refs(ptrs, numels, codes);
    const std::size_t n = refs_.size();
    if (static_cast<std::size_t>(py::len(tensors_)) != n || static_cast<std::size_t>(py::len(storages_)) != n ||
        static_cast<std::size_t>(py::len(dtypes_)) != n) {
      throw aamp::ArgumentError("tensors: the plan's lists differ in length");
    }
    workspace_bytes_ = aamp::unscale_workspace_bytes(refs_, true);
    if (n > 0) {  // the first tensor's exact type: torch.Tensor or torch.nn.Parameter, usually
      PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(PyTuple_GET_ITEM(tensors_.ptr(), 0)));
      data_ptr_fn_ = get_attr(type, PyUnicode_InternFromString("data_ptr"));
      numel_fn_ = get_attr(type, PyUnicode_InternFromString("numel"));
      dtype_get_ = get_attr(type, PyUnicode_InternFromString("dtype"));
      if (!data_ptr_fn_ || !numel_fn_ || !dtype_get_ || Py_TYPE(dtype_get_.ptr())->tp_descr_get == nullptr) {
        PyErr_Clear();
      } else {
        type_ = Py_TYPE(PyTuple_GET_ITEM(tensors_.ptr(), 0));
      }
    }
    if (!check()) throw aamp::ArgumentError("tensors: not the tensors described (pointer, size or dtype)");
  }

  std::size_t size() const { return refs_.size(); }
  std::size_t workspace_bytes() const { return workspace_bytes_; }

  bool check() const {
    // The three reads go straight to torch.Tensor's own descriptors, found once (a method lookup per read
    // costs about as much as the read); a tensor of another type (a subclass) takes the general lookup.
    static PyObject* dtype_name = PyUnicode_InternFromString("dtype");
    static PyObject* numel_name = PyUnicode_InternFromString("numel");
    static PyObject* data_ptr_name = PyUnicode_InternFromString("data_ptr");
    for (std::size_t i = 0; i < refs_.size(); ++i) {
      PyObject* x = PyTuple_GET_ITEM(tensors_.ptr(), i);
      const bool fast = Py_TYPE(x) == type_;
      py::object ptr = fast ? call_descr(data_ptr_fn_.ptr(), x) : call_method(x, data_ptr_name);
      if (!ptr) return clear();
      if (PyLong_AsUnsignedLongLong(ptr.ptr()) != reinterpret_cast<std::uintptr_t>(refs_[i].data)) return clear();
      py::object numel = fast ? call_descr(numel_fn_.ptr(), x) : call_method(x, numel_name);
      if (!numel || PyLong_AsLongLong(numel.ptr()) != refs_[i].numel) return clear();
      py::object dtype = fast ? get_descr(dtype_get_.ptr(), x) : get_attr(x, dtype_name);
      if (!dtype || dtype.ptr() != PyTuple_GET_ITEM(dtypes_.ptr(), i)) return clear();
    }
    return true;
  }

  // check(), then one unscale pass; false (nothing run) when the tensors no longer hold. One call, with
  // the GIL held from the check to the end of the launch: a check the caller made before its own Python
  // code (a thread switch point) could be undone by another thread's resize_ before the launch.
  bool unscale(std::uintptr_t found_inf, std::uintptr_t inv_scale, bool check_only, std::uintptr_t sumsq,
               std::uintptr_t amax, std::uintptr_t workspace, std::size_t workspace_bytes, std::uintptr_t stream,
               py::object watch) {
    if (!check()) return false;
    Watch w(std::move(watch), 2, "found_inf, inv_scale");
    w.one(0, found_inf, "found_inf");
    w.one(1, inv_scale, "inv_scale");
    const py::tuple keep = tensors_, keep_storages = storages_;
    run_unscale(refs_, found_inf, inv_scale, check_only, sumsq, amax, workspace, workspace_bytes, device_, stream);
    return true;
  }

 private:
  static bool clear() {
    PyErr_Clear();
    return false;
  }

  py::tuple tensors_, storages_, dtypes_;
  PyTypeObject* type_ = nullptr;  // held alive by tensors_[0]
  py::object data_ptr_fn_, numel_fn_, dtype_get_;
  int device_;
  std::vector<aamp::TensorRef> refs_;
  std::size_t workspace_bytes_ = 0;
};

// Reads a DLPack capsule without consuming it: the capsule (held by the
// caller until the op returns) keeps the memory alive and frees it itself.
py::dict dlpack_describe(py::capsule capsule) {
  const std::string name = capsule.name() ? capsule.name() : "";
  const aamp::dlpack::DLTensor* t = nullptr;
  bool read_only = false;
  if (name == "dltensor") {
    t = &static_cast<aamp::dlpack::DLManagedTensor*>(capsule.get_pointer())->dl_tensor;
  } else if (name == "dltensor_versioned") {
    auto* m = static_cast<aamp::dlpack::DLManagedTensorVersioned*>(capsule.get_pointer());
    if (m->version.major != 1) {
      throw aamp::ArgumentError("array: DLPack version " + std::to_string(m->version.major) +
                                " is not supported (expected 1.x)");
    }
    t = &m->dl_tensor;
    read_only = (m->flags & aamp::dlpack::kFlagReadOnly) != 0;
  } else {
    throw aamp::ArgumentError("array: '" + name + "' is not a DLPack capsule (already consumed?)");
  }
  py::tuple shape(t->ndim);
  for (int i = 0; i < t->ndim; ++i) shape[i] = t->shape[i];
  py::object strides = py::none();
  if (t->strides != nullptr) {
    py::tuple s(t->ndim);
    for (int i = 0; i < t->ndim; ++i) s[i] = t->strides[i];
    strides = s;
  }
  py::dict d;
  d["data"] = reinterpret_cast<std::uintptr_t>(t->data) + t->byte_offset;
  d["shape"] = shape;
  d["strides"] = strides;
  d["dtype"] = py::make_tuple(t->dtype.code, t->dtype.bits, t->dtype.lanes);
  d["device_type"] = t->device.device_type;
  d["device_id"] = t->device.device_id;
  d["read_only"] = read_only;
  return d;
}

// Stochastic rounding (csrc/sround.h). bits == 0 and bits_numel < 0: Philox.
void stochastic_round(std::uintptr_t x, std::int64_t numel, int x_dtype, std::uintptr_t out, std::int64_t out_numel,
                      int out_dtype, std::uintptr_t bits, std::int64_t bits_numel, int bits_dtype,
                      std::uint64_t seed, std::uint64_t offset, std::uintptr_t seed_offset, std::uintptr_t scale,
                      bool has_scale_value, float scale_value, bool saturate, std::uintptr_t amax, int device,
                      std::uintptr_t stream, py::object watch) {
  aamp::SroundArgs a;
  a.x = {as_ptr<void>(x), numel, aamp::dtype_from_code(x_dtype, "x")};
  a.out = {as_ptr<void>(out), out_numel, aamp::dtype_from_code(out_dtype, "out")};
  a.has_random_bits = bits_numel >= 0;
  if (a.has_random_bits) a.random_bits = {as_ptr<void>(bits), bits_numel, aamp::dtype_from_code(bits_dtype, "random_bits")};
  a.seed = seed;
  a.offset = offset;
  a.seed_offset = as_ptr<const std::uint64_t>(seed_offset);
  a.scale = as_ptr<const float>(scale);
  a.has_scale_value = has_scale_value;
  a.scale_value = scale_value;
  a.saturate = saturate;
  a.amax = as_ptr<float>(amax);
  a.place.device = device;
  a.place.stream = stream;
  Watch w(std::move(watch), 6, "x, out, random_bits, seed_offset, scale, amax");
  w.one(0, x, "x");
  w.one(1, out, "out");
  w.one(2, bits, "random_bits");
  w.one(3, seed_offset, "seed_offset");
  w.one(4, scale, "scale");
  w.one(5, amax, "amax");
  aamp::stochastic_round(a);  // with the GIL (see "The GIL stays held")
}

// Per-tensor statistics (csrc/stats.h). format < 0: none; scale == 0 and
// !has_scale_value: no scale.
void tensor_stats(const std::vector<std::uintptr_t>& ptrs, const std::vector<std::int64_t>& numels,
                  const std::vector<int>& dtypes, int format, std::uintptr_t scale, bool scale_per_tensor,
                  bool has_scale_value, float scale_value, std::uintptr_t out, std::uintptr_t workspace,
                  std::size_t workspace_bytes, int device, std::uintptr_t stream, py::object watch) {
  aamp::StatsArgs a;
  a.tensors = tensor_refs(ptrs, numels, dtypes);
  a.has_format = format >= 0;
  if (a.has_format) a.format = aamp::dtype_from_code(format, "format");
  a.scale = as_ptr<const float>(scale);
  a.scale_per_tensor = scale_per_tensor;
  a.has_scale_value = has_scale_value;
  a.scale_value = scale_value;
  a.out = as_ptr<double>(out);
  a.workspace = as_ptr<void>(workspace);
  a.workspace_bytes = workspace_bytes;
  a.place.device = device;
  a.place.stream = stream;
  Watch w(std::move(watch), 2, "tensors, scale");
  w.list(0, a.tensors, "tensors");
  w.one(1, scale, "scale");
  aamp::tensor_stats(a);  // with the GIL (see "The GIL stays held")
}

// Fused optimizer step (csrc/optim.h). Each list comes as pointers, element
// counts and dtype codes; the core compares the counts with params'.
std::vector<aamp::TensorRef> optim_refs(const std::vector<std::uintptr_t>& ptrs, const std::vector<std::int64_t>& numels,
                                        const std::vector<int>& dtypes, const char* name) {
  if (ptrs.size() != dtypes.size() || ptrs.size() != numels.size()) {
    throw aamp::ArgumentError(std::string(name) + ": pointer, size and dtype lists differ in length");
  }
  std::vector<aamp::TensorRef> refs(ptrs.size());
  for (std::size_t i = 0; i < ptrs.size(); ++i) {
    refs[i].data = reinterpret_cast<void*>(ptrs[i]);
    refs[i].numel = numels[i];
    refs[i].dtype = aamp::dtype_from_code(dtypes[i], aamp::item_name(name, i));
  }
  return refs;
}

// The hyperparameters and per-step scalars of one optimizer call, as both entries receive them.
void set_step_scalars(aamp::OptimArgs& a, double lr, double beta1, double beta2, double eps, double momentum,
                      double dampening, bool nesterov, double weight_decay, bool maximize, bool stochastic_rounding,
                      std::uintptr_t grad_scale, std::uintptr_t found_inf, std::uint64_t seed, std::uint64_t offset,
                      std::uintptr_t seed_offset, std::uintptr_t stream) {
  a.lr = lr;
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.eps = eps;
  a.momentum = momentum;
  a.dampening = dampening;
  a.nesterov = nesterov;
  a.weight_decay = weight_decay;
  a.maximize = maximize;
  a.stochastic_rounding = stochastic_rounding;
  a.grad_scale = as_ptr<const float>(grad_scale);
  a.found_inf = as_ptr<const float>(found_inf);
  a.seed = seed;
  a.offset = offset;
  a.seed_offset = as_ptr<const std::uint64_t>(seed_offset);
  a.place.stream = stream;
}

// The gradient statistics' output and workspace of one optimizer call (0: none). Both are the caller's own
// allocations for this call, which no other thread can reach (see "Pointers read before the launching call");
// the core checks their sizes against the params.
void set_step_stats(aamp::OptimArgs& a, std::uintptr_t grad_sumsq, std::size_t grad_sumsq_count,
                    std::uintptr_t workspace, std::size_t workspace_bytes) {
  a.grad_sumsq = as_ptr<float>(grad_sumsq);
  a.grad_sumsq_count = grad_sumsq_count;
  a.workspace = as_ptr<void>(workspace);
  a.workspace_bytes = workspace_bytes;
}

std::size_t optim_workspace_bytes(const std::vector<std::int64_t>& numels) {
  std::vector<aamp::TensorRef> refs(numels.size());
  for (std::size_t i = 0; i < numels.size(); ++i) refs[i].numel = numels[i];
  return aamp::optim_workspace_bytes(refs);
}

void optim_step(int kind, const std::vector<std::uintptr_t>& params, const std::vector<std::int64_t>& numels,
                const std::vector<int>& param_dtypes, const std::vector<std::uintptr_t>& grads,
                const std::vector<std::int64_t>& grad_numels, const std::vector<int>& grad_dtypes,
                const std::vector<std::uintptr_t>& exp_avgs, const std::vector<std::int64_t>& exp_avg_numels,
                const std::vector<int>& exp_avg_dtypes, const std::vector<std::uintptr_t>& exp_avg_sqs,
                const std::vector<std::int64_t>& exp_avg_sq_numels, const std::vector<int>& exp_avg_sq_dtypes, const std::vector<std::uintptr_t>& steps,
                const std::vector<bool>& first, double lr, double beta1, double beta2, double eps, double momentum,
                double dampening, bool nesterov, double weight_decay, bool maximize, bool stochastic_rounding,
                std::uintptr_t grad_scale, std::uintptr_t found_inf, std::uint64_t seed, std::uint64_t offset,
                std::uintptr_t seed_offset, int device, std::uintptr_t stream, py::object watch,
                std::uintptr_t grad_sumsq, std::size_t grad_sumsq_count, std::uintptr_t workspace,
                std::size_t workspace_bytes) {
  aamp::OptimArgs a;
  if (kind != 0 && kind != 1) throw aamp::ArgumentError("kind: expected 0 (AdamW) or 1 (SGD)");
  a.kind = static_cast<aamp::OptimKind>(kind);
  a.params = optim_refs(params, numels, param_dtypes, "params");
  a.grads = optim_refs(grads, grad_numels, grad_dtypes, "grads");
  const char* buf_name = kind == 0 ? "exp_avgs" : "momentum_buffers";
  a.exp_avgs = optim_refs(exp_avgs, exp_avg_numels, exp_avg_dtypes, buf_name);
  a.exp_avg_sqs = optim_refs(exp_avg_sqs, exp_avg_sq_numels, exp_avg_sq_dtypes, "exp_avg_sqs");
  for (std::uintptr_t p : steps) a.steps.push_back(as_ptr<float>(p));
  for (bool f : first) a.first.push_back(f ? 1 : 0);
  set_step_scalars(a, lr, beta1, beta2, eps, momentum, dampening, nesterov, weight_decay, maximize,
                   stochastic_rounding, grad_scale, found_inf, seed, offset, seed_offset, stream);
  set_step_stats(a, grad_sumsq, grad_sumsq_count, workspace, workspace_bytes);
  a.place.device = device;
  Watch w(std::move(watch), 8, "params, grads, exp_avgs, exp_avg_sqs, steps, grad_scale, found_inf, seed_offset");
  w.list(0, a.params, "params");
  w.list(1, a.grads, "grads");
  w.list(2, a.exp_avgs, buf_name);
  w.list(3, a.exp_avg_sqs, "exp_avg_sqs");
  std::vector<aamp::TensorRef> step_refs(steps.size());
  for (std::size_t i = 0; i < steps.size(); ++i) step_refs[i] = {as_ptr<void>(steps[i]), 1, aamp::DType::kFloat32};
  w.list(4, step_refs, "steps");
  w.one(5, grad_scale, "grad_scale");
  w.one(6, found_inf, "found_inf");
  w.one(7, seed_offset, "seed_offset");
  aamp::optim_step(a);  // with the GIL (see "The GIL stays held")
}

// One optimizer param group's tensors on one device, described once and kept
// between steps (adaptive_amp/optim.py builds it after validating every
// list): the params' and moments' pointers, element counts and dtypes, the
// step counters' pointers. A step then only reads each planned parameter's
// .grad in one C++ loop and launches; the core validates the assembled
// arguments again before anything is written.
//
// Sizes are never taken on trust: the constructor reads each param's and
// each watched state value's element count, dtype and contiguity itself, and
// every moment handed to the core must be one of the watched state values
// with the element count given for it (the core then compares it with its
// param's). collect() checks that the plan still holds and reports false
// otherwise, so that the caller rebuilds it (and its full validation names
// any problem): the group's list has the same length and the same parameter
// objects at the planned places; each parameter, and each moment of its state
// dict (the same dict holding the same objects), still has the same data
// pointer, element count, dtype and contiguity (a buffer resized or
// re-strided in place keeps its object and maybe its pointer); its gradient
// has the parameter's dtype, shape and device and is contiguous; parameters
// planned without a gradient still have none. Only attribute reads: nothing
// is written.
//
// The tensors of a launch (params and state values held by the plan, the
// gradients that collect() found, held in a list it replaces each time) stay
// referenced from collect() to the launch, so another thread that sets
// p.grad = None or drops a state entry cannot free memory the kernel uses.
class OptimPlan {
 public:
  OptimPlan(int kind, py::list group_params, std::vector<std::size_t> planned, std::vector<std::size_t> absent,
            py::list params, const std::vector<std::uintptr_t>& param_ptrs, const std::vector<std::int64_t>& numels,
            const std::vector<int>& codes, py::list shapes, py::list dtypes, py::dict state, py::list states,
            py::list keys, py::list values, const std::vector<std::uintptr_t>& value_ptrs,
            const std::vector<std::uintptr_t>& exp_avgs, const std::vector<std::int64_t>& exp_avg_numels,
            const std::vector<int>& exp_avg_codes, const std::vector<std::uintptr_t>& exp_avg_sqs,
            const std::vector<std::int64_t>& exp_avg_sq_numels, const std::vector<int>& exp_avg_sq_codes,
            const std::vector<std::uintptr_t>& steps, const std::vector<bool>& first, int device)
      : group_params_(std::move(group_params)), length_(static_cast<std::size_t>(py::len(group_params_))),
        planned_(std::move(planned)), absent_(std::move(absent)), params_(std::move(params)),
        shapes_(std::move(shapes)), dtypes_(std::move(dtypes)), state_(std::move(state)),
        states_(std::move(states)), keys_(std::move(keys)), values_(std::move(values)) {
    if (kind != 0 && kind != 1) throw aamp::ArgumentError("kind: expected 0 (AdamW) or 1 (SGD)");
    const std::size_t n = planned_.size();
    const std::size_t nk = static_cast<std::size_t>(py::len(keys_));
    if (static_cast<std::size_t>(py::len(params_)) != n || param_ptrs.size() != n || numels.size() != n ||
        codes.size() != n || static_cast<std::size_t>(py::len(shapes_)) != n ||
        static_cast<std::size_t>(py::len(dtypes_)) != n || static_cast<std::size_t>(py::len(states_)) != n ||
        static_cast<std::size_t>(py::len(values_)) != n * nk || value_ptrs.size() != n * nk) {
      throw aamp::ArgumentError("params: the plan's lists differ in length");
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (planned_[i] >= length_) throw aamp::ArgumentError(aamp::item_name("planned", i) + ": is out of range");
    }
    a_.kind = static_cast<aamp::OptimKind>(kind);
    a_.params = tensor_refs(param_ptrs, numels, codes);
    a_.grads = tensor_refs(std::vector<std::uintptr_t>(n, 0), numels, codes);
    if (!exp_avgs.empty()) a_.exp_avgs = tensor_refs(exp_avgs, exp_avg_numels, exp_avg_codes);
    if (!exp_avg_sqs.empty()) a_.exp_avg_sqs = tensor_refs(exp_avg_sqs, exp_avg_sq_numels, exp_avg_sq_codes);
    for (std::uintptr_t p : steps) a_.steps.push_back(as_ptr<float>(p));
    for (bool f : first) a_.first.push_back(f ? 1 : 0);
    a_.place.device = device;
    // What each watched tensor is now, read here rather than taken from the caller's lists.
    for (std::size_t i = 0; i < n; ++i) {
      Watched w = read(PyList_GET_ITEM(params_.ptr(), i), aamp::item_name("params", i));
      if (w.ptr != param_ptrs[i] || w.numel != numels[i]) {
        throw aamp::ArgumentError(aamp::item_name("params", i) + ": is not the tensor described (pointer or size)");
      }
      watched_.push_back(std::move(w));
    }
    std::vector<bool> seen_m(a_.exp_avgs.size(), false), seen_v(a_.exp_avg_sqs.size(), false);
    for (std::size_t j = 0; j < n * nk; ++j) {
      if (value_ptrs[j] == 0) {
        watched_.push_back(Watched{});  // not a buffer the core touches through this plan (AdamW's step)
        continue;
      }
      const std::size_t i = j / nk;
      Watched w = read(PyList_GET_ITEM(values_.ptr(), j), aamp::item_name("values", j));
      if (w.ptr != value_ptrs[j]) throw aamp::ArgumentError(aamp::item_name("values", j) + ": pointer differs");
      for (auto [list, seen, name] : {std::tuple{&a_.exp_avgs, &seen_m, "exp_avgs"},
                                      std::tuple{&a_.exp_avg_sqs, &seen_v, "exp_avg_sqs"}}) {
        if (i < list->size() && reinterpret_cast<std::uintptr_t>((*list)[i].data) == w.ptr) {
          // (A non-contiguous moment is the param's dense permuted layout, which optim.py checked; still()
          // then holds its strides.)
          if ((*list)[i].numel != w.numel) {
            throw aamp::ArgumentError(aamp::item_name(name, i) + ": has " + std::to_string(w.numel) +
                                      " elements, not the " + std::to_string((*list)[i].numel) + " given");
          }
          (*seen)[i] = true;
        }
      }
      watched_.push_back(std::move(w));
    }
    for (auto [list, seen, name] : {std::tuple{&a_.exp_avgs, &seen_m, "exp_avgs"},
                                    std::tuple{&a_.exp_avg_sqs, &seen_v, "exp_avg_sqs"}}) {
      for (std::size_t i = 0; i < seen->size(); ++i) {
        // (An empty moment is never touched, and the core checks that its param is empty too.)
        if (!(*seen)[i] && (*list)[i].numel != 0) {
          throw aamp::ArgumentError(aamp::item_name(name, i) + ": is not one of the state values the plan watches");
        }
      }
    }
  }

  std::size_t size() const { return planned_.size(); }

  bool collect() {
    static PyObject* grad_name = PyUnicode_InternFromString("grad");
    static PyObject* dtype_name = PyUnicode_InternFromString("dtype");
    static PyObject* shape_name = PyUnicode_InternFromString("shape");
    static PyObject* device_name = PyUnicode_InternFromString("get_device");
    static PyObject* contiguous_name = PyUnicode_InternFromString("is_contiguous");
    static PyObject* data_ptr_name = PyUnicode_InternFromString("data_ptr");
    collected_ = false;  // a collect() that fails midway leaves pointers of gradients grads_ does not hold
    PyObject* list = group_params_.ptr();
    if (static_cast<std::size_t>(PyList_GET_SIZE(list)) != length_) return false;
    const std::size_t n = planned_.size();
    const std::size_t nk = static_cast<std::size_t>(PyList_GET_SIZE(keys_.ptr()));
    py::list grads(n);
    for (std::size_t i = 0; i < n; ++i) {
      PyObject* param = PyList_GET_ITEM(params_.ptr(), i);
      if (PyList_GET_ITEM(list, planned_[i]) != param) return false;
      if (!still(param, watched_[i])) return false;
      PyObject* st = PyList_GET_ITEM(states_.ptr(), i);
      if (nk != 0) {
        PyObject* now = PyDict_GetItemWithError(state_.ptr(), param);  // borrowed
        if (now != st) {
          PyErr_Clear();
          return false;
        }
      }
      for (std::size_t k = 0; k < nk; ++k) {
        PyObject* v = PyDict_GetItemWithError(st, PyList_GET_ITEM(keys_.ptr(), k));  // borrowed from the dict,
        PyObject* planned = PyList_GET_ITEM(values_.ptr(), i * nk + k);            // held by values_
        if (v != planned) {
          PyErr_Clear();
          return false;
        }
        const Watched& w = watched_[n + i * nk + k];
        if (w.ptr != 0 && !still(planned, w)) return false;
      }
      py::object grad = get_attr(param, grad_name);
      if (!grad || grad.is_none()) return clear();
      py::object dtype = get_attr(grad.ptr(), dtype_name);
      if (!dtype || dtype.ptr() != PyList_GET_ITEM(dtypes_.ptr(), i)) return clear();
      py::object contiguous = call_method(grad.ptr(), contiguous_name);
      if (!contiguous) return clear();  // sparse layouts raise
      // The grad must have its param's memory layout (the core pairs elements by memory order): a contiguous
      // param takes a contiguous grad, a channels_last one a grad of the same strides (a contiguous grad of a
      // channels_last param goes through the functional path, which copies it into the param's layout).
      const bool layout = watched_[i].contiguous ? contiguous.ptr() == Py_True : same_strides(grad.ptr(), watched_[i]);
      if (!layout) return clear();
      static PyObject* neg_name = PyUnicode_InternFromString("is_neg");
      py::object neg = call_method(grad.ptr(), neg_name);  // lazily negated: the functional path resolves it
      if (!neg || neg.ptr() != Py_False) return clear();
      py::object shape = get_attr(grad.ptr(), shape_name);
      if (!shape) return clear();
      const int same = PyObject_RichCompareBool(shape.ptr(), PyList_GET_ITEM(shapes_.ptr(), i), Py_EQ);
      if (same != 1) return clear();
      py::object device = call_method(grad.ptr(), device_name);
      if (!device || PyLong_AsLong(device.ptr()) != a_.place.device) return clear();
      py::object ptr = call_method(grad.ptr(), data_ptr_name);
      if (!ptr) return clear();
      a_.grads[i].data = reinterpret_cast<void*>(PyLong_AsUnsignedLongLong(ptr.ptr()));
      if (a_.grads[i].numel > 0 && a_.grads[i].data == nullptr) return false;
      PyList_SET_ITEM(grads.ptr(), i, grad.release().ptr());
    }
    for (std::size_t at : absent_) {
      if (at >= length_) return false;
      py::object grad = get_attr(PyList_GET_ITEM(list, at), grad_name);
      if (!grad || !grad.is_none()) return clear();
    }
    grads_ = std::move(grads);
    collected_ = true;
    return true;
  }

  // One native step over the gradients that the last collect() found.
  void launch(double lr, double beta1, double beta2, double eps, double momentum, double dampening, bool nesterov,
              double weight_decay, bool maximize, bool stochastic_rounding, std::uintptr_t grad_scale,
              std::uintptr_t found_inf, std::uint64_t seed, std::uint64_t offset, std::uintptr_t seed_offset,
              std::uintptr_t stream, py::object watch, std::uintptr_t grad_sumsq, std::size_t grad_sumsq_count,
              std::uintptr_t workspace, std::size_t workspace_bytes) {
    if (!collected_) throw aamp::ArgumentError("plan: launch() before a collect() that held");
    collected_ = false;  // the gradients found are used once: the next step collects again
    unchanged_since_collect();
    Watch w(std::move(watch), 3, "grad_scale, found_inf, seed_offset");
    w.one(0, grad_scale, "grad_scale");
    w.one(1, found_inf, "found_inf");
    w.one(2, seed_offset, "seed_offset");
    // ... and are not held past this launch (see GradPlan::launch: kept until the next collect(), they
    // outlived zero_grad(set_to_none=True), a second set of gradients through every forward and backward).
    const py::list grads = std::exchange(grads_, py::list());
    set_step_scalars(a_, lr, beta1, beta2, eps, momentum, dampening, nesterov, weight_decay, maximize,
                     stochastic_rounding, grad_scale, found_inf, seed, offset, seed_offset, stream);
    set_step_stats(a_, grad_sumsq, grad_sumsq_count, workspace, workspace_bytes);
    // Local copies: what this launch touches stays referenced (and its pointers unchanged).
    const aamp::OptimArgs args = a_;
    const py::list params = params_, values = values_;
    aamp::optim_step(args);  // with the GIL (see "The GIL stays held")
    // A new momentum buffer is new for one step only (a skipped step leaves it
    // at zero, which the next step reads as history: see optim.SGD).
    std::fill(a_.first.begin(), a_.first.end(), std::uint8_t{0});
  }

 private:
  struct Watched {
    std::uintptr_t ptr = 0;
    std::int64_t numel = 0;
    py::object dtype;
    bool contiguous = false;
    py::object strides;  // non-contiguous (dense permuted) tensors only
  };

  static Watched read(PyObject* x, const std::string& name) {
    static PyObject* dtype_name = PyUnicode_InternFromString("dtype");
    static PyObject* numel_name = PyUnicode_InternFromString("numel");
    static PyObject* contiguous_name = PyUnicode_InternFromString("is_contiguous");
    static PyObject* data_ptr_name = PyUnicode_InternFromString("data_ptr");
    py::object ptr = call_method(x, data_ptr_name), numel = call_method(x, numel_name);
    py::object dtype = get_attr(x, dtype_name), contiguous = call_method(x, contiguous_name);
    if (!ptr || !numel || !dtype || !contiguous) {
      PyErr_Clear();
      throw aamp::ArgumentError(name + ": is not a tensor");
    }
    Watched w;
    w.ptr = PyLong_AsUnsignedLongLong(ptr.ptr());
    w.numel = PyLong_AsLongLong(numel.ptr());
    if (PyErr_Occurred()) {
      PyErr_Clear();
      throw aamp::ArgumentError(name + ": has no readable pointer or size");
    }
    w.dtype = std::move(dtype);
    w.contiguous = contiguous.ptr() == Py_True;
    if (!w.contiguous) {  // a dense permuted layout (channels_last): its strides are part of what must hold
      w.strides = call_method(x, stride_name());
      if (!w.strides) {
        PyErr_Clear();
        throw aamp::ArgumentError(name + ": has no readable strides");
      }
    }
    return w;
  }

  static PyObject* stride_name() {
    static PyObject* name = PyUnicode_InternFromString("stride");
    return name;
  }

  // collect() and the caller's work since (torch calls that release the GIL) let other threads run: a tensor
  // given new memory meanwhile (resize_, set_, its storage resized) would have its old, maybe freed, memory
  // touched. Every pointer the step uses is read again here, with the GIL held to the end of the launch.
  void unchanged_since_collect() const {
    const std::size_t n = planned_.size();
    DataPtrReader read;
    auto same = [&](PyObject* x, std::uintptr_t want) { return read(x) == want; };
    auto refuse = [&](const char* what, std::size_t i) {
      refuse_new_memory(aamp::item_name(what, planned_[i]), "nothing was written",
                        "Do not change parameters, gradients or optimizer state while the optimizer steps");
    };
    const std::size_t nk = static_cast<std::size_t>(PyList_GET_SIZE(keys_.ptr()));
    for (std::size_t i = 0; i < n; ++i) {
      if (!same(PyList_GET_ITEM(params_.ptr(), i), watched_[i].ptr)) refuse("params", i);
      if (!same(PyList_GET_ITEM(grads_.ptr(), i), reinterpret_cast<std::uintptr_t>(a_.grads[i].data))) {
        refuse("grads", i);
      }
      for (std::size_t k = 0; k < nk; ++k) {
        const Watched& w = watched_[n + i * nk + k];
        if (w.ptr != 0 && !same(PyList_GET_ITEM(values_.ptr(), i * nk + k), w.ptr)) refuse("state of params", i);
      }
    }
  }

  // Whether x has the strides of w, a non-contiguous watched tensor.
  static bool same_strides(PyObject* x, const Watched& w) {
    if (w.contiguous || !w.strides) return false;
    py::object strides = call_method(x, stride_name());
    if (!strides) return clear();
    const int same = PyObject_RichCompareBool(strides.ptr(), w.strides.ptr(), Py_EQ);
    if (same < 0) return clear();
    return same == 1;
  }

  // Whether x still is the tensor w describes: same pointer, element count, dtype and contiguity.
  static bool still(PyObject* x, const Watched& w) {
    static PyObject* dtype_name = PyUnicode_InternFromString("dtype");
    static PyObject* numel_name = PyUnicode_InternFromString("numel");
    static PyObject* contiguous_name = PyUnicode_InternFromString("is_contiguous");
    static PyObject* data_ptr_name = PyUnicode_InternFromString("data_ptr");
    py::object ptr = call_method(x, data_ptr_name);
    if (!ptr) return clear();
    const std::uintptr_t got = PyLong_AsUnsignedLongLong(ptr.ptr());
    if (PyErr_Occurred()) return clear();
    if (got != w.ptr) return false;
    py::object numel = call_method(x, numel_name);
    if (!numel || PyLong_AsLongLong(numel.ptr()) != w.numel) return clear();
    py::object dtype = get_attr(x, dtype_name);
    if (!dtype || dtype.ptr() != w.dtype.ptr()) return clear();
    py::object contiguous = call_method(x, contiguous_name);
    if (!contiguous || (contiguous.ptr() == Py_True) != w.contiguous) return clear();
    return w.contiguous || same_strides(x, w);
  }

  static bool clear() {
    PyErr_Clear();
    return false;
  }

  py::list group_params_;
  std::size_t length_;
  std::vector<std::size_t> planned_, absent_;
  py::list params_;
  py::list shapes_, dtypes_;
  py::dict state_;
  py::list states_, keys_, values_;
  std::vector<Watched> watched_;  // params, then values (index n + i * nk + k)
  py::list grads_;  // from collect() to launch(): the gradients found
  bool collected_ = false;
  aamp::OptimArgs a_;
};

std::size_t stats_workspace_bytes(const std::vector<std::int64_t>& numels) {
  std::vector<aamp::TensorRef> refs(numels.size());
  for (std::size_t i = 0; i < numels.size(); ++i) refs[i].numel = numels[i];
  return aamp::stats_workspace_bytes(refs);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "adaptive_amp native core (framework-agnostic; see csrc/*.h for the contracts)";

  py::register_exception<aamp::DTypeError>(m, "DTypeError", PyExc_TypeError);
  py::register_exception<aamp::ArgumentError>(m, "ArgumentError", PyExc_ValueError);
  py::register_exception<aamp::CudaError>(m, "CudaError", PyExc_RuntimeError);

  m.def("cuda_built", &aamp::cuda_built, "Whether the CUDA kernels were compiled in.");
  m.def("cuda_device_count", &aamp::cuda_device_count, "CUDA devices this build can see (0 without CUDA).");
  m.def("build_info", []() {
    py::dict d;
    d["cuda_built"] = aamp::cuda_built();
    d["cuda_archs"] = aamp::cuda_archs();
    d["cuda_runtime_version"] = aamp::cuda_runtime_version();
#ifdef _OPENMP
    d["openmp"] = _OPENMP;
#else
    d["openmp"] = 0;
#endif
    d["compiler"] = __VERSION__;
    return d;
  });

  m.attr("UNSCALE_CHUNK") = aamp::kUnscaleChunk;
  m.def("unscale_workspace_bytes", &unscale_workspace_bytes, py::arg("numels"), py::arg("stats"));
  m.def("unscale_and_check", &unscale_and_check, py::arg("ptrs"), py::arg("numels"), py::arg("dtypes"),
        py::arg("found_inf"), py::arg("inv_scale"), py::arg("check_only"), py::arg("sumsq"), py::arg("amax"),
        py::arg("workspace"), py::arg("workspace_bytes"), py::arg("device"), py::arg("stream"), py::arg("watch"));

  m.def("update_scale", &update_scale, py::arg("scale"), py::arg("growth_tracker"), py::arg("found_inf"),
        py::arg("counters"), py::arg("growth_factor"), py::arg("backoff_factor"), py::arg("growth_interval"),
        py::arg("hysteresis"), py::arg("min_scale"), py::arg("max_scale"), py::arg("predictive"),
        py::arg("step_amax"), py::arg("amax_history"), py::arg("history"), py::arg("margin"), py::arg("fmt_max"),
        py::arg("inv_scale"), py::arg("device"), py::arg("stream"), py::arg("watch"));
  m.def("describe_tensors", &describe_tensors, py::arg("xs"), py::arg("codes"), py::arg("writable"));
  py::class_<GradPlan>(m, "GradPlan")
      .def(py::init<const std::vector<std::pair<py::list, std::size_t>>&, py::list,
                    const std::vector<std::int64_t>&, py::list, const std::vector<int>&, int>(),
           py::arg("slots"), py::arg("params"), py::arg("numels"), py::arg("dtypes"), py::arg("codes"),
           py::arg("device"))
      .def_property_readonly("workspace_bytes", &GradPlan::workspace_bytes)
      .def("__len__", &GradPlan::size)
      .def_property_readonly("collected", &GradPlan::collected)
      .def_property_readonly("collected_count", &GradPlan::collected_count)
      .def("collect", [](GradPlan& p) { return static_cast<int>(p.collect()); })
      .def("launch", &GradPlan::launch, py::arg("found_inf"), py::arg("inv_scale"), py::arg("check_only"),
           py::arg("sumsq"), py::arg("amax"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("stream"),
           py::arg("watch"));
  m.attr("PLAN_DONE") = static_cast<int>(GradPlan::kDone);
  m.attr("PLAN_GENERAL") = static_cast<int>(GradPlan::kGeneral);
  m.attr("PLAN_STALE") = static_cast<int>(GradPlan::kStale);
  m.def("dlpack_describe", &dlpack_describe, py::arg("capsule"));
  py::class_<TensorsPlan>(m, "TensorsPlan")
      .def(py::init<py::tuple, py::tuple, const std::vector<std::uintptr_t>&, const std::vector<std::int64_t>&,
                    const std::vector<int>&, py::tuple, int>(),
           py::arg("tensors"), py::arg("storages"), py::arg("ptrs"), py::arg("numels"), py::arg("codes"),
           py::arg("dtypes"), py::arg("device"))
      .def("__len__", &TensorsPlan::size)
      .def_property_readonly("workspace_bytes", &TensorsPlan::workspace_bytes)
      .def("check", &TensorsPlan::check)
      .def("unscale", &TensorsPlan::unscale, py::arg("found_inf"), py::arg("inv_scale"), py::arg("check_only"),
           py::arg("sumsq"), py::arg("amax"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("stream"),
           py::arg("watch"));

  m.attr("SROUND_GROUP") = aamp::kSroundGroup;
  m.def("stochastic_round", &stochastic_round, py::arg("x"), py::arg("numel"), py::arg("x_dtype"), py::arg("out"),
        py::arg("out_numel"), py::arg("out_dtype"), py::arg("bits"), py::arg("bits_numel"), py::arg("bits_dtype"),
        py::arg("seed"), py::arg("offset"), py::arg("seed_offset"), py::arg("scale"), py::arg("has_scale_value"),
        py::arg("scale_value"), py::arg("saturate"), py::arg("amax"), py::arg("device"), py::arg("stream"),
        py::arg("watch"));

  m.def("optim_step", &optim_step, py::arg("kind"), py::arg("params"), py::arg("numels"), py::arg("param_dtypes"),
        py::arg("grads"), py::arg("grad_numels"), py::arg("grad_dtypes"), py::arg("exp_avgs"),
        py::arg("exp_avg_numels"), py::arg("exp_avg_dtypes"), py::arg("exp_avg_sqs"), py::arg("exp_avg_sq_numels"),
        py::arg("exp_avg_sq_dtypes"), py::arg("steps"), py::arg("first"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("momentum"), py::arg("dampening"),
        py::arg("nesterov"), py::arg("weight_decay"), py::arg("maximize"), py::arg("stochastic_rounding"),
        py::arg("grad_scale"), py::arg("found_inf"), py::arg("seed"), py::arg("offset"), py::arg("seed_offset"),
        py::arg("device"), py::arg("stream"), py::arg("watch"), py::arg("grad_sumsq") = 0,
        py::arg("grad_sumsq_count") = 0, py::arg("workspace") = 0, py::arg("workspace_bytes") = 0);
  m.def("optim_workspace_bytes", &optim_workspace_bytes, py::arg("numels"));

  py::class_<OptimPlan>(m, "OptimPlan")
      .def(py::init<int, py::list, std::vector<std::size_t>, std::vector<std::size_t>, py::list,
                    const std::vector<std::uintptr_t>&, const std::vector<std::int64_t>&, const std::vector<int>&,
                    py::list, py::list, py::dict, py::list, py::list, py::list, const std::vector<std::uintptr_t>&,
                    const std::vector<std::uintptr_t>&, const std::vector<std::int64_t>&, const std::vector<int>&,
                    const std::vector<std::uintptr_t>&, const std::vector<std::int64_t>&, const std::vector<int>&,
                    const std::vector<std::uintptr_t>&, const std::vector<bool>&, int>(),
           py::arg("kind"), py::arg("group_params"), py::arg("planned"), py::arg("absent"), py::arg("params"),
           py::arg("param_ptrs"), py::arg("numels"), py::arg("codes"), py::arg("shapes"), py::arg("dtypes"),
           py::arg("state"), py::arg("states"), py::arg("keys"), py::arg("values"), py::arg("value_ptrs"),
           py::arg("exp_avgs"), py::arg("exp_avg_numels"), py::arg("exp_avg_codes"), py::arg("exp_avg_sqs"),
           py::arg("exp_avg_sq_numels"), py::arg("exp_avg_sq_codes"), py::arg("steps"), py::arg("first"),
           py::arg("device"))
      .def("__len__", &OptimPlan::size)
      .def("collect", &OptimPlan::collect)
      .def("launch", &OptimPlan::launch, py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
           py::arg("momentum"), py::arg("dampening"), py::arg("nesterov"), py::arg("weight_decay"),
           py::arg("maximize"), py::arg("stochastic_rounding"), py::arg("grad_scale"), py::arg("found_inf"),
           py::arg("seed"), py::arg("offset"), py::arg("seed_offset"), py::arg("stream"), py::arg("watch"),
           py::arg("grad_sumsq") = 0, py::arg("grad_sumsq_count") = 0, py::arg("workspace") = 0,
           py::arg("workspace_bytes") = 0);

  m.attr("STATS_CHUNK") = aamp::kStatsChunk;
  {
    py::tuple fields(static_cast<std::size_t>(aamp::kStatFields));
    for (int i = 0; i < aamp::kStatFields; ++i) fields[i] = aamp::kStatFieldNames[i];
    m.attr("STATS_FIELDS") = fields;
  }
  m.def("stats_workspace_bytes", &stats_workspace_bytes, py::arg("numels"));
  m.def("tensor_stats", &tensor_stats, py::arg("ptrs"), py::arg("numels"), py::arg("dtypes"), py::arg("format"),
        py::arg("scale"), py::arg("scale_per_tensor"), py::arg("has_scale_value"), py::arg("scale_value"),
        py::arg("out"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("device"), py::arg("stream"),
        py::arg("watch"));
}
