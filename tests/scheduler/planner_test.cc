// strata::Planner (include/strata/plan.h, src/scheduler/planner.cc): the
// plan of parameters that are only described is the one Engine::Plan() makes
// when they are registered, for every placement; a plan that does not fit
// says so (Engine::Plan() refuses it); bad parameters are refused.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "strata/plan.h"
#include "tests/scheduler/toy_engine_model.h"
#include "tests/test_util.h"

namespace strata {
namespace {

constexpr int kModules = 6;

// A parameter's name ("m3.weight"); snprintf, as GCC 12's -Wrestrict
// misfires on a concatenated std::string here.
std::string Name(const char* prefix, int m, const char* suffix) {
  char name[32];
  std::snprintf(name, sizeof(name), "%s%d%s", prefix, m, suffix);
  return name;
}

// The toy model of the engine tests (toy_engine_model.h), described.
std::vector<PlanParam> ToyParams(int modules) {
  std::vector<PlanParam> out;
  for (int m = 0; m < modules; ++m)
    for (int i = 0; i < 2; ++i)
      out.push_back({Name("m", m, i == 0 ? ".weight" : ".bias"), testing::ToyNumel(m, i),
                     testing::ToyDType(m, i), m});
  return out;
}

// Short probes: the smallest CPU probe and 1 MiB on the disk.
PlanOptions QuickProbes() {
  PlanOptions o;
  o.cpu_probe_elements = 1;
  o.nvme_probe_bytes = int64_t{1} << 20;
  return o;
}

class PlannerPlacementTest
    : public ::testing::TestWithParam<std::tuple<OffloadDevice, OffloadDevice>> {};

TEST_P(PlannerPlacementTest, PlansWhatTheEnginePlans) {
  const auto [opt, par] = GetParam();
  testing::ScratchDir dir;
  const Config c = testing::ToyConfig(opt, par, dir.str());
  StatusOr<std::unique_ptr<Planner>> planner = Planner::Create(c, QuickProbes());
  ASSERT_TRUE(planner.ok()) << planner.status();
  EXPECT_TRUE((*planner)->DeviceIsHost());
  EXPECT_FALSE((*planner)->OptimizerOnDevice());
  StatusOr<PlanResult> plan = (*planner)->Plan(ToyParams(kModules));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->fits);

  StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(c);
  ASSERT_TRUE(engine.ok()) << engine.status();
  testing::RegisterToy(**engine, 1, kModules);
  ASSERT_TRUE((*engine)->Plan().ok());
  EXPECT_EQ((*planner)->DeviceName(), (*engine)->DeviceName());

  // The bytes each tier needs, and the budgets (free space and MemAvailable
  // move between the two measurements: only the configured budgets are
  // compared).
  const std::vector<TierBudget> want = (*engine)->Budgets();
  ASSERT_EQ(plan->budgets.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(want[i].tier);
    EXPECT_EQ(plan->budgets[i].tier, want[i].tier);
    EXPECT_EQ(plan->budgets[i].needed_bytes, want[i].needed_bytes) << plan->budgets[i].detail;
    if (want[i].tier == "hbm" || want[i].tier == "pinned") {
      EXPECT_EQ(plan->budgets[i].available_bytes, want[i].available_bytes);
    }
  }
  EXPECT_GT(plan->host_bytes, 0);
  EXPECT_FALSE(plan->gradient_path.empty());
  // The predicted step moves what the engine's prediction moves (the
  // seconds are at each one's own measured rates).
  const std::vector<PredictedTerm> step = (*engine)->PredictedStep();
  ASSERT_EQ(plan->step.size(), step.size());
  for (size_t i = 0; i < step.size(); ++i) {
    EXPECT_EQ(plan->step[i].resource, step[i].resource);
    EXPECT_EQ(plan->step[i].amount, step[i].amount) << step[i].resource;
  }

