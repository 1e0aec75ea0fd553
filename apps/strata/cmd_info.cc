// strata info: the machine as the engine sees it.
#include <sys/resource.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "apps/strata/commands.h"
#include "strata/build_config.h"
#include "strata/strata.h"

namespace strata::cli {
namespace {

using nlohmann::json;

std::string HumanBytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) b /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", b, units[u]);
  return buf;
}

json MemlockInfo() {
  rlimit rl{};
  json j;
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) return json{{"error", "getrlimit failed"}};
  auto val = [](rlim_t v) -> json { return v == RLIM_INFINITY ? json("unlimited") : json(uint64_t(v)); };
  j["soft_bytes"] = val(rl.rlim_cur);
  j["hard_bytes"] = val(rl.rlim_max);
  return j;
}

int RunInfo(const std::string& config_path, const std::string& dir, bool as_json) {
  json out;
  out["version"] = std::string(Version());
  out["build"] = {{"cuda", bool(STRATA_HAVE_CUDA)}, {"nccl", bool(STRATA_HAVE_NCCL)}};
  out["memlock"] = MemlockInfo();
  if (!config_path.empty()) {
    StatusOr<Config> config = LoadConfigFile(config_path);
    if (!config.ok()) {
      std::fprintf(stderr, "strata info: %s\n", config.status().ToString().c_str());
      return 2;
    }
    out["config"] = json::parse(ConfigToJson(*config));
    out["config_warnings"] = config->warnings;
  }
  (void)dir;
  if (as_json) {
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::printf("strata %s (CUDA %s, NCCL %s)\n", out["version"].get<std::string>().c_str(),
              STRATA_HAVE_CUDA ? "built" : "not built", STRATA_HAVE_NCCL ? "built" : "not built");
  auto ml = out["memlock"];
  auto show = [](const json& v) { return v.is_string() ? v.get<std::string>() : HumanBytes(v.get<double>()); };
  std::printf("RLIMIT_MEMLOCK: soft %s, hard %s\n", show(ml["soft_bytes"]).c_str(),
              show(ml["hard_bytes"]).c_str());
  if (out.contains("config")) {
    std::printf("effective config (%s):\n%s\n", config_path.c_str(), out["config"].dump(2).c_str());
  }
  return 0;
}

CommandRegistrar reg("", [](CLI::App& app, CliResult& r) {
  auto* cmd = app.add_subcommand("info", "Show the machine as Strata sees it (GPUs, NUMA, io_uring, O_DIRECT, memlock)");
  auto config = std::make_shared<std::string>();
  auto dir = std::make_shared<std::string>();
  auto as_json = std::make_shared<bool>(false);
  cmd->add_option("--config", *config, "Also print this DeepSpeed/Strata config with defaults filled in");
  cmd->add_option("--path", *dir, "Probe O_DIRECT and the block size under this directory (default: .)");
  cmd->add_flag("--json", *as_json, "Machine-readable output");
  cmd->callback([&r, config, dir, as_json] { r.exit_code = RunInfo(*config, *dir, *as_json); });
});

}  // namespace
}  // namespace strata::cli
