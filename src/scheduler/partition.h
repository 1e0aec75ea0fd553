// src/scheduler/partition.h — who this rank is and what it owns, decided
// once, and the narrow interfaces through which the other parts reach the
// other ranks (DataParallel implements them; data_parallel.h).
//
// Partition is built once by Engine::Plan() from the layout (its partitions
// are cut there: Layout::OwnedElems / OwnedGroups / OwnedBytes), the rank and
// the config, and passed by const reference to everything that needs it:
// the StateStore, the optimizer back-ends and their step, checkpoints. It
// never changes after. One rank (world_size 1) owns every element, every
// sub-group and the whole parameter-byte space.
//
// Data parallelism (stages 1-3): rank r owns the optimizer states of its
// elements and steps its sub-groups. Stage 3 also partitions the parameters
// (params_partitioned()): every parameter array (the host copy, the device
// block, the NVMe pieces, the step's copy-out target) holds only this rank's
// bytes, from param_byte_base(); a module is then gathered from the ranks
// when it is fetched (ParamGatherer).
//
// One rank with zero_optimization.offload_optimizer.ratio below 1
// (TierPlan::device_step_groups): the first sub-groups' states live in HBM
// and the device Adam steps them; the CPU optimizer steps the rest
// (host_elems / host_groups). elems() and groups() still cover both.
//
// Threading: immutable; read from any thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "src/gpu/device.h"
#include "src/scheduler/layout.h"
#include "strata/status.h"

namespace strata::scheduler {

class Partition {
 public:
  // One rank over `layout` (which must outlive it): owns everything.
  explicit Partition(const Layout* layout) : Partition(layout, 0, 1, false) {}
  // Rank `rank` of `world_size` over `layout`, cut into world_size
  // partitions by Layout::Build; `params_partitioned` at stage 3 with
  // several ranks. The first `device_groups` of the rank's sub-groups are
  // stepped on the device (offload_optimizer.ratio; the plan gives them to
  // one rank only).
  Partition(const Layout* layout, int rank, int world_size, bool params_partitioned,
            int64_t device_groups = 0)
      : layout_(layout),
        rank_(rank),
        world_size_(std::max(1, world_size)),
        params_partitioned_(params_partitioned && world_size > 1),
        device_groups_(static_cast<size_t>(
            std::clamp<int64_t>(device_groups, 0, static_cast<int64_t>(layout->num_groups())))) {}
  // One rank whose first `device_groups` sub-groups are stepped on the
  // device (offload_optimizer.ratio).
  Partition(const Layout* layout, int64_t device_groups)
      : Partition(layout, 0, 1, false, device_groups) {}

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  bool data_parallel() const { return world_size_ > 1; }
  bool params_partitioned() const { return params_partitioned_; }

  // The optimizer states this rank keeps: elements [first, second); the
  // in-memory state arrays start at state_base().
  std::pair<int64_t, int64_t> elems() const { return layout_->OwnedElems(rank_); }
  int64_t state_base() const { return elems().first; }
  // The sub-groups this rank steps, [first, second).
  std::pair<size_t, size_t> groups() const { return layout_->OwnedGroups(rank_); }
  bool OwnsGroup(size_t g) const {
    const auto [g0, g1] = groups();
    return g >= g0 && g < g1;
  }
  // The sub-groups and elements whose states are in HBM and stepped by the
  // device Adam (offload_optimizer.ratio below 1; else none): the first
  // ones, [groups().first, first + device_groups()).
  size_t device_groups() const { return device_groups_; }
  std::pair<int64_t, int64_t> device_elems() const {
    const int64_t e0 = elems().first;
    return {e0, host_elems().first};
  }
  // The ones the CPU optimizer steps: the rest of groups() / elems().
  std::pair<size_t, size_t> host_groups() const {
    const auto [g0, g1] = groups();
    return {std::min(g1, g0 + device_groups_), g1};
  }
  std::pair<int64_t, int64_t> host_elems() const {
    const auto [g0, g1] = host_groups();
    const auto [e0, e1] = elems();
    return {g0 < g1 ? std::max(e0, layout_->group(g0).elem_begin) : e1, e1};
  }
  bool DeviceGroup(size_t g) const {
    const auto [h0, h1] = host_groups();
    return OwnsGroup(g) && g < h0;
  }

  // The parameter bytes this rank keeps: its part of the parameter-byte
  // space when the parameters are partitioned (Layout::OwnedBytes), else
  // the whole space. The parameter arrays start at param_byte_base() and
  // are param_array_bytes() long (page-rounded): with partitioned
  // parameters the largest rank's part, on every rank, as the plan counts.
  std::pair<int64_t, int64_t> param_bytes() const {
    return params_partitioned_ ? layout_->OwnedBytes(rank_)
                               : std::pair<int64_t, int64_t>{0, layout_->total_param_bytes()};
  }
  int64_t param_byte_base() const { return param_bytes().first; }
  int64_t param_array_bytes() const {
    if (!params_partitioned_) return layout_->total_param_bytes();
    return IoBytes(layout_->MaxOwnedBytes());
  }
  // The bytes of module m this rank keeps, [first, second) of the
  // parameter-byte space: its part of the module (possibly empty) when the
  // parameters are partitioned, else the whole module.
  std::pair<int64_t, int64_t> ModulePiece(int m) const {
    const ModuleExtent& me = layout_->module(m);
    if (!params_partitioned_) return {me.byte_begin, me.byte_end};
    const auto [b0, b1] = layout_->OwnedBytes(rank_);
    const int64_t lo = std::max(b0, me.byte_begin);
    return {lo, std::max(lo, std::min(b1, me.byte_end))};
  }

 private:
  const Layout* layout_;
  int rank_;
  int world_size_;
  bool params_partitioned_;
  size_t device_groups_ = 0;
};

// Where the arrays of a collective live: host memory (staged through device
// memory), or device memory (copied within the device).
enum class Memory { kHost, kDevice };

// What this rank sends of a module in a gather: an array holding parameter
// bytes from `first_byte` on (its whole part, or just its piece of the
// module). StateStore::PartOf says where it is.
struct PartBytes {
  const uint8_t* data = nullptr;
  int64_t first_byte = 0;
};

// Stage 3's partitioned parameters: a module's bytes gathered from every
// rank's part. A collective: every rank asks for the same modules in the
// same order (the fetcher's, which every rank follows alike).
class ParamGatherer {
 public:
  virtual ~ParamGatherer() = default;
  // Module m's bytes into dst[0, module(m).bytes()), each rank sending its
  // part from `mine`; `mine` and `dst` both in `where`.
  virtual Status GatherModule(int m, PartBytes mine, uint8_t* dst, Memory where) = 0;
  // The same, issued without waiting (a gather ahead): `done` is recorded
  // after it; `mine` and `dst` stay valid, `dst` unread, until
  // WaitGathered(done) returns, which reports a failed collective.
  virtual Status IssueGatherModule(int m, PartBytes mine, uint8_t* dst, Memory where,
                                   gpu::Event* done) = 0;
  virtual Status WaitGathered(gpu::Event& done) = 0;
};

// The ranks' exchange of small messages (checkpoints agree on a directory,
// report each rank's outcome): every rank's bytes in rank order, `mine` from
// this rank. A collective.
class RankExchange {
 public:
  virtual ~RankExchange() = default;
  virtual StatusOr<std::vector<std::string>> AllGatherBytes(const std::string& mine) = 0;
};

}  // namespace strata::scheduler
