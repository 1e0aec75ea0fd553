// CpuOptimizer: validation, per-shard coefficients, the oneTBB arena with
// hwloc-pinned workers, synchronous / many-shard / asynchronous steps.
#include "src/cpu_adam/cpu_adam.h"

#include <fmt/format.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_scheduler_observer.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "src/common/host_memory.h"
#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/thread_annotations.h"
#include "src/cpu_adam/kernel.h"
#include "src/cpu_adam/state_codes.h"
#include "src/cpu_adam/topology.h"

namespace strata::cpu_adam {

using internal::CopyOut;
using internal::KernelArgs;
using internal::KernelOp;
using internal::KernelTable;

std::string_view AlgorithmName(Algorithm a) {
  switch (a) {
    case Algorithm::kAdam:
      return "adam";
    case Algorithm::kAdamW:
      return "adamw";
    case Algorithm::kAdagrad:
      return "adagrad";
    case Algorithm::kLion:
      return "lion";
  }
  return "?";
}

std::optional<Algorithm> ParseAlgorithm(std::string_view name) {
  if (name == "adam") return Algorithm::kAdam;
  if (name == "adamw") return Algorithm::kAdamW;
  if (name == "adagrad") return Algorithm::kAdagrad;
  if (name == "lion") return Algorithm::kLion;
  return std::nullopt;
}

size_t BytesPerElement(Algorithm a, DType grad_dtype, std::optional<DType> copy_dtype) {
  const size_t states = (a == Algorithm::kAdam || a == Algorithm::kAdamW) ? 2 : 1;
  return 4 * 2 + DTypeSize(grad_dtype) + states * 4 * 2 + (copy_dtype ? DTypeSize(*copy_dtype) : 0);
}

static_assert(internal::kQuantBlock == kStateBlock);

std::string_view StateFormatName(StateFormat f) {
  switch (f) {
    case StateFormat::kFp32:
      return "fp32";
    case StateFormat::kBf16:
      return "bf16";
    case StateFormat::kBf16Master:
      return "bf16-master";
    case StateFormat::kInt8:
      return "int8";
  }
  return "?";
}

std::optional<StateFormat> ParseStateFormat(std::string_view name) {
  if (name == "fp32") return StateFormat::kFp32;
  if (name == "bf16") return StateFormat::kBf16;
  if (name == "bf16-master") return StateFormat::kBf16Master;
  if (name == "int8") return StateFormat::kInt8;
  return std::nullopt;
}

bool SupportsStateFormat(Algorithm a, StateFormat f) {
  switch (f) {
    case StateFormat::kFp32:
      return true;
    case StateFormat::kBf16:
    case StateFormat::kInt8:
      return a == Algorithm::kAdam || a == Algorithm::kAdamW || a == Algorithm::kLion;
    case StateFormat::kBf16Master:
      return a == Algorithm::kAdam || a == Algorithm::kAdamW;
  }
  return false;
}

size_t StateElementBytes(StateFormat f, StateRole r) {
  if (f == StateFormat::kFp32) return 4;
  if (r == StateRole::kParam) return f == StateFormat::kBf16Master ? 2 : 4;
  return f == StateFormat::kInt8 ? 1 : 2;
}

size_t StateScaleCount(StateFormat f, StateRole r, size_t count) {
  if (f != StateFormat::kInt8 || r == StateRole::kParam) return 0;
  return (count + kStateBlock - 1) / kStateBlock;
}

double StateBytesPerParam(StateFormat f, Algorithm a) {
  const int moments = (a == Algorithm::kAdam || a == Algorithm::kAdamW) ? 2 : 1;
  const double scale = f == StateFormat::kInt8 ? 4.0 / kStateBlock : 0.0;
  return static_cast<double>(StateElementBytes(f, StateRole::kParam)) +
         moments * (static_cast<double>(StateElementBytes(f, StateRole::kExpAvg)) + scale);
}

double BytesPerElement(Algorithm a, DType grad_dtype, std::optional<DType> copy_dtype,
                       StateFormat states) {
  // Everything stored is read and written once; the gradient and the copy once.
  return 2 * StateBytesPerParam(states, a) + static_cast<double>(DTypeSize(grad_dtype)) +
         (copy_dtype ? static_cast<double>(DTypeSize(*copy_dtype)) : 0.0);
}

std::string_view BestIsa() { return internal::UsableTables().front()->isa; }

StatusOr<std::string_view> SelectedIsa() {
  ASSIGN_OR_RETURN(const KernelTable* t, internal::SelectTable("auto"));
  return t->isa;
}

std::vector<std::string_view> AvailableIsas() {
  std::vector<std::string_view> out;
  for (const KernelTable* t : internal::UsableTables()) out.push_back(t->isa);
  return out;
}

namespace {

bool IsValidDType(DType t) { return t == DType::kFp32 || t == DType::kFp16 || t == DType::kBf16; }

struct Prepared {
  KernelArgs base;
  internal::StepFn fn = nullptr;
  bool check = false;
  size_t blocks = 0;
  size_t grad_bytes = 4;  // per element
  size_t copy_bytes = 0;
  StateFormat states = StateFormat::kFp32;
  size_t state_bytes = 4;  // compact formats: bytes per stored moment
};

CopyOut CopyOutOf(const ShardStep& s) {
  if (s.copy_out == nullptr) return CopyOut::kNone;
  return s.copy_dtype == DType::kFp32
             ? CopyOut::kFp32
             : (s.copy_dtype == DType::kFp16 ? CopyOut::kFp16 : CopyOut::kBf16);
}

std::string ShardName(size_t i) { return "cpu_adam: shard " + std::to_string(i); }

Status CheckHyper(const HyperParams& hp, size_t i) {
  auto bad = [&](const std::string& what) {
    return InvalidArgumentError(ShardName(i) + " (" + std::string(AlgorithmName(hp.algorithm)) +
                                "): " + what);
  };
  if (!(hp.lr >= 0) || !std::isfinite(hp.lr))
    return bad("lr must be finite and >= 0, got " + std::to_string(hp.lr));
  if (!(hp.beta1 >= 0 && hp.beta1 < 1))
    return bad("beta1 must be in [0, 1), got " + std::to_string(hp.beta1));
  if (!(hp.beta2 >= 0 && hp.beta2 < 1))
    return bad("beta2 must be in [0, 1), got " + std::to_string(hp.beta2));
  if (!(hp.eps >= 0) || !std::isfinite(hp.eps))
    return bad("eps must be finite and >= 0, got " + std::to_string(hp.eps));
  if (!(hp.weight_decay >= 0) || !std::isfinite(hp.weight_decay))
    return bad("weight_decay must be finite and >= 0, got " + std::to_string(hp.weight_decay));
  if (!std::isfinite(hp.grad_scale))
    return bad("grad_scale must be finite, got " + std::to_string(hp.grad_scale));
  if (hp.step < 1)
    return bad("step must be >= 1 (the step being taken, 1-based), got " + std::to_string(hp.step));
  return Status::Ok();
}

internal::Coeffs MakeCoeffs(const HyperParams& hp) {
  internal::Coeffs c;
  const double lr = hp.lr, b1 = hp.beta1, b2 = hp.beta2, wd = hp.weight_decay;
  c.grad_scale = static_cast<float>(hp.grad_scale);
  c.eps = static_cast<float>(hp.eps);
  c.beta1 = static_cast<float>(hp.beta1);
  c.beta2 = static_cast<float>(hp.beta2);
  c.w1 = static_cast<float>(1.0 - b1);
  c.w2 = static_cast<float>(1.0 - b2);
  switch (hp.algorithm) {
    case Algorithm::kAdam:
    case Algorithm::kAdamW: {
      const double t = static_cast<double>(hp.step);
      const double bc1 = hp.bias_correction ? 1.0 - std::pow(b1, t) : 1.0;
      const double bc2 = hp.bias_correction ? 1.0 - std::pow(b2, t) : 1.0;
      c.neg_step = static_cast<float>(-lr / bc1);
      c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
      if (hp.algorithm == Algorithm::kAdam)
        c.l2 = static_cast<float>(hp.weight_decay);
      else
        c.decay = static_cast<float>(1.0 - lr * wd);
      break;
    }
    case Algorithm::kAdagrad:
      c.neg_step = static_cast<float>(-lr);
      c.l2 = static_cast<float>(hp.weight_decay);
      break;
    case Algorithm::kLion:
      c.neg_step = static_cast<float>(-lr);
      c.decay = static_cast<float>(1.0 - lr * wd);
      break;
  }
  return c;
}

struct Range {
  uintptr_t lo, hi;
  const char* name;
};

// A shard in a compact state format: the fp32 pointers it does not use must
// be null, the ones it uses non-null and disjoint; int8 shards start at a
// block boundary of the global index.
Status PrepareCompactShard(const ShardStep& s, size_t i, const KernelTable& table, bool roofline,
                           size_t block, Prepared* out) {
  const Algorithm alg = s.hp.algorithm;
  const StateFormat f = s.states;
  const int fi = static_cast<int>(f);
  if (fi < 1 || fi > 3)
    return InvalidArgumentError(ShardName(i) + ": unknown state format " + std::to_string(fi));
  const std::string what = ShardName(i) + " (" + std::string(AlgorithmName(alg)) + ", states " +
                           std::string(StateFormatName(f)) + ", count " + std::to_string(s.count) +
                           ")";
  if (!SupportsStateFormat(alg, f)) {
    return InvalidArgumentError(
        what + ": state format " + std::string(StateFormatName(f)) + " is not supported for " +
        std::string(AlgorithmName(alg)) +
        " (supported: " + (alg == Algorithm::kLion ? "fp32, bf16, int8" : "fp32") + ")");
  }
  if (f == StateFormat::kInt8 && s.element_offset % kStateBlock != 0) {
    return InvalidArgumentError(what + ": element_offset " + std::to_string(s.element_offset) +
                                " is not a multiple of " + std::to_string(kStateBlock) +
                                " (int8 blocks are aligned to the global element index)");
  }
  // The fp32 state pointers belong to kFp32.
  if (s.exp_avg != nullptr || s.exp_avg_sq != nullptr)
    return InvalidArgumentError(what + ": exp_avg/exp_avg_sq (fp32) must be null; the " +
                                std::string(StateFormatName(f)) +
                                " moments go in exp_avg_c/exp_avg_sq_c");
  const bool master16 = f == StateFormat::kBf16Master;
  const bool int8 = f == StateFormat::kInt8;
  const bool two = alg != Algorithm::kLion || roofline;
  if (master16 && s.param != nullptr)
    return InvalidArgumentError(what + ": param (fp32) must be null; the bf16 master is param_c");
  if (!master16 && s.param_c != nullptr)
    return InvalidArgumentError(what + ": param_c must be null; the master is param (fp32)");
  if (!int8 && (s.exp_avg_scale != nullptr || s.exp_avg_sq_scale != nullptr))
    return InvalidArgumentError(what + ": exp_avg_scale/exp_avg_sq_scale are for int8 only");
  if (!two && (s.exp_avg_sq_c != nullptr || s.exp_avg_sq_scale != nullptr))
    return InvalidArgumentError(what + ": lion has no exp_avg_sq_c/exp_avg_sq_scale (null)");
  if (s.fold && s.check_finite)
    return InvalidArgumentError(ShardName(i) +
                                ": check_finite is not supported with fold (check the sum first)");
  if (s.count == 0) return Status::Ok();
  auto null = [&](const char* field) {
    return InvalidArgumentError(what + ": " + field + " is null");
  };
  if (master16 ? s.param_c == nullptr : s.param == nullptr)
    return null(master16 ? "param_c" : "param");
  if (s.grad == nullptr) return null("grad");
  if (s.exp_avg_c == nullptr) return null("exp_avg_c");
  if (two && s.exp_avg_sq_c == nullptr) return null("exp_avg_sq_c");
  if (int8 && s.exp_avg_scale == nullptr) return null("exp_avg_scale");
  if (int8 && two && s.exp_avg_sq_scale == nullptr) return null("exp_avg_sq_scale");
  const size_t sb = StateElementBytes(f, StateRole::kExpAvg);
  const size_t nblk = (s.count + kStateBlock - 1) / kStateBlock;
  std::vector<Range> ranges;
  auto add = [&](const void* p, size_t bytes, const char* name) {
    const auto lo = reinterpret_cast<uintptr_t>(p);
    ranges.push_back({lo, lo + bytes, name});
  };
  if (master16) {
    add(s.param_c, s.count * 2, "param_c");
  } else {
    add(s.param, s.count * 4, "param");
  }
  add(s.grad, s.count * DTypeSize(s.grad_dtype), "grad");
  add(s.exp_avg_c, s.count * sb, "exp_avg_c");
  if (two) add(s.exp_avg_sq_c, s.count * sb, "exp_avg_sq_c");
  if (int8) add(s.exp_avg_scale, nblk * 4, "exp_avg_scale");
  if (int8 && two) add(s.exp_avg_sq_scale, nblk * 4, "exp_avg_sq_scale");
  if (s.copy_out) add(s.copy_out, s.count * DTypeSize(s.copy_dtype), "copy_out");
  if (s.fold && s.fold_acc != nullptr) add(s.fold_acc, s.count * 4, "fold_acc");
  for (size_t a = 0; a < ranges.size(); ++a) {
    for (size_t b = a + 1; b < ranges.size(); ++b) {
      if (ranges[a].lo < ranges[b].hi && ranges[b].lo < ranges[a].hi) {
        return InvalidArgumentError(what + ": " + ranges[a].name + " and " + ranges[b].name +
                                    " overlap");
      }
    }
  }
  const KernelOp op = roofline ? KernelOp::kRoofline : static_cast<KernelOp>(static_cast<int>(alg));
  out->fn = table.compact[fi - 1][static_cast<int>(op)][static_cast<int>(s.grad_dtype)];
  if (out->fn == nullptr)
    return InternalError(what + ": no kernel in the " + std::string(table.isa) + " table");
  KernelArgs& a = out->base;
  a.param = s.param;
  a.param_c = s.param_c;
  a.grad = s.grad;
  a.state0_c = s.exp_avg_c;
  a.state1_c = two ? s.exp_avg_sq_c : nullptr;
  a.scale0 = s.exp_avg_scale;
  a.scale1 = two ? s.exp_avg_sq_scale : nullptr;
  a.index0 = s.element_offset;
  const internal::SrKey key = internal::MakeSrKey(s.seed, s.hp.step);
  a.sr_key0 = key.k0;
  a.sr_key1 = key.k1;
  a.folded = s.fold;
  a.fold = s.fold ? s.fold_acc : nullptr;
  a.copy_out = s.copy_out;
  a.copy = CopyOutOf(s);
  a.n = s.count;
  a.c = MakeCoeffs(s.hp);
  out->check = s.check_finite;
  out->blocks = (s.count + block - 1) / block;
  out->grad_bytes = DTypeSize(s.grad_dtype);
  out->copy_bytes = s.copy_out ? DTypeSize(s.copy_dtype) : 0;
  out->states = f;
  out->state_bytes = sb;
  return Status::Ok();
}

Status PrepareShard(const ShardStep& s, size_t i, const KernelTable& table, bool roofline,
                    size_t block, bool stream_state, bool stream_copy, Prepared* out) {
  RETURN_IF_ERROR(CheckHyper(s.hp, i));
  const Algorithm alg = s.hp.algorithm;
  if (static_cast<int>(alg) > 3) return InvalidArgumentError(ShardName(i) + ": unknown algorithm");
  if (!IsValidDType(s.grad_dtype))
    return InvalidArgumentError(ShardName(i) + ": grad_dtype is not fp32, fp16 or bf16");
  if (s.copy_out != nullptr && !IsValidDType(s.copy_dtype))
    return InvalidArgumentError(ShardName(i) + ": copy_dtype is not fp32, fp16 or bf16");
  const bool adam = alg == Algorithm::kAdam || alg == Algorithm::kAdamW;
  const bool needs_m = adam || alg == Algorithm::kLion || roofline;
  const bool needs_v = adam || alg == Algorithm::kAdagrad || roofline;
  *out = Prepared{};
  if (s.states != StateFormat::kFp32) return PrepareCompactShard(s, i, table, roofline, block, out);
  if (s.param_c != nullptr || s.exp_avg_c != nullptr || s.exp_avg_sq_c != nullptr ||
      s.exp_avg_scale != nullptr || s.exp_avg_sq_scale != nullptr)
    return InvalidArgumentError(ShardName(i) +
                                ": param_c/exp_avg_c/exp_avg_sq_c/exp_avg_scale/exp_avg_sq_scale "
                                "are for compact state formats; states is fp32");
  if (s.count == 0) return Status::Ok();
  auto null = [&](const char* what) {
    return InvalidArgumentError(ShardName(i) + " (" + std::string(AlgorithmName(alg)) + ", count " +
                                std::to_string(s.count) + "): " + what + " is null");
  };
  if (s.param == nullptr) return null("param");
  if (s.grad == nullptr) return null("grad");
  if (needs_m && s.exp_avg == nullptr) return null("exp_avg");
  if (needs_v && s.exp_avg_sq == nullptr) return null("exp_avg_sq");
  // The arrays must not overlap (an element would be read after being written).
  std::vector<Range> ranges;
  auto add = [&](const void* p, size_t bytes, const char* name) {
    const auto lo = reinterpret_cast<uintptr_t>(p);
    ranges.push_back({lo, lo + bytes, name});
  };
  add(s.param, s.count * 4, "param");
  add(s.grad, s.count * DTypeSize(s.grad_dtype), "grad");
  if (needs_m) add(s.exp_avg, s.count * 4, "exp_avg");
  if (needs_v) add(s.exp_avg_sq, s.count * 4, "exp_avg_sq");
  if (s.copy_out) add(s.copy_out, s.count * DTypeSize(s.copy_dtype), "copy_out");
  if (s.fold && s.check_finite)
    return InvalidArgumentError(ShardName(i) +
                                ": check_finite is not supported with fold (check the sum first)");
  if (s.fold && s.fold_acc != nullptr) add(s.fold_acc, s.count * 4, "fold_acc");
  for (size_t a = 0; a < ranges.size(); ++a) {
    for (size_t b = a + 1; b < ranges.size(); ++b) {
      if (ranges[a].lo < ranges[b].hi && ranges[b].lo < ranges[a].hi) {
        return InvalidArgumentError(ShardName(i) + ": " + ranges[a].name + " and " +
                                    ranges[b].name + " overlap (count " + std::to_string(s.count) +
                                    ")");
      }
    }
  }
  KernelOp op = roofline ? KernelOp::kRoofline : static_cast<KernelOp>(static_cast<int>(alg));
  CopyOut co = CopyOut::kNone;
  if (s.copy_out) {
    co = s.copy_dtype == DType::kFp32
             ? CopyOut::kFp32
             : (s.copy_dtype == DType::kFp16 ? CopyOut::kFp16 : CopyOut::kBf16);
  }
  const auto& fns = s.fold ? table.step_fold : table.step;
  out->fn = fns[static_cast<int>(op)][static_cast<int>(s.grad_dtype)][static_cast<int>(co)];
  KernelArgs& a = out->base;
  a.fold = s.fold ? s.fold_acc : nullptr;
  a.param = s.param;
  a.grad = s.grad;
  // Adagrad keeps its sum in exp_avg_sq; the kernels call it state0.
  a.state0 = alg == Algorithm::kAdagrad && !roofline ? s.exp_avg_sq : s.exp_avg;
  a.state1 = (adam || roofline) ? s.exp_avg_sq : nullptr;
  a.copy_out = s.copy_out;
  a.n = s.count;
  a.c = MakeCoeffs(s.hp);
  a.stream_state = stream_state;
  a.stream_copy = stream_copy && s.copy_out != nullptr;
  out->check = s.check_finite;
  out->blocks = (s.count + block - 1) / block;
  out->grad_bytes = DTypeSize(s.grad_dtype);
  out->copy_bytes = s.copy_out ? DTypeSize(s.copy_dtype) : 0;
  return Status::Ok();
}

// The blocks of several shards as one index range [0, total()): global block
// gb is block gb - first_[k] of shard k. Block b of a shard covers its
// elements [b*block, min((b+1)*block, count)).
class FlatBlocks {
 public:
  // Each of `shards` has a `blocks` count.
  template <typename S>
  explicit FlatBlocks(const std::vector<S>& shards) : first_(shards.size() + 1, 0) {
    for (size_t k = 0; k < shards.size(); ++k) first_[k + 1] = first_[k] + shards[k].blocks;
  }
  size_t total() const { return first_.back(); }
  // The shard global block `gb` belongs to.
  size_t ShardOf(size_t gb) const {
    return static_cast<size_t>(std::upper_bound(first_.begin(), first_.end(), gb) -
                               first_.begin()) -
           1;
  }
  // The offset of global block `gb` (of shard k) in its shard's elements.
  size_t Offset(size_t gb, size_t k, size_t block) const { return (gb - first_[k]) * block; }

