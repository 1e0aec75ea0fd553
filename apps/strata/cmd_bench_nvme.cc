// strata bench nvme: sequential write then read through the swap store, and
// optionally fio with the same parameters, alternated, medians and ratios.
//
// Each run is a pair: the engine's write and read passes, then fio's. The
// engine/fio ratio is taken per run (the two tools a second apart, on the
// same disk in the same state) and the median of those is reported with
// its quartiles: on a virtual disk one pass of 64 MiB took 32 or 47 ms
// depending on how the host happened to serve it, so a ratio of separate
// medians of few runs flipped between pass and fail (docs/perf.md).
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/strata/bench_stats.h"
#include "apps/strata/commands.h"
#include "src/nvme/nvme_bench.h"

namespace strata::cli {
namespace {

using nlohmann::json;

struct BenchNvmeArgs {
  std::vector<std::string> paths;
  std::string size = "1G";
  std::string block_size = "1M";
  std::string request = "256M";
  int queue_depth = 16;
  int threads = 1;
  std::string engine = "uring";
  bool vs_fio = false;
  int runs = 3;
  int in_flight = 4;
  bool json = false;
};

constexpr char kCommand[] = "bench nvme";

int RunBenchNvme(const BenchNvmeArgs& a) {
  nvme::NvmeBenchOptions o;
  o.paths = a.paths;
  uint64_t bs = 0;
  if (!ParseByteSize(a.size, &o.size) || o.size == 0)
    return Fail(kCommand, "--size: \"" + a.size + "\" is not a size");
  if (!ParseByteSize(a.block_size, &bs))
    return Fail(kCommand, "--block-size: \"" + a.block_size + "\" is not a size");
  if (!ParseByteSize(a.request, &o.request_bytes) || o.request_bytes == 0)
    return Fail(kCommand, "--request-size: \"" + a.request + "\" is not a size");
  auto kind = nvme::ParseEngineKind(a.engine);
  if (!kind.ok()) return Fail(kCommand, std::string(kind.status().message()));
  o.io.engine = *kind;
  o.io.block_size = bs;
  o.io.queue_depth = a.queue_depth;
  o.io.threads = a.threads;
  // The flags' own names (nvme::ValidateIoOptions names the config keys).
  if (bs == 0 || bs % 4096 != 0 || bs > (uint64_t{1} << 30))
    return Fail(kCommand, "--block-size: " + std::to_string(bs) + " " + kBlockSizeRule);
  if (a.queue_depth < 1 || a.queue_depth > 4096)
    return Fail(kCommand,
                "--queue-depth: " + std::to_string(a.queue_depth) + " is not between 1 and 4096");
  if (a.threads < 1 || a.threads > 64)
    return Fail(kCommand, "--threads: " + std::to_string(a.threads) + " is not between 1 and 64");
  if (Status s = nvme::ValidateIoOptions(o.io); !s.ok())
    return Fail(kCommand, std::string(s.message()));
  if (a.runs < 1) return Fail(kCommand, "--runs must be at least 1");
  if (a.in_flight < 1 || a.in_flight > 1024)
    return Fail(kCommand,
                "--in-flight: " + std::to_string(a.in_flight) + " is not between 1 and 1024");
  o.requests_in_flight = a.in_flight;

  std::vector<double> ew, er, fw, fr;
  json runs = json::array();
  std::string engine_used;
  // Per run: engine write+read, then fio write+read. Each tool reads what it
  // wrote just before: on a VM whose host caches its virtual disk write-back,
  // freshly written data is faster to read, so a read that follows the other
  // tool's write pass is penalised (measured on such a VM, docs/perf.md:
  // engine/fio read 0.70 with the interleaved order, 1.28 the other way round).
  const std::string fio_file = a.paths[0] + "/strata-fio-" + std::to_string(getpid()) + ".bin";
  for (int i = 0; i < a.runs; ++i) {
    auto session = nvme::EngineBenchSession::Open(o);
    if (!session.ok()) return Fail(kCommand, session.status());
    engine_used = (*session)->engine();
    auto w = (*session)->WritePass();
    if (!w.ok()) return Fail(kCommand, w.status());
    auto rd = (*session)->ReadPass();
    if (!rd.ok()) return Fail(kCommand, rd.status());
    session->reset();  // removes the swap file
    if (a.vs_fio) {
      auto f = nvme::RunFioPass(o, fio_file, "write");
      auto g = f.ok() ? nvme::RunFioPass(o, fio_file, "read") : StatusOr<double>(f.status());
      unlink(fio_file.c_str());
      if (!g.ok()) return Fail(kCommand, g.status());
      fw.push_back(*f);
      fr.push_back(*g);
    }
    ew.push_back(*w);
    er.push_back(*rd);
    json run = {{"run", i}, {"write_gbytes_per_s", ew.back()}, {"read_gbytes_per_s", er.back()}};
    if (a.vs_fio) {
      run["fio_write_gbytes_per_s"] = fw.back();
      run["fio_read_gbytes_per_s"] = fr.back();
    }
    if (!a.json)
      std::fprintf(stderr, "run %d/%d: engine write %.3f read %.3f GB/s%s\n", i + 1, a.runs,
                   ew.back(), er.back(),
                   a.vs_fio ? (", fio write " + std::to_string(fw.back()) + " read " +
                               std::to_string(fr.back()))
                                  .c_str()
                            : "");
    runs.push_back(run);
  }
  json out;
  out["engine"] = engine_used;
  out["paths"] = a.paths;
  out["size_bytes"] = o.size;
  out["block_size"] = o.io.block_size;
  out["queue_depth"] = o.io.queue_depth;
  out["threads"] = o.io.threads;
  out["request_bytes"] = o.request_bytes;
  out["requests_in_flight"] = a.in_flight;
  out["write_gbytes_per_s"] = nvme::Median(ew);
  out["read_gbytes_per_s"] = nvme::Median(er);
  // One request of request_bytes (the last one shorter) at a time: the
  // pass's time per request, what a one-at-a-time caller (a module fetch)
  // waits for each.
  const uint64_t req = std::min(o.request_bytes, o.size);
  const double requests = std::ceil(static_cast<double>(o.size) / static_cast<double>(req));
  auto per_request_us = [&](double gbytes_per_s) {
    return static_cast<double>(o.size) / (gbytes_per_s * 1e9) / requests * 1e6;
  };
  out["requests_per_pass"] = requests;
  out["write_us_per_request"] = per_request_us(nvme::Median(ew));
  out["read_us_per_request"] = per_request_us(nvme::Median(er));
  std::vector<double> wratio, rratio;
  if (a.vs_fio) {
    for (size_t i = 0; i < ew.size(); ++i) {
      wratio.push_back(ew[i] / fw[i]);
      rratio.push_back(er[i] / fr[i]);
    }
    out["fio_write_gbytes_per_s"] = nvme::Median(fw);
    out["fio_read_gbytes_per_s"] = nvme::Median(fr);
    // fio moves the same bytes in blocks of block_size, iodepth deep.
    out["fio_write_us_per_block"] =
        static_cast<double>(o.io.block_size) / (nvme::Median(fw) * 1e9) * 1e6;
    out["fio_read_us_per_block"] =
        static_cast<double>(o.io.block_size) / (nvme::Median(fr) * 1e9) * 1e6;
    // Medians of the runs' own ratios, with their quartiles.
    for (const auto& [name, v] :
         {std::pair<std::string, const std::vector<double>*>{"write", &wratio},
          {"read", &rratio}}) {
      out[name + "_vs_fio"] = Quantile(*v, 0.5);
      out[name + "_vs_fio_min"] = Quantile(*v, 0);
      out[name + "_vs_fio_p25"] = Quantile(*v, 0.25);
      out[name + "_vs_fio_p75"] = Quantile(*v, 0.75);
      out[name + "_vs_fio_max"] = Quantile(*v, 1);
    }
    out["fio_command_write"] =
        nvme::FioCommand(o, a.paths[0] + "/strata-fio-<pid>.bin", "write", "<json>");
  }
  out["runs"] = runs;
  if (a.json) {
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  std::printf(
      "engine %s, %s over %zu path(s), block %llu, queue depth %d, threads %d, %d run(s) "
      "(medians)\n",
      engine_used.c_str(), a.size.c_str(), a.paths.size(),
      static_cast<unsigned long long>(o.io.block_size), o.io.queue_depth, o.io.threads, a.runs);
  std::printf("  write %.3f GB/s   read %.3f GB/s\n", nvme::Median(ew), nvme::Median(er));
  if (a.in_flight == 1)
    std::printf("  per request (%llu bytes, one at a time): write %.1f us   read %.1f us\n",
                static_cast<unsigned long long>(req), out["write_us_per_request"].get<double>(),
                out["read_us_per_request"].get<double>());
  if (a.vs_fio) {
    std::printf("  fio   write %.3f GB/s   read %.3f GB/s\n", nvme::Median(fw), nvme::Median(fr));
    for (const char* d : {"write", "read"}) {
      const std::string k = std::string(d) + "_vs_fio";
      std::printf(
          "  engine/fio %-5s %.3f (median of %d runs' ratios; min %.3f, p25 %.3f, p75 %.3f, "
          "max %.3f)\n",
          d, out[k].get<double>(), a.runs, out[k + "_min"].get<double>(),
          out[k + "_p25"].get<double>(), out[k + "_p75"].get<double>(),
          out[k + "_max"].get<double>());
    }
  }
  return 0;
}

CommandRegistrar reg("bench", [](CLI::App& bench, CliResult& r) {
  auto* cmd = bench.add_subcommand(
      "nvme", "Sequential write then read through the swap store (optionally against fio)");
  auto a = std::make_shared<BenchNvmeArgs>();
  cmd->add_option("--path", a->paths, "Directory for the swap file; repeat to stripe over several")
      ->required()
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--size", a->size, "Bytes written then read (default 1G, ~10 s here)");
  cmd->add_option("--block-size", a->block_size, "aio.block_size (default 1M)");
  cmd->add_option("--queue-depth", a->queue_depth, "aio.queue_depth (default 16)")
      ->transform(CountSuffix());
  cmd->add_option("--threads", a->threads, "aio.intra_op_parallelism: rings (default 1)");
  cmd->add_option("--engine", a->engine, "uring|posix|auto (default uring)")
      ->check(CLI::IsMember({"uring", "io_uring", "posix", "auto"}));
  cmd->add_option("--request-size", a->request,
                  "Bytes per swap-store request (default 256M; DeepSpeed sub-groups are GBs)");
  cmd->add_option("--runs", a->runs, "Repetitions, alternating engine and fio (default 3)")
      ->transform(CountSuffix());
  cmd->add_option("--in-flight", a->in_flight,
                  "Swap-store requests outstanding at once (default 4; 1: one at a time, as a "
                  "module fetch waits)")
      ->transform(CountSuffix());
  cmd->add_flag("--vs-fio", a->vs_fio,
                "Also run fio with the same engine/block/depth/size/O_DIRECT");
  cmd->add_flag("--json", a->json, "Machine-readable output");
  cmd->callback([&r, a] { r.exit_code = RunBenchNvme(*a); });
});

}  // namespace
}  // namespace strata::cli
