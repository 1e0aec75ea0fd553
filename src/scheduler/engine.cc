// The tiered scheduler: strata::Engine on a Device, the CPU optimizer and the
// NVMe swap store. See scheduler.h and docs/design.md ("Scheduler").
//
// Layout. Parameters are laid out in one flat element space ordered by
// (module, registration order), so a module's parameters are contiguous and
// sub-groups (sub_group_size elements) cut that space into shards. Every
// per-element state is a flat array over that space:
//   grad_acc_     fp32 gradient accumulator, host DRAM (every placement)
//   master/m/v    fp32 optimizer state: arena (offload_optimizer none, host
//                 device only), DRAM (cpu), or per sub-group NVMe shards (nvme)
//   host params   fp16/bf16/fp32 copy the device fetches from: DRAM (cpu),
//                 per-module NVMe shards (nvme); with offload_param none the
//                 parameters live in one arena block for the whole run.
//   next params   DRAM: the optimizer's fused copy-out target; published at
//                 commit (pointer flip for cpu, H2D for none; for nvme the
//                 module shards are written from it during the step).
//
// Atomic steps. NVMe-resident states and parameters have two versions (A/B)
// on disk; a step reads the active version and writes the other, and flips
// only after every write has succeeded, so a failed step leaves the previous
// state intact. DRAM/HBM-resident optimizer states are updated in place; the
// only failures possible after that point are NVMe parameter writes, which
// are reported precisely (the parameters on NVMe stay at the previous step and
// are rewritten by the next successful one).
#include <fmt/format.h>
#include <sys/statvfs.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <unordered_map>

#include "src/common/aligned_buffer.h"
#include "src/common/dtype.h"
#include "src/common/half.h"
#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/gpu/device.h"
#include "src/scheduler/fetch_trace.h"
#include "src/scheduler/loss_scaler.h"
#include "src/scheduler/scheduler.h"
#include "src/scheduler/timeline.h"

namespace strata {
namespace {

using gpu::Device;
using gpu::DeviceBuffer;
using gpu::Event;
using gpu::PinnedBuffer;
using gpu::PinnedPool;
using gpu::Stream;

constexpr int64_t kNormBlock = 1 << 16;  // elements per partial sum (fixed: deterministic)
// Every NVMe request is a multiple of this in offset, length and buffer
// address, so the I/O engine never sends a piece through the page cache: a
// buffered read-modify-write of a partial page racing an O_DIRECT write of
// the rest of that page can write stale bytes back.
constexpr int64_t kIoAlign = 4096;
int64_t IoBytes(int64_t n) {
  return static_cast<int64_t>(AlignUp(static_cast<size_t>(n), kIoAlign));
}

std::string Bytes(int64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  return u == 0 ? fmt::format("{} B", b) : fmt::format("{:.2f} {}", v, units[u]);
}

void FromFloat(float v, DType t, void* p, int64_t i) {
  switch (t) {
    case DType::kFp32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::kFp16:
      static_cast<uint16_t*>(p)[i] = FloatToHalfBits(v);
      break;
    case DType::kBf16:
      static_cast<uint16_t*>(p)[i] = FloatToBf16Bits(v);
      break;
  }
}

// A flat host array that may be page-locked through the device.
class HostArray {
 public:
  Status Allocate(int64_t bytes, Device* pin_with, const std::string& what) {
    ASSIGN_OR_RETURN(
        buf_, AlignedBuffer::Allocate(static_cast<size_t>(std::max<int64_t>(bytes, 64)), 4096));
    bytes_ = bytes;
    if (pin_with != nullptr && bytes > 0) {
      Status s = pin_with->PinHostMemory(buf_.data(), AlignUp(static_cast<size_t>(bytes), 4096));
      if (s.ok()) {
        pinned_by_ = pin_with;
      } else {
        STRATA_WARN_ONCE("scheduler.pin." + what,
                         "pin_memory: could not page-lock {} for {} ({}); using pageable memory "
                         "(raise the limit with `ulimit -l unlimited` or LimitMEMLOCK=infinity)",
                         Bytes(bytes), what, s.ToString());
      }
    }
    return Status();
  }
  ~HostArray() {
    if (pinned_by_ != nullptr)
      pinned_by_->UnpinHostMemory(buf_.data(), AlignUp(static_cast<size_t>(bytes_), 4096))
          .IgnoreError();
  }
  void* data() { return buf_.data(); }
  template <typename T>
  T* as() {
    return buf_.as<T>();
  }
  int64_t bytes() const { return bytes_; }
  bool pinned() const { return pinned_by_ != nullptr; }
  void swap(HostArray& o) {
    std::swap(buf_, o.buf_);
    std::swap(bytes_, o.bytes_);
    std::swap(pinned_by_, o.pinned_by_);
  }

 private:
  AlignedBuffer buf_;
  int64_t bytes_ = 0;
  Device* pinned_by_ = nullptr;
};

struct ParamRec {
  std::string name;
  int64_t numel = 0;
  DType dtype = DType::kBf16;
  int module = 0;
  int64_t elem_off = 0;  // in the flat element space
  int64_t byte_off = 0;  // in the flat parameter-byte space
  std::vector<float> init;
  std::function<void(std::span<float>)> initializer;
};

enum class Residency { kAbsent, kReading, kCopying, kResident };

struct ModuleRec {
  std::vector<int> params;
  int64_t elem_begin = 0, elem_end = 0;
  int64_t byte_begin = 0, byte_end = 0;
  int64_t elems() const { return elem_end - elem_begin; }
  int64_t bytes() const { return byte_end - byte_begin; }
  bool persistent = false;
  // Device copy (offload_param cpu/nvme): state machine absent → (reading
  // from NVMe into `staging`) → copying (H2D in flight, `ready` recorded) →
  // resident.
  Residency residency = Residency::kAbsent;
  DeviceBuffer buf;
  std::unique_ptr<Event> ready;
  // Recorded on the compute stream when the module's gradients are complete;
  // the D2H stream waits on it. Owned here because a stream wait refers to it.
  std::unique_ptr<Event> computed;
  PinnedBuffer staging;
  nvme::IoHandle read;
  int64_t read_issued_ns = 0;
  bool in_use = false;
  bool prefetched = false;  // fetch started by a prefetch, not by demand
  DeviceBuffer grad;
  bool registered = false;  // at least one parameter
  int last_group = -1;      // the sub-group holding its last element (-1: none)
};

struct SubGroup {
  int64_t elem_begin = 0, elem_end = 0;
  int64_t elems() const { return elem_end - elem_begin; }
};

// One D2H'd chunk of gradients waiting to be accumulated.
struct GradJob {
  PinnedBuffer staging;
  std::unique_ptr<Event> done;
  int module = 0;
  int64_t byte_begin = 0, byte_end = 0;  // in the flat parameter-byte space
};

struct DeferredFree {
  DeviceBuffer buf;
  std::unique_ptr<Event> after;
};

// An optimizer step running on its own thread (strata.overlap_optimizer,
// strata.delayed_param_update). Sub-groups are stepped in order; the thread
// publishes its progress through `groups_done`, and the main thread commits
// or rolls the step back once it has finished (FinishStep).
struct AsyncStep {
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<size_t> groups_done{0};  // written under mu: sub-groups stepped, in order
  bool finished = false;               // GUARDED_BY(mu)
  Status status;                       // GUARDED_BY(mu)
  // Set by the thread before it finishes (read after join).
  bool advanced = false;  // in-memory states moved to the new step
  std::vector<int> param_write_failed;  // modules whose NVMe parameter write failed
  std::vector<int> param_written;       // modules whose new parameters are on NVMe

  // Set at launch (main thread).
  bool delayed = false;  // DPU: its parameters are used from the next Step() on
  bool background = false;  // on its own thread (else run inside Step())
  const float* grads = nullptr;  // the accumulator it consumes (zeroed as it goes)
  float* grads_mut = nullptr;
  cpu_adam::HyperParams hp;
  int64_t step = 0;  // the optimizer step it computes (1-based)
  int64_t launched_ns = 0;
  LossScaler scaler_before;
  // Main thread: modules whose new parameters were uploaded into the device
  // parameter block during the step (offload_param none).
  std::vector<uint8_t> uploaded;
  // offload_optimizer nvme: the first sub-groups' states, read during the
  // last backward pass of the window (buffer g holds sub-group g).
  std::vector<PinnedBuffer> pre_buffers;
  std::vector<nvme::IoHandle> pre_reads;
  std::vector<int64_t> pre_issue_ns;
};

class EngineImpl final : public Engine {
 public:
  EngineImpl(Config config, EngineTestHooks hooks)
      : cfg_(std::move(config)), hooks_(std::move(hooks)) {}
  ~EngineImpl() override;

  Status Init();

  StatusOr<int> RegisterParameter(const ParamSpec& spec) override;
  Status Plan() override;
  std::vector<TierBudget> Budgets() const override { return budgets_; }
  StatusOr<ModuleView> BeforeForward(int module) override;
  Status AfterForward(int module) override;
  StatusOr<ModuleView> BeforeBackward(int module) override;
  Status AfterBackward(int module) override;
  StatusOr<StepStats> Step() override;
  Status ZeroGrad() override;
  Status Synchronize() override;
  double loss_scale() const override { return scaler_.scale(); }
  void* ComputeStream() const override { return dev_->compute().native_handle(); }
  StatusOr<void*> AllocateWorkspace(int64_t bytes) override;
  Status FreeWorkspace(void* ptr) override;
  std::string DeviceName() const override { return dev_->Describe(); }
  bool DeviceIsHost() const override { return dev_->is_host(); }
  Status ReadParameter(int id, std::span<float> out) override;
  StatusOr<int> FindParameter(std::string_view name) const override;
  int num_parameters() const override { return static_cast<int>(params_.size()); }
  int64_t num_elements() const override { return total_elems_; }
  StepStats LastStepStats() const override { return last_; }
  std::string StatsJson() const override;
  Status WriteTimeline() override;

 private:
  OffloadDevice opt_place() const { return cfg_.zero_optimization.offload_optimizer.device; }
  OffloadDevice param_place() const { return cfg_.zero_optimization.offload_param.device; }
  bool params_offloaded() const { return param_place() != OffloadDevice::kNone; }

  Status CheckModule(int module, const char* call) const;
  void ComputePlan(int64_t hbm_budget, int64_t pinned_budget);
  Status AllocateStates();
  Status InitializeStates();

  // Fetching.
  Status Fetch(int module, bool prefetch);
  Status StartCopy(ModuleRec& m);
  Status WaitResident(int module);
  Status Acquire(int module);
  Status Pump();  // advances NVMe reads that have completed
  Status MakeRoom(int64_t bytes, int keep_module);
  void ReleaseModule(ModuleRec& m);
  Status Prefetch();
  Status FinishUse(int module);
  StatusOr<DeviceBuffer> AllocDevice(int64_t bytes, int keep_module);
  Status ReclaimDeferred(bool wait_all);
  ModuleView ViewOf(int module, bool with_grads);
  int64_t live_elems() const;

  // Gradients.
  void GradWorker();
  Status DrainGrads();
  void Accumulate(const GradJob& job);

  // Optimizer. A step is launched by Step() (LaunchStep) and runs RunStep
  // on its own thread, or inline without overlap; FinishStep joins it and
  // commits (CommitStep) or rolls it back (RollbackStep).
  cpu_adam::HyperParams HyperParamsFor(float grad_scale) const;
  void LaunchStep(float grad_scale, bool delayed, bool background);
  void RunStep(AsyncStep* job);
  // Sub-group g of the step is done: its gradients are zeroed and modules
  // whose last element is in it may use the new parameters.
  void GroupDone(AsyncStep* job, size_t g);
  Status StepCpuStates(AsyncStep* job);
  Status StepNvmeStates(AsyncStep* job);
  Status WriteParamShards(int64_t elem_begin, int64_t elem_end,
                          std::vector<std::pair<int, nvme::IoHandle>>& out);
  Status FinishStep();
  Status CommitStep(AsyncStep& job);
  void RollbackStep(AsyncStep& job);
  Status PollStep();  // finishes a step that has ended (error, or commit when not delayed)
  Status AwaitModule(int module);  // waits for a module's parameters of the step in flight
  bool ModuleReady(int module) const;
  bool reading_next_params() const { return inflight_ && !inflight_->delayed; }
  Status InvalidateDeviceCopies();
  // offload_optimizer nvme: starts reading the states of the sub-groups the
  // next step begins with (they do not depend on the gradients).
  void PrefetchStates();
  size_t StateLookahead(size_t buffers) const { return buffers >= 3 ? buffers - 2 : buffers - 1; }
  void GlobalChecks(bool* overflow, double* sumsq);
  void ClearGradients();

