// src/scheduler/layout.h — what never changes after Plan(): where every
// parameter's elements and bytes live, the modules' extents and the
// optimizer's sub-groups. Pure data and slicing helpers; no device, no I/O.
//
// Parameters are laid out in one flat element space ordered by (module,
// registration order), each tensor starting on a multiple of kElemAlign
// elements, so a module's parameters are contiguous but for that padding and
// sub-groups (sub_group_size elements) cut that space into shards. Every
// per-element state (gradient accumulator, fp32 master, moments) is a flat
// array over that space; the fp16/bf16/fp32 parameter copies are a flat byte
// space in which each tensor starts on kTensorAlign and each module on
// kIoAlign.
//
// Padding elements (between a tensor's end and the next tensor's aligned
// start) belong to no parameter: Slices and ByteSlices skip them, so no
// gradient, optimizer step or copy-out touches them. The arrays' owners
// zero them when they create the arrays, and so they stay zero: sums over a
// whole array (norms, finiteness checks) are unchanged by them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "src/common/dtype.h"
#include "src/cpu_adam/cpu_adam.h"

namespace strata::scheduler {

// Bytes per element of the fp32 per-element states.
inline constexpr int64_t kGradAccBytesPerElem = 4;  // fp32 gradient accumulator
inline constexpr int64_t kMasterBytesPerElem = 4;   // fp32 master parameter
// fp32 master + exp_avg + exp_avg_sq: one sub-group's NVMe shard holds them
// one after the other (master | m | v).
inline constexpr int64_t kOptimizerStateBytesPerElem = 12;
inline constexpr int kOptimizerStateArrays = 3;

// Where `elems` elements' optimizer states lie in one buffer or NVMe shard
// in format f (strata.optimizer_states), one array after the other:
// master | exp_avg | exp_avg_sq | int8's exp_avg scales | exp_avg_sq
// scales. For fp32: master | m | v at 0, 4n, 8n (12n bytes in all).
struct GroupStateLayout {
  int64_t master = 0, exp_avg = 0, exp_avg_sq = 0, exp_avg_scale = 0, exp_avg_sq_scale = 0;
  int64_t bytes = 0;  // the whole
};
GroupStateLayout GroupStatesIn(cpu_adam::StateFormat f, int64_t elems);
// GroupStatesIn(f, elems).bytes.
int64_t StateArrayBytes(cpu_adam::StateFormat f, int64_t elems);

// Every NVMe request is a multiple of this in offset, length and buffer
// address, so the I/O engine never sends a piece through the page cache: a
// buffered read-modify-write of a partial page racing an O_DIRECT write of
// the rest of that page can write stale bytes back.
inline constexpr int64_t kIoAlign = 4096;
// Each parameter tensor starts on this boundary in the parameter-byte space
// (the device's allocation alignment, so a module's tensors are aligned on
// the device too).
inline constexpr int64_t kTensorAlign = 256;
// Each parameter tensor starts on a multiple of this many elements in the
// flat element space: 16 bytes of fp32, so that every fp32 state array of a
// tensor (master, moments, gradient accumulator) is 16-byte aligned wherever
// the array itself is (the device's arrays are 256-byte aligned). The device
// Adam's vector path needs all of a tensor's arrays 16-byte aligned; dense
// offsets put every tensor after one whose size is not a multiple of 4 on
// the scalar path.
inline constexpr int64_t kElemAlign = 4;

// Elements per partial sum of the global checks (grad_store.h, kNormBlock).
inline constexpr int64_t kNormBlockElems = int64_t{1} << 16;
// Data parallelism: a rank's partition of at least this many elements is a
// multiple of kNormBlockElems, so that the global checks' blocks are those of
// one rank (the sum of squares then has one rank's bits when the sub-groups
// start on that grid too: sub_group_size a multiple of it, or above the
// partition). Smaller partitions are multiples of kElemAlign (padding 64K
// elements per rank would outweigh them).
inline constexpr int64_t kBlockAlignedPartition = 16 * kNormBlockElems;

// n rounded up to kIoAlign.
int64_t IoBytes(int64_t n);

// One optimizer pipeline buffer (offload_optimizer nvme): one piece of a
// sub-group (StatePiece: the whole sub-group unless the pinned budget cuts
// it), its states (GroupStatesIn of format f), then with gradients on NVMe
// its fp32 gradient sums, each part page-rounded.
inline int64_t OptimizerBufferBytes(int64_t max_piece_elems, bool with_grads,
                                    cpu_adam::StateFormat f = cpu_adam::StateFormat::kFp32) {
  return IoBytes(StateArrayBytes(f, max_piece_elems)) +
         (with_grads ? IoBytes(kGradAccBytesPerElem * max_piece_elems) : 0);
}
// Pieces of a sub-group (Layout::set_state_piece_elems) are multiples of
// this many elements: of every format's quantization block (int8's
// kStateBlock), and page-aligned in a sub-group's fp32 gradient shard.
inline constexpr int64_t kStatePieceQuantum = int64_t{1} << 16;
// One sub-group's fp32 gradient sums, page-rounded (a gradient cache slot).
inline int64_t GradSlotBytes(int64_t max_group_elems) {
  return IoBytes(kGradAccBytesPerElem * std::max<int64_t>(1, max_group_elems));
}

struct ParamRec {
  std::string name;
  int64_t numel = 0;
  DType dtype = DType::kBf16;
  int module = 0;
  int group = 0;         // optimizer parameter group (ParamSpec::group)
  int64_t elem_off = 0;  // in the flat element space
  int64_t byte_off = 0;  // in the flat parameter-byte space
  // ParamSpec::shape (empty: [numel]) and ParamSpec::aliases.
  std::vector<int64_t> shape = {};
  std::vector<std::string> aliases = {};
  int64_t elem_size() const { return static_cast<int64_t>(DTypeSize(dtype)); }
};

struct ModuleExtent {
  std::vector<int> params;  // parameter ids, registration order
  int64_t elem_begin = 0, elem_end = 0;
  int64_t byte_begin = 0, byte_end = 0;
  bool registered = false;  // at least one parameter
  bool persistent = false;  // stays on the device (offload_param none, or small)
  int last_group = -1;      // the sub-group holding its last element (-1: none)
  int64_t elems() const { return elem_end - elem_begin; }
  int64_t bytes() const { return byte_end - byte_begin; }
};

struct SubGroup {
  int64_t elem_begin = 0, elem_end = 0;
  int64_t elems() const { return elem_end - elem_begin; }
  // Bytes of its states in the layout's format (GroupStatesIn); -1: fp32.
  int64_t state_bytes = -1;
  // Bytes of its NVMe state shard: its pieces' GroupStatesIn arrays, each
  // page-rounded (Layout::StatePieces); -1: one piece.
  int64_t shard_bytes = -1;
  int64_t state_io_bytes() const {
    if (shard_bytes >= 0) return shard_bytes;
    return IoBytes(state_bytes >= 0 ? state_bytes : kOptimizerStateBytesPerElem * elems());
  }
};

// One piece of a sub-group's NVMe state shard: the optimizer pipeline
// streams a sub-group a piece at a time through buffers the pinned budget
// holds. A shard holds its pieces one after the other, each in
// GroupStatesIn's arrangement for its own elements and page-rounded, so
// that a piece is one aligned read and one aligned write; with one piece
// the shard is the whole sub-group's GroupStatesIn. Adam is elementwise and
// the pieces start on quantization blocks, so the bits do not depend on
// the cut.
struct StatePiece {
  int64_t elem_begin = 0, elem_end = 0;  // flat elements
  int64_t shard_offset = 0;              // of its first byte in the shard
  int64_t io_bytes = 0;                  // IoBytes of its states
  int64_t elems() const { return elem_end - elem_begin; }
};

struct LayoutOptions {
  int64_t sub_group_size = 1'000'000'000;    // elements per sub-group (< 1: 1)
  bool params_offloaded = false;             // offload_param cpu or nvme
  int64_t persistence_threshold = 0;         // modules below this many elements stay resident
  int64_t reduce_bucket_size = 500'000'000;  // elements; sizes a gradient staging chunk
  // Data-parallel ranks. With more than one, the element space is padded to
  // world_size equal partitions (partition_elems() each, a multiple of
  // kElemAlign) and sub-groups are cut inside each partition, so that rank r
  // owns whole sub-groups (OwnedGroups): its optimizer states, its share of
  // the reduced gradients and of the updated parameters.
  int world_size = 1;
  // Each tensor, partition and sub-group starts on a multiple of this many
  // elements (a power of two, at least kElemAlign): kStateBlock with int8
  // optimizer states, whose quantization blocks are aligned to the element
  // index, so that no block spans two tensors, sub-groups or ranks.
  int64_t elem_align = kElemAlign;
  // The optimizer states' format: what a sub-group's states take
  // (SubGroup::state_bytes).
  cpu_adam::StateFormat state_format = cpu_adam::StateFormat::kFp32;
};

class Layout {
 public:
  Layout() = default;
  // `params` carry name, numel, dtype and module; offsets are assigned here.
  static Layout Build(std::vector<ParamRec> params, const LayoutOptions& options);

