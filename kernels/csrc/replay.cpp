// Launch plans replayed in C++: the host path of an eager op call that kernels/ops/replay.py has recorded.
//
// replay.LaunchPlans records, once per input signature, which outputs an op body allocates and which compiled
// kernels it launches with which arguments (each argument a constant, or an address at a byte offset into
// one of the call's inputs or outputs). Replaying that from Python still costs the H100's host 11.8 us a call
// (softmax 16x32768: signature tuple, allocation, Triton's launcher parsing its arguments), more than the GPU
// needs for a decode-sized memory-bound kernel; torch's whole softmax call takes 9.9 (tests/benchmarks/NOTES.md).
// A Replayer holds an op's plans in C++: a call hashes the inputs' signature, finds the plan, allocates the
// outputs through ATen and launches each kernel through the CUDA driver (cuLaunchKernel), without a Python
// object per argument. A call whose signature has no plan returns None, and Python takes its own path.
//
// Only launches that Triton's launcher would make with cuLaunchKernel's plain semantics are given here
// (one CTA a cluster or the kernel's own clusters, no programmatic dependent launch, no cooperative grid,
// no scratch buffers): the Python side (kernels/ops/native.py) keeps every other plan in Python. Kernel
// parameters are passed as Triton's launcher passes them: each non-constexpr argument by its C type
// (pointers as 64-bit addresses, floats in their storage width), a CUtensorMap by value for a TMA descriptor
// (encoded for each call from the recorded dimensions, strides, box and swizzle and the call's address, as
// Triton's fillTMADescriptor encodes it), then the scratch pointers that Triton's version appends (null).
//
// The driver is opened with dlopen at the first launch, so the module builds and loads where no GPU is (CI
// tests it there: `set_dry_run` makes launches append what they would pass to the driver to a list).

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// ---- the CUDA driver, opened at the first launch -------------------------------------------------------

using CUresult = int;
using CUfunction = void*;
using CUstream = void*;
using LaunchKernelFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, CUstream, void**, void**);
using GetErrorStringFn = CUresult (*)(CUresult, const char**);
using EncodeTiledFn = CUresult (*)(void* map, int dtype, uint32_t rank, void* address, const uint64_t* dims,
                                   const uint64_t* strides, const uint32_t* box, const uint32_t* element_strides,
                                   int interleave, int swizzle, int l2_promotion, int oob_fill);

struct Driver {
  LaunchKernelFn launch = nullptr;
  GetErrorStringFn error_string = nullptr;
  EncodeTiledFn encode_tiled = nullptr;
};

const Driver* driver() {
  static Driver d;
  static bool opened = false;
  if (!opened) {
    opened = true;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib != nullptr) {
      d.launch = reinterpret_cast<LaunchKernelFn>(dlsym(lib, "cuLaunchKernel"));
      d.error_string = reinterpret_cast<GetErrorStringFn>(dlsym(lib, "cuGetErrorString"));
      d.encode_tiled = reinterpret_cast<EncodeTiledFn>(dlsym(lib, "cuTensorMapEncodeTiled"));
    }
  }
  return d.launch != nullptr ? &d : nullptr;
}

std::string driver_error(const Driver* d, CUresult code) {
  const char* text = nullptr;
  if (d->error_string != nullptr) d->error_string(code, &text);
  return "squeezeserve replay: CUDA error " + std::to_string(code) + (text ? std::string(": ") + text : "");
}

// cuda.h's values for what Triton's maps fix: no interleave, L2 promotion of 128 bytes, unit element strides.
constexpr int kInterleaveNone = 0;
constexpr int kL2Promotion128B = 2;
constexpr uint32_t kElementStrides[5] = {1, 1, 1, 1, 1};

// ---- signatures ----------------------------------------------------------------------------------------

enum Kind : int8_t { kNone = 0, kTensor = 1, kBool = 2, kInt = 3, kFloat = 4 };

// What a plan depends on in one input (replay.signature()'s terms): a tensor's sizes, strides, dtype, device
// and whether its address is 16-byte aligned; a scalar's kind and value.
struct InputSig {
  Kind kind = kNone;
  int8_t dtype = 0;     // c10::ScalarType
  int8_t aligned = 0;   // address % 16 == 0
  int32_t device = -1;  // CUDA device index; -1 CPU
  std::vector<int64_t> sizes, strides;
  int64_t int_value = 0;
  double float_value = 0.0;

  void reset() {  // as a fresh InputSig, keeping the vectors' storage (calls reuse the scratch signature)
    kind = kNone;
    dtype = aligned = 0;
    device = -1;
    sizes.clear();
    strides.clear();
    int_value = 0;
    float_value = 0.0;
  }

