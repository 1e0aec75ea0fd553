// Test helpers: fresh random data (never zeros), scratch directories, an
// environment variable for a scope and a free loopback port.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace strata::testing {

// A generator seeded from the test's name and a per-process random value,
// printed by the caller's SCOPED_TRACE if it wants reproducibility. Use
// SeededRng(seed) to replay.
std::mt19937_64 MakeRng(uint64_t* seed_out = nullptr);
std::mt19937_64 SeededRng(uint64_t seed);

// n floats uniform in [lo, hi), none exactly zero.
std::vector<float> RandomFloats(std::mt19937_64& rng, size_t n, float lo = -1.f, float hi = 1.f);
// n random bytes.
std::vector<uint8_t> RandomBytes(std::mt19937_64& rng, size_t n);

// A fresh directory under $TMPDIR (or /tmp), removed with its contents on
// destruction.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag = "strata-test");
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// Sets (or, with nullptr, unsets) an environment variable for a scope and
// restores what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value);
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// A TCP port on 127.0.0.1 that was free a moment ago.
int FreeLoopbackPort();

}  // namespace strata::testing