  const std::vector<ParamRec>& params() const { return params_; }
  const ParamRec& param(int id) const { return params_[static_cast<size_t>(id)]; }
  const std::vector<ModuleExtent>& modules() const { return modules_; }
  const ModuleExtent& module(int m) const { return modules_[static_cast<size_t>(m)]; }
  int num_modules() const { return static_cast<int>(modules_.size()); }
  const std::vector<SubGroup>& groups() const { return groups_; }
  const SubGroup& group(size_t g) const { return groups_[g]; }
  size_t num_groups() const { return groups_.size(); }
  // The sub-group holding element `elem` (REQUIRES: 0 <= elem < total_elems()).
  size_t GroupOf(int64_t elem) const {
    if (world_size_ == 1)
      return static_cast<size_t>(elem / std::max<int64_t>(1, groups_.front().elems()));
    const int64_t r = elem / partition_elems_;
    return static_cast<size_t>(r * groups_per_rank_ +
                               (elem - r * partition_elems_) / groups_.front().elems());
  }

  // Data parallelism (LayoutOptions::world_size). One rank: one partition,
  // the whole element space and every sub-group.
  int world_size() const { return world_size_; }
  int64_t partition_elems() const { return partition_elems_; }
  // Rank r's elements [r * partition_elems(), (r + 1) * partition_elems()),
  // its sub-groups [first, second), and the parameter bytes of its elements
  // [first, second): the byte ranges of the ranks tile the parameter-byte
  // space (alignment padding goes with the element after it).
  std::pair<int64_t, int64_t> OwnedElems(int rank) const {
    return {rank * partition_elems_, (rank + 1) * partition_elems_};
  }
  std::pair<size_t, size_t> OwnedGroups(int rank) const {
    return {static_cast<size_t>(rank * groups_per_rank_),
            static_cast<size_t>((rank + 1) * groups_per_rank_)};
  }
  std::pair<int64_t, int64_t> OwnedBytes(int rank) const {
    return {ByteOfElem(rank * partition_elems_), ByteOfElem((rank + 1) * partition_elems_)};
  }
  // The largest rank's parameter bytes (OwnedBytes), at least 1.
  int64_t MaxOwnedBytes() const {
    int64_t largest = 1;
    for (int r = 0; r < world_size_; ++r) {
      const auto [b0, b1] = OwnedBytes(r);
      largest = std::max(largest, b1 - b0);
    }
    return largest;
  }
  // The parameter-byte offset of element e: of e itself in a tensor, else of
  // the next tensor's first byte (total_param_bytes() after the last).
  int64_t ByteOfElem(int64_t e) const;