  // Timing helpers.
  void NoteHookEntry();
  void NoteHookExit();
  void NoteNvme(int64_t start_ns, int64_t end_ns, int64_t bytes, bool write,
                const std::string& name);

  std::string ModuleShard(int module, int version) const {
    return fmt::format("param.m{}.v{}", module, version);
  }
  std::string StateShard(size_t group, int version) const {
    return fmt::format("state.g{}.v{}", group, version);
  }

  Config cfg_;
  EngineTestHooks hooks_;
  std::unique_ptr<Device> dev_;
  std::unique_ptr<cpu_adam::CpuOptimizer> adam_;
  std::unique_ptr<nvme::IoService> io_;
  std::unique_ptr<nvme::SwapStore> swap_;
  std::unique_ptr<PinnedPool> grad_pool_, opt_pool_, param_pool_;
  Timeline timeline_;
  LossScaler scaler_;
  std::unique_ptr<FetchTrace> trace_;

  std::vector<ParamRec> params_;
  std::unordered_map<std::string, int> by_name_;
  std::vector<ModuleRec> modules_;
  std::vector<SubGroup> groups_;
  int64_t total_elems_ = 0;
  int64_t total_param_bytes_ = 0;
  int64_t max_module_bytes_ = 0;
  int64_t max_group_elems_ = 0;
  bool planned_ = false;
  std::vector<TierBudget> budgets_;
  bool plan_fits_ = true;

  // States.
  HostArray grad_acc_;
  HostArray master_h_, exp_avg_h_, exp_avg_sq_h_;     // offload_optimizer cpu
  DeviceBuffer master_d_, exp_avg_d_, exp_avg_sq_d_;  // offload_optimizer none (host device)
  float* master_ = nullptr;
  float* exp_avg_ = nullptr;
  float* exp_avg_sq_ = nullptr;
  std::vector<int> state_version_;          // per sub-group, nvme: active version
  HostArray host_params_;                   // offload_param cpu
  HostArray next_params_;                   // copy-out target
  DeviceBuffer device_params_;              // offload_param none
  std::unique_ptr<Event> params_uploaded_;  // offload_param none: last publish H2D
  std::vector<int> module_version_;         // per module, nvme: active version
  int64_t optimizer_steps_ = 0;
  int micro_batches_ = 0;
  std::unique_ptr<AsyncStep> inflight_;  // the step running in the background
  HostArray grad_alt_;                   // DPU: the accumulator of the next window
  bool grads_since_launch_ = false;      // gradients were handed over since LaunchStep
  bool mirror_params_ = false;           // offload_param none: host_params_ mirrors the device
  // PrefetchStates: reads of the next step's first sub-groups (main thread).
  std::vector<PinnedBuffer> pre_buffers_;
  std::vector<nvme::IoHandle> pre_reads_;
  std::vector<int64_t> pre_issue_ns_;

  std::vector<DeferredFree> deferred_;
  std::map<void*, DeviceBuffer> workspaces_;

  // Gradient worker.
  std::thread grad_thread_;
  std::mutex grad_mu_;
  std::condition_variable grad_cv_;
  std::deque<GradJob> grad_queue_;  // GUARDED_BY(grad_mu_)
  int64_t grad_pending_ = 0;        // GUARDED_BY(grad_mu_): queued + running
  bool grad_stop_ = false;          // GUARDED_BY(grad_mu_)
  Status grad_error_;               // GUARDED_BY(grad_mu_)
  std::atomic<int64_t> grad_busy_ns_{0};
  int64_t grad_staging_bytes_ = 0;