 private:
  std::vector<size_t> first_;
};

// Runs the prepared shards as one parallel pass over all their blocks.
// Must be called inside the arena.
size_t RunPrepared(const std::vector<Prepared>& shards, size_t block) {
  const FlatBlocks blocks(shards);
  const size_t total = blocks.total();
  if (total == 0) return 0;
  std::unique_ptr<std::atomic<bool>[]> bad(new std::atomic<bool>[shards.size()]);
  for (size_t k = 0; k < shards.size(); ++k) bad[k].store(false, std::memory_order_relaxed);
  auto body = [&](const tbb::blocked_range<size_t>& r) {
    for (size_t gb = r.begin(); gb < r.end(); ++gb) {
      const size_t k = blocks.ShardOf(gb);
      const Prepared& p = shards[k];
      const size_t off = blocks.Offset(gb, k, block);
      KernelArgs a = p.base;
      a.n = std::min(block, p.base.n - off);
      if (p.states == StateFormat::kFp32) a.param += off;
      a.grad = static_cast<const char*>(p.base.grad) + off * p.grad_bytes;
      if (p.states == StateFormat::kFp32) {
        a.state0 += off;
        if (a.state1) a.state1 += off;
      } else {
        // Blocks are multiples of 1024 elements: int8 blocks stay aligned.
        if (a.param) a.param += off;
        if (a.param_c) a.param_c = static_cast<uint16_t*>(a.param_c) + off;
        a.state0_c = static_cast<char*>(a.state0_c) + off * p.state_bytes;
        if (a.state1_c) a.state1_c = static_cast<char*>(a.state1_c) + off * p.state_bytes;
        if (a.scale0) a.scale0 += off / kStateBlock;
        if (a.scale1) a.scale1 += off / kStateBlock;
        a.index0 += off;
      }
      if (a.fold) a.fold += off;
      if (a.copy_out) a.copy_out = static_cast<char*>(a.copy_out) + off * p.copy_bytes;
      if (!p.fn(a, p.check)) bad[k].store(true, std::memory_order_relaxed);
    }
  };
  tbb::parallel_for(tbb::blocked_range<size_t>(0, total, 1), body, tbb::simple_partitioner());
  size_t n_bad = 0;
  for (size_t k = 0; k < shards.size(); ++k)
    n_bad += bad[k].load(std::memory_order_relaxed) ? 1 : 0;
  return n_bad;
}

// Starts `n` threads that wait until all have started, then joins them:
// ResourceExhausted naming how many were asked and started when the process
// cannot have them all (RLIMIT_NPROC, RLIMIT_AS for their stacks).
Status ProbeThreads(int n) {
  struct Gate {
    Mutex mu;
    CondVar cv;
    bool release GUARDED_BY(mu) = false;
  } gate;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n));
  Status status;
  for (int i = 0; i < n; ++i) {
    try {
      threads.emplace_back([&] {
        MutexLock lock(&gate.mu);
        while (!gate.release) gate.cv.Wait(&gate.mu);
      });
    } catch (const std::system_error& e) {
      const std::string limits = ThreadStartLimits();
      status = ResourceExhaustedError("cpu_adam: cannot start " + std::to_string(n) +
                                      " optimizer worker threads (strata.threads - 1); " +
                                      std::to_string(i) + " started: " + e.what() +
                                      (limits.empty() ? "" : "; " + limits));
      break;
    }
  }
  {
    MutexLock lock(&gate.mu);
    gate.release = true;
  }
  gate.cv.NotifyAll();
  for (auto& t : threads) t.join();
  return status;
}

