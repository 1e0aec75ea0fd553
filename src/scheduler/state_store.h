// src/scheduler/state_store.h — where every state lives, and the one place
// where a step's results become current.
//
// It owns:
//   * the optimizer states (master | exp_avg | exp_avg_sq, in the format
//     strata.optimizer_states names: StateArrays): in the device arena
//     (offload_optimizer none, fp32), in DRAM (cpu, pinned with
//     pin_memory), or as two versions per sub-group on NVMe (nvme);
//   * the parameter copies: the device block (offload_param none) with its
//     DRAM mirror (Placement::param_mirror), the host copy (cpu), two
//     versions per module on NVMe (nvme), and the "next" array, the
//     optimizer's fused copy-out target;
//   * the NVMe tier (I/O service + swap store) and the pinned pools of the
//     optimizer pipeline and of parameter fetches.
// Each kind of state lives in one home per placement (state_homes.h:
// DeviceStates / HostStates / NvmeStates, DeviceParams / HostParams /
// NvmeParams), chosen at Open from the plan's placement; the store delegates
// to them. The placement is read only where the store is set up (Open picks
// the homes and the pinned pools, OpenNvme allocates the NVMe shards) and in
// the typed accessors of the NVMe and device homes the pipeline and the
// fetcher use (nvme_states_, nvme_params_, device_params_: set at Open, null
// for the other placements); the other methods do not branch on it.
//
// Atomic steps. NVMe-resident states and parameters have two versions (A/B)
// on disk; a step reads the active version and writes the other, and
// Commit() flips the versions only of what was written in full. A step that
// fails before anything in memory changed is rolled back (Rollback); DRAM/HBM
// optimizer states are updated in place, so a step that failed after that
// point is committed, keeping the previous NVMe parameters of the modules whose
// write failed. Commit and Rollback run on the caller's (main) thread only.
//
// Threading: the optimizer thread reads states and writes the inactive NVMe
// versions and next_params() through the views below while a step runs; the
// main thread does not touch those until the step has been joined, except
// for modules the step has finished (next_params() of those is final).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "src/common/aligned_buffer.h"
#include "src/gpu/device.h"
#include "src/nvme/nvme.h"
#include "src/scheduler/host_array.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/partition.h"
#include "src/scheduler/plan.h"
#include "src/scheduler/state_homes.h"
#include "src/scheduler/step_counters.h"
#include "strata/config.h"

namespace strata::scheduler {

class StateStore {
 public:
  // `partition` (what this rank keeps) must outlive the store.
  StateStore(gpu::Device* device, const Layout* layout, const Partition& partition,
             StepCounters* counters, const Config* config);
  ~StateStore();

  // Allocates every state by the placement and the plan (what is pinned) and
  // opens the NVMe tier (if used) with the plan's NVMe bytes;
  // `extra_fixed_buffers` (the gradient staging pool) are registered with the
  // I/O engine too. Adds the pinned pools' bytes to *pinned_bytes.
  Status Open(const TierPlan& plan, const std::vector<gpu::PinnedPool::Region>& extra_fixed_buffers,
              const std::function<std::unique_ptr<nvme::IoEngine>(std::unique_ptr<nvme::IoEngine>)>&
                  wrap_io_engine,
              int64_t* pinned_bytes);
  // Sets every state from the initial values: master_of(id, scratch) returns
  // parameter id's fp32 values (in `scratch` or elsewhere), called once per
  // parameter in element order. Moments are zero; the parameters are
  // published to where the device fetches them. States and parameters on
  // NVMe are written sub-group by sub-group and module by module through
  // one pipeline buffer and one write-back buffer.
  Status Initialize(
      const std::function<std::span<const float>(int id, std::vector<float>& scratch)>& master_of);
  // Bytes Initialize() wrote to NVMe (a first measure of the disk's rate).
  int64_t initial_nvme_bytes() const { return initial_nvme_bytes_; }
  // Closes the swap store (removes its files).
  Status Close();

