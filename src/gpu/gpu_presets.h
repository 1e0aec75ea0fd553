// src/gpu/gpu_presets.h — nominal figures of common GPUs, for planning a GPU
// machine from a machine without one (`strata plan --gpu NAME`, or a config
// whose strata.device is "cuda" where no CUDA device can be opened).
//
// The figures are the vendors' datasheet values: memory, the PCIe
// generation and width of the host link, and the memory bandwidth. The
// rates a plan takes from them are nominal, not measured: a pinned copy
// over the link at kNominalFraction of the link's raw rate per direction,
// a copy within device memory at kNominalFraction of the datasheet
// bandwidth (bytes read + written per second). A plan says which of its
// figures are nominal.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace strata::gpu {

struct GpuPreset {
  std::string_view name;         // what --gpu takes: "h100", "a100-40g", ...
  std::string_view description;  // "NVIDIA H100 SXM5 80GB"
  int64_t memory_bytes = 0;
  int pcie_gen = 0;                // 3, 4 or 5
  int pcie_width = 0;              // lanes
  double memory_gbytes_per_s = 0;  // datasheet bandwidth
};

// The fraction of a raw rate a nominal rate takes.
inline constexpr double kNominalFraction = 0.8;

// Every preset, in the order `--help` lists them.
std::span<const GpuPreset> GpuPresets();
// The preset named `name` (case-insensitive), or null.
const GpuPreset* FindGpuPreset(std::string_view name);
// "h100, h100-pcie, h200, ..." (for error messages and --help).
std::string GpuPresetNames();

// The raw rate of a PCIe link per direction, in GB/s (128b/130b encoding
// from gen 3): 0 for an unknown generation.
double PcieRawGBytesPerS(int gen, int width);
// The nominal pinned copy rate over the preset's link, and the nominal
// device-memory copy rate (read + write), both in GB/s.
double NominalLinkGBytesPerS(const GpuPreset& p);
double NominalDeviceCopyGBytesPerS(const GpuPreset& p);

}  // namespace strata::gpu