  // Statistics of the current step window.
  StepStats last_;
  int64_t window_start_ns_ = 0;
  int64_t last_hook_exit_ns_ = -1;
  int64_t compute_ns_ = 0;
  int64_t fetch_wait_ns_ = 0;
  std::atomic<int64_t> h2d_busy_ns_{0}, d2h_busy_ns_{0};
  std::atomic<int64_t> h2d_bytes_{0}, d2h_bytes_{0};
  std::atomic<int64_t> nvme_read_bytes_{0}, nvme_written_bytes_{0};
  std::mutex stats_mu_;  // the optimizer thread notes NVMe intervals too
  std::vector<std::pair<int64_t, int64_t>> nvme_intervals_;  // GUARDED_BY(stats_mu_)
  std::atomic<int64_t> optimizer_ns_{0};
  int64_t optimizer_wait_ns_ = 0;
  int64_t prefetch_hits_ = 0, fetch_misses_ = 0;
  int64_t pinned_high_water_ = 0;
};

// ---------------------------------------------------------------------------
// Creation and registration
// ---------------------------------------------------------------------------

EngineImpl::~EngineImpl() {
  // A step still running in the background ends first; it is not committed
  // (nothing reads the engine's state any more).
  if (inflight_ && inflight_->thread.joinable()) inflight_->thread.join();
  for (auto& h : pre_reads_) h.Wait().IgnoreError();
  if (dev_) dev_->Synchronize().IgnoreError();
  {
    std::lock_guard<std::mutex> lock(grad_mu_);
    grad_stop_ = true;
  }
  grad_cv_.notify_all();
  if (grad_thread_.joinable()) grad_thread_.join();
  if (!cfg_.strata.trace_path.empty() && timeline_.size() > 0) {
    Status s = WriteTimeline();
    if (!s.ok()) STRATA_LOG_WARN("timeline: {}", s.ToString());
  }
  for (auto& m : modules_) {
    if (m.read.valid()) m.read.Wait().IgnoreError();
  }
  if (swap_) swap_->Close().IgnoreError();
}

Status EngineImpl::Init() {
  RETURN_IF_ERROR(ValidateConfig(cfg_));
  const auto& zo = cfg_.zero_optimization;
  if (zo.offload_optimizer.device == OffloadDevice::kNvme && zo.offload_optimizer.nvme_path.empty())
    return InvalidArgumentError(
        "zero_optimization.offload_optimizer.nvme_path: required when device is nvme");
  if (zo.offload_param.device == OffloadDevice::kNvme && zo.offload_param.nvme_path.empty())
    return InvalidArgumentError(
        "zero_optimization.offload_param.nvme_path: required when device is nvme");
  // Fail on unusable NVMe directories before anything else is set up.
  for (const auto* paths : {&zo.offload_optimizer.nvme_path, &zo.offload_param.nvme_path}) {
    const bool used = (paths == &zo.offload_optimizer.nvme_path)
                          ? zo.offload_optimizer.device == OffloadDevice::kNvme
                          : zo.offload_param.device == OffloadDevice::kNvme;
    if (!used) continue;
    for (const std::string& p : *paths) {
      if (access(p.c_str(), F_OK) != 0)
        return NotFoundError(fmt::format("nvme_path {}: no such directory", p));
      if (access(p.c_str(), W_OK | X_OK) != 0)
        return ErrnoError(fmt::format("nvme_path {}: not writable", p), errno);
    }
  }

  ASSIGN_OR_RETURN(gpu::DeviceOptions dopts, gpu::DeviceOptionsFromConfig(cfg_));
  ASSIGN_OR_RETURN(dev_, gpu::CreateDevice(dopts));
  if (opt_place() == OffloadDevice::kNone && !dev_->is_host())
    return NotSupportedError(
        "zero_optimization.offload_optimizer.device: none needs a GPU optimizer kernel, which this "
        "build does not have yet; use cpu or nvme");

  cpu_adam::Options aopts;
  aopts.threads = static_cast<int>(cfg_.strata.threads);
  ASSIGN_OR_RETURN(adam_, cpu_adam::CpuOptimizer::Create(aopts));

  scaler_ = cfg_.fp16.enabled ? LossScaler::FromConfig(cfg_.fp16) : LossScaler::Disabled();
  timeline_.set_enabled(!cfg_.strata.trace_path.empty());
  grad_thread_ = std::thread([this] { GradWorker(); });
  window_start_ns_ = NowNanos();
  return Status();
}

StatusOr<int> EngineImpl::RegisterParameter(const ParamSpec& spec) {
  if (planned_) return FailedPreconditionError("RegisterParameter " + spec.name + ": after Plan()");
  if (spec.name.empty()) return InvalidArgumentError("RegisterParameter: empty name");
  if (by_name_.count(spec.name))
    return InvalidArgumentError("RegisterParameter: duplicate name " + spec.name);
  if (spec.numel <= 0)
    return InvalidArgumentError(
        fmt::format("RegisterParameter {}: numel {} must be > 0", spec.name, spec.numel));
  if (spec.module < 0 || spec.module > 1'000'000)
    return InvalidArgumentError(
        fmt::format("RegisterParameter {}: module {} out of range", spec.name, spec.module));
  if (!spec.init.empty() && static_cast<int64_t>(spec.init.size()) != spec.numel)
    return InvalidArgumentError(fmt::format("RegisterParameter {}: init has {} values, numel is {}",
                                            spec.name, spec.init.size(), spec.numel));
  if (spec.init.empty() && !spec.initializer)
    return InvalidArgumentError("RegisterParameter " + spec.name +
                                ": give init values or an initializer");
  ParamRec p;
  p.name = spec.name;
  p.numel = spec.numel;
  p.dtype = spec.dtype;
  p.module = spec.module;
  p.init.assign(spec.init.begin(), spec.init.end());
  p.initializer = spec.initializer;
  const int id = static_cast<int>(params_.size());
  by_name_[p.name] = id;
  params_.push_back(std::move(p));
  return id;
}

StatusOr<int> EngineImpl::FindParameter(std::string_view name) const {
  auto it = by_name_.find(std::string(name));
  if (it == by_name_.end()) return NotFoundError(fmt::format("no parameter named {}", name));
  return it->second;
}

// ---------------------------------------------------------------------------
// Planning
// ---------------------------------------------------------------------------

void EngineImpl::ComputePlan(int64_t hbm_budget, int64_t pinned_budget) {
  const auto& zo = cfg_.zero_optimization;
  budgets_.clear();
  const int64_t n = total_elems_;
  // HBM.
  TierBudget hbm{"hbm", 0, hbm_budget, ""};
  std::vector<std::string> parts;
  if (!params_offloaded()) {
    hbm.needed_bytes += total_param_bytes_;
    parts.push_back("parameters " + Bytes(total_param_bytes_));
  } else {
    int64_t persistent = 0;
    for (auto& m : modules_) persistent += m.persistent ? m.bytes() : 0;
    // Working set: the live-parameter limit, but at least the largest module
    // (for backward: the module and its gradient buffer, plus one prefetched).
    const int64_t elem_size = total_elems_ ? total_param_bytes_ / total_elems_ : 2;
    const int64_t live =
        std::min(total_param_bytes_ - persistent,
                 std::max(zo.stage3_max_live_parameters * elem_size, 2 * max_module_bytes_));
    hbm.needed_bytes += persistent + live;
    parts.push_back("persistent parameters " + Bytes(persistent));
    parts.push_back("live parameters " + Bytes(live));
  }
  hbm.needed_bytes += 2 * max_module_bytes_;  // gradient buffers: one written, one offloading
  parts.push_back("gradient buffers " + Bytes(2 * max_module_bytes_));
  if (opt_place() == OffloadDevice::kNone) {
    hbm.needed_bytes += 12 * n;
    parts.push_back("optimizer states " + Bytes(12 * n));
  }
  hbm.detail = fmt::format("{}", fmt::join(parts, " + "));
  budgets_.push_back(hbm);

  // Pinned staging (+ pinned states when pin_memory).
  TierBudget pinned{"pinned", 0, pinned_budget, ""};
  parts.clear();
  int64_t staging = 4 * grad_staging_bytes_;
  parts.push_back("gradient staging " + Bytes(staging));
  if (opt_place() == OffloadDevice::kNvme) {
    const int64_t b = zo.offload_optimizer.buffer_count * 12 * max_group_elems_;
    staging += b;
    parts.push_back(fmt::format("optimizer pipeline {} x {}", zo.offload_optimizer.buffer_count,
                                Bytes(12 * max_group_elems_)));
  }
  if (param_place() == OffloadDevice::kNvme) {
    const int64_t b = zo.offload_param.buffer_count * max_module_bytes_;
    staging += b;
    parts.push_back(fmt::format("parameter fetch {} x {}", zo.offload_param.buffer_count,
                                Bytes(max_module_bytes_)));
  }
  pinned.needed_bytes = staging;
  if (opt_place() == OffloadDevice::kCpu && zo.offload_optimizer.pin_memory) {
    pinned.needed_bytes += 12 * n;
    parts.push_back("optimizer states " + Bytes(12 * n));
  }
  pinned.detail = fmt::format("{}", fmt::join(parts, " + "));
  budgets_.push_back(pinned);

  // NVMe: two versions of everything placed there (atomic steps).
  std::vector<std::string> nvme_paths;
  TierBudget disk{"nvme", 0, 0, ""};
  parts.clear();
  if (opt_place() == OffloadDevice::kNvme) {
    disk.needed_bytes += 2 * 12 * n;
    parts.push_back("optimizer states 2 x " + Bytes(12 * n));
    nvme_paths = zo.offload_optimizer.nvme_path;
  }
  if (param_place() == OffloadDevice::kNvme) {
    disk.needed_bytes += 2 * total_param_bytes_;
    parts.push_back("parameters 2 x " + Bytes(total_param_bytes_));
    for (auto& p : zo.offload_param.nvme_path)
      if (std::find(nvme_paths.begin(), nvme_paths.end(), p) == nvme_paths.end())
        nvme_paths.push_back(p);
  }
  if (!nvme_paths.empty()) {
    // Headroom for stripe rounding: one stripe unit per shard per path.
    disk.needed_bytes +=
        static_cast<int64_t>(2 * (groups_.size() + modules_.size()) * nvme_paths.size()) << 20;
    int64_t avail = 0;
    for (auto& p : nvme_paths) {
      struct statvfs sv {};
      if (statvfs(p.c_str(), &sv) == 0) avail += static_cast<int64_t>(sv.f_bavail) * sv.f_frsize;
    }
    disk.available_bytes = avail;
    disk.detail = fmt::format("{} on {}", fmt::join(parts, " + "), fmt::join(nvme_paths, ", "));
    budgets_.push_back(disk);
  }

  // DRAM (pageable): gradient accumulator, copy-out target, host states/params.
  TierBudget dram{"dram", 0, 0, ""};
  parts.clear();
  dram.needed_bytes = 4 * n + total_param_bytes_;
  parts.push_back("gradient accumulator " + Bytes(4 * n));
  parts.push_back("updated parameters " + Bytes(total_param_bytes_));
  if (opt_place() == OffloadDevice::kCpu && !zo.offload_optimizer.pin_memory) {
    dram.needed_bytes += 12 * n;
    parts.push_back("optimizer states " + Bytes(12 * n));
  }
  if (param_place() == OffloadDevice::kCpu) {
    dram.needed_bytes += total_param_bytes_;
    parts.push_back("parameters " + Bytes(total_param_bytes_));
  }
  if (param_place() == OffloadDevice::kNone && cfg_.strata.overlap_optimizer) {
    dram.needed_bytes += total_param_bytes_;
    parts.push_back("parameter mirror (overlap_optimizer) " + Bytes(total_param_bytes_));
  }
  if (cfg_.strata.delayed_param_update) {
    dram.needed_bytes += 4 * n;
    parts.push_back("second gradient accumulator (delayed_param_update) " + Bytes(4 * n));
  }
  const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  dram.available_bytes = (pages > 0 && page > 0) ? static_cast<int64_t>(pages) * page : 0;
  dram.detail = fmt::format("{}", fmt::join(parts, " + "));
  budgets_.push_back(dram);

  plan_fits_ = true;
  for (auto& t : budgets_)
    if (t.available_bytes > 0 && t.needed_bytes > t.available_bytes) plan_fits_ = false;
}

Status EngineImpl::Plan() {
  if (planned_) return Status();
  if (params_.empty()) return FailedPreconditionError("Plan: no parameters registered");
  const auto& zo = cfg_.zero_optimization;
  // Modules and the flat layout, ordered by (module, registration).
  int max_module = 0;
  for (auto& p : params_) max_module = std::max(max_module, p.module);
  modules_.clear();
  modules_.resize(static_cast<size_t>(max_module) + 1);
  for (int i = 0; i < static_cast<int>(params_.size()); ++i)
    modules_[params_[i].module].params.push_back(i);
  int64_t elem = 0, byte = 0;
  for (auto& m : modules_) {
    m.elem_begin = elem;
    byte = IoBytes(byte);  // modules start on a page: whole-module NVMe I/O is aligned
    m.byte_begin = byte;
    for (int id : m.params) {
      auto& p = params_[id];
      p.elem_off = elem;
      p.byte_off = byte;
      elem += p.numel;
      byte += p.numel * static_cast<int64_t>(DTypeSize(p.dtype));
      byte = static_cast<int64_t>(
          AlignUp(static_cast<size_t>(byte), 256));  // device alignment per tensor
    }
    m.elem_end = elem;
    m.byte_end = byte;
    m.registered = !m.params.empty();
    m.persistent = !params_offloaded() || m.elems() < zo.stage3_param_persistence_threshold;
    max_module_bytes_ = std::max(max_module_bytes_, m.bytes());
  }
  total_elems_ = elem;
  total_param_bytes_ = IoBytes(byte);
  // Sub-groups.
  const int64_t sg = std::max<int64_t>(1, zo.sub_group_size);
  for (int64_t b = 0; b < total_elems_; b += sg) {
    groups_.push_back({b, std::min(total_elems_, b + sg)});
    max_group_elems_ = std::max(max_group_elems_, groups_.back().elems());
  }
  for (auto& m : modules_)
    m.last_group = m.elems() > 0 ? static_cast<int>((m.elem_end - 1) / sg) : -1;
  grad_staging_bytes_ = std::min<int64_t>(std::max<int64_t>(max_module_bytes_, 4096),
                                          std::max<int64_t>(zo.reduce_bucket_size * 2, 4096));

  const gpu::ArenaStats as = dev_->Stats();
  ComputePlan(static_cast<int64_t>(as.budget_bytes), cfg_.strata.pinned_budget_bytes);
  if (!plan_fits_) {
    std::string table = "the placement does not fit:\n";
    table += fmt::format("  {:<7} {:>12} {:>12}  {}\n", "tier", "needed", "available", "made of");
    for (auto& t : budgets_)
      table += fmt::format(
          "  {:<7} {:>12} {:>12}  {}{}\n", t.tier, Bytes(t.needed_bytes),
          t.available_bytes > 0 ? Bytes(t.available_bytes) : std::string("-"), t.detail,
          (t.available_bytes > 0 && t.needed_bytes > t.available_bytes) ? "  <-- over" : "");
    table += fmt::format(
        "  (stage {}, offload_optimizer {}, offload_param {}, {} parameters in {} modules, "
        "sub_group_size {})",
        zo.stage, OffloadDeviceName(opt_place()), OffloadDeviceName(param_place()), total_elems_,
        modules_.size(), zo.sub_group_size);
    return ResourceExhaustedError(table);
  }
  std::vector<int64_t> module_elems;
  for (auto& m : modules_) module_elems.push_back(m.elems());
  trace_ = std::make_unique<FetchTrace>(std::move(module_elems));
  RETURN_IF_ERROR(AllocateStates());
  RETURN_IF_ERROR(InitializeStates());
  planned_ = true;
  // Parameters are no longer needed in registration form.
  for (auto& p : params_) {
    p.init.clear();
    p.init.shrink_to_fit();
    p.initializer = nullptr;
  }
  return Status();
}

Status EngineImpl::AllocateStates() {
  const auto& zo = cfg_.zero_optimization;
  const int64_t n = total_elems_;
  Device* pin_opt = zo.offload_optimizer.pin_memory ? dev_.get() : nullptr;
  Device* pin_par = zo.offload_param.pin_memory ? dev_.get() : nullptr;
  RETURN_IF_ERROR(grad_acc_.Allocate(4 * n, nullptr, "gradient accumulator"));
  std::memset(grad_acc_.data(), 0, static_cast<size_t>(4 * n));
  RETURN_IF_ERROR(next_params_.Allocate(total_param_bytes_, pin_par, "updated parameters"));
  if (cfg_.strata.delayed_param_update) {
    RETURN_IF_ERROR(grad_alt_.Allocate(4 * n, nullptr, "second gradient accumulator"));
    std::memset(grad_alt_.data(), 0, static_cast<size_t>(4 * n));
  }

  switch (opt_place()) {
    case OffloadDevice::kNone: {
      ASSIGN_OR_RETURN(master_d_, dev_->Allocate(static_cast<size_t>(4 * n)));
      ASSIGN_OR_RETURN(exp_avg_d_, dev_->Allocate(static_cast<size_t>(4 * n)));
      ASSIGN_OR_RETURN(exp_avg_sq_d_, dev_->Allocate(static_cast<size_t>(4 * n)));
      master_ = master_d_.as<float>();
      exp_avg_ = exp_avg_d_.as<float>();
      exp_avg_sq_ = exp_avg_sq_d_.as<float>();
      break;
    }
    case OffloadDevice::kCpu:
      RETURN_IF_ERROR(master_h_.Allocate(4 * n, pin_opt, "optimizer states"));
      RETURN_IF_ERROR(exp_avg_h_.Allocate(4 * n, pin_opt, "optimizer states"));
      RETURN_IF_ERROR(exp_avg_sq_h_.Allocate(4 * n, pin_opt, "optimizer states"));
      master_ = master_h_.as<float>();
      exp_avg_ = exp_avg_h_.as<float>();
      exp_avg_sq_ = exp_avg_sq_h_.as<float>();
      break;
    case OffloadDevice::kNvme:
      state_version_.assign(groups_.size(), 0);
      break;
  }
  switch (param_place()) {
    case OffloadDevice::kNone: {
      ASSIGN_OR_RETURN(device_params_, dev_->Allocate(static_cast<size_t>(total_param_bytes_)));
      ASSIGN_OR_RETURN(params_uploaded_, dev_->CreateEvent());
      // With the optimizer overlapping the next forward, modules are uploaded
      // one by one as the step finishes them; the mirror holds the previous
      // parameters so that a step failing half-way can be undone.
      mirror_params_ = cfg_.strata.overlap_optimizer;
      if (mirror_params_)
        RETURN_IF_ERROR(host_params_.Allocate(total_param_bytes_, pin_par, "parameter mirror"));
      break;
    }
    case OffloadDevice::kCpu:
      RETURN_IF_ERROR(host_params_.Allocate(total_param_bytes_, pin_par, "parameters"));
      break;
    case OffloadDevice::kNvme:
      module_version_.assign(modules_.size(), 0);
      break;
  }
  for (auto& m : modules_) {
    ASSIGN_OR_RETURN(m.ready, dev_->CreateEvent());
    ASSIGN_OR_RETURN(m.computed, dev_->CreateEvent());
  }

  // Pinned staging, one pool per purpose so that no user can starve another
  // (a gradient chunk must never hold an optimizer pipeline buffer):
  // gradient chunks; NVMe optimizer pipeline; NVMe parameter fetches. The
  // pinned budget was checked against their total by Plan().
  auto make_pool = [&](std::unique_ptr<PinnedPool>* pool, int64_t bytes, int64_t count) -> Status {
    gpu::PinnedPoolOptions popts;
    popts.classes.push_back({AlignUp(static_cast<size_t>(std::max<int64_t>(bytes, 4096)), 4096),
                             static_cast<size_t>(std::max<int64_t>(1, count))});
    popts.allow_pageable_fallback = true;
    ASSIGN_OR_RETURN(*pool, PinnedPool::Create(popts, dev_.get()));
    pinned_high_water_ += static_cast<int64_t>((*pool)->total_bytes());
    return Status();
  };
  RETURN_IF_ERROR(make_pool(&grad_pool_, grad_staging_bytes_, 4));
  if (opt_place() == OffloadDevice::kNvme)
    RETURN_IF_ERROR(
        make_pool(&opt_pool_, 12 * max_group_elems_, zo.offload_optimizer.buffer_count));
  if (param_place() == OffloadDevice::kNvme)
    RETURN_IF_ERROR(make_pool(&param_pool_, max_module_bytes_, zo.offload_param.buffer_count));

  // NVMe.
  if (opt_place() == OffloadDevice::kNvme || param_place() == OffloadDevice::kNvme) {
    nvme::IoOptions io = nvme::IoOptionsFromConfig(cfg_);
    for (auto* pool : {grad_pool_.get(), opt_pool_.get(), param_pool_.get()})
      if (pool != nullptr)
        for (auto& r : pool->Regions()) io.fixed_buffers.push_back({r.data, r.bytes});
    ASSIGN_OR_RETURN(std::unique_ptr<nvme::IoEngine> engine, nvme::NewIoEngine(io));
    if (hooks_.wrap_io_engine) engine = hooks_.wrap_io_engine(std::move(engine));
    ASSIGN_OR_RETURN(io_, nvme::IoService::Create(io, std::move(engine)));
    nvme::SwapStoreOptions so;
    for (const auto* paths : {&zo.offload_optimizer.nvme_path, &zo.offload_param.nvme_path}) {
      const bool used = (paths == &zo.offload_optimizer.nvme_path)
                            ? opt_place() == OffloadDevice::kNvme
                            : param_place() == OffloadDevice::kNvme;
      if (!used) continue;
      for (auto& p : *paths)
        if (std::find(so.paths.begin(), so.paths.end(), p) == so.paths.end()) so.paths.push_back(p);
    }
    for (auto& t : budgets_)
      if (t.tier == "nvme") so.capacity_bytes = static_cast<uint64_t>(t.needed_bytes);
    ASSIGN_OR_RETURN(swap_, nvme::SwapStore::Open(so, io_.get()));
    if (opt_place() == OffloadDevice::kNvme)
      for (size_t g = 0; g < groups_.size(); ++g)
        for (int v = 0; v < 2; ++v)
          RETURN_IF_ERROR(swap_->Allocate(StateShard(g, v),
                                          static_cast<uint64_t>(IoBytes(12 * groups_[g].elems()))));
    if (param_place() == OffloadDevice::kNvme)
      for (size_t m = 0; m < modules_.size(); ++m)
        if (modules_[m].bytes() > 0)
          for (int v = 0; v < 2; ++v)
            RETURN_IF_ERROR(swap_->Allocate(ModuleShard(static_cast<int>(m), v),
                                            static_cast<uint64_t>(IoBytes(modules_[m].bytes()))));
  }
  return Status();
}

Status EngineImpl::InitializeStates() {
  // Master values in a scratch buffer per parameter; then fanned out to
  // wherever states and parameters live.
  auto* next = static_cast<uint8_t*>(next_params_.data());
  std::memset(next, 0, static_cast<size_t>(total_param_bytes_));
  std::vector<float> value;
  auto master_of = [&](const ParamRec& p) -> std::span<const float> {
    if (!p.init.empty()) return p.init;
    value.assign(static_cast<size_t>(p.numel), 0.f);
    p.initializer(value);
    return value;
  };
  std::vector<float> all_master;  // only for nvme optimizer
  if (opt_place() == OffloadDevice::kNvme) all_master.resize(static_cast<size_t>(total_elems_));
  for (auto& p : params_) {
    std::span<const float> v = master_of(p);
    float* dst =
        opt_place() == OffloadDevice::kNvme ? all_master.data() + p.elem_off : master_ + p.elem_off;
    std::memcpy(dst, v.data(), static_cast<size_t>(p.numel) * 4);
    for (int64_t i = 0; i < p.numel; ++i)
      FromFloat(v[static_cast<size_t>(i)], p.dtype, next + p.byte_off, i);
  }
  if (opt_place() != OffloadDevice::kNvme) {
    std::memset(exp_avg_, 0, static_cast<size_t>(total_elems_) * 4);
    std::memset(exp_avg_sq_, 0, static_cast<size_t>(total_elems_) * 4);
  } else {
    std::vector<nvme::IoHandle> handles;
    for (size_t g = 0; g < groups_.size(); ++g) {
      const int64_t e = groups_[g].elems();
      const int64_t bytes = IoBytes(12 * e);
      ASSIGN_OR_RETURN(AlignedBuffer group_state,
                       AlignedBuffer::Allocate(static_cast<size_t>(bytes), kIoAlign));
      std::memset(group_state.data(), 0,
                  static_cast<size_t>(bytes));  // master | exp_avg = 0 | exp_avg_sq = 0
      std::memcpy(group_state.data(), all_master.data() + groups_[g].elem_begin,
                  static_cast<size_t>(e) * 4);
      nvme::IoHandle h =
          swap_->Write(StateShard(g, 0), 0, group_state.data(), static_cast<size_t>(bytes));
      RETURN_IF_ERROR(h.Wait().WithContext("initializing optimizer state on NVMe"));
      nvme_written_bytes_ += bytes;
    }
  }
  // Publish the initial parameters.
  switch (param_place()) {
    case OffloadDevice::kNone:
      RETURN_IF_ERROR(dev_->CopyH2D(device_params_.data(), next,
                                    static_cast<size_t>(total_param_bytes_), dev_->h2d()));
      RETURN_IF_ERROR(dev_->h2d().Record(*params_uploaded_));
      RETURN_IF_ERROR(dev_->h2d().Synchronize());
      h2d_bytes_ += total_param_bytes_;
      if (mirror_params_)
        std::memcpy(host_params_.data(), next, static_cast<size_t>(total_param_bytes_));
      break;
    case OffloadDevice::kCpu:
      std::memcpy(host_params_.data(), next, static_cast<size_t>(total_param_bytes_));
      break;
    case OffloadDevice::kNvme: {
      for (size_t m = 0; m < modules_.size(); ++m) {
        if (modules_[m].bytes() == 0) continue;
        const int64_t bytes = IoBytes(modules_[m].bytes());
        nvme::IoHandle h = swap_->Write(ModuleShard(static_cast<int>(m), 0), 0,
                                        next + modules_[m].byte_begin, static_cast<size_t>(bytes));
        RETURN_IF_ERROR(h.Wait().WithContext("initializing parameters on NVMe"));
        nvme_written_bytes_ += bytes;
      }
      break;
    }
  }
  return Status();
}

// ---------------------------------------------------------------------------
// Fetching parameters
// ---------------------------------------------------------------------------

Status EngineImpl::CheckModule(int module, const char* call) const {
  if (module < 0 || module >= static_cast<int>(modules_.size()) || !modules_[module].registered)
    return InvalidArgumentError(
        fmt::format("{}({}): no parameters are registered for module {}", call, module, module));
  return Status();
}

int64_t EngineImpl::live_elems() const {
  int64_t live = 0;
  for (auto& m : modules_)
    if (!m.persistent && m.residency != Residency::kAbsent) live += m.elems();
  return live;
}

Status EngineImpl::ReclaimDeferred(bool wait_all) {
  for (auto it = deferred_.begin(); it != deferred_.end();) {
    bool done = wait_all;
    if (wait_all) {
      RETURN_IF_ERROR(it->after->Synchronize());
    } else {
      ASSIGN_OR_RETURN(done, it->after->Query());
    }
    if (done) {
      it = deferred_.erase(it);
    } else {
      ++it;
    }
  }
  return Status();
}

void EngineImpl::ReleaseModule(ModuleRec& m) {
  // The device copy may still be read by work on the compute stream.
  auto ev = dev_->CreateEvent();
  if (ev.ok() && dev_->compute().Record(**ev).ok()) {
    deferred_.push_back({std::move(m.buf), std::move(*ev)});
  } else {
    dev_->compute().Synchronize().IgnoreError();
    m.buf.Reset();
  }
  m.residency = Residency::kAbsent;
  m.prefetched = false;
}

Status EngineImpl::MakeRoom(int64_t bytes, int keep_module) {
  // Evict cached (resident, not in use, not persistent) modules, those whose
  // next use is furthest first (here: the ones not in the lookahead).
  RETURN_IF_ERROR(ReclaimDeferred(false));
  if (static_cast<int64_t>(dev_->Stats().largest_free_bytes) >= bytes) return Status();
  std::vector<int> upcoming = trace_ ? trace_->Lookahead(INT64_MAX) : std::vector<int>{};
  auto rank = [&](int m) {
    auto it = std::find(upcoming.begin(), upcoming.end(), m);
    return it == upcoming.end() ? INT32_MAX : static_cast<int>(it - upcoming.begin());
  };
  std::vector<int> candidates;
  for (int i = 0; i < static_cast<int>(modules_.size()); ++i) {
    auto& m = modules_[i];
    if (i != keep_module && !m.persistent && !m.in_use && m.residency == Residency::kResident)
      candidates.push_back(i);
  }
  std::sort(candidates.begin(), candidates.end(), [&](int a, int b) { return rank(a) > rank(b); });
  for (int i : candidates) {
    ReleaseModule(modules_[i]);
    RETURN_IF_ERROR(ReclaimDeferred(true));
    if (static_cast<int64_t>(dev_->Stats().largest_free_bytes) >= bytes) return Status();
  }
  RETURN_IF_ERROR(ReclaimDeferred(true));
  return Status();
}

StatusOr<DeviceBuffer> EngineImpl::AllocDevice(int64_t bytes, int keep_module) {
  StatusOr<DeviceBuffer> b = dev_->Allocate(static_cast<size_t>(bytes));
  if (b.ok() || b.status().code() != StatusCode::kResourceExhausted) return b;
  RETURN_IF_ERROR(MakeRoom(bytes, keep_module));
  return dev_->Allocate(static_cast<size_t>(bytes));
}

namespace {
// Enqueues `work` on `s` bracketed by two host callbacks that time it: the
// busy time goes to `busy_ns` and, if enabled, an event to the timeline.
Status Timed(Stream& s, Timeline* timeline, std::string track, std::string name, const char* cat,
             int64_t bytes, std::atomic<int64_t>* busy_ns, const std::function<Status()>& work) {
  auto t0 = std::make_shared<int64_t>(0);
  RETURN_IF_ERROR(s.EnqueueHostCallback([t0] { *t0 = NowNanos(); }));
  RETURN_IF_ERROR(work());
  return s.EnqueueHostCallback([=] {
    const int64_t t1 = NowNanos();
    busy_ns->fetch_add(t1 - *t0, std::memory_order_relaxed);
    timeline->Add(track, name, cat, *t0, t1 - *t0, bytes);
  });
}
}  // namespace

Status EngineImpl::StartCopy(ModuleRec& m) {
  const int idx = static_cast<int>(&m - modules_.data());
  // While a step runs (not delayed), modules it has finished are copied from
  // its copy-out target: the new values, without a trip through NVMe.
  const void* src = reading_next_params() ? next_params_.as<uint8_t>() + m.byte_begin
                    : param_place() == OffloadDevice::kCpu
                        ? static_cast<const uint8_t*>(host_params_.data()) + m.byte_begin
                        : m.staging.data();
  const int64_t bytes = m.bytes();
  RETURN_IF_ERROR(Timed(
      dev_->h2d(), &timeline_, "pcie h2d", fmt::format("fetch module {}", idx), "pcie", bytes,
      &h2d_busy_ns_,
      [&] { return dev_->CopyH2D(m.buf.data(), src, static_cast<size_t>(bytes), dev_->h2d()); }));
  RETURN_IF_ERROR(dev_->h2d().Record(*m.ready));
  if (m.staging) {
    // The staging buffer goes back to the pool once the copy has read it.
    auto held = std::make_shared<PinnedBuffer>(std::move(m.staging));
    RETURN_IF_ERROR(dev_->h2d().EnqueueHostCallback([held] { held->Reset(); }));
  }
  h2d_bytes_ += bytes;
  m.residency = Residency::kCopying;
  return Status();
}

void EngineImpl::NoteNvme(int64_t start_ns, int64_t end_ns, int64_t bytes, bool write,
                          const std::string& name) {
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    nvme_intervals_.emplace_back(start_ns, end_ns);
  }
  (write ? nvme_written_bytes_ : nvme_read_bytes_) += bytes;
  timeline_.Add(write ? "nvme write" : "nvme read", name, "nvme", start_ns, end_ns - start_ns,
                bytes);
}

Status EngineImpl::Pump() {
  for (size_t i = 0; i < modules_.size(); ++i) {
    ModuleRec& m = modules_[i];
    if (m.residency != Residency::kReading || !m.read.Poll()) continue;
    Status s = m.read.status();
    NoteNvme(m.read_issued_ns, NowNanos(), IoBytes(m.bytes()), false,
             fmt::format("read module {}", i));
    m.read = nvme::IoHandle();
    if (!s.ok()) {
      m.staging.Reset();
      m.buf.Reset();
      m.residency = Residency::kAbsent;
      return s.WithContext(fmt::format("fetching module {} from NVMe", i));
    }
    RETURN_IF_ERROR(StartCopy(m));
  }
  return Status();
}

Status EngineImpl::Fetch(int module, bool prefetch) {
  ModuleRec& m = modules_[module];
  if (!params_offloaded() || m.residency != Residency::kAbsent) return Status();
  if (prefetch) {
    // A prefetch never evicts and never waits: it uses what is free.
    StatusOr<DeviceBuffer> b = dev_->Allocate(static_cast<size_t>(m.bytes()));
    if (!b.ok()) return b.status().code() == StatusCode::kResourceExhausted ? Status() : b.status();
    m.buf = std::move(*b);
  } else {
    ASSIGN_OR_RETURN(m.buf, AllocDevice(m.bytes(), module));
  }
  m.prefetched = prefetch;
  if (param_place() == OffloadDevice::kCpu || reading_next_params()) return StartCopy(m);
  // NVMe → pinned staging → HBM.
  StatusOr<PinnedBuffer> staging = param_pool_->Acquire(static_cast<size_t>(IoBytes(m.bytes())));
  while (!staging.ok() && staging.status().code() == StatusCode::kResourceExhausted) {
    if (prefetch) {
      m.buf.Reset();
      return Status();
    }
    // Wait for the oldest read in flight to land and free its staging buffer.
    bool waited = false;
    for (auto& other : modules_) {
      if (other.residency == Residency::kReading) {
        other.read.Wait().IgnoreError();
        waited = true;
        break;
      }
    }
    RETURN_IF_ERROR(Pump());
    RETURN_IF_ERROR(dev_->h2d().Synchronize());  // staging returns after its H2D
    staging = param_pool_->Acquire(static_cast<size_t>(IoBytes(m.bytes())));
    if (!waited && !staging.ok()) break;
  }
  if (!staging.ok()) {
    m.buf.Reset();
    return staging.status().WithContext(fmt::format("fetching module {}", module));
  }
  m.staging = std::move(*staging);
  m.read_issued_ns = NowNanos();
  m.read = swap_->Read(ModuleShard(module, module_version_[module]), 0, m.staging.data(),
                       static_cast<size_t>(IoBytes(m.bytes())));
  m.residency = Residency::kReading;
  return Status();
}

Status EngineImpl::WaitResident(int module) {
  RETURN_IF_ERROR(AwaitModule(module));
  if (!params_offloaded()) {
    if (params_uploaded_) {
      if (dev_->is_host()) {
        RETURN_IF_ERROR(params_uploaded_->Synchronize());
      } else {
        RETURN_IF_ERROR(dev_->compute().Wait(*params_uploaded_));
      }
    }
    return Status();
  }
  ModuleRec& m = modules_[module];
  if (m.residency == Residency::kAbsent) {
    ++fetch_misses_;
    RETURN_IF_ERROR(Fetch(module, false));
  } else if (m.prefetched) {
    ++prefetch_hits_;
  }
  if (m.residency == Residency::kReading) {
    m.read.Wait().IgnoreError();  // the status is taken by Pump
    RETURN_IF_ERROR(Pump());
  }
  if (m.residency == Residency::kCopying) {
    if (dev_->is_host()) {
      RETURN_IF_ERROR(m.ready->Synchronize());  // the framework computes on this thread
    } else {
      RETURN_IF_ERROR(dev_->compute().Wait(*m.ready));
    }
    m.residency = Residency::kResident;
  }
  return Status();
}

Status EngineImpl::Prefetch() {
  if (!params_offloaded() || !trace_->following()) return Status();
  const auto& zo = cfg_.zero_optimization;
  int64_t live = live_elems();
  for (int next : trace_->Lookahead(zo.stage3_prefetch_bucket_size)) {
    ModuleRec& m = modules_[next];
    if (m.residency != Residency::kAbsent) continue;
    if (reading_next_params() && !ModuleReady(next)) break;  // the step has not reached it
    if (!m.persistent && live + m.elems() > zo.stage3_max_live_parameters) break;
    RETURN_IF_ERROR(Fetch(next, true));
    if (m.residency == Residency::kAbsent) break;  // no room now: stop here
    live += m.persistent ? 0 : m.elems();
  }
  return Status();
}

Status EngineImpl::FinishUse(int module) {
  ModuleRec& m = modules_[module];
  m.in_use = false;
  if (!params_offloaded() || m.persistent) return Status();
  const int64_t reuse = trace_->ReuseDistance();
  if (trace_->following() && reuse <= cfg_.zero_optimization.stage3_max_reuse_distance)
    return Status();
  ReleaseModule(m);
  return Status();
}

ModuleView EngineImpl::ViewOf(int module, bool with_grads) {
  ModuleRec& m = modules_[module];
  ModuleView v;
  auto* base =
      params_offloaded() ? m.buf.as<uint8_t>() : device_params_.as<uint8_t>() + m.byte_begin;
  for (int id : m.params) {
    v.params.push_back(base + (params_[id].byte_off - m.byte_begin));
    if (with_grads) v.grads.push_back(m.grad.as<uint8_t>() + (params_[id].byte_off - m.byte_begin));
  }
  return v;
}

void EngineImpl::NoteHookEntry() {
  const int64_t now = NowNanos();
  if (last_hook_exit_ns_ >= 0) compute_ns_ += now - last_hook_exit_ns_;
}

void EngineImpl::NoteHookExit() { last_hook_exit_ns_ = NowNanos(); }

// The part of BeforeForward/BeforeBackward that makes a module usable: record
// the fetch in the trace, wait until its parameters are on the device, mark it
// in use. Prefetching follows in the caller, after any allocation of its own.
Status EngineImpl::Acquire(int module) {
  trace_->Observe(module);
  const int64_t t0 = NowNanos(), waited0 = optimizer_wait_ns_;
  RETURN_IF_ERROR(WaitResident(module));
  fetch_wait_ns_ += (NowNanos() - t0) - (optimizer_wait_ns_ - waited0);
  modules_[module].in_use = true;
  return Status();
}

StatusOr<ModuleView> EngineImpl::BeforeForward(int module) {
  NoteHookEntry();
  RETURN_IF_ERROR(Plan());
  RETURN_IF_ERROR(CheckModule(module, "BeforeForward"));
  RETURN_IF_ERROR(PollStep());
  RETURN_IF_ERROR(Pump());
  RETURN_IF_ERROR(Acquire(module));
  RETURN_IF_ERROR(Prefetch());
  ModuleView v = ViewOf(module, false);
  NoteHookExit();
  return v;
}

Status EngineImpl::AfterForward(int module) {
  NoteHookEntry();
  RETURN_IF_ERROR(CheckModule(module, "AfterForward"));
  if (!planned_) return FailedPreconditionError("AfterForward before any BeforeForward");
  RETURN_IF_ERROR(PollStep());
  RETURN_IF_ERROR(FinishUse(module));
  RETURN_IF_ERROR(Pump());
  NoteHookExit();
  return Status();
}

StatusOr<ModuleView> EngineImpl::BeforeBackward(int module) {
  NoteHookEntry();
  RETURN_IF_ERROR(Plan());
  RETURN_IF_ERROR(CheckModule(module, "BeforeBackward"));
  RETURN_IF_ERROR(PollStep());
  RETURN_IF_ERROR(Pump());
  ModuleRec& m = modules_[module];
  if (m.grad)
    return FailedPreconditionError(
        fmt::format("BeforeBackward({}): the module's previous gradients were not handed over with "
                    "AfterBackward",
                    module));
  RETURN_IF_ERROR(Acquire(module));
  if (opt_place() == OffloadDevice::kNvme && pre_reads_.empty() && !inflight_ &&
      micro_batches_ + 1 >= std::max<int64_t>(1, cfg_.gradient_accumulation_steps))
    PrefetchStates();  // the window's last backward pass: the step follows it
  ASSIGN_OR_RETURN(m.grad, AllocDevice(m.bytes(), module));
  RETURN_IF_ERROR(Prefetch());
  ModuleView v = ViewOf(module, true);
  NoteHookExit();
  return v;
}

Status EngineImpl::AfterBackward(int module) {
  NoteHookEntry();
  RETURN_IF_ERROR(CheckModule(module, "AfterBackward"));
  ModuleRec& m = modules_[module];
  if (!m.grad)
    return FailedPreconditionError(fmt::format("AfterBackward({}) without BeforeBackward", module));
  grads_since_launch_ = true;
  // The gradients are complete once the framework's work on the compute
  // stream is; the D2H stream waits for that, then copies them out in chunks.
  RETURN_IF_ERROR(dev_->compute().Record(*m.computed));
  RETURN_IF_ERROR(dev_->d2h().Wait(*m.computed));
  for (int64_t b = m.byte_begin; b < m.byte_end; b += grad_staging_bytes_) {
    const int64_t e = std::min(m.byte_end, b + grad_staging_bytes_);
    StatusOr<PinnedBuffer> staging = grad_pool_->Acquire(static_cast<size_t>(e - b));
    while (!staging.ok() && staging.status().code() == StatusCode::kResourceExhausted) {
      // Every buffer is held by a chunk not yet accumulated: wait for the
      // worker to finish one, then try again. With no chunk pending, the
      // buffers were all returned since the failed Acquire: one more try.
      bool none_pending = false;
      {
        std::unique_lock<std::mutex> lock(grad_mu_);
        none_pending = grad_pending_ == 0;
        const int64_t before = grad_pending_;
        if (!none_pending)
          grad_cv_.wait(lock, [&] { return grad_pending_ < before || !grad_error_.ok(); });
      }
      staging = grad_pool_->Acquire(static_cast<size_t>(e - b));
      if (none_pending) break;
    }
    if (!staging.ok()) return staging.status().WithContext("staging gradients");
    GradJob job;
    job.module = module;
    job.byte_begin = b;
    job.byte_end = e;
    job.staging = std::move(*staging);
    ASSIGN_OR_RETURN(job.done, dev_->CreateEvent());
    void* dst = job.staging.data();
    const void* src = m.grad.as<uint8_t>() + (b - m.byte_begin);
    RETURN_IF_ERROR(
        Timed(dev_->d2h(), &timeline_, "pcie d2h", fmt::format("grads module {}", module), "pcie",
              e - b, &d2h_busy_ns_,
              [&] { return dev_->CopyD2H(dst, src, static_cast<size_t>(e - b), dev_->d2h()); }));
    RETURN_IF_ERROR(dev_->d2h().Record(*job.done));
    d2h_bytes_ += e - b;
    {
      std::lock_guard<std::mutex> lock(grad_mu_);
      grad_queue_.push_back(std::move(job));
      ++grad_pending_;
    }
    grad_cv_.notify_all();
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Event> copied, dev_->CreateEvent());
  RETURN_IF_ERROR(dev_->d2h().Record(*copied));
  deferred_.push_back({std::move(m.grad), std::move(copied)});
  RETURN_IF_ERROR(FinishUse(module));
  RETURN_IF_ERROR(ReclaimDeferred(false));
  RETURN_IF_ERROR(Pump());
  NoteHookExit();
  return Status();
}

// ---------------------------------------------------------------------------
// Gradients: D2H'd chunks are accumulated in fp32 on a worker thread
// ---------------------------------------------------------------------------

void EngineImpl::Accumulate(const GradJob& job) {
  const ModuleRec& m = modules_[job.module];
  float* acc = grad_acc_.as<float>();
  const uint8_t* staging = static_cast<const uint8_t*>(job.staging.data());
  for (int id : m.params) {
    const ParamRec& p = params_[id];
    const int64_t esize = static_cast<int64_t>(DTypeSize(p.dtype));
    const int64_t pb = p.byte_off, pe = p.byte_off + p.numel * esize;
    const int64_t b = std::max(pb, job.byte_begin), e = std::min(pe, job.byte_end);
    if (b >= e) continue;
    const void* src = staging + (b - job.byte_begin);
    float* dst = acc + p.elem_off + (b - pb) / esize;
    const int64_t count = (e - b) / esize;
    switch (p.dtype) {
      case DType::kFp32: {
        const float* s = static_cast<const float*>(src);
        for (int64_t i = 0; i < count; ++i) dst[i] += s[i];
        break;
      }
      case DType::kFp16: {
        const uint16_t* s = static_cast<const uint16_t*>(src);
        for (int64_t i = 0; i < count; ++i) dst[i] += HalfBitsToFloat(s[i]);
        break;
      }
      case DType::kBf16: {
        const uint16_t* s = static_cast<const uint16_t*>(src);
        for (int64_t i = 0; i < count; ++i) dst[i] += Bf16BitsToFloat(s[i]);
        break;
      }
    }
  }
}

void EngineImpl::GradWorker() {
  for (;;) {
    GradJob job;
    {
      std::unique_lock<std::mutex> lock(grad_mu_);
      grad_cv_.wait(lock, [&] { return grad_stop_ || !grad_queue_.empty(); });
      if (grad_queue_.empty()) return;  // stopping and drained
      job = std::move(grad_queue_.front());
      grad_queue_.pop_front();
    }
    Status s = job.done->Synchronize();
    const int64_t t0 = NowNanos();
    if (s.ok()) Accumulate(job);
    const int64_t t1 = NowNanos();
    grad_busy_ns_ += t1 - t0;
    timeline_.Add("grad accumulate", fmt::format("module {}", job.module), "cpu", t0, t1 - t0,
                  job.byte_end - job.byte_begin);
    job.staging.Reset();
    {
      std::lock_guard<std::mutex> lock(grad_mu_);
      if (!s.ok() && grad_error_.ok()) grad_error_ = s.WithContext("gradient copy");
      --grad_pending_;
    }
    grad_cv_.notify_all();
  }
}

Status EngineImpl::DrainGrads() {
  std::unique_lock<std::mutex> lock(grad_mu_);
  grad_cv_.wait(lock, [&] { return grad_pending_ == 0; });
  Status s = grad_error_;
  grad_error_ = Status();
  return s;
}

Status EngineImpl::ZeroGrad() {
  if (!planned_) return Status();
  RETURN_IF_ERROR(PollStep());
  if (reading_next_params()) {
    // The step in flight zeroes the accumulator as it consumes it: with no
    // gradients added since, there is nothing to do (and no reason to wait).
    if (!grads_since_launch_) {
      micro_batches_ = 0;
      return DrainGrads();
    }
    RETURN_IF_ERROR(FinishStep());
  }
  // With DPU in flight, the step owns the other accumulator; this one is ours.
  RETURN_IF_ERROR(DrainGrads());
  grads_since_launch_ = false;
  float* acc = grad_acc_.as<float>();
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, total_elems_, kNormBlock), [&](const auto& r) {
    std::memset(acc + r.begin(), 0, static_cast<size_t>(r.end() - r.begin()) * 4);
  });
  micro_batches_ = 0;
  return Status();
}

