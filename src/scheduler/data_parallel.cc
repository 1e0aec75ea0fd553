#include "src/scheduler/data_parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "src/common/status_util.h"
#include "src/common/timer.h"

namespace strata::scheduler {
namespace {

// The first line where a and b differ, as "line N: A / B".
std::string FirstDifference(const std::string& a, const std::string& b) {
  size_t pa = 0, pb = 0;
  for (int line = 1;; ++line) {
    const size_t ea = std::min(a.find('\n', pa), a.size());
    const size_t eb = std::min(b.find('\n', pb), b.size());
    const std::string la = a.substr(pa, ea - pa), lb = b.substr(pb, eb - pb);
    if (la != lb || ea == a.size() || eb == b.size()) {
      if (la == lb && a.size() - ea != b.size() - eb)
        return fmt::format("line {}: one ends there, the other goes on", line + 1);
      return fmt::format("line {}: \"{}\" against \"{}\"", line, la, lb);
    }
    pa = ea + 1;
    pb = eb + 1;
  }
}

}  // namespace

DataParallel::DataParallel(gpu::Device* device, std::unique_ptr<gpu::Communicator> comm,
                           std::unique_ptr<gpu::Stream> stream, int stage)
    : dev_(device), comm_(std::move(comm)), stream_(std::move(stream)), stage_(stage) {}

DataParallel::~DataParallel() {
  // The issuer's thread ends first (what it was handed is issued), then the
  // collectives still queued end (each within the timeout) before the
  // staging buffer goes.
  issuer_.reset();
  if (stream_) stream_->Synchronize().IgnoreError();
}

StatusOr<std::unique_ptr<DataParallel>> DataParallel::Create(gpu::Device* device,
                                                             const gpu::CommOptions& options,
                                                             int stage) {
  if (stage < 1 || stage > 3)
    return NotSupportedError(fmt::format(
        "zero_optimization.stage: {} with {} ranks; data parallelism partitions the optimizer "
        "states with stage 1, 2 or 3",
        stage, options.world_size));
  ASSIGN_OR_RETURN(std::unique_ptr<gpu::Communicator> comm,
                   gpu::CreateCommunicator(*device, options));
  ASSIGN_OR_RETURN(std::unique_ptr<gpu::Stream> stream, device->CreateStream("collectives"));
  std::unique_ptr<DataParallel> dp(
      new DataParallel(device, std::move(comm), std::move(stream), stage));
  // A small staging buffer until Bind: the checks at Plan and ReduceScalars
  // need one before the layout is known (the same on every rank).
  dp->chunk_ = kStartChunkElems;
  ASSIGN_OR_RETURN(
      dp->staging_,
      device->Allocate(static_cast<size_t>(StagingBytes(dp->world_size(), dp->chunk_))));
  return dp;
}

int64_t DataParallel::StagingBytes(int world_size, int64_t chunk_elems) {
  return static_cast<int64_t>(world_size + 1) * chunk_elems * static_cast<int64_t>(sizeof(float));
}

int64_t DataParallel::ChunkElems(const Layout& layout, int64_t reduce_bucket_size) {
  return std::max<int64_t>(
      kMinChunkElems, std::min({reduce_bucket_size, layout.partition_elems(), kMaxChunkElems}));
}

int64_t DataParallel::GatherChunkBytes(const Layout& layout, int64_t allgather_bucket_size) {
  // The parameters' mean bytes per element (not counting the page padding
  // between modules).
  double bytes = 0, elems = 0;
  for (const ParamRec& p : layout.params()) {
    bytes += static_cast<double>(p.numel) * static_cast<double>(DTypeSize(p.dtype));
    elems += static_cast<double>(p.numel);
  }
  const double per_elem = elems > 0 ? bytes / elems : 2.0;
  if (allgather_bucket_size <= 0) allgather_bucket_size = kZeroMeansOneTensorElems;
  const double want = static_cast<double>(allgather_bucket_size) * per_elem /
                      static_cast<double>(std::max(1, layout.world_size()));
  const int64_t cap =
      std::min(layout.MaxOwnedBytes(), kMaxChunkElems * static_cast<int64_t>(sizeof(float)));
  const auto chunk = static_cast<int64_t>(std::min(want, static_cast<double>(cap)));
  return std::max<int64_t>(4, chunk / 4 * 4);
}

Status DataParallel::Bind(const Layout* layout, int64_t chunk_elems, int64_t gather_chunk_bytes) {
  return InContext("allocating the staging buffer", [&]() -> Status {
    layout_ = layout;
    for (int r = 0; r <= world_size(); ++r) {
      const int64_t b = layout->ByteOfElem(r * layout->partition_elems());
      if (b % 4 != 0)
        return InternalError(
            fmt::format("rank {}'s parameter bytes start at {}, not a multiple of 4", r, b));
    }
    staging_ = gpu::DeviceBuffer();  // the small one from Create
    chunk_ = std::max<int64_t>(kMinChunkElems, chunk_elems);
    gather_bytes_ = std::max<int64_t>(4, gather_chunk_bytes / 4 * 4);
    ASSIGN_OR_RETURN(staging_, dev_->Allocate(static_cast<size_t>(StagingBytes(
                                   world_size(), StagingChunkElems(chunk_, gather_bytes_)))));
    return Status();
  });
}

Status DataParallel::Sync(const char* what) {
  Status s = stream_->Synchronize();
  if (s.ok()) s = comm_->AsyncError();
  return InContext(what, [&] { return s; });
}

std::string DataParallel::ContextPrefix() const {
  return fmt::format("data parallelism (rank {} of {})", rank(), world_size());
}

Status DataParallel::AddContext(const Status& s, std::string_view what) const {
  if (s.ok()) return s;
  const std::string prefix = ContextPrefix();
  // A collective inside another (a flush before a gather, the exchange
  // inside a check) already said where it failed.
  if (s.message().find(prefix) != std::string::npos) return s;
  return s.WithContext(fmt::format("{}: {}", prefix, what));
}

Status DataParallel::ToStaging(void* staging, const void* src, size_t bytes, Memory where) {
  return where == Memory::kDevice ? dev_->CopyD2D(staging, src, bytes, *stream_)
                                  : dev_->CopyH2D(staging, src, bytes, *stream_);
}

Status DataParallel::FromStaging(void* dst, const void* staging, size_t bytes, Memory where) {
  return where == Memory::kDevice ? dev_->CopyD2D(dst, staging, bytes, *stream_)
                                  : dev_->CopyD2H(dst, staging, bytes, *stream_);
}

Status DataParallel::ZeroOthers(float* acc, Memory where) {
  // Only the partition's sums are read by this rank's step; the rest starts
  // the next window at zero.
  const int64_t part = layout_->partition_elems(), total = layout_->total_elems();
  const int64_t me = rank();
  const auto before = static_cast<size_t>(me * part);
  const auto after = static_cast<size_t>(total - (me + 1) * part);
  if (where == Memory::kHost) {
    std::memset(acc, 0, before * sizeof(float));
    std::memset(acc + (me + 1) * part, 0, after * sizeof(float));
    return Status();
  }
  RETURN_IF_ERROR(dev_->Fill(acc, DType::kFp32, before, 0.f, *stream_));
  RETURN_IF_ERROR(dev_->Fill(acc + (me + 1) * part, DType::kFp32, after, 0.f, *stream_));
  return Sync("zeroing the other ranks' gradients");
}

Status DataParallel::ReduceGradients(float* acc, Memory where) {
  return InContext("reducing the gradients", [&]() -> Status {
    RETURN_IF_ERROR(Flush());
    const int64_t t0 = NowNanos();
    const int64_t n_ranks = world_size(), me = rank();
    const int64_t part = layout_->partition_elems();
    const int64_t total = layout_->total_elems();
    float* send = staging_.as<float>();
    constexpr size_t kF = sizeof(float);
    if (stage_ == 1) {
      // All-reduce: every element, (world + 1) chunks at a time.
      const int64_t step = (n_ranks + 1) * chunk_;
      for (int64_t k = 0; k < total; k += step) {
        RETURN_IF_ERROR(IssueReduce(acc + k, static_cast<size_t>(std::min(step, total - k)), 0,
                                    /*everyone=*/true, where));
        RETURN_IF_ERROR(Sync("all-reducing the gradients"));
      }
    } else {
      // Reduce-scatter: chunk k of every partition in, chunk k of ours out.
      float* recv = send + n_ranks * chunk_;
      for (int64_t k = 0; k < part; k += chunk_) {
        const int64_t n = std::min(chunk_, part - k);
        for (int64_t r = 0; r < n_ranks; ++r)
          RETURN_IF_ERROR(
              ToStaging(send + r * n, acc + r * part + k, static_cast<size_t>(n) * kF, where));
        RETURN_IF_ERROR(Timed([&] {
          return comm_->ReduceScatter(send, recv, static_cast<size_t>(n), DType::kFp32,
                                      gpu::ReduceOp::kAvg, *stream_);
        }));
        RETURN_IF_ERROR(FromStaging(acc + me * part + k, recv, static_cast<size_t>(n) * kF, where));
        RETURN_IF_ERROR(Sync("reduce-scattering the gradients"));
        MutexLock lock(&mu_);
        counters_.reduced_bytes += n_ranks * n * static_cast<int64_t>(kF);
      }
    }
    RETURN_IF_ERROR(ZeroOthers(acc, where));
    AddBusy(t0);
    return Status();
  });
}

Status DataParallel::StartOverlapIssuer() {
  if (issuer_) return Status();
  auto issuer = std::make_unique<OverlapIssuer>([this](int64_t lo) { return ReduceFrom(lo); });
  RETURN_IF_ERROR(issuer->Start());
  issuer_ = std::move(issuer);
  return Status();
}

void DataParallel::BeginOverlap(float* acc, Memory where) {
  MutexLock lock(&mu_);
  overlap_acc_ = acc;
  overlap_where_ = where;
  overlap_next_ = layout_->total_elems();
}

bool DataParallel::overlapping() const {
  MutexLock lock(&mu_);
  return overlap_acc_ != nullptr;
}

void DataParallel::ReduceFromWhenReady(int64_t lo, std::function<Status()> ready) {
  issuer_->Submit(lo, std::move(ready));
}

Status DataParallel::ReduceFrom(int64_t lo) {
  return InContext("reducing the gradients (overlapped with backward)",
                   [&]() -> Status { return IssueFrom(lo, /*overlapped=*/true); });
}

Status DataParallel::IssueFrom(int64_t lo, bool overlapped) {
  const int64_t part = layout_->partition_elems();
  for (;;) {
    // The next piece down, read under the lock; issued without it (the copy
    // into staging may block until the stream reaches it).
    float* acc = nullptr;
    Memory where = Memory::kHost;
    int64_t a = 0, b = 0, r = 0;
    {
      MutexLock lock(&mu_);
      if (overlap_acc_ == nullptr)
        return FailedPreconditionError("ReduceFrom: no overlapped reduction");
      if (overlap_next_ <= 0) return Status();
      r = (overlap_next_ - 1) / part;
      const int64_t p0 = r * part;
      a = p0 + (overlap_next_ - 1 - p0) / chunk_ * chunk_;
      b = overlap_next_;
      if (a < lo) return Status();
      acc = overlap_acc_;
      where = overlap_where_;
    }
    const auto n = static_cast<size_t>(b - a);
    RETURN_IF_ERROR(IssueReduce(acc + a, n, static_cast<int>(r), stage_ == 1, where));
    MutexLock lock(&mu_);
    if (overlapped) counters_.overlapped_bytes += static_cast<int64_t>(n * sizeof(float));
    overlap_next_ = a;
  }
}

Status DataParallel::IssueReduce(float* sums, size_t n, int owner, bool everyone, Memory where) {
  float* buf = staging_.as<float>();
  constexpr size_t kF = sizeof(float);
  RETURN_IF_ERROR(ToStaging(buf, sums, n * kF, where));
  if (everyone) {
    RETURN_IF_ERROR(Timed([&] {
      return comm_->AllReduce(buf, buf, n, DType::kFp32, gpu::ReduceOp::kAvg, *stream_);
    }));
  } else {
    RETURN_IF_ERROR(Timed([&] {
      return comm_->Reduce(buf, buf, n, DType::kFp32, gpu::ReduceOp::kAvg, owner, *stream_);
    }));
  }
  if (everyone || owner == rank()) RETURN_IF_ERROR(FromStaging(sums, buf, n * kF, where));
  MutexLock lock(&mu_);
  counters_.reduced_bytes += static_cast<int64_t>(n * kF);
  return Status();
}

void DataParallel::AddBusy(int64_t since_ns) {
  const double s = static_cast<double>(NowNanos() - since_ns) * 1e-9;
  MutexLock lock(&mu_);
  counters_.busy_s += s;
}

Status DataParallel::ReduceGroup(size_t g, float* sums) {
  return InContext("reducing a sub-group's gradients", [&]() -> Status {
    RETURN_IF_ERROR(Flush());
    const int64_t t0 = NowNanos();
    const SubGroup& sg = layout_->group(g);
    const auto owner = static_cast<int>(sg.elem_begin / layout_->partition_elems());
    const int64_t step = (world_size() + 1) * chunk_;  // the staging buffer's fp32
    for (int64_t k = 0; k < sg.elems(); k += step)
      RETURN_IF_ERROR(IssueReduce(sums + k, static_cast<size_t>(std::min(step, sg.elems() - k)),
                                  owner, /*everyone=*/false, Memory::kHost));
    RETURN_IF_ERROR(Sync("reducing a sub-group's gradients"));
    AddBusy(t0);
    return Status();
  });
}

Status DataParallel::FinishOverlap() {
  return InContext("reducing the gradients (overlapped with backward)", [&]() -> Status {
    const int64_t t0 = NowNanos();
    // What the issuer was handed, then the rest (issued at the window's
    // end: not counted as overlapped).
    Status s = Flush();
    if (s.ok()) s = IssueFrom(0, /*overlapped=*/false);
    if (s.ok()) s = Sync("reducing the gradients (overlapped with backward)");
    float* acc = nullptr;
    Memory where = Memory::kHost;
    {
      MutexLock lock(&mu_);
      acc = overlap_acc_;
      where = overlap_where_;
      overlap_acc_ = nullptr;
    }
    RETURN_IF_ERROR(s);
    RETURN_IF_ERROR(ZeroOthers(acc, where));
    AddBusy(t0);
    return Status();
  });
}

void DataParallel::AbandonOverlap() {
  if (issuer_) issuer_->Reset();
  MutexLock lock(&mu_);
  if (overlap_acc_ == nullptr) return;
  stream_->Synchronize().IgnoreError();
  overlap_acc_ = nullptr;
}

Status DataParallel::CombineChecks(const std::vector<double>& partial,
                                   const std::vector<uint8_t>& bad, bool* overflow, double* sumsq) {
  return InContext("combining the gradient checks", [&]() -> Status {
    const int64_t t0 = NowNanos();
    // Per block: its sum, then 1.0 for an inf/nan.
    std::vector<double> mine;
    for (size_t i = 0; i < partial.size(); ++i)
      mine.insert(mine.end(), {partial[i], bad[i] ? 1.0 : 0.0});
    ASSIGN_OR_RETURN(std::vector<std::vector<double>> all, AllGatherDoubles(mine));
    double sum = 0;
    bool any = false;
    for (const std::vector<double>& r : all)  // rank order is element order
      for (size_t i = 0; i + 1 < r.size(); i += 2) {
        sum += r[i];
        any = any || r[i + 1] != 0.0;
      }
    *sumsq = sum;
    *overflow = any;
    AddBusy(t0);
    return Status();
  });
}

Status DataParallel::GatherPieces(const std::vector<std::pair<int64_t, int64_t>>& pieces,
                                  const uint8_t* src, int64_t src_base, uint8_t* dst,
                                  int64_t dst_base, bool copy_own, Memory where, const char* what,
                                  gpu::Event* done) {
  return InContext(what, [&]() -> Status {
    RETURN_IF_ERROR(Flush());
    const int64_t t0 = NowNanos();
    const int n_ranks = world_size(), me = rank();
    int64_t longest = 0;
    for (const auto& [lo, hi] : pieces) longest = std::max(longest, hi - lo);
    // allgather_bucket_size (Bind), or before Bind the staging's chunk.
    const int64_t chunk_bytes =
        gather_bytes_ > 0 ? gather_bytes_ : chunk_ * static_cast<int64_t>(sizeof(float));
    auto* send = staging_.as<uint8_t>();
    uint8_t* recv = send + chunk_bytes;
    for (int64_t off = 0; off < longest; off += chunk_bytes) {
      const int64_t n = (std::min(chunk_bytes, longest - off) + 3) / 4 * 4;  // whole fp32 slots
      auto len = [&](int r) {
        const auto [lo, hi] = pieces[static_cast<size_t>(r)];
        return std::clamp<int64_t>(hi - lo - off, 0, n);
      };
      const int64_t my_lo = pieces[static_cast<size_t>(me)].first;
      if (len(me) > 0)
        RETURN_IF_ERROR(
            ToStaging(send, src + (my_lo - src_base) + off, static_cast<size_t>(len(me)), where));
      RETURN_IF_ERROR(Timed([&] {
        return comm_->AllGather(send, recv, static_cast<size_t>(n / 4), DType::kFp32, *stream_);
      }));
      for (int r = 0; r < n_ranks; ++r) {
        if (len(r) == 0 || (r == me && !copy_own)) continue;
        RETURN_IF_ERROR(FromStaging(dst + (pieces[static_cast<size_t>(r)].first - dst_base) + off,
                                    recv + r * n, static_cast<size_t>(len(r)), where));
        if (r != me) {
          MutexLock lock(&mu_);
          counters_.gathered_bytes += len(r);
        }
      }
      // (One stream: the next chunk's copy into staging follows this one's
      // copies out of it.)
      if (done == nullptr) RETURN_IF_ERROR(Sync(what));
    }
    if (done != nullptr) return stream_->Record(*done);
    AddBusy(t0);
    return Status();
  });
}

Status DataParallel::GatherParams(uint8_t* params, Memory where) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int r = 0; r < world_size(); ++r) ranges.push_back(layout_->OwnedBytes(r));
  return GatherPieces(ranges, params, 0, params, 0, /*copy_own=*/false, where,
                      "gathering the updated parameters");
}

