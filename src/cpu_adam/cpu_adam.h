// src/cpu_adam/cpu_adam.h — the CPU optimizer module's contract.
//
// Steps shards ("sub-groups") of CPU-resident optimizer state in ONE
// fused pass per element: read the master param, the gradient (fp32, fp16
// or bf16), the moments; write master and moments and, optionally in the
// same pass, an fp16/bf16 (or fp32) copy of the updated param. The state is
// fp32 or one of the compact formats (StateFormat: bf16 moments, a bf16
// master with stochastic rounding, 8-bit block-quantized moments).
//
// Algorithms (PyTorch semantics; the order of float operations is in
// docs/design.md, "cpu_adam"):
//   kAdam    torch.optim.Adam:  g += wd*p (L2), moments, bias-corrected step
//   kAdamW   torch.optim.AdamW: p *= 1 - lr*wd (decoupled), then as Adam
//            (DeepSpeed's adam_w_mode=true is kAdamW, false is kAdam)
//   kAdagrad torch.optim.Adagrad (lr_decay 0): state in exp_avg_sq ("sum")
//   kLion    Lion (Chen et al. 2023): state in exp_avg
//
// Threads: a CpuOptimizer owns one oneTBB arena created once. Its worker
// threads are pinned (hwloc) to the cores of one NUMA node when asked.
// Shards are cut into fixed blocks of Options::block_elems elements; every
// element is computed by the same vector code wherever it falls, so results
// are bitwise independent of the thread count and of the partitioning. They
// may differ between ISAs (FMA vs multiply+add) by a few ulps.
//
// Gradient accumulation (Accumulate, AccumulateMany): acc[i] += float(grad[i])
// into fp32 accumulators, the gradients fp32, fp16 or bf16 (widened exactly),
// vectorized with the same ISA table and spread over the same arena in the
// same fixed blocks. One fp32 add per element, so the result is the plain
// loop's, bit for bit, on every ISA and for any thread count.
//
// Thread-safety: every method of CpuOptimizer may be called concurrently
// from several threads; calls share the arena's threads (each call submits
// its blocks to the one arena with task_arena::execute, so concurrent calls
// do not oversubscribe the cores). The caller must not touch a shard's
// arrays while a step or accumulation on it is running, and arrays written
// by concurrent calls must not overlap anything those calls read or write.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "src/common/dtype.h"
#include "strata/status.h"

namespace strata::cpu_adam {

enum class Algorithm : uint8_t { kAdam = 0, kAdamW = 1, kAdagrad = 2, kLion = 3 };
std::string_view AlgorithmName(Algorithm a);  // "adam", "adamw", "adagrad", "lion"
std::optional<Algorithm> ParseAlgorithm(std::string_view name);  // the names above

// How the optimizer state of a shard is stored (docs/design.md, "Compact
// state formats"). The master param is always updated in fp32 arithmetic;
// the formats differ in what is kept between steps:
//   kFp32        fp32 master, fp32 exp_avg, fp32 exp_avg_sq      12 B/param
//   kBf16        fp32 master, bf16 exp_avg and exp_avg_sq (round to nearest
//                even)                                            8 B/param
//   kBf16Master  bf16 master written with stochastic rounding (a hash of
//                the global element index, the step and a seed), bf16
//                moments (nearest even)                           6 B/param
//   kInt8        fp32 master, 8-bit block-quantized moments: blocks of 256
//                elements (aligned to the global element index) with one
//                fp32 scale per moment, recomputed each step from the
//                block's absmax; exp_avg a signed 8-bit float code (4
//                exponent, 3 mantissa bits), exp_avg_sq an unsigned one (5
//                exponent, 3 mantissa bits)               6 + 8/256 B/param
// Support: Adam and AdamW in every format; Lion in fp32, bf16 and int8;
// Adagrad in fp32 only. Anything else is refused (InvalidArgument).
// (The type is strata::StateFormat, strata/dtype.h: the config and the
// device's Adam step name the same formats with it.)
using ::strata::StateFormat;
// "fp32", "bf16", "bf16-master", "int8"
std::string_view StateFormatName(StateFormat f);
std::optional<StateFormat> ParseStateFormat(std::string_view name);  // the names above
// Whether `a` can be stepped with state format `f` (see above).
bool SupportsStateFormat(Algorithm a, StateFormat f);
// Elements per int8 quantization block (one fp32 scale per moment each).
inline constexpr size_t kStateBlock = 256;

// Per-group hyper-parameters plus the step count and the gradient multiplier.
struct HyperParams {
  Algorithm algorithm = Algorithm::kAdamW;
  // Doubles, as in PyTorch: derived coefficients (1 - beta2, lr / (1 -
  // beta1^t), 1 - lr*wd) are computed in double and rounded to fp32 once.
  double lr = 1e-3;
  double beta1 = 0.9;    // Lion: the interpolation for the sign (paper: 0.9)
  double beta2 = 0.999;  // Lion: the momentum decay (paper: 0.99)
  double eps = 1e-8;     // Adam/AdamW/Adagrad; unused by Lion
  double weight_decay = 0.0;
  bool bias_correction = true;  // Adam/AdamW only
  // The step being taken, 1-based: PyTorch's state["step"] after its
  // increment. Must be ≥ 1 (Adam/AdamW with bias correction; ignored else).
  int64_t step = 1;
  // Every gradient is multiplied by this first: 1/loss_scale × clip coefficient.
  double grad_scale = 1.0;