void EngineImpl::GlobalChecks(bool* overflow, double* sumsq) {
  const float* acc = grad_acc_.as<float>();
  const int64_t blocks = (total_elems_ + kNormBlock - 1) / kNormBlock;
  std::vector<double> partial(static_cast<size_t>(blocks), 0.0);
  std::vector<uint8_t> bad(static_cast<size_t>(blocks), 0);
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, blocks), [&](const auto& r) {
    for (int64_t blk = r.begin(); blk < r.end(); ++blk) {
      const int64_t b = blk * kNormBlock, e = std::min(total_elems_, b + kNormBlock);
      double s = 0;
      bool nonfinite = false;
      for (int64_t i = b; i < e; ++i) {
        const double x = acc[i];
        nonfinite |= !std::isfinite(acc[i]);
        s += x * x;
      }
      partial[static_cast<size_t>(blk)] = s;
      bad[static_cast<size_t>(blk)] = nonfinite;
    }
  });
  double total = 0;
  bool any_bad = false;
  for (int64_t blk = 0; blk < blocks; ++blk) {  // fixed order: deterministic
    total += partial[static_cast<size_t>(blk)];
    any_bad |= bad[static_cast<size_t>(blk)] != 0;
  }
  *overflow = any_bad;
  *sumsq = total;
}