std::vector<std::pair<int64_t, int64_t>> DataParallel::PiecesOf(int64_t byte_begin,
                                                                int64_t byte_end) const {
  std::vector<std::pair<int64_t, int64_t>> pieces;
  for (int r = 0; r < world_size(); ++r) {
    const auto [b0, b1] = layout_->OwnedBytes(r);
    const int64_t lo = std::max(b0, byte_begin), hi = std::max(lo, std::min(b1, byte_end));
    pieces.emplace_back(lo, hi);
  }
  return pieces;
}

Status DataParallel::GatherModule(int m, PartBytes mine, uint8_t* dst, Memory where) {
  const ModuleExtent& me = layout_->module(m);
  return GatherPieces(PiecesOf(me.byte_begin, me.byte_end), mine.data, mine.first_byte, dst,
                      me.byte_begin, /*copy_own=*/true, where, "gathering a module's parameters");
}

Status DataParallel::IssueGatherModule(int m, PartBytes mine, uint8_t* dst, Memory where,
                                       gpu::Event* done) {
  if (done == nullptr) return InvalidArgumentError("IssueGatherModule: no event to record");
  const ModuleExtent& me = layout_->module(m);
  return GatherPieces(PiecesOf(me.byte_begin, me.byte_end), mine.data, mine.first_byte, dst,
                      me.byte_begin, /*copy_own=*/true, where,
                      "gathering a module's parameters (prefetched)", done);
}

