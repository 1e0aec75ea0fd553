// src/scheduler/grad_store.h — the window's fp32 gradient sums on NVMe
// (TierPlan::grads_on_nvme): one shard per sub-group on the swap store, and a
// cache of a few sub-groups in DRAM, so that host memory does not grow with
// the parameter count.
//
// A sub-group's sums are in one of three places: nowhere (zero: no gradient
// reached it in this window), in a cache slot (being added into, or kept
// after being written out), or only in its NVMe shard. Update() brings a
// sub-group into a slot (read back from NVMe when it holds part of the
// window's sum — a later micro-batch of the window — else zero-filled) and
// adds into it; once backward is past a cached sub-group (the gradient
// worker says which module its adds come from and how far they reached:
// Progress), it is written out behind it (write-behind), once, so that a
// slot is free again by the time it is needed; the lowest sub-groups stay
// cached for the step. Bytes on NVMe are the fp32 sums bit for bit: the sums
// are those of an all-parameter accumulator whatever the cache does.
//
// The global checks (inf/nan, the sum of squares for clipping) need every
// sub-group's final sums before the step: each write-behind computes the
// sub-group's block sums (NormBlocks) from the slot, and an add after it
// invalidates them; GlobalChecks() computes the rest (cached sub-groups, and
// reads back any that were only written in an earlier micro-batch). The
// blocks and their order are GradOffloader's (NormBlocks), so the sum of
// squares has the same bits as with the accumulator in DRAM.
//
// The optimizer pipeline reads a sub-group's sums with its states (Source):
// from its slot, or from NVMe into the pipeline buffer, or zeros; once the
// step has used them (Consumed) the sub-group is zero for the next window.
//
// Threading: Update on the gradient worker's thread; Source, Peek and Consumed on
// the step's thread (a step reads sub-groups the next window has not reached:
// the engine's module readiness orders them); GlobalChecks and DropWindow on
// the main thread while neither runs. Every method holds one mutex for its
// whole run, I/O waits and adds included (the callers do not overlap in
// practice); a slot the step reads (Source) stays its own until Consumed.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "src/common/aligned_buffer.h"
#include "src/common/thread_annotations.h"
#include "src/nvme/nvme.h"
#include "src/scheduler/host_array.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/step_counters.h"
#include "strata/status.h"

namespace strata::scheduler {

class StateStore;

// Elements per partial sum of the global checks. Blocks start at every
// sub-group's first element and every kNormBlock elements after it; their
// sums are added in element order (the same bits for any thread count and
// wherever the sums are kept).
inline constexpr int64_t kNormBlock = kNormBlockElems;  // layout.h

// How many blocks sub-group sg has: ceil(elems / kNormBlock).
int64_t NormBlockCount(const SubGroup& sg);

// Block sums of squares of `n` fp32 sums (one sub-group, from its first
// element), each x in double, added one element at a time in element order,
// and whether each block holds an inf/nan. partial and bad have
// NormBlockCount entries.
void NormBlocks(const float* sums, int64_t n, double* partial, uint8_t* bad);

// The global checks from the blocks' results, in order: whether any block
// holds an inf/nan, and the sum of squares (added block by block: the same
// bits wherever the sums are kept).
void CombineBlocks(const std::vector<double>& partial, const std::vector<uint8_t>& bad,
                   bool* overflow, double* sumsq);

class GradStore {
 public:
  // `slots` sub-groups cached in DRAM (at least 2).
  GradStore(const Layout* layout, StateStore* store, StepCounters* counters, int64_t slots);
  ~GradStore();  // waits for writes in flight

  // Allocates the cache (4 KiB-aligned slots of the largest sub-group).
  Status Open();

  // ---- The window (the gradient worker's thread) ----
  // Where backward is, for the write-behind: the adds come from module
  // [module_begin, module_end) in element order and have reached
  // chunk_end. In the usual order (modules descending, each one's chunks
  // ascending) no later add of the micro-batch reaches an element at or
  // above module_end, nor one in [module_begin, chunk_end).
  struct Progress {
    int64_t module_begin = 0, chunk_end = 0, module_end = 0;
  };
  // add(sums) adds into sub-group g's sums (sums[i]: element elem_begin + i).
  // Then the cached sub-groups that `progress` says are complete for this
  // micro-batch are written out behind; without it, the previous sub-group
  // is, when the adds move to another. (Another order only costs a second
  // write of a sub-group added into again.)
  // Errors: reading back, or writing out the sub-group whose slot is reused.
  Status Update(size_t g, const std::function<Status(float* sums)>& add,
                const Progress* progress = nullptr) EXCLUDES(mu_);

