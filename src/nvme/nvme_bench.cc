#include "src/nvme/nvme_bench.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "src/common/aligned_buffer.h"
#include "src/common/host_memory.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/nvme/internal.h"

namespace strata::nvme {

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

namespace {

// Runs `count` requests of `req` bytes over [0, size) with `slots` in flight.
Status Sweep(SwapStore* store, const std::string& shard, uint64_t size, uint64_t req, int slots,
             char* base, bool write) {
  std::vector<IoHandle> inflight(static_cast<size_t>(slots));
  uint64_t i = 0;
  for (uint64_t off = 0; off < size; off += req, ++i) {
    size_t slot = i % static_cast<size_t>(slots);
    if (inflight[slot].valid()) RETURN_IF_ERROR(inflight[slot].Wait());
    uint64_t n = std::min(req, size - off);
    char* buf = base + slot * req;
    inflight[slot] = write ? store->Write(shard, off, buf, n) : store->Read(shard, off, buf, n);
  }
  return WaitAll(inflight);
}

}  // namespace

struct EngineBenchSession::State {
  NvmeBenchOptions o;
  uint64_t req = 0;
  size_t slots = 0;
  AlignedBuffer wbuf, rbuf;
  std::unique_ptr<IoService> service;
  std::unique_ptr<SwapStore> store;
  bool written = false;
};

EngineBenchSession::EngineBenchSession(std::unique_ptr<State> s) : s_(std::move(s)) {}
EngineBenchSession::~EngineBenchSession() {
  if (s_ && s_->store) s_->store->Close().IgnoreError();
}
std::string EngineBenchSession::engine() const {
  return std::string(EngineKindName(s_->service->engine()->kind()));
}

StatusOr<std::unique_ptr<EngineBenchSession>> EngineBenchSession::Open(const NvmeBenchOptions& o) {
  if (o.size == 0) return InvalidArgumentError("bench size is 0 bytes");
  if (o.requests_in_flight < 1)
    return InvalidArgumentError("requests_in_flight must be at least 1");
  if (o.paths.empty()) return InvalidArgumentError("bench: no nvme path given");
  auto st = std::make_unique<State>();
  st->o = o;
  st->req = AlignUp(std::min<uint64_t>(o.request_bytes, o.size), 4096);
  st->slots = static_cast<size_t>(
      std::min<uint64_t>(o.requests_in_flight, (o.size + st->req - 1) / st->req));
  // Before allocating anything: the swap file must fit in every path (what
  // SwapStore::Open checks again, after the buffers), and the two buffers in
  // memory.
  const uint64_t stripe = std::max<uint64_t>(o.io.block_size, 4096);
  const uint64_t per_path = AlignUp((o.size + o.paths.size() - 1) / o.paths.size(), stripe);
  for (const std::string& p : o.paths) {
    RETURN_IF_ERROR(internal::CheckWritableDir(p));
    RETURN_IF_ERROR(RemoveLeftoverSwapFiles(p).status());
    ASSIGN_OR_RETURN(uint64_t avail, internal::FreeBytes(p));
    if (avail < per_path)
      return ResourceExhaustedError(fmt::format(
          "bench: nvme path {} needs {} bytes ({} over {} path(s)) but only {} bytes are "
          "available there",
          p, per_path, o.size, o.paths.size(), avail));
  }
  RETURN_IF_ERROR(CheckHostMemory(
      fmt::format("bench: the write and read buffers ({} requests of {} bytes in flight, x2)",
                  st->slots, st->req),
      2 * st->req * st->slots));
  ASSIGN_OR_RETURN(st->wbuf, AlignedBuffer::Allocate(st->req * st->slots, 4096));
  ASSIGN_OR_RETURN(st->rbuf, AlignedBuffer::Allocate(st->req * st->slots, 4096));
  std::mt19937_64 rng(0x5eed ^ static_cast<uint64_t>(getpid()));
  auto* w64 = st->wbuf.as<uint64_t>();
  for (size_t i = 0; i < st->req * st->slots / 8; ++i) w64[i] = rng() | 1;
  std::memset(st->rbuf.data(), 0, st->rbuf.size());
  IoOptions io = o.io;
  io.fixed_buffers = {{st->wbuf.data(), st->wbuf.size()}, {st->rbuf.data(), st->rbuf.size()}};
  ASSIGN_OR_RETURN(st->service, IoService::Create(io));
  SwapStoreOptions so;
  so.paths = o.paths;
  so.capacity_bytes = o.size;
  so.stripe_unit = std::max<uint64_t>(io.block_size, 4096);
  ASSIGN_OR_RETURN(st->store, SwapStore::Open(so, st->service.get()));
  RETURN_IF_ERROR(st->store->Allocate("bench", o.size));
  return std::unique_ptr<EngineBenchSession>(new EngineBenchSession(std::move(st)));
}

StatusOr<double> EngineBenchSession::WritePass() {
  State& m = *s_;
  Stopwatch sw;
  RETURN_IF_ERROR(Sweep(m.store.get(), "bench", m.o.size, m.req, static_cast<int>(m.slots),
                        m.wbuf.as<char>(), true));
  double sec = sw.Seconds();
  m.written = true;
  return static_cast<double>(m.o.size) / sec / 1e9;
}

StatusOr<double> EngineBenchSession::ReadPass() {
  State& m = *s_;
  if (!m.written) return FailedPreconditionError("bench read pass before a write pass");
  std::memset(m.rbuf.data(), 0, m.rbuf.size());
  Stopwatch sw;
  RETURN_IF_ERROR(Sweep(m.store.get(), "bench", m.o.size, m.req, static_cast<int>(m.slots),
                        m.rbuf.as<char>(), false));
  double sec = sw.Seconds();
  // The last `slots` requests read back what the same slots wrote.
  uint64_t nreq = (m.o.size + m.req - 1) / m.req;
  for (uint64_t i = nreq > m.slots ? nreq - m.slots : 0; i < nreq; ++i) {
    size_t slot = i % m.slots;
    uint64_t n = std::min(m.req, m.o.size - i * m.req);
    if (std::memcmp(m.wbuf.as<char>() + slot * m.req, m.rbuf.as<char>() + slot * m.req, n) != 0)
      return DataLossError(fmt::format(
          "bench: data read back at offset {} differs from what was written", i * m.req));
  }
  return static_cast<double>(m.o.size) / sec / 1e9;
}

StatusOr<NvmeBenchResult> RunEngineBench(const NvmeBenchOptions& o) {
  ASSIGN_OR_RETURN(auto session, EngineBenchSession::Open(o));
  NvmeBenchResult r;
  r.engine = session->engine();
  ASSIGN_OR_RETURN(r.write_gbytes_per_s, session->WritePass());
  ASSIGN_OR_RETURN(r.read_gbytes_per_s, session->ReadPass());
  return r;
}

std::string FioCommand(const NvmeBenchOptions& o, const std::string& file, const std::string& rw,
                       const std::string& json_out) {
  bool uring = o.io.engine != EngineKind::kPosix;
  int jobs = uring ? o.io.threads : o.io.queue_depth * o.io.threads;
  int depth = uring ? o.io.queue_depth : 1;
  uint64_t per_job = AlignDown(o.size / static_cast<uint64_t>(jobs), o.io.block_size);
  if (per_job == 0) per_job = o.io.block_size;
  std::string cmd = fmt::format(
      "fio --name=strata-vs-fio --filename={} --rw={} --bs={} --iodepth={} --numjobs={} "
      "--size={} --offset_increment={} --direct=1 --thread --group_reporting "
      "--output-format=json --output={} ",
      file, rw, o.io.block_size, depth, jobs, per_job, per_job, json_out);
  if (uring) {
    cmd += "--ioengine=io_uring --fixedbufs=1 --registerfiles=1";
    if (o.io.sqpoll) cmd += " --sqthread_poll=1";
  } else {
    cmd += "--ioengine=psync";
  }
  return cmd;
}

namespace {
StatusOr<double> RunFioOnce(const std::string& cmd, const std::string& json_out,
                            const std::string& rw) {
  std::string full = cmd + " >/dev/null 2>&1";
  int rc = std::system(full.c_str());
  std::ifstream in(json_out);
  std::stringstream ss;
  ss << in.rdbuf();
  unlink(json_out.c_str());
  if (rc != 0) return IOError(fmt::format("fio exited with status {}: {}", rc, cmd));
  auto j = nlohmann::json::parse(ss.str(), nullptr, false);
  if (j.is_discarded() || !j.contains("jobs") || j["jobs"].empty())
    return IOError(fmt::format("fio output is not the expected JSON ({})", cmd));
  double bw = j["jobs"][0][rw].value("bw_bytes", 0.0);
  if (bw <= 0) return IOError(fmt::format("fio reported no {} bandwidth ({})", rw, cmd));
  return bw / 1e9;
}
}  // namespace

StatusOr<double> RunFioPass(const NvmeBenchOptions& o, const std::string& file,
                            const std::string& rw) {
  if (std::system("command -v fio >/dev/null 2>&1") != 0)
    return NotFoundError("fio is not installed (not found in PATH)");
  std::string json = file + ".json";
  return RunFioOnce(FioCommand(o, file, rw, json), json, rw);
}

StatusOr<NvmeBenchResult> RunFioBench(const NvmeBenchOptions& o) {
  if (o.paths.empty()) return InvalidArgumentError("fio: no path");
  std::string file = fmt::format("{}/strata-fio-{}.bin", o.paths[0], getpid());
  NvmeBenchResult r;
  r.engine = o.io.engine == EngineKind::kPosix ? "psync" : "io_uring";
  auto w = RunFioPass(o, file, "write");
  auto rd = w.ok() ? RunFioPass(o, file, "read") : StatusOr<double>(w.status());
  unlink(file.c_str());
  if (!rd.ok()) return rd.status();
  r.write_gbytes_per_s = *w;
  r.read_gbytes_per_s = *rd;
  return r;
}

StatusOr<std::vector<TunePoint>> RunTune(
    const NvmeBenchOptions& base, const std::vector<uint64_t>& block_sizes,
    const std::vector<int>& queue_depths, const std::vector<int>& threads,
    const std::function<void(size_t, size_t, const TunePoint&)>& progress, int confirm_top,
    int confirm_runs) {
  std::vector<TunePoint> points;
  const size_t sweep = block_sizes.size() * queue_depths.size() * threads.size();
  const size_t top = std::min<size_t>(static_cast<size_t>(std::max(confirm_top, 0)), sweep);
  const size_t n = sweep + top * static_cast<size_t>(std::max(confirm_runs, 0));
  size_t i = 0;
  auto measure = [&](uint64_t bs, int qd, int t) -> StatusOr<TunePoint> {
    NvmeBenchOptions o = base;
    o.io.block_size = bs;
    o.io.queue_depth = qd;
    o.io.threads = t;
    RETURN_IF_ERROR(ValidateIoOptions(o.io));
    ASSIGN_OR_RETURN(NvmeBenchResult r, RunEngineBench(o));
    TunePoint p{bs, qd, t, r, std::sqrt(r.read_gbytes_per_s * r.write_gbytes_per_s)};
    if (progress) progress(++i, n, p);
    return p;
  };
  for (uint64_t bs : block_sizes)
    for (int qd : queue_depths)
      for (int t : threads) {
        ASSIGN_OR_RETURN(TunePoint p, measure(bs, qd, t));
        points.push_back(p);
      }
  auto by_score = [](const TunePoint& a, const TunePoint& b) { return a.score > b.score; };
  std::stable_sort(points.begin(), points.end(), by_score);
  if (top == 0 || confirm_runs <= 0) return points;
  // Re-measure the leaders, interleaved, and keep medians.
  std::vector<std::vector<TunePoint>> runs(top);
  for (size_t k = 0; k < top; ++k) runs[k].push_back(points[k]);
  for (int rep = 0; rep < confirm_runs; ++rep)
    for (size_t k = 0; k < top; ++k) {
      ASSIGN_OR_RETURN(TunePoint p,
                       measure(points[k].block_size, points[k].queue_depth, points[k].threads));
      runs[k].push_back(p);
    }
  for (size_t k = 0; k < top; ++k) {
    std::vector<double> w, r, sc;
    for (auto& p : runs[k]) {
      w.push_back(p.result.write_gbytes_per_s);
      r.push_back(p.result.read_gbytes_per_s);
      sc.push_back(p.score);
    }
    points[k].result.write_gbytes_per_s = Median(w);
    points[k].result.read_gbytes_per_s = Median(r);
    points[k].score = Median(sc);
  }
  std::stable_sort(points.begin(), points.begin() + static_cast<std::ptrdiff_t>(top), by_score);
  return points;
}

}  // namespace strata::nvme