Status DataParallel::WaitGathered(gpu::Event& done) {
  return InContext("gathering a module's parameters (prefetched)", [&]() -> Status {
    const int64_t t0 = NowNanos();
    Status s = done.Synchronize();
    if (s.ok()) s = comm_->AsyncError();
    AddBusy(t0);
    return s;
  });
}

Status DataParallel::ShareMaster(const ParamRec& p, std::span<float> out) {
  return InContext("sharing a parameter's fp32 values", [&]() -> Status {
    RETURN_IF_ERROR(Flush());
    const int64_t part = layout_->partition_elems();
    const int64_t step = (world_size() + 1) * chunk_;
    float* buf = staging_.as<float>();
    constexpr size_t kF = sizeof(float);
    for (int r = 0; r < world_size(); ++r) {
      const int64_t b = std::max(p.elem_off, r * part);
      const int64_t e = std::min(p.elem_off + p.numel, (r + 1) * part);
      for (int64_t k = b; k < e; k += step) {
        const int64_t n = std::min(step, e - k);
        float* host = out.data() + (k - p.elem_off);
        if (r == rank())
          RETURN_IF_ERROR(dev_->CopyH2D(buf, host, static_cast<size_t>(n) * kF, *stream_));
        RETURN_IF_ERROR(Timed([&] {
          return comm_->Broadcast(buf, buf, static_cast<size_t>(n), DType::kFp32, r, *stream_);
        }));
        if (r != rank())
          RETURN_IF_ERROR(dev_->CopyD2H(host, buf, static_cast<size_t>(n) * kF, *stream_));
        RETURN_IF_ERROR(Sync("sharing a parameter's fp32 values"));
      }
    }
    return Status();
  });
}

