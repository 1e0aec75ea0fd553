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
#include "src/cpu_adam/cpu_adam.h"
#include "src/gpu/device.h"
#include "src/nvme/nvme.h"
#include "src/scheduler/host_array.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/partition.h"
#include "src/scheduler/plan.h"
#include "src/scheduler/step_counters.h"
#include "strata/status.h"

namespace strata::scheduler {

// What an optimizer step did, for the homes' and the store's Commit /
// Rollback.
struct StepOutcome {
  Status status;
  bool advanced = false;                // in-memory states moved to the new step
  bool states_written = false;          // every sub-group's new NVMe states were written
  std::vector<int> param_written;       // modules whose new parameters are on NVMe
  std::vector<int> param_write_failed;  // modules whose NVMe parameter write failed
};

// The optimizer states of a run of elements in their format
// (strata.optimizer_states), as the CPU optimizer steps them: element e at
// index e - first of each array. fp32: master, exp_avg and exp_avg_sq are
// float arrays; bf16: an fp32 master, bf16 moments; bf16-master: all three
// bf16; int8: an fp32 master, one code per element per moment, and one fp32
// scale per kStateBlock elements per moment (first is a multiple of it).
struct StateArrays {
  cpu_adam::StateFormat format = cpu_adam::StateFormat::kFp32;
  int64_t first = 0;
  void* master = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  float* exp_avg_scale = nullptr;
  float* exp_avg_sq_scale = nullptr;
  // Points st's state arrays at elements [e, e + st->count) and sets its
  // format and element_offset (e); st->hp.algorithm must be set (Lion has
  // no second moment in a compact format).
  // REQUIRES: int8: e - first is a multiple of kStateBlock.
  void Point(int64_t e, cpu_adam::ShardStep* st) const;
  // Array `role`'s storage of element e, and its scales (int8 moments: e
  // starts a block; else null).
  std::pair<uint8_t*, float*> At(cpu_adam::StateRole role, int64_t e) const;
  // Elements [e, e + n) decoded to fp32 as master | exp_avg | exp_avg_sq
  // (n each, from out, each array `stride` floats after the previous one;
  // -1: n), and encoded back from that (a checkpoint's form).
  // REQUIRES: int8: e starts a block.
  Status Decode(int64_t e, int64_t n, float* out, int64_t stride = -1) const;
  Status Encode(const float* in, int64_t e, int64_t n, int64_t stride = -1) const;
};

// Sub-group sg's states in `buf` (a pipeline buffer or a shard's bytes),
// laid out by GroupStatesIn(f, sg.elems()).
StateArrays GroupBufferStates(const SubGroup& sg, cpu_adam::StateFormat f, void* buf);
// Elements [first, first + elems)'s states in `buf`, laid out by
// GroupStatesIn(f, elems) (the speculative step's spare).
StateArrays StatesInBuffer(cpu_adam::StateFormat f, int64_t first, int64_t elems, void* buf);
// Copies elements [lo, hi)'s states (every array, int8's scales of the
// blocks they cover) from `from` to `to`, both of one format, on the CPU
// optimizer's threads (CpuOptimizer::Copy) where both ends are
// float-aligned, the rest with memcpy.
// REQUIRES: int8: lo starts a block in both.
Status CopyStates(cpu_adam::CpuOptimizer* adam, const StateArrays& from, const StateArrays& to,
                  int64_t lo, int64_t hi);

// What the homes share with the store.
struct StoreContext {
  gpu::Device* dev = nullptr;
  // The optimizer states' format (strata.optimizer_states; in DRAM and on
  // NVMe; the device's states are fp32).
  cpu_adam::StateFormat state_format = cpu_adam::StateFormat::kFp32;
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
  // In memory: the states in their format (the three arrays above for
  // fp32), from Partition::state_base(); empty (null arrays) for nvme.
  const StateArrays& arrays() const { return view_; }
  // offload_optimizer cpu with ratio below 1 (Partition::device_groups):
  // the first sub-groups' states in the arena, in the state format, from
  // Partition::device_elems().first; arrays() then holds the
  // rest, from host_elems().first. Else empty.
  const StateArrays& device_arrays() const { return device_view_; }
  virtual int64_t pinned_bytes() const;

  // Initialization, sub-group by owned sub-group in order: InitTarget(g)
  // is where sub-group g's fp32 masters go (its elements, from its first),
  // InitGroup(g) then stores them with zero moments; FinishInit after the
  // last. `nvme_bytes` counts what went to NVMe.
  virtual StatusOr<float*> InitTarget(size_t g) = 0;
  virtual Status InitGroup(size_t g, int64_t* nvme_bytes) = 0;
  virtual Status FinishInit() = 0;

