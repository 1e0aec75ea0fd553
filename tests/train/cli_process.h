// Helpers of the tests that run the `strata` binary as a child process and
// watch what it leaves behind.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>

namespace strata::cli_testing {

// The file's contents ("" when it cannot be read).
inline std::string ReadFile(const std::string& path) {
  std::stringstream ss;
  ss << std::ifstream(path).rdbuf();
  return ss.str();
}

// Waits until `file` contains `text` (or 60 s pass).
inline bool WaitFor(const std::string& file, const std::string& text) {
  for (int i = 0; i < 1200; ++i) {
    if (ReadFile(file).find(text) != std::string::npos) return true;
    usleep(50'000);
  }
  return false;
}

// The NVMe swap files a run left in `dir`.
inline size_t SwapFilesIn(const std::string& dir) {
  size_t n = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    n += e.path().filename().string().rfind("strata-swap-", 0) == 0;
  return n;
}

}  // namespace strata::cli_testing
