// Nominal GPU figures (gpu_presets.h), from the vendors' datasheets.
#include "src/gpu/gpu_presets.h"

#include <algorithm>
#include <cctype>

namespace strata::gpu {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

constexpr GpuPreset kPresets[] = {
    {"h100", "NVIDIA H100 SXM5 80GB", 80 * kGiB, 5, 16, 3350},
    {"h100-pcie", "NVIDIA H100 PCIe 80GB", 80 * kGiB, 5, 16, 2000},
    {"h200", "NVIDIA H200 SXM 141GB", 141 * kGiB, 5, 16, 4800},
    {"a100-80g", "NVIDIA A100 SXM4 80GB", 80 * kGiB, 4, 16, 2039},
    {"a100-40g", "NVIDIA A100 SXM4 40GB", 40 * kGiB, 4, 16, 1555},
    {"l40s", "NVIDIA L40S 48GB", 48 * kGiB, 4, 16, 864},
    {"a10", "NVIDIA A10 24GB", 24 * kGiB, 4, 16, 600},
    {"rtx4090", "NVIDIA GeForce RTX 4090 24GB", 24 * kGiB, 4, 16, 1008},
};

bool SameName(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

}  // namespace

std::span<const GpuPreset> GpuPresets() { return kPresets; }

const GpuPreset* FindGpuPreset(std::string_view name) {
  for (const GpuPreset& p : kPresets)
    if (SameName(p.name, name)) return &p;
  return nullptr;
}

std::string GpuPresetNames() {
  std::string out;
  for (const GpuPreset& p : kPresets) {
    if (!out.empty()) out += ", ";
    out += p.name;
  }
  return out;
}

double PcieRawGBytesPerS(int gen, int width) {
  // GT/s per lane × encoding efficiency / 8 bits.
  double per_lane = 0;
  switch (gen) {
    case 3:
      per_lane = 8.0 * 128 / 130 / 8;
      break;
    case 4:
      per_lane = 16.0 * 128 / 130 / 8;
      break;
    case 5:
      per_lane = 32.0 * 128 / 130 / 8;
      break;
    default:
      return 0;
  }
  return per_lane * width;
}

double NominalLinkGBytesPerS(const GpuPreset& p) {
  return kNominalFraction * PcieRawGBytesPerS(p.pcie_gen, p.pcie_width);
}

double NominalDeviceCopyGBytesPerS(const GpuPreset& p) {
  return kNominalFraction * p.memory_gbytes_per_s;
}

}  // namespace strata::gpu