  bool operator==(const InputSig& o) const {
    return kind == o.kind && dtype == o.dtype && aligned == o.aligned && device == o.device &&
           sizes == o.sizes && strides == o.strides && int_value == o.int_value &&
           std::memcmp(&float_value, &o.float_value, sizeof(double)) == 0;
  }
};

uint64_t mix(uint64_t h, uint64_t v) {  // FNV-1a over 64-bit words
  h ^= v;
  return h * 1099511628211ULL;
}

uint64_t hash_of(const std::vector<InputSig>& sig, int device) {
  uint64_t h = mix(14695981039346656037ULL, static_cast<uint64_t>(device));
  for (const InputSig& s : sig) {
    h = mix(h, (static_cast<uint64_t>(s.kind) << 48) ^ (static_cast<uint64_t>(s.dtype) << 40) ^
                   (static_cast<uint64_t>(s.aligned) << 32) ^ static_cast<uint32_t>(s.device));
    for (int64_t v : s.sizes) h = mix(h, static_cast<uint64_t>(v));
    for (int64_t v : s.strides) h = mix(h, static_cast<uint64_t>(v) * 31);
    uint64_t bits;
    std::memcpy(&bits, &s.float_value, sizeof(bits));
    h = mix(mix(h, static_cast<uint64_t>(s.int_value)), bits);
  }
  return h;
}

PyTypeObject* g_parameter = nullptr;  // torch.nn.Parameter

// A plain tensor: torch.Tensor or nn.Parameter exactly (registry.eager's _PLAIN); a subclass may mean
// something else by its operations (a fake or wrapped tensor), and its calls take the Python path.
bool plain_tensor(PyObject* a) {
  if (Py_TYPE(a) == reinterpret_cast<PyTypeObject*>(THPVariableClass)) return true;
  if (g_parameter == nullptr) {
    PyObject* module = PyImport_ImportModule("torch.nn.parameter");
    if (module == nullptr) {
      PyErr_Clear();
      return false;
    }
    g_parameter = reinterpret_cast<PyTypeObject*>(PyObject_GetAttrString(module, "Parameter"));
    Py_DECREF(module);
    if (g_parameter == nullptr) {
      PyErr_Clear();
      return false;
    }
  }
  return Py_TYPE(a) == g_parameter;
}

// The signature of a call's inputs; false when an input is of a kind no plan takes (a miss, not an error:
// the caller goes the Python way), and for calls that need gradients (grad mode on and an input requiring
// them), which autograd records.
bool read_signature(PyObject* const* args, Py_ssize_t n, std::vector<InputSig>& sig) {
  sig.resize(n);
  const bool grad = c10::GradMode::is_enabled();
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = args[i];
    InputSig& s = sig[i];
    s.reset();
    if (a == Py_None) {
      s.kind = kNone;
    } else if (THPVariable_Check(a)) {
      if (!plain_tensor(a)) return false;
      const at::Tensor& t = THPVariable_Unpack(a);
      if (!t.defined() || t.layout() != at::kStrided || (grad && t.requires_grad())) return false;
      s.kind = kTensor;
      s.dtype = static_cast<int8_t>(t.scalar_type());
      const at::Device dev = t.device();
      if (dev.is_cuda()) {
        s.device = dev.index();
      } else if (!dev.is_cpu()) {
        return false;
      }
      s.aligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
      s.sizes.assign(t.sizes().begin(), t.sizes().end());
      s.strides.assign(t.strides().begin(), t.strides().end());
    } else if (PyBool_Check(a)) {
      s.kind = kBool;
      s.int_value = a == Py_True;
    } else if (PyLong_CheckExact(a)) {
      int overflow = 0;
      s.kind = kInt;
      s.int_value = PyLong_AsLongLongAndOverflow(a, &overflow);
      if (overflow != 0) return false;
    } else if (PyFloat_CheckExact(a)) {
      s.kind = kFloat;
      s.float_value = PyFloat_AS_DOUBLE(a);
    } else {
      return false;
    }
  }
  return true;
}

// ---- plans ---------------------------------------------------------------------------------------------

enum ParamKind : int8_t { kConstant = 0, kAddress = 1, kTensorMap = 2 };

struct TensorMapSpec {  // cuTensorMapEncodeTiled's arguments but the address (innermost dimension first)
  int dtype = 0;
  uint32_t rank = 0;
  uint64_t dims[5] = {};
  uint64_t strides[5] = {};  // bytes; rank - 1 of them
  uint32_t box[5] = {};
  int swizzle = 0;
  int oob_fill = 0;
};

