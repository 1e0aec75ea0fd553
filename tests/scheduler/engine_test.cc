// The Engine on the host device with a small HBM budget: placement never
// changes the arithmetic, prefetch follows the trace within the budget,
// accumulation/clipping/loss scaling, fault injection mid-step, and plans
// that cannot fit.
#include "strata/engine.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "src/common/dtype.h"
#include "src/common/half.h"
#include "src/scheduler/host_array.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/scheduler.h"
#include "tests/scheduler/toy_engine_model.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using testing::BitwiseEqual;
using testing::Load;
using testing::ReadAll;
using testing::Store;

constexpr int kModules = 6;

Config BaseConfig(OffloadDevice opt, OffloadDevice par, const std::string& nvme_dir) {
  return testing::ToyConfig(opt, par, nvme_dir);
}
DType DTypeOf(int m, int i) { return testing::ToyDType(m, i); }
void Register(Engine& e, uint64_t seed) { testing::RegisterToy(e, seed, kModules); }

// One micro-batch of a toy "model": forward touches every module in `order`,
// backward writes gradients that depend on the parameters' device values and
// on the batch: g = 0.5 p + 0.1 sin(batch + 0.37 j + module) (× scale).
void MicroBatch(Engine& e, int batch, const std::vector<int>& order, float scale = 1.f,
                int poison_module = -1) {
  for (int m : order) {
    auto v = e.BeforeForward(m);
    ASSERT_TRUE(v.ok()) << v.status();
    ASSERT_EQ(v->params.size(), 2u);
    ASSERT_TRUE(e.AfterForward(m).ok());
  }
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const int m = *it;
    auto v = e.BeforeBackward(m);
    ASSERT_TRUE(v.ok()) << v.status();
    for (int i = 0; i < 2; ++i) {
      const int64_t n = testing::ToyNumel(m, i);
      const DType t = DTypeOf(m, i);
      for (int64_t j = 0; j < n; ++j) {
        const float p = Load(v->params[i], t, j);
        float g = scale * (0.5f * p + 0.1f * std::sin(static_cast<float>(batch) + 0.37f * j + m));
        if (m == poison_module && i == 0 && j == 3) g = INFINITY;
        Store(v->grads[i], t, j, g);
      }
    }
    Status ab = e.AfterBackward(m);
    ASSERT_TRUE(ab.ok()) << ab;
  }
}

std::vector<int> Forward() {
  std::vector<int> o(kModules);
  for (int i = 0; i < kModules; ++i) o[i] = i;
  return o;
}

// Trains `steps` optimizer steps; *last gets the last Step()'s statistics
// with the byte counters summed over all of them (with the optimizer
// overlapping the next forward, a step's I/O lands in the next window).
std::vector<std::vector<float>> Train(const Config& c, uint64_t seed, int steps,
                                      StepStats* last = nullptr) {
  auto e = CreateEngine(c);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return {};
  Register(**e, seed);
  int batch = 0;
  StepStats sum;
  for (int s = 0; s < steps; ++s) {
    for (int64_t k = 0; k < c.gradient_accumulation_steps; ++k) {
      MicroBatch(**e, batch++, Forward());
      auto st = (*e)->Step();
      EXPECT_TRUE(st.ok()) << st.status();
      if (!st.ok()) continue;
      sum.nvme_read_bytes += st->nvme_read_bytes;
      sum.nvme_written_bytes += st->nvme_written_bytes;
      sum.pcie_d2h_bytes += st->pcie_d2h_bytes;
      if (last) {
        *last = *st;
        last->nvme_read_bytes = sum.nvme_read_bytes;
        last->nvme_written_bytes = sum.nvme_written_bytes;
        last->pcie_d2h_bytes = sum.pcie_d2h_bytes;
      }
      // As a PyTorch loop does after each step: must neither lose the step
      // nor wait for it.
      if (st->applied) {
        EXPECT_TRUE((*e)->ZeroGrad().ok());
      }
    }
  }
  return ReadAll(**e);
}

// Trains `steps` windows of 2 micro-batches (seed 12) with `save`, saving
// to `ckpt` after window `at` (1-based count of windows done) and going on
// in a fresh engine of `load` (registered with other initial values) that
// loads it; `loaded(engine)` runs right after the load. The parameters at
// the end. REQUIRES: both configs have gradient_accumulation_steps 2.
std::vector<std::vector<float>> TrainResumed(const Config& save, const Config& load,
                                             const std::string& ckpt, int at, int steps = 3,
                                             const EngineTestHooks& hooks = {},
                                             const std::function<void(Engine&)>& loaded = {}) {
  auto e = CreateEngine(save, hooks);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return {};
  Register(**e, 12);
  int batch = 0;
  for (int step = 1; step <= steps; ++step) {
    for (int k = 0; k < 2; ++k) {
      MicroBatch(**e, batch++, Forward());
      auto st = (*e)->Step();
      EXPECT_TRUE(st.ok()) << st.status();
    }
    if (step == at) {
      EXPECT_TRUE((*e)->SaveCheckpoint(ckpt, CheckpointInfo{}).ok());
      e = CreateEngine(load, hooks);
      EXPECT_TRUE(e.ok()) << e.status();
      if (!e.ok()) return {};
      Register(**e, 99);
      EXPECT_TRUE((*e)->LoadCheckpoint(ckpt, nullptr).ok());
      if (loaded) loaded(**e);
    }
  }
  return ReadAll(**e);
}

// (optimizer placement, parameter placement, strata.overlap_optimizer)
class PlacementTest
    : public ::testing::TestWithParam<std::tuple<OffloadDevice, OffloadDevice, bool>> {};

TEST_P(PlacementTest, BitwiseIdenticalToAllInHbm) {
  testing::ScratchDir dir;
  uint64_t seed = 0;
  testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  Config ref = BaseConfig(OffloadDevice::kNone, OffloadDevice::kNone, dir.str());
  ref.gradient_accumulation_steps = ref.train_batch_size = 2;
  ref.strata.overlap_optimizer = false;  // the reference: everything in HBM, blocking steps
  auto [opt, par, overlap] = GetParam();
  Config c = BaseConfig(opt, par, dir.str());
  c.gradient_accumulation_steps = c.train_batch_size = 2;
  c.strata.overlap_optimizer = overlap;
  StepStats st;
  auto want = Train(ref, seed, 3);
  auto got = Train(c, seed, 3, &st);
  ASSERT_FALSE(want.empty());
  // Something actually changed, and identically.
  auto init = Train(ref, seed, 0);
  EXPECT_FALSE(BitwiseEqual(init, want));
  EXPECT_TRUE(BitwiseEqual(want, got));
  EXPECT_EQ(st.step, 3);
  EXPECT_LE(st.hbm_high_water_bytes, 8 << 20);
  const bool any_nvme = opt == OffloadDevice::kNvme || par == OffloadDevice::kNvme;
  EXPECT_EQ(st.nvme_read_bytes > 0, any_nvme);
  EXPECT_EQ(st.nvme_written_bytes > 0, any_nvme);
  EXPECT_GT(st.pcie_d2h_bytes, 0);
}

INSTANTIATE_TEST_SUITE_P(AllPlacements, PlacementTest, testing::AllPlacementsAndOverlap(),
                         testing::PlacementOverlapName);

TEST(EngineTest, PrefetchFollowsTraceWithinBudgetAndRerecords) {
  testing::ScratchDir dir;
  for (OffloadDevice par : {OffloadDevice::kCpu, OffloadDevice::kNvme}) {
    Config c = BaseConfig(OffloadDevice::kCpu, par, dir.str());
    // Budget: the states are elsewhere; parameters of 2-3 modules fit at once.
    c.strata.hbm_budget_bytes = 24 * 1024;
    c.zero_optimization.stage3_max_live_parameters = 2000;
    c.zero_optimization.stage3_max_reuse_distance = 0;
    auto e = CreateEngine(c);
    ASSERT_TRUE(e.ok()) << e.status();
    Register(**e, 7);
    MicroBatch(**e, 0, Forward());
    auto s1 = (*e)->Step();
    ASSERT_TRUE(s1.ok()) << s1.status();
    EXPECT_EQ(s1->prefetched_modules, 0);  // first step records
    MicroBatch(**e, 1, Forward());
    auto s2 = (*e)->Step();
    ASSERT_TRUE(s2.ok()) << s2.status();
    EXPECT_GT(s2->prefetched_modules, 0) << "par=" << OffloadDeviceName(par);
    EXPECT_LT(s2->fetch_misses, s1->fetch_misses);
    EXPECT_LE(s2->hbm_high_water_bytes, 24 * 1024);
    EXPECT_EQ(s2->trace_rerecords, 0);
    // A different path through the model: module 2 is skipped.
    MicroBatch(**e, 2, {0, 1, 3, 4, 5});
    auto s3 = (*e)->Step();
    ASSERT_TRUE(s3.ok()) << s3.status();
    EXPECT_EQ(s3->trace_rerecords, 1);
    MicroBatch(**e, 3, {0, 1, 3, 4, 5});
    auto s4 = (*e)->Step();
    ASSERT_TRUE(s4.ok());
    EXPECT_EQ(s4->trace_rerecords, 1);  // the new order is followed
    EXPECT_GT(s4->prefetched_modules, 0);
  }
}

TEST(EngineTest, AccumulationEqualsOneBigBatch) {
  testing::ScratchDir dir;
  // Two micro-batches of g accumulate to exactly 2g (power-of-two scaling).
  Config a = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  a.gradient_accumulation_steps = a.train_batch_size = 2;
  Config b = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  b.gradient_accumulation_steps = 1;
  auto ea = CreateEngine(a);
  auto eb = CreateEngine(b);
  ASSERT_TRUE(ea.ok() && eb.ok());
  Register(**ea, 11);
  Register(**eb, 11);
  MicroBatch(**ea, 5, Forward());
  auto sa = (*ea)->Step();
  ASSERT_TRUE(sa.ok());
  EXPECT_FALSE(sa->applied);  // accumulating
  MicroBatch(**ea, 5, Forward());
  sa = (*ea)->Step();
  ASSERT_TRUE(sa.ok());
  EXPECT_TRUE(sa->applied);
  // Same gradients × 2 in one micro-batch. bf16/fp16 of 2g is exactly 2 × (g rounded).
  MicroBatch(**eb, 5, Forward(), 2.f);
  ASSERT_TRUE((*eb)->Step().ok());
  EXPECT_TRUE(BitwiseEqual(ReadAll(**ea), ReadAll(**eb)));
}

TEST(EngineTest, ClippingByGlobalNorm) {
  testing::ScratchDir dir;
  Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kNone, dir.str());
  c.gradient_clipping = 0.5;
  auto e = CreateEngine(c);
  ASSERT_TRUE(e.ok());
  Register(**e, 3);
  MicroBatch(**e, 0, Forward());
  auto st = (*e)->Step();
  ASSERT_TRUE(st.ok());
  EXPECT_GT(st->grad_norm, 0.5);
  EXPECT_NEAR(st->clip_coef, 0.5 / (st->grad_norm + 1e-6), 1e-9);
  c.gradient_clipping = 1e9;
  auto e2 = CreateEngine(c);
  ASSERT_TRUE(e2.ok());
  Register(**e2, 3);
  MicroBatch(**e2, 0, Forward());
  auto st2 = (*e2)->Step();
  ASSERT_TRUE(st2.ok());
  EXPECT_EQ(st2->clip_coef, 1.0);
  EXPECT_DOUBLE_EQ(st2->grad_norm, st->grad_norm);
}

TEST(EngineTest, Fp16OverflowSkipsAndScaleSchedule) {
  testing::ScratchDir dir;
  Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  c.fp16.enabled = true;
  c.fp16.initial_scale_power = 8;
  c.fp16.hysteresis = 1;
  c.fp16.loss_scale_window = 2;
  auto e = CreateEngine(c);
  ASSERT_TRUE(e.ok());
  Register(**e, 5);
  EXPECT_EQ((*e)->loss_scale(), 256.0);
  auto before = ReadAll(**e);
  MicroBatch(**e, 0, Forward(), 256.f, /*poison_module=*/2);
  auto st = (*e)->Step();
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(st->overflow);
  EXPECT_FALSE(st->applied);
  EXPECT_EQ(st->loss_scale, 128.0);
  EXPECT_TRUE(BitwiseEqual(before, ReadAll(**e)));  // skipped: nothing changed
  MicroBatch(**e, 1, Forward(), 128.f);
  st = (*e)->Step();
  ASSERT_TRUE(st.ok());
  EXPECT_TRUE(st->applied);
  EXPECT_EQ(st->loss_scale, 128.0);
  MicroBatch(**e, 2, Forward(), 128.f);
  st = (*e)->Step();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->loss_scale, 256.0);  // two clean steps since the overflow
  EXPECT_FALSE(BitwiseEqual(before, ReadAll(**e)));
}