  // What this rank keeps (the Partition given at construction): with
  // several ranks the optimizer states of its elements only (the in-memory
  // state arrays from Partition::state_base()); at stage 3 also only its
  // bytes of the parameters (Partition::params_partitioned(), the arrays
  // from param_byte_base()): the host copy (cpu), the device block (none),
  // or on NVMe (nvme) each module's piece (Partition::ModulePiece) in two
  // versions; the copy-out target and the mirror too (nvme has none: the
  // step writes the pieces through write-back buffers). The store keeps
  // where those bytes live (PartOf); the ranks exchange them elsewhere
  // (ParamGatherer).
  const Partition& partition() const { return part_; }
  // Partitioned with offload_param none: this rank's part lives in the
  // device block and modules are gathered within device memory (into a
  // device slot or buffer); with cpu or nvme into pinned host buffers.
  bool gathers_on_device() const {
    return part_.params_partitioned() && placement_.params == OffloadDevice::kNone;
  }
  // The pinned buffers modules are gathered into (offload_param.buffer_count).
  int64_t param_buffers() const { return std::max<int64_t>(1, placement_.param_buffer_count); }
  // Partitioned: what this rank sends of module m in a gather, in device
  // memory when gathers_on_device() and not `to_host`, else in host memory:
  // the host copy (cpu; with `updated`, a step in flight that has finished
  // this rank's piece of the module, the step's copy-out target) or the
  // device block (none), from param_byte_base(); or its piece of the module
  // in *piece, from ModulePiece(m).first: read from NVMe (nvme), or copied
  // from the device block (none with `to_host`). Waited for; *piece must
  // stay until the gather has read it.
  StatusOr<PartBytes> PartOf(int m, bool updated, bool to_host, AlignedBuffer* piece);

  OffloadDevice optimizer_place() const { return placement_.optimizer; }
  OffloadDevice param_place() const { return placement_.params; }

  // ---- Optimizer states ----
  // In memory with fp32 states (offload_optimizer none/cpu): flat arrays
  // over the owned elements (element e at index e - state_base()); null for
  // nvme and for compact formats (states() has them).
  float* master() { return states_->master(); }
  float* exp_avg() { return states_->exp_avg(); }
  float* exp_avg_sq() { return states_->exp_avg_sq(); }
  // In memory: the states in their format (strata.optimizer_states), from
  // state_base(); for fp32 the three arrays above. With sub-groups stepped
  // on the device (Partition::device_groups): the CPU optimizer's part,
  // from Partition::host_elems().first, and device_states() the first
  // sub-groups' in HBM (master fp32, moments fp32 or bf16).
  const StateArrays& states() const { return states_->arrays(); }
  const StateArrays& device_states() const { return states_->device_arrays(); }
  // Bytes of page-locked states and parameter copies (not the pools).
  int64_t pinned_array_bytes() const;
  // NVMe: reads piece pc of sub-group g's active states into buf
  // (pc.io_bytes; Layout::StatePieces), or writes buf as its new (inactive)
  // version.
  nvme::IoHandle ReadStates(size_t g, const StatePiece& pc, void* buf);
  nvme::IoHandle WriteStates(size_t g, const StatePiece& pc, const void* buf);
  gpu::PinnedPool* optimizer_pool() { return opt_pool_.get(); }
  // Bytes of one optimizer pipeline buffer: the largest piece's states in
  // their format (IoBytes of GroupStatesIn's, 12 x Layout::max_piece_elems
  // for fp32), then with gradients on NVMe its gradient sums (at
  // grad_buffer_offset()).
  int64_t optimizer_buffer_bytes() const;
  int64_t grad_buffer_offset() const;
  // Gradients on NVMe (TierPlan::grads_on_nvme): sub-group g's shard (one
  // version; `bytes` = IoBytes(4 x elems); a read may start at a page).
  nvme::IoHandle ReadGrads(size_t g, void* buf, int64_t bytes, int64_t offset = 0);
  nvme::IoHandle WriteGrads(size_t g, const void* buf, int64_t bytes);
  // The fp32 master values of parameter p (from the active NVMe versions
  // when the states are there): the elements this rank owns, into the same
  // positions of `out` (the rest of `out` is left as it is).
  Status ReadMaster(const ParamRec& p, std::span<float> out);
  // Its mirror: parameter p's fp32 master becomes `values` (p.numel of them)
  // wherever it lives (NVMe: the active version, in place; the elements this
  // rank owns), and so does its working-precision copy wherever fetches read
  // it; the moments are kept.
  // REQUIRES: no step in flight, the device idle.
  Status WriteMaster(const ParamRec& p, std::span<const float> values);

