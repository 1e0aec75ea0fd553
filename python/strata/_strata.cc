// _strata: the Python extension under the `strata` package (python/strata).
//
// A thin binding of strata::Engine (include/strata/engine.h) for the PyTorch
// frontend in strata/engine.py. It never includes a torch header: tensors
// cross as DLPack capsules (dlpack/dlpack.h), so one build works with any
// torch that speaks DLPack (Debian's 1.13 on the CPU, 2.x on a GPU machine).
//
//   * Parameter and gradient views are capsules over the engine's device
//     memory (CUDA memory on a CUDA device, host memory on the host device),
//     valid from BeforeForward/BeforeBackward until the matching After call.
//     They own nothing; the frontend replaces them before they go stale.
//   * Initial values and parameter writes are consumed from fp32, contiguous,
//     CPU capsules (torch.utils.dlpack.to_dlpack of a CPU tensor), or
//     written by a Python callable into a capsule over the engine's buffer
//     when the engine initializes the states (register_parameter_fn).
//   * ReadParameter returns a capsule that owns its fp32 host buffer.
//   * write_safetensors consumes uint8 CPU capsules of tensors' bytes and
//     writes them with the C++ writer (src/scheduler/safetensors.h).
//
// Every engine call releases the GIL (hooks may wait for fetches). A non-OK
// Status becomes a Python exception: strata.StrataError or its subclass for
// the code (see strata/_errors.py), with the Status message.
#include <Python.h>
#include <dlpack/dlpack.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "src/scheduler/safetensors.h"
#include "strata/checkpoint.h"
#include "strata/config.h"
#include "strata/engine.h"
#include "strata/status.h"

namespace py = pybind11;

namespace strata::python {
namespace {

// A non-OK Status on its way to Python (translated below).
struct StatusException {
  Status status;
};

void ThrowIfError(const Status& s) {
  if (!s.ok()) throw StatusException{s};
}

template <typename T>
T ValueOrThrow(StatusOr<T> v) {
  if (!v.ok()) throw StatusException{v.status()};
  return std::move(*v);
}

bool InterpreterFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// ---- DLPack ----------------------------------------------------------------

constexpr const char* kCapsuleName = "dltensor";
constexpr const char* kUsedCapsuleName = "used_dltensor";

DLDataType ToDL(DType t) {
  switch (t) {
    case DType::kFp32:
      return DLDataType{kDLFloat, 32, 1};
    case DType::kFp16:
      return DLDataType{kDLFloat, 16, 1};
    case DType::kBf16:
      return DLDataType{kDLBfloat, 16, 1};
  }
  return DLDataType{kDLFloat, 32, 1};
}

DType ParseDType(const std::string& name) {
  if (name == "float32" || name == "fp32") return DType::kFp32;
  if (name == "float16" || name == "fp16") return DType::kFp16;
  if (name == "bfloat16" || name == "bf16") return DType::kBf16;
  throw StatusException{
      InvalidArgumentError("dtype '" + name + "': expected float32, float16 or bfloat16")};
}

// The manager of a capsule we hand out: the shape (and, for a capsule that
// owns its data, the data).
struct Managed {
  DLManagedTensor tensor{};
  std::vector<int64_t> shape;
  std::vector<float> owned;
};

void DeleteManaged(DLManagedTensor* self) { delete static_cast<Managed*>(self->manager_ctx); }

// The capsule's destructor: a capsule never consumed (still "dltensor")
// frees its manager; a consumer renamed it and calls the deleter itself.
void CapsuleDestructor(PyObject* capsule) {
  if (PyCapsule_IsValid(capsule, kCapsuleName)) {
    auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kCapsuleName));
    if (t != nullptr && t->deleter != nullptr) t->deleter(t);
  }
}