struct Param {
  ParamKind kind = kConstant;
  int size = 8;        // bytes the kernel parameter takes (constants)
  uint64_t bits = 0;   // a constant's value
  int pool = -1;       // kAddress, kTensorMap: which of inputs + outputs
  int64_t offset = 0;  // bytes into it
  TensorMapSpec map;   // kTensorMap
};

struct alignas(64) TensorMapStorage {  // a CUtensorMap (cuda.h: 128 bytes, 64-byte aligned)
  unsigned char bytes[128];
};

struct Launch {
  CUfunction function = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 128;
  unsigned shared = 0;
  std::vector<Param> params;
  // Per call: each parameter's value (8 bytes a slot; a tensor map in maps, its address in its slot),
  // pointed to by pointers.
  std::vector<uint64_t> slots;
  std::vector<TensorMapStorage> maps;
  std::vector<void*> pointers;
};

struct Output {
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  int device = -1;
};

struct Plan {
  std::vector<InputSig> sig;
  int device = -1;  // the current CUDA device when recorded (Triton launches there); -1 for CPU inputs
  std::vector<Output> outputs;
  std::vector<Launch> launches;
  bool single = true;
};

// Dry run (tests without a GPU): launches append (function, grid, block, shared, stream, [param bytes]).
PyObject* g_dry_run = nullptr;
// torch._C._cuda_getDevice and _cuda_getCurrentRawStream, looked up once.
PyObject* g_get_device = nullptr;
PyObject* g_get_stream = nullptr;

bool cuda_functions() {
  if (g_get_device != nullptr) return true;
  PyObject* torch_c = PyImport_ImportModule("torch._C");
  if (torch_c == nullptr) return false;
  g_get_device = PyObject_GetAttrString(torch_c, "_cuda_getDevice");
  g_get_stream = PyObject_GetAttrString(torch_c, "_cuda_getCurrentRawStream");
  Py_DECREF(torch_c);
  if (g_get_device == nullptr || g_get_stream == nullptr) {
    Py_CLEAR(g_get_device);
    Py_CLEAR(g_get_stream);
    return false;
  }
  return true;
}

// The CUDA device-guard implementation torch registers when its CUDA library loads (null in a CPU build):
// the current device and stream through it cost no Python call (the replayer call alone, H100 host: 5.3 us
// with the two Python calls above, fifteenth session; 4.9 through this, sixteenth, another lease).
const c10::impl::DeviceGuardImplInterface* cuda_guard() {
  return c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)].load();
}

// triton.knobs.runtime (set_launch_hooks), whose launch hooks a replay must not skip: a profiler (proton)
// sees launches through them, so a call with one installed goes the Python way, which runs them.
PyObject* g_runtime_knobs = nullptr;
PyObject* g_hook_names[2] = {nullptr, nullptr};
PyObject* g_calls_name = nullptr;

// launch.launch_hooks() in C: true where either hook is set (Triton 3.6 keeps empty HookChains: their
// `calls` list decides; older releases a callable or None).
bool launch_hooked() {
  if (g_runtime_knobs == nullptr) return false;
  for (PyObject* name : g_hook_names) {
    PyObject* hook = PyObject_GetAttr(g_runtime_knobs, name);
    if (hook == nullptr) {
      PyErr_Clear();
      continue;
    }
    if (hook == Py_None) {
      Py_DECREF(hook);
      continue;
    }
    PyObject* calls = PyObject_GetAttr(hook, g_calls_name);
    Py_DECREF(hook);
    if (calls == nullptr) {
      PyErr_Clear();
      return true;  // a plain callable
    }
    const int set = PyObject_IsTrue(calls);
    Py_DECREF(calls);
    if (set != 0) {
      PyErr_Clear();  // (-1: undecidable, taken as set)
      return true;
    }
  }
  return false;
}

long call_long(PyObject* fn, PyObject* arg) {  // -1 with an exception set on failure
  PyObject* r = arg == nullptr ? PyObject_CallNoArgs(fn) : PyObject_CallOneArg(fn, arg);
  if (r == nullptr) return -1;
  long v = PyLong_AsLong(r);
  Py_DECREF(r);
  return v;
}