StatusOr<std::vector<std::string>> DataParallel::AllGatherBytes(const std::string& mine) {
  return InContext<std::vector<std::string>>(
      "exchanging bytes", [&]() -> StatusOr<std::vector<std::string>> {
        RETURN_IF_ERROR(Flush());
        const int n_ranks = world_size();
        // allgather_bucket_size (Bind), or before Bind the staging's chunk.
        const int64_t chunk_bytes =
            gather_bytes_ > 0 ? gather_bytes_ : chunk_ * static_cast<int64_t>(sizeof(float));
        auto* send = staging_.as<uint8_t>();
        uint8_t* recv = send + chunk_bytes;
        // The lengths first: 8 bytes from each rank (chunk_ >= kMinChunkElems).
        std::vector<int64_t> lengths(static_cast<size_t>(n_ranks));
        const auto len = static_cast<int64_t>(mine.size());
        RETURN_IF_ERROR(dev_->CopyH2D(send, &len, sizeof(len), *stream_));
        RETURN_IF_ERROR(
            Timed([&] { return comm_->AllGather(send, recv, 2, DType::kFp32, *stream_); }));
        RETURN_IF_ERROR(
            dev_->CopyD2H(lengths.data(), recv, sizeof(int64_t) * lengths.size(), *stream_));
        RETURN_IF_ERROR(Sync("exchanging lengths"));
        const int64_t longest = *std::max_element(lengths.begin(), lengths.end());
        std::vector<std::string> all(static_cast<size_t>(n_ranks));
        for (int r = 0; r < n_ranks; ++r)
          all[static_cast<size_t>(r)].resize(static_cast<size_t>(lengths[static_cast<size_t>(r)]));
        for (int64_t off = 0; off < longest; off += chunk_bytes) {
          const int64_t n = (std::min(chunk_bytes, longest - off) + 3) / 4 * 4;
          const int64_t mine_len =
              std::clamp<int64_t>(static_cast<int64_t>(mine.size()) - off, 0, n);
          if (mine_len > 0)
            RETURN_IF_ERROR(
                dev_->CopyH2D(send, mine.data() + off, static_cast<size_t>(mine_len), *stream_));
          RETURN_IF_ERROR(Timed([&] {
            return comm_->AllGather(send, recv, static_cast<size_t>(n / 4), DType::kFp32, *stream_);
          }));
          for (int r = 0; r < n_ranks; ++r) {
            const int64_t len = std::clamp<int64_t>(lengths[static_cast<size_t>(r)] - off, 0, n);
            if (len > 0)
              RETURN_IF_ERROR(dev_->CopyD2H(all[static_cast<size_t>(r)].data() + off, recv + r * n,
                                            static_cast<size_t>(len), *stream_));
          }
          RETURN_IF_ERROR(Sync("exchanging bytes"));
        }
        return all;
      });
}