// ---------------------------------------------------------------------------
// The optimizer step
// ---------------------------------------------------------------------------

cpu_adam::HyperParams EngineImpl::HyperParamsFor(float grad_scale) const {
  const auto& o = cfg_.optimizer;
  cpu_adam::HyperParams hp;
  hp.algorithm = o.adam_w_mode ? cpu_adam::Algorithm::kAdamW : cpu_adam::Algorithm::kAdam;
  hp.lr = static_cast<float>(o.lr);
  hp.beta1 = static_cast<float>(o.beta1);
  hp.beta2 = static_cast<float>(o.beta2);
  hp.eps = static_cast<float>(o.eps);
  hp.weight_decay = static_cast<float>(o.weight_decay);
  hp.bias_correction = o.bias_correction;
  hp.step = optimizer_steps_ + 1;
  hp.grad_scale = grad_scale;
  return hp;
}

namespace {
// The parameter containing flat element e (params sorted by elem_off).
size_t ParamAt(const std::vector<int>& order, const std::vector<ParamRec>& params, int64_t e) {
  size_t lo = 0, hi = order.size();
  while (hi - lo > 1) {
    const size_t mid = (lo + hi) / 2;
    if (params[order[mid]].elem_off <= e)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}
}  // namespace

Status EngineImpl::WriteParamShards(int64_t eb, int64_t ee,
                                    std::vector<std::pair<int, nvme::IoHandle>>& out) {
  // A module is written whole (page-aligned, see kIoAlign) once the sub-group
  // holding its last element has been stepped: sub-groups run in order, so
  // all of its elements have been copied out by then.
  const uint8_t* next = static_cast<const uint8_t*>(next_params_.data());
  for (size_t mi = 0; mi < modules_.size(); ++mi) {
    const ModuleRec& m = modules_[mi];
    if (m.elems() == 0 || m.elem_end <= eb || m.elem_end > ee) continue;
    const int64_t bytes = IoBytes(m.bytes());
    out.emplace_back(static_cast<int>(mi),
                     swap_->Write(ModuleShard(static_cast<int>(mi), 1 - module_version_[mi]), 0,
                                  next + m.byte_begin, static_cast<size_t>(bytes)));
    nvme_written_bytes_ += bytes;
  }
  return Status();
}

namespace {
// One ShardStep per parameter slice of [eb, ee), with states at
// master/m/v + (slice - base).
std::vector<cpu_adam::ShardStep> Slices(const std::vector<ParamRec>& params,
                                        const std::vector<int>& order, int64_t eb, int64_t ee,
                                        int64_t base, float* master, float* m, float* v,
                                        const float* grad_acc, uint8_t* next,
                                        const cpu_adam::HyperParams& hp) {
  std::vector<cpu_adam::ShardStep> out;
  for (size_t i = ParamAt(order, params, eb); i < order.size(); ++i) {
    const ParamRec& p = params[order[i]];
    if (p.elem_off >= ee) break;
    const int64_t b = std::max(eb, p.elem_off), e = std::min(ee, p.elem_off + p.numel);
    if (b >= e) continue;
    cpu_adam::ShardStep s;
    s.param = master + (b - base);
    s.grad = grad_acc + b;
    s.grad_dtype = DType::kFp32;
    s.exp_avg = m + (b - base);
    s.exp_avg_sq = v + (b - base);
    s.count = static_cast<size_t>(e - b);
    s.copy_out = next + p.byte_off + (b - p.elem_off) * static_cast<int64_t>(DTypeSize(p.dtype));
    s.copy_dtype = p.dtype;
    s.hp = hp;
    out.push_back(s);
  }
  return out;
}

std::vector<int> ElemOrder(const std::vector<ParamRec>& params) {
  std::vector<int> order(params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return params[a].elem_off < params[b].elem_off; });
  return order;
}
}  // namespace

