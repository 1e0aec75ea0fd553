// The measurements behind `strata bench nvme`, `strata tune nvme` and
// bench/bench_nvme.cc: sequential write then read of the engine through the
// swap store, fio with the same parameters, and the block × depth × threads
// sweep. The engine's Plan() uses RunEngineBench (a short one) for the
// disk's rates of the step bound.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "src/nvme/nvme.h"
#include "strata/status.h"

namespace strata::nvme {

struct NvmeBenchOptions {
  std::vector<std::string> paths;          // striped when several
  uint64_t size = uint64_t{1} << 30;       // bytes written then read
  IoOptions io;                            // engine, block_size, queue_depth, threads
  uint64_t request_bytes = 256ull << 20;   // one swap-store request (a shard slice)
  int requests_in_flight = 4;              // requests outstanding at once
};

struct NvmeBenchResult {
  double write_gbytes_per_s = 0;  // 1e9 bytes per second
  double read_gbytes_per_s = 0;
  std::string engine;             // the engine that ran ("uring"/"posix")
};

// Opens a swap store of `size` bytes over the paths, writes one shard of
// `size` bytes sequentially (requests of request_bytes, requests_in_flight
// outstanding, buffers registered as fixed buffers), reads it back, checks the
// bytes of the last requests, removes the swap files.
StatusOr<NvmeBenchResult> RunEngineBench(const NvmeBenchOptions& options);

// The same measurement in passes, so a caller can interleave other work
// (fio) between the write and the read pass: Open, WritePass, ReadPass
// (verifies), destructor removes the swap files.
class EngineBenchSession {
 public:
  static StatusOr<std::unique_ptr<EngineBenchSession>> Open(const NvmeBenchOptions& options);
  ~EngineBenchSession();
  StatusOr<double> WritePass();  // GB/s
  StatusOr<double> ReadPass();   // GB/s; REQUIRES: WritePass() succeeded
  std::string engine() const;

 private:
  struct State;
  explicit EngineBenchSession(std::unique_ptr<State> s);
  std::unique_ptr<State> s_;
};

// One fio pass ("write" or "read") over `file` (kept between passes; the
// caller removes it). GB/s.
StatusOr<double> RunFioPass(const NvmeBenchOptions& options, const std::string& file, const std::string& rw);

// fio with the same engine (io_uring with fixedbufs+registerfiles, or psync
// with queue_depth × threads jobs), block size, queue depth, size and
// O_DIRECT, on paths[0]: a write pass then a read pass of one file, removed
// afterwards. NotFound when fio is not installed.
StatusOr<NvmeBenchResult> RunFioBench(const NvmeBenchOptions& options);
// The fio command line RunFioBench uses for `rw` ("write" or "read").
std::string FioCommand(const NvmeBenchOptions& options, const std::string& file,
                       const std::string& rw, const std::string& json_out);

double Median(std::vector<double> v);

struct TunePoint {
  uint64_t block_size = 0;
  int queue_depth = 0;
  int threads = 0;
  NvmeBenchResult result;
  double score = 0;  // geometric mean of read and write GB/s
};

// Measures every block × depth × threads combination once (`base` gives
// paths, size and engine), then re-measures the `confirm_top` best
// `confirm_runs` more times, interleaved, and ranks those by the median score
// (one lucky run on a noisy disk does not win). progress(i, n, point) is called
// after each measurement. Returns the points, best first; confirmed points
// carry medians.
StatusOr<std::vector<TunePoint>> RunTune(const NvmeBenchOptions& base,
                                         const std::vector<uint64_t>& block_sizes,
                                         const std::vector<int>& queue_depths,
                                         const std::vector<int>& threads,
                                         const std::function<void(size_t, size_t, const TunePoint&)>& progress,
                                         int confirm_top = 4, int confirm_runs = 2);

}  // namespace strata::nvme