Status DataParallel::CheckSame(const std::string& what, const std::string& text) {
  ASSIGN_OR_RETURN(std::vector<std::string> all, AllGatherBytes(text));
  std::vector<int> differ;
  for (int r = 1; r < world_size(); ++r)
    if (all[static_cast<size_t>(r)] != all[0]) differ.push_back(r);
  if (differ.empty()) return Status();
  const int r = differ.front();
  return FailedPreconditionError(fmt::format(
      "data parallelism: rank {}'s {} differs from rank 0's ({} of {} ranks differ); first "
      "difference, rank 0 against rank {}: {}. Start every rank with the same config and model",
      r, what, differ.size(), world_size(), r,
      FirstDifference(all[0], all[static_cast<size_t>(r)])));
}

StatusOr<std::vector<std::vector<double>>> DataParallel::AllGatherDoubles(
    std::span<const double> mine) {
  std::string bytes(mine.size() * sizeof(double), '\0');
  if (!mine.empty()) std::memcpy(bytes.data(), mine.data(), bytes.size());
  ASSIGN_OR_RETURN(std::vector<std::string> all, AllGatherBytes(bytes));
  std::vector<std::vector<double>> out(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    out[r].resize(all[r].size() / sizeof(double));
    if (!out[r].empty()) std::memcpy(out[r].data(), all[r].data(), out[r].size() * sizeof(double));
  }
  return out;
}