  // Checkpoints: sub-group g's states decoded to fp32, master | exp_avg |
  // exp_avg_sq (12 x elems bytes), into buf (IoBytes of that, aligned), and
  // back (encoded in the format).
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
  // The owned elements of p in this home's range, [first, second) of the
  // element space.
  std::pair<int64_t, int64_t> Owned(const ParamRec& p) const;
  const StoreContext* ctx_;
  // The elements this home keeps (empty: the partition's).
  std::pair<int64_t, int64_t> range_{0, 0};
  StateArrays device_view_;
  float* master_ = nullptr;
  float* exp_avg_ = nullptr;
  float* exp_avg_sq_ = nullptr;
  StateArrays view_;
  HostArray arrays_[4];  // cpu: master, exp_avg, exp_avg_sq, int8's scales
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

  // Piece `pc` of sub-group g (Layout::StatePieces): its active version
  // into buf, or buf as its inactive one (pc.io_bytes).
  nvme::IoHandle Read(size_t g, const StatePiece& pc, void* buf);
  nvme::IoHandle Write(size_t g, const StatePiece& pc, const void* buf);
  int version(size_t g) const { return version_[g]; }

 private:
  // Compact formats or pieces: shard g's bytes through a scratch buffer.
  Status ReadShard(size_t g, int version, AlignedBuffer* out);
  // Whether shard g is the sub-group's fp32 master | exp_avg | exp_avg_sq
  // as a checkpoint holds them (fp32, one piece).
  bool Plain() const {
    return ctx_->state_format == cpu_adam::StateFormat::kFp32 &&
           ctx_->layout->state_piece_elems() == 0;
  }
  // Whether initialization fills a sub-group's fp32 master straight into
  // the buffer (one piece, master fp32), else into init_ and piece by piece.
  bool InitInPlace() const {
    return ctx_->state_format != cpu_adam::StateFormat::kBf16Master &&
           ctx_->layout->state_piece_elems() == 0;
  }
  std::vector<int> version_;  // per sub-group: the active version
  gpu::PinnedBuffer init_buf_;
  // bf16-master or pieces: a sub-group's fp32 masters at initialization.
  std::vector<float> init_;
};

// ---- Parameter copies: this rank's working-precision bytes (Partition::
// param_bytes: the whole parameter-byte space, or its part when partitioned)

class ParamHome {
 public:
  virtual ~ParamHome() = default;
  // The place offload_param names.
  static std::unique_ptr<ParamHome> For(const Placement& placement, const StoreContext* ctx);
  // Allocates what the placement keeps (`pinned`: page-lock the host arrays).
  virtual Status Allocate(bool pinned) = 0;
  // The optimizer's copy-out target over this rank's parameter bytes (from
  // Partition::param_byte_base()); null with offload_param nvme, where the
  // step writes modules through write-back buffers.
  uint8_t* next() { return next_.as<uint8_t>(); }
  int64_t pinned_bytes() const;

  // Initialization, in element order: parameter p's elements [first, first
  // + count) from `values` (p's fp32 values), then FinishInit publishes them
  // where fetches read them. `nvme_bytes` counts what went to NVMe.
  virtual Status InitElems(const ParamRec& p, int64_t first, int64_t count,
                           std::span<const float> values, int64_t* nvme_bytes) = 0;
  virtual Status FinishInit(int64_t* nvme_bytes) = 0;

  // Partitioned: what this rank sends of module m in a gather (the store's
  // PartOf, which says the rules).
  virtual StatusOr<PartBytes> PartOf(int m, bool updated, bool to_host, AlignedBuffer* piece) = 0;
  // The host bytes a fetch of module m copies to the device (unpartitioned
  // offload_param cpu), else null.
  virtual const uint8_t* FetchSource(int m, bool updated) { return nullptr; }
  // Module m's current bytes into / from buf (checkpoints, WriteParameter).
  // Read: unpartitioned only. Write: partitioned, this rank's piece of it.
  virtual Status ReadModule(int m, void* buf) = 0;
  virtual Status WriteModule(int m, const void* buf) = 0;
  // Partitioned: parameter p's elements this rank keeps set from `values`.
  virtual Status WriteOwnedElems(const ParamRec& p, std::span<const float> values) = 0;
  // The step's outcome becomes current; `uploaded`: offload_param none's
  // modules already uploaded by the step.
  virtual Status Commit(const StepOutcome& outcome, const std::vector<uint8_t>& uploaded) = 0;
  // A failed step: what it uploaded is undone (offload_param none's mirror).
  virtual void Rollback(const std::vector<uint8_t>& uploaded, int64_t step) {}