  const PlanRates& rates = (*planner)->Rates();
  EXPECT_GT(rates.h2d_gbytes_per_s, 0);
  EXPECT_GT(rates.cpu_adam_elements_per_s, 0);
  const bool nvme = opt == OffloadDevice::kNvme || par == OffloadDevice::kNvme;
  EXPECT_EQ(rates.nvme_path, nvme ? dir.str() : "");
  EXPECT_EQ(rates.nvme_engine.empty(), !nvme);
  EXPECT_EQ(rates.nvme_read_gbytes_per_s > 0, nvme);
}

INSTANTIATE_TEST_SUITE_P(Placements, PlannerPlacementTest,
                         ::testing::Values(std::tuple{OffloadDevice::kNone, OffloadDevice::kNone},
                                           std::tuple{OffloadDevice::kCpu, OffloadDevice::kNone},
                                           std::tuple{OffloadDevice::kCpu, OffloadDevice::kCpu},
                                           std::tuple{OffloadDevice::kNvme, OffloadDevice::kCpu},
                                           std::tuple{OffloadDevice::kNvme, OffloadDevice::kNvme}),
                         [](const auto& info) {
                           return std::string(OffloadDeviceName(std::get<0>(info.param))) + "_" +
                                  std::string(OffloadDeviceName(std::get<1>(info.param)));
                         });

// offload_optimizer.ratio 0.5: the planner splits as the engine does (the
// same rows), says so, and predicts the CPU step over the other half only,
// beside the bound with every sub-group on the CPU.
TEST(PlannerTest, RatioSplitsAsTheEngineDoes) {
  testing::ScratchDir dir;
  Config c = testing::ToyConfig(OffloadDevice::kCpu, OffloadDevice::kNone, dir.str());
  c.zero_optimization.offload_optimizer.ratio = 0.5;
  StatusOr<std::unique_ptr<Planner>> planner = Planner::Create(c, QuickProbes());
  ASSERT_TRUE(planner.ok()) << planner.status();
  StatusOr<PlanResult> plan = (*planner)->Plan(ToyParams(kModules));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_NE(plan->device_step.find("the first 2 of 4 sub-groups"), std::string::npos)
      << plan->device_step;
  EXPECT_GT(plan->bound_all_on_cpu_s, 0);
  StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(c);
  ASSERT_TRUE(engine.ok()) << engine.status();
  testing::RegisterToy(**engine, 1, kModules);
  ASSERT_TRUE((*engine)->Plan().ok());
  const std::vector<TierBudget> want = (*engine)->Budgets();
  ASSERT_EQ(plan->budgets.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(plan->budgets[i].needed_bytes, want[i].needed_bytes) << want[i].detail;
    // (The other rows quote rates each measured on its own.)
    if (want[i].tier == "hbm") {
      EXPECT_EQ(plan->budgets[i].detail, want[i].detail);
    }
  }
  double cpu_elems = 0;
  for (const PredictedTerm& t : plan->step)
    if (t.resource == "cpu_optimizer") cpu_elems = t.amount;
  c.zero_optimization.offload_optimizer.ratio = 1.0;
  StatusOr<std::unique_ptr<Planner>> all = Planner::Create(c, QuickProbes());
  ASSERT_TRUE(all.ok()) << all.status();
  StatusOr<PlanResult> whole = (*all)->Plan(ToyParams(kModules));
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_TRUE(whole->device_step.empty());
  for (const PredictedTerm& t : whole->step)
    if (t.resource == "cpu_optimizer") {
      EXPECT_GT(cpu_elems, 0);
      EXPECT_LT(cpu_elems, t.amount);
    }
}

// Parameters far beyond the HBM budget with nothing offloaded: the plan says
// it does not fit and which row is over, without allocating them; the
// engine refuses the same plan.
TEST(PlannerTest, APlanThatDoesNotFitSaysWhichTier) {
  testing::ScratchDir dir;
  const Config c = testing::ToyConfig(OffloadDevice::kNone, OffloadDevice::kNone, dir.str());
  StatusOr<std::unique_ptr<Planner>> planner = Planner::Create(c, QuickProbes());
  ASSERT_TRUE(planner.ok()) << planner.status();
  std::vector<PlanParam> params;
  for (int m = 0; m < 64; ++m)
    params.push_back({Name("w", m, ""), int64_t{1} << 24, DType::kBf16, m});  // 1G elements
  StatusOr<PlanResult> plan = (*planner)->Plan(params);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->fits);
  bool hbm_over = false;
  for (const TierBudget& t : plan->budgets)
    hbm_over |= t.tier == "hbm" && t.needed_bytes > t.available_bytes;
  EXPECT_TRUE(hbm_over);
}

TEST(PlannerTest, RefusesParametersTheEngineWouldRefuse) {
  testing::ScratchDir dir;
  StatusOr<std::unique_ptr<Planner>> planner = Planner::Create(
      testing::ToyConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str()), QuickProbes());
  ASSERT_TRUE(planner.ok()) << planner.status();
  EXPECT_EQ((*planner)->Plan({}).status().code(), StatusCode::kInvalidArgument);
  const std::vector<PlanParam> empty_tensor = {{"w", 0, DType::kBf16, 0}};
  EXPECT_EQ((*planner)->Plan(empty_tensor).status().code(), StatusCode::kInvalidArgument);
  const std::vector<PlanParam> bad_module = {{"w", 10, DType::kBf16, -1}};
  EXPECT_EQ((*planner)->Plan(bad_module).status().code(), StatusCode::kInvalidArgument);
}

TEST(PlannerTest, ABadConfigIsRefusedAtCreate) {
  testing::ScratchDir dir;
  Config c = testing::ToyConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  c.zero_optimization.stage = 7;
  EXPECT_EQ(Planner::Create(c, QuickProbes()).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata
