// src/scheduler/data_parallel.h — data-parallel ZeRO across ranks: one
// process per rank, the collectives through gpu::Communicator (NCCL on CUDA,
// Gloo on the host device). Stages 1 and 2 as DeepSpeed defines them; stage 3
// partitions what stage 2 does and the parameters too
// (Partition::params_partitioned: a module is gathered from the ranks when it
// is fetched: DataParallel is the fetcher's ParamGatherer, in host or device
// memory).
//
// What is partitioned. The layout (LayoutOptions::world_size) pads the flat
// element space to world_size equal partitions and cuts sub-groups inside
// them; rank r owns partition r: the fp32 master, exp_avg and exp_avg_sq of
// its elements (StateStore), the optimizer step over its sub-groups
// (OptimizerStep), and after the step the updated parameters of its
// elements, which every rank then gathers (partitioned parameters: at the
// next fetch). Parameters are otherwise replicated (every rank fetches every
// module as with one rank); each rank accumulates its own micro-batches'
// gradients over the whole element space.
//
// A window's end, on every rank in the same order:
//   ReduceGradients  the window's fp32 sums averaged over the ranks (the mean
//                    of the global batch's gradients, as DistributedDataParallel
//                    and DeepSpeed give them): stage 1 all-reduces every
//                    element, stages 2 and 3 reduce-scatter so that each rank
//                    gets its partition only. The rest of the accumulator is
//                    zeroed for the next window.
//   CombineChecks    each rank's inf/nan flags and sums of squares of its
//                    partition's blocks, all-gathered and added in element
//                    order (the same bits on every rank), so clipping and
//                    the fp16 overflow skip are global.
//   GatherParams     after the step: the updated parameter bytes of every
//                    partition (Layout::OwnedBytes) into every rank's copy.
// The accumulator and the parameter copies live in host memory; the
// collectives move them through a staging buffer in device memory
// (StagingBytes), a chunk of at most chunk_elems fp32 per rank at a time,
// on a stream of their own.
//
// Determinism: the reductions' order is the backend's (Gloo's halving-doubling
// reduce-scatter, its ring all-reduce; NCCL's), fixed for a world size, so a
// run repeats bitwise. Against one rank accumulating the same micro-batches
// the sums may differ in the last bit: with 2 ranks a + b is the one-rank sum
// 0 + a + b exactly; with more the backend's pairing differs from the
// one-rank order. The norm's partial sums follow the sub-groups, which the
// partitions cut differently from one rank's.
//
// Failures: a collective that fails (a peer died, the timeout passed) is
// Unavailable naming the collective. Every error a public method returns
// starts "data parallelism (rank R of N): <what it was doing>", whichever path
// it took: a failed enqueue (the communicator's sticky error, returned at
// once), a failed wait on the stream, or a wait on a gather ahead. The engine
// cannot continue after a failed GatherParams (ranks disagree on the
// parameters) and says so.
//
// Threading: the engine's (main) thread calls every method, except that
// with overlap_comm the OverlapIssuer's thread runs ReduceFrom. What the two
// share (the overlapped reduction's position, the counters) is guarded by
// one mutex, checked by Clang's thread-safety analysis. That the two never
// enqueue collectives at once is the flush rule: every collective of the
// main thread first drains the issuer (Flush), so every rank has issued the
// same pieces before it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "src/common/thread_annotations.h"
#include "src/gpu/device.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/partition.h"
#include "strata/status.h"

namespace strata::scheduler {

// What the collectives moved and how long they took (per window).
struct CommCounters {
  int64_t reduced_bytes = 0;   // gradient bytes this rank sent into reductions
  int64_t gathered_bytes = 0;  // parameter bytes this rank received by all-gather
  // Of reduced_bytes, those issued before the window's end (overlap_comm:
  // while backward went on).
  int64_t overlapped_bytes = 0;
  // Wall time the caller waited for collectives (staging copies included);
  // an overlapped reduction counts only the wait at the window's end.
  double busy_s = 0;
  // The collectives' busy time on their stream, from device events around
  // each (NCCL's kernels on CUDA, Gloo's calls on the host device; waiting
  // for the peers included, staging copies not): the collectives that
  // completed since the last TakeCounters.
  double device_s = 0;
};

// overlap_comm's issuer: a thread of its own that, for each watermark handed
// over, waits until its gradients are ready and then issues the reduction's
// pieces above it. Its own thread, because copying pageable sums into the
// staging buffer blocks until the collectives' stream reaches the copy.
class OverlapIssuer {
 public:
  // `issue(lo)` issues the pieces in [lo, end) (DataParallel::ReduceFrom).
  explicit OverlapIssuer(std::function<Status(int64_t lo)> issue) : issue_(std::move(issue)) {}
  ~OverlapIssuer();  // stops the thread (what was handed over is issued first)
  Status Start();
  // Hands over a watermark: once `ready()` returns OK (the gradients of
  // [lo, end) are final), the pieces there are issued. After a failure
  // nothing more is issued (the other ranks' collectives then fail within
  // the timeout).
  void Submit(int64_t lo, std::function<Status()> ready) EXCLUDES(mu_);
  // Waits until every watermark handed over is issued; the first error.
  Status Drain() EXCLUDES(mu_);
  // Drains, and forgets the error: the next window starts clean.
  void Reset() EXCLUDES(mu_);