py::capsule MakeCapsule(std::unique_ptr<Managed> m, void* data, DType dtype, DLDevice device) {
  DLTensor& t = m->tensor.dl_tensor;
  t.data = data;
  t.device = device;
  t.ndim = static_cast<int32_t>(m->shape.size());
  t.dtype = ToDL(dtype);
  t.shape = m->shape.empty() ? nullptr : m->shape.data();
  t.strides = nullptr;  // compact, row-major
  t.byte_offset = 0;
  m->tensor.manager_ctx = m.get();
  m->tensor.deleter = DeleteManaged;
  PyObject* cap = PyCapsule_New(&m->tensor, kCapsuleName, CapsuleDestructor);
  if (cap == nullptr) throw py::error_already_set();
  m.release();
  return py::reinterpret_steal<py::capsule>(cap);
}

// Copies the fp32 values of a CPU capsule (consuming it, as a DLPack
// consumer does) into out; `what` names the tensor in errors.
std::vector<float> ConsumeFloats(const py::capsule& cap, int64_t numel, const std::string& what) {
  PyObject* obj = cap.ptr();
  if (!PyCapsule_IsValid(obj, kCapsuleName))
    throw StatusException{InvalidArgumentError(
        what + ": expected an unconsumed DLPack capsule (torch.utils.dlpack.to_dlpack)")};
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(obj, kCapsuleName));
  const DLTensor& t = m->dl_tensor;
  std::string problem;
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  if (t.device.device_type != kDLCPU) {
    problem = "it is not in CPU memory";
  } else if (t.dtype.code != kDLFloat || t.dtype.bits != 32 || t.dtype.lanes != 1) {
    problem = "it is not float32";
  } else if (n != numel) {
    problem = "it has " + std::to_string(n) + " elements, the parameter " + std::to_string(numel);
  } else if (t.strides != nullptr) {
    int64_t expect = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      if (t.shape[i] != 1 && t.strides[i] != expect) problem = "it is not contiguous";
      expect *= t.shape[i];
    }
  }
  if (!problem.empty()) throw StatusException{InvalidArgumentError(what + ": " + problem)};
  std::vector<float> out(static_cast<size_t>(numel));
  if (numel > 0)
    std::memcpy(out.data(), static_cast<const uint8_t*>(t.data) + t.byte_offset,
                static_cast<size_t>(numel) * sizeof(float));
  // Consumed: renamed so the capsule's destructor leaves it, then released.
  PyCapsule_SetName(obj, kUsedCapsuleName);
  if (m->deleter != nullptr) m->deleter(m);
  return out;
}

// The bytes of a CPU capsule of uint8 (consumed, as a DLPack consumer does:
// the producer's deleter runs when this is destroyed); `what` names the
// tensor in errors.
class ConsumedBytes {
 public:
  ConsumedBytes(const py::capsule& cap, const std::string& what) {
    PyObject* obj = cap.ptr();
    if (!PyCapsule_IsValid(obj, kCapsuleName))
      throw StatusException{InvalidArgumentError(
          what + ": expected an unconsumed DLPack capsule (torch.utils.dlpack.to_dlpack)")};
    auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(obj, kCapsuleName));
    const DLTensor& t = m->dl_tensor;
    std::string problem;
    if (t.device.device_type != kDLCPU)
      problem = "it is not in CPU memory";
    else if (t.dtype.code != kDLUInt || t.dtype.bits != 8 || t.dtype.lanes != 1)
      problem = "it is not uint8";
    else if (t.ndim != 1)
      problem = "it is not 1-D";
    else if (t.strides != nullptr && t.shape[0] > 1 && t.strides[0] != 1)
      problem = "it is not contiguous";
    if (!problem.empty()) throw StatusException{InvalidArgumentError(what + ": " + problem)};
    PyCapsule_SetName(obj, kUsedCapsuleName);
    managed_ = m;
    if (t.shape[0] > 0)
      bytes_ = {static_cast<const uint8_t*>(t.data) + t.byte_offset,
                static_cast<size_t>(t.shape[0])};
  }
  ConsumedBytes(const ConsumedBytes&) = delete;
  ConsumedBytes& operator=(const ConsumedBytes&) = delete;
  ~ConsumedBytes() {
    if (managed_->deleter != nullptr) managed_->deleter(managed_);
  }
  std::span<const uint8_t> bytes() const { return bytes_; }

 private:
  DLManagedTensor* managed_ = nullptr;
  std::span<const uint8_t> bytes_;
};

