// Links against an installed Strata and uses only its public headers.
//   c++ -std=c++20 main.cc $(pkg-config --cflags --libs strata) -o link_example
//   ./link_example configs/zero2_cpu_offload.json [--plan]
// With --plan it also plans a model of 8 blocks of 1M bf16 parameters under
// the config (strata/plan.h): no state is allocated.
#include <strata/plan.h>
#include <strata/strata.h>

#include <cstdio>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  std::printf("strata %.*s\n", static_cast<int>(strata::Version().size()),
              strata::Version().data());
  if (argc < 2) return 0;
  strata::StatusOr<strata::Config> config = strata::LoadConfigFile(argv[1]);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "zero stage %d, optimizer offload to %.*s\n", config->zero_optimization.stage,
      static_cast<int>(
          strata::OffloadDeviceName(config->zero_optimization.offload_optimizer.device).size()),
      strata::OffloadDeviceName(config->zero_optimization.offload_optimizer.device).data());
  if (argc < 3 || std::string(argv[2]) != "--plan") return 0;
  auto planner = strata::Planner::Create(*config);
  if (!planner.ok()) {
    std::fprintf(stderr, "%s\n", planner.status().ToString().c_str());
    return 1;
  }
  std::vector<strata::PlanParam> params;
  for (int m = 0; m < 8; ++m)
    params.push_back({"block" + std::to_string(m) + ".w", 1 << 20, strata::DType::kBf16, m});
  auto plan = (*planner)->Plan(params);
  if (!plan.ok()) {
    std::fprintf(stderr, "%s\n", plan.status().ToString().c_str());
    return 1;
  }
  for (const strata::TierBudget& t : plan->budgets)
    std::printf("%-6s needs %lld of %lld bytes\n", t.tier.c_str(),
                static_cast<long long>(t.needed_bytes), static_cast<long long>(t.available_bytes));
  std::printf("%s\n", plan->fits ? "fits" : "does not fit");
  return 0;
}