// Fill a launch's parameter values for this call's pool of tensors (tensor maps encoded where `d` is the
// driver; a dry run leaves them); false with an exception set.
bool fill_params(Launch& l, const std::vector<const at::Tensor*>& pool, const Driver* d) {
  for (size_t i = 0; i < l.params.size(); ++i) {
    const Param& p = l.params[i];
    l.slots[i] = p.kind == kConstant ? p.bits : reinterpret_cast<uintptr_t>(pool[p.pool]->data_ptr()) + p.offset;
    if (p.kind != kTensorMap || d == nullptr) continue;
    if (d->encode_tiled == nullptr) {
      PyErr_SetString(PyExc_RuntimeError, "squeezeserve replay: this driver has no cuTensorMapEncodeTiled");
      return false;
    }
    const TensorMapSpec& m = p.map;
    CUresult r = d->encode_tiled(l.pointers[i], m.dtype, m.rank, reinterpret_cast<void*>(l.slots[i]), m.dims,
                                 m.strides, m.box, kElementStrides, kInterleaveNone, m.swizzle, kL2Promotion128B,
                                 m.oob_fill);
    if (r != 0) {
      PyErr_SetString(PyExc_RuntimeError, (driver_error(d, r) + " (encoding a TMA descriptor)").c_str());
      return false;
    }
  }
  return true;
}

// Append what the driver would be handed to the dry-run list; false with an exception set.
bool dry_launch(const Launch& l, long stream) {
  PyObject* params = PyList_New(static_cast<Py_ssize_t>(l.params.size()));
  if (params == nullptr) return false;
  for (size_t i = 0; i < l.params.size(); ++i) {
    const Param& p = l.params[i];
    PyObject* item = nullptr;
    if (p.kind == kTensorMap) {  // what cuTensorMapEncodeTiled would be called with
      const TensorMapSpec& m = p.map;
      PyObject* dims = PyTuple_New(m.rank);
      PyObject* strides = PyTuple_New(m.rank - 1);
      PyObject* box = PyTuple_New(m.rank);
      if (dims == nullptr || strides == nullptr || box == nullptr) {
        Py_XDECREF(dims);
        Py_XDECREF(strides);
        Py_XDECREF(box);
        Py_DECREF(params);
        return false;
      }
      for (uint32_t j = 0; j < m.rank; ++j) {
        PyTuple_SET_ITEM(dims, j, PyLong_FromUnsignedLongLong(m.dims[j]));
        PyTuple_SET_ITEM(box, j, PyLong_FromUnsignedLong(m.box[j]));
        if (j + 1 < m.rank) PyTuple_SET_ITEM(strides, j, PyLong_FromUnsignedLongLong(m.strides[j]));
      }
      item = Py_BuildValue("(KiNNNii)", static_cast<unsigned long long>(l.slots[i]), m.dtype, dims, strides, box,
                           m.swizzle, m.oob_fill);
    } else {
      const int size = p.kind == kAddress ? 8 : p.size;  // (little-endian: a constant's low bytes first)
      item = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(&l.slots[i]), size);
    }
    if (item == nullptr) {
      Py_DECREF(params);
      return false;
    }
    PyList_SET_ITEM(params, i, item);
  }
  PyObject* record = Py_BuildValue("(K(III)IIlN)", static_cast<unsigned long long>(
                                       reinterpret_cast<uintptr_t>(l.function)),
                                   l.grid[0], l.grid[1], l.grid[2], l.block, l.shared, stream, params);
  if (record == nullptr) return false;
  int rc = PyList_Append(g_dry_run, record);
  Py_DECREF(record);
  return rc == 0;
}

// ---- the Replayer type ---------------------------------------------------------------------------------

struct Replayer {
  PyObject_HEAD
  vectorcallfunc vectorcall;  // replayer_call: calls skip the argument tuple
  std::unordered_map<uint64_t, std::vector<std::shared_ptr<Plan>>>* plans;
  Py_ssize_t count;
  Py_ssize_t max_plans;
  std::vector<InputSig>* scratch;  // the call's signature, reused between calls
};

PyObject* replayer_call(PyObject* obj, PyObject* const* args, size_t nargsf, PyObject* kwnames);

PyObject* replayer_new(PyTypeObject* type, PyObject* args, PyObject*) {
  Py_ssize_t max_plans = 256;
  if (!PyArg_ParseTuple(args, "|n", &max_plans)) return nullptr;
  auto* self = reinterpret_cast<Replayer*>(type->tp_alloc(type, 0));
  if (self == nullptr) return nullptr;
  self->plans = new std::unordered_map<uint64_t, std::vector<std::shared_ptr<Plan>>>();
  self->scratch = new std::vector<InputSig>();
  self->count = 0;
  self->max_plans = max_plans;
  self->vectorcall = replayer_call;
  return reinterpret_cast<PyObject*>(self);
}