 private:
  void Run() EXCLUDES(mu_);

  struct Job {
    int64_t lo = 0;
    std::function<Status()> ready;
  };
  std::function<Status(int64_t)> issue_;
  Mutex mu_;
  CondVar cv_;
  std::deque<Job> queue_ GUARDED_BY(mu_);  // the front one stays until issued
  bool stop_ GUARDED_BY(mu_) = false;
  Status error_ GUARDED_BY(mu_);
  std::thread thread_;
};

class DataParallel final : public ParamGatherer, public RankExchange {
 public:
  // Connects to the other ranks (options.world_size > 1); stage 1, 2 or 3.
  static StatusOr<std::unique_ptr<DataParallel>> Create(gpu::Device* device,
                                                        const gpu::CommOptions& options, int stage);
  ~DataParallel() override;

  int rank() const { return comm_->rank(); }
  int world_size() const { return comm_->world_size(); }
  int stage() const { return stage_; }

  // Device bytes of the staging buffer for chunks of `chunk_elems` fp32:
  // world_size + 1 chunks.
  static int64_t StagingBytes(int world_size, int64_t chunk_elems);
  // The chunk a layout's partitions are reduced in: min(reduce_bucket_size,
  // the partition, kMaxChunkElems), at least kMinChunkElems.
  static int64_t ChunkElems(const Layout& layout, int64_t reduce_bucket_size);
  // The bytes each rank sends into one all-gather of parameters, so that one
  // all-gather moves about allgather_bucket_size elements over all ranks
  // (DeepSpeed's meaning; at the parameters' mean bytes per element; 0 as
  // kZeroMeansOneTensorElems): at most the largest rank's part and
  // kMaxChunkElems fp32, a multiple of 4.
  static int64_t GatherChunkBytes(const Layout& layout, int64_t allgather_bucket_size);
  // The staging chunk (fp32) that holds both.
  static int64_t StagingChunkElems(int64_t chunk_elems, int64_t gather_chunk_bytes) {
    return std::max(chunk_elems, (gather_chunk_bytes + 3) / 4);
  }
  static constexpr int64_t kMaxChunkElems = int64_t{1} << 22;  // 16 MiB of fp32
  // The chunk before Bind (Create allocates (world + 1) of them), and the
  // least one (a rank's 8-byte length fits in its slot).
  static constexpr int64_t kStartChunkElems = 4096;
  static constexpr int64_t kMinChunkElems = 2;

  // After Plan() laid the parameters out: allocates the staging buffer
  // (CheckSame and ReduceScalars work before, with a small one) for
  // reductions in chunks of `chunk_elems` and parameter gathers of
  // `gather_chunk_bytes` per rank.
  Status Bind(const Layout* layout, int64_t chunk_elems, int64_t gather_chunk_bytes);

  // Every rank's `text` must equal rank 0's; else FailedPrecondition naming
  // `what`, the ranks and the first line that differs (each rank reports
  // the same).
  Status CheckSame(const std::string& what, const std::string& text);