TEST(EngineTest, ScaledFp16GradientsMatchUnscaledBf16Path) {
  // Loss scaling is undone exactly: a power-of-two scale on fp32 gradients
  // gives the same update as no scaling.
  testing::ScratchDir dir;
  Config a = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  a.fp16.enabled = true;
  a.fp16.initial_scale_power = 4;
  Config b = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  b.bf16_enabled = true;
  auto ea = CreateEngine(a);
  auto eb = CreateEngine(b);
  ASSERT_TRUE(ea.ok() && eb.ok());
  EXPECT_EQ((*eb)->loss_scale(), 1.0);
  // Only fp32 parameters keep g × 16 exact; use a model of fp32 parameters.
  for (Engine* e : {ea->get(), eb->get()}) {
    std::vector<float> init(500, 0.25f);
    for (size_t i = 0; i < init.size(); ++i) init[i] = 0.001f * static_cast<float>(i) - 0.2f;
    ParamSpec s{"w", 500, DType::kFp32, 0, init, nullptr};
    ASSERT_TRUE(e->RegisterParameter(s).ok());
  }
  for (auto* pair : {&ea, &eb}) {
    Engine& e = ***pair;
    const float scale = static_cast<float>(e.loss_scale());
    auto v = e.BeforeForward(0);
    ASSERT_TRUE(v.ok());
    ASSERT_TRUE(e.AfterForward(0).ok());
    v = e.BeforeBackward(0);
    ASSERT_TRUE(v.ok());
    float* g = static_cast<float*>(v->grads[0]);
    for (int j = 0; j < 500; ++j) g[j] = scale * 0.01f * std::cos(0.1f * j);
    ASSERT_TRUE(e.AfterBackward(0).ok());
    ASSERT_TRUE(e.Step().ok());
  }
  std::vector<float> wa(500), wb(500);
  ASSERT_TRUE((*ea)->ReadParameter(0, wa).ok());
  ASSERT_TRUE((*eb)->ReadParameter(0, wb).ok());
  EXPECT_EQ(0, std::memcmp(wa.data(), wb.data(), wa.size() * 4));
}

// The bytes of module m's parameters in a view.
std::vector<uint8_t> ModuleBytes(const ModuleView& v, int m) {
  std::vector<uint8_t> out;
  for (int i = 0; i < 2; ++i) {
    const int64_t n = i == 0 ? 300 + 97 * m : 20 + m;
    const auto* p = static_cast<const uint8_t*>(v.params[i]);
    out.insert(out.end(), p, p + n * static_cast<int64_t>(DTypeSize(DTypeOf(m, i))));
  }
  return out;
}

// Hooks that wrap the engine's NVMe I/O in a FaultInjectionEngine (*faults
// once the NVMe tier is opened).
EngineTestHooks FaultHooks(nvme::FaultInjectionEngine** faults) {
  EngineTestHooks hooks;
  hooks.wrap_io_engine =
      [faults](std::unique_ptr<nvme::IoEngine> inner) -> std::unique_ptr<nvme::IoEngine> {
    auto f = std::make_unique<nvme::FaultInjectionEngine>(std::move(inner));
    *faults = f.get();
    return f;
  };
  return hooks;
}

// Runs one micro-batch's hooks and Step(), stopping at the first error;
// returns it (OK if there was none). The gradients do not depend on the
// parameters. `seen` (if given) gets each module's parameter bytes as the
// forward pass saw them.
Status MicroBatchUntilError(Engine& e, int batch, std::vector<std::vector<uint8_t>>* seen = nullptr,
                            bool step = true) {
  for (int m : Forward()) {
    auto v = e.BeforeForward(m);
    if (!v.ok()) return v.status();
    if (seen) seen->push_back(ModuleBytes(*v, m));
    if (Status s = e.AfterForward(m); !s.ok()) return s;
  }
  for (int m = kModules - 1; m >= 0; --m) {
    auto v = e.BeforeBackward(m);
    if (!v.ok()) return v.status();
    for (int i = 0; i < 2; ++i) {
      const int64_t n = i == 0 ? 300 + 97 * m : 20 + m;
      for (int64_t j = 0; j < n; ++j)
        Store(v->grads[i], DTypeOf(m, i), j, 0.1f * std::sin(static_cast<float>(batch) + j));
    }
    if (Status s = e.AfterBackward(m); !s.ok()) return s;
  }
  return step ? e.Step().status() : Status();
}

// Each module's parameter bytes as a forward pass (no backward) sees them.
std::vector<std::vector<uint8_t>> ForwardOnly(Engine& e) {
  std::vector<std::vector<uint8_t>> out;
  for (int m : Forward()) {
    auto v = e.BeforeForward(m);
    EXPECT_TRUE(v.ok()) << v.status();
    if (!v.ok()) return out;
    out.push_back(ModuleBytes(*v, m));
    EXPECT_TRUE(e.AfterForward(m).ok());
  }
  return out;
}

// The parameters of an engine (seed 21) that trained batches 0 and 2 only:
// what one whose window of batch 1 failed and was dropped must hold after
// batch 2.
std::vector<std::vector<float>> TrainedOnBatches0And2(const Config& c) {
  auto ref = CreateEngine(c);
  EXPECT_TRUE(ref.ok()) << ref.status();
  if (!ref.ok()) return {};
  Register(**ref, 21);
  for (int batch : {0, 2}) {
    MicroBatch(**ref, batch, Forward());
    EXPECT_TRUE((*ref)->Step().ok());
  }
  return ReadAll(**ref);
}

// (fault kind, strata.overlap_optimizer); kinds: 0 EIO on a write, 1 short
// read, 2 ENOSPC on a write.
class FaultTest : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(FaultTest, FailedStepKeepsPreviousStateAndNextStepWorks) {
  const auto [kind, overlap] = GetParam();
  testing::ScratchDir dir;
  // The short read: parameters on the CPU, so that the only NVMe reads are
  // the step's (with offload_param nvme an overlapped step races the next
  // forward pass's fetches for the first read, and a failed fetch is not the
  // failure under test).
  Config c = BaseConfig(OffloadDevice::kNvme,
                        kind == 1 ? OffloadDevice::kCpu : OffloadDevice::kNvme, dir.str());
  c.strata.overlap_optimizer = overlap;
  nvme::FaultInjectionEngine* faults = nullptr;
  EngineTestHooks hooks = FaultHooks(&faults);
  auto e = CreateEngine(c, hooks);
  ASSERT_TRUE(e.ok()) << e.status();
  Register(**e, 21);
  MicroBatch(**e, 0, Forward());
  ASSERT_TRUE((*e)->Step().ok());
  ASSERT_NE(faults, nullptr);
  auto after_one = ReadAll(**e);

  nvme::FaultInjectionEngine::Rule rule;
  rule.kind = kind == 1 ? nvme::IoOpKind::kRead : nvme::IoOpKind::kWrite;
  // The first sub-groups' states were read during backward: the step itself
  // reads only the last one.
  rule.nth = kind == 1 ? 1 : 2;
  rule.fault = kind == 1 ? nvme::FaultInjectionEngine::Fault::kShort
                         : nvme::FaultInjectionEngine::Fault::kErrno;
  rule.err = kind == 2 ? 28 /*ENOSPC*/ : 5 /*EIO*/;
  rule.short_bytes = 0;
  rule.times = 1000;  // keeps failing (a short read is resubmitted otherwise)
  MicroBatch(**e, 1, Forward());
  faults->AddRule(rule);
  Status failed = (*e)->Step().status();
  if (overlap) {
    // Step() only started the optimizer; its error comes from a later call,
    // at the latest the next Step().
    ASSERT_TRUE(failed.ok()) << failed;
    failed = MicroBatchUntilError(**e, 7);
  }
  faults->ClearRules();
  ASSERT_FALSE(failed.ok());
  SCOPED_TRACE(failed.ToString());
  EXPECT_GT(faults->faults_injected(), 0);
  EXPECT_THAT(std::string(failed.message()), ::testing::HasSubstr("intact"));
  if (overlap) {
    EXPECT_THAT(std::string(failed.message()), ::testing::HasSubstr("background"));
  }
  EXPECT_TRUE(BitwiseEqual(after_one, ReadAll(**e)));
  EXPECT_TRUE((*e)->Synchronize().ok());  // reported once

  // The fault cleared: the next step works and matches an engine that never
  // saw the failed batch.
  MicroBatch(**e, 2, Forward());
  auto ok = (*e)->Step();
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(BitwiseEqual(TrainedOnBatches0And2(c), ReadAll(**e)));
}

std::string FaultName(const ::testing::TestParamInfo<std::tuple<int, bool>>& info) {
  static const char* const kKinds[] = {"write_eio", "short_read", "write_enospc"};
  return std::string(kKinds[std::get<0>(info.param)]) +
         (std::get<1>(info.param) ? "_overlap" : "_blocking");
}

INSTANTIATE_TEST_SUITE_P(Faults, FaultTest,
                         ::testing::Combine(::testing::Values(0, 1, 2), ::testing::Bool()),
                         FaultName);

TEST(EngineTest, PlanThatCannotFitFailsWithTable) {
  testing::ScratchDir dir;
  Config c = BaseConfig(OffloadDevice::kNone, OffloadDevice::kNone, dir.str());
  c.strata.hbm_budget_bytes = 16 * 1024;  // far below 12 B/param of states
  auto e = CreateEngine(c);
  ASSERT_TRUE(e.ok()) << e.status();
  Register(**e, 1);
  auto v = (*e)->BeforeForward(0);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), StatusCode::kResourceExhausted);
  const std::string msg(v.status().message());
  EXPECT_THAT(msg, ::testing::HasSubstr("needed"));
  EXPECT_THAT(msg, ::testing::HasSubstr("hbm"));
  EXPECT_THAT(msg, ::testing::HasSubstr("optimizer states"));
  EXPECT_THAT(msg, ::testing::HasSubstr("<-- over"));
}

// strata.dram_budget bounds the pageable host memory of the plan: over it,
// Plan() refuses with the table before any state is allocated; at the
// plan's own figure it fits.
TEST(EngineTest, PlanOverTheDramBudgetIsRefusedWithTheTable) {
  testing::ScratchDir dir;
  Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  c.strata.dram_budget_bytes = 4096;  // below the gradient accumulator alone
  auto e = CreateEngine(c);
  ASSERT_TRUE(e.ok()) << e.status();
  Register(**e, 1);
  const Status s = (*e)->Plan();
  ASSERT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), ::testing::HasSubstr("dram"));
  EXPECT_THAT(s.message(), ::testing::HasSubstr("gradient accumulator"));
  EXPECT_THAT(s.message(), ::testing::HasSubstr("<-- over"));
  int64_t needed = 0;
  for (const TierBudget& b : (*e)->Budgets())
    if (b.tier == "dram") needed = b.needed_bytes;
  ASSERT_GT(needed, 4096);
  c.strata.dram_budget_bytes = needed;
  auto fits = CreateEngine(c);
  ASSERT_TRUE(fits.ok());
  Register(**fits, 1);
  EXPECT_TRUE((*fits)->Plan().ok());
}

// With an NVMe tier, Plan() measures the disk's read and write rates for
// the step bound; without one there are none.
TEST(EngineTest, DiskRatesAreMeasuredWithAnNvmeTier) {
  testing::ScratchDir dir;
  for (OffloadDevice place : {OffloadDevice::kCpu, OffloadDevice::kNvme}) {
    StepStats last;
    Train(BaseConfig(place, place, dir.str()), 2, 2, &last);
    if (place == OffloadDevice::kNvme) {
      EXPECT_GT(last.nvme_read_gbytes_per_s, 0);
      EXPECT_GT(last.nvme_write_gbytes_per_s, 0);
    } else {
      EXPECT_EQ(last.nvme_read_gbytes_per_s, 0);
      EXPECT_EQ(last.nvme_write_gbytes_per_s, 0);
    }
  }
}

TEST(EngineTest, BadNvmePathFailsAtCreate) {
  Config c = BaseConfig(OffloadDevice::kNvme, OffloadDevice::kCpu, "/nonexistent/strata-nvme");
  auto e = CreateEngine(c);
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(std::string(e.status().message()), ::testing::HasSubstr("/nonexistent/strata-nvme"));
}

TEST(EngineTest, HookMisuseIsAnError) {
  testing::ScratchDir dir;
  auto e = CreateEngine(BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str()));
  ASSERT_TRUE(e.ok());
  Register(**e, 2);
  EXPECT_EQ((*e)->BeforeForward(99).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*e)->AfterBackward(0).code(), StatusCode::kFailedPrecondition);
  ParamSpec late{"late", 10, DType::kFp32,
                 0,      {}, [](std::span<float> v) { std::fill(v.begin(), v.end(), 1.f); }};
  EXPECT_EQ((*e)->RegisterParameter(late).status().code(), StatusCode::kFailedPrecondition);
  auto stats = nlohmann::json::parse((*e)->StatsJson());
  EXPECT_TRUE(stats.contains("overlap_efficiency"));
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

