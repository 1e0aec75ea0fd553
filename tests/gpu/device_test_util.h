// Shared by the gpu tests: the two backends as type parameters.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "src/gpu/device.h"
#include "tests/status_matchers.h"

namespace strata::gpu::testing {

// Aborts the test binary, naming the test, if it is still running after
// `seconds`: a hang on a GPU (a host function that waits for the test thread
// while the test thread waits for the device) fails in seconds, not at
// CTest's TIMEOUT. Disarmed by destruction.
class Watchdog {
 public:
  explicit Watchdog(double seconds) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    name_ = info ? std::string(info->test_suite_name()) + "." + info->name() : "?";
    thread_ = std::thread([this, seconds] {
      std::unique_lock<std::mutex> lock(mu_);
      if (cv_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return done_; })) return;
      std::fprintf(stderr,
                   "watchdog: %s still running after %.0f s: a hang (e.g. a blocking device call "
                   "while a host function waits for this thread); aborting\n",
                   name_.c_str(), seconds);
      std::fflush(stderr);
      std::abort();
    });
  }
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

// Host devices in tests report a deadlock after this long (the default, 10 s,
// is for production).
inline constexpr double kTestDeadlockTimeoutS = 2.0;

struct HostBackend {
  static constexpr const char* kName = "host";
  static StatusOr<std::unique_ptr<Device>> Make(size_t budget) {
    DeviceOptions o;
    o.kind = DeviceKind::kHost;
    o.hbm_budget_bytes = budget;
    o.host_deadlock_timeout_s = kTestDeadlockTimeoutS;
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
    watchdog_ = std::make_unique<Watchdog>(60);
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

  std::unique_ptr<Watchdog> watchdog_;  // first: outlives the device's teardown
  std::unique_ptr<Device> device_;
};

// Typed suites are instantiated without a name generator: CTest then names
// each case after its type (Suite.Case<strata::gpu::testing::HostBackend>);
// with one, CMake's test discovery puts gtest's whole "# TypeParam = ..."
// line into the CTest name.
using Backends = ::testing::Types<HostBackend, CudaBackend>;

}  // namespace strata::gpu::testing
