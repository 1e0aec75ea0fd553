// src/scheduler/device_sums.h — the window's fp32 gradient sums kept in HBM
// until the CPU step reads them (TierPlan::grads_in_hbm, strata.grad_tier
// hbm), so that host memory holds no array over every parameter for them.
//
// Every micro-batch's gradients are added into one fp32 array in HBM on the
// compute stream (HostOptimizer: Device::AddToFp32, in the order the host
// path adds them, so the sums are the same bits). Nothing crosses PCIe during
// the window. At its end:
//   * the global checks copy the sums to the host a chunk at a time (two
//     pinned buffers: one copied into while the other is checked) and take
//     each chunk's blocks with NormBlocks; chunks are whole norm blocks from
//     each sub-group's first element, so the sum of squares has the bits of
//     the sums in DRAM;
//   * the step (OptimizerStep) streams each sub-group's sums the same way
//     and steps each chunk from its buffer; after a sub-group's last chunk
//     its part of the array is zeroed (landed before the sub-group is
//     published: the next window's adds into its modules come after their
//     fetches, which wait for it).
// The copies run on a stream of their own; Begin() orders it after the
// compute stream's work so far (the window's adds, a zeroing).
//
// Threading: Begin, BlockChecks and GlobalChecks on the main thread; Stream on
// the step's thread while the main thread does none of those. The array is
// zeroed whole by the owner (on the compute stream) when a window is
// dropped.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "src/gpu/device.h"
#include "src/scheduler/host_array.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/step_counters.h"
#include "strata/status.h"

namespace strata::scheduler {

class DeviceSums {
 public:
  // `chunk_elems`: a multiple of kNormBlockElems (TierPlan::grad_chunk_elems);
  // `pin`: the host buffers page-locked (else pageable, the copies then
  // synchronous).
  DeviceSums(gpu::Device* device, const Layout* layout, StepCounters* counters, int64_t chunk_elems,
             bool pin);
  ~DeviceSums();  // waits for its stream

  // The array (zeroed), its stream and events, and the host buffers. Adds
  // the page-locked bytes to *pinned_bytes.
  Status Open(int64_t* pinned_bytes);
  // The sums, in the flat element space (device memory).
  float* data() const { return sums_.as<float>(); }

  // Main thread: the copies that follow come after the compute stream's
  // work enqueued so far.
  Status Begin();

  // The blocks of the global checks over the sub-groups [g0, g1) (grad_store.h,
  // NormBlocks): each block's sum of squares and whether it holds an inf/nan,
  // in order. Begin() first.
  Status BlockChecks(size_t g0, size_t g1, std::vector<double>* partial, std::vector<uint8_t>* bad);
  // Inf/nan anywhere, and the sum of squares (the blocks added in order).
  Status GlobalChecks(bool* overflow, double* sumsq);

  // The step: sub-groups [g0, g1) in order, each in chunks [lo, hi) (whole
  // norm blocks from the sub-group's first element): step(g, lo, hi, sums)
  // with sums[i] the element lo + i, the next chunk being copied meanwhile;
  // after g's last chunk its part of the array is zeroed and the zeroing
  // has landed, then done(g). Stops at the first error (of step, or of a
  // copy or zeroing).
  using ChunkFn = std::function<Status(size_t g, int64_t lo, int64_t hi, const float* sums)>;
  Status Stream(size_t g0, size_t g1, const ChunkFn& step, const std::function<void(size_t)>& done);

 private:
  struct Chunk {
    size_t g = 0;
    int64_t lo = 0, hi = 0;
    bool last = false;  // g's last chunk
  };
  std::vector<Chunk> ChunksOf(size_t g0, size_t g1) const;
  // Enqueues chunk c's copy into buffer b and records its event.
  Status Issue(const Chunk& c, int b);

  gpu::Device* dev_;
  const Layout* layout_;
  StepCounters* counters_;
  const int64_t chunk_elems_;
  const bool pin_;
  gpu::DeviceBuffer sums_;
  std::unique_ptr<gpu::Stream> stream_;
  std::unique_ptr<gpu::Event> compute_done_, zeroed_;
  std::unique_ptr<gpu::Event> copied_[2];
  HostArray buf_[2];
};

}  // namespace strata::scheduler
