// The toy model the Engine tests (engine_test.cc, checkpoint_test.cc,
// optimizer_states_test.cc) train:
// module m has a weight of 300 + 97 m elements and a bias of 20 + m, their
// dtypes cycling bf16, fp16, fp32; the config they start from (host device,
// 8 MiB of HBM, sub-groups that split parameters, gradient chunks of 1000
// bytes); and the helpers to read the parameters back and compare them.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "src/common/dtype.h"
#include "strata/config.h"
#include "strata/engine.h"
#include "tests/test_util.h"

namespace strata::testing {

inline int64_t ToyNumel(int m, int i) { return i == 0 ? 300 + 97 * m : 20 + m; }

inline DType ToyDType(int m, int i) {
  static const DType kinds[] = {DType::kBf16, DType::kFp16, DType::kFp32};
  return kinds[(m + i) % 3];
}

inline Config ToyConfig(OffloadDevice opt, OffloadDevice par, const std::string& nvme_dir) {
  Config c;
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_optimizer.device = opt;
  c.zero_optimization.offload_param.device = par;
  if (opt == OffloadDevice::kNvme) c.zero_optimization.offload_optimizer.nvme_path = {nvme_dir};
  if (par == OffloadDevice::kNvme) c.zero_optimization.offload_param.nvme_path = {nvme_dir};
  c.zero_optimization.sub_group_size = 1000;  // several sub-groups, some splitting parameters
  c.zero_optimization.stage3_param_persistence_threshold = 100;
  c.zero_optimization.stage3_prefetch_bucket_size = 2000;
  c.zero_optimization.reduce_bucket_size = 500;  // gradient chunks of 1000 bytes: several a module
  c.optimizer.lr = 1e-2;
  c.optimizer.weight_decay = 0.01;
  c.strata.device = DeviceKind::kHost;
  c.strata.hbm_budget_bytes = 8 << 20;
  c.strata.threads = 2;
  return c;
}

// Registers `modules` modules with random initial values from `seed`;
// module 3's weight gets `extra_numel` more elements (a layout that differs).
inline void RegisterToy(Engine& e, uint64_t seed, int modules, int64_t extra_numel = 0) {
  auto rng = SeededRng(seed);
  for (int m = 0; m < modules; ++m)
    for (int i = 0; i < 2; ++i) {
      const int64_t n = ToyNumel(m, i) + (m == 3 && i == 0 ? extra_numel : 0);
      std::vector<float> init = RandomFloats(rng, static_cast<size_t>(n), -0.5f, 0.5f);
      ParamSpec s;
      char name[32];  // (GCC 12's -Wrestrict misfires on a concatenated std::string here)
      std::snprintf(name, sizeof(name), "m%d.%s", m, i == 0 ? "weight" : "bias");
      s.name = name;
      s.numel = n;
      s.dtype = ToyDType(m, i);
      s.module = m;
      s.init = init;
      ASSERT_TRUE(e.RegisterParameter(s).ok());
    }
}

inline float Load(const void* p, DType t, int64_t i) {
  return LoadAsFloat(p, t, static_cast<size_t>(i));
}
inline void Store(void* p, DType t, int64_t i, float v) {
  StoreFromFloat(p, t, static_cast<size_t>(i), v);
}

// One micro-batch through `modules` toy modules: gradients depend on the
// parameters the device sees, on the batch index and on the loss scale
// (g = 0.5 p + 0.1 sin(batch + 0.37 j + module), × the scale); returns a
// "loss" (a sum over the parameters seen) so losses can be compared too.
inline double ToyMicroBatch(Engine& e, int batch, int modules) {
  double loss = 0;
  for (int m = 0; m < modules; ++m) {
    auto v = e.BeforeForward(m);
    EXPECT_TRUE(v.ok()) << v.status();
    if (!v.ok()) return NAN;
    for (int i = 0; i < 2; ++i)
      for (int64_t j = 0; j < ToyNumel(m, i); ++j) loss += Load(v->params[i], ToyDType(m, i), j);
    EXPECT_TRUE(e.AfterForward(m).ok());
  }
  const float scale = static_cast<float>(e.loss_scale());
  for (int m = modules - 1; m >= 0; --m) {
    auto v = e.BeforeBackward(m);
    EXPECT_TRUE(v.ok()) << v.status();
    if (!v.ok()) return NAN;
    for (int i = 0; i < 2; ++i)
      for (int64_t j = 0; j < ToyNumel(m, i); ++j) {
        const float p = Load(v->params[i], ToyDType(m, i), j);
        const float g = 0.5f * p + 0.1f * std::sin(static_cast<float>(batch) + 0.37f * j + m);
        Store(v->grads[i], ToyDType(m, i), j, scale * g);
      }
    EXPECT_TRUE(e.AfterBackward(m).ok());
  }
  return loss;
}

// Trains optimizer steps [from, to) (batches numbered from from × gas);
// appends each step's loss.
inline void TrainToySteps(Engine& e, const Config& c, int from, int to, int modules,
                          std::vector<double>* losses) {
  for (int s = from; s < to; ++s) {
    double loss = 0;
    for (int64_t k = 0; k < c.gradient_accumulation_steps; ++k) {
      loss += ToyMicroBatch(e, static_cast<int>(s * c.gradient_accumulation_steps + k), modules);
      auto st = e.Step();
      ASSERT_TRUE(st.ok()) << st.status();
    }
    losses->push_back(loss);
  }
}

// Every parameter's fp32 master, in registration order.
inline std::vector<std::vector<float>> ReadAll(Engine& e) {
  std::vector<std::vector<float>> out;
  for (int id = 0; id < e.num_parameters(); ++id) {
    std::vector<float> v(static_cast<size_t>(ToyNumel(id / 2, id % 2)));
    Status s = e.ReadParameter(id, v);
    EXPECT_TRUE(s.ok()) << s;
    out.push_back(std::move(v));
  }
  return out;
}

inline bool BitwiseEqual(const std::vector<std::vector<float>>& a,
                         const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * 4) != 0)
      return false;
  return true;
}

inline bool BitwiseEqual(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

// Every (offload_optimizer, offload_param) placement, each with the
// optimizer overlapping the next forward pass and blocking, and test names
// for them ("opt_nvme_param_cpu_overlap"); and names for a placement pair.
using Placement = std::tuple<OffloadDevice, OffloadDevice>;
using PlacementOverlap = std::tuple<OffloadDevice, OffloadDevice, bool>;
inline auto AllPlacementsAndOverlap() {
  return ::testing::Combine(
      ::testing::Values(OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme),
      ::testing::Values(OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme),
      ::testing::Bool());
}
inline std::string PlacementName(OffloadDevice opt, OffloadDevice par) {
  return "opt_" + std::string(OffloadDeviceName(opt)) + "_param_" +
         std::string(OffloadDeviceName(par));
}
inline std::string PlacementOverlapName(const ::testing::TestParamInfo<PlacementOverlap>& info) {
  return PlacementName(std::get<0>(info.param), std::get<1>(info.param)) +
         (std::get<2>(info.param) ? "_overlap" : "_blocking");
}
inline std::string PlacementPairName(const ::testing::TestParamInfo<Placement>& info) {
  return PlacementName(std::get<0>(info.param), std::get<1>(info.param));
}

}  // namespace strata::testing