Status DataParallel::ReduceScalars(std::span<double> values, Scalars op) {
  return InContext("reducing scalars", [&]() -> Status {
    ASSIGN_OR_RETURN(std::vector<std::vector<double>> all, AllGatherDoubles(values));
    for (size_t r = 0; r < all.size(); ++r)
      if (all[r].size() != values.size())
        return InvalidArgumentError(fmt::format("rank {} reduced {} values, rank {} {}", r,
                                                all[r].size(), rank(), values.size()));
    for (size_t i = 0; i < values.size(); ++i) {
      double acc = all[0][i];
      for (size_t r = 1; r < all.size(); ++r)
        acc = op == Scalars::kMax ? std::max(acc, all[r][i]) : acc + all[r][i];
      values[i] = op == Scalars::kMean ? acc / static_cast<double>(all.size()) : acc;
    }
    return Status();
  });
}

StatusOr<double> DataParallel::ProbeBusBandwidth(int reps) {
  return InContext<double>("measuring the collectives' bandwidth", [&]() -> StatusOr<double> {
    RETURN_IF_ERROR(Flush());
    const int64_t n = world_size();
    const int64_t bytes =
        StagingChunkElems(chunk_, gather_bytes_) * static_cast<int64_t>(sizeof(float));
    auto* send = staging_.as<uint8_t>();
    uint8_t* recv = send + bytes;
    gpu::EventOptions o;
    o.timing = true;
    ASSIGN_OR_RETURN(std::unique_ptr<gpu::Event> start, dev_->CreateEvent(o));
    ASSIGN_OR_RETURN(std::unique_ptr<gpu::Event> end, dev_->CreateEvent(o));
    std::vector<double> secs;
    for (int i = 0; i <= reps; ++i) {  // the first one warms up
      RETURN_IF_ERROR(stream_->Record(*start));
      RETURN_IF_ERROR(
          comm_->AllGather(send, recv, static_cast<size_t>(bytes / 4), DType::kFp32, *stream_));
      RETURN_IF_ERROR(stream_->Record(*end));
      RETURN_IF_ERROR(Sync("measuring the collectives' bandwidth"));
      ASSIGN_OR_RETURN(double t, dev_->ElapsedSeconds(*start, *end));
      if (i > 0) secs.push_back(t);
    }
    if (secs.empty()) return 0.0;
    std::sort(secs.begin(), secs.end());
    const double t = secs[secs.size() / 2];
    if (!(t > 0)) return 0.0;
    // The all-gather's size is n chunks; a ring moves (n-1)/n of it.
    return static_cast<double>(n * bytes) * static_cast<double>(n - 1) / static_cast<double>(n) /
           t * 1e-9;
  });
}