// ---- Engine ----------------------------------------------------------------

// The fields of AutoValues by their Python names (strata.initialize's
// auto_values), one table for parsing and for the error that lists them.
template <typename T>
using AutoField = std::optional<T> AutoValues::*;
struct AutoKey {
  const char* name;
  AutoField<int64_t> count = nullptr;
  AutoField<double> number = nullptr;
  AutoField<bool> flag = nullptr;
};
const AutoKey kAutoKeys[] = {
    {"train_batch_size", &AutoValues::train_batch_size},
    {"train_micro_batch_size_per_gpu", &AutoValues::train_micro_batch_size_per_gpu},
    {"gradient_accumulation_steps", &AutoValues::gradient_accumulation_steps},
    {"gradient_clipping", nullptr, &AutoValues::gradient_clipping},
    {"lr", nullptr, &AutoValues::lr},
    {"beta1", nullptr, &AutoValues::beta1},
    {"beta2", nullptr, &AutoValues::beta2},
    {"eps", nullptr, &AutoValues::eps},
    {"weight_decay", nullptr, &AutoValues::weight_decay},
    {"fp16_enabled", nullptr, nullptr, &AutoValues::fp16_enabled},
    {"bf16_enabled", nullptr, nullptr, &AutoValues::bf16_enabled},
    {"warmup_num_steps", &AutoValues::warmup_num_steps},
    {"total_num_steps", &AutoValues::total_num_steps},
};

AutoValues ToAutoValues(const py::dict& d) {
  AutoValues a;
  for (const auto& [k, v] : d) {
    const std::string key = py::str(k);
    if (v.is_none()) continue;
    const AutoKey* f = nullptr;
    for (const AutoKey& candidate : kAutoKeys)
      if (key == candidate.name) f = &candidate;
    if (f == nullptr) {
      std::string names;
      for (const AutoKey& candidate : kAutoKeys)
        names += std::string(names.empty() ? "" : ", ") + candidate.name;
      throw StatusException{InvalidArgumentError("auto value '" + key + "': not one of " + names)};
    }
    if (f->count) a.*(f->count) = v.cast<int64_t>();
    if (f->number) a.*(f->number) = v.cast<double>();
    if (f->flag) a.*(f->flag) = v.cast<bool>();
  }
  return a;
}

// The parsed config: text → Config (with "auto" values), the device forced
// to the host when the frontend cannot use a GPU.
Config ParseForPython(const std::string& json_text, const std::string& source,
                      const py::dict& auto_values, bool host_only) {
  Config c = ValueOrThrow(ParseConfig(json_text, source, ToAutoValues(auto_values)));
  if (host_only) {
    if (c.strata.device == DeviceKind::kCuda)
      throw StatusException{InvalidArgumentError(
          source +
          ": strata.device is \"cuda\" but this torch has no CUDA device; use \"auto\" "
          "or \"host\"")};
    c.strata.device = DeviceKind::kHost;
  }
  ThrowIfError(ValidateConfig(c));
  return c;
}