  bool operator==(const HyperParams&) const = default;
};

// One shard of state to step. The optimizer does not own any of the arrays;
// they must stay valid (and untouched by the caller) until the step returns
// or its StepHandle is waited on. Any alignment is accepted; 64-byte aligned
// arrays are fastest. Arrays must not overlap each other.
struct ShardStep {
  float* param = nullptr;      // fp32 master, count elements, updated in place
  const void* grad = nullptr;  // count elements of grad_dtype (read only)
  DType grad_dtype = DType::kFp32;
  float* exp_avg = nullptr;     // Adam/AdamW/Lion momentum; null for Adagrad
  float* exp_avg_sq = nullptr;  // Adam/AdamW second moment, Adagrad sum; null for Lion
  size_t count = 0;             // elements; 0 is valid (nothing happens)
  void* copy_out = nullptr;     // optional: count elements of copy_dtype ← updated param
  DType copy_dtype = DType::kBf16;
  HyperParams hp;
  // Check the scaled gradient for inf/NaN in the same pass. A chunk of 1024
  // elements (counted from the shard start) that holds one is left entirely
  // untouched (param, states, copy-out) and the result reports the shard;
  // every other chunk is updated. For PyTorch's all-or-nothing "skip the
  // step" use AllFinite() before stepping (a read-only pass over the grads).
  bool check_finite = false;
  // Fold the window's last micro-batch into the step (no accumulation pass
  // for it): the gradient stepped with is the fp32 sum fold_acc[i] +
  // float(grad[i]) — one fp32 add, rounded, before the grad_scale multiply —
  // bitwise what Accumulate(fold_acc, grad) followed by a step with
  // grad = fold_acc (fp32) gives. fold_acc null: 0.f + float(grad[i]), a
  // zeroed accumulator's sum (-0 becomes +0). fold_acc (count fp32, read
  // only) must not overlap param, states or copy_out. Not with check_finite
  // (InvalidArgument): check the sum beforehand.
  bool fold = false;
  const float* fold_acc = nullptr;