void replayer_dealloc(Replayer* self) {
  delete self->plans;
  delete self->scratch;
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject*>(self));
}

// replayer(*inputs): the op's result from its plan for these inputs, or None when it has none, the call
// needs gradients, or something traces (then the Python path decides).
PyObject* replayer_call(PyObject* obj, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* self = reinterpret_cast<Replayer*>(obj);
  const Py_ssize_t n = PyVectorcall_NARGS(nargsf);
  if (kwnames != nullptr && PyTuple_GET_SIZE(kwnames) > 0) {
    PyErr_SetString(PyExc_TypeError, "Replayer takes the op's inputs by position");
    return nullptr;
  }
  if (self->count == 0 || launch_hooked()) Py_RETURN_NONE;
  // Nothing may be tracing (registry.eager): a dispatch mode (fake tensors, make_fx, a recording) or a
  // functorch transform sees every op, and a replay would hide the launches from it.
  // (functorch includes its dynamic-layer key in the thread's dispatch keys while a transform runs)
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 ||
      c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) {
    Py_RETURN_NONE;
  }
  std::vector<InputSig>& sig = *self->scratch;
  if (!read_signature(args, n, sig)) Py_RETURN_NONE;
  int device = -1;
  const c10::impl::DeviceGuardImplInterface* guard = nullptr;
  if (n > 0 && sig[0].kind == kTensor && sig[0].device >= 0 && g_dry_run == nullptr) {
    guard = cuda_guard();
    if (guard != nullptr) {
      try {
        device = guard->getDevice().index();
      } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
      }
    } else {
      if (!cuda_functions()) return nullptr;
      device = static_cast<int>(call_long(g_get_device, nullptr));
      if (device < 0 && PyErr_Occurred()) return nullptr;
    }
  } else if (n > 0 && sig[0].kind == kTensor) {
    device = sig[0].device;  // dry run: the first input's device stands for the current one
  }
  auto found = self->plans->find(hash_of(sig, device));
  if (found == self->plans->end()) Py_RETURN_NONE;
  std::shared_ptr<Plan> plan;  // (held: a plan the memo drops meanwhile lives until this call is done)
  for (auto& candidate : found->second) {
    if (candidate->device == device && candidate->sig == sig) {
      plan = candidate;
      break;
    }
  }
  if (plan == nullptr) Py_RETURN_NONE;

  const Driver* d = nullptr;
  long stream = 0;  // (a plan over CPU tensors, which only tests make, launches on the null stream)
  if (g_dry_run == nullptr) {
    d = driver();
    if (d == nullptr) {
      PyErr_SetString(PyExc_RuntimeError, "squeezeserve replay: libcuda.so.1 could not be opened");
      return nullptr;
    }
  }
  if (d != nullptr && device >= 0 && guard != nullptr) {
    try {
      const c10::Device here(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
      stream = reinterpret_cast<long>(guard->getStreamNativeHandle(guard->getStream(here)));
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
  } else if (d != nullptr && device >= 0) {
    PyObject* index = PyLong_FromLong(device);
    if (index == nullptr) return nullptr;
    stream = call_long(g_get_stream, index);
    Py_DECREF(index);
    if (stream == -1 && PyErr_Occurred()) return nullptr;
  }

  // The pool's inputs first: `sig` is this Replayer's scratch, which nothing may read after the allocation
  // (an allocator callback could run Python, and another call of this op).
  std::vector<const at::Tensor*> pool;
  pool.reserve(n + plan->outputs.size());
  for (Py_ssize_t i = 0; i < n; ++i) {
    pool.push_back(sig[i].kind == kTensor ? &THPVariable_Unpack(args[i]) : nullptr);
  }
  std::vector<at::Tensor> outs;
  outs.reserve(plan->outputs.size());
  try {
    for (const Output& o : plan->outputs) {
      at::TensorOptions options = at::TensorOptions().dtype(o.dtype);
      options = o.device >= 0 ? options.device(at::kCUDA, static_cast<c10::DeviceIndex>(o.device))
                              : options.device(at::kCPU);
      outs.push_back(at::empty(o.sizes, options));
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  for (const at::Tensor& t : outs) pool.push_back(&t);

  for (Launch& l : plan->launches) {
    if (!fill_params(l, pool, d)) return nullptr;
    if (d == nullptr) {
      if (!dry_launch(l, stream)) return nullptr;
      continue;
    }
    CUresult r = d->launch(l.function, l.grid[0], l.grid[1], l.grid[2], l.block, 1, 1, l.shared,
                           reinterpret_cast<CUstream>(stream), l.pointers.data(), nullptr);
    if (r != 0) {
      PyErr_SetString(PyExc_RuntimeError, driver_error(d, r).c_str());
      return nullptr;
    }
  }
  if (plan->single) return THPVariable_Wrap(std::move(outs[0]));
  PyObject* result = PyTuple_New(static_cast<Py_ssize_t>(outs.size()));
  if (result == nullptr) return nullptr;
  for (size_t i = 0; i < outs.size(); ++i) {
    PyObject* t = THPVariable_Wrap(std::move(outs[i]));
    if (t == nullptr) {
      Py_DECREF(result);
      return nullptr;
    }
    PyTuple_SET_ITEM(result, i, t);
  }
  return result;
}

// ---- building a plan from its Python description (kernels/ops/native.py: plan_spec) -------------------

bool as_int64s(PyObject* seq, std::vector<int64_t>& out) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of ints");
  if (fast == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  out.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (out[i] == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
  }
  Py_DECREF(fast);
  return true;
}

bool scalar_type(PyObject* dtype, at::ScalarType& out) {
  if (!THPDtype_Check(dtype)) {
    PyErr_SetString(PyExc_TypeError, "expected a torch.dtype");
    return false;
  }
  out = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
  return true;
}

// ("t", sizes, strides, dtype, device, aligned) | ("n",) | ("b", v) | ("i", v) | ("f", v)
bool parse_input(PyObject* spec, InputSig& s) {
  const char* tag = nullptr;
  PyObject* a = nullptr;
  PyObject* b = nullptr;
  PyObject* dtype = nullptr;
  int device = -1, aligned = 0;
  if (!PyArg_ParseTuple(spec, "s|OOOii", &tag, &a, &b, &dtype, &device, &aligned)) return false;
  switch (tag[0]) {
    case 't': {
      at::ScalarType st;
      if (a == nullptr || b == nullptr || dtype == nullptr) break;
      if (!as_int64s(a, s.sizes) || !as_int64s(b, s.strides) || !scalar_type(dtype, st)) return false;
      s.kind = kTensor;
      s.dtype = static_cast<int8_t>(st);
      s.device = device;
      s.aligned = static_cast<int8_t>(aligned != 0);
      return true;
    }
    case 'n':
      s.kind = kNone;
      return true;
    case 'b':
    case 'i':
      if (a == nullptr) break;
      s.kind = tag[0] == 'b' ? kBool : kInt;
      s.int_value = PyLong_AsLongLong(a);
      return !(s.int_value == -1 && PyErr_Occurred());
    case 'f':
      if (a == nullptr) break;
      s.kind = kFloat;
      s.float_value = PyFloat_AsDouble(a);
      return !(s.float_value == -1.0 && PyErr_Occurred());
    default:
      break;
  }
  PyErr_Format(PyExc_ValueError, "squeezeserve replay: bad input spec tag %s", tag);
  return false;
}

// ("c", size, bits) | ("a", pool, offset) | ("m", pool, offset, dtype, dims, strides, box, swizzle, fill)
bool parse_param(PyObject* spec, Param& p) {
  const char* tag = nullptr;
  long long x = 0, y = 0;
  int map_dtype = 0, swizzle = 0, fill = 0;
  PyObject *dims = nullptr, *strides = nullptr, *box = nullptr;
  if (!PyArg_ParseTuple(spec, "sLL|iOOOii", &tag, &x, &y, &map_dtype, &dims, &strides, &box, &swizzle, &fill)) {
    return false;
  }
  if (tag[0] == 'c') {
    if (x != 1 && x != 2 && x != 4 && x != 8) {
      PyErr_Format(PyExc_ValueError, "squeezeserve replay: a constant of %lld bytes", x);
      return false;
    }
    p.kind = kConstant;
    p.size = static_cast<int>(x);
    p.bits = static_cast<uint64_t>(y);
    return true;
  }
  p.pool = static_cast<int>(x);
  p.offset = y;
  if (tag[0] == 'a') {
    p.kind = kAddress;
    return true;
  }
  std::vector<int64_t> d, s, b;
  if (tag[0] != 'm' || dims == nullptr || !as_int64s(dims, d) || !as_int64s(strides, s) || !as_int64s(box, b)) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "squeezeserve replay: bad parameter spec %s", tag);
    return false;
  }
  if (d.empty() || d.size() > 5 || b.size() != d.size() || s.size() + 1 != d.size()) {
    PyErr_SetString(PyExc_ValueError, "squeezeserve replay: a tensor map of rank 1-5 takes rank - 1 strides");
    return false;
  }
  p.kind = kTensorMap;
  p.map.dtype = map_dtype;
  p.map.rank = static_cast<uint32_t>(d.size());
  for (size_t i = 0; i < d.size(); ++i) {
    p.map.dims[i] = static_cast<uint64_t>(d[i]);
    p.map.box[i] = static_cast<uint32_t>(b[i]);
  }
  for (size_t i = 0; i < s.size(); ++i) p.map.strides[i] = static_cast<uint64_t>(s[i]);
  p.map.swizzle = swizzle;
  p.map.oob_fill = fill;
  return true;
}

// (function, (gx, gy, gz), block, shared, params)
bool parse_launch(PyObject* spec, Launch& l, Py_ssize_t pool_size) {
  unsigned long long function = 0;
  PyObject* params = nullptr;
  if (!PyArg_ParseTuple(spec, "K(III)IIO", &function, &l.grid[0], &l.grid[1], &l.grid[2], &l.block, &l.shared,
                        &params)) {
    return false;
  }
  l.function = reinterpret_cast<CUfunction>(static_cast<uintptr_t>(function));
  PyObject* fast = PySequence_Fast(params, "expected a sequence of parameters");
  if (fast == nullptr) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  l.params.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!parse_param(PySequence_Fast_GET_ITEM(fast, i), l.params[i])) {
      Py_DECREF(fast);
      return false;
    }
    const Param& p = l.params[i];
    if (p.kind != kConstant && (p.pool < 0 || p.pool >= pool_size)) {
      Py_DECREF(fast);
      PyErr_Format(PyExc_ValueError, "squeezeserve replay: parameter %zd names tensor %d of %zd", i, p.pool,
                   pool_size);
      return false;
    }
  }
  Py_DECREF(fast);
  size_t maps = 0;
  for (const Param& p : l.params) maps += p.kind == kTensorMap;
  l.slots.assign(n, 0);
  l.maps.resize(maps);
  l.pointers.resize(n);
  maps = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {  // (slots and maps never move after this)
    l.pointers[i] = l.params[i].kind == kTensorMap ? static_cast<void*>(l.maps[maps++].bytes) : &l.slots[i];
  }
  return true;
}