  // The element space of the same parameters on one rank, and its sub-group
  // count: what a checkpoint records, whatever the number of ranks that
  // wrote it (the parameters' offsets do not depend on it; only the tail
  // padding and the cuts of the sub-groups do).
  int64_t unpartitioned_elems() const { return modules_.empty() ? 0 : modules_.back().elem_end; }
  int64_t unpartitioned_groups() const {
    return (unpartitioned_elems() + sub_group_size_ - 1) / sub_group_size_;
  }
  int64_t sub_group_size() const { return sub_group_size_; }
  int64_t elem_align() const { return elem_align_; }  // LayoutOptions::elem_align
  cpu_adam::StateFormat state_format() const { return state_format_; }
  // The largest sub-group's states in the format.
  // The elements of a sub-group's NVMe shard that one optimizer pipeline
  // buffer holds (TierPlan::state_piece_elems, a multiple of
  // kStatePieceQuantum; 0: whole sub-groups). Set once, by the plan, before
  // any shard is allocated; it recomputes every SubGroup::shard_bytes.
  void set_state_piece_elems(int64_t elems);
  int64_t state_piece_elems() const { return state_piece_elems_; }
  // The largest piece (the largest sub-group with whole sub-groups).
  int64_t max_piece_elems() const {
    return state_piece_elems_ > 0 ? std::min(state_piece_elems_, max_group_elems_)
                                  : max_group_elems_;
  }
  // Sub-group g's pieces, in element order (one: the whole sub-group).
  std::vector<StatePiece> StatePieces(size_t g) const;