  // ---- Compact state formats (StateFormat) --------------------------------
  // kFp32 uses param, exp_avg and exp_avg_sq above; the compact formats use
  // these instead (the fp32 pointers the format does not use must be null):
  //   kBf16:       param (fp32), exp_avg_c, exp_avg_sq_c (bf16 bits, uint16_t)
  //   kBf16Master: param_c (bf16 bits, updated in place; param null),
  //                exp_avg_c, exp_avg_sq_c (bf16 bits)
  //   kInt8:       param (fp32), exp_avg_c, exp_avg_sq_c (one uint8_t code
  //                per element), exp_avg_scale, exp_avg_sq_scale (one fp32
  //                per block: ceil((count) / kStateBlock) of them, block b
  //                covering elements [b*256, b*256 + 256) of this shard)
  // Lion has no exp_avg_sq_c / exp_avg_sq_scale (null). The compact kernels
  // use ordinary stores (Options::streaming_stores applies to fp32 only).
  StateFormat states = StateFormat::kFp32;
  void* param_c = nullptr;
  void* exp_avg_c = nullptr;
  void* exp_avg_sq_c = nullptr;
  float* exp_avg_scale = nullptr;
  float* exp_avg_sq_scale = nullptr;
  // The global index of element 0 of this shard in its parameter space
  // (e.g. the flat offset of the sub-group). kInt8: must be a multiple of
  // kStateBlock (blocks are aligned to the global index). kBf16Master: the
  // stochastic rounding of element i depends on (element_offset + i,
  // hp.step, seed) only — so the bits do not depend on how the parameter
  // space is cut into shards, on the thread count or on the ISA's lane
  // width.
  uint64_t element_offset = 0;
  uint64_t seed = 0;  // kBf16Master: the stochastic rounding's seed
};

struct StepResult {
  size_t nonfinite_shards = 0;  // shards in which a non-finite gradient was seen
  bool nonfinite() const { return nonfinite_shards != 0; }
};

enum class StreamingStores : uint8_t {
  kAuto = 0,     // what the measurements say (docs/perf.md, "cpu_adam"): currently off
  kOff = 1,      // ordinary stores
  kCopyOut = 2,  // non-temporal stores for the write-only copy-out only
  kAll = 3,      // non-temporal stores for param, states and copy-out
};

struct Options {
  // Worker threads (the caller of Step/StepMany joins them). 0 = the number
  // of PUs of `numa_node` (all PUs when numa_node is -1).
  int threads = 0;
  // Pin the worker threads to the PUs of this NUMA node (hwloc logical
  // index; see NumaNodeOf). -1: do not pin.
  int numa_node = -1;
  // "auto" (best this CPU supports), "avx512", "avx2" (or "avx2+fma"),
  // "sse4.2", "scalar". Asking for one the CPU lacks is NotSupported.
  std::string isa = "auto";
  StreamingStores streaming_stores = StreamingStores::kAuto;
  // Elements per task; a multiple of 1024. Fixed, so results do not depend
  // on the thread count.
  size_t block_elems = 32768;
  // Accumulate/AccumulateMany calls with fewer elements than this in total
  // (or that fit in one block) run on the caller's thread without entering
  // the arena: waking the workers costs more than the work. 0: always use
  // the arena when there is more than one block.
  size_t accumulate_inline_elems = 65536;
  // Benchmark only (strata bench adam, strata bench accumulate): replace the
  // optimizer arithmetic by trivial adds over the very same loads and stores
  // — the memory roofline. Accumulate then leaves acc unchanged.
  bool roofline_kernel = false;
};

// One slice of gradient accumulation: acc[i] += float(grad[i]) for i in
// [0, count). The optimizer owns neither array; both must stay valid and
// untouched by others until the call returns. Any alignment is accepted.
// acc must not overlap grad, nor any array of another shard of the same call.
struct AccumulateShard {
  float* acc = nullptr;        // count fp32 elements, updated in place
  const void* grad = nullptr;  // count elements of grad_dtype (read only)
  DType grad_dtype = DType::kFp32;
  size_t count = 0;  // 0 is valid: nothing happens, pointers may be null
};

// A step running on the optimizer's threads. Move-only; the destructor
// waits for the step (so the arrays are never written after it returns).
class StepHandle {
 public:
  StepHandle();
  ~StepHandle();
  StepHandle(StepHandle&&) noexcept;
  StepHandle& operator=(StepHandle&&) noexcept;
  StepHandle(const StepHandle&) = delete;
  StepHandle& operator=(const StepHandle&) = delete;

  bool valid() const { return state_ != nullptr; }
  // True once the step has finished (never blocks). REQUIRES: valid().
  bool Ready() const;
  // Blocks until the step has finished and returns its result. The handle
  // is invalid afterwards. FailedPrecondition on an invalid handle.
  StatusOr<StepResult> Wait();

  struct State;  // implementation detail
  explicit StepHandle(std::shared_ptr<State> s);

 private:
  std::shared_ptr<State> state_;
};

class CpuOptimizer {
 public:
  // InvalidArgument for a bad option (naming it), NotSupported for an ISA
  // this CPU lacks or a NUMA node that does not exist.
  static StatusOr<std::unique_ptr<CpuOptimizer>> Create(const Options& options = {});
  ~CpuOptimizer();  // waits for running asynchronous steps
  CpuOptimizer(const CpuOptimizer&) = delete;
  CpuOptimizer& operator=(const CpuOptimizer&) = delete;