// replayer.add(inputs, device, outputs, launches, single): a plan for calls whose inputs match `inputs`.
// outputs: ((sizes, dtype, device), ...); launches as parse_launch takes them.
PyObject* replayer_add(PyObject* obj, PyObject* args) {
  auto* self = reinterpret_cast<Replayer*>(obj);
  PyObject *inputs = nullptr, *outputs = nullptr, *launches = nullptr;
  int device = -1, single = 1;
  if (!PyArg_ParseTuple(args, "OiOOp", &inputs, &device, &outputs, &launches, &single)) return nullptr;
  auto plan = std::make_shared<Plan>();
  plan->device = device;
  plan->single = single != 0;

  PyObject* fast = PySequence_Fast(inputs, "inputs: expected a sequence");
  if (fast == nullptr) return nullptr;
  plan->sig.resize(PySequence_Fast_GET_SIZE(fast));
  for (size_t i = 0; i < plan->sig.size(); ++i) {
    if (!parse_input(PySequence_Fast_GET_ITEM(fast, i), plan->sig[i])) {
      Py_DECREF(fast);
      return nullptr;
    }
  }
  Py_DECREF(fast);

  fast = PySequence_Fast(outputs, "outputs: expected a sequence");
  if (fast == nullptr) return nullptr;
  plan->outputs.resize(PySequence_Fast_GET_SIZE(fast));
  for (size_t i = 0; i < plan->outputs.size(); ++i) {
    PyObject *sizes = nullptr, *dtype = nullptr;
    int out_device = -1;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "OOi", &sizes, &dtype, &out_device) ||
        !as_int64s(sizes, plan->outputs[i].sizes) || !scalar_type(dtype, plan->outputs[i].dtype)) {
      Py_DECREF(fast);
      return nullptr;
    }
    plan->outputs[i].device = out_device;
  }
  Py_DECREF(fast);
  if (plan->outputs.empty() || (plan->single && plan->outputs.size() != 1)) {
    PyErr_SetString(PyExc_ValueError, "squeezeserve replay: a plan makes one output, or a tuple of them");
    return nullptr;
  }

  const Py_ssize_t pool_size = static_cast<Py_ssize_t>(plan->sig.size() + plan->outputs.size());
  fast = PySequence_Fast(launches, "launches: expected a sequence");
  if (fast == nullptr) return nullptr;
  plan->launches.resize(PySequence_Fast_GET_SIZE(fast));
  for (size_t i = 0; i < plan->launches.size(); ++i) {
    if (!parse_launch(PySequence_Fast_GET_ITEM(fast, i), plan->launches[i], pool_size)) {
      Py_DECREF(fast);
      return nullptr;
    }
  }
  Py_DECREF(fast);
  for (const Launch& l : plan->launches) {
    for (const Param& p : l.params) {
      if (p.kind != kConstant && p.pool < static_cast<int>(plan->sig.size()) && plan->sig[p.pool].kind != kTensor) {
        PyErr_Format(PyExc_ValueError, "squeezeserve replay: input %d is not a tensor", p.pool);
        return nullptr;
      }
    }
  }

  if (self->count >= self->max_plans) {  // as replay.LaunchPlans: the memo starts over
    self->plans->clear();
    self->count = 0;
  }
  const uint64_t h = hash_of(plan->sig, plan->device);
  auto& bucket = (*self->plans)[h];
  for (auto& existing : bucket) {
    if (existing->device == plan->device && existing->sig == plan->sig) {
      existing = std::move(plan);
      Py_RETURN_NONE;
    }
  }
  bucket.push_back(std::move(plan));
  ++self->count;
  Py_RETURN_NONE;
}

