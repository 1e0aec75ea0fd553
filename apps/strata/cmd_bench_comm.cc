// strata bench comm: all-gather, reduce-scatter and all-reduce bandwidth
// against message size, as nccl-tests reports it. `size` is nccl-tests'
// message size: the all-gather's output, the reduce-scatter's input, the
// all-reduce's buffer (bytes, rounded down to a multiple of ranks × element).
//   algbw = size / time
//   busbw = algbw × (n-1)/n   all-gather, reduce-scatter
//         = algbw × 2(n-1)/n  all-reduce
// A sample times `iters` collectives back to back on the compute stream
// (enough to move --min-bytes, at most --max-iters)
// until a Synchronize; its time is the slowest rank's (an all-reduce max of
// the ranks' times). The baseline, interleaved with them: one device-to-device
// copy of `size` bytes per iteration on the same stream. Repetitions
// interleave the sizes, the collectives and the copy; figures are medians.
//
// Ranks: from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT), or
// with --nproc N this process starts N local ranks itself (the same binary,
// those variables set, a free port, a fresh rendezvous directory) and rank 0
// prints. Device: a CUDA device with NCCL when there is one (--device auto or
// cuda; rank r uses GPU LOCAL_RANK), else the host device with Gloo over TCP.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "apps/strata/bench_stats.h"
#include "apps/strata/commands.h"
#include "apps/strata/exit_codes.h"
#include "apps/strata/launch_ranks.h"
#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/gpu/device.h"
#include "src/gpu/tcp_store.h"