double DataParallel::RingBytes(const CommCounters& c) const {
  const auto n = static_cast<double>(world_size());
  const double reduce = static_cast<double>(c.reduced_bytes) * (n - 1) / n * (stage_ == 1 ? 2 : 1);
  return reduce + static_cast<double>(c.gathered_bytes);
}

Status DataParallel::Timed(const std::function<Status()>& collective) {
  Span span;
  {
    MutexLock lock(&spans_mu_);
    for (std::unique_ptr<gpu::Event>* e : {&span.start, &span.end}) {
      if (!free_events_.empty()) {
        *e = std::move(free_events_.back());
        free_events_.pop_back();
      }
    }
  }
  for (std::unique_ptr<gpu::Event>* e : {&span.start, &span.end}) {
    if (*e) continue;
    gpu::EventOptions o;
    o.timing = true;
    StatusOr<std::unique_ptr<gpu::Event>> created = dev_->CreateEvent(o);
    if (!created.ok()) return collective();  // untimed (counted as 0)
    *e = std::move(*created);
  }
  RETURN_IF_ERROR(stream_->Record(*span.start));
  RETURN_IF_ERROR(collective());
  RETURN_IF_ERROR(stream_->Record(*span.end));
  MutexLock lock(&spans_mu_);
  spans_.push_back(std::move(span));
  return Status();
}

