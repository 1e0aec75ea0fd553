// hwloc: topology summary for `strata info`, NUMA placement of buffers and
// thread pinning for the optimizer's workers.
#include "src/cpu_adam/topology.h"

#include <hwloc.h>

#include <algorithm>
#include <cerrno>
#include <string>

#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/cpu_adam/cpu_adam.h"

namespace strata::cpu_adam {
namespace internal {

namespace {
hwloc_topology_t T(void* p) { return static_cast<hwloc_topology_t>(p); }
}  // namespace

StatusOr<std::shared_ptr<Topology>> Topology::Load() {
  std::shared_ptr<Topology> t(new Topology());
  hwloc_topology_t topo = nullptr;
  if (hwloc_topology_init(&topo) != 0) return ErrnoError("cpu_adam: hwloc_topology_init", errno);
  t->topo_ = topo;  // destroyed by ~Topology from here on
  if (hwloc_topology_load(topo) != 0) return ErrnoError("cpu_adam: hwloc_topology_load", errno);
  return t;
}

Topology::~Topology() {
  if (topo_ != nullptr) hwloc_topology_destroy(T(topo_));
}

int Topology::NumaNodeCount() const {
  const int n = hwloc_get_nbobjs_by_type(T(topo_), HWLOC_OBJ_NUMANODE);
  return n > 0 ? n : 1;
}

StatusOr<int> Topology::PuCount(int node) const {
  hwloc_const_cpuset_t set = nullptr;
  if (node < 0) {
    set = hwloc_topology_get_topology_cpuset(T(topo_));
  } else {
    hwloc_obj_t obj =
        hwloc_get_obj_by_type(T(topo_), HWLOC_OBJ_NUMANODE, static_cast<unsigned>(node));
    if (obj == nullptr) {
      return OutOfRangeError("cpu_adam: NUMA node " + std::to_string(node) +
                             " does not exist (this machine has " +
                             std::to_string(NumaNodeCount()) + ")");
    }
    set = obj->cpuset;
  }
  const int n = hwloc_bitmap_weight(set);
  return n > 0 ? n : 1;
}

Status Topology::BindThisThread(int node) const {
  hwloc_const_cpuset_t set = hwloc_topology_get_topology_cpuset(T(topo_));
  if (node >= 0) {
    hwloc_obj_t obj =
        hwloc_get_obj_by_type(T(topo_), HWLOC_OBJ_NUMANODE, static_cast<unsigned>(node));
    if (obj == nullptr)
      return OutOfRangeError("cpu_adam: NUMA node " + std::to_string(node) + " does not exist");
    set = obj->cpuset;
  }
  if (hwloc_set_cpubind(T(topo_), set, HWLOC_CPUBIND_THREAD) != 0) {
    return ErrnoError("cpu_adam: hwloc_set_cpubind to NUMA node " + std::to_string(node), errno);
  }
  return Status::Ok();
}

struct Topology::Binding {
  hwloc_bitmap_t set = nullptr;
  bool valid = false;
};

std::unique_ptr<Topology::Binding, void (*)(Topology::Binding*)> Topology::SaveBinding() const {
  auto* b = new Binding;
  b->set = hwloc_bitmap_alloc();
  b->valid = b->set != nullptr && hwloc_get_cpubind(T(topo_), b->set, HWLOC_CPUBIND_THREAD) == 0;
  return {b, [](Binding* x) {
            if (x->set) hwloc_bitmap_free(x->set);
            delete x;
          }};
}

void Topology::RestoreBinding(const Binding& b) const {
  if (b.valid) hwloc_set_cpubind(T(topo_), b.set, HWLOC_CPUBIND_THREAD);
}

}  // namespace internal

StatusOr<CpuTopology> DescribeTopology() {
  ASSIGN_OR_RETURN(auto topo, internal::Topology::Load());
  hwloc_topology_t t = static_cast<hwloc_topology_t>(topo->raw());
  CpuTopology out;
  out.packages = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PACKAGE);
  out.cores = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE);
  out.pus = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PU);
  const int nodes = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < nodes; ++i) {
    hwloc_obj_t node = hwloc_get_obj_by_type(t, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(i));
    NumaNodeInfo info;
    info.logical_index = static_cast<int>(node->logical_index);
    info.os_index = static_cast<int>(node->os_index);
    info.memory_bytes = node->attr ? node->attr->numanode.local_memory : 0;
    info.cores = hwloc_get_nbobjs_inside_cpuset_by_type(t, node->cpuset, HWLOC_OBJ_CORE);
    unsigned pu;
    hwloc_bitmap_foreach_begin(pu, node->cpuset) { info.pus.push_back(static_cast<int>(pu)); }
    hwloc_bitmap_foreach_end();
    out.numa_nodes.push_back(std::move(info));
  }
  return out;
}

RankCpuShare ShareOfLocalRank(const CpuTopology& topology, int local_rank, int local_world,
                              int gpu_os_node) {
  RankCpuShare share;
  const int nodes = static_cast<int>(topology.numa_nodes.size());
  local_world = std::max(1, local_world);
  const NumaNodeInfo* node = nullptr;
  if (nodes > 1) {
    for (const NumaNodeInfo& n : topology.numa_nodes)
      if (gpu_os_node >= 0 && n.os_index == gpu_os_node) node = &n;
    if (node != nullptr) {
      share.why = "the node nearest its GPU";
    } else {
      node = &topology.numa_nodes[static_cast<size_t>(std::max(0, local_rank) % nodes)];
      share.why = "local rank " + std::to_string(local_rank) + " modulo " + std::to_string(nodes) +
                  " nodes";
    }
  } else {
    share.why = "one NUMA node: not pinned";
  }
  // The local ranks on the chosen node (or the machine), spread evenly.
  const int sharing = nodes > 1 ? (local_world + nodes - 1) / nodes : local_world;
  const int pus = node != nullptr ? static_cast<int>(node->pus.size()) : topology.pus;
  share.threads = std::max(1, pus / std::max(1, sharing));
  if (node != nullptr) {
    share.numa_node = node->logical_index;
    share.numa_os_node = node->os_index;
  }
  return share;
}

StatusOr<int> NumaNodeOf(const void* p, size_t bytes) {
  if (p == nullptr || bytes == 0)
    return InvalidArgumentError("cpu_adam: NumaNodeOf needs a non-empty range");
  ASSIGN_OR_RETURN(auto topo, internal::Topology::Load());
  hwloc_topology_t t = static_cast<hwloc_topology_t>(topo->raw());
  hwloc_nodeset_t set = hwloc_bitmap_alloc();
  if (set == nullptr) return ResourceExhaustedError("cpu_adam: hwloc_bitmap_alloc failed");
  const int rc = hwloc_get_area_memlocation(t, p, bytes, set, HWLOC_MEMBIND_BYNODESET);
  const int err = errno;
  int result = -1;
  if (rc == 0 && !hwloc_bitmap_iszero(set)) {
    const int os = hwloc_bitmap_first(set);
    hwloc_obj_t node = hwloc_get_numanode_obj_by_os_index(t, static_cast<unsigned>(os));
    if (node != nullptr) result = static_cast<int>(node->logical_index);
  }
  hwloc_bitmap_free(set);
  if (rc != 0) {
    if (err == ENOSYS)
      return NotSupportedError("cpu_adam: hwloc cannot query memory location on this system");
    return ErrnoError("cpu_adam: hwloc_get_area_memlocation", err);
  }
  return result;
}

}  // namespace strata::cpu_adam
