// Helpers for the nvme tests.
#pragma once

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>

#include "src/common/aligned_buffer.h"
#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/nvme/nvme.h"
#include "tests/test_util.h"

namespace strata::nvme::testing {

// Captures what the Strata logger prints while alive.
class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(out_)) {
    Logger().sinks().push_back(sink_);
  }
  ~LogCapture() {
    auto& sinks = Logger().sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
  }
  std::string text() { return out_.str(); }
  static size_t Count(const std::string& hay, const std::string& needle) {
    size_t n = 0;
    for (size_t p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
    return n;
  }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

// Which engines can run here: uring only where the kernel allows it.
inline bool UringAvailable() {
  static const bool ok = ProbeUring().available;
  return ok;
}

#define SKIP_IF_NO_URING(kind)                                \
  do {                                                        \
    if ((kind) == ::strata::nvme::EngineKind::kUring &&       \
        !::strata::nvme::testing::UringAvailable())           \
      GTEST_SKIP() << "io_uring is refused on this machine: " \
                   << ::strata::nvme::ProbeUring().error;     \
  } while (0)

// Small pieces so that tests exercise splitting, depth and tails quickly.
inline IoOptions SmallOptions(EngineKind kind, size_t block = 16 << 10, int depth = 4,
                              int threads = 1) {
  IoOptions o;
  o.engine = kind;
  o.block_size = block;
  o.queue_depth = depth;
  o.threads = threads;
  return o;
}

// An aligned buffer of n bytes (4096-aligned) filled with random non-zero bytes.
inline AlignedBuffer RandomBuffer(std::mt19937_64& rng, size_t n) {
  auto b = AlignedBuffer::Allocate(std::max<size_t>(n, 1), 4096);
  EXPECT_TRUE(b.ok()) << b.status();
  auto* p = b->as<uint8_t>();
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>((rng() % 255) + 1);
  return std::move(b).value();
}

// An aligned buffer of n bytes set to a poison pattern (never random data).
inline AlignedBuffer PoisonBuffer(size_t n) {
  auto b = AlignedBuffer::Allocate(std::max<size_t>(n, 1), 4096);
  EXPECT_TRUE(b.ok()) << b.status();
  std::memset(b->data(), 0, std::max<size_t>(n, 1));
  return std::move(b).value();
}

inline bool SameBytes(const void* a, const void* b, size_t n) { return std::memcmp(a, b, n) == 0; }

inline std::string EngineParamName(const ::testing::TestParamInfo<EngineKind>& info) {
  return std::string(EngineKindName(info.param));
}

}  // namespace strata::nvme::testing