// Pins every thread that enters the arena to the NUMA node's PUs. A thread
// that is not a TBB worker (the caller of Step) gets its own binding back
// when it leaves.
class PinObserver final : public tbb::task_scheduler_observer {
 public:
  PinObserver(tbb::task_arena& arena, std::shared_ptr<internal::Topology> topo, int node,
              std::atomic<uint64_t>* entries)
      : tbb::task_scheduler_observer(arena),
        topo_(std::move(topo)),
        node_(node),
        entries_(entries) {
    observe(true);
  }
  ~PinObserver() override { observe(false); }

  void on_scheduler_entry(bool is_worker) override {
    if (!is_worker) Saved().push_back(topo_->SaveBinding());
    Status s = topo_->BindThisThread(node_);
    if (!s.ok()) {
      STRATA_WARN_ONCE("cpu_adam.pin_failed",
                       "cpu_adam: cannot pin optimizer threads, running unpinned: {}",
                       s.ToString());
      return;
    }
    entries_->fetch_add(1, std::memory_order_relaxed);
  }
  void on_scheduler_exit(bool is_worker) override {
    if (is_worker || Saved().empty()) return;
    topo_->RestoreBinding(*Saved().back());
    Saved().pop_back();
  }

 private:
  using SavedBinding = decltype(std::declval<internal::Topology&>().SaveBinding());
  static std::vector<SavedBinding>& Saved() {
    thread_local std::vector<SavedBinding> saved;
    return saved;
  }
  std::shared_ptr<internal::Topology> topo_;
  int node_;
  std::atomic<uint64_t>* entries_;
};

}  // namespace