TEST(EngineTest, OverlappedStepLetsTheNextForwardStartHalfWay) {
  testing::ScratchDir dir;
  for (OffloadDevice par : {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme}) {
    SCOPED_TRACE(std::string("offload_param ") + std::string(OffloadDeviceName(par)));
    Config c = BaseConfig(OffloadDevice::kNvme, par, dir.str());
    c.strata.overlap_optimizer = true;
    Config blocking = c;
    blocking.strata.overlap_optimizer = false;
    // 3390 elements in sub-groups of 1000: groups 0-3; module 0 is in group 0.
    std::mutex mu;
    std::condition_variable cv;
    bool armed = false, held = false, release = false;
    EngineTestHooks hooks;
    hooks.before_sub_group = [&](size_t g) {
      std::unique_lock<std::mutex> lock(mu);
      if (!armed || g != 3) return;
      held = true;
      cv.notify_all();
      // Bounded, so that a regression fails instead of hanging the suite.
      EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return release; }));
    };
    auto e = CreateEngine(c, hooks);
    auto ref = CreateEngine(blocking);
    ASSERT_TRUE(e.ok() && ref.ok());
    Register(**e, 31);
    Register(**ref, 31);
    for (int b = 0; b < 2; ++b) {
      ASSERT_TRUE(MicroBatchUntilError(**ref, b).ok());
      if (b == 1) {
        ASSERT_TRUE((*e)->Synchronize().ok());  // step 1 is not the one to hold
        std::lock_guard<std::mutex> lock(mu);
        armed = true;
      }
      ASSERT_TRUE(MicroBatchUntilError(**e, b).ok());
    }
    {
      std::unique_lock<std::mutex> lock(mu);
      // The step is now held before its last sub-group.
      ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return held; }));
    }
    // Module 0's parameters are final already: the forward pass starts, and
    // sees exactly what a blocking step produced.
    auto v = (*e)->BeforeForward(0);
    ASSERT_TRUE(v.ok()) << v.status();
    auto want = (*ref)->BeforeForward(0);
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(ModuleBytes(*v, 0), ModuleBytes(*want, 0));
    ASSERT_TRUE((*e)->AfterForward(0).ok());
    ASSERT_TRUE((*ref)->AfterForward(0).ok());
    {
      std::lock_guard<std::mutex> lock(mu);
      release = true;
    }
    cv.notify_all();
    for (int m = 1; m < kModules; ++m) {
      auto got = (*e)->BeforeForward(m);
      auto exp = (*ref)->BeforeForward(m);
      ASSERT_TRUE(got.ok() && exp.ok()) << got.status();
      EXPECT_EQ(ModuleBytes(*got, m), ModuleBytes(*exp, m)) << "module " << m;
      ASSERT_TRUE((*e)->AfterForward(m).ok());
      ASSERT_TRUE((*ref)->AfterForward(m).ok());
    }
    ASSERT_TRUE((*e)->Synchronize().ok());
    EXPECT_TRUE(BitwiseEqual(ReadAll(**ref), ReadAll(**e)));
  }
}

TEST(EngineTest, DelayedParamUpdateUsesParametersOneStepOld) {
  testing::ScratchDir dir;
  for (OffloadDevice opt : {OffloadDevice::kCpu, OffloadDevice::kNvme}) {
    for (OffloadDevice par : {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme}) {
      SCOPED_TRACE(std::string("offload_optimizer ") + std::string(OffloadDeviceName(opt)) +
                   ", offload_param " + std::string(OffloadDeviceName(par)));
      Config plain = BaseConfig(opt, par, dir.str());
      plain.strata.overlap_optimizer = false;
      Config dpu = BaseConfig(opt, par, dir.str());
      dpu.strata.delayed_param_update = true;
      dpu.strata.delayed_param_update_warmup = 1;
      auto a = CreateEngine(plain);
      auto b = CreateEngine(dpu);
      ASSERT_TRUE(a.ok() && b.ok()) << b.status();
      Register(**a, 41);
      Register(**b, 41);
      // The gradients do not depend on the parameters, so both engines apply
      // the same updates; only what the forward pass sees differs.
      constexpr int kWindows = 5;
      std::vector<std::vector<std::vector<uint8_t>>> seen_a(kWindows), seen_b(kWindows);
      for (int w = 0; w < kWindows; ++w) {
        ASSERT_TRUE(MicroBatchUntilError(**a, w, &seen_a[w]).ok());
        Status sb = MicroBatchUntilError(**b, w, &seen_b[w]);
        ASSERT_TRUE(sb.ok()) << sb;
      }
      // Window 0: initial parameters; window 1: step 1 was the warm-up (not
      // delayed); from window 2 on, DPU's forward sees one step less.
      EXPECT_EQ(seen_b[0], seen_a[0]);
      EXPECT_EQ(seen_b[1], seen_a[1]);
      for (int w = 2; w < kWindows; ++w) {
        EXPECT_EQ(seen_b[w], seen_a[w - 1]) << "window " << w;
        EXPECT_NE(seen_b[w], seen_a[w]) << "window " << w;
      }
      ASSERT_TRUE((*b)->Synchronize().ok());
      EXPECT_TRUE(BitwiseEqual(ReadAll(**a), ReadAll(**b)));
    }
  }
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// offload_optimizer cpu updates the states in place, so a failed write of the
// new parameters to NVMe cannot be undone: the step reports DataLoss, the
// modules whose write failed keep their previous parameters on NVMe (never a
// half-written or older version), and the next step rewrites them.
TEST(EngineTest, FailedParameterWriteKeepsThePreviousParameters) {
  testing::ScratchDir dir;
  Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kNvme, dir.str());
  c.strata.overlap_optimizer = false;
  nvme::FaultInjectionEngine* faults = nullptr;
  EngineTestHooks hooks = FaultHooks(&faults);
  auto e = CreateEngine(c, hooks);
  Config rc = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  rc.strata.overlap_optimizer = false;
  auto ref = CreateEngine(rc);
  ASSERT_TRUE(e.ok() && ref.ok());
  Register(**e, 51);
  Register(**ref, 51);
  const auto initial = ForwardOnly(**e);
  ASSERT_TRUE(MicroBatchUntilError(**e, 0).ok());
  ASSERT_TRUE(MicroBatchUntilError(**ref, 0).ok());
  const auto after_one = ForwardOnly(**e);

  ASSERT_TRUE(MicroBatchUntilError(**e, 1, nullptr, /*step=*/false).ok());
  ASSERT_TRUE(MicroBatchUntilError(**ref, 1).ok());
  nvme::FaultInjectionEngine::Rule rule;
  rule.kind = nvme::IoOpKind::kWrite;
  rule.nth = 2;  // the first module's write succeeds, the rest fail
  rule.fault = nvme::FaultInjectionEngine::Fault::kErrno;
  rule.err = 5;
  rule.times = 1000;
  faults->AddRule(rule);
  auto failed = (*e)->Step();
  faults->ClearRules();
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kDataLoss);
  EXPECT_THAT(std::string(failed.status().message()), ::testing::HasSubstr("stay those of step 1"));
  const auto after_failure = ForwardOnly(**e);
  const auto ref_two = ForwardOnly(**ref);
  int stale = 0;
  for (int m = 0; m < kModules; ++m) {
    SCOPED_TRACE("module " + std::to_string(m));
    EXPECT_NE(after_one[m], initial[m]);
    // Either written (step 2) or kept (step 1); never an older version.
    EXPECT_TRUE(after_failure[m] == ref_two[m] || after_failure[m] == after_one[m]);
    EXPECT_NE(after_failure[m], initial[m]);
    stale += after_failure[m] == after_one[m] && after_one[m] != ref_two[m];
  }
  EXPECT_GT(stale, 0);
  // The next step rewrites every module: back in line with the reference.
  ASSERT_TRUE(MicroBatchUntilError(**e, 2).ok());
  ASSERT_TRUE(MicroBatchUntilError(**ref, 2).ok());
  EXPECT_EQ(ForwardOnly(**e), ForwardOnly(**ref));
  EXPECT_TRUE(BitwiseEqual(ReadAll(**ref), ReadAll(**e)));
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// NVMe bytes are counted once: what nvme/nvme writes is what nvme/cpu
// (states) and cpu/nvme (parameters) write between them.
TEST(EngineTest, NvmeWrittenBytesAddUpAcrossPlacements) {
  testing::ScratchDir dir;
  auto written = [&](OffloadDevice opt, OffloadDevice par) {
    Config c = BaseConfig(opt, par, dir.str());
    c.strata.overlap_optimizer = false;  // every step's writes land in its own window
    StepStats st;
    Train(c, 5, 3, &st);
    return st.nvme_written_bytes;
  };
  const int64_t states = written(OffloadDevice::kNvme, OffloadDevice::kCpu);
  const int64_t params = written(OffloadDevice::kCpu, OffloadDevice::kNvme);
  const int64_t both = written(OffloadDevice::kNvme, OffloadDevice::kNvme);
  EXPECT_GT(states, 0);
  EXPECT_GT(params, 0);
  EXPECT_EQ(both, states + params);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// optimizer.type reaches the CPU optimizer. Lion moves every element by
// exactly lr per step (after the decoupled decay): sign updates, which
// neither Adam nor Adagrad make after their first step. Placements stay
// bitwise equal for each type.
TEST(EngineTest, OptimizerTypeSelectsTheAlgorithm) {
  testing::ScratchDir dir;
  auto params_after = [&](OptimizerType type, OffloadDevice opt, int steps) {
    Config c = BaseConfig(opt, OffloadDevice::kCpu, dir.str());
    c.optimizer.type = type;
    return Train(c, 11, steps);
  };
  std::map<OptimizerType, std::vector<std::vector<float>>> result;
  for (OptimizerType t : {OptimizerType::kAdamW, OptimizerType::kAdagrad, OptimizerType::kLion}) {
    result[t] = params_after(t, OffloadDevice::kCpu, 3);
    EXPECT_TRUE(BitwiseEqual(result[t], params_after(t, OffloadDevice::kNvme, 3)))
        << OptimizerTypeName(t);
  }
  EXPECT_FALSE(BitwiseEqual(result[OptimizerType::kAdamW], result[OptimizerType::kLion]));
  EXPECT_FALSE(BitwiseEqual(result[OptimizerType::kAdamW], result[OptimizerType::kAdagrad]));
  EXPECT_FALSE(BitwiseEqual(result[OptimizerType::kLion], result[OptimizerType::kAdagrad]));
  // Lion, steps 2 and 3: |p_t - p_{t-1} (1 - lr wd)| == lr for every element.
  const Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  const double lr = c.optimizer.lr, wd = c.optimizer.weight_decay;
  const auto before = params_after(OptimizerType::kLion, OffloadDevice::kCpu, 2);
  const auto& after = result[OptimizerType::kLion];
  int64_t checked = 0;
  for (size_t i = 0; i < after.size(); ++i)
    for (size_t j = 0; j < after[i].size(); ++j, ++checked)
      ASSERT_NEAR(std::fabs(after[i][j] - before[i][j] * (1.0 - lr * wd)), lr, 1e-6)
          << "parameter " << i << " element " << j;
  EXPECT_GT(checked, 1000);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// offload_optimizer none as it runs on a GPU (gradient accumulator in the
// arena, Device::AdamStep), on the host device: the same steps as the CPU
// optimizer's none/none to rounding (the global norm is reduced in another
// order), with accumulation, clipping and fp16 loss scaling; fp16 overflow
// skips. (Over several steps the two drift apart further: this toy model's
// gradients depend on its bf16/fp16 parameters, so a rounding difference that
// moves a parameter across a rounding boundary changes its next gradient.)
TEST(EngineTest, DeviceOptimizerMatchesTheCpuPlacementsToRounding) {
  testing::ScratchDir dir;
  for (int variant = 0; variant < 3; ++variant) {
    // AdamW; Adam with L2 decay (the decay competes with the scaled gradient,
    // so the multiplier shows); fp16 loss scaling.
    const bool fp16 = variant == 2;
    SCOPED_TRACE(variant == 0 ? "AdamW" : variant == 1 ? "Adam (L2)" : "fp16");
    Config c = BaseConfig(OffloadDevice::kNone, OffloadDevice::kNone, dir.str());
    if (variant == 1) {
      c.optimizer.type = OptimizerType::kAdam;
      c.optimizer.adam_w_mode = false;
    }
    c.gradient_accumulation_steps = c.train_batch_size = 2;
    c.gradient_clipping = 0.5;
    c.strata.overlap_optimizer = false;
    if (fp16) {
      c.fp16.enabled = true;
      c.fp16.initial_scale_power = 4;
    }
    const auto cpu = Train(c, 9, 2);
    EngineTestHooks hooks;
    hooks.device_optimizer = true;
    auto e = CreateEngine(c, hooks);
    ASSERT_TRUE(e.ok()) << e.status();
    Register(**e, 9);
    int batch = 0;
    for (int s = 0; s < 2; ++s)
      for (int k = 0; k < 2; ++k) {
        MicroBatch(**e, batch++, Forward());
        auto st = (*e)->Step();
        ASSERT_TRUE(st.ok()) << st.status();
        if (k == 1) {
          EXPECT_TRUE(st->applied);
        }
      }
    const auto dev = ReadAll(**e);
    ASSERT_EQ(dev.size(), cpu.size());
    // Two steps, within 1e-6 (a step moves an element by up to lr = 1e-2);
    // the clip coefficient differs between them, so a wrong multiplier shows.
    for (size_t i = 0; i < dev.size(); ++i)
      for (size_t j = 0; j < dev[i].size(); ++j)
        ASSERT_NEAR(dev[i][j], cpu[i][j], 1e-6) << "parameter " << i << " element " << j;
    // Trained: the parameters moved from their initial values.
    auto fresh = CreateEngine(c);
    ASSERT_TRUE(fresh.ok());
    Register(**fresh, 9);
    EXPECT_FALSE(BitwiseEqual(ReadAll(**fresh), dev));
  }
  // An fp16 overflow skips the step on the device path too.
  Config c = BaseConfig(OffloadDevice::kNone, OffloadDevice::kNone, dir.str());
  c.fp16.enabled = true;
  EngineTestHooks hooks;
  hooks.device_optimizer = true;
  auto e = CreateEngine(c, hooks);
  ASSERT_TRUE(e.ok());
  Register(**e, 3);
  const auto before = ReadAll(**e);
  MicroBatch(**e, 0, Forward(), 1.f, /*poison_module=*/2);
  auto st = (*e)->Step();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->overflow);
  EXPECT_FALSE(st->applied);
  EXPECT_TRUE(BitwiseEqual(ReadAll(**e), before));
  // And the next, clean, step applies.
  MicroBatch(**e, 1, Forward());
  st = (*e)->Step();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->applied);
}

