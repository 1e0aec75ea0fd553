// src/scheduler/step_progress.h — what the parameter fetcher and the
// optimizer back-end need of each other, without either knowing the other's
// class: the fetcher asks about an optimizer step in flight (StepProgress,
// told by the back-end, optimizer_backend.h); a back-end whose step rewrites
// the parameters in place drops the fetcher's device copies (DeviceCopies,
// implemented by ParamFetcher).
//
// Threading: the engine's (main) thread only.
#pragma once

#include "src/gpu/device.h"
#include "strata/status.h"

namespace strata::scheduler {

// What the parameter fetcher needs to know of an optimizer step in flight.
class StepProgress {
 public:
  virtual ~StepProgress() = default;
  // A step is running whose new parameters the next fetches must read.
  virtual bool reading_next_params() const = 0;
  // That step has finished module m (its new parameters are final).
  virtual bool module_ready(int m) const = 0;
  // Makes module m's parameters those of the step in flight, if one produces
  // them: waits until the step has finished the module (a step that failed
  // first is joined and rolled back, and its error returned), and with
  // offload_param none uploads them into the module's part of the device
  // block. Time spent waiting for the step counts as optimizer wait.
  virtual Status AwaitModule(int m) = 0;
  // offload_param nvme: module m's new bytes as the step wrote them to NVMe,
  // in the write-back buffer they were written from (laid out like a read of
  // the module), handed over to the caller, who returns it to its pool by
  // dropping it once its copy has read it; empty when the step no longer
  // holds them (the caller reads the new version from NVMe). REQUIRES:
  // module_ready(m).
  virtual gpu::PinnedBuffer TakeUpdatedModule(int m) { return {}; }
};

// The device copies of the parameters the fetcher holds.
class DeviceCopies {
 public:
  virtual ~DeviceCopies() = default;
  // The parameters changed: every device copy is dropped once the work that
  // uses it is done.
  virtual Status InvalidateAll() = 0;
};

}  // namespace strata::scheduler