struct StepHandle::State {
  Mutex mu;
  CondVar cv;
  bool done GUARDED_BY(mu) = false;
  Status status GUARDED_BY(mu);
  StepResult result GUARDED_BY(mu);
  std::vector<Prepared> shards;  // read by the worker only
};

StepHandle::StepHandle() = default;
StepHandle::StepHandle(std::shared_ptr<State> s) : state_(std::move(s)) {}
StepHandle::StepHandle(StepHandle&&) noexcept = default;
StepHandle& StepHandle::operator=(StepHandle&& o) noexcept {
  if (this != &o) {
    if (state_) Wait().status().IgnoreError();
    state_ = std::move(o.state_);
  }
  return *this;
}
StepHandle::~StepHandle() {
  if (state_) Wait().status().IgnoreError();
}

bool StepHandle::Ready() const {
  if (!state_) return false;
  MutexLock lock(&state_->mu);
  return state_->done;
}

StatusOr<StepResult> StepHandle::Wait() {
  if (!state_)
    return FailedPreconditionError(
        "cpu_adam: Wait on an invalid StepHandle (already waited or empty)");
  std::shared_ptr<State> s = std::move(state_);
  MutexLock lock(&s->mu);
  while (!s->done) s->cv.Wait(&s->mu);
  if (!s->status.ok()) return s->status;
  return s->result;
}