void EngineImpl::GroupDone(AsyncStep* job, size_t g) {
  const SubGroup& sg = groups_[g];
  std::memset(job->grads_mut + sg.elem_begin, 0, static_cast<size_t>(sg.elems()) * 4);
  {
    std::lock_guard<std::mutex> lock(job->mu);
    job->groups_done.store(g + 1, std::memory_order_release);
  }
  job->cv.notify_all();
}

Status EngineImpl::StepCpuStates(AsyncStep* job) {
  const std::vector<int> order = ElemOrder(params_);
  std::vector<std::pair<int, nvme::IoHandle>> writes;
  std::vector<int64_t> write_issue;
  Status step_error;
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (hooks_.before_sub_group) hooks_.before_sub_group(g);
    const SubGroup& sg = groups_[g];
    auto shards = Slices(params_, order, sg.elem_begin, sg.elem_end, 0, master_, exp_avg_,
                         exp_avg_sq_, job->grads, next_params_.as<uint8_t>(), job->hp);
    const int64_t t0 = NowNanos();
    StatusOr<cpu_adam::StepResult> r = adam_->StepMany(shards);
    const int64_t t1 = NowNanos();
    optimizer_ns_ += t1 - t0;
    timeline_.Add("cpu adam", fmt::format("sub-group {}", g), "optimizer", t0, t1 - t0, 0);
    if (!r.ok()) {
      step_error = r.status().WithContext(fmt::format("optimizer, sub-group {}", g));
      break;
    }
    job->advanced = true;
    if (param_place() == OffloadDevice::kNvme) {
      const size_t before = writes.size();
      step_error = WriteParamShards(sg.elem_begin, sg.elem_end, writes);
      for (size_t i = before; i < writes.size(); ++i) write_issue.push_back(t1);
      if (!step_error.ok()) break;
    }
    GroupDone(job, g);
  }
  // Every write issued lands before this thread ends (io_uring may cancel
  // requests of a thread that has exited).
  Status first_error;
  for (size_t i = 0; i < writes.size(); ++i) {
    Status s = writes[i].second.Wait();
    NoteNvme(write_issue[i], NowNanos(), static_cast<int64_t>(writes[i].second.bytes()), true,
             "write params");
    if (s.ok()) {
      job->param_written.push_back(writes[i].first);
      continue;
    }
    job->param_write_failed.push_back(writes[i].first);
    if (first_error.ok()) first_error = s;
  }
  if (!step_error.ok()) return step_error;
  if (!first_error.ok()) {
    return DataLossError(fmt::format(
        "step {}: the optimizer states and fp32 master parameters were updated, but writing the "
        "updated parameters of {} module(s) to NVMe failed ({}); those modules' parameters on "
        "NVMe stay those of step {} until the next successful step rewrites them",
        job->step, job->param_write_failed.size(), first_error.ToString(), job->step - 1));
  }
  return Status();
}

