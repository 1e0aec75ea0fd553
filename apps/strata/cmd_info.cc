// strata info: the machine as the engine sees it — GPUs, NUMA, the CPU
// optimizer's instruction set, io_uring (a real probe), O_DIRECT and the swap
// files (live, leftover) under a directory, RLIMIT_MEMLOCK, and optionally
// the effective config.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/strata/commands.h"
#include "apps/strata/exit_codes.h"
#include "src/common/rank_env.h"
#include "src/common/units.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/gpu/device.h"
#include "src/nvme/nvme.h"
#include "strata/build_config.h"
#include "strata/strata.h"

namespace strata::cli {
namespace {

using nlohmann::json;

std::string HumanBytes(double b) { return FormatBytes(static_cast<int64_t>(b)); }

json GpuInfo() {
  gpu::CudaDeviceList list = gpu::ListCudaDevices();
  json devices = json::array();
  for (const auto& d : list.devices) {
    devices.push_back(
        {{"ordinal", d.ordinal},
         {"name", d.name},
         {"hbm_bytes", d.total_bytes},
         {"free_bytes", d.free_bytes},
         {"compute_capability", std::to_string(d.cc_major) + "." + std::to_string(d.cc_minor)},
         {"multiprocessors", d.multiprocessors},
         {"pci_bus_id", d.pci_bus_id},
         {"pcie_gen", d.pcie_gen},
         {"pcie_width", d.pcie_width},
         {"numa_node", d.numa_node}});
  }
  return {{"devices", devices}, {"reason", list.reason}};
}

json CpuInfo() {
  json j;
  j["optimizer_isa"] = std::string(cpu_adam::BestIsa());
  if (const char* env = std::getenv("STRATA_CPU_ISA"); env != nullptr && *env != '\0') {
    // What every optimizer of a run under this environment uses instead.
    StatusOr<std::string_view> selected = cpu_adam::SelectedIsa();
    j["isa_override"] = env;
    if (selected.ok()) {
      j["optimizer_isa"] = std::string(*selected);
    } else {
      j["isa_override_error"] = selected.status().ToString();
    }
  }
  json isas = json::array();
  for (auto isa : cpu_adam::AvailableIsas()) isas.push_back(std::string(isa));
  j["available_isas"] = isas;
  StatusOr<cpu_adam::CpuTopology> topo = cpu_adam::DescribeTopology();
  if (!topo.ok()) {
    j["topology_error"] = topo.status().ToString();
    return j;
  }
  j["packages"] = topo->packages;
  j["cores"] = topo->cores;
  j["pus"] = topo->pus;
  json nodes = json::array();
  for (const auto& n : topo->numa_nodes)
    nodes.push_back({{"node", n.os_index},
                     {"memory_bytes", n.memory_bytes},
                     {"cores", n.cores},
                     {"pus", n.pus}});
  j["numa_nodes"] = nodes;
  return j;
}

json IoInfo(const std::string& dir) {
  json j;
  nvme::UringProbe u = nvme::ProbeUring();
  j["io_uring"] = {{"available", u.available}, {"error", u.available ? "" : u.error.ToString()}};
  StatusOr<nvme::DirectIoProbe> d = nvme::ProbeDirectIo(dir);
  if (!d.ok()) {
    j["o_direct"] = {{"path", dir}, {"error", d.status().ToString()}};
  } else {
    j["o_direct"] = {{"path", dir},
                     {"supported", d->direct_supported},
                     {"error", d->direct_supported ? "" : d->direct_error.ToString()},
                     {"logical_block_size", d->logical_block_size},
                     {"block_size_source", d->block_size_source}};
  }
  // Swap files under the directory: live (locked by a running store) or
  // leftovers of a run that ended without removing them (the next store on
  // the directory removes those).
  StatusOr<std::vector<nvme::SwapFileEntry>> swaps = nvme::ListSwapFiles(dir);
  if (!swaps.ok()) {
    j["swap_files_error"] = swaps.status().ToString();
  } else {
    json files = json::array();
    for (const auto& f : *swaps)
      files.push_back({{"path", f.path},
                       {"size_bytes", f.size},
                       {"age_s", f.age_s},
                       {"state", f.live ? "live" : "leftover"}});
    j["swap_files"] = files;
  }
  return j;
}

std::string HumanAge(double s) {
  char buf[32];
  if (s < 120)
    std::snprintf(buf, sizeof(buf), "%.0f s", s);
  else if (s < 7200)
    std::snprintf(buf, sizeof(buf), "%.0f min", s / 60);
  else if (s < 172800)
    std::snprintf(buf, sizeof(buf), "%.1f h", s / 3600);
  else
    std::snprintf(buf, sizeof(buf), "%.1f days", s / 86400);
  return buf;
}

// Data parallelism on this machine: what each local rank's CPU optimizer
// takes (the engine's own choice, cpu_adam::ShareOfLocalRank): for
// LOCAL_WORLD_SIZE ranks when set, else one per GPU (one rank without GPUs).
json LocalRanksInfo(const json& gpus) {
  json ranks = json::array();
  StatusOr<cpu_adam::CpuTopology> topo = cpu_adam::DescribeTopology();
  if (!topo.ok()) return ranks;
  int local_world = static_cast<int>(std::max<size_t>(1, gpus["devices"].size()));
  if (StatusOr<std::optional<int>> v = RankEnvInteger("LOCAL_WORLD_SIZE");
      v.ok() && v->has_value() && **v > 0)
    local_world = **v;
  for (int k = 0; k < local_world; ++k) {
    int gpu_node = -1;
    json gpu = nullptr;
    for (const auto& d : gpus["devices"])
      if (d["ordinal"].get<int>() == k) {
        gpu = k;
        gpu_node = d.value("numa_node", -1);
      }
    const cpu_adam::RankCpuShare share =
        cpu_adam::ShareOfLocalRank(*topo, k, local_world, gpu_node);
    ranks.push_back({{"local_rank", k},
                     {"gpu", gpu},
                     {"numa_node", share.numa_os_node >= 0 ? json(share.numa_os_node) : json()},
                     {"threads", share.threads},
                     {"why", share.why}});
  }
  return ranks;
}

json MemlockInfo() {
  gpu::MemlockLimit m = gpu::ReadMemlockLimit();
  auto val = [](bool unlimited, uint64_t v) -> json {
    return unlimited ? json("unlimited") : json(v);
  };
  return {{"soft_bytes", val(m.soft_unlimited, m.soft_bytes)},
          {"hard_bytes", val(m.hard_unlimited, m.hard_bytes)}};
}

std::string Show(const json& v) {
  return v.is_string() ? v.get<std::string>() : HumanBytes(v.get<double>());
}

int RunInfo(const std::string& config_path, const std::string& dir_arg, bool as_json) {
  const std::string dir = dir_arg.empty() ? "." : dir_arg;
  json out;
  if (!config_path.empty()) {
    StatusOr<Config> config = LoadConfigFile(config_path);
    if (!config.ok()) {
      std::fprintf(stderr, "strata info: %s\n", config.status().ToString().c_str());
      return kExitConfig;
    }
    out["config"] = json::parse(ConfigToJson(*config));
    out["config_warnings"] = config->warnings;
  }
  out["version"] = std::string(Version());
  out["build"] = {{"cuda", bool(STRATA_HAVE_CUDA)}, {"nccl", bool(STRATA_HAVE_NCCL)}};
  out["gpu"] = GpuInfo();
  out["cpu"] = CpuInfo();
  out["io"] = IoInfo(dir);
  out["memlock"] = MemlockInfo();
  out["local_ranks"] = LocalRanksInfo(out["gpu"]);
  if (as_json) {
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::printf("strata %s (CUDA %s, NCCL %s)\n", out["version"].get<std::string>().c_str(),
              STRATA_HAVE_CUDA ? "built" : "not built", STRATA_HAVE_NCCL ? "built" : "not built");
  const json& g = out["gpu"];
  if (g["devices"].empty()) {
    std::printf("GPUs:           none (%s)\n", g["reason"].get<std::string>().c_str());
  } else {
    for (const auto& d : g["devices"]) {
      std::printf("GPU %d:          %s, %s HBM, sm_%s, PCIe %s\n", d["ordinal"].get<int>(),
                  d["name"].get<std::string>().c_str(),
                  HumanBytes(d["hbm_bytes"].get<double>()).c_str(),
                  d["compute_capability"].get<std::string>().c_str(),
                  d["pcie_gen"].get<int>() > 0 ? ("gen" + std::to_string(d["pcie_gen"].get<int>()) +
                                                  " x" + std::to_string(d["pcie_width"].get<int>()))
                                                     .c_str()
                                               : "link unknown");
    }
  }
  const json& c = out["cpu"];
  if (c.contains("topology_error")) {
    std::printf("CPU topology:   %s\n", c["topology_error"].get<std::string>().c_str());
  } else {
    std::printf("CPU:            %d package(s), %d cores, %d PUs\n", c["packages"].get<int>(),
                c["cores"].get<int>(), c["pus"].get<int>());
    for (const auto& n : c["numa_nodes"])
      std::printf("  NUMA node %d:  %d cores, %s\n", n["node"].get<int>(), n["cores"].get<int>(),
                  HumanBytes(n["memory_bytes"].get<double>()).c_str());
  }
  std::printf("CPU optimizer:  %s SIMD%s\n", c["optimizer_isa"].get<std::string>().c_str(),
              c.contains("isa_override")
                  ? (" (STRATA_CPU_ISA=" + c["isa_override"].get<std::string>() + ")").c_str()
                  : "");
  if (c.contains("isa_override_error"))
    std::printf("                %s\n", c["isa_override_error"].get<std::string>().c_str());
  for (const auto& k : out["local_ranks"])
    std::printf(
        "  local rank %d: %s%s, %d thread(s) (%s)\n", k["local_rank"].get<int>(),
        k["gpu"].is_null() ? "" : ("GPU " + std::to_string(k["gpu"].get<int>()) + ", ").c_str(),
        k["numa_node"].is_null()
            ? "every core"
            : ("NUMA node " + std::to_string(k["numa_node"].get<int>())).c_str(),
        k["threads"].get<int>(), k["why"].get<std::string>().c_str());
  const json& io = out["io"];
  std::printf("io_uring:       %s\n",
              io["io_uring"]["available"].get<bool>()
                  ? "works (NOP round trip)"
                  : ("unavailable: " + io["io_uring"]["error"].get<std::string>() +
                     " (the POSIX engine will be used)")
                        .c_str());
  const json& od = io["o_direct"];
  if (od.contains("supported")) {
    if (od["supported"].get<bool>()) {
      std::printf("O_DIRECT:       works under %s, logical block %u bytes (%s)\n", dir.c_str(),
                  od["logical_block_size"].get<unsigned>(),
                  od["block_size_source"].get<std::string>().c_str());
    } else {
      std::printf("O_DIRECT:       refused under %s (%s): buffered I/O will be used\n", dir.c_str(),
                  od["error"].get<std::string>().c_str());
    }
  } else {
    std::printf("O_DIRECT:       cannot probe %s: %s\n", dir.c_str(),
                od["error"].get<std::string>().c_str());
  }
  if (io.contains("swap_files_error")) {
    std::printf("swap files:     cannot list %s: %s\n", dir.c_str(),
                io["swap_files_error"].get<std::string>().c_str());
  } else if (io["swap_files"].empty()) {
    std::printf("swap files:     none under %s\n", dir.c_str());
  } else {
    int leftovers = 0;
    for (const auto& f : io["swap_files"]) leftovers += f["state"] == "leftover";
    std::printf("swap files:     %zu under %s (%d leftover: removed by the next run there)\n",
                io["swap_files"].size(), dir.c_str(), leftovers);
    for (const auto& f : io["swap_files"])
      std::printf("  %-8s  %s  %s, modified %s ago\n", f["state"].get<std::string>().c_str(),
                  f["path"].get<std::string>().c_str(),
                  HumanBytes(f["size_bytes"].get<double>()).c_str(),
                  HumanAge(f["age_s"].get<double>()).c_str());
  }
  std::printf("RLIMIT_MEMLOCK: soft %s, hard %s\n", Show(out["memlock"]["soft_bytes"]).c_str(),
              Show(out["memlock"]["hard_bytes"]).c_str());
  if (out.contains("config")) {
    for (const auto& w : out["config_warnings"])
      std::printf("config warning: %s\n", w.get<std::string>().c_str());
    std::printf("effective config (%s):\n%s\n", config_path.c_str(), out["config"].dump(2).c_str());
  }
  return 0;
}

CommandRegistrar reg("", [](CLI::App& app, CliResult& r) {
  auto* cmd = app.add_subcommand(
      "info", "Show the machine as Strata sees it (GPUs, NUMA, SIMD, io_uring, O_DIRECT, memlock)");
  auto config = std::make_shared<std::string>();
  auto dir = std::make_shared<std::string>();
  auto as_json = std::make_shared<bool>(false);
  cmd->add_option("--config", *config,
                  "Also print this DeepSpeed/Strata config with defaults filled in");
  cmd->add_option("--path", *dir,
                  "Probe O_DIRECT and the block size, and list swap files (live, leftover) under "
                  "this directory (default: .)");
  cmd->add_flag("--json", *as_json, "Machine-readable output");
  cmd->callback([&r, config, dir, as_json] { r.exit_code = RunInfo(*config, *dir, *as_json); });
});

}  // namespace
}  // namespace strata::cli