  // The arrays handed to ReduceGradients and GatherParams live in host
  // memory (staged through the device buffer), or in device memory (the
  // device optimizer's accumulator and parameter block: copied within the
  // device).
  // acc: this rank's window sums over Layout::total_elems() elements. After:
  // acc over this rank's partition holds the mean over the ranks, and every
  // other element is 0.
  Status ReduceGradients(float* acc, Memory where = Memory::kHost);
  // ---- The reduction overlapped with backward (overlap_comm) ----
  // The same result as ReduceGradients, piece by piece while the last
  // micro-batch's backward goes on. The pieces are each partition's chunks,
  // from the top of the element space down (the order backward completes
  // them); a piece is reduced to its owner (stage 2 and 3: Reduce; stage 1:
  // AllReduce to every rank) through the staging buffer, asynchronously on
  // the collectives' stream. Every rank issues the same pieces in the same
  // order; only when it issues them differs.
  // Starts the issuer thread (overlap_comm); once, before the first window.
  Status StartOverlapIssuer();
  // A window's overlapped reduction of `acc` (as ReduceGradients) starts.
  void BeginOverlap(float* acc, Memory where = Memory::kHost) EXCLUDES(mu_);
  bool overlapping() const EXCLUDES(mu_);
  // The elements [lo, total_elems()) hold the window's final sums once
  // `ready()` returns OK: the issuer issues every piece not issued yet
  // there, on its thread (REQUIRES StartOverlapIssuer).
  void ReduceFromWhenReady(int64_t lo, std::function<Status()> ready);
  // Issues every piece not issued yet that lies in [lo, total_elems()):
  // REQUIRES those elements hold the window's final sums.
  Status ReduceFrom(int64_t lo) EXCLUDES(mu_);
  // Issues the rest (every sum final), waits for all, and zeroes the
  // elements other ranks own; the window's overlapped reduction ends.
  Status FinishOverlap() EXCLUDES(mu_);
  // Drops the window's overlapped reduction (waits for what was issued,
  // and forgets the issuer's error).
  void AbandonOverlap() EXCLUDES(mu_);

  // The global checks from this rank's blocks (GradOffloader::BlockChecks
  // over its partition): every rank's block sums, gathered and added in the
  // order of the element space, so the sum of squares has the same bits on
  // every rank, and the bits of one rank's when the blocks are the same
  // (Layout: partitions on the block grid).
  Status CombineChecks(const std::vector<double>& partial, const std::vector<uint8_t>& bad,
                       bool* overflow, double* sumsq);
  // params: the parameter-byte space (Layout::total_param_bytes()), current
  // in this rank's OwnedBytes; after: current everywhere.
  Status GatherParams(uint8_t* params, Memory where = Memory::kHost);
  // Gradients on NVMe (GradStore): sub-group g's window sums `sums` (its
  // elements, host memory) averaged over the ranks into its owner's
  // `sums` (the others' are left as they were). A collective: every rank
  // reduces every sub-group, in order.
  Status ReduceGroup(size_t g, float* sums);
  // Stage 3's partitioned parameters (ParamGatherer): module m's bytes,
  // each rank sending its part of them (Layout::OwnedBytes) from `mine`.
  // Every rank asks for the same modules in the same order; a gather
  // issued ahead is ordered with every other collective as issued.
  Status GatherModule(int m, PartBytes mine, uint8_t* dst, Memory where) override;
  Status IssueGatherModule(int m, PartBytes mine, uint8_t* dst, Memory where,
                           gpu::Event* done) override;
  Status WaitGathered(gpu::Event& done) override;
  // out: parameter p's fp32 values, current where this rank owns them;
  // after: every element from its owner (a collective: every rank calls it
  // for the same parameters in the same order).
  Status ShareMaster(const ParamRec& p, std::span<float> out);

  // values[i] becomes the sum, mean or maximum over the ranks of their
  // values[i] (every rank passes as many), added in rank order: the same
  // bits on every rank.
  enum class Scalars { kSum, kMean, kMax };
  Status ReduceScalars(std::span<double> values, Scalars op);

  // The collectives' bus bandwidth (nccl-tests' busbw: size x (n-1)/n over
  // the time) from `reps` all-gathers of the staging buffer's chunk, timed
  // with device events; the median, GB/s (1e9 B/s). A collective (every
  // rank, after Bind).
  StatusOr<double> ProbeBusBandwidth(int reps = 5);
  // The bytes a ring algorithm moves through one rank for the window's
  // collectives in `c` (reductions (n-1)/n of the bytes sent in, twice for
  // stage 1's all-reduce; all-gathers the bytes received).
  double RingBytes(const CommCounters& c) const;

  // Every rank's bytes in rank order (`mine` from this rank; any lengths),
  // chunked through staging. A collective (RankExchange).
  StatusOr<std::vector<std::string>> AllGatherBytes(const std::string& mine) override;

  // The counters since the last call, then reset.
  CommCounters TakeCounters() EXCLUDES(mu_);