// Compact states in HBM (offload_optimizer none, strata.optimizer_states
// bf16, bf16-master, int8): the CPU optimizer stepping them there (the host
// device) and the device optimizer give the bits of the same format in
// DRAM (without clipping, whose coefficient the device path sums in another
// order), and a checkpoint of them resumes bitwise.
TEST(EngineTest, CompactStatesInHbm) {
  testing::ScratchDir dir;
  for (const OptimizerStates f :
       {OptimizerStates::kBf16, OptimizerStates::kBf16Master, OptimizerStates::kInt8})
    for (const bool device_optimizer : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << OptimizerStatesName(f) << ", "
                   << (device_optimizer ? "device optimizer" : "CPU optimizer, states in HBM"));
      Config dram = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kNone, dir.str());
      dram.strata.optimizer_states = f;
      dram.gradient_accumulation_steps = dram.train_batch_size = 2;
      dram.strata.overlap_optimizer = false;
      if (!device_optimizer) dram.gradient_clipping = 0.3;
      const auto want = Train(dram, 12, 3);
      Config hbm = dram;
      hbm.zero_optimization.offload_optimizer.device = OffloadDevice::kNone;
      EngineTestHooks hooks;
      hooks.device_optimizer = device_optimizer;
      // Saved after two steps, loaded into a fresh engine that goes on.
      const std::string ckpt = (dir.path() / fmt::format("{}-{}", OptimizerStatesName(f),
                                                         device_optimizer ? "dev" : "host"))
                                   .string();
      std::vector<TierBudget> budgets;
      EXPECT_TRUE(BitwiseEqual(want, TrainResumed(hbm, hbm, ckpt, 2, 3, hooks,
                                                  [&](Engine& e) { budgets = e.Budgets(); })));
      // The plan's HBM row holds the states in the format.
      bool format_row = false;
      for (const TierBudget& b : budgets)
        format_row |= b.tier == "hbm" && b.detail.find(fmt::format(
                                             "({})", OptimizerStatesName(f))) != std::string::npos;
      EXPECT_TRUE(format_row);
    }
}