struct CpuOptimizer::Impl {
  Options opt;
  const KernelTable* table = nullptr;
  std::shared_ptr<internal::Topology> topo;
  int threads = 1;
  int node = -1;
  bool stream_state = false;
  bool stream_copy = false;
  std::atomic<uint64_t> pinned{0};
  std::unique_ptr<tbb::task_arena> arena;
  std::unique_ptr<PinObserver> observer;

  Mutex mu;
  CondVar idle;
  int outstanding GUARDED_BY(mu) = 0;  // asynchronous steps not finished

  ~Impl() {
    {
      MutexLock lock(&mu);
      while (outstanding != 0) idle.Wait(&mu);
    }
    observer.reset();  // before the arena it observes
    arena.reset();
  }

  Status PrepareAll(std::span<const ShardStep> shards, std::vector<Prepared>* out) const {
    out->resize(shards.size());
    for (size_t i = 0; i < shards.size(); ++i) {
      RETURN_IF_ERROR(PrepareShard(shards[i], i, *table, opt.roofline_kernel, opt.block_elems,
                                   stream_state, stream_copy, &(*out)[i]));
    }
    return Status::Ok();
  }
};

CpuOptimizer::CpuOptimizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CpuOptimizer::~CpuOptimizer() = default;

StatusOr<std::unique_ptr<CpuOptimizer>> CpuOptimizer::Create(const Options& options) {
  auto impl = std::make_unique<Impl>();
  impl->opt = options;
  if (options.block_elems == 0 || options.block_elems % internal::kCheckChunk != 0) {
    return InvalidArgumentError("cpu_adam: block_elems must be a positive multiple of 1024, got " +
                                std::to_string(options.block_elems));
  }
  if (options.threads < 0) {
    return InvalidArgumentError("cpu_adam: threads must be >= 0 (0 = all PUs of the node), got " +
                                std::to_string(options.threads));
  }
  ASSIGN_OR_RETURN(impl->table, internal::SelectTable(options.isa));
  ASSIGN_OR_RETURN(impl->topo, internal::Topology::Load());
  impl->node = options.numa_node;
  if (impl->node < -1) {
    return InvalidArgumentError(
        "cpu_adam: numa_node must be -1 (no pinning) or a node index, got " +
        std::to_string(impl->node));
  }
  auto pus = impl->topo->PuCount(impl->node);
  if (!pus.ok()) return NotSupportedError(std::string(pus.status().message()));
  impl->threads = options.threads > 0 ? options.threads : *pus;
  switch (options.streaming_stores) {
    case StreamingStores::kAuto:
      // Measured (docs/perf.md, "cpu_adam"): non-temporal stores into the
      // in-place arrays halve throughput (the lines were just read, so there
      // is no write-allocate to save); for the write-only copy-out they were
      // no faster than ordinary stores on 100M params. So: off.
      impl->stream_state = false;
      impl->stream_copy = false;
      break;
    case StreamingStores::kOff:
      break;
    case StreamingStores::kCopyOut:
      impl->stream_copy = true;
      break;
    case StreamingStores::kAll:
      impl->stream_state = true;
      impl->stream_copy = true;
      break;
  }
  if (impl->table->lanes == 1)
    impl->stream_state = impl->stream_copy = false;  // plain loop: no NT stores
  // TBB starts its workers lazily, on a step, and a pthread_create it cannot
  // make there throws on whichever thread asked (a TBB worker: terminate).
  // So check now that the workers can all exist at once.
  RETURN_IF_ERROR(ProbeThreads(impl->threads > 1 ? impl->threads - 1 : 1));
  try {
    // One slot is kept for the thread that calls Step (it joins the work);
    // asynchronous steps run on the threads-1 workers (1 worker when threads
    // is 1, so that enqueued work always has a thread).
    impl->arena = std::make_unique<tbb::task_arena>(impl->threads, impl->threads > 1 ? 1 : 0);
    impl->arena->initialize();
    if (impl->node >= 0) {
      impl->observer =
          std::make_unique<PinObserver>(*impl->arena, impl->topo, impl->node, &impl->pinned);
    }
  } catch (const std::exception& e) {
    return ResourceExhaustedError(std::string("cpu_adam: creating the TBB arena of ") +
                                  std::to_string(impl->threads) + " threads failed: " + e.what());
  }
  STRATA_LOG_DEBUG("cpu_adam: isa {}, {} threads, NUMA node {}", impl->table->isa, impl->threads,
                   impl->node);
  return std::unique_ptr<CpuOptimizer>(new CpuOptimizer(std::move(impl)));
}