  // Steps one shard on the arena's threads (the caller joins them) and
  // returns when done. InvalidArgument (naming the shard and field) for a
  // bad descriptor; nothing is written then.
  StatusOr<StepResult> Step(const ShardStep& shard);
  // Steps many shards back to back as one parallel pass over all their
  // blocks (no barrier between shards, threads not re-created). All
  // descriptors are validated before anything is written.
  StatusOr<StepResult> StepMany(std::span<const ShardStep> shards);
  // Starts stepping the shards on the arena's worker threads and returns at
  // once; the caller's thread is free (for I/O, copies). The descriptors are
  // copied; the arrays must stay valid until the handle is waited on.
  StatusOr<StepHandle> StepAsync(std::span<const ShardStep> shards);

  // True if grad[0, count) * grad_scale holds no inf/NaN (read-only pass on
  // the optimizer's threads). InvalidArgument for a null grad with count > 0.
  StatusOr<bool> AllFinite(const void* grad, DType grad_dtype, size_t count,
                           float grad_scale = 1.f);

  // dst[i] = src[i] converted to dst_dtype (round to nearest even), on the
  // optimizer's threads: e.g. the fp16/bf16 copy of freshly loaded masters.
  // A separate pass — Step's copy_out is the fused way. InvalidArgument for
  // null pointers with count > 0, overlapping arrays or a bad dtype.
  Status Cast(const float* src, void* dst, DType dst_dtype, size_t count);

  // acc[i] += float(grad[i]) for i in [0, count): the gradient fp32, fp16 or
  // bf16 (widened exactly), one fp32 add per element — bitwise what the
  // plain loop gives, for any ISA and thread count (NaN + NaN may keep
  // either payload). Cut into Options::block_elems blocks run on the arena's
  // threads, the caller joining them; below Options::accumulate_inline_elems
  // elements (or a single block) it runs on the caller's thread alone.
  // Returns when every element is done.
  //
  // Threads: callable from any thread, concurrently with every other method
  // of this CpuOptimizer (e.g. the gradient thread accumulating while the
  // optimizer thread runs StepMany): the blocks of concurrent calls share
  // the arena's workers. While it waits for its own blocks, the caller runs
  // only those (this_task_arena::isolate), never a concurrent step's.
  //
  // InvalidArgument (naming the shard and field) for a null array with
  // count > 0, a dtype other than fp32/fp16/bf16, or acc overlapping its own
  // grad or another shard's acc or grad; nothing is written then.
  // Internal on a failure inside oneTBB (elements may be partly updated).
  Status Accumulate(float* acc, const void* grad, DType grad_dtype, size_t count);
  // The slices of one gradient chunk (several parameters) as one parallel
  // pass over all their blocks; every shard validated before anything is
  // written. Same threading as Accumulate.
  Status AccumulateMany(std::span<const AccumulateShard> shards);
  // p[0..n) = 0 on the worker threads, in blocks of block_elems (small
  // ranges on the caller's thread). InvalidArgument for null with n > 0.
  Status Zero(float* p, size_t n);
  // dst[0..n) = src[0..n), the same way (a parallel memcpy; the ranges must
  // not overlap). InvalidArgument for null with n > 0.
  Status Copy(float* dst, const float* src, size_t n);

  std::string_view isa() const;  // the ISA actually used
  int threads() const;
  int numa_node() const;       // -1 when not pinned
  bool streams_state() const;  // resolved streaming-store choice
  bool streams_copy() const;
  // How many times a thread entered the arena and was pinned (tests).
  uint64_t pinned_thread_entries() const;

  struct Impl;

