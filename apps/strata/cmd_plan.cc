// strata plan: a dry run of `strata train` with a config — the tier table,
// the predicted step per resource and the largest model that fits, without
// allocating any state (examples/train/plan_command.cc).
#include <iostream>
#include <memory>

#include "apps/strata/commands.h"
#include "examples/train/train.h"

namespace strata::cli {
namespace {

CommandRegistrar reg("", [](CLI::App& app, CliResult& r) {
  auto* cmd = app.add_subcommand(
      "plan",
      "Show what `strata train` would place where, the predicted step time per resource from "
      "measured rates, and the largest model that fits, without training (exit 4 if it does not "
      "fit)");
  auto opt = std::make_shared<example::PlanCommandOptions>();
  cmd->add_option("--config", opt->config_path, "DeepSpeed/Strata JSON config")->required();
  cmd->add_option("--params", opt->params,
                  "Plan a model of about this many parameters (the config's width, as many "
                  "blocks as that takes; 1.5B, 270M, ...) instead of strata.model")
      ->transform(CountSuffix(/*min=*/1));
  cmd->add_option("--nvme-path", opt->nvme_path,
                  "Directory for NVMe-offloaded states; overrides the config's nvme_path");
  cmd->add_option("--device", opt->device, "Override strata.device: auto, cuda or host");
  cmd->add_flag("--no-nvme-bench{false}", opt->measure_nvme,
                "Do not measure the NVMe directory (256 MiB written and read)");
  cmd->add_flag("--json", opt->json, "Print one JSON object instead of the tables");
  cmd->callback([&r, opt] { r.exit_code = example::RunPlanCommand(*opt, std::cout, std::cerr); });
});

}  // namespace
}  // namespace strata::cli