// A RendezvousStore over a Python object with set(key, bytes),
// get(key, timeout_s) -> bytes and remove(key) (strata.engine's
// _TorchStore over torch.distributed's store). The engine calls it without
// the GIL; each call takes it. A Python exception becomes Unavailable with
// its text.
class PyRendezvousStore final : public strata::RendezvousStore {
 public:
  explicit PyRendezvousStore(py::object store) : store_(new py::object(std::move(store))) {}
  ~PyRendezvousStore() override {
    if (Py_IsInitialized() != 0 && !InterpreterFinalizing()) {
      py::gil_scoped_acquire gil;
      delete store_;
    } else {
      store_->release();  // the interpreter is gone: leak the reference
      delete store_;
    }
  }
  strata::Status Set(const std::string& key, const std::string& value) override {
    return Call("set", key, [&] { store_->attr("set")(key, py::bytes(value)); });
  }
  strata::StatusOr<std::string> Get(const std::string& key, double timeout_s) override {
    std::string out;
    strata::Status st = Call("get", key, [&] {
      out = py::bytes(store_->attr("get")(key, timeout_s)).cast<std::string>();
    });
    if (!st.ok()) return st;
    return out;
  }
  strata::Status Remove(const std::string& key) override {
    return Call("remove", key, [&] { store_->attr("remove")(key); });
  }

 private:
  template <typename F>
  strata::Status Call(const char* what, const std::string& key, F&& f) {
    py::gil_scoped_acquire gil;
    try {
      f();
      return strata::Status::Ok();
    } catch (py::error_already_set& e) {
      return strata::Status(strata::StatusCode::kUnavailable,
                            "rendezvous store " + std::string(what) + " " + key + ": " + e.what());
    }
  }
  py::object* store_;
};

class PyEngine {
 public:
  PyEngine(const std::string& json_text, const std::string& source, const py::dict& auto_values,
           bool host_only, const py::object& rendezvous)
      : config_(ParseForPython(json_text, source, auto_values, host_only)) {
    std::shared_ptr<strata::RendezvousStore> store;
    if (!rendezvous.is_none()) store = std::make_shared<PyRendezvousStore>(rendezvous);
    py::gil_scoped_release nogil;
    engine_ = ValueOrThrow(Engine::Create(config_, std::move(store)));
    device_ = DLDevice{kDLCPU, 0};
    if (!e().DeviceIsHost())
      device_ = DLDevice{kDLCUDA, static_cast<int32_t>(config_.strata.device_id)};
  }

  std::string config_json() const { return ConfigToJson(config_); }

  int register_parameter(const std::string& name, const std::vector<int64_t>& shape,
                         const std::string& dtype, int module, const py::capsule& init, int group,
                         const std::vector<std::string>& aliases) {
    e();  // closed: before the capsule is consumed
    const int64_t numel = Numel(name, shape);
    std::vector<float> values = ConsumeFloats(init, numel, "initial values of " + name);
    ParamSpec spec;
    spec.init = values;
    spec.aliases = aliases;
    return Register(name, shape, dtype, module, group, spec);
  }

  // A parameter whose initial values come from `fill`, a Python callable the
  // engine calls when it initializes the states (Plan, or ReadParameter
  // before it): fill(capsule) gets a writable fp32 CPU capsule of numel
  // elements over the engine's scratch buffer, valid only during the call,
  // and writes the values into it. So no host copy of the values is held
  // between registration and Plan. An exception in `fill` is raised by the
  // call that ran it (plan, read_parameter); the parameters after it are
  // left at zero there.
  int register_parameter_fn(const std::string& name, const std::vector<int64_t>& shape,
                            const std::string& dtype, int module, const py::function& fill,
                            int group, const std::vector<std::string>& aliases) {
    e();
    const int64_t numel = Numel(name, shape);
    // The callable is released with the GIL held, wherever the engine drops
    // its std::function (Plan runs without the GIL).
    std::shared_ptr<py::object> fn(new py::object(fill), [](py::object* o) {
      if (Py_IsInitialized() != 0 && !InterpreterFinalizing()) {
        py::gil_scoped_acquire gil;
        delete o;
      } else {
        o->release();  // the interpreter is gone: leak the reference
        delete o;
      }
    });
    ParamSpec spec;
    spec.aliases = aliases;
    spec.initializer = [this, fn, numel](std::span<float> out) {
      py::gil_scoped_acquire gil;
      if (fill_error_) return;  // the first error is reported; the rest stay zero
      try {
        auto m = std::make_unique<Managed>();
        m->shape = {numel};
        (*fn)(MakeCapsule(std::move(m), out.data(), DType::kFp32, DLDevice{kDLCPU, 0}));
      } catch (py::error_already_set& err) {
        fill_error_ = std::move(err);
      } catch (const std::exception& err) {  // nothing may unwind into the engine
        PyErr_SetString(PyExc_RuntimeError, err.what());
        fill_error_ = py::error_already_set();
      }
    };
    return Register(name, shape, dtype, module, group, spec);
  }