 private:
  DataParallel(gpu::Device* device, std::unique_ptr<gpu::Communicator> comm,
               std::unique_ptr<gpu::Stream> stream, int stage);
  // Every rank's doubles, as AllGatherBytes.
  StatusOr<std::vector<std::vector<double>>> AllGatherDoubles(std::span<const double> mine);
  // Waits for the stream and reports a failed collective, in context.
  Status Sync(const char* what);
  // "data parallelism (rank R of N)".
  std::string ContextPrefix() const;
  // `s` with ContextPrefix() and `what` in front, unless it has them already.
  Status AddContext(const Status& s, std::string_view what) const;
  // Runs `body` and returns its result in context (AddContext).
  template <typename F>
  Status InContext(std::string_view what, F&& body) {
    return AddContext(body(), what);
  }
  template <typename T, typename F>
  StatusOr<T> InContext(std::string_view what, F&& body) {
    StatusOr<T> r = body();
    if (!r.ok()) return AddContext(r.status(), what);
    return r;
  }
  // Every rank's piece (pieces[r], a byte range) to every rank, chunked
  // through staging: this rank's read from src + (its first byte -
  // src_base), rank r's written to dst + (its first byte - dst_base), this
  // rank's own too with copy_own.
  // With `done`, nothing is waited for: `done` is recorded after the last
  // chunk instead.
  Status GatherPieces(const std::vector<std::pair<int64_t, int64_t>>& pieces, const uint8_t* src,
                      int64_t src_base, uint8_t* dst, int64_t dst_base, bool copy_own, Memory where,
                      const char* what, gpu::Event* done = nullptr);
  // Each rank's piece of [byte_begin, byte_end).
  std::vector<std::pair<int64_t, int64_t>> PiecesOf(int64_t byte_begin, int64_t byte_end) const;
  // n fp32 sums through the staging buffer: averaged into `owner`'s sums
  // (Reduce), or into everyone's (AllReduce); on the stream, not waited for.
  Status IssueReduce(float* sums, size_t n, int owner, bool everyone, Memory where) EXCLUDES(mu_);
  // Issues the overlapped reduction's pieces not issued yet in [lo, end),
  // counted as overlapped or not.
  Status IssueFrom(int64_t lo, bool overlapped) EXCLUDES(mu_);
  // Adds the time since `since_ns` to the counters' busy time.
  void AddBusy(int64_t since_ns) EXCLUDES(mu_);
  // Zeroes the elements of `acc` other ranks own.
  Status ZeroOthers(float* acc, Memory where);
  // Copies between an array of `where` and the staging buffer.
  Status ToStaging(void* staging, const void* src, size_t bytes, Memory where);
  Status FromStaging(void* dst, const void* staging, size_t bytes, Memory where);

  gpu::Device* dev_;
  std::unique_ptr<gpu::Communicator> comm_;
  std::unique_ptr<gpu::Stream> stream_;
  int stage_ = 2;
  const Layout* layout_ = nullptr;
  int64_t chunk_ = 0;         // fp32 elements per rank per reduction
  int64_t gather_bytes_ = 0;  // bytes per rank per parameter all-gather
  // What the issuer thread and the main thread share: the overlapped
  // reduction (its array, and the top of what is not issued) and the
  // counters.
  mutable Mutex mu_;
  float* overlap_acc_ GUARDED_BY(mu_) = nullptr;
  Memory overlap_where_ GUARDED_BY(mu_) = Memory::kHost;
  int64_t overlap_next_ GUARDED_BY(mu_) = 0;
  CommCounters counters_ GUARDED_BY(mu_);
  std::unique_ptr<OverlapIssuer> issuer_;  // overlap_comm (StartOverlapIssuer)
  // Before any other collective: the issuer has issued every piece handed
  // to it, so that every rank has issued the same ones; its first error.
  Status Flush() { return issuer_ ? issuer_->Drain() : Status(); }
  gpu::DeviceBuffer staging_;
  // Runs `collective` (an enqueue on stream_) between two timing events,
  // kept until TakeCounters finds them complete.
  Status Timed(const std::function<Status()>& collective);
  struct Span {
    std::unique_ptr<gpu::Event> start, end;
  };
  Mutex spans_mu_;  // the issuer thread's reductions and the main thread's
  std::vector<Span> spans_ GUARDED_BY(spans_mu_);
  std::vector<std::unique_ptr<gpu::Event>> free_events_ GUARDED_BY(spans_mu_);
};

}  // namespace strata::scheduler
