// strata train: trains the example model (examples/train) through the engine
// with the placement from the config, and reports what happened.
#include <iostream>
#include <memory>

#include "apps/strata/commands.h"
#include "examples/train/train.h"

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
  cmd->callback([&r, opt] { r.exit_code = example::RunTrainCommand(*opt, std::cout, std::cerr); });
});

}  // namespace
}  // namespace strata::cli
