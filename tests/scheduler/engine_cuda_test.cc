// The Engine on a CUDA device against the same run on the host device: the
// toy model of the engine tests (toy_engine_model.h) trained two optimizer
// steps of two micro-batches with clipping, through the optimizer/parameter
// placements none/none (DeviceOptimizer), cpu/none, cpu/cpu and nvme/nvme.
// The framework's side (reading parameters, writing gradients) goes through
// cudaMemcpyAsync on Engine::ComputeStream() on CUDA and plain memcpy on the
// host device; the final masters agree to rounding (the global norm is
// reduced in another order on a GPU). On the GPU, the window's sum in HBM
// gives the host sum's bits. CUDA builds only; without a GPU the
// host half runs (it must train) and the CUDA half skips with the reason.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "src/scheduler/scheduler.h"
#include "strata/engine.h"
#include "tests/scheduler/toy_engine_model.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using testing::Placement;

constexpr int kModules = 5;

// Reads n bytes of a parameter the engine handed out into host memory.
void ReadDev(Engine& e, bool cuda, void* dst, const void* src, size_t n) {
  if (!cuda) {
    std::memcpy(dst, src, n);
    return;
  }
  auto s = static_cast<cudaStream_t>(e.ComputeStream());
  ASSERT_EQ(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
}
void WriteDev(Engine& e, bool cuda, void* dst, const void* src, size_t n) {
  if (!cuda) {
    std::memcpy(dst, src, n);
    return;
  }
  auto s = static_cast<cudaStream_t>(e.ComputeStream());
  ASSERT_EQ(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);  // the host buffer is reused
}

// One micro-batch: every module forward (its parameters read), then backward
// with gradients 0.5 p + 0.1 sin(batch + 0.37 j + m), times the loss scale.
void MicroBatch(Engine& e, bool cuda, int batch) {
  for (int m = 0; m < kModules; ++m) {
    auto v = e.BeforeForward(m);
    ASSERT_TRUE(v.ok()) << v.status();
    ASSERT_TRUE(e.AfterForward(m).ok());
  }
  const float scale = static_cast<float>(e.loss_scale());
  for (int m = kModules - 1; m >= 0; --m) {
    auto v = e.BeforeBackward(m);
    ASSERT_TRUE(v.ok()) << v.status();
    for (int i = 0; i < 2; ++i) {
      const DType t = testing::ToyDType(m, i);
      const int64_t n = testing::ToyNumel(m, i);
      const size_t bytes = static_cast<size_t>(n) * DTypeSize(t);
      std::vector<uint8_t> p(bytes), g(bytes);
      ReadDev(e, cuda, p.data(), v->params[static_cast<size_t>(i)], bytes);
      for (int64_t j = 0; j < n; ++j) {
        const float x = testing::Load(p.data(), t, j);
        testing::Store(g.data(), t, j,
                       scale * (0.5f * x + 0.1f * std::sin(static_cast<float>(batch) + 0.37f * j +
                                                           static_cast<float>(m))));
      }
      WriteDev(e, cuda, v->grads[static_cast<size_t>(i)], g.data(), bytes);
    }
    ASSERT_TRUE(e.AfterBackward(m).ok());
  }
}

// `windows` windows of 2 micro-batches of config `c` (registered with
// `seed`), then the parameters; empty, with *skip saying why, when the
// engine cannot be created (no GPU). *budgets, if given, gets the plan's.
std::vector<std::vector<float>> TrainToy(const Config& c, uint64_t seed, int windows,
                                         std::string* skip,
                                         std::vector<TierBudget>* budgets = nullptr) {
  auto e = CreateEngine(c);
  if (!e.ok()) {
    *skip = e.status().ToString();
    return {};
  }
  testing::RegisterToy(**e, seed, kModules);
  const bool cuda = c.strata.device == DeviceKind::kCuda;
  int batch = 0;
  for (int s = 0; s < windows; ++s)
    for (int k = 0; k < 2; ++k) {
      MicroBatch(**e, cuda, batch++);
      auto st = (*e)->Step();
      EXPECT_TRUE(st.ok()) << st.status();
    }
  EXPECT_TRUE((*e)->Synchronize().ok());
  if (budgets != nullptr) *budgets = (*e)->Budgets();
  return testing::ReadAll(**e);
}

class EngineOnCudaTest : public ::testing::TestWithParam<Placement> {};

TEST_P(EngineOnCudaTest, TrainsLikeTheHostDevice) {
  testing::ScratchDir dir;
  const auto [opt, par] = GetParam();
  auto train = [&](DeviceKind kind, std::string* skip) -> std::vector<std::vector<float>> {
    Config c = testing::ToyConfig(opt, par, dir.str());
    c.strata.device = kind;
    c.gradient_accumulation_steps = c.train_batch_size = 2;
    c.gradient_clipping = 0.5;
    auto e = CreateEngine(c);
    if (!e.ok()) {
      *skip = e.status().ToString();
      return {};
    }
    testing::RegisterToy(**e, 9, kModules);
    const bool cuda = kind == DeviceKind::kCuda;
    int batch = 0;
    for (int s = 0; s < 2; ++s)
      for (int k = 0; k < 2; ++k) {
        MicroBatch(**e, cuda, batch++);
        auto st = (*e)->Step();
        EXPECT_TRUE(st.ok()) << st.status();
        if (st.ok() && k == 1) {
          EXPECT_TRUE(st->applied);
        }
      }
    EXPECT_TRUE((*e)->Synchronize().ok());
    return testing::ReadAll(**e);
  };
  std::string why;
  const auto host = train(DeviceKind::kHost, &why);
  ASSERT_FALSE(host.empty()) << why;
  // The host run trained: its parameters left their initial values.
  {
    auto fresh = CreateEngine(testing::ToyConfig(opt, par, dir.str()));
    ASSERT_TRUE(fresh.ok()) << fresh.status();
    testing::RegisterToy(**fresh, 9, kModules);
    EXPECT_FALSE(testing::BitwiseEqual(testing::ReadAll(**fresh), host));
  }
  const auto gpu = train(DeviceKind::kCuda, &why);
  if (gpu.empty()) GTEST_SKIP() << "no CUDA device: " << why;
  ASSERT_EQ(gpu.size(), host.size());
  // Two steps move an element by up to 2 lr = 2e-2; the clip coefficient
  // (from a norm summed in another order) differs by rounding only.
  for (size_t i = 0; i < gpu.size(); ++i)
    for (size_t j = 0; j < gpu[i].size(); ++j)
      ASSERT_NEAR(gpu[i][j], host[i][j], 1e-6) << "parameter " << i << " element " << j;
}

// On the GPU, the window's gradients summed in HBM (strata.grad_accumulator
// device) give the bits of the host sum (host), three micro-batches a window.
TEST_P(EngineOnCudaTest, WindowSumInHbmGivesTheHostSumsBits) {
  testing::ScratchDir dir;
  const auto [opt, par] = GetParam();
  if (opt == OffloadDevice::kNone) GTEST_SKIP() << "the device optimizer sums in HBM anyway";
  auto train = [&](GradAccumulatorPlace place, std::string* skip) {
    Config c = testing::ToyConfig(opt, par, dir.str());
    c.strata.device = DeviceKind::kCuda;
    c.strata.grad_accumulator = place;
    c.gradient_accumulation_steps = c.train_batch_size = 3;
    c.gradient_clipping = 0.5;
    std::vector<std::vector<float>> out;
    auto e = CreateEngine(c);
    if (!e.ok()) {
      *skip = e.status().ToString();
      return out;
    }
    testing::RegisterToy(**e, 10, kModules);
    int batch = 0;
    for (int s = 0; s < 2; ++s)
      for (int k = 0; k < 3; ++k) {
        MicroBatch(**e, true, batch++);
        auto st = (*e)->Step();
        EXPECT_TRUE(st.ok()) << st.status();
      }
    EXPECT_TRUE((*e)->Synchronize().ok());
    return testing::ReadAll(**e);
  };
  std::string why;
  const auto host = train(GradAccumulatorPlace::kHost, &why);
  if (host.empty()) GTEST_SKIP() << "no CUDA device: " << why;
  const auto device = train(GradAccumulatorPlace::kDevice, &why);
  ASSERT_FALSE(device.empty()) << why;
  EXPECT_TRUE(testing::BitwiseEqual(host, device));
}

// offload_optimizer.ratio 0.5 on the GPU (the first 2 of the toy's 4
// sub-groups' states in HBM, stepped by the device Adam's kernel, their
// gradients summed on the compute stream; the parameters in HBM or through
// the host copy-out array) against every sub-group on the CPU of the host
// device: the same to rounding. The host half runs the split on the host
// device.
TEST(EngineOnCudaRatioTest, SplitAgreesWithTheHostDevice) {
  testing::ScratchDir dir;
  std::string no_gpu;
  for (const OffloadDevice par : {OffloadDevice::kNone, OffloadDevice::kCpu}) {
    SCOPED_TRACE(std::string("offload_param ") + std::string(OffloadDeviceName(par)));
    auto train = [&](DeviceKind kind, double ratio, std::string* skip) {
      Config c = testing::ToyConfig(OffloadDevice::kCpu, par, dir.str());
      c.strata.device = kind;
      c.zero_optimization.offload_optimizer.ratio = ratio;
      c.gradient_accumulation_steps = c.train_batch_size = 2;
      c.gradient_clipping = 0.5;
      std::vector<TierBudget> budgets;
      auto out = TrainToy(c, 11, 3, skip, &budgets);
      if (out.empty()) return out;
      bool split = false;
      for (const TierBudget& b : budgets)
        split |= b.tier == "hbm" && b.detail.find("stepped on the device") != std::string::npos;
      EXPECT_EQ(split, ratio < 1.0);
      return out;
    };
    std::string why;
    const auto host = train(DeviceKind::kHost, 1.0, &why);
    ASSERT_FALSE(host.empty()) << why;
    const auto host_split = train(DeviceKind::kHost, 0.5, &why);
    ASSERT_FALSE(host_split.empty()) << why;
    const auto gpu = train(DeviceKind::kCuda, 0.5, &why);
    if (gpu.empty()) {
      no_gpu = why;
      continue;
    }
    ASSERT_EQ(gpu.size(), host.size());
    for (size_t i = 0; i < gpu.size(); ++i)
      for (size_t j = 0; j < gpu[i].size(); ++j)
        ASSERT_NEAR(gpu[i][j], host[i][j], 1e-6) << "parameter " << i << " element " << j;
  }
  if (!no_gpu.empty()) GTEST_SKIP() << "no CUDA device: " << no_gpu;
}

// The compact state formats on the GPU: a bf16 master and int8 moments in
// HBM, stepped by the device Adam's compact kernel (offload_optimizer none,
// and the sub-groups offload_optimizer.ratio 0.5 keeps there), give the
// host device's bits (its CPU optimizer's format): without clipping the
// step's inputs are the same bits (the window summed with one fp32 add per
// micro-batch on either side).
TEST(EngineOnCudaCompactStatesTest, GiveTheHostDevicesBits) {
  testing::ScratchDir dir;
  std::string no_gpu;
  for (const OptimizerStates f : {OptimizerStates::kBf16Master, OptimizerStates::kInt8})
    for (const OffloadDevice opt : {OffloadDevice::kNone, OffloadDevice::kCpu}) {
      SCOPED_TRACE(::testing::Message()
                   << OptimizerStatesName(f) << ", offload_optimizer " << OffloadDeviceName(opt));
      auto train = [&](DeviceKind kind, std::string* skip) {
        Config c = testing::ToyConfig(opt, OffloadDevice::kNone, dir.str());
        c.strata.device = kind;
        c.strata.optimizer_states = f;
        if (opt == OffloadDevice::kCpu) c.zero_optimization.offload_optimizer.ratio = 0.5;
        c.gradient_accumulation_steps = c.train_batch_size = 2;
        return TrainToy(c, 13, 3, skip);
      };
      std::string why;
      const auto host = train(DeviceKind::kHost, &why);
      ASSERT_FALSE(host.empty()) << why;
      const auto gpu = train(DeviceKind::kCuda, &why);
      if (gpu.empty()) {
        no_gpu = why;
        continue;
      }
      EXPECT_TRUE(testing::BitwiseEqual(gpu, host));
    }
  if (!no_gpu.empty()) GTEST_SKIP() << "no CUDA device: " << no_gpu;
}

INSTANTIATE_TEST_SUITE_P(Placements, EngineOnCudaTest,
                         ::testing::Values(Placement{OffloadDevice::kNone, OffloadDevice::kNone},
                                           Placement{OffloadDevice::kCpu, OffloadDevice::kNone},
                                           Placement{OffloadDevice::kCpu, OffloadDevice::kCpu},
                                           Placement{OffloadDevice::kNvme, OffloadDevice::kNvme}),
                         testing::PlacementPairName);

}  // namespace
}  // namespace strata