// The device optimizer needs the parameters in HBM and Adam/AdamW.
TEST(EngineTest, DeviceOptimizerRefusesWhatItCannotRun) {
  testing::ScratchDir dir;
  EngineTestHooks hooks;
  hooks.device_optimizer = true;
  Config c = BaseConfig(OffloadDevice::kNone, OffloadDevice::kCpu, dir.str());
  auto e = CreateEngine(c, hooks);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kNotSupported);
  EXPECT_THAT(std::string(e.status().message()), ::testing::HasSubstr("offload_param.device"));
  c = BaseConfig(OffloadDevice::kNone, OffloadDevice::kNone, dir.str());
  c.optimizer.type = OptimizerType::kLion;
  e = CreateEngine(c, hooks);
  ASSERT_FALSE(e.ok());
  EXPECT_THAT(std::string(e.status().message()), ::testing::HasSubstr("optimizer.type: Lion"));
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// A killed run's swap file (nobody holds its lock) is removed by Plan(), a
// library user's too (Plan removes leftovers before it measures free space).
// offload_param nvme with the step overlapping the next forward: a module
// the step has written is fetched from the write-back buffer it was written
// from (no NVMe read back), and the parameters are bitwise those of a run
// without overlap. The step is slowed (50 ms before each sub-group after the
// first) so that the forward reaches module 0 while it runs.
TEST(EngineTest, OverlappedFetchTakesTheStepsWriteBackBuffer) {
  for (OffloadDevice opt : {OffloadDevice::kCpu, OffloadDevice::kNvme}) {
    SCOPED_TRACE(std::string("offload_optimizer ") + std::string(OffloadDeviceName(opt)));
    testing::ScratchDir dir;
    auto run = [&](bool overlap, int64_t* from_memory) {
      Config c = BaseConfig(opt, OffloadDevice::kNvme, dir.str());
      c.strata.overlap_optimizer = overlap;
      EngineTestHooks hooks;
      hooks.before_sub_group = [](size_t g) {
        if (g > 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      };
      auto e = CreateEngine(c, hooks);
      EXPECT_TRUE(e.ok()) << e.status();
      if (!e.ok()) return std::vector<std::vector<float>>{};
      Register(**e, 5);
      for (int batch = 0; batch < 3; ++batch) {
        MicroBatch(**e, batch, Forward());
        auto st = (*e)->Step();
        EXPECT_TRUE(st.ok()) << st.status();
        if (st.ok()) *from_memory += st->updated_from_memory;
      }
      EXPECT_TRUE((*e)->Synchronize().ok());
      return ReadAll(**e);
    };
    int64_t overlapped = 0, blocking = 0;
    const auto a = run(true, &overlapped);
    const auto b = run(false, &blocking);
    ASSERT_FALSE(a.empty());
    EXPECT_TRUE(BitwiseEqual(a, b));
    EXPECT_GT(overlapped, 0);  // at least module 0 in each of the later windows
    EXPECT_EQ(blocking, 0);    // no step in flight during a forward
  }
}

TEST(EngineTest, PlanRemovesLeftoverSwapFilesFirst) {
  testing::ScratchDir dir;
  const std::string leftover = dir.str() + "/strata-swap-00000000000000aa-12345-0.bin";
  {
    std::ofstream f(leftover, std::ios::binary);
    f << std::string(1 << 16, 'x');
  }
  ASSERT_TRUE(std::filesystem::exists(leftover));
  auto e = CreateEngine(BaseConfig(OffloadDevice::kNvme, OffloadDevice::kNvme, dir.str()));
  ASSERT_TRUE(e.ok()) << e.status();
  Register(**e, 1);
  ASSERT_TRUE((*e)->Plan().ok());
  EXPECT_FALSE(std::filesystem::exists(leftover));
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// ---- The gradient path: the last micro-batch folded into the optimizer ------

bool PlanFolds(Engine& e) {
  for (const TierBudget& b : e.Budgets())
    if (b.detail.find("folded into the optimizer") != std::string::npos) return true;
  return false;
}

// The plan copies the window's HBM sums straight into a pinned accumulator.
bool PlanSumsCopiedIn(Engine& e) {
  for (const TierBudget& b : e.Budgets())
    if (b.detail.find("the window's sums copied in") != std::string::npos) return true;
  return false;
}

struct FoldRun {
  bool copied_in = false;     // PlanSumsCopiedIn
  int64_t pinned_needed = 0;  // the plan's pinned bytes
  std::vector<std::vector<float>> params;
  std::vector<double> norms;
  std::vector<int> applied;
  bool folded = false;
  // strata.speculative_step: sub-groups speculated and rolled back, summed.
  int64_t speculated = 0, redone = 0;
};

// `steps` windows of c.gradient_accumulation_steps micro-batches; in each
// window's last micro-batch module 4 is left out and module 2 runs twice
// (forward and backward: two gradient hand-overs in one micro-batch), and
// in window 1 (fp16) module 1's gradients overflow in the last micro-batch.
// fold_override: EngineTestHooks::fold_override.
// skip_window: the third step's window leaves module 4 out altogether.
FoldRun TrainOddOrders(const Config& c, uint64_t seed, int steps, bool poison, int fold_override,
                       bool skip_window = false) {
  FoldRun r;
  EngineTestHooks hooks;
  hooks.fold_override = fold_override;
  hooks.speculation_steps_all_handed_over = true;
  auto e = CreateEngine(c, hooks);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return r;
  Register(**e, seed);
  int batch = 0;
  const float scale = c.fp16.enabled ? 64.f : 1.f;
  for (int s = 0; s < steps; ++s) {
    for (int64_t k = 0; k < c.gradient_accumulation_steps; ++k) {
      const bool last = k + 1 == c.gradient_accumulation_steps;
      std::vector<int> order = Forward();
      if (last) order = {0, 1, 2, 2, 3, 5};
      if (skip_window && s == 2) std::erase(order, 4);
      MicroBatch(**e, batch++, order, scale, (poison && last && s == 1) ? 1 : -1);
      auto st = (*e)->Step();
      EXPECT_TRUE(st.ok()) << st.status();
      if (!st.ok()) return r;
      if (last) {
        r.norms.push_back(st->grad_norm);
        r.applied.push_back(st->applied ? 1 : 0);
      }
      r.speculated += st->sub_groups_speculated;
      r.redone += st->sub_groups_redone;
    }
  }
  r.folded = PlanFolds(**e);
  r.copied_in = PlanSumsCopiedIn(**e);
  for (const TierBudget& b : (*e)->Budgets())
    if (b.tier == "pinned") r.pinned_needed = b.needed_bytes;
  r.params = ReadAll(**e);
  return r;
}

// The config TrainOddOrders runs with: `gas` micro-batches a window; fp16
// with a small initial scale that the poisoned step lowers, or bf16 with
// clipping that clips (the norm is well above 0.3).
Config OddOrdersConfig(OffloadDevice opt, OffloadDevice par, const std::string& dir, int gas,
                       bool fp16) {
  Config c = BaseConfig(opt, par, dir);
  c.gradient_accumulation_steps = c.train_batch_size = gas;
  if (fp16) {
    c.fp16.enabled = true;
    c.fp16.initial_scale_power = 6;
    c.fp16.hysteresis = 1;
  } else {
    c.gradient_clipping = 0.3;
  }
  return c;
}

// Test names for (optimizer placement, parameter placement,
// gradient_accumulation_steps): "opt_cpu_param_none_gas2".
std::string PlacementGasName(
    const ::testing::TestParamInfo<std::tuple<OffloadDevice, OffloadDevice, int>>& info) {
  return testing::PlacementName(std::get<0>(info.param), std::get<1>(info.param)) + "_gas" +
         std::to_string(std::get<2>(info.param));
}

// (optimizer placement, parameter placement, gradient_accumulation_steps)
class FoldTest : public ::testing::TestWithParam<std::tuple<OffloadDevice, OffloadDevice, int>> {};

// Folding changes no bit: parameters after every step, the global norm (and
// so the clip coefficient) and the overflow skip are those of the plain
// accumulation path, for every placement, with and without accumulation,
// with a module missing from and a module twice in the last micro-batch.
TEST_P(FoldTest, BitwiseIdenticalToAccumulating) {
  testing::ScratchDir dir;
  uint64_t seed = 0;
  testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto [opt, par, gas] = GetParam();
  for (bool fp16 : {false, true}) {
    SCOPED_TRACE(fp16 ? "fp16" : "bf16 + clipping");
    Config c = OddOrdersConfig(opt, par, dir.str(), gas, fp16);
    c.strata.grad_accumulator = GradAccumulatorPlace::kHost;  // folding is for the host sum
    const FoldRun plain = TrainOddOrders(c, seed, 3, fp16, /*fold_override=*/0);
    const FoldRun folded = TrainOddOrders(c, seed, 3, fp16, /*fold_override=*/-1);
    ASSERT_FALSE(plain.params.empty());
    EXPECT_FALSE(plain.folded);
    EXPECT_TRUE(folded.folded) << "the plan did not fold";
    EXPECT_TRUE(BitwiseEqual(plain.params, folded.params));
    EXPECT_EQ(plain.norms, folded.norms);  // bitwise: same doubles
    EXPECT_EQ(plain.applied, folded.applied);
    if (fp16) {
      EXPECT_EQ(folded.applied, (std::vector<int>{1, 0, 1}));  // the overflow skipped step 2
    } else {
      EXPECT_GT(folded.norms[0], 0.3);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Placements, FoldTest,
    ::testing::Combine(::testing::Values(OffloadDevice::kNone, OffloadDevice::kCpu,
                                         OffloadDevice::kNvme),
                       ::testing::Values(OffloadDevice::kNone, OffloadDevice::kNvme),
                       ::testing::Values(1, 3)),
    PlacementGasName);

bool PlanSumsInHbm(Engine& e) {
  for (const TierBudget& b : e.Budgets())
    if (b.detail.find("window gradient accumulator") != std::string::npos) return true;
  return false;
}

// (optimizer placement, parameter placement, gradient_accumulation_steps)
class DeviceAccumulatorTest
    : public ::testing::TestWithParam<std::tuple<OffloadDevice, OffloadDevice, int>> {};

// The window's gradients summed in HBM (strata.grad_accumulator device) give
// the bits of the host sum: parameters, norms and overflow skips, with a
// module missing from the last micro-batch (offloaded at the window's end)
// and one used twice in it, a window without one module at all, clipping
// and fp16 overflow; the sums copied straight into a pinned accumulator
// (which the step does not zero) and, with a pinned budget too small for
// it, through the staging buffers.
TEST_P(DeviceAccumulatorTest, BitwiseIdenticalToTheHostSum) {
  testing::ScratchDir dir;
  uint64_t seed = 0;
  testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto [opt, par, gas] = GetParam();
  // Sub-groups of 100 elements: blocks of the checks inside the module used
  // twice (its checks computed ahead, then dropped by the second sum).
  for (const auto& [fp16, sub_group] : {std::pair{false, int64_t{0}}, std::pair{true, int64_t{0}},
                                        std::pair{false, int64_t{100}}}) {
    SCOPED_TRACE(fp16 ? "fp16" : "bf16 + clipping");
    SCOPED_TRACE("sub_group_size " + std::to_string(sub_group));
    Config c = OddOrdersConfig(opt, par, dir.str(), gas, fp16);
    if (sub_group > 0) c.zero_optimization.sub_group_size = sub_group;
    c.strata.grad_accumulator = GradAccumulatorPlace::kHost;
    const FoldRun host = TrainOddOrders(c, seed, 4, fp16, /*fold_override=*/0, true);
    ASSERT_FALSE(host.params.empty());
    c.strata.grad_accumulator = GradAccumulatorPlace::kDevice;
    int64_t without_accumulator = 0;
    for (const bool pin : {true, false}) {
      SCOPED_TRACE(pin ? "copied into the accumulator" : "through the staging buffers");
      Config d = c;
      // One byte less than the first run's pinned bytes: the rest fits, the
      // accumulator (placed last) does not.
      if (!pin) d.strata.pinned_budget_bytes = without_accumulator;
      const FoldRun device = TrainOddOrders(d, seed, 4, fp16, /*fold_override=*/-1, true);
      without_accumulator = device.pinned_needed - 1;
      EXPECT_EQ(device.copied_in, pin);
      EXPECT_FALSE(device.folded);
      EXPECT_TRUE(BitwiseEqual(host.params, device.params));
      EXPECT_EQ(host.norms, device.norms);
      EXPECT_EQ(host.applied, device.applied);
      if (fp16) {
        EXPECT_EQ(device.applied, (std::vector<int>{1, 0, 1, 1}));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Placements, DeviceAccumulatorTest,
    ::testing::Combine(::testing::Values(OffloadDevice::kNone, OffloadDevice::kCpu,
                                         OffloadDevice::kNvme),
                       ::testing::Values(OffloadDevice::kNone, OffloadDevice::kNvme),
                       ::testing::Values(2, 3)),
    PlacementGasName);

bool PlanGradsOnNvme(Engine& e) {
  for (const TierBudget& b : e.Budgets())
    if (b.detail.find("gradient cache") != std::string::npos) return true;
  return false;
}

// (parameter placement, gradient_accumulation_steps); the optimizer on NVMe.
class GradsOnNvmeTest : public ::testing::TestWithParam<std::tuple<OffloadDevice, int>> {};

// The window's gradient sums on NVMe (strata.grad_tier nvme: a cache of two
// of the toy's four sub-groups, the rest written out and read back) give the
// bits of cpu/cpu with the sums in DRAM: parameters, norms and overflow
// skips, with a module missing from the last micro-batch and one used twice
// in it (a sub-group added into again after being written out), clipping and
// fp16 overflow.
TEST_P(GradsOnNvmeTest, BitwiseIdenticalToCpuCpu) {
  testing::ScratchDir dir;
  uint64_t seed = 0;
  testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto [par, gas] = GetParam();
  for (bool fp16 : {false, true}) {
    SCOPED_TRACE(fp16 ? "fp16" : "bf16 + clipping");
    Config ref = OddOrdersConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str(), gas, fp16);
    ref.strata.grad_accumulator = GradAccumulatorPlace::kHost;
    const FoldRun cpu = TrainOddOrders(ref, seed, 3, fp16, /*fold_override=*/0);
    Config c = OddOrdersConfig(OffloadDevice::kNvme, par, dir.str(), gas, fp16);
    c.strata.grad_accumulator = GradAccumulatorPlace::kHost;
    c.strata.grad_tier = GradTier::kNvme;
    const FoldRun nvme = TrainOddOrders(c, seed, 3, fp16, /*fold_override=*/-1);
    ASSERT_FALSE(cpu.params.empty());
    ASSERT_FALSE(nvme.params.empty());
    EXPECT_TRUE(BitwiseEqual(cpu.params, nvme.params));
    EXPECT_EQ(cpu.norms, nvme.norms);  // bitwise: same doubles
    EXPECT_EQ(cpu.applied, nvme.applied);
    if (fp16) {
      EXPECT_EQ(nvme.applied, (std::vector<int>{1, 0, 1}));  // the overflow skipped step 2
    } else {
      EXPECT_GT(nvme.norms[0], 0.3);
    }
  }
  // The plan put them there.
  Config c = OddOrdersConfig(OffloadDevice::kNvme, par, dir.str(), gas, false);
  c.strata.grad_tier = GradTier::kNvme;
  auto e = CreateEngine(c);
  ASSERT_TRUE(e.ok());
  Register(**e, seed);
  ASSERT_TRUE((*e)->Plan().ok());
  EXPECT_TRUE(PlanGradsOnNvme(**e));
}

INSTANTIATE_TEST_SUITE_P(Placements, GradsOnNvmeTest,
                         ::testing::Combine(::testing::Values(OffloadDevice::kCpu,
                                                              OffloadDevice::kNvme),
                                            ::testing::Values(1, 2, 3)),
                         [](const auto& info) {
                           return "param_" +
                                  std::string(OffloadDeviceName(std::get<0>(info.param))) + "_gas" +
                                  std::to_string(std::get<1>(info.param));
                         });

// The swap store is opened with the plan's NVMe row as its capacity, which
// counts each shard's page rounding and, over several paths, its striping
// headroom (plan.cc, PlanNvme): states, parameters and the window's sums on
// one and on three paths, at sub-groups far smaller than a stripe (7
// elements: shards of a page) and larger, fp32 and int8 states, train with
// the bits of cpu/cpu.
TEST(EngineTest, SmallSubGroupsOnSeveralNvmePathsFitThePlannedSwap) {
  testing::ScratchDir dir;
  uint64_t seed = 0;
  testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const auto& [sub_group, states] : {std::pair{int64_t{7}, OptimizerStates::kFp32},
                                          std::pair{int64_t{1000}, OptimizerStates::kFp32},
                                          std::pair{int64_t{300}, OptimizerStates::kInt8}}) {
    Config ref = OddOrdersConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str(), 2, false);
    ref.zero_optimization.sub_group_size = sub_group;
    ref.strata.optimizer_states = states;
    ref.strata.grad_accumulator = GradAccumulatorPlace::kHost;
    const FoldRun cpu = TrainOddOrders(ref, seed, 2, false, /*fold_override=*/0);
    ASSERT_FALSE(cpu.params.empty());
    for (const int paths : {1, 3}) {
      SCOPED_TRACE(fmt::format("sub_group_size {}, {} path(s)", sub_group, paths));
      std::vector<std::string> dirs;
      for (int i = 0; i < paths; ++i) {
        dirs.push_back(fmt::format("{}/nvme-{}-{}-{}", dir.str(), sub_group, paths, i));
        std::filesystem::create_directories(dirs.back());
      }
      Config c = OddOrdersConfig(OffloadDevice::kNvme, OffloadDevice::kNvme, dir.str(), 2, false);
      c.zero_optimization.sub_group_size = sub_group;
      c.strata.optimizer_states = states;
      c.zero_optimization.offload_optimizer.nvme_path = dirs;
      c.zero_optimization.offload_param.nvme_path = dirs;
      c.strata.grad_accumulator = GradAccumulatorPlace::kHost;
      c.strata.grad_tier = GradTier::kNvme;
      const FoldRun nvme = TrainOddOrders(c, seed, 2, false, /*fold_override=*/-1);
      ASSERT_FALSE(nvme.params.empty());
      EXPECT_TRUE(BitwiseEqual(cpu.params, nvme.params));
      EXPECT_EQ(cpu.norms, nvme.norms);
    }
  }
}

// With the window's sums on NVMe, a window whose backward runs the modules
// in descending order writes each sub-group's sums out at most once, the
// sub-group holding the first element not at all (it stays cached for the
// step), although the toy's modules straddle sub-groups and each module's
// gradients arrive in several ascending chunks.
TEST(GradsOnNvmeWriteTest, EachSubGroupIsWrittenAtMostOnceAWindow) {
  testing::ScratchDir dir;
  int64_t total = 0;  // the toy's elements: each tensor starts on 4 elements
  for (int m = 0; m < kModules; ++m)
    for (int i = 0; i < 2; ++i) total = (total + 3) / 4 * 4 + testing::ToyNumel(m, i);
  const int64_t groups = (total + 999) / 1000;  // sub_group_size 1000
  ASSERT_GE(groups, 3);
  int64_t written[2] = {};
  for (const bool nvme : {false, true}) {
    Config c = BaseConfig(OffloadDevice::kNvme, OffloadDevice::kCpu, dir.str());
    c.strata.overlap_optimizer = false;
    c.strata.grad_tier = nvme ? GradTier::kNvme : GradTier::kDram;
    StepStats st;
    Train(c, 5, 3, &st);
    written[nvme ? 1 : 0] = st.nvme_written_bytes;
  }
  const int64_t sums = written[1] - written[0];  // the gradients' writes, 3 windows
  EXPECT_GT(sums, 0);
  EXPECT_LE(sums, 3 * (groups - 1) * scheduler::kIoAlign) << groups << " sub-groups";
}

bool PlanGradsInHbm(Engine& e) {
  for (const TierBudget& b : e.Budgets())
    if (b.tier == "hbm" && b.detail.find("window gradient sums") != std::string::npos) return true;
  return false;
}

// (parameter placement, gradient_accumulation_steps); the optimizer on the CPU.
class GradsInHbmTest : public ::testing::TestWithParam<std::tuple<OffloadDevice, int>> {};

// The window's gradient sums kept in HBM until the step (strata.grad_tier
// hbm: no host accumulator; the checks and the step copy them over a chunk
// at a time) give the bits of the sums in DRAM: parameters, norms and
// overflow skips, with a module missing from the last micro-batch and one
// used twice in it, clipping that triggers and fp16 overflow, with the
// step overlapping the next forward pass and inline.
TEST_P(GradsInHbmTest, BitwiseIdenticalToTheSumsInDram) {
  testing::ScratchDir dir;
  uint64_t seed = 0;
  testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto [par, gas] = GetParam();
  for (bool fp16 : {false, true}) {
    for (bool overlap : {true, false}) {
      SCOPED_TRACE(std::string(fp16 ? "fp16" : "bf16 + clipping") +
                   (overlap ? ", overlapped step" : ", inline step"));
      Config ref = OddOrdersConfig(OffloadDevice::kCpu, par, dir.str(), gas, fp16);
      ref.strata.grad_accumulator = GradAccumulatorPlace::kHost;
      ref.strata.grad_tier = GradTier::kDram;
      ref.strata.overlap_optimizer = overlap;
      const FoldRun dram = TrainOddOrders(ref, seed, 3, fp16, /*fold_override=*/0);
      Config c = ref;
      c.strata.grad_tier = GradTier::kHbm;
      const FoldRun hbm = TrainOddOrders(c, seed, 3, fp16, /*fold_override=*/-1);
      ASSERT_FALSE(dram.params.empty());
      ASSERT_FALSE(hbm.params.empty());
      EXPECT_TRUE(BitwiseEqual(dram.params, hbm.params));
      EXPECT_EQ(dram.norms, hbm.norms);  // bitwise: same doubles
      EXPECT_EQ(dram.applied, hbm.applied);
      EXPECT_FALSE(hbm.folded);
      if (fp16) {
        EXPECT_EQ(hbm.applied, (std::vector<int>{1, 0, 1}));  // the overflow skipped step 2
      } else {
        EXPECT_GT(hbm.norms[0], 0.3);
      }
    }
  }
  // The plan put them there, and no host accumulator beside them.
  Config c = OddOrdersConfig(OffloadDevice::kCpu, par, dir.str(), gas, false);
  c.strata.grad_tier = GradTier::kHbm;
  auto e = CreateEngine(c);
  ASSERT_TRUE(e.ok()) << e.status();
  Register(**e, seed);
  ASSERT_TRUE((*e)->Plan().ok());
  EXPECT_TRUE(PlanGradsInHbm(**e));
  for (const TierBudget& b : (*e)->Budgets())
    EXPECT_THAT(b.detail, ::testing::Not(::testing::HasSubstr("gradient accumulator"))) << b.tier;
}

INSTANTIATE_TEST_SUITE_P(Placements, GradsInHbmTest,
                         ::testing::Combine(::testing::Values(OffloadDevice::kNone,
                                                              OffloadDevice::kCpu,
                                                              OffloadDevice::kNvme),
                                            ::testing::Values(1, 2, 3)),
                         [](const auto& info) {
                           return "param_" +
                                  std::string(OffloadDeviceName(std::get<0>(info.param))) + "_gas" +
                                  std::to_string(std::get<1>(info.param));
                         });

// ZeroGrad in the middle of a window drops the sums in HBM: the engine then
// holds what one with the sums in DRAM that never saw the dropped
// micro-batch holds.
TEST(GradsInHbmTest, ZeroGradDropsTheSums) {
  testing::ScratchDir dir;
  Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kNone, dir.str());
  c.strata.grad_tier = GradTier::kHbm;
  auto e = CreateEngine(c);
  ASSERT_TRUE(e.ok()) << e.status();
  Register(**e, 21);
  MicroBatch(**e, 7, Forward());
  ASSERT_TRUE((*e)->ZeroGrad().ok());
  for (int batch : {0, 2}) {
    MicroBatch(**e, batch, Forward());
    ASSERT_TRUE((*e)->Step().ok());
  }
  EXPECT_TRUE(PlanGradsInHbm(**e));
  Config dram = c;
  dram.strata.grad_tier = GradTier::kDram;
  EXPECT_TRUE(BitwiseEqual(TrainedOnBatches0And2(dram), ReadAll(**e)));
}

// I/O faults on the gradient shards fail the window like faults on the state
// files: a write while backward runs, or a read by the optimizer pipeline;
// the parameters and states stay those of the previous step, and the next
// window trains as if the failed one had never been.
TEST(GradsOnNvmeFaultTest, FailedGradientIoRollsBack) {
  for (const bool read : {false, true}) {
    SCOPED_TRACE(read ? "read" : "write");
    testing::ScratchDir dir;
    // Parameters in DRAM: the only reads in a window are the states' and
    // the gradients'.
    Config c = BaseConfig(OffloadDevice::kNvme, read ? OffloadDevice::kCpu : OffloadDevice::kNvme,
                          dir.str());
    c.strata.grad_tier = GradTier::kNvme;
    c.strata.overlap_optimizer = false;
    nvme::FaultInjectionEngine* faults = nullptr;
    auto e = CreateEngine(c, FaultHooks(&faults));
    ASSERT_TRUE(e.ok()) << e.status();
    Register(**e, 21);
    MicroBatch(**e, 0, Forward());
    ASSERT_TRUE((*e)->Step().ok());
    ASSERT_TRUE(PlanGradsOnNvme(**e));
    auto after_one = ReadAll(**e);

    nvme::FaultInjectionEngine::Rule rule;
    rule.kind = read ? nvme::IoOpKind::kRead : nvme::IoOpKind::kWrite;
    rule.nth = 1;
    rule.err = 5;  // EIO
    rule.times = 1000;
    Status failed;
    if (read) {
      // After backward (the states of the first sub-groups are read ahead
      // then): the step's first read is a written-out sub-group's gradients.
      MicroBatch(**e, 1, Forward());
      faults->AddRule(rule);
      failed = (*e)->Step().status();
    } else {
      // During backward, the only writes are the gradients' write-behind.
      faults->AddRule(rule);
      failed = MicroBatchUntilError(**e, 1);
    }
    faults->ClearRules();
    ASSERT_FALSE(failed.ok());
    EXPECT_GT(faults->faults_injected(), 0);
    EXPECT_THAT(std::string(failed.message()), ::testing::HasSubstr("gradients of sub-group"));
    EXPECT_TRUE(BitwiseEqual(after_one, ReadAll(**e)));

    MicroBatch(**e, 2, Forward());
    auto ok = (*e)->Step();
    ASSERT_TRUE(ok.ok()) << ok.status();
    EXPECT_TRUE(BitwiseEqual(TrainedOnBatches0And2(c), ReadAll(**e)));
  }
}

// The engine follows the plan (plan_test.cc has the rule on hand-made
// sizes): device when asked or when it pays, never with one micro-batch or
// delayed_param_update; ZeroGrad in the middle of a window drops the device
// sum too.
TEST(DeviceAccumulatorPlanTest, ChoiceAndZeroGrad) {
  testing::ScratchDir dir;
  Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  c.gradient_accumulation_steps = c.train_batch_size = 2;
  auto planned = [&](const Config& cfg) {
    auto e = CreateEngine(cfg);
    EXPECT_TRUE(e.ok()) << e.status();
    Register(**e, 1);
    EXPECT_TRUE((*e)->Plan().ok());
    return PlanSumsInHbm(**e);
  };
  EXPECT_FALSE(planned(c));  // auto, on the host device: the host sums
  c.strata.grad_accumulator = GradAccumulatorPlace::kDevice;
  EXPECT_TRUE(planned(c));
  c.strata.delayed_param_update = true;
  EXPECT_FALSE(planned(c));
  c.strata.delayed_param_update = false;
  c.gradient_accumulation_steps = c.train_batch_size = 1;
  EXPECT_FALSE(planned(c));
  c.gradient_accumulation_steps = c.train_batch_size = 2;

  // ZeroGrad after one micro-batch, then a full window: as on the host.
  std::vector<std::vector<std::vector<float>>> result;
  for (GradAccumulatorPlace place : {GradAccumulatorPlace::kHost, GradAccumulatorPlace::kDevice}) {
    c.strata.grad_accumulator = place;
    auto e = CreateEngine(c);
    ASSERT_TRUE(e.ok());
    Register(**e, 4);
    MicroBatch(**e, 0, Forward());
    ASSERT_TRUE((*e)->Step().ok());
    ASSERT_TRUE((*e)->ZeroGrad().ok());
    for (int k = 0; k < 2; ++k) {
      MicroBatch(**e, 1 + k, Forward());
      ASSERT_TRUE((*e)->Step().ok());
    }
    result.push_back(ReadAll(**e));
  }
  EXPECT_TRUE(BitwiseEqual(result[0], result[1]));
}

// delayed_param_update keeps the plain path (the step reads the window's
// gradients while the next window runs), and the plan table says so.
TEST(FoldPlanTest, DelayedParamUpdateDoesNotFold) {
  testing::ScratchDir dir;
  Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  c.strata.delayed_param_update = true;
  auto e = CreateEngine(c);
  ASSERT_TRUE(e.ok());
  Register(**e, 1);
  ASSERT_TRUE((*e)->Plan().ok());
  EXPECT_FALSE(PlanFolds(**e));
  bool said = false;
  for (const TierBudget& b : (*e)->Budgets())
    said |=
        b.detail.find("last micro-batch accumulated (delayed_param_update") != std::string::npos;
  EXPECT_TRUE(said);
}

// The plan's pinned and DRAM rows are the bytes the engine allocates, in
// every placement, with the step overlapping the forward pass or inline,
// and with the device optimizer: nothing the plan counts goes unallocated,
// and nothing is allocated that it does not count (a host mirror of the
// device parameters only where an overlapped step uploads modules as it
// goes). (Two ranks: DataParallelPlacementTest.)
TEST(PlanBytesTest, PlanRowsAreTheBytesAllocated) {
  struct Case {
    OffloadDevice opt, par;
    bool overlap, device_optimizer;
    bool speculate = false;
    GradTier tier = GradTier::kAuto;
  };
  std::vector<Case> cases;
  for (OffloadDevice opt : {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme})
    for (OffloadDevice par : {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme})
      for (bool overlap : {false, true}) cases.push_back({opt, par, overlap, false});
  cases.push_back({OffloadDevice::kNone, OffloadDevice::kNone, true, true});
  // The speculative step's spare states (where it applies).
  for (OffloadDevice opt : {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme})
    for (OffloadDevice par : {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme})
      cases.push_back({opt, par, true, false, true});
  // The window's sums in HBM (the chunk buffers pinned, no accumulator).
  for (OffloadDevice par : {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme})
    for (bool overlap : {false, true})
      cases.push_back({OffloadDevice::kCpu, par, overlap, false, false, GradTier::kHbm});
  for (const Case& k : cases) {
    SCOPED_TRACE(fmt::format("{} overlap {} device optimizer {} speculative {} grad_tier {}",
                             testing::PlacementName(k.opt, k.par), k.overlap, k.device_optimizer,
                             k.speculate, GradTierName(k.tier)));
    testing::ScratchDir dir;
    const scheduler::HostArray::Live before = scheduler::HostArray::LiveBytes();
    Config c = BaseConfig(k.opt, k.par, dir.str());
    c.strata.overlap_optimizer = k.overlap;
    c.strata.speculative_step = k.speculate;
    c.strata.grad_tier = k.tier;
    EngineTestHooks hooks;
    hooks.device_optimizer = k.device_optimizer;
    auto e = CreateEngine(c, hooks);
    ASSERT_TRUE(e.ok()) << e.status();
    Register(**e, 5);
    ASSERT_NO_FATAL_FAILURE(MicroBatch(**e, 0, Forward()));
    auto st = (*e)->Step();
    ASSERT_TRUE(st.ok()) << st.status();
    ASSERT_TRUE((*e)->Synchronize().ok());
    const scheduler::HostArray::Live after = scheduler::HostArray::LiveBytes();
    int64_t pinned = 0, dram = 0;
    std::string detail;
    for (const TierBudget& b : (*e)->Budgets()) {
      if (b.tier == "pinned") pinned = b.needed_bytes;
      if (b.tier == "dram") dram = b.needed_bytes;
      detail += b.tier + ": " + b.detail + "\n";
    }
    EXPECT_EQ(dram, after.pageable - before.pageable) << detail;
    EXPECT_EQ(pinned, st->pinned_high_water_bytes) << detail;
  }
}

// ---- The speculative step (strata.speculative_step) ----------------------------

// What is speculated does not depend on the threads' timing.
EngineTestHooks SpeculationHooks() {
  EngineTestHooks hooks;
  hooks.speculation_steps_all_handed_over = true;
  return hooks;
}

// (optimizer placement, parameter placement, gradient_accumulation_steps)
class SpeculationTest
    : public ::testing::TestWithParam<std::tuple<OffloadDevice, OffloadDevice, int>> {};

// Stepping sub-groups during the last backward pass changes no bit:
// parameters, norms and skips are those of the step after backward, with
// clipping that never triggers (every speculated sub-group kept), clipping
// that always does (every one redone), and fp16 with an overflow (dropped
// with the skipped step); in the odd orders of TrainOddOrders (a module
// missing from the last micro-batch holds the speculation at its
// sub-groups; one used twice; sub-groups of 100 elements) and in plain
// order (sub-groups that split parameters).
TEST_P(SpeculationTest, BitwiseIdenticalToTheStepAfterBackward) {
  testing::ScratchDir dir;
  uint64_t seed = 0;
  testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto [opt, par, gas] = GetParam();
  enum Kind { kNoClip, kClips, kFp16Overflow };
  // States on NVMe: with the window's sums in DRAM and on NVMe.
  std::vector<GradTier> tiers = {GradTier::kDram};
  if (opt == OffloadDevice::kNvme) tiers.push_back(GradTier::kNvme);
  for (GradTier tier : tiers)
    for (Kind kind : {kNoClip, kClips, kFp16Overflow})
      for (bool odd : {false, true}) {
        SCOPED_TRACE(fmt::format("kind {} odd orders {} sums {}", static_cast<int>(kind), odd,
                                 GradTierName(tier)));
        Config c = OddOrdersConfig(opt, par, dir.str(), gas, kind == kFp16Overflow);
        c.strata.grad_tier = tier;
        if (kind == kNoClip) c.gradient_clipping = 1e6;
        // (Odd orders: sub-groups inside the last module, above the one left
        // out of the last micro-batch.)
        if (odd) c.zero_optimization.sub_group_size = 100;
        c.strata.speculative_step = false;
        const int steps = 3;
        auto run = [&](const Config& cfg) {
          if (odd)
            return TrainOddOrders(cfg, seed, steps, kind == kFp16Overflow, /*fold_override=*/-1);
          FoldRun r;
          auto e = CreateEngine(cfg, SpeculationHooks());
          EXPECT_TRUE(e.ok()) << e.status();
          if (!e.ok()) return r;
          Register(**e, seed);
          int batch = 0;
          for (int s = 0; s < steps; ++s)
            for (int64_t k = 0; k < cfg.gradient_accumulation_steps; ++k) {
              const bool last = k + 1 == cfg.gradient_accumulation_steps;
              MicroBatch(**e, batch++, Forward(), kind == kFp16Overflow ? 64.f : 1.f,
                         kind == kFp16Overflow && last && s == 1 ? 1 : -1);
              auto st = (*e)->Step();
              EXPECT_TRUE(st.ok()) << st.status();
              if (!st.ok()) return r;
              if (last) {
                r.norms.push_back(st->grad_norm);
                r.applied.push_back(st->applied ? 1 : 0);
              }
              r.speculated += st->sub_groups_speculated;
              r.redone += st->sub_groups_redone;
            }
          r.params = ReadAll(**e);
          return r;
        };
        const FoldRun after = run(c);
        c.strata.speculative_step = true;
        const FoldRun spec = run(c);
        ASSERT_FALSE(after.params.empty());
        EXPECT_TRUE(BitwiseEqual(after.params, spec.params));
        EXPECT_EQ(after.norms, spec.norms);
        EXPECT_EQ(after.applied, spec.applied);
        EXPECT_EQ(after.speculated, 0);
        EXPECT_GT(spec.speculated, 0);
        if (kind == kNoClip) {
          EXPECT_EQ(spec.redone, 0);
        } else if (kind == kClips) {
          EXPECT_EQ(spec.redone, spec.speculated);
        } else {
          EXPECT_GT(spec.redone, 0);  // the overflowed window's
          EXPECT_LT(spec.redone, spec.speculated);
          EXPECT_EQ(spec.applied, (std::vector<int>{1, 0, 1}));
        }
      }
}

INSTANTIATE_TEST_SUITE_P(
    Placements, SpeculationTest,
    ::testing::Combine(
        ::testing::Values(OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme),
        ::testing::Values(OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme),
        ::testing::Values(1, 2, 4)),
    PlacementGasName);

// What voids a speculation, each on its own window, still gives the bits
// of the step after backward: the last module's backward running twice
// after its sub-groups were handed over, a learning rate changed between
// the backward pass and Step(), ReadParameter between the backward pass and
// Step(), ZeroGrad in the middle of the last micro-batch, and a checkpoint
// saved and loaded between windows.
// (offload_optimizer cpu or nvme, offload_param, strata.grad_tier)
class SpeculationVoidTest
    : public ::testing::TestWithParam<std::tuple<OffloadDevice, OffloadDevice, GradTier>> {};

TEST_P(SpeculationVoidTest, WhatVoidsItKeepsTheBits) {
  testing::ScratchDir dir;
  uint64_t seed = 0;
  testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  Config c = BaseConfig(std::get<0>(GetParam()), std::get<1>(GetParam()), dir.str());
  c.strata.grad_tier = std::get<2>(GetParam());
  c.zero_optimization.sub_group_size = 100;
  c.gradient_clipping = 1e6;
  const int kSteps = 6;
  // (gtest's ASSERTs need a void function.)
  auto run = [&](bool speculate, std::vector<std::vector<float>>* mid, FoldRun* counts,
                 std::vector<std::vector<float>>* out) {
    Config cfg = c;
    cfg.strata.speculative_step = speculate;
    auto e = CreateEngine(cfg, SpeculationHooks());
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return;
    Register(**e, seed);
    for (int s = 0; s < kSteps; ++s) {
      std::vector<int> order = Forward();
      if (s == 0) order.push_back(kModules - 1);  // its backward first, twice
      if (s == 3) {
        // ZeroGrad half-way through the backward pass, then the whole
        // micro-batch again.
        for (int m : order) {
          ASSERT_TRUE((*e)->BeforeForward(m).ok());
          ASSERT_TRUE((*e)->AfterForward(m).ok());
        }
        for (int m = kModules - 1; m >= kModules / 2; --m) {
          auto v = (*e)->BeforeBackward(m);
          ASSERT_TRUE(v.ok()) << v.status();
          ASSERT_TRUE((*e)->AfterBackward(m).ok());
        }
        ASSERT_TRUE((*e)->ZeroGrad().ok());
      }
      MicroBatch(**e, s, order);
      if (s == 1) {
        ASSERT_TRUE((*e)->SetLearningRate(3e-3).ok());
      }
      if (s == 2) {
        *mid = ReadAll(**e);
      }
      auto st = (*e)->Step();
      ASSERT_TRUE(st.ok()) << st.status();
      counts->speculated += st->sub_groups_speculated;
      counts->redone += st->sub_groups_redone;
      if (s == 4) {
        const std::string ck = (dir.path() / (speculate ? "spec" : "plain")).string();
        ASSERT_TRUE((*e)->SaveCheckpoint(ck, CheckpointInfo{}).ok());
        ASSERT_TRUE((*e)->LoadCheckpoint(ck, nullptr).ok());
      }
    }
    *out = ReadAll(**e);
  };
  std::vector<std::vector<float>> mid_after, mid_spec;
  FoldRun after_counts, spec_counts;
  std::vector<std::vector<float>> after, spec;
  run(false, &mid_after, &after_counts, &after);
  run(true, &mid_spec, &spec_counts, &spec);
  ASSERT_FALSE(after.empty());
  EXPECT_TRUE(BitwiseEqual(mid_after, mid_spec));  // ReadParameter saw no speculated state
  EXPECT_TRUE(BitwiseEqual(after, spec));
  // The optimizer states too, as the checkpoints saved them: the same bytes.
  auto saved = [&](const char* run, const char* file) {
    for (const auto& d : std::filesystem::directory_iterator(dir.path() / run))
      if (d.path().filename().string().rfind("ckpt-", 0) == 0) {
        std::ifstream in(d.path() / file, std::ios::binary);
        return std::string(std::istreambuf_iterator<char>(in), {});
      }
    return std::string();
  };
  for (const char* file : {"states.bin", "params.bin"}) {
    const std::string a = saved("plain", file), b = saved("spec", file);
    EXPECT_FALSE(a.empty()) << file;
    EXPECT_TRUE(a == b) << file << " differs";
  }
  EXPECT_EQ(after_counts.speculated, 0);
  EXPECT_GT(spec_counts.speculated, 0);
  EXPECT_GT(spec_counts.redone, 0);
  EXPECT_LT(spec_counts.redone, spec_counts.speculated);  // steps 4 and 5 kept theirs
}

INSTANTIATE_TEST_SUITE_P(
    Placements, SpeculationVoidTest,
    ::testing::Values(std::tuple{OffloadDevice::kCpu, OffloadDevice::kCpu, GradTier::kDram},
                      std::tuple{OffloadDevice::kCpu, OffloadDevice::kNvme, GradTier::kDram},
                      std::tuple{OffloadDevice::kNvme, OffloadDevice::kCpu, GradTier::kDram},
                      std::tuple{OffloadDevice::kNvme, OffloadDevice::kNvme, GradTier::kDram},
                      // The window's sums on NVMe too.
                      std::tuple{OffloadDevice::kNvme, OffloadDevice::kCpu, GradTier::kNvme},
                      std::tuple{OffloadDevice::kNvme, OffloadDevice::kNvme, GradTier::kNvme}),
    [](const auto& info) {
      const GradTier tier = std::get<2>(info.param);
      return testing::PlacementName(std::get<0>(info.param), std::get<1>(info.param)) +
             (tier == GradTier::kNvme ? "_sums_nvme" : "");
    });

// strata.speculative_step on the host device: off unless asked (auto), and
// where it does not apply the step runs after backward.
TEST(SpeculationTest, WhereItApplies) {
  testing::ScratchDir dir;
  auto speculated = [&](OffloadDevice opt, OffloadDevice par, std::optional<bool> on) {
    Config c = BaseConfig(opt, par, dir.str());
    c.zero_optimization.sub_group_size = 100;
    c.strata.speculative_step = on;
    auto e = CreateEngine(c, SpeculationHooks());
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return int64_t{-1};
    Register(**e, 3);
    MicroBatch(**e, 0, Forward());
    auto st = (*e)->Step();
    EXPECT_TRUE(st.ok()) << st.status();
    return st.ok() ? st->sub_groups_speculated : -1;
  };
  EXPECT_GT(speculated(OffloadDevice::kCpu, OffloadDevice::kNone, true), 0);
  EXPECT_EQ(speculated(OffloadDevice::kCpu, OffloadDevice::kNone, std::nullopt), 0);
  EXPECT_EQ(speculated(OffloadDevice::kCpu, OffloadDevice::kNone, false), 0);
  EXPECT_GT(speculated(OffloadDevice::kNvme, OffloadDevice::kCpu, true), 0);
  EXPECT_GT(speculated(OffloadDevice::kCpu, OffloadDevice::kNvme, true), 0);
}

// States on NVMe: the speculation steps through the pipeline buffers the
// read-ahead leaves it (one, with offload_optimizer.buffer_count 1 or 2 as
// with 4), with the bits of the step after backward.
TEST(SpeculationTest, NvmeStatesWithFewPipelineBuffers) {
  for (int64_t buffers : {1, 2, 4}) {
    SCOPED_TRACE(fmt::format("buffer_count {}", buffers));
    testing::ScratchDir dir;
    Config c = BaseConfig(OffloadDevice::kNvme, OffloadDevice::kNvme, dir.str());
    c.zero_optimization.sub_group_size = 100;
    c.zero_optimization.offload_optimizer.buffer_count = buffers;
    c.gradient_clipping = 1e6;
    std::vector<std::vector<float>> params[2];
    int64_t speculated = 0, redone = 0;
    for (bool speculate : {false, true}) {
      c.strata.speculative_step = speculate;
      auto e = CreateEngine(c, SpeculationHooks());
      ASSERT_TRUE(e.ok()) << e.status();
      Register(**e, 31);
      for (int s = 0; s < 3; ++s) {
        MicroBatch(**e, s, Forward());
        auto st = (*e)->Step();
        ASSERT_TRUE(st.ok()) << st.status();
        if (speculate) {
          speculated += st->sub_groups_speculated;
          redone += st->sub_groups_redone;
        }
      }
      params[speculate] = ReadAll(**e);
    }
    EXPECT_TRUE(BitwiseEqual(params[0], params[1]));
    EXPECT_GT(speculated, 0);
    EXPECT_EQ(redone, 0);
  }
}

// A speculated NVMe write that fails voids the speculation: a module's
// (offload_param nvme) or a sub-group's states (offload_optimizer nvme).
// The step after the checks steps and writes everything again (the states'
// active versions are untouched), and the run goes on with the bits of one
// that never speculated.
TEST(SpeculationTest, AFailedNvmeWriteIsRedone) {
  for (auto [opt, par] : {std::pair{OffloadDevice::kCpu, OffloadDevice::kNvme},
                          std::pair{OffloadDevice::kNvme, OffloadDevice::kCpu}}) {
    SCOPED_TRACE(testing::PlacementName(opt, par));
    testing::ScratchDir dir;
    Config c = BaseConfig(opt, par, dir.str());
    c.zero_optimization.sub_group_size = 100;
    c.gradient_clipping = 1e6;
    std::vector<std::vector<float>> params[2];
    for (bool speculate : {false, true}) {
      c.strata.speculative_step = speculate;
      nvme::FaultInjectionEngine* faults = nullptr;
      EngineTestHooks hooks = FaultHooks(&faults);
      hooks.speculation_steps_all_handed_over = true;
      auto e = CreateEngine(c, hooks);
      ASSERT_TRUE(e.ok()) << e.status();
      Register(**e, 23);
      MicroBatch(**e, 0, Forward());
      ASSERT_TRUE((*e)->Step().ok());
      ASSERT_TRUE((*e)->Synchronize().ok());  // its writes have landed
      ASSERT_NE(faults, nullptr);
      nvme::FaultInjectionEngine::Rule rule;
      rule.kind = nvme::IoOpKind::kWrite;
      rule.nth = 1;  // the first write from here on: the speculation's
      rule.err = 5;  // EIO
      if (speculate) faults->AddRule(rule);
      MicroBatch(**e, 1, Forward());
      auto st = (*e)->Step();
      ASSERT_TRUE(st.ok()) << st.status();
      ASSERT_TRUE((*e)->Synchronize().ok());
      if (speculate) {
        EXPECT_EQ(faults->faults_injected(), 1);
        EXPECT_GT(st->sub_groups_speculated, 0);
        EXPECT_EQ(st->sub_groups_redone, st->sub_groups_speculated);
      }
      MicroBatch(**e, 2, Forward());
      ASSERT_TRUE((*e)->Step().ok());
      params[speculate] = ReadAll(**e);
    }
    EXPECT_TRUE(BitwiseEqual(params[0], params[1]));
  }
}

// Auto's back-off: after a rolled-back window the next 1, 2, 4, ... windows
// step after backward; a kept one resets it. The bits never change.
TEST(SpeculationTest, AutoBacksOffAfterRollbacks) {
  testing::ScratchDir dir;
  for (bool clips : {true, false}) {
    SCOPED_TRACE(clips ? "clips every window" : "never clips");
    Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
    c.gradient_clipping = clips ? 0.3 : 1e6;
    std::vector<std::vector<float>> params[2];
    std::vector<int> windows;
    for (bool speculate : {false, true}) {
      c.strata.speculative_step = speculate;
      EngineTestHooks hooks = SpeculationHooks();
      hooks.speculation_backoff = true;
      auto e = CreateEngine(c, hooks);
      ASSERT_TRUE(e.ok()) << e.status();
      Register(**e, 11);
      for (int s = 0; s < 10; ++s) {
        MicroBatch(**e, s, Forward());
        auto st = (*e)->Step();
        ASSERT_TRUE(st.ok()) << st.status();
        if (speculate && st->sub_groups_speculated > 0) windows.push_back(s);
      }
      params[speculate] = ReadAll(**e);
    }
    EXPECT_TRUE(BitwiseEqual(params[0], params[1]));
    const std::vector<int> want =
        clips ? std::vector<int>{0, 2, 5} : std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    EXPECT_EQ(windows, want);
  }
}

// ---- offload_optimizer.ratio: the first sub-groups stepped on the device ----

bool PlanStepsOnDevice(Engine& e) {
  for (const TierBudget& b : e.Budgets())
    if (b.tier == "hbm" && b.detail.find("stepped on the device") != std::string::npos) return true;
  return false;
}

// The largest difference between a and b relative to max(|a|, 1e-3).
double MaxRelDiff(const std::vector<std::vector<float>>& a,
                  const std::vector<std::vector<float>>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    for (size_t j = 0; j < a[i].size() && j < b[i].size(); ++j)
      worst = std::max(worst, std::abs(static_cast<double>(a[i][j]) - b[i][j]) /
                                  std::max(1e-3, std::abs(static_cast<double>(a[i][j]))));
  return worst;
}

// (offload_optimizer.ratio, gradient_accumulation_steps)
class RatioTest : public ::testing::TestWithParam<std::tuple<double, int>> {};

// With offload_optimizer.ratio below 1 the first sub-groups' states live in
// HBM and the device Adam steps them (the toy has 4 sub-groups of 1000
// elements, modules across their edges; the parameters in HBM or in DRAM):
// the parameters, norms and skipped steps agree with every sub-group on the
// CPU within the device Adam's tolerance (1e-6 relative; the global sum of
// squares is added in another order, so a clip coefficient may differ in
// its last bits), with clipping that triggers, fp16 overflow, a module
// missing from the last micro-batch and one used twice in it, the step
// overlapping the next forward and inline, with and without speculation,
// and with the window summed in HBM.
TEST_P(RatioTest, AgreesWithTheCpuStep) {
  testing::ScratchDir dir;
  uint64_t seed = 0;
  testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto [ratio, gas] = GetParam();
  for (const OffloadDevice par : {OffloadDevice::kNone, OffloadDevice::kCpu}) {
    SCOPED_TRACE(std::string("offload_param ") + std::string(OffloadDeviceName(par)));
    for (bool fp16 : {false, true}) {
      for (int mode = 0; mode < 4; ++mode) {
        // (Mode 3: the window summed in HBM and copied once, as on a GPU.)
        const bool overlap = mode != 1, speculate = mode == 2, device_sum = mode == 3;
        SCOPED_TRACE(std::string(fp16 ? "fp16" : "bf16 + clipping") +
                     (overlap ? ", overlapped step" : ", inline step") +
                     (speculate ? ", speculative" : "") +
                     (device_sum ? ", grad_accumulator device" : ""));
        Config ref = OddOrdersConfig(OffloadDevice::kCpu, par, dir.str(), gas, fp16);
        ref.strata.overlap_optimizer = overlap;
        ref.strata.speculative_step = speculate;
        if (device_sum) ref.strata.grad_accumulator = GradAccumulatorPlace::kDevice;
        const FoldRun cpu = TrainOddOrders(ref, seed, 3, fp16, /*fold_override=*/-1);
        Config c = ref;
        c.zero_optimization.offload_optimizer.ratio = ratio;
        const FoldRun split = TrainOddOrders(c, seed, 3, fp16, /*fold_override=*/-1);
        ASSERT_FALSE(cpu.params.empty());
        ASSERT_FALSE(split.params.empty());
        EXPECT_LE(MaxRelDiff(cpu.params, split.params), 1e-6);
        ASSERT_EQ(cpu.norms.size(), split.norms.size());
        for (size_t i = 0; i < cpu.norms.size(); ++i)
          EXPECT_NEAR(cpu.norms[i], split.norms[i], 1e-9 * cpu.norms[i]) << "step " << i;
        EXPECT_EQ(cpu.applied, split.applied);
        if (fp16) {
          EXPECT_EQ(split.applied, (std::vector<int>{1, 0, 1}));  // the overflow skipped step 2
        } else {
          EXPECT_GT(split.norms[0], 0.3);
        }
      }
    }
  }
  Config c = OddOrdersConfig(OffloadDevice::kCpu, OffloadDevice::kNone, dir.str(), gas, false);
  c.zero_optimization.offload_optimizer.ratio = ratio;
  auto e = CreateEngine(c);
  ASSERT_TRUE(e.ok()) << e.status();
  Register(**e, seed);
  ASSERT_TRUE((*e)->Plan().ok());
  EXPECT_TRUE(PlanStepsOnDevice(**e));
}

INSTANTIATE_TEST_SUITE_P(
    Ratios, RatioTest, ::testing::Combine(::testing::Values(0.5, 0.75), ::testing::Values(1, 2, 3)),
    [](const auto& info) {
      return fmt::format("ratio{}_gas{}", static_cast<int>(100 * std::get<0>(info.param)),
                         std::get<1>(info.param));
    });

// ZeroGrad in the middle of a window drops the sums below the split too:
// the engine then holds what one that never saw the dropped micro-batch
// holds (within the device Adam's tolerance of every sub-group on the CPU).
TEST(RatioZeroGradTest, DropsTheSumsInHbm) {
  testing::ScratchDir dir;
  Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kNone, dir.str());
  c.zero_optimization.offload_optimizer.ratio = 0.5;
  auto e = CreateEngine(c);
  ASSERT_TRUE(e.ok()) << e.status();
  Register(**e, 21);
  MicroBatch(**e, 7, Forward());
  ASSERT_TRUE((*e)->ZeroGrad().ok());
  for (int batch : {0, 2}) {
    MicroBatch(**e, batch, Forward());
    ASSERT_TRUE((*e)->Step().ok());
  }
  EXPECT_TRUE(PlanStepsOnDevice(**e));
  Config split = c;
  EXPECT_TRUE(BitwiseEqual(TrainedOnBatches0And2(split), ReadAll(**e)));
  Config all_cpu = c;
  all_cpu.zero_optimization.offload_optimizer.ratio = 1.0;
  EXPECT_LE(MaxRelDiff(TrainedOnBatches0And2(all_cpu), ReadAll(**e)), 1e-6);
}

// A checkpoint of a run with sub-groups stepped on the device holds their
// states: a fresh engine with the same ratio that loads it goes on bitwise
// as the run that never stopped, and one with every sub-group on the CPU
// (ratio 1) within the device Adam's tolerance; the other way round too.
// fp32 and bf16 states, clipping that triggers.
TEST(RatioCheckpointTest, ResumesWithAnyRatio) {
  testing::ScratchDir dir;
  for (const OptimizerStates states : {OptimizerStates::kFp32, OptimizerStates::kBf16}) {
    SCOPED_TRACE(OptimizerStatesName(states));
    Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kNone, dir.str());
    c.strata.optimizer_states = states;
    c.gradient_accumulation_steps = c.train_batch_size = 2;
    c.gradient_clipping = 0.3;
    Config split = c;
    split.zero_optimization.offload_optimizer.ratio = 0.5;
    // (ratio saved, ratio loaded)
    for (const auto& [saved, loaded] : {std::pair{0.5, 0.5}, {0.5, 1.0}, {1.0, 0.5}}) {
      SCOPED_TRACE(fmt::format("saved with ratio {}, loaded with {}", saved, loaded));
      Config a = c, b = c;
      a.zero_optimization.offload_optimizer.ratio = saved;
      b.zero_optimization.offload_optimizer.ratio = loaded;
      const auto want = Train(a, 12, 3);
      const std::string ckpt =
          (dir.path() / fmt::format("{}_{}_{}", OptimizerStatesName(states), saved, loaded))
              .string();
      const auto got = TrainResumed(
          a, b, ckpt, 2, 3, {}, [&](Engine& e) { EXPECT_EQ(PlanStepsOnDevice(e), loaded < 1.0); });
      if (saved == loaded)
        EXPECT_TRUE(BitwiseEqual(want, got));
      else
        EXPECT_LE(MaxRelDiff(want, got), 1e-6);
    }
  }
}

// The compact formats split too: without clipping (whose coefficient the
// split sums in another order) the device Adam gives the CPU optimizer's
// bits in every format, so a run with ratio 0.5 is bitwise one with every
// sub-group on the CPU, the parameters in HBM or in DRAM; and a checkpoint
// saved with the split resumes bitwise with every sub-group on the CPU.
TEST(RatioTest, CompactFormatsAreTheCpuFormats) {
  testing::ScratchDir dir;
  for (const OptimizerStates f :
       {OptimizerStates::kBf16, OptimizerStates::kBf16Master, OptimizerStates::kInt8})
    for (const OffloadDevice par : {OffloadDevice::kNone, OffloadDevice::kCpu}) {
      SCOPED_TRACE(::testing::Message()
                   << OptimizerStatesName(f) << ", offload_param " << OffloadDeviceName(par));
      Config all_cpu = BaseConfig(OffloadDevice::kCpu, par, dir.str());
      all_cpu.strata.optimizer_states = f;
      all_cpu.gradient_accumulation_steps = all_cpu.train_batch_size = 2;
      Config split = all_cpu;
      split.zero_optimization.offload_optimizer.ratio = 0.5;
      const auto want = Train(all_cpu, 12, 3);
      EXPECT_TRUE(BitwiseEqual(want, Train(split, 12, 3)));
      const std::string ckpt =
          (dir.path() / fmt::format("{}_{}", OptimizerStatesName(f), OffloadDeviceName(par)))
              .string();
      EXPECT_TRUE(BitwiseEqual(want, TrainResumed(split, all_cpu, ckpt, 1)));
      auto e = CreateEngine(split);  // (the split applies: the comparisons mean something)
      ASSERT_TRUE(e.ok()) << e.status();
      Register(**e, 12);
      ASSERT_TRUE((*e)->Plan().ok());
      EXPECT_TRUE(PlanStepsOnDevice(**e));
    }
}

// Where the split does not apply it is not applied, and the plan says why;
// "auto" on the host device keeps every sub-group on the CPU.
TEST(RatioPlanTest, SaysWhyNotApplied) {
  testing::ScratchDir dir;
  auto plan_of = [&](Config c) {
    auto e = CreateEngine(c);
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return false;
    Register(**e, 3);
    EXPECT_TRUE((*e)->Plan().ok());
    return PlanStepsOnDevice(**e);
  };
  Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kNone, dir.str());
  c.zero_optimization.offload_optimizer.ratio = 0.5;
  EXPECT_TRUE(plan_of(c));
  Config params_cpu = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  params_cpu.zero_optimization.offload_optimizer.ratio = 0.5;
  EXPECT_TRUE(plan_of(params_cpu));
  Config params_nvme = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kNvme, dir.str());
  params_nvme.zero_optimization.offload_optimizer.ratio = 0.5;
  EXPECT_FALSE(plan_of(params_nvme));
  Config nvme = BaseConfig(OffloadDevice::kNvme, OffloadDevice::kNone, dir.str());
  nvme.zero_optimization.offload_optimizer.ratio = 0.5;
  EXPECT_FALSE(plan_of(nvme));
  Config int8 = c;  // (every state format splits)
  int8.strata.optimizer_states = OptimizerStates::kInt8;
  EXPECT_TRUE(plan_of(int8));
  Config lion = c;
  lion.optimizer.type = OptimizerType::kLion;
  EXPECT_FALSE(plan_of(lion));
  Config dpu = c;
  dpu.strata.delayed_param_update = true;
  EXPECT_FALSE(plan_of(dpu));
  Config automatic = c;
  automatic.zero_optimization.offload_optimizer.ratio = 1.0;
  automatic.zero_optimization.offload_optimizer.ratio_auto = true;
  EXPECT_FALSE(plan_of(automatic));  // the host device
  // (A ratio close to 1: less than one whole sub-group of the toy's 4.)
  Config small = c;
  small.zero_optimization.offload_optimizer.ratio = 0.9;
  EXPECT_FALSE(plan_of(small));
}

}  // namespace
}  // namespace strata
