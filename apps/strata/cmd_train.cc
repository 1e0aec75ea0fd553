// strata train: trains the example model (examples/train) through the engine
// with the placement from the config, and reports what happened.
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "apps/strata/commands.h"
#include "apps/strata/exit_codes.h"
#include "apps/strata/launch_ranks.h"
#include "examples/train/train.h"
#include "strata/config.h"

namespace strata::cli {
namespace {

CommandRegistrar reg("", [](CLI::App& app, CliResult& r) {
  auto* cmd = app.add_subcommand(
      "train",
      "Train the example byte-level language model with its states placed as the config says");
  auto opt = std::make_shared<example::TrainCommandOptions>();
  cmd->add_option("--config", opt->config_path,
                  "DeepSpeed/Strata JSON config (strata.model sets the size)")
      ->required();
  cmd->add_option("--steps", opt->steps, "Optimizer steps (default: strata.model.steps, else 40)")
      ->transform(CountSuffix(/*min=*/1));
  cmd->add_option(
      "--nvme-path", opt->nvme_path,
      "Directory for NVMe-offloaded states; overrides the config's nvme_path (created if missing)");
  cmd->add_option("--device", opt->device, "Override strata.device: auto, cuda or host");
  cmd->add_option("--plot", opt->plot_dir,
                  "Write loss and step-time plots (SVG via gnuplot) into this directory");
  cmd->add_option("--checkpoint-dir", opt->checkpoint_dir,
                  "Save checkpoints into this directory (after the last step, and every "
                  "--checkpoint-every steps)");
  cmd->add_option("--checkpoint-every", opt->checkpoint_every,
                  "Save a checkpoint every N optimizer steps");
  cmd->add_flag(
      "--resume", opt->resume,
      "Resume from the newest checkpoint in --checkpoint-dir (if any); --steps is the total");
  cmd->add_flag("--overwrite", opt->overwrite,
                "Without --resume: remove the checkpoints (of another run) already in "
                "--checkpoint-dir instead of refusing to start");
  cmd->add_flag("--json", opt->json, "Print one JSON object with the summary instead of the table");
  auto nproc = std::make_shared<int>(0);
  cmd->add_option("--nproc-per-node", *nproc,
                  "Start this many local ranks (data parallelism, as torchrun does: RANK, "
                  "WORLD_SIZE, MASTER_ADDR, MASTER_PORT set for each); rank 0 prints")
      ->check(CLI::Range(1, 1024));
  cmd->callback([&r, opt, nproc] {
    if (*nproc <= 0) {
      r.exit_code = example::RunTrainCommand(*opt, std::cout, std::cerr);
      return;
    }
    // The same command line, run by every rank.
    std::vector<std::string> args = {"train", "--config", opt->config_path};
    auto add = [&](const char* flag, const std::string& v) {
      if (!v.empty()) args.insert(args.end(), {flag, v});
    };
    if (opt->steps > 0) add("--steps", std::to_string(opt->steps));
    add("--nvme-path", opt->nvme_path);
    add("--device", opt->device);
    add("--plot", opt->plot_dir);
    add("--checkpoint-dir", opt->checkpoint_dir);
    if (opt->checkpoint_every > 0) add("--checkpoint-every", std::to_string(opt->checkpoint_every));
    if (opt->resume) args.push_back("--resume");
    if (opt->overwrite) args.push_back("--overwrite");
    if (opt->json) args.push_back("--json");
    // One GPU per local rank: refused here rather than by rank k failing to
    // open device k while the others wait for it.
    std::string device = opt->device;
    if (device.empty()) {
      StatusOr<Config> config = LoadConfigFile(opt->config_path);
      device = config.ok() ? std::string(DeviceKindName(config->strata.device)) : "host";
    }
    if (Status s = CheckGpusForLocalRanks(*nproc, device, "--nproc-per-node"); !s.ok()) {
      std::cerr << "strata train: " << s.ToString() << "\n";
      r.exit_code = kExitUsage;
      return;
    }
    r.exit_code = LaunchLocalRanks("train", *nproc, args);
  });
});

}  // namespace
}  // namespace strata::cli