Status EngineImpl::StepNvmeStates(AsyncStep* job) {
  const std::vector<int> order = ElemOrder(params_);
  const size_t G = groups_.size();
  const int64_t want = std::max<int64_t>(1, cfg_.zero_optimization.offload_optimizer.buffer_count);
  // The sub-groups read ahead during backward (PrefetchStates) come first.
  std::vector<PinnedBuffer> buffers = std::move(job->pre_buffers);
  for (int64_t i = static_cast<int64_t>(buffers.size()); i < want && i < static_cast<int64_t>(G);
       ++i) {
    StatusOr<PinnedBuffer> b = opt_pool_->Acquire(static_cast<size_t>(12 * max_group_elems_));
    if (!b.ok()) {
      if (buffers.empty()) return b.status().WithContext("optimizer pipeline buffers");
      break;
    }
    buffers.push_back(std::move(*b));
  }
  const size_t B = buffers.size();
  std::vector<nvme::IoHandle> reads(G), writes(G);
  std::vector<std::pair<int, nvme::IoHandle>> param_writes;
  std::vector<int64_t> read_issue(G, 0), write_issue(G, 0);
  std::vector<bool> write_noted(G, false);
  for (size_t g = 0; g < job->pre_reads.size(); ++g) {
    reads[g] = std::move(job->pre_reads[g]);
    read_issue[g] = job->pre_issue_ns[g];
  }
  Status error;

  auto note_write = [&](size_t g) {
    Status s = writes[g].Wait();
    NoteNvme(write_issue[g], NowNanos(), IoBytes(12 * groups_[g].elems()), true,
             fmt::format("write state {}", g));
    write_noted[g] = true;
    if (!s.ok() && error.ok())
      error = s.WithContext(fmt::format("writing optimizer state of sub-group {}", g));
  };
  auto note_writes = [&](bool wait) {
    for (size_t g = 0; g < G; ++g) {
      if (!writes[g].valid() || write_noted[g]) continue;
      if (!wait && !writes[g].Poll()) continue;
      note_write(g);
    }
  };
  auto issue_read = [&](size_t g) {
    // The buffer may still be being written out for sub-group g - B.
    if (g >= B && writes[g - B].valid() && !write_noted[g - B]) note_write(g - B);
    read_issue[g] = NowNanos();
    reads[g] = swap_->Read(StateShard(g, state_version_[g]), 0, buffers[g % B].data(),
                           static_cast<size_t>(IoBytes(12 * groups_[g].elems())));
  };
  // Read ahead into buffers that hold neither the sub-group being stepped nor
  // the one being written behind it (with one buffer: no read-ahead at all).
  const size_t lookahead = StateLookahead(B);
  for (size_t g = 0; g < G && error.ok(); ++g) {
    if (!reads[g].valid()) issue_read(g);
    for (size_t j = g + 1; j < G && j <= g + lookahead; ++j)
      if (!reads[j].valid() && (j < B || write_noted[j - B] || !writes[j - B].valid() || j - B < g))
        issue_read(j);
    if (hooks_.before_sub_group) hooks_.before_sub_group(g);
    Status rs = reads[g].Wait();
    NoteNvme(read_issue[g], NowNanos(), IoBytes(12 * groups_[g].elems()), false,
             fmt::format("read state {}", g));
    if (!rs.ok()) {
      error = rs.WithContext(fmt::format("reading optimizer state of sub-group {}", g));
      break;
    }
    if (!error.ok()) break;
    const SubGroup& sg = groups_[g];
    float* buf = buffers[g % B].as<float>();
    const int64_t e = sg.elems();
    auto shards = Slices(params_, order, sg.elem_begin, sg.elem_end, sg.elem_begin, buf, buf + e,
                         buf + 2 * e, job->grads, next_params_.as<uint8_t>(), job->hp);
    const int64_t t0 = NowNanos();
    StatusOr<cpu_adam::StepResult> r = adam_->StepMany(shards);
    const int64_t t1 = NowNanos();
    optimizer_ns_ += t1 - t0;
    timeline_.Add("cpu adam", fmt::format("sub-group {}", g), "optimizer", t0, t1 - t0, 0);
    if (!r.ok()) {
      error = r.status().WithContext(fmt::format("optimizer, sub-group {}", g));
      break;
    }
    write_issue[g] = t1;
    writes[g] = swap_->Write(StateShard(g, 1 - state_version_[g]), 0, buf,
                             static_cast<size_t>(IoBytes(12 * e)));
    if (param_place() == OffloadDevice::kNvme) {
      Status ws = WriteParamShards(sg.elem_begin, sg.elem_end, param_writes);
      if (!ws.ok()) error = ws;
    }
    GroupDone(job, g);
    note_writes(false);
  }
  // Everything in flight lands before the buffers go back to the pool.
  for (size_t g = 0; g < G; ++g)
    if (reads[g].valid()) reads[g].Wait().IgnoreError();
  note_writes(true);
  const int64_t pw0 = NowNanos();
  for (auto& [module, h] : param_writes) {
    Status s = h.Wait();
    if (s.ok()) job->param_written.push_back(module);
    if (!s.ok() && error.ok())
      error = s.WithContext(fmt::format("writing the updated parameters of module {} to NVMe",
                                        module));
  }
  if (!param_writes.empty()) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    nvme_intervals_.emplace_back(pw0, NowNanos());
  }
  if (!error.ok()) {
    return error.WithContext(
        fmt::format("step {} failed; the previous parameters and optimizer states are intact (the "
                    "new versions were not committed)",
                    job->step));
  }
  for (auto& v : state_version_) v = 1 - v;  // commit (only the optimizer reads these)
  return Status();
}

void EngineImpl::PrefetchStates() {
  // Exactly the reads the pipeline would issue first (sub-groups 0 ..
  // lookahead, into buffers 0 ..), so that it continues as if it had.
  const size_t want = static_cast<size_t>(
      std::max<int64_t>(1, cfg_.zero_optimization.offload_optimizer.buffer_count));
  const size_t n = std::min(groups_.size(), StateLookahead(std::min(want, groups_.size())) + 1);
  for (size_t g = 0; g < n; ++g) {
    StatusOr<PinnedBuffer> b = opt_pool_->Acquire(static_cast<size_t>(12 * max_group_elems_));
    if (!b.ok()) break;  // the pipeline acquires what it can itself
    pre_buffers_.push_back(std::move(*b));
    pre_issue_ns_.push_back(NowNanos());
    pre_reads_.push_back(swap_->Read(StateShard(g, state_version_[g]), 0,
                                     pre_buffers_.back().data(),
                                     static_cast<size_t>(IoBytes(12 * groups_[g].elems()))));
  }
}

void EngineImpl::RunStep(AsyncStep* job) {
  Status s = opt_place() == OffloadDevice::kNvme ? StepNvmeStates(job) : StepCpuStates(job);
  {
    std::lock_guard<std::mutex> lock(job->mu);
    job->finished = true;
    job->status = s;
  }
  job->cv.notify_all();
}

void EngineImpl::LaunchStep(float grad_scale, bool delayed, bool background) {
  auto job = std::make_unique<AsyncStep>();
  job->delayed = delayed;
  job->background = background;
  job->hp = HyperParamsFor(grad_scale);
  job->step = optimizer_steps_ + 1;
  job->scaler_before = scaler_;
  job->launched_ns = NowNanos();
  job->uploaded.assign(modules_.size(), 0);
  job->pre_buffers = std::move(pre_buffers_);
  job->pre_reads = std::move(pre_reads_);
  job->pre_issue_ns = std::move(pre_issue_ns_);
  pre_buffers_.clear();
  pre_reads_.clear();
  pre_issue_ns_.clear();
  if (delayed) grad_acc_.swap(grad_alt_);  // the next window accumulates into the other one
  job->grads_mut = delayed ? grad_alt_.as<float>() : grad_acc_.as<float>();
  job->grads = job->grads_mut;
  ++optimizer_steps_;
  scaler_.Update(false);
  grads_since_launch_ = false;
  inflight_ = std::move(job);
  AsyncStep* j = inflight_.get();
  if (background) {
    j->thread = std::thread([this, j] { RunStep(j); });
  } else {
    RunStep(j);
  }
}

bool EngineImpl::ModuleReady(int module) const {
  const int g = modules_[module].last_group;
  return g < 0 || inflight_->groups_done.load(std::memory_order_acquire) > static_cast<size_t>(g);
}

Status EngineImpl::PollStep() {
  if (!inflight_) return Status();
  bool finished = false, ok = true;
  {
    std::lock_guard<std::mutex> lock(inflight_->mu);
    finished = inflight_->finished;
    ok = inflight_->status.ok();
  }
  if (!finished || (inflight_->delayed && ok)) return Status();  // DPU: committed by Step()
  return FinishStep();
}

Status EngineImpl::AwaitModule(int module) {
  RETURN_IF_ERROR(PollStep());
  if (!reading_next_params()) return Status();
  AsyncStep& job = *inflight_;
  if (!ModuleReady(module)) {
    const int64_t t0 = NowNanos();
    {
      std::unique_lock<std::mutex> lock(job.mu);
      job.cv.wait(lock, [&] { return job.finished || ModuleReady(module); });
    }
    optimizer_wait_ns_ += NowNanos() - t0;
    // Finished without reaching the module: the step failed (rolled back).
    if (!ModuleReady(module)) return FinishStep();
  }
  if (param_place() != OffloadDevice::kNone || job.uploaded[module]) return Status();
  // offload_param none: the module's new parameters go into its part of the
  // device block now, ahead of the rest of the step.
  ModuleRec& m = modules_[module];
  if (m.bytes() > 0) {
    RETURN_IF_ERROR(Timed(dev_->h2d(), &timeline_, "pcie h2d",
                          fmt::format("updated module {}", module), "pcie", m.bytes(),
                          &h2d_busy_ns_, [&] {
                            return dev_->CopyH2D(device_params_.as<uint8_t>() + m.byte_begin,
                                                 next_params_.as<uint8_t>() + m.byte_begin,
                                                 static_cast<size_t>(m.bytes()), dev_->h2d());
                          }));
    RETURN_IF_ERROR(dev_->h2d().Record(*m.ready));
    h2d_bytes_ += m.bytes();
    if (dev_->is_host()) {
      RETURN_IF_ERROR(m.ready->Synchronize());
    } else {
      RETURN_IF_ERROR(dev_->compute().Wait(*m.ready));
    }
  }
  job.uploaded[module] = 1;
  return Status();
}

Status EngineImpl::FinishStep() {
  if (!inflight_) return Status();
  std::unique_ptr<AsyncStep> job = std::move(inflight_);
  if (job->thread.joinable()) job->thread.join();
  const Status s = job->status;
  if (s.ok() || job->advanced) {
    Status cs = CommitStep(*job);
    if (!s.ok()) ClearGradients();
    return s.ok() ? cs : s;
  }
  RollbackStep(*job);
  return s.WithContext(
      fmt::format("optimizer step {} (launched by Step(){}); parameters and optimizer states are "
                  "those of step {}, the window's gradients are discarded and a micro-batch in "
                  "progress must be restarted",
                  job->step, job->background ? ", run in the background" : "", job->step - 1));
}

Status EngineImpl::InvalidateDeviceCopies() {
  RETURN_IF_ERROR(dev_->Synchronize());
  for (auto& m : modules_) {
    if (m.residency == Residency::kReading) m.read.Wait().IgnoreError();
    m.read = nvme::IoHandle();
    m.staging.Reset();
    m.buf.Reset();
    m.residency = Residency::kAbsent;
    m.prefetched = false;
    m.in_use = false;
  }
  return Status();
}

Status EngineImpl::CommitStep(AsyncStep& job) {
  // DPU: the device copies were used during the step; they go now.
  if (job.delayed) RETURN_IF_ERROR(InvalidateDeviceCopies());
  switch (param_place()) {
    case OffloadDevice::kNone: {
      bool any = false, all = true;
      for (size_t i = 0; i < modules_.size(); ++i) {
        any |= job.uploaded[i] != 0;
        all &= job.uploaded[i] != 0 || modules_[i].bytes() == 0;
      }
      auto upload = [&](int64_t b, int64_t bytes, const std::string& what) {
        return Timed(dev_->h2d(), &timeline_, "pcie h2d", what, "pcie", bytes, &h2d_busy_ns_, [&] {
          return dev_->CopyH2D(device_params_.as<uint8_t>() + b, next_params_.as<uint8_t>() + b,
                               static_cast<size_t>(bytes), dev_->h2d());
        });
      };
      if (!any) {
        RETURN_IF_ERROR(upload(0, total_param_bytes_, "updated parameters"));
        h2d_bytes_ += total_param_bytes_;
      } else if (!all) {
        for (size_t i = 0; i < modules_.size(); ++i) {
          const ModuleRec& m = modules_[i];
          if (job.uploaded[i] || m.bytes() == 0) continue;
          RETURN_IF_ERROR(upload(m.byte_begin, m.bytes(), fmt::format("updated module {}", i)));
          h2d_bytes_ += m.bytes();
        }
      }
      // The next step's copy-out must not overwrite what these copies read:
      // Step() waits for this event before launching it.
      RETURN_IF_ERROR(dev_->h2d().Record(*params_uploaded_));
      if (mirror_params_) host_params_.swap(next_params_);
      break;
    }
    case OffloadDevice::kCpu:
      host_params_.swap(next_params_);
      break;
    case OffloadDevice::kNvme:
      // Only modules whose new version was written flip; one whose write
      // failed (or was never issued) keeps its previous, consistent version.
      for (int m : job.param_written) module_version_[m] = 1 - module_version_[m];
      break;
  }
  return Status();
}

void EngineImpl::RollbackStep(AsyncStep& job) {
  optimizer_steps_ = job.step - 1;
  scaler_ = job.scaler_before;
  if (!job.delayed) {
    // Device copies may hold the new parameters of modules the step reached.
    InvalidateDeviceCopies().IgnoreError();
    bool any = false;
    for (uint8_t u : job.uploaded) any |= u != 0;
    if (any && mirror_params_) {
      Status s = dev_->CopyH2D(device_params_.data(), host_params_.data(),
                               static_cast<size_t>(total_param_bytes_), dev_->h2d());
      if (s.ok()) s = dev_->h2d().Record(*params_uploaded_);
      if (s.ok()) s = dev_->h2d().Synchronize();
      if (!s.ok())
        STRATA_LOG_ERROR("rolling back step {}: restoring the device parameters failed: {}",
                         job.step, s.ToString());
      h2d_bytes_ += total_param_bytes_;
    }
  }
  ClearGradients();
}