  void plan() {
    Status st;
    {
      py::gil_scoped_release nogil;
      st = e().Plan();
    }
    RethrowFillError();
    ThrowIfError(st);
  }

  py::list budgets() const {
    py::list out;
    for (const TierBudget& b : e().Budgets()) {
      py::dict d;
      d["tier"] = b.tier;
      d["needed_bytes"] = b.needed_bytes;
      d["available_bytes"] = b.available_bytes;
      d["detail"] = b.detail;
      out.append(d);
    }
    return out;
  }

  // Parameter views of module m (list of capsules, registration order).
  py::list before_forward(int m) {
    ModuleView v;
    {
      py::gil_scoped_release nogil;
      v = ValueOrThrow(e().BeforeForward(m));
    }
    return Views(m, v.params);
  }
  void after_forward(int m) {
    py::gil_scoped_release nogil;
    ThrowIfError(e().AfterForward(m));
  }
  // (parameter views, gradient views) of module m.
  py::tuple before_backward(int m) {
    ModuleView v;
    {
      py::gil_scoped_release nogil;
      v = ValueOrThrow(e().BeforeBackward(m));
    }
    return py::make_tuple(Views(m, v.params), Views(m, v.grads));
  }
  // The gradient views alone (BeforeBackward for a hand-over that writes
  // gradients and reads no parameter: no parameter capsules built).
  py::list before_backward_grads(int m) {
    ModuleView v;
    {
      py::gil_scoped_release nogil;
      v = ValueOrThrow(e().BeforeBackward(m));
    }
    return Views(m, v.grads);
  }
  void after_backward(int m) {
    py::gil_scoped_release nogil;
    ThrowIfError(e().AfterBackward(m));
  }

  // The step's statistics as JSON text (StatsJson).
  std::string step() {
    py::gil_scoped_release nogil;
    ValueOrThrow(e().Step());
    return e().StatsJson();
  }
  void zero_grad() {
    py::gil_scoped_release nogil;
    ThrowIfError(e().ZeroGrad());
  }
  void synchronize() {
    py::gil_scoped_release nogil;
    ThrowIfError(e().Synchronize());
  }

  py::capsule read_parameter(int id) {
    const Param& p = Get(id);
    auto m = std::make_unique<Managed>();
    m->shape = p.shape;
    m->owned.resize(static_cast<size_t>(p.numel));
    {
      py::gil_scoped_release nogil;
      ThrowIfError(e().ReadParameter(id, m->owned));
    }
    RethrowFillError();
    float* data = m->owned.data();
    return MakeCapsule(std::move(m), data, DType::kFp32, DLDevice{kDLCPU, 0});
  }
  void write_parameter(int id, const py::capsule& values) {
    const Param& p = Get(id);
    std::vector<float> v =
        ConsumeFloats(values, p.numel, "values for parameter " + std::to_string(id));
    py::gil_scoped_release nogil;
    ThrowIfError(e().WriteParameter(id, v));
  }

  void save_checkpoint(const std::string& dir, int64_t data_position, const std::string& note) {
    CheckpointInfo info;
    info.data_position = data_position;
    info.note = note;
    py::gil_scoped_release nogil;
    ThrowIfError(e().SaveCheckpoint(dir, info));
  }
  py::dict load_checkpoint(const std::string& dir, bool convert_optimizer_states) {
    CheckpointInfo info;
    info.convert_optimizer_states = convert_optimizer_states;
    {
      py::gil_scoped_release nogil;
      ThrowIfError(e().LoadCheckpoint(dir, &info));
    }
    py::dict d;
    d["data_position"] = info.data_position;
    d["note"] = info.note;
    d["optimizer_step"] = info.optimizer_step;
    d["path"] = info.path;
    return d;
  }

