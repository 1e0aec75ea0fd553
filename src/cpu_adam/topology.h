// Internal to src/cpu_adam: a loaded hwloc topology (RAII) and thread
// pinning. Keeps <hwloc.h> out of cpu_adam.h.
#pragma once

#include <memory>

#include "strata/status.h"

namespace strata::cpu_adam::internal {

class Topology {
 public:
  static StatusOr<std::shared_ptr<Topology>> Load();
  ~Topology();
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;

  int NumaNodeCount() const;
  // PUs of NUMA node `node` (logical index), or of the machine for -1.
  // OutOfRange for a node that does not exist.
  StatusOr<int> PuCount(int node) const;
  // Binds the calling thread to the PUs of `node` (-1: the whole machine).
  // Thread-safe.
  Status BindThisThread(int node) const;
  // The calling thread's current binding, restorable with RestoreBinding.
  struct Binding;
  std::unique_ptr<Binding, void (*)(Binding*)> SaveBinding() const;
  void RestoreBinding(const Binding& b) const;

  void* raw() const { return topo_; }  // hwloc_topology_t

 private:
  Topology() = default;
  void* topo_ = nullptr;
};

}  // namespace strata::cpu_adam::internal