PyObject* replayer_clear(PyObject* obj, PyObject*) {
  auto* self = reinterpret_cast<Replayer*>(obj);
  self->plans->clear();
  self->count = 0;
  Py_RETURN_NONE;
}

Py_ssize_t replayer_len(PyObject* obj) { return reinterpret_cast<Replayer*>(obj)->count; }

PyMethodDef replayer_methods[] = {
    {"add", replayer_add, METH_VARARGS, "add(inputs, device, outputs, launches, single): store a plan"},
    {"clear", replayer_clear, METH_NOARGS, "forget every plan"},
    {nullptr, nullptr, 0, nullptr},
};

PySequenceMethods replayer_sequence = {replayer_len};

PyTypeObject ReplayerType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* set_dry_run(PyObject*, PyObject* arg) {
  if (arg != Py_None && !PyList_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "set_dry_run takes a list or None");
    return nullptr;
  }
  Py_XDECREF(g_dry_run);
  g_dry_run = arg == Py_None ? nullptr : arg;
  Py_XINCREF(g_dry_run);
  Py_RETURN_NONE;
}

PyObject* set_launch_hooks(PyObject*, PyObject* arg) {
  if (g_calls_name == nullptr) {
    g_hook_names[0] = PyUnicode_InternFromString("launch_enter_hook");
    g_hook_names[1] = PyUnicode_InternFromString("launch_exit_hook");
    g_calls_name = PyUnicode_InternFromString("calls");
    if (g_hook_names[0] == nullptr || g_hook_names[1] == nullptr || g_calls_name == nullptr) return nullptr;
  }
  Py_XDECREF(g_runtime_knobs);
  g_runtime_knobs = arg == Py_None ? nullptr : arg;
  Py_XINCREF(g_runtime_knobs);
  Py_RETURN_NONE;
}