  // ---- Parameters ----
  // The optimizer's copy-out target over every parameter (offload_param
  // none and cpu); null with offload_param nvme, where the step copies out
  // into write-back buffers (param_write_pool) and writes modules from them.
  uint8_t* next_params() { return params_->next(); }
  // The bytes a fetch of module m copies to the device: the step's new
  // values (`updated`: a step in flight has finished the module), the host
  // copy (cpu), or null (nvme: read into a staging buffer first).
  const uint8_t* FetchSource(int m, bool updated);
  // NVMe: reads module m's active version into buf (IoBytes(bytes)), or with
  // `updated` the version a step in flight has written (its write has
  // landed), or writes `buf` (the module's bytes from its first, IoBytes of
  // them) as the new (inactive) version. Partitioned: this rank's piece
  // (ModulePiece) from its first byte, IoBytes of it.
  nvme::IoHandle ReadModule(int m, void* buf, bool updated = false);
  nvme::IoHandle WriteModule(int m, const void* buf);
  gpu::PinnedPool* param_pool() { return param_pool_.get(); }
  // offload_param nvme: kParamWriteBuffers buffers of the largest module.
  gpu::PinnedPool* param_write_pool() { return param_write_pool_.get(); }
  // offload_param none: the device block (partitioned: this rank's part)
  // and the event of its last upload.
  uint8_t* device_params() { return device_params_ ? device_params_->block() : nullptr; }
  gpu::Event* params_uploaded() { return device_params_ ? device_params_->uploaded() : nullptr; }
  // offload_param none: uploads module m's new parameters (next_params())
  // into its part of the device block; ready is recorded after the copy.
  Status UploadModule(int m, gpu::Event& ready);

  // ---- Commit / rollback (main thread) ----
  // Makes the step's results current: NVMe state versions (when every
  // sub-group was written), NVMe module versions (only modules written),
  // the host copy or mirror (swapped with next_params()), and the device
  // block (offload_param none: modules not yet in `uploaded` are uploaded).
  Status Commit(const StepOutcome& outcome, const std::vector<uint8_t>& uploaded);
  // A step that failed before changing any in-memory state: nothing flips;
  // modules already uploaded into the device block are restored from the
  // mirror. Errors are logged (the step's error is the one returned).
  void Rollback(const std::vector<uint8_t>& uploaded, int64_t step);

  // ---- Checkpoints (main thread; no step in flight, the device idle) ----
  // REQUIRES OwnsGroup(g). Sub-group g's current states decoded to fp32,
  // master | exp_avg | exp_avg_sq (12 x elems bytes), into buf (IoBytes of
  // that, kIoAlign-aligned), from wherever they live (NVMe: the active
  // version), and back (encoded in the states' format). Writing NVMe states
  // overwrites the active version in place (the swap store is scratch space;
  // the next step reads it).
  Status ReadGroupStates(size_t g, void* buf);
  Status WriteGroupStates(size_t g, const void* buf);
  // Module m's current parameter bytes (module(m).bytes(), tensors at their
  // layout offsets) into buf (IoBytes of that, aligned), and back: written to
  // where fetches read them (device block and mirror, host copy, or the
  // active NVMe version) and to next_params(). Partitioned parameters:
  // Read is refused (a module comes from the ranks: PartOf and a
  // ParamGatherer); Write keeps this rank's piece of `buf` (ModulePiece).
  Status ReadModuleParams(int m, void* buf);
  Status WriteModuleParams(int m, const void* buf);

  // For tests and ReadParameter: a sub-group's active version.
  int state_version(size_t g) const { return nvme_states_->version(g); }

  // NVMe shard names (stable: they name files' contents on disk).
  static std::string ModuleShard(int module, int version);
  static std::string StateShard(size_t group, int version);
  static std::string GradShard(size_t group);

 private:
  Status AllocatePools(int64_t* pinned_bytes);
  // WriteMaster's part: the working copy of a whole module read, patched
  // and written back.
  Status WriteWorkingCopy(const ParamRec& p, std::span<const float> values);
  bool params_partitioned() const { return part_.params_partitioned(); }
  std::pair<int64_t, int64_t> ModulePiece(int m) const { return part_.ModulePiece(m); }
  Status OpenNvme(
      int64_t capacity, const std::vector<gpu::PinnedPool::Region>& extra,
      const std::function<std::unique_ptr<nvme::IoEngine>(std::unique_ptr<nvme::IoEngine>)>& wrap);

  gpu::Device* dev_;
  const Layout* layout_;
  const Config* cfg_;
  const Partition& part_;
  Placement placement_;

  StoreContext ctx_;  // what the homes share (state_homes.h)
  // The optimizer states' home (offload_optimizer), and it as NvmeStates
  // when they are on NVMe (else null).
  std::unique_ptr<StateHome> states_;
  NvmeStates* nvme_states_ = nullptr;
  // The parameter copies' home (offload_param), and it as DeviceParams or
  // NvmeParams when it is one (else null).
  std::unique_ptr<ParamHome> params_;
  DeviceParams* device_params_ = nullptr;
  NvmeParams* nvme_params_ = nullptr;
  int64_t initial_nvme_bytes_ = 0;

  bool grads_on_nvme_ = false;
  std::unique_ptr<gpu::PinnedPool> opt_pool_, param_pool_, param_write_pool_;
  std::unique_ptr<nvme::IoService> io_;
  std::unique_ptr<nvme::SwapStore> swap_;
};

}  // namespace strata::scheduler
