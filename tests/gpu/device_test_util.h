// Shared by the gpu tests: the two backends as type parameters.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "src/gpu/device.h"

#define ASSERT_OK(expr)                                     \
  do {                                                      \
    const ::strata::Status s_ = (expr);                     \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_.ToString(); \
  } while (0)
#define EXPECT_OK(expr)                                     \
  do {                                                      \
    const ::strata::Status s_ = (expr);                     \
    EXPECT_TRUE(s_.ok()) << #expr << ": " << s_.ToString(); \
  } while (0)

namespace strata::gpu::testing {

struct HostBackend {
  static constexpr const char* kName = "host";
  static StatusOr<std::unique_ptr<Device>> Make(size_t budget) {
    DeviceOptions o;
    o.kind = DeviceKind::kHost;
    o.hbm_budget_bytes = budget;
    return CreateDevice(o);
  }
};

struct CudaBackend {
  static constexpr const char* kName = "cuda";
  static StatusOr<std::unique_ptr<Device>> Make(size_t budget) {
    DeviceOptions o;
    o.kind = DeviceKind::kCuda;
    o.hbm_budget_bytes = budget;
    return CreateDevice(o);
  }
};

// Creates the device in SetUp; a CUDA backend without a device skips the
// test with the reason.
template <typename Backend>
class DeviceTest : public ::testing::Test {
 protected:
  static constexpr size_t kBudget = size_t{64} << 20;  // multiple of 2 MiB (CUDA rounding)

  void SetUp() override {
    auto d = Backend::Make(kBudget);
    if (!d.ok()) {
      const StatusCode c = d.status().code();
      if (std::string(Backend::kName) == "cuda" &&
          (c == StatusCode::kUnavailable || c == StatusCode::kNotSupported))
        GTEST_SKIP() << "no CUDA device: " << d.status().ToString();
      FAIL() << d.status().ToString();
    }
    device_ = std::move(d).value();
  }
  void TearDown() override {
    if (device_) EXPECT_OK(device_->Synchronize());
  }
  Device& dev() { return *device_; }

  std::unique_ptr<Device> device_;
};

using Backends = ::testing::Types<HostBackend, CudaBackend>;

struct BackendNames {
  template <typename T>
  static std::string GetName(int) {
    return T::kName;
  }
};

}  // namespace strata::gpu::testing
