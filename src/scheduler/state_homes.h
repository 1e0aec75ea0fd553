// src/scheduler/state_homes.h — where the StateStore keeps each kind of
// state, one class per placement, so that no method branches on it:
//
//   optimizer states (offload_optimizer)   parameter copies (offload_param)
//   DeviceStates  none: arrays in the arena  DeviceParams  none: the device
//                                                          block (+ its mirror)
//   HostStates    cpu: DRAM arrays            HostParams    cpu: the host copy
//   NvmeStates    nvme: two versions per      NvmeParams    nvme: two versions
//                 sub-group                                 per module
//
// Each holds only this rank's part (the store's Partition). The StateStore
// (state_store.h) owns one of each, the pinned pools and the NVMe tier, and
// is the interface the rest of the scheduler sees; these classes are its
// internals.
//
// Threading: as the StateStore's (the optimizer thread reads the states and
// writes the inactive versions while a step runs; the main thread commits).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "src/common/aligned_buffer.h"
#include "src/gpu/device.h"
#include "src/nvme/nvme.h"
#include "src/scheduler/host_array.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/partition.h"
#include "src/scheduler/plan.h"
#include "src/scheduler/step_counters.h"
#include "strata/status.h"

namespace strata::scheduler {

struct StepOutcome;

// What the homes share with the store.
struct StoreContext {
  gpu::Device* dev = nullptr;
  const Layout* layout = nullptr;
  const Partition* part = nullptr;
  StepCounters* counters = nullptr;
  nvme::SwapStore* swap = nullptr;  // once the NVMe tier is open
};

// NVMe shard names (stable: they name files' contents on disk).
std::string ModuleShardName(int module, int version);
std::string StateShardName(size_t group, int version);

// ---- Optimizer states: master | exp_avg | exp_avg_sq over the owned elements

class StateHome {
 public:
  virtual ~StateHome() = default;
  // The place offload_optimizer names (pinned: page-lock DRAM arrays).
  static std::unique_ptr<StateHome> For(OffloadDevice place, const StoreContext* ctx);
  virtual Status Allocate(bool pinned) = 0;
  // In memory (none, cpu): flat fp32 arrays over the owned elements, element
  // e at index e - Partition::state_base(); null for nvme.
  float* master() const { return master_; }
  float* exp_avg() const { return exp_avg_; }
  float* exp_avg_sq() const { return exp_avg_sq_; }
  int64_t pinned_bytes() const;

  // Initialization, sub-group by owned sub-group in order: InitTarget(g)
  // is where sub-group g's fp32 masters go (its elements, from its first),
  // InitGroup(g) then stores them with zero moments; FinishInit after the
  // last. `nvme_bytes` counts what went to NVMe.
  virtual StatusOr<float*> InitTarget(size_t g) = 0;
  virtual Status InitGroup(size_t g, int64_t* nvme_bytes) = 0;
  virtual Status FinishInit() = 0;

  // Checkpoints: sub-group g's states as master | exp_avg | exp_avg_sq (12 x
  // elems bytes) into buf (state_io_bytes, aligned), and back.
  virtual Status ReadGroup(size_t g, void* buf) = 0;
  virtual Status WriteGroup(size_t g, const void* buf) = 0;
  // The masters of parameter p this rank owns, into / from the same
  // positions of out / values.
  virtual Status ReadMaster(const ParamRec& p, std::span<float> out) = 0;
  virtual Status WriteMaster(const ParamRec& p, std::span<const float> values) = 0;
  // A step's outcome becomes current (nvme: the versions flip when every
  // sub-group was written).
  virtual void Commit(const StepOutcome& outcome) {}

 protected:
  explicit StateHome(const StoreContext* ctx) : ctx_(ctx) {}
  // The owned elements of p, [first, second) of the element space.
  std::pair<int64_t, int64_t> Owned(const ParamRec& p) const;
  const StoreContext* ctx_;
  float* master_ = nullptr;
  float* exp_avg_ = nullptr;
  float* exp_avg_sq_ = nullptr;
  HostArray arrays_[3];  // cpu: master, exp_avg, exp_avg_sq
};

// offload_optimizer nvme: two versions of each owned sub-group's states; a
// step reads the active one and writes the other.
class NvmeStates final : public StateHome {
 public:
  explicit NvmeStates(const StoreContext* ctx) : StateHome(ctx) {}
  Status Allocate(bool pinned) override;
  // The pipeline buffer initialization fills (the optimizer pool's).
  void set_init_buffer(gpu::PinnedBuffer buf) { init_buf_ = std::move(buf); }
  StatusOr<float*> InitTarget(size_t g) override;
  Status InitGroup(size_t g, int64_t* nvme_bytes) override;
  Status FinishInit() override;
  Status ReadGroup(size_t g, void* buf) override;
  Status WriteGroup(size_t g, const void* buf) override;
  Status ReadMaster(const ParamRec& p, std::span<float> out) override;
  Status WriteMaster(const ParamRec& p, std::span<const float> values) override;
  void Commit(const StepOutcome& outcome) override;

  nvme::IoHandle Read(size_t g, void* buf);         // the active version
  nvme::IoHandle Write(size_t g, const void* buf);  // the inactive one
  int version(size_t g) const { return version_[g]; }

 private:
  std::vector<int> version_;  // per sub-group: the active version
  gpu::PinnedBuffer init_buf_;
};

}  // namespace strata::scheduler