 private:
  explicit CpuOptimizer(std::unique_ptr<Impl> impl);
  // fn(begin, count) over [0, n) in blocks of block_elems on the worker
  // threads (one call on the caller's thread for small n); `what` names it
  // in an error.
  Status Blocks(size_t n, const char* what,
                const std::function<void(size_t begin, size_t count)>& fn);
  std::unique_ptr<Impl> impl_;
};

// Bytes one fused step moves per element (reads + writes; write-allocate
// traffic not counted): 4 (param) ×2 + grad + states ×2 ×4 + copy-out.
size_t BytesPerElement(Algorithm a, DType grad_dtype, std::optional<DType> copy_dtype);
// The same for a state format: master and states read and written at their
// stored size, int8's scales (8 bytes per 256 elements per moment) included.
double BytesPerElement(Algorithm a, DType grad_dtype, std::optional<DType> copy_dtype,
                       StateFormat states);
// Bytes of stored state per parameter (master + moments + scales) for Adam
// and AdamW: 12, 8, 6, 6.0625 (Lion: one moment less).
double StateBytesPerParam(StateFormat f, Algorithm a = Algorithm::kAdamW);

// ---- Whole arrays in a state format (checkpoints, export, conversion) ------

// Which array of the state: the master param, exp_avg or exp_avg_sq.
enum class StateRole : uint8_t { kParam = 0, kExpAvg = 1, kExpAvgSq = 2 };
// Bytes per element of that array in format f (fp32 4, bf16 2, int8 codes
// 1; an int8 master is fp32: 4).
size_t StateElementBytes(StateFormat f, StateRole r);
// fp32 scales that array needs for `count` elements: ceil(count / 256) for
// int8 moments, else 0.
size_t StateScaleCount(StateFormat f, StateRole r, size_t count);
// src[0, count) (fp32) → dst in format f (StateElementBytes each) and, for
// int8 moments, scales (StateScaleCount of them). Element 0 starts a block.
// bf16 rounds to nearest even (a bf16 master too: conversion is not a step,
// so no stochastic rounding); int8 uses the block absmax scale and the codes
// the kernels use. InvalidArgument for null arrays with count > 0.
Status EncodeState(StateFormat f, StateRole r, const float* src, size_t count, void* dst,
                   float* scales);
// The inverse: dst[0, count) = the values the kernels see. Exact for fp32 and
// bf16; int8: code value × block scale.
Status DecodeState(StateFormat f, StateRole r, const void* src, const float* scales, size_t count,
                   float* dst);

// Bytes one accumulation moves per element: acc 4r+4w + grad read.
inline size_t AccumulateBytesPerElement(DType grad_dtype) { return 8 + DTypeSize(grad_dtype); }

// ---- For `strata info` -----------------------------------------------------

// The best ISA this CPU and build support: "avx512", "avx2+fma", "sse4.2" or
// "scalar".
std::string_view BestIsa();
// The ISA an optimizer with isa "auto" runs: BestIsa(), or the one the
// environment's STRATA_CPU_ISA names (scalar, sse4.2, avx2, avx512; an
// unknown name is InvalidArgument, one this CPU lacks NotSupported).
StatusOr<std::string_view> SelectedIsa();
// All ISAs usable here, best first (always ends with "scalar").
std::vector<std::string_view> AvailableIsas();

struct NumaNodeInfo {
  int logical_index = 0;      // hwloc logical index (what Options::numa_node takes)
  int os_index = 0;           // the kernel's node number
  uint64_t memory_bytes = 0;  // local memory
  int cores = 0;
  std::vector<int> pus;  // OS indices of the PUs (logical CPUs)
};
struct CpuTopology {
  int packages = 0;
  int cores = 0;
  int pus = 0;
  std::vector<NumaNodeInfo> numa_nodes;  // at least one (a machine without NUMA has one)
};
StatusOr<CpuTopology> DescribeTopology();

// Data parallelism, several ranks on one machine: the share of the CPU the
// CPU optimizer of local rank `local_rank` of `local_world` takes. Its NUMA
// node: `gpu_os_node` (the node nearest the rank's GPU, the kernel's
// number) when >= 0, else local_rank modulo the nodes; no node (-1, no
// pinning) on a machine with one. Its threads: the node's PUs (the
// machine's without a node) divided among the local ranks that land on that
// node, at least 1.
struct RankCpuShare {
  int numa_node = -1;     // logical index (Options::numa_node), -1: not pinned
  int numa_os_node = -1;  // the kernel's number, -1: not pinned
  int threads = 1;
  std::string why;  // "the GPU's node", "local rank 1 of 2 on 2 nodes", "one NUMA node"
};
RankCpuShare ShareOfLocalRank(const CpuTopology& topology, int local_rank, int local_world,
                              int gpu_os_node);
// The NUMA node (logical index) holding most of [p, p + bytes), or -1 when
// the OS cannot tell (pages not yet touched, no NUMA). NotSupported if hwloc
// cannot query memory location here.
StatusOr<int> NumaNodeOf(const void* p, size_t bytes);

}  // namespace strata::cpu_adam