  double loss_scale() const { return e().loss_scale(); }
  // group -1: every group.
  void set_learning_rate(double lr, int group) {
    ThrowIfError(group < 0 ? e().SetLearningRate(lr) : e().SetLearningRate(group, lr));
  }
  double learning_rate(int group) const { return e().learning_rate(group); }
  int add_param_group(const std::string& name, std::optional<double> lr,
                      std::optional<double> weight_decay, std::optional<double> beta1,
                      std::optional<double> beta2, std::optional<double> eps) {
    ParamGroupSpec g;
    g.name = name;
    g.lr = lr;
    g.weight_decay = weight_decay;
    g.beta1 = beta1;
    g.beta2 = beta2;
    g.eps = eps;
    return ValueOrThrow(e().AddParamGroup(g));
  }
  int num_param_groups() const { return e().num_param_groups(); }
  uintptr_t compute_stream() const { return reinterpret_cast<uintptr_t>(e().ComputeStream()); }
  std::string device_name() const { return e().DeviceName(); }
  bool device_is_host() const { return e().DeviceIsHost(); }
  int num_parameters() const { return e().num_parameters(); }
  int64_t num_elements() const { return e().num_elements(); }
  std::string stats_json() const { return e().StatsJson(); }
  void write_timeline() {
    py::gil_scoped_release nogil;
    ThrowIfError(e().WriteTimeline());
  }
  // Destroys the engine now (removes swap files); later calls raise.
  void close() {
    py::gil_scoped_release nogil;
    engine_.reset();
  }

 private:
  // The engine; after close(), FailedPrecondition.
  Engine& e() const {
    if (!engine_) throw StatusException{FailedPreconditionError("the engine was closed")};
    return *engine_;
  }

  struct Param {
    std::vector<int64_t> shape;
    DType dtype;
    int64_t numel;
  };

  static int64_t Numel(const std::string& name, const std::vector<int64_t>& shape) {
    int64_t numel = 1;
    for (int64_t d : shape) {
      if (d < 0)
        throw StatusException{InvalidArgumentError("parameter " + name + ": negative dimension")};
      numel *= d;
    }
    return numel;
  }

  // `spec` with its init or initializer set; the rest from the arguments.
  int Register(const std::string& name, const std::vector<int64_t>& shape, const std::string& dtype,
               int module, int group, ParamSpec& spec) {
    spec.name = name;
    spec.numel = Numel(name, shape);
    // (A 0-d tensor's shape is []: the engine's empty shape means [numel].)
    spec.shape = shape;
    spec.dtype = ParseDType(dtype);
    spec.module = module;
    spec.group = group;
    int id = 0;
    {
      py::gil_scoped_release nogil;
      id = ValueOrThrow(e().RegisterParameter(spec));
    }
    if (id != static_cast<int>(params_.size()))
      throw StatusException{InternalError("parameter ids out of order")};
    params_.push_back({shape, spec.dtype, spec.numel});
    if (static_cast<size_t>(module) >= module_params_.size())
      module_params_.resize(static_cast<size_t>(module) + 1);
    module_params_[static_cast<size_t>(module)].push_back(id);
    return id;
  }

  // The Python error of a register_parameter_fn callable, raised once.
  void RethrowFillError() {
    if (!fill_error_) return;
    py::error_already_set err = std::move(*fill_error_);
    fill_error_.reset();
    throw err;
  }

  const Param& Get(int id) const {
    if (id < 0 || id >= static_cast<int>(params_.size()))
      throw StatusException{InvalidArgumentError("no parameter " + std::to_string(id))};
    return params_[static_cast<size_t>(id)];
  }