PyMethodDef module_methods[] = {
    {"set_dry_run", set_dry_run, METH_O,
     "set_dry_run(list | None): while a list is set, launches append what they would pass the driver to it"},
    {"set_launch_hooks", set_launch_hooks, METH_O,
     "set_launch_hooks(triton.knobs.runtime | None): replays refuse calls while it has a launch hook set"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_squeezeserve_replay", "Launch plans replayed in C++.", -1,
                          module_methods};

}  // namespace

PyMODINIT_FUNC PyInit__squeezeserve_replay(void) {
  ReplayerType.tp_name = "_squeezeserve_replay.Replayer";
  ReplayerType.tp_basicsize = sizeof(Replayer);
  ReplayerType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
  ReplayerType.tp_new = replayer_new;
  ReplayerType.tp_dealloc = reinterpret_cast<destructor>(replayer_dealloc);
  ReplayerType.tp_call = PyVectorcall_Call;
  ReplayerType.tp_vectorcall_offset = offsetof(Replayer, vectorcall);
  ReplayerType.tp_methods = replayer_methods;
  ReplayerType.tp_as_sequence = &replayer_sequence;
  ReplayerType.tp_doc = "Replayer(max_plans=256): an op's launch plans; replayer(*inputs) -> result or None";
  if (PyType_Ready(&ReplayerType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  Py_INCREF(&ReplayerType);
  if (PyModule_AddObject(m, "Replayer", reinterpret_cast<PyObject*>(&ReplayerType)) < 0) {
    Py_DECREF(&ReplayerType);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
