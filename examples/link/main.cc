// Links against an installed Strata and uses only its public headers.
//   c++ -std=c++20 main.cc $(pkg-config --cflags --libs strata) -o link_example
//   ./link_example configs/zero2_cpu_offload.json
#include <strata/strata.h>

#include <cstdio>

int main(int argc, char** argv) {
  std::printf("strata %.*s\n", static_cast<int>(strata::Version().size()), strata::Version().data());
  if (argc < 2) return 0;
  strata::StatusOr<strata::Config> config = strata::LoadConfigFile(argv[1]);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", config.status().ToString().c_str());
    return 1;
  }
  std::printf("zero stage %d, optimizer offload to %.*s\n", config->zero_optimization.stage,
              static_cast<int>(strata::OffloadDeviceName(config->zero_optimization.offload_optimizer.device).size()),
              strata::OffloadDeviceName(config->zero_optimization.offload_optimizer.device).data());
  return 0;
}