  // Capsules over the pointers of module m's view (registration order).
  py::list Views(int m, const std::vector<void*>& ptrs) {
    const std::vector<int>& ids = module_params_.at(static_cast<size_t>(m));
    if (ids.size() != ptrs.size())
      throw StatusException{InternalError("module view has an unexpected number of tensors")};
    py::list out;
    for (size_t i = 0; i < ptrs.size(); ++i) {
      const Param& p = params_[static_cast<size_t>(ids[i])];
      auto man = std::make_unique<Managed>();
      man->shape = p.shape;
      out.append(MakeCapsule(std::move(man), ptrs[i], p.dtype, device_));
    }
    return out;
  }

 private:
  Config config_;
  std::unique_ptr<Engine> engine_;
  DLDevice device_{};
  std::vector<Param> params_;
  std::vector<std::vector<int>> module_params_;      // module -> parameter ids
  std::optional<py::error_already_set> fill_error_;  // from a fill callable, until raised
};

}  // namespace
}  // namespace strata::python

PYBIND11_MODULE(_strata, m) {
  using strata::python::PyEngine;
  using strata::python::StatusException;
  m.doc() = "Strata's engine binding (use the `strata` package, not this module).";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StatusException& e) {
      py::object errors = py::module_::import("strata._errors");
      const std::string code(strata::StatusCodeName(e.status.code()));
      py::object cls = errors.attr("error_class")(code);
      py::object exc = cls(std::string(e.status.message()), code);
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });

  py::class_<PyEngine>(m, "Engine")
      .def(py::init<const std::string&, const std::string&, const py::dict&, bool,
                    const py::object&>(),
           py::arg("json_text"), py::arg("source"), py::arg("auto_values"), py::arg("host_only"),
           py::arg("rendezvous") = py::none())
      .def("config_json", &PyEngine::config_json)
      .def("register_parameter", &PyEngine::register_parameter, py::arg("name"), py::arg("shape"),
           py::arg("dtype"), py::arg("module"), py::arg("init"), py::arg("group") = 0,
           py::arg("aliases") = std::vector<std::string>{})
      .def("register_parameter_fn", &PyEngine::register_parameter_fn, py::arg("name"),
           py::arg("shape"), py::arg("dtype"), py::arg("module"), py::arg("fill"),
           py::arg("group") = 0, py::arg("aliases") = std::vector<std::string>{})
      .def("add_param_group", &PyEngine::add_param_group, py::arg("name"), py::arg("lr"),
           py::arg("weight_decay"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"))
      .def("num_param_groups", &PyEngine::num_param_groups)
      .def("plan", &PyEngine::plan)
      .def("budgets", &PyEngine::budgets)
      .def("before_forward", &PyEngine::before_forward)
      .def("after_forward", &PyEngine::after_forward)
      .def("before_backward", &PyEngine::before_backward)
      .def("before_backward_grads", &PyEngine::before_backward_grads)
      .def("after_backward", &PyEngine::after_backward)
      .def("step", &PyEngine::step)
      .def("zero_grad", &PyEngine::zero_grad)
      .def("synchronize", &PyEngine::synchronize)
      .def("read_parameter", &PyEngine::read_parameter)
      .def("write_parameter", &PyEngine::write_parameter)
      .def("save_checkpoint", &PyEngine::save_checkpoint, py::arg("dir"),
           py::arg("data_position") = 0, py::arg("note") = "")
      .def("load_checkpoint", &PyEngine::load_checkpoint, py::arg("dir"),
           py::arg("convert_optimizer_states") = false)
      .def("loss_scale", &PyEngine::loss_scale)
      .def("set_learning_rate", &PyEngine::set_learning_rate, py::arg("lr"), py::arg("group") = -1)
      .def("learning_rate", &PyEngine::learning_rate, py::arg("group") = 0)
      .def("compute_stream", &PyEngine::compute_stream)
      .def("device_name", &PyEngine::device_name)
      .def("device_is_host", &PyEngine::device_is_host)
      .def("num_parameters", &PyEngine::num_parameters)
      .def("num_elements", &PyEngine::num_elements)
      .def("stats_json", &PyEngine::stats_json)
      .def("write_timeline", &PyEngine::write_timeline)
      .def("close", &PyEngine::close);

  m.def(
      "parse_config",
      [](const std::string& json_text, const std::string& source, const py::dict& auto_values) {
        return strata::ConfigToJson(
            strata::python::ParseForPython(json_text, source, auto_values, false));
      },
      py::arg("json_text"), py::arg("source") = "<string>", py::arg("auto_values") = py::dict(),
      "The effective config (every key, defaults filled in) as JSON text; raises on a bad one.");
  m.def(
      "schedule_at",
      [](const std::string& json_text, int64_t applied_steps, const std::string& source) {
        const strata::Config c =
            strata::python::ParseForPython(json_text, source, py::dict(), false);
        const strata::ScheduledValues v = strata::ScheduleAt(c, applied_steps);
        py::dict d;
        d["lr"] = v.lr;
        d["beta1"] = v.beta1;
        d["beta2"] = v.beta2;
        d["lr_ratio"] = v.lr_ratio ? py::object(py::float_(*v.lr_ratio)) : py::object(py::none());
        return d;
      },
      py::arg("json_text"), py::arg("applied_steps"), py::arg("source") = "<string>",
      "The config's learning-rate schedule (strata::ScheduleAt) after `applied_steps` applied "
      "optimizer steps: a dict of lr, beta1, beta2 and lr_ratio (None unless the schedule "
      "scales each group's own lr); raises on a bad config.");
  m.def(
      "export_checkpoint",
      [](const std::string& dir, const std::string& out, const std::string& dtype) {
        if (dtype != "fp32" && dtype != "train")
          throw StatusException{strata::InvalidArgumentError("export_checkpoint: dtype " + dtype +
                                                             ", expected \"fp32\" or \"train\"")};
        const auto precision =
            dtype == "fp32" ? strata::ExportPrecision::kFp32 : strata::ExportPrecision::kTrain;
        auto r = [&] {
          py::gil_scoped_release nogil;
          return strata::ExportCheckpoint(dir, out, precision);
        }();
        if (!r.ok()) throw StatusException{r.status()};
        py::dict d;
        d["checkpoint"] = r->checkpoint;
        d["optimizer_step"] = r->optimizer_step;
        d["tensors"] = r->tensors;
        d["bytes"] = r->bytes;
        return d;
      },
      py::arg("checkpoint_dir"), py::arg("out"), py::arg("dtype") = "fp32",
      "Writes a checkpoint's parameters (fp32 masters or training-dtype copies) as a "
      "safetensors file keyed by the registered names; verifies the checkpoint first.");
  m.def(
      "write_safetensors",
      [](const std::string& path, const std::vector<std::pair<std::string, std::string>>& metadata,
         const std::vector<std::tuple<std::string, std::string, std::vector<int64_t>, py::capsule>>&
             tensors) {
        std::vector<std::unique_ptr<strata::python::ConsumedBytes>> held;
        std::vector<strata::scheduler::SafetensorsTensorData> data;
        for (const auto& [name, dtype, shape, cap] : tensors) {
          held.push_back(
              std::make_unique<strata::python::ConsumedBytes>(cap, "write_safetensors: " + name));
          data.push_back({{name, dtype, shape}, held.back()->bytes()});
        }
        auto r = [&] {
          py::gil_scoped_release nogil;
          return strata::scheduler::WriteSafetensors(path, metadata, data);
        }();
        if (!r.ok()) throw StatusException{r.status()};
        return *r;
      },
      py::arg("path"), py::arg("metadata"), py::arg("tensors"),
      "Writes a safetensors file (src/scheduler/safetensors.h): `metadata` as (key, value) "
      "strings, `tensors` as (name, dtype name such as \"BF16\", shape, DLPack capsule of the "
      "tensor's bytes as a 1-D uint8 CPU tensor). Returns the file's size.");
}
