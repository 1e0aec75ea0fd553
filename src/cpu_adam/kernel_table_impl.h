// Internal to src/cpu_adam: MakeTable<A>(), the kernel table of one
// instruction set (kernel.h's KernelTable) filled with kernel_impl.h's fused
// kernels and kernel_compact.h's compact ones. Included by kernel_avx512.cc,
// kernel_avx2.cc and kernel_sse42.cc after they specialize ArchIO<A>.
#pragma once

#include <string_view>

#include "src/cpu_adam/kernel_compact.h"

namespace strata::cpu_adam::internal {

template <class A, KernelOp OP, int GD>
constexpr void FillCopies(KernelTable& t) {
  t.step[int(OP)][GD][int(CopyOut::kNone)] = &FusedKernel<A, OP, GD, CopyOut::kNone>::Run;
  t.step[int(OP)][GD][int(CopyOut::kFp32)] = &FusedKernel<A, OP, GD, CopyOut::kFp32>::Run;
  t.step[int(OP)][GD][int(CopyOut::kFp16)] = &FusedKernel<A, OP, GD, CopyOut::kFp16>::Run;
  t.step[int(OP)][GD][int(CopyOut::kBf16)] = &FusedKernel<A, OP, GD, CopyOut::kBf16>::Run;
  t.step_fold[int(OP)][GD][int(CopyOut::kNone)] =
      &FusedKernel<A, OP, GD, CopyOut::kNone, true>::Run;
  t.step_fold[int(OP)][GD][int(CopyOut::kFp32)] =
      &FusedKernel<A, OP, GD, CopyOut::kFp32, true>::Run;
  t.step_fold[int(OP)][GD][int(CopyOut::kFp16)] =
      &FusedKernel<A, OP, GD, CopyOut::kFp16, true>::Run;
  t.step_fold[int(OP)][GD][int(CopyOut::kBf16)] =
      &FusedKernel<A, OP, GD, CopyOut::kBf16, true>::Run;
}
template <class A, KernelOp OP>
constexpr void FillGrads(KernelTable& t) {
  FillCopies<A, OP, 0>(t);
  FillCopies<A, OP, 1>(t);
  FillCopies<A, OP, 2>(t);
}

template <class A>
KernelTable MakeTable(std::string_view isa) {
  KernelTable t{};
  t.isa = isa;
  t.lanes = BF<A>::size;
  {
    // (1 + 2^-12)^2 - (1 + 2^-11) is 2^-24 exactly; a multiply then an add
    // rounds the square to 1 + 2^-11 first and gives 0. Opaque inputs, so
    // the compiler cannot fold the probe; a build that let the compiler
    // contract MulAdd into an fma would show here (tests assert false).
    static volatile float opaque = 1.f + 0x1p-12f;
    const BF<A> x(opaque);
    const BF<A> r = MulAdd<A>(x, x, BF<A>(-(1.f + 0x1p-11f)));
    t.fused_fma = xsimd::all(r != BF<A>(0.f));
  }
  FillGrads<A, KernelOp::kAdam>(t);
  FillGrads<A, KernelOp::kAdamW>(t);
  FillGrads<A, KernelOp::kAdagrad>(t);
  FillGrads<A, KernelOp::kLion>(t);
  FillGrads<A, KernelOp::kRoofline>(t);
  FillCompact<A, StateFormat::kBf16, KernelOp::kAdam>(t);
  FillCompact<A, StateFormat::kBf16, KernelOp::kAdamW>(t);
  FillCompact<A, StateFormat::kBf16, KernelOp::kLion>(t);
  FillCompact<A, StateFormat::kBf16, KernelOp::kRoofline>(t);
  FillCompact<A, StateFormat::kBf16Master, KernelOp::kAdam>(t);
  FillCompact<A, StateFormat::kBf16Master, KernelOp::kAdamW>(t);
  FillCompact<A, StateFormat::kBf16Master, KernelOp::kRoofline>(t);
  FillCompact<A, StateFormat::kInt8, KernelOp::kAdam>(t);
  FillCompact<A, StateFormat::kInt8, KernelOp::kAdamW>(t);
  FillCompact<A, StateFormat::kInt8, KernelOp::kLion>(t);
  FillCompact<A, StateFormat::kInt8, KernelOp::kRoofline>(t);
  t.check[0] = &CheckKernel<A, 0>;
  t.check[1] = &CheckKernel<A, 1>;
  t.check[2] = &CheckKernel<A, 2>;
  t.accumulate[0] = &AccumulateKernel<A, 0>;
  t.accumulate[1] = &AccumulateKernel<A, 1>;
  t.accumulate[2] = &AccumulateKernel<A, 2>;
  t.accumulate_roofline[0] = &AccumulateRooflineKernel<A, 0>;
  t.accumulate_roofline[1] = &AccumulateRooflineKernel<A, 1>;
  t.accumulate_roofline[2] = &AccumulateRooflineKernel<A, 2>;
  t.f32_to_f16 = &ToHalfArray<A>;
  t.f32_to_bf16 = &ToBf16Array<A>;
  t.f16_to_f32 = &FromHalfArray<A, 1>;
  t.bf16_to_f32 = &FromHalfArray<A, 2>;
  t.quantize_q8[0] = &QuantizeQ8Array<A, false>;
  t.quantize_q8[1] = &QuantizeQ8Array<A, true>;
  t.dequantize_q8[0] = &DequantizeQ8Array<A, false>;
  t.dequantize_q8[1] = &DequantizeQ8Array<A, true>;
  t.to_bf16_stochastic = &StochasticBf16Array<A>;
  return t;
}

}  // namespace strata::cpu_adam::internal
