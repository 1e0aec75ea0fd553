// src/scheduler/grad_offloader.h — gradients from the device into the fp32
// accumulator in DRAM.
//
// Offload(m) enqueues module m's gradients, in chunks of the layout's
// grad_staging_bytes, as D2H copies into pinned staging buffers on the D2H
// stream (after the compute stream's `computed` event); a worker thread waits
// for each chunk's copy and adds it to the accumulator (fp16/bf16/fp32 →
// fp32) while the next chunks are still being copied. The adds run through
// the CPU optimizer's vectorized kernels on its pinned worker threads
// (CpuOptimizer::AccumulateMany: one add per element, so the same bits as a
// plain loop for any thread count), chunks in the order they were enqueued,
// so the sums are the same bits for every placement. Drain() waits for every chunk and returns the
// first error. The accumulator is also where the global inf/nan check and
// the gradient norm read from (GlobalChecks).
//
// With delayed_param_update there are two accumulators: the step started at
// the end of a window consumes one (SwapForStep) while the next window
// accumulates into the other.
//
// Threading: every method is for the engine's (main) thread; the worker is
// internal. The accumulator pointers handed out are read and zeroed by the
// optimizer thread only while a step consumes them.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>

#include "src/common/thread_annotations.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/gpu/device.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/state_store.h"
#include "src/scheduler/step_stats.h"

namespace strata::scheduler {

class GradOffloader {
 public:
  GradOffloader(gpu::Device* device, const Layout* layout, cpu_adam::CpuOptimizer* adam,
                StepCounters* counters);
  ~GradOffloader();  // drains the queue and stops the worker

  // Allocates the accumulator(s) (zeroed; none when !host_accumulator: the
  // gradients stay on the device) and the staging pool, and starts the
  // worker. ResourceExhausted when the thread cannot be created. Adds the
  // pool's bytes to *pinned_bytes.
  Status Start(bool second_accumulator, int64_t* pinned_bytes, bool host_accumulator = true);
  gpu::PinnedPool* staging_pool() { return pool_.get(); }

  // Enqueues the D2H copies of module m's gradients (device_grad: the
  // module's gradient buffer, laid out like its parameters) after `computed`
  // and hands each chunk to the worker. The buffer may be freed once the D2H
  // stream has passed this point.
  Status Offload(int m, const void* device_grad, gpu::Event& computed) EXCLUDES(mu_);
  // Waits until every chunk has been accumulated; returns (and forgets) the
  // first error since the last Drain.
  Status Drain() EXCLUDES(mu_);

  // The accumulator of the current window.
  float* accumulator() { return acc_.as<float>(); }
  // delayed_param_update: the current accumulator becomes the step's, and the
  // other one (zeroed by the previous step as it consumed it) the current.
  float* SwapForStep();
  // Zeroes the current accumulator / both (REQUIRES: drained).
  void Zero();
  void ZeroAll();
  // Inf/nan anywhere in the current accumulator, and its sum of squares, in
  // fixed blocks added in order (the same bits for any thread count).
  void GlobalChecks(bool* overflow, double* sumsq) const;

 private:
  // One D2H'd chunk of gradients waiting to be accumulated.
  struct Job {
    gpu::PinnedBuffer staging;
    std::unique_ptr<gpu::Event> done;
    int module = 0;
    int64_t byte_begin = 0, byte_end = 0;  // in the flat parameter-byte space
  };
  void Worker() EXCLUDES(mu_);
  // acc += the staged chunk (module m's bytes [byte_begin, byte_end)).
  Status Accumulate(const Job& job);

  gpu::Device* dev_;
  const Layout* layout_;
  cpu_adam::CpuOptimizer* adam_;
  StepCounters* counters_;
  HostArray acc_, alt_;
  std::unique_ptr<gpu::PinnedPool> pool_;
  std::thread worker_;

  Mutex mu_;
  CondVar cv_;
  std::deque<Job> queue_ GUARDED_BY(mu_);
  int64_t pending_ GUARDED_BY(mu_) = 0;  // queued + running
  bool stop_ GUARDED_BY(mu_) = false;
  Status error_ GUARDED_BY(mu_);
};

}  // namespace strata::scheduler
