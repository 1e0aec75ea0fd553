// Shared by the scheduler component tests: a host device, hand-made layouts
// with mixed dtypes, initial values and a StateStore opened by a config.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "src/common/dtype.h"
#include "src/gpu/device.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/plan.h"
#include "src/scheduler/state_store.h"
#include "src/scheduler/step_counters.h"
#include "tests/status_matchers.h"
#include "tests/test_util.h"

namespace strata::scheduler::testing {

inline std::unique_ptr<gpu::Device> MakeHostDevice(size_t hbm_budget) {
  gpu::DeviceOptions o;
  o.kind = DeviceKind::kHost;
  o.hbm_budget_bytes = hbm_budget;
  auto d = gpu::CreateDevice(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? std::move(d).value() : nullptr;
}

inline ParamRec Rec(std::string name, int64_t numel, DType dtype, int module) {
  ParamRec p;
  p.name = std::move(name);
  p.numel = numel;
  p.dtype = dtype;
  p.module = module;
  return p;
}

// Values stored as dtype t (round to nearest even), as bytes.
inline std::vector<uint8_t> ToBytes(std::span<const float> v, DType t) {
  std::vector<uint8_t> out(v.size() * DTypeSize(t));
  for (size_t i = 0; i < v.size(); ++i) StoreFromFloat(out.data(), t, i, v[i]);
  return out;
}

// Random initial values for every parameter of `layout`.
inline std::vector<std::vector<float>> RandomInit(const Layout& layout, std::mt19937_64& rng) {
  std::vector<std::vector<float>> init;
  for (const ParamRec& p : layout.params())
    init.push_back(::strata::testing::RandomFloats(rng, static_cast<size_t>(p.numel), -0.5f, 0.5f));
  return init;
}

// A config for a StateStore: stage 3, the given placements, NVMe directories
// in `dir`, the host device.
inline Config StoreConfig(OffloadDevice opt, OffloadDevice par, const std::string& dir,
                          int64_t buffer_count = 4) {
  Config c;
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_optimizer.device = opt;
  c.zero_optimization.offload_param.device = par;
  c.zero_optimization.offload_optimizer.buffer_count = buffer_count;
  if (opt == OffloadDevice::kNvme) c.zero_optimization.offload_optimizer.nvme_path = {dir};
  if (par == OffloadDevice::kNvme) c.zero_optimization.offload_param.nvme_path = {dir};
  c.strata.device = DeviceKind::kHost;
  c.strata.threads = 2;
  return c;
}

// Opens and initializes a StateStore for `config` over `layout` (NVMe
// capacity as the planner computes it).
inline Status OpenStore(
    StateStore& store, const Config& config, const Layout& layout,
    const std::vector<std::vector<float>>& init,
    const std::function<std::unique_ptr<nvme::IoEngine>(std::unique_ptr<nvme::IoEngine>)>& wrap =
        {}) {
  TierFacts facts;
  facts.nvme_paths = UsedNvmePaths(config);
  const TierPlan plan =
      ComputeTierPlan(Placement::FromConfig(config), LayoutSizes::Of(layout), facts);
  int64_t pinned = 0;
  Status s = store.Open(plan, {}, wrap, &pinned);
  if (!s.ok()) return s;
  return store.Initialize([&](int id, std::vector<float>&) -> std::span<const float> {
    return init[static_cast<size_t>(id)];
  });
}

}  // namespace strata::scheduler::testing