StatusOr<StepResult> CpuOptimizer::Step(const ShardStep& shard) { return StepMany({&shard, 1}); }

StatusOr<StepResult> CpuOptimizer::StepMany(std::span<const ShardStep> shards) {
  std::vector<Prepared> prepared;
  RETURN_IF_ERROR(impl_->PrepareAll(shards, &prepared));
  StepResult result;
  try {
    impl_->arena->execute(
        [&] { result.nonfinite_shards = RunPrepared(prepared, impl_->opt.block_elems); });
  } catch (const std::exception& e) {
    return InternalError(std::string("cpu_adam: step failed: ") + e.what());
  }
  return result;
}

StatusOr<StepHandle> CpuOptimizer::StepAsync(std::span<const ShardStep> shards) {
  auto state = std::make_shared<StepHandle::State>();
  RETURN_IF_ERROR(impl_->PrepareAll(shards, &state->shards));
  {
    MutexLock lock(&impl_->mu);
    ++impl_->outstanding;
  }
  Impl* impl = impl_.get();
  auto task = [state, impl] {
    Status status;
    StepResult result;
    try {
      result.nonfinite_shards = RunPrepared(state->shards, impl->opt.block_elems);
    } catch (const std::exception& e) {
      status = InternalError(std::string("cpu_adam: asynchronous step failed: ") + e.what());
    }
    {
      MutexLock lock(&state->mu);
      state->status = std::move(status);
      state->result = result;
      state->done = true;
    }
    state->cv.NotifyAll();
    {
      MutexLock lock(&impl->mu);
      --impl->outstanding;
    }
    impl->idle.NotifyAll();
  };
  try {
    impl_->arena->enqueue(std::move(task));
  } catch (const std::exception& e) {
    MutexLock lock(&impl_->mu);
    --impl_->outstanding;
    return InternalError(std::string("cpu_adam: enqueue failed: ") + e.what());
  }
  return StepHandle(std::move(state));
}

