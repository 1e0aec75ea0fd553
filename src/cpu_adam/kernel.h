// Internal to src/cpu_adam: the per-ISA kernel table and the plain argument
// block every kernel takes. Included by cpu_adam.cc, the per-ISA translation
// units, tests and benchmarks — never by other modules (they use cpu_adam.h).
//
// A kernel updates `n` consecutive elements of one shard in a single pass:
//   reads  param (fp32), grad (fp32|fp16|bf16), state0, state1 (fp32)
//   writes param, state0, state1 and optionally copy_out (fp16|bf16|fp32)
// The compact state formats (StateFormat in cpu_adam.h) have their own
// kernels (KernelTable::compact): the same math, the state arrays stored as
// bf16 or as 8-bit codes with per-block scales (see "Compact state formats"
// below and in docs/design.md).
// The math of each optimizer, in the exact order of float operations, is
// written once in kernel_impl.h / kernel_compact.h (SIMD) and once in kernel_scalar.cc (plain
// loop); both are documented in docs/design.md ("cpu_adam").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "src/common/dtype.h"
#include "src/common/state_codes.h"
#include "src/cpu_adam/cpu_adam.h"

namespace strata::cpu_adam::internal {

// What the kernel computes. kRoofline is not an optimizer: it reads and
// writes exactly the arrays Adam does with trivial arithmetic (x + g*0,
// which leaves finite values unchanged) — the memory roofline for this
// access pattern, used by `strata bench adam`.
enum class KernelOp : uint8_t { kAdam = 0, kAdamW = 1, kAdagrad = 2, kLion = 3, kRoofline = 4 };
constexpr int kNumKernelOps = 5;

// Copy-out selector: none, or the dtype of the copy.
enum class CopyOut : uint8_t { kNone = 0, kFp32 = 1, kFp16 = 2, kBf16 = 3 };
constexpr int kNumCopyOuts = 4;

// ---- Compact state formats ---------------------------------------------------
// StateFormat::kBf16, kBf16Master, kInt8 (index = format - 1 in the table).
constexpr int kNumCompactFormats = 3;
// int8: elements per quantization block and the two codes' ranges (see
// src/common/state_codes.h, shared with the device Adam).
inline constexpr size_t kQuantBlock = codes::kQuantBlock;
inline constexpr float kExpAvgCodeMax = codes::kExpAvgCodeMax;
inline constexpr float kExpAvgSqCodeMax = codes::kExpAvgSqCodeMax;

// Coefficients are computed once per shard (in double, then rounded to
// float) by cpu_adam.cc; the kernels only multiply and add them.
struct Coeffs {
  float grad_scale = 1.f;    // g = grad * grad_scale
  float l2 = 0.f;            // Adam/Adagrad: g += l2 * p   (coupled weight decay)
  float decay = 1.f;         // AdamW/Lion: p *= decay     (1 - lr * weight_decay)
  float beta1 = 0.9f;        // Lion: interpolation for the sign
  float w1 = 0.1f;           // 1 - beta1   (Adam: lerp weight of exp_avg)
  float beta2 = 0.999f;      //
  float w2 = 0.001f;         // 1 - beta2
  float inv_bc2_sqrt = 1.f;  // 1 / sqrt(1 - beta2^t)  (1 without bias correction)
  float eps = 1e-8f;         //
  float neg_step = -1e-3f;   // -lr / (1 - beta1^t); Adagrad: -clr; Lion: -lr
};

struct KernelArgs {
  float* param = nullptr;
  const void* grad = nullptr;
  float* state0 = nullptr;   // Adam: exp_avg;    Adagrad: sum;  Lion: exp_avg
  float* state1 = nullptr;   // Adam: exp_avg_sq; Adagrad, Lion: unused (null)
  void* copy_out = nullptr;  // null when copy == kNone
  // The step_fold kernels only: the gradient is fold[i] + float(grad[i]) (one
  // fp32 add, before the grad_scale multiply), or 0.f + float(grad[i]) when
  // fold is null — exactly what accumulate[] into fold (or into a zeroed
  // accumulator) followed by a step on the fp32 sum computes. Read only.
  const float* fold = nullptr;
  size_t n = 0;
  Coeffs c;
  // Non-temporal stores (where the address is vector-aligned) for the
  // in-place arrays (param, states) and for the write-only copy-out.
  bool stream_state = false;
  bool stream_copy = false;