CommCounters DataParallel::TakeCounters() {
  CommCounters c;
  {
    MutexLock lock(&mu_);
    c = counters_;
    counters_ = CommCounters();
  }
  MutexLock lock(&spans_mu_);
  size_t kept = 0;
  for (size_t i = 0; i < spans_.size(); ++i) {
    Span& sp = spans_[i];
    const StatusOr<bool> done = sp.end->Query();
    if (done.ok() && !*done) {  // (in flight: a gather ahead) taken next time
      if (kept != i) spans_[kept] = std::move(sp);
      ++kept;
      continue;
    }
    if (done.ok())
      if (StatusOr<double> secs = dev_->ElapsedSeconds(*sp.start, *sp.end); secs.ok())
        c.device_s += std::max(0.0, *secs);
    free_events_.push_back(std::move(sp.start));
    free_events_.push_back(std::move(sp.end));
  }
  spans_.resize(kept);
  return c;
}

// ---- OverlapIssuer ----------------------------------------------------------

OverlapIssuer::~OverlapIssuer() {
  if (!thread_.joinable()) return;
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  thread_.join();
}

Status OverlapIssuer::Start() {
  try {
    thread_ = std::thread([this] { Run(); });
  } catch (const std::system_error& e) {
    return ResourceExhaustedError(
        fmt::format("overlap_comm: cannot start the reduction's thread: {}", e.what()));
  }
  return Status();
}

void OverlapIssuer::Submit(int64_t lo, std::function<Status()> ready) {
  {
    MutexLock lock(&mu_);
    queue_.push_back(Job{lo, std::move(ready)});
  }
  cv_.NotifyAll();
}

Status OverlapIssuer::Drain() {
  MutexLock lock(&mu_);
  while (!queue_.empty()) cv_.Wait(&mu_);
  return error_;
}

void OverlapIssuer::Reset() {
  MutexLock lock(&mu_);
  while (!queue_.empty()) cv_.Wait(&mu_);
  error_ = Status();
}

void OverlapIssuer::Run() {
  for (;;) {
    Job job;
    {
      MutexLock lock(&mu_);
      while (!stop_ && queue_.empty()) cv_.Wait(&mu_);
      if (queue_.empty()) return;
      job = queue_.front();  // popped once issued: Drain waits for it
    }
    Status s = job.ready();
    {
      MutexLock lock(&mu_);
      if (!error_.ok()) s = error_;  // after a failure nothing more is issued
    }
    if (s.ok()) s = issue_(job.lo);
    {
      MutexLock lock(&mu_);
      queue_.pop_front();
      if (!s.ok() && error_.ok()) error_ = s;
    }
    cv_.NotifyAll();
  }
}

}  // namespace strata::scheduler