namespace strata::cli {
namespace {

using nlohmann::json;
constexpr const char* kCmd = "bench comm";

struct Args {
  int nproc = 0;  // 0: the ranks come from the environment
  std::string sizes = "4K..64M";
  std::string device = "auto";
  std::string dtype = "fp32";
  int reps = 5;
  std::string min_bytes = "16M";  // a sample repeats a collective until it moved this much
  int max_iters = 100;            // ... or ran this many times
  double timeout_s = 60;
  bool json = false;
};

// --nproc N: runs N copies of this command as ranks 0..N-1 (launch_ranks.h).
int LaunchRanks(const Args& a) {
  {  // the command line is checked once, here, rather than by every rank
    std::vector<size_t> sizes;
    std::string err;
    uint64_t min_bytes = 0;
    if (!ParseSizes(a.sizes, &sizes, &err, "4K..64M", "4K, 1M, 64M")) return Fail(kCmd, err);
    if (!ParseByteSize(a.min_bytes, &min_bytes))
      return Fail(kCmd, "--min-bytes: \"" + a.min_bytes + "\" is not a size");
    if (!(a.timeout_s > 0)) return Fail(kCmd, "--timeout must be positive (seconds)");
    if (Status s = CheckGpusForLocalRanks(a.nproc, a.device, "--nproc"); !s.ok())
      return Fail(kCmd, s);
  }
  std::vector<std::string> args = {"bench",       "comm",
                                   "--sizes",     a.sizes,
                                   "--device",    a.device,
                                   "--dtype",     a.dtype,
                                   "--reps",      std::to_string(a.reps),
                                   "--min-bytes", a.min_bytes,
                                   "--timeout",   std::to_string(a.timeout_s)};
  if (a.json) args.push_back("--json");
  return LaunchLocalRanks(kCmd, a.nproc, args);
}

// kCopy: the baseline, one device-to-device copy of `size` bytes on the
// same stream (what moving the message costs within one rank).
enum Coll { kAllGather = 0, kReduceScatter = 1, kAllReduce = 2, kCopy = 3 };
constexpr int kKinds = 4;
constexpr const char* kCollName[] = {"all_gather", "reduce_scatter", "all_reduce"};

struct Point {
  size_t bytes = 0;
  size_t iters = 0;
  double seconds[kKinds] = {};  // median per collective and the copy
};

int RunRank(const Args& a) {
  std::vector<size_t> sizes;
  std::string err;
  if (!ParseSizes(a.sizes, &sizes, &err, "4K..64M", "4K, 1M, 64M")) return Fail(kCmd, err);
  uint64_t min_bytes = 0;
  if (!ParseByteSize(a.min_bytes, &min_bytes))
    return Fail(kCmd, "--min-bytes: \"" + a.min_bytes + "\" is not a size");
  if (a.reps < 1) return Fail(kCmd, "--reps must be at least 1");
  if (a.max_iters < 1) return Fail(kCmd, "--max-iters must be at least 1");
  if (!(a.timeout_s > 0)) return Fail(kCmd, "--timeout must be positive (seconds)");
  const DType type = a.dtype == "fp16"   ? DType::kFp16
                     : a.dtype == "bf16" ? DType::kBf16
                                         : DType::kFp32;
  const size_t es = DTypeSize(type);

  auto copts = gpu::CommOptionsFromEnv();
  if (!copts.ok()) return Fail(kCmd, copts.status());
  copts->timeout_s = a.timeout_s;
  // Across machines without a shared directory: the TCP store at
  // MASTER_ADDR:MASTER_PORT, as the engine uses.
  auto store = gpu::DefaultRendezvousStore(*copts);
  if (!store.ok()) return Fail(kCmd, store.status());
  copts->store = *std::move(store);
  const int n = copts->world_size, rank = copts->rank;
  const size_t unit = es * static_cast<size_t>(n);
  for (size_t& s : sizes) s = std::max(unit, s / unit * unit);
  size_t max_size = 0;
  for (size_t s : sizes) max_size = std::max(max_size, s);

  gpu::DeviceOptions o;
  o.kind = a.device == "host"   ? DeviceKind::kHost
           : a.device == "cuda" ? DeviceKind::kCuda
                                : DeviceKind::kAuto;
  o.device_id = copts->local_rank;
  o.hbm_budget_bytes = 2 * max_size + (16 << 20);
  auto device = gpu::CreateDevice(o);
  if (!device.ok()) {
    // Not an error: this machine has no GPU to measure (rank 0 says so).
    if (a.device == "cuda" && ReportNoDevice("strata bench comm", device.status(), a.json,
                                             "Use --device host (Gloo) instead.", rank == 0))
      return 0;
    return Fail(kCmd, device.status());
  }
  gpu::Device& dev = **device;
  auto comm = gpu::CreateCommunicator(dev, *copts);
  if (!comm.ok()) return Fail(kCmd, comm.status());
  gpu::Communicator& c = **comm;
  gpu::Stream& s = dev.compute();
  const std::string backend = !dev.is_host() ? "nccl" : n > 1 ? "gloo" : "local";

  auto send = dev.Allocate(max_size);
  auto recv = dev.Allocate(max_size);
  auto tbuf = dev.Allocate(sizeof(float));
  if (!send.ok()) return Fail(kCmd, send.status());
  if (!recv.ok()) return Fail(kCmd, recv.status());
  if (!tbuf.ok()) return Fail(kCmd, tbuf.status());
  {
    std::vector<float> v(max_size / sizeof(float));
    for (size_t i = 0; i < v.size(); ++i) v[i] = Hash01(i, 17 + rank);
    std::vector<uint8_t> bytes(max_size);
    // The values are fp32 in [0, 1]; as another dtype, their first bytes.
    std::memcpy(bytes.data(), v.data(), v.size() * sizeof(float));
    Status st = dev.CopyH2D(send->data(), bytes.data(), bytes.size(), s);
    if (st.ok()) st = s.Synchronize();
    if (!st.ok()) return Fail(kCmd, st);
  }

  // One sample: `iters` collectives, then the slowest rank's seconds.
  auto sample = [&](Coll k, size_t bytes, size_t iters) -> StatusOr<double> {
    const size_t total = bytes / es;  // nccl-tests' count for the message
    Stopwatch sw;
    for (size_t i = 0; i < iters; ++i) {
      Status st;
      if (k == kAllGather)
        st = c.AllGather(send->data(), recv->data(), total / n, type, s);
      else if (k == kReduceScatter)
        st = c.ReduceScatter(send->data(), recv->data(), total / n, type, gpu::ReduceOp::kSum, s);
      else if (k == kAllReduce)
        st = c.AllReduce(send->data(), recv->data(), total, type, gpu::ReduceOp::kSum, s);
      else
        st = dev.CopyD2D(recv->data(), send->data(), bytes, s);
      RETURN_IF_ERROR(st);
    }
    RETURN_IF_ERROR(s.Synchronize());
    RETURN_IF_ERROR(c.AsyncError());
    float t = static_cast<float>(sw.Seconds());
    RETURN_IF_ERROR(dev.CopyH2D(tbuf->data(), &t, sizeof(t), s));
    RETURN_IF_ERROR(
        c.AllReduce(tbuf->data(), tbuf->data(), 1, DType::kFp32, gpu::ReduceOp::kMax, s));
    RETURN_IF_ERROR(dev.CopyD2H(&t, tbuf->data(), sizeof(t), s));
    RETURN_IF_ERROR(s.Synchronize());
    RETURN_IF_ERROR(c.AsyncError());
    return static_cast<double>(t);
  };

  std::vector<Point> points(sizes.size());
  std::vector<std::vector<double>> times(sizes.size() * kKinds);
  for (size_t i = 0; i < sizes.size(); ++i) {
    points[i].bytes = sizes[i];
    points[i].iters = std::clamp<size_t>(min_bytes / sizes[i], 1, a.max_iters);
  }
  // A warm-up of each point (connections, first touches), not timed.
  for (auto& p : points)
    for (int k = 0; k < kKinds; ++k) {
      auto t = sample(static_cast<Coll>(k), p.bytes, 1);
      if (!t.ok()) return Fail(kCmd, t.status());
    }
  for (int rep = 0; rep < a.reps; ++rep)
    for (size_t i = 0; i < points.size(); ++i)
      for (int k = 0; k < kKinds; ++k) {
        auto t = sample(static_cast<Coll>(k), points[i].bytes, points[i].iters);
        if (!t.ok()) return Fail(kCmd, t.status());
        times[i * kKinds + k].push_back(*t / static_cast<double>(points[i].iters));
      }
  for (size_t i = 0; i < points.size(); ++i)
    for (int k = 0; k < kKinds; ++k) points[i].seconds[k] = Median(times[i * kKinds + k]);
  if (rank != 0) return 0;

  const double bus_ag = n > 1 ? static_cast<double>(n - 1) / n : 0.0;
  const double bus_ar = 2 * bus_ag;
  auto algbw = [](size_t bytes, double s) { return s > 0 ? bytes / s / 1e9 : 0.0; };
  const std::string label = dev.Describe() + (backend == "gloo"   ? " (Gloo over TCP)"
                                              : backend == "nccl" ? " (NCCL)"
                                                                  : "");
  const double load = LoadAverage();
  if (a.json) {
    json pts = json::array();
    for (const auto& p : points) {
      json pt = {{"bytes", p.bytes}, {"iterations", p.iters}};
      for (int k = 0; k < 3; ++k) {
        const double alg = algbw(p.bytes, p.seconds[k]);
        pt[kCollName[k]] = {{"time_us", p.seconds[k] * 1e6},
                            {"algbw_gbytes_per_s", alg},
                            {"busbw_gbytes_per_s", alg * (k == kAllReduce ? bus_ar : bus_ag)}};
      }
      pt["copy"] = {{"time_us", p.seconds[kCopy] * 1e6},
                    {"gbytes_per_s", algbw(p.bytes, p.seconds[kCopy])}};
      pts.push_back(pt);
    }
    json j = {{"device", label},  {"backend", backend},    {"world_size", n},
              {"dtype", a.dtype}, {"repetitions", a.reps}, {"load_average", load},
              {"sizes", pts}};
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::printf("device: %s; %d ranks; %s; %d repetitions interleaved, medians; load %.2f\n",
              label.c_str(), n, a.dtype.c_str(), a.reps, load);
  std::printf("%8s | %10s %8s %8s | %10s %8s %8s | %10s %8s %8s | %8s\n", "size", "ag us", "algbw",
              "busbw", "rs us", "algbw", "busbw", "ar us", "algbw", "busbw", "copy");
  for (const auto& p : points) {
    std::printf("%8s", SizeLabel(p.bytes).c_str());
    for (int k = 0; k < 3; ++k) {
      const double alg = algbw(p.bytes, p.seconds[k]);
      std::printf(" | %10.1f %8.3f %8.3f", p.seconds[k] * 1e6, alg,
                  alg * (k == kAllReduce ? bus_ar : bus_ag));
    }
    std::printf(" | %8.3f\n", algbw(p.bytes, p.seconds[kCopy]));
  }
  std::printf(
      "GB/s (1e9 B/s); busbw: all-gather, reduce-scatter algbw*(n-1)/n, all-reduce "
      "algbw*2(n-1)/n (nccl-tests); copy: one device-to-device copy of size bytes on the same "
      "stream, interleaved (the baseline)\n");
  return 0;
}

CommandRegistrar reg("bench", [](CLI::App& bench, CliResult& result) {
  auto args = std::make_shared<Args>();
  CLI::App* cmd = bench.add_subcommand(
      "comm", "Collective bandwidth (all-gather, reduce-scatter, all-reduce) vs message size");
  cmd->add_option("--nproc", args->nproc,
                  "Start this many local ranks (0: the ranks come from torchrun's RANK, "
                  "WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  cmd->add_option("--sizes", args->sizes,
                  "Message sizes (nccl-tests' size): a range 4K..64M (x4 steps) or a list")
      ->capture_default_str();
  cmd->add_option("--device", args->device, "auto (CUDA+NCCL if present, else host+Gloo)|cuda|host")
      ->check(CLI::IsMember({"auto", "cuda", "host"}))
      ->capture_default_str();
  cmd->add_option("--dtype", args->dtype, "Element type")
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}))
      ->capture_default_str();
  cmd->add_option("--reps", args->reps, "Repetitions per point (interleaved; medians)")
      ->transform(CountSuffix(1))
      ->capture_default_str();
  cmd->add_option("--min-bytes", args->min_bytes,
                  "A sample repeats a collective until it moved this many bytes")
      ->capture_default_str();
  cmd->add_option("--max-iters", args->max_iters, "... or at most this many times")
      ->transform(CountSuffix(1))
      ->capture_default_str();
  cmd->add_option("--timeout", args->timeout_s, "Collective and rendezvous timeout, seconds")
      ->check(FiniteNumber())
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Machine-readable output (rank 0)");
  cmd->callback([args, &result] {
    result.exit_code = args->nproc > 0 ? LaunchRanks(*args) : RunRank(*args);
  });
});

}  // namespace
}  // namespace strata::cli