StatusOr<bool> CpuOptimizer::AllFinite(const void* grad, DType grad_dtype, size_t count,
                                       float grad_scale) {
  if (!IsValidDType(grad_dtype))
    return InvalidArgumentError("cpu_adam: AllFinite: grad_dtype is not fp32, fp16 or bf16");
  if (count == 0) return true;
  if (grad == nullptr)
    return InvalidArgumentError("cpu_adam: AllFinite: grad is null (count " +
                                std::to_string(count) + ")");
  const internal::CheckFn fn = impl_->table->check[static_cast<int>(grad_dtype)];
  const size_t block = impl_->opt.block_elems;
  const size_t esize = DTypeSize(grad_dtype);
  std::atomic<bool> finite{true};
  try {
    impl_->arena->execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<size_t>(0, (count + block - 1) / block, 1),
          [&](const tbb::blocked_range<size_t>& r) {
            for (size_t b = r.begin(); b < r.end(); ++b) {
              if (!finite.load(std::memory_order_relaxed)) return;
              const size_t off = b * block;
              if (!fn(static_cast<const char*>(grad) + off * esize, std::min(block, count - off),
                      grad_scale))
                finite.store(false, std::memory_order_relaxed);
            }
          },
          tbb::simple_partitioner());
    });
  } catch (const std::exception& e) {
    return InternalError(std::string("cpu_adam: AllFinite failed: ") + e.what());
  }
  return finite.load();
}

Status CpuOptimizer::Cast(const float* src, void* dst, DType dst_dtype, size_t count) {
  if (!IsValidDType(dst_dtype))
    return InvalidArgumentError("cpu_adam: Cast: dst_dtype is not fp32, fp16 or bf16");
  if (count == 0) return Status::Ok();
  if (src == nullptr || dst == nullptr)
    return InvalidArgumentError("cpu_adam: Cast: null " + std::string(src ? "dst" : "src") +
                                " (count " + std::to_string(count) + ")");
  const size_t esize = DTypeSize(dst_dtype);
  const auto s_lo = reinterpret_cast<uintptr_t>(src), d_lo = reinterpret_cast<uintptr_t>(dst);
  if (s_lo < d_lo + count * esize && d_lo < s_lo + count * 4)
    return InvalidArgumentError("cpu_adam: Cast: src and dst overlap (count " +
                                std::to_string(count) + ")");
  const KernelTable& t = *impl_->table;
  const size_t block = impl_->opt.block_elems;
  try {
    impl_->arena->execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<size_t>(0, (count + block - 1) / block, 1),
          [&](const tbb::blocked_range<size_t>& r) {
            for (size_t b = r.begin(); b < r.end(); ++b) {
              const size_t off = b * block, n = std::min(block, count - off);
              if (dst_dtype == DType::kFp32) {
                std::memcpy(static_cast<float*>(dst) + off, src + off, n * 4);
              } else {
                uint16_t* out = static_cast<uint16_t*>(dst) + off;
                (dst_dtype == DType::kFp16 ? t.f32_to_f16 : t.f32_to_bf16)(src + off, out, n);
              }
            }
          },
          tbb::simple_partitioner());
    });
  } catch (const std::exception& e) {
    return InternalError(std::string("cpu_adam: Cast failed: ") + e.what());
  }
  return Status::Ok();
}

namespace {

// A validated accumulation slice and the kernel that runs it.
struct PreparedAccumulate {
  internal::AccumulateFn fn = nullptr;
  float* acc = nullptr;
  const char* grad = nullptr;
  size_t count = 0;
  size_t grad_bytes = 4;  // per element
  size_t blocks = 0;
};

std::string AccumulateShardName(size_t i, const AccumulateShard& s) {
  return "cpu_adam: accumulate shard " + std::to_string(i) + " (count " + std::to_string(s.count) +
         ", grad " + (IsValidDType(s.grad_dtype) ? std::string(DTypeName(s.grad_dtype)) : "?") +
         ")";
}

// Checks every shard and that no shard's acc overlaps its own grad or any
// other shard's acc or grad (grads may overlap each other: they are only
// read). O(k log k) in the number of shards.
Status PrepareAccumulate(std::span<const AccumulateShard> shards, const KernelTable& table,
                         bool roofline, size_t block, std::vector<PreparedAccumulate>* out) {
  out->clear();
  out->reserve(shards.size());
  struct AccRange {
    uintptr_t lo, hi;
    size_t shard;
  };
  std::vector<AccRange> accs;
  accs.reserve(shards.size());
  for (size_t i = 0; i < shards.size(); ++i) {
    const AccumulateShard& s = shards[i];
    if (!IsValidDType(s.grad_dtype))
      return InvalidArgumentError(AccumulateShardName(i, s) +
                                  ": grad_dtype is not fp32, fp16 or bf16");
    if (s.count == 0) continue;
    if (s.acc == nullptr) return InvalidArgumentError(AccumulateShardName(i, s) + ": acc is null");
    if (s.grad == nullptr)
      return InvalidArgumentError(AccumulateShardName(i, s) + ": grad is null");
    PreparedAccumulate p;
    const int gd = static_cast<int>(s.grad_dtype);
    p.fn = roofline ? table.accumulate_roofline[gd] : table.accumulate[gd];
    p.acc = s.acc;
    p.grad = static_cast<const char*>(s.grad);
    p.count = s.count;
    p.grad_bytes = DTypeSize(s.grad_dtype);
    p.blocks = (s.count + block - 1) / block;
    out->push_back(p);
    const auto lo = reinterpret_cast<uintptr_t>(s.acc);
    accs.push_back({lo, lo + s.count * 4, i});
  }
  std::sort(accs.begin(), accs.end(),
            [](const AccRange& a, const AccRange& b) { return a.lo < b.lo; });
  for (size_t k = 1; k < accs.size(); ++k) {
    if (accs[k].lo < accs[k - 1].hi) {
      const size_t a = std::min(accs[k - 1].shard, accs[k].shard),
                   b = std::max(accs[k - 1].shard, accs[k].shard);
      return InvalidArgumentError("cpu_adam: accumulate shards " + std::to_string(a) + " and " +
                                  std::to_string(b) + ": their acc arrays overlap");
    }
  }
  // The acc ranges are now sorted and disjoint: a grad range [lo, hi) can
  // only overlap the last acc range starting below hi.
  for (size_t i = 0; i < shards.size(); ++i) {
    const AccumulateShard& s = shards[i];
    if (s.count == 0) continue;
    const auto lo = reinterpret_cast<uintptr_t>(s.grad),
               hi = lo + s.count * DTypeSize(s.grad_dtype);
    auto it = std::lower_bound(accs.begin(), accs.end(), hi,
                               [](const AccRange& a, uintptr_t v) { return a.lo < v; });
    if (it == accs.begin()) continue;
    --it;
    if (it->hi > lo) {
      if (it->shard == i)
        return InvalidArgumentError(AccumulateShardName(i, s) + ": acc and grad overlap");
      return InvalidArgumentError("cpu_adam: accumulate shard " + std::to_string(i) +
                                  ": grad overlaps the acc of shard " + std::to_string(it->shard));
    }
  }
  return Status::Ok();
}

}  // namespace