  // ---- Compact state formats only (KernelTable::compact) -------------------
  // Which arrays are used depends on the format:
  //   bf16:        param (fp32), state0_c/state1_c bf16 bits (uint16_t)
  //   bf16-master: param_c (bf16 bits), state0_c/state1_c bf16 bits
  //   int8:        param (fp32), state0_c/state1_c 8-bit codes (uint8_t),
  //                scale0/scale1 one fp32 per kQuantBlock elements; element 0
  //                of the call starts a block (index0 % kQuantBlock == 0)
  void* param_c = nullptr;
  void* state0_c = nullptr;
  void* state1_c = nullptr;
  float* scale0 = nullptr;
  float* scale1 = nullptr;
  uint64_t index0 = 0;                // global index of element 0 (stochastic rounding, blocks)
  uint32_t sr_key0 = 0, sr_key1 = 0;  // SrKey(seed, step): the rounding stream of this step
  // The compact kernels take the copy-out and the fold as run-time choices
  // (fewer instantiations; the branch is per 256 elements or per vector and
  // always predicted): copy is the copy-out dtype (copy_out null when kNone),
  // fold true means the gradient is fold[i] + float(grad[i]) (0.f + grad
  // when fold is null), as the step_fold kernels do.
  CopyOut copy = CopyOut::kNone;
  bool folded = false;
};

// One pass over [0, n). Returns false if a non-finite scaled gradient was
// seen (only when check_finite; then every 1024-element chunk holding one is
// left untouched, see cpu_adam.h), true otherwise.
using StepFn = bool (*)(const KernelArgs& a, bool check_finite);
// True if all of grad[0, n) * scale is finite. Read-only.
using CheckFn = bool (*)(const void* grad, size_t n, float scale);
// Gradient accumulation over [0, n): acc[i] += float(grad[i]), the gradient
// in the table's dtype (fp16/bf16 widened exactly), one fp32 add per element
// (so every ISA gives the scalar loop's bits). Any alignment; acc and grad
// must not overlap. Moves 8 + sizeof(grad) bytes per element.
using AccumulateFn = void (*)(float* acc, const void* grad, size_t n);
// Vector conversions (for tests: compared to src/common/half.h).
using ToHalfFn = void (*)(const float* in, uint16_t* out, size_t n);
using FromHalfFn = void (*)(const uint16_t* in, float* out, size_t n);
using QuantizeFn = void (*)(const float* in, size_t n, uint8_t* codes, float* scales);
using DequantizeFn = void (*)(const uint8_t* codes, const float* scales, size_t n, float* out);
using StochasticFn = void (*)(const float* in, uint16_t* out, size_t n, uint64_t index0,
                              uint32_t k0, uint32_t k1);

struct KernelTable {
  std::string_view isa;  // "avx512", "avx2+fma", "sse4.2", "scalar"
  size_t lanes;          // fp32 lanes per vector (1 for scalar)
  // Whether the kernels' fma rounds once (probed when the table is made).
  // xsimd 8.1 fuses on AVX2+FMA but implements fma as multiply + add for
  // its AVX-512 arch (and SSE4.2), so those give the scalar loop's bits.
  bool fused_fma = false;
  // step[op][grad dtype][copy-out]
  StepFn step[kNumKernelOps][3][kNumCopyOuts];
  // The same with the window's last micro-batch folded in (KernelArgs::fold):
  // reads fold (4 bytes, unless null) beside the grad. check_finite is not
  // supported (cpu_adam.cc refuses it).
  StepFn step_fold[kNumKernelOps][3][kNumCopyOuts];
  // The compact state formats: compact[format - 1][op][grad dtype], format
  // the StateFormat (bf16, bf16-master, int8); copy-out and fold are
  // run-time (KernelArgs::copy, KernelArgs::folded). Null where the format
  // does not support the op (Adagrad everywhere, Lion with bf16-master).
  StepFn compact[kNumCompactFormats][kNumKernelOps][3];
  CheckFn check[3];            // by grad dtype
  AccumulateFn accumulate[3];  // by grad dtype
  // Benchmark only: the same loads and stores as accumulate[] with trivial
  // integer arithmetic (acc's bits | (grad's bits & an opaque zero): no
  // conversion, no float add); acc keeps its bits — the memory roofline of
  // the access pattern, used by `strata bench accumulate`.
  AccumulateFn accumulate_roofline[3];
  ToHalfFn f32_to_f16, f32_to_bf16;
  FromHalfFn f16_to_f32, bf16_to_f32;
  // The compact formats' conversions over arrays (EncodeState/DecodeState
  // and tests; the scalar table's are the reference of state_codes.h):
  // quantize_q8[0] exp_avg, [1] exp_avg_sq: in[0, n) → codes and one scale
  // per kQuantBlock (element 0 starts a block); dequantize_q8 the inverse.
  QuantizeFn quantize_q8[2];
  DequantizeFn dequantize_q8[2];
  // out[i] = FloatToBf16Stochastic(in[i], SrBits(index0 + i, {k0, k1})).
  StochasticFn to_bf16_stochastic;
};

// Tables per ISA. A table whose ISA this build could not compile is null.
const KernelTable* Avx512Table();
const KernelTable* Avx2Table();
const KernelTable* Sse42Table();
const KernelTable& ScalarTable();  // always present; also the bench baseline

// Elements per chunk for the non-finite check (a chunk with a non-finite
// gradient is skipped as a whole). Chunks start at multiples of this from the
// start of the kernel call.
constexpr size_t kCheckChunk = 1024;

// A kernel call with check_finite: each chunk of kCheckChunk elements whose
// scaled gradients are all finite (finite(off, len)) is stepped (range(off,
// len)); the others are left untouched. True when every chunk was finite.
template <class Finite, class Range>
inline bool StepFiniteChunks(size_t n, Finite&& finite, Range&& range) {
  bool all = true;
  for (size_t off = 0; off < n; off += kCheckChunk) {
    const size_t len = n - off < kCheckChunk ? n - off : kCheckChunk;
    if (!finite(off, len)) {
      all = false;  // leave this chunk untouched
      continue;
    }
    range(off, len);
  }
  return all;
}

}  // namespace strata::cpu_adam::internal

#include <vector>

#include "strata/status.h"

namespace strata::cpu_adam::internal {

// Run-time ISA choice (dispatch.cc). "auto" → the best usable table; a named
// ISA ("avx512", "avx2", "avx2+fma", "sse4.2", "scalar") → that table or
// NotSupported naming what the CPU lacks; anything else → InvalidArgument.
StatusOr<const KernelTable*> SelectTable(std::string_view request);
// Tables usable on this CPU, best first; the last is always the scalar one.
std::vector<const KernelTable*> UsableTables();

}  // namespace strata::cpu_adam::internal