 protected:
  explicit ParamHome(const StoreContext* ctx) : ctx_(ctx) {}
  // Stores p's elements [first, first + count) into an array holding this
  // rank's parameter bytes from Partition::param_byte_base() (partitioned:
  // only the elements it owns).
  void StoreOwned(uint8_t* array, const ParamRec& p, int64_t first, int64_t count,
                  std::span<const float> values) const;
  const StoreContext* ctx_;
  HostArray next_;  // the copy-out target (none, cpu)
  HostArray host_;  // cpu: the host copy fetches read; none: the mirror (param_mirror)
};

// offload_param none: the parameters in a device block (partitioned: this
// rank's part), uploaded from the copy-out target; with an overlapped step
// a host mirror undoes a step that fails after uploading modules.
class DeviceParams final : public ParamHome {
 public:
  DeviceParams(const StoreContext* ctx, bool mirror) : ParamHome(ctx), mirror_(mirror) {}
  Status Allocate(bool pinned) override;
  Status InitElems(const ParamRec& p, int64_t first, int64_t count, std::span<const float> values,
                   int64_t* nvme_bytes) override;
  Status FinishInit(int64_t* nvme_bytes) override;
  StatusOr<PartBytes> PartOf(int m, bool updated, bool to_host, AlignedBuffer* piece) override;
  Status ReadModule(int m, void* buf) override;
  Status WriteModule(int m, const void* buf) override;
  Status WriteOwnedElems(const ParamRec& p, std::span<const float> values) override;
  Status Commit(const StepOutcome& outcome, const std::vector<uint8_t>& uploaded) override;
  void Rollback(const std::vector<uint8_t>& uploaded, int64_t step) override;

  uint8_t* block() { return block_.as<uint8_t>(); }
  gpu::Event* uploaded() { return uploaded_.get(); }
  // Module m's new bytes (next()) into the block; `ready` recorded after.
  Status UploadModule(int m, gpu::Event& ready);

 private:
  // Bytes [offset, offset + bytes) of next() into the block, waited for.
  Status UploadPart(int64_t offset, size_t bytes);
  // The first parameter byte the CPU step writes (0; with sub-groups
  // stepped on the device, those write the bytes before it in place).
  int64_t HostSteppedFrom() const;
  bool mirror_;
  gpu::DeviceBuffer block_;
  std::unique_ptr<gpu::Event> uploaded_;  // after the block's last upload
};

// offload_param nvme: two versions of each module (partitioned: of this
// rank's piece of it); a step reads the active one and writes the other.
class NvmeParams final : public ParamHome {
 public:
  explicit NvmeParams(const StoreContext* ctx) : ParamHome(ctx) {}
  Status Allocate(bool pinned) override;
  // The write-back buffer initialization fills (the store's pool's).
  void set_init_buffer(gpu::PinnedBuffer buf) { init_buf_ = std::move(buf); }
  Status InitElems(const ParamRec& p, int64_t first, int64_t count, std::span<const float> values,
                   int64_t* nvme_bytes) override;
  Status FinishInit(int64_t* nvme_bytes) override;
  StatusOr<PartBytes> PartOf(int m, bool updated, bool to_host, AlignedBuffer* piece) override;
  Status ReadModule(int m, void* buf) override;
  Status WriteModule(int m, const void* buf) override;
  Status WriteOwnedElems(const ParamRec& p, std::span<const float> values) override;
  Status Commit(const StepOutcome& outcome, const std::vector<uint8_t>& uploaded) override;

  // The active version of module m (or with `updated` the one a step in
  // flight has written), or the new (inactive) one written: this rank's
  // piece from its first byte, IoBytes of it.
  nvme::IoHandle Read(int m, void* buf, bool updated = false);
  nvme::IoHandle Write(int m, const void* buf);
  int version(int m) const { return version_[static_cast<size_t>(m)]; }

 private:
  // This rank's piece of module m (active version) into *piece, and back.
  Status ReadPiece(int m, AlignedBuffer* piece);
  Status WritePiece(int m, const AlignedBuffer& piece);
  // Initialization: the module being filled in init_buf_, written when the
  // next one begins.
  Status FlushInitModule(int64_t* nvme_bytes);
  std::vector<int> version_;  // per module: the active version
  gpu::PinnedBuffer init_buf_;
  int init_module_ = -1;
};

}  // namespace strata::scheduler