Status CpuOptimizer::Accumulate(float* acc, const void* grad, DType grad_dtype, size_t count) {
  const AccumulateShard shard{acc, grad, grad_dtype, count};
  return AccumulateMany({&shard, 1});
}

Status CpuOptimizer::AccumulateMany(std::span<const AccumulateShard> shards) {
  const size_t block = impl_->opt.block_elems;
  std::vector<PreparedAccumulate> prepared;
  RETURN_IF_ERROR(
      PrepareAccumulate(shards, *impl_->table, impl_->opt.roofline_kernel, block, &prepared));
  size_t total_elems = 0, total_blocks = 0;
  for (const PreparedAccumulate& p : prepared) {
    total_elems += p.count;
    total_blocks += p.blocks;
  }
  if (total_blocks == 0) return Status::Ok();
  if (total_blocks == 1 || total_elems < impl_->opt.accumulate_inline_elems) {
    // Small: on the caller's thread, no TBB round trip.
    for (const PreparedAccumulate& p : prepared) p.fn(p.acc, p.grad, p.count);
    return Status::Ok();
  }
  const FlatBlocks blocks(prepared);
  auto body = [&](const tbb::blocked_range<size_t>& r) {
    for (size_t gb = r.begin(); gb < r.end(); ++gb) {
      const size_t k = blocks.ShardOf(gb);
      const PreparedAccumulate& p = prepared[k];
      const size_t off = blocks.Offset(gb, k, block);
      p.fn(p.acc + off, p.grad + off * p.grad_bytes, std::min(block, p.count - off));
    }
  };
  try {
    impl_->arena->execute([&] {
      // Isolated: while waiting for its blocks this thread takes no task of
      // a concurrent step (which would delay the return of this call).
      tbb::this_task_arena::isolate([&] {
        tbb::parallel_for(tbb::blocked_range<size_t>(0, total_blocks, 1), body,
                          tbb::simple_partitioner());
      });
    });
  } catch (const std::exception& e) {
    return InternalError(std::string("cpu_adam: accumulate failed: ") + e.what());
  }
  return Status::Ok();
}

Status CpuOptimizer::Zero(float* p, size_t n) {
  if (n != 0 && p == nullptr) return InvalidArgumentError("cpu_adam: Zero of a null pointer");
  return Blocks(n, "zero", [p](size_t begin, size_t count) {
    std::memset(p + begin, 0, count * sizeof(float));
  });
}

Status CpuOptimizer::Copy(float* dst, const float* src, size_t n) {
  if (n != 0 && (dst == nullptr || src == nullptr))
    return InvalidArgumentError("cpu_adam: Copy with a null pointer");
  return Blocks(n, "copy", [dst, src](size_t begin, size_t count) {
    std::memcpy(dst + begin, src + begin, count * sizeof(float));
  });
}

Status CpuOptimizer::Blocks(size_t n, const char* what,
                            const std::function<void(size_t begin, size_t count)>& fn) {
  if (n == 0) return Status::Ok();
  const size_t block = impl_->opt.block_elems;
  const size_t blocks = (n + block - 1) / block;
  if (blocks == 1 || n < impl_->opt.accumulate_inline_elems) {
    fn(0, n);
    return Status::Ok();
  }
  auto body = [&](const tbb::blocked_range<size_t>& r) {
    for (size_t b = r.begin(); b < r.end(); ++b) fn(b * block, std::min(block, n - b * block));
  };
  try {
    impl_->arena->execute([&] {
      tbb::this_task_arena::isolate([&] {
        tbb::parallel_for(tbb::blocked_range<size_t>(0, blocks, 1), body,
                          tbb::simple_partitioner());
      });
    });
  } catch (const std::exception& e) {
    return InternalError(fmt::format("cpu_adam: {} failed: {}", what, e.what()));
  }
  return Status::Ok();
}

std::string_view CpuOptimizer::isa() const { return impl_->table->isa; }
int CpuOptimizer::threads() const { return impl_->threads; }
int CpuOptimizer::numa_node() const { return impl_->node; }
bool CpuOptimizer::streams_state() const { return impl_->stream_state; }
bool CpuOptimizer::streams_copy() const { return impl_->stream_copy; }
uint64_t CpuOptimizer::pinned_thread_entries() const { return impl_->pinned.load(); }

}  // namespace strata::cpu_adam