  // ---- The end of the window (main thread; the worker idle, no step) ----
  // Inf/nan anywhere, and the sum of squares (the blocks of NormBlocks, in
  // sub-group then block order).
  Status GlobalChecks(bool* overflow, double* sumsq) EXCLUDES(mu_);
  // The blocks GlobalChecks adds over the sub-groups [first_group,
  // end_group) (data parallelism: a rank's partition): each block's sum of
  // squares and whether it holds an inf/nan, in order.
  Status BlockChecks(size_t first_group, size_t end_group, std::vector<double>* partial,
                     std::vector<uint8_t>* bad) EXCLUDES(mu_);

  // ---- The step (its thread) ----
  // The sums of piece pc of sub-group g (Layout::StatePieces) for the
  // optimizer: in its cached slot (no I/O), or read from NVMe into `buf`
  // (IoBytes(4 x pc.elems()), 4 KiB-aligned; wait on the returned handle),
  // or zeros written into buf. *sums is where the piece's first one is.
  nvme::IoHandle Source(size_t g, const StatePiece& pc, float* buf, const float** sums)
      EXCLUDES(mu_);
  // The same for a speculative step (strata.speculative_step), during the
  // window's last backward pass, of a sub-group no add of the window
  // reaches any more: a cached slot's piece is copied into `buf` (the slot
  // stays the cache's, for the other sub-groups' adds), else read from NVMe
  // into it, else zeros; *sums is buf. The sums stay the window's (a redo,
  // or the step after the checks, reads them again).
  nvme::IoHandle Peek(size_t g, const StatePiece& pc, float* buf, const float** sums) EXCLUDES(mu_);
  // The step has used g's sums: g is zero for the next window.
  void Consumed(size_t g) EXCLUDES(mu_);

  // ---- Main thread, nothing running ----
  // The window's sums dropped (every sub-group zero); writes in flight land
  // first. Returns nothing: a failed write only matters for sums now dropped.
  void DropWindow() EXCLUDES(mu_);

 private:
  // Where a sub-group's sums are.
  enum class Where { kZero, kCached, kNvme };
  struct Slot {
    std::unique_ptr<HostArray> buf;  // (a HostArray: counted with the plan's DRAM row)
    int group = -1;                  // the sub-group it holds, -1: free
    bool busy = false;               // read by the step (Source .. Consumed)
    nvme::IoHandle write;            // write-behind in flight (or landed, not waited)
    int64_t write_issue_ns = 0;
    uint64_t used = 0;  // LRU stamp
  };
  struct Record {
    Where where = Where::kZero;
    int slot = -1;
    bool dirty = false;  // the slot has adds the shard does not
    bool norm_valid = false;
    std::vector<double> partial;
    std::vector<uint8_t> bad;
  };
  // A free slot for sub-group g: an unused one, else the least recently used
  // one not read by the step whose sub-group is written out (or being
  // written), else the least recently used one, written out first.
  StatusOr<int> AcquireSlot(size_t g) REQUIRES(mu_);
  // Starts writing slot s's sub-group out (its norm record computed first).
  void WriteBehind(int s) REQUIRES(mu_);
  // Waits for slot s's write; an error is the write's.
  Status WaitWrite(int s) REQUIRES(mu_);
  void ComputeNorm(size_t g, const float* sums) REQUIRES(mu_);
  // Sub-group g's norm record made valid (from its slot, or read back).
  Status EnsureNorm(size_t g, AlignedBuffer* tmp) REQUIRES(mu_);
  int64_t io_bytes(size_t g) const;

  const Layout* layout_;
  StateStore* store_;
  StepCounters* counters_;
  const int64_t num_slots_;
  mutable Mutex mu_;
  std::vector<Slot> slots_ GUARDED_BY(mu_);
  std::vector<Record> records_ GUARDED_BY(mu_);
  int last_group_ GUARDED_BY(mu_) = -1;  // the sub-group Update last added into
  uint64_t clock_ GUARDED_BY(mu_) = 0;
};

}  // namespace strata::scheduler