void EngineImpl::ClearGradients() {
  DrainGrads().IgnoreError();
  for (HostArray* a : {&grad_acc_, &grad_alt_}) {
    if (a->data() == nullptr) continue;
    float* acc = a->as<float>();
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, total_elems_, kNormBlock),
                      [&](const auto& r) {
                        std::memset(acc + r.begin(), 0,
                                    static_cast<size_t>(r.end() - r.begin()) * 4);
                      });
  }
  micro_batches_ = 0;
  grads_since_launch_ = false;
}

Status EngineImpl::Synchronize() {
  if (!planned_) return Status();
  return FinishStep();
}

StatusOr<StepStats> EngineImpl::Step() {
  NoteHookEntry();
  RETURN_IF_ERROR(Plan());
  for (auto& m : modules_)
    if (m.grad)
      return FailedPreconditionError(
          "Step: a module's gradients were not handed over with AfterBackward");
  StepStats st;
  ++micro_batches_;
  const int64_t gas = std::max<int64_t>(1, cfg_.gradient_accumulation_steps);
  Status status;
  if (micro_batches_ >= gas) {
    const int64_t opt0 = NowNanos();
    status = DrainGrads();
    // The step in flight ends here: this one reads its states (and with DPU
    // its parameters become the current ones now).
    Status fs = FinishStep();
    if (status.ok()) status = fs;
    bool overflow = false;
    double sumsq = 0;
    if (status.ok()) GlobalChecks(&overflow, &sumsq);
    const double scale = scaler_.scale();
    st.overflow = overflow;
    if (status.ok() && overflow) {
      scaler_.Update(true);
      STRATA_LOG_INFO("step {}: inf/nan in the gradients, step skipped; loss scale now {}",
                      optimizer_steps_ + 1, scaler_.scale());
      ClearGradients();
    } else if (status.ok()) {
      const double norm = std::sqrt(sumsq) / scale;
      double clip_coef = 1.0;
      if (cfg_.gradient_clipping > 0) {
        const double c = cfg_.gradient_clipping / (norm + 1e-6);
        if (c < 1.0) clip_coef = c;
      }
      st.grad_norm = norm;
      st.clip_coef = clip_coef;
      const float grad_scale = static_cast<float>(clip_coef / scale);
      // The copy-out target must not still be read by the previous publish.
      if (params_uploaded_) status = params_uploaded_->Synchronize();
      const bool delayed = cfg_.strata.delayed_param_update &&
                           optimizer_steps_ >= cfg_.strata.delayed_param_update_warmup;
      const bool background = delayed || cfg_.strata.overlap_optimizer;
      // Device copies of parameters are stale once the step runs (with DPU:
      // once it is committed, by the next Step()).
      if (status.ok() && !delayed) status = InvalidateDeviceCopies();
      if (status.ok()) {
        const int64_t before = optimizer_steps_;
        LaunchStep(grad_scale, delayed, background);
        if (!background) status = FinishStep();
        st.applied = optimizer_steps_ > before;
      }
    }
    if (!status.ok()) ClearGradients();  // the window is over, applied or not
    st.optimizer_wall_s = static_cast<double>(NowNanos() - opt0) * 1e-9;
    micro_batches_ = 0;
  }
  // Statistics of the window since the previous Step().
  const int64_t now = NowNanos();
  trace_->EndStep();
  st.step = optimizer_steps_;
  st.loss_scale = scaler_.scale();
  st.step_time_s = static_cast<double>(now - window_start_ns_) * 1e-9;
  st.fetch_wait_s = static_cast<double>(fetch_wait_ns_) * 1e-9;
  st.optimizer_wait_s = static_cast<double>(optimizer_wait_ns_) * 1e-9;
  st.compute_s = static_cast<double>(compute_ns_) * 1e-9;
  st.grad_offload_s =
      static_cast<double>(grad_busy_ns_.exchange(0) + d2h_busy_ns_.exchange(0)) * 1e-9;
  st.optimizer_s = static_cast<double>(optimizer_ns_.exchange(0)) * 1e-9;
  // NVMe busy: the union of the intervals with requests in flight (those of
  // a step still running count in the window they end in).
  std::vector<std::pair<int64_t, int64_t>> intervals;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    intervals.swap(nvme_intervals_);
  }
  std::sort(intervals.begin(), intervals.end());
  int64_t busy = 0, cur_b = -1, cur_e = -1;
  for (auto [b, e] : intervals) {
    if (b > cur_e) {
      if (cur_e > cur_b) busy += cur_e - cur_b;
      cur_b = b;
      cur_e = e;
    } else {
      cur_e = std::max(cur_e, e);
    }
  }
  if (cur_e > cur_b) busy += cur_e - cur_b;
  st.nvme_busy_s = static_cast<double>(busy) * 1e-9;
  st.pcie_busy_s = static_cast<double>(h2d_busy_ns_.exchange(0)) * 1e-9;
  st.nvme_read_bytes = nvme_read_bytes_.exchange(0);
  st.nvme_written_bytes = nvme_written_bytes_.exchange(0);
  st.pcie_h2d_bytes = h2d_bytes_.exchange(0);
  st.pcie_d2h_bytes = d2h_bytes_.exchange(0);
  const gpu::ArenaStats as = dev_->Stats();
  st.hbm_high_water_bytes = static_cast<int64_t>(as.high_water_bytes);
  st.pinned_high_water_bytes =
      pinned_high_water_ + (master_h_.pinned() ? 3 * master_h_.bytes() : 0);
  st.prefetched_modules = prefetch_hits_;
  st.fetch_misses = fetch_misses_;
  st.trace_rerecords = trace_->rerecords();
  const double busiest =
      std::max({st.compute_s, st.pcie_busy_s + st.grad_offload_s, st.optimizer_s, st.nvme_busy_s});
  st.overlap_efficiency = st.step_time_s > 0 ? std::min(1.0, busiest / st.step_time_s) : 0;
  last_ = st;
  compute_ns_ = fetch_wait_ns_ = optimizer_wait_ns_ = 0;
  prefetch_hits_ = fetch_misses_ = 0;
  window_start_ns_ = now;
  trace_->BeginStep();
  NoteHookExit();
  if (!status.ok()) return status;
  return st;
}

// ---------------------------------------------------------------------------
// The rest of the API
// ---------------------------------------------------------------------------

StatusOr<void*> EngineImpl::AllocateWorkspace(int64_t bytes) {
  if (bytes <= 0) return InvalidArgumentError(fmt::format("AllocateWorkspace: {} bytes", bytes));
  ASSIGN_OR_RETURN(DeviceBuffer b, AllocDevice(bytes, -1));
  void* p = b.data();
  workspaces_[p] = std::move(b);
  return p;
}

Status EngineImpl::FreeWorkspace(void* ptr) {
  auto it = workspaces_.find(ptr);
  if (it == workspaces_.end())
    return InvalidArgumentError("FreeWorkspace: not a workspace pointer");
  RETURN_IF_ERROR(dev_->compute().Synchronize());
  workspaces_.erase(it);
  return Status();
}

Status EngineImpl::ReadParameter(int id, std::span<float> out) {
  if (id < 0 || id >= static_cast<int>(params_.size()))
    return InvalidArgumentError(fmt::format("ReadParameter: no parameter {}", id));
  const ParamRec& p = params_[id];
  if (static_cast<int64_t>(out.size()) != p.numel)
    return InvalidArgumentError(fmt::format(
        "ReadParameter {}: buffer of {} floats, parameter has {}", p.name, out.size(), p.numel));
  if (!planned_) {
    if (!p.init.empty()) {
      std::copy(p.init.begin(), p.init.end(), out.begin());
    } else {
      p.initializer(out);
    }
    return Status();
  }
  // A step in flight is finished (and committed) first: its states are read.
  RETURN_IF_ERROR(FinishStep());
  if (opt_place() != OffloadDevice::kNvme) {
    std::memcpy(out.data(), master_ + p.elem_off, static_cast<size_t>(p.numel) * 4);
    return Status();
  }
  // From the sub-groups' active NVMe versions: the master is the first third.
  for (size_t g = 0; g < groups_.size(); ++g) {
    const int64_t b = std::max(groups_[g].elem_begin, p.elem_off);
    const int64_t e = std::min(groups_[g].elem_end, p.elem_off + p.numel);
    if (b >= e) continue;
    // The master's pages of this group, read whole (page-aligned, see kIoAlign).
    const int64_t first = 4 * (b - groups_[g].elem_begin), last = 4 * (e - groups_[g].elem_begin);
    const int64_t page0 = static_cast<int64_t>(AlignDown(static_cast<size_t>(first), kIoAlign));
    const int64_t len = IoBytes(last) - page0;
    ASSIGN_OR_RETURN(AlignedBuffer tmp,
                     AlignedBuffer::Allocate(static_cast<size_t>(len), kIoAlign));
    nvme::IoHandle h = swap_->Read(StateShard(g, state_version_[g]), static_cast<uint64_t>(page0),
                                   tmp.data(), static_cast<size_t>(len));
    RETURN_IF_ERROR(h.Wait().WithContext("ReadParameter " + p.name));
    std::memcpy(out.data() + (b - p.elem_off), tmp.as<uint8_t>() + (first - page0),
                static_cast<size_t>(last - first));
  }
  return Status();
}

std::string EngineImpl::StatsJson() const {
  const StepStats& s = last_;
  nlohmann::json j = {{"step", s.step},
                      {"applied", s.applied},
                      {"overflow", s.overflow},
                      {"loss_scale", s.loss_scale},
                      {"grad_norm", s.grad_norm},
                      {"clip_coef", s.clip_coef},
                      {"step_time_s", s.step_time_s},
                      {"fetch_wait_s", s.fetch_wait_s},
                      {"compute_s", s.compute_s},
                      {"grad_offload_s", s.grad_offload_s},
                      {"optimizer_s", s.optimizer_s},
                      {"optimizer_wall_s", s.optimizer_wall_s},
                      {"optimizer_wait_s", s.optimizer_wait_s},
                      {"nvme_busy_s", s.nvme_busy_s},
                      {"pcie_busy_s", s.pcie_busy_s},
                      {"nvme_read_bytes", s.nvme_read_bytes},
                      {"nvme_written_bytes", s.nvme_written_bytes},
                      {"pcie_h2d_bytes", s.pcie_h2d_bytes},
                      {"pcie_d2h_bytes", s.pcie_d2h_bytes},
                      {"hbm_high_water_bytes", s.hbm_high_water_bytes},
                      {"pinned_high_water_bytes", s.pinned_high_water_bytes},
                      {"prefetched_modules", s.prefetched_modules},
                      {"fetch_misses", s.fetch_misses},
                      {"trace_rerecords", s.trace_rerecords},
                      {"overlap_efficiency", s.overlap_efficiency},
                      {"device", dev_->Describe()}};
  return j.dump();
}

Status EngineImpl::WriteTimeline() {
  if (cfg_.strata.trace_path.empty())
    return FailedPreconditionError("WriteTimeline: strata.trace_path is not set");
  return timeline_.WriteJson(cfg_.strata.trace_path);
}

}  // namespace

StatusOr<std::unique_ptr<Engine>> CreateEngine(const Config& config, const EngineTestHooks& hooks) {
  auto engine = std::make_unique<EngineImpl>(config, hooks);
  RETURN_IF_ERROR(engine->Init());
  return std::unique_ptr<Engine>(std::move(engine));
}

StatusOr<std::unique_ptr<Engine>> Engine::Create(const Config& config) {
  return CreateEngine(config);
}

StatusOr<std::unique_ptr<Engine>> Engine::CreateFromFile(const std::string& path) {
  ASSIGN_OR_RETURN(Config c, LoadConfigFile(path));
  return CreateEngine(c);
}

StatusOr<std::unique_ptr<Engine>> Engine::CreateFromJson(std::string_view json_text) {
  ASSIGN_OR_RETURN(Config c, ParseConfig(json_text));
  return CreateEngine(c);
}

}  // namespace strata