  // The element space's extent: the length of every per-element state array
  // (parameters plus alignment padding).
  int64_t total_elems() const { return total_elems_; }
  // The parameters' elements (Σ numel): total_elems() less the padding.
  int64_t param_elems() const { return param_elems_; }
  int64_t total_param_bytes() const { return total_param_bytes_; }  // page-rounded
  int64_t max_module_bytes() const { return max_module_bytes_; }
  int64_t max_group_elems() const { return max_group_elems_; }
  int64_t persistent_param_bytes() const;
  // Bytes of one gradient staging chunk: a module at most, 2 x
  // reduce_bucket_size at most (rounded down to a multiple of 4, so that no
  // chunk splits an fp32 element), 4 KiB at least.
  int64_t grad_staging_bytes() const { return grad_staging_bytes_; }

  // One piece of a parameter inside an element range.
  struct Slice {
    int param = 0;
    int64_t elem_begin = 0, elem_end = 0;  // flat elements
    int64_t byte_offset = 0;               // of elem_begin in the parameter-byte space
  };
  // The parameter pieces of [elem_begin, elem_end), in element order.
  std::vector<Slice> Slices(int64_t elem_begin, int64_t elem_end) const;
  // The parameter pieces of the byte range [byte_begin, byte_end) of module m
  // (a gradient chunk), in element order; alignment padding is skipped.
  std::vector<Slice> ByteSlices(int m, int64_t byte_begin, int64_t byte_end) const;
  // Modules (with elements) whose last element lies in [elem_begin, elem_end):
  // once the sub-groups up to elem_end are stepped, they are complete.
  std::vector<int> ModulesEndingIn(int64_t elem_begin, int64_t elem_end) const;

 private:
  std::vector<ParamRec> params_;
  std::vector<int> elem_order_;  // parameter ids by elem_off
  std::vector<ModuleExtent> modules_;
  std::vector<SubGroup> groups_;
  int64_t total_elems_ = 0;
  int64_t param_elems_ = 0;
  int64_t total_param_bytes_ = 0;
  int64_t max_module_bytes_ = 0;
  int64_t max_group_elems_ = 0;
  int64_t grad_staging_bytes_ = 0;
  int world_size_ = 1;
  int64_t sub_group_size_ = 1;
  int64_t elem_align_ = kElemAlign;
  cpu_adam::StateFormat state_format_ = cpu_adam::StateFormat::kFp32;
  int64_t state_piece_elems_ = 0;
  int64_t partition_elems_ = 0;
  int64_t groups_per_rank_ = 0;
};

}  // namespace strata::scheduler
