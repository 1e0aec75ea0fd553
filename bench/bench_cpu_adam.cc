// Google Benchmark microbenchmarks of the cpu_adam kernel variants, one
// thread, straight through the kernel tables (no thread pool): every usable
// ISA × optimizer × grad dtype × copy-out, at a cache-resident size (16K
// elements: compute bound) and a DRAM size (8M elements: memory bound),
// plus the roofline kernel and the plain scalar loop as baselines; and the
// compact state formats' kernels (Compact/<format>/...: AdamW and their
// roofline, fp32 grads, no copy-out) at the same two sizes.
//   build-adam/bench/bench_cpu_adam --benchmark_filter='AdamW/.*bf16.*'
//   build-adam/bench/bench_cpu_adam --benchmark_filter='Compact/int8/.*'
// The end-to-end, multi-threaded comparison is `strata bench adam`.
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "src/common/aligned_buffer.h"
#include "src/common/half.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/cpu_adam/kernel.h"

namespace strata::cpu_adam::internal {
namespace {

struct Buffers {
  AlignedBuffer p, g, m, v, c;
  explicit Buffers(size_t n) {
    p = std::move(*AlignedBuffer::Allocate(n * 4));
    g = std::move(*AlignedBuffer::Allocate(n * 4));
    m = std::move(*AlignedBuffer::Allocate(n * 4));
    v = std::move(*AlignedBuffer::Allocate(n * 4));
    c = std::move(*AlignedBuffer::Allocate(n * 4));
    for (size_t i = 0; i < n; ++i) {
      const float x = static_cast<float>((i * 2654435761u) % 1000 + 1) * 1e-3f;  // (0, 1]
      p.as<float>()[i] = x - 0.5f;
      m.as<float>()[i] = x * 0.01f;
      v.as<float>()[i] = x * 1e-4f;
      g.as<float>()[i] = 0.5f - x;
    }
  }
};

void BM_Kernel(benchmark::State& state, const KernelTable* table, KernelOp op, int gd, CopyOut co,
               size_t n, bool stream) {
  Buffers b(n);
  if (gd != 0) {  // gradients as 16-bit patterns
    auto* g16 = b.g.as<uint16_t>();
    for (size_t i = 0; i < n; ++i)
      g16[i] = gd == 1 ? FloatToHalfBits(0.25f - 0.5f * (i % 7) / 7.f)
                       : FloatToBf16Bits(0.25f - 0.5f * (i % 7) / 7.f);
  }
  KernelArgs a;
  a.param = b.p.as<float>();
  a.grad = b.g.data();
  a.state0 = b.m.as<float>();
  a.state1 = (op == KernelOp::kAdagrad || op == KernelOp::kLion) ? nullptr : b.v.as<float>();
  a.copy_out = co == CopyOut::kNone ? nullptr : b.c.data();
  a.n = n;
  a.c.neg_step = -1e-6f;
  a.c.grad_scale = 1e-3f;  // keeps the roofline kernel's adds from drifting far
  a.stream_copy = stream && co != CopyOut::kNone;
  const StepFn fn = table->step[static_cast<int>(op)][gd][static_cast<int>(co)];
  for (auto _ : state) {
    benchmark::DoNotOptimize(fn(a, false));
    benchmark::ClobberMemory();
  }
  const size_t states = (op == KernelOp::kAdagrad || op == KernelOp::kLion) ? 1 : 2;
  const size_t bytes = 8 + (gd == 0 ? 4 : 2) + states * 8 +
                       (co == CopyOut::kNone ? 0 : (co == CopyOut::kFp32 ? 4 : 2));
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * n));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * bytes));
}

// A compact format's kernel (KernelTable::compact): fp32 grads, no copy-out.
// The states start as valid codes of small moments (bf16 bits, or 8-bit
// codes with per-block scales).
void BM_Compact(benchmark::State& state, const KernelTable* table, StateFormat sf, KernelOp op,
                size_t n) {
  Buffers b(n);
  const bool int8 = sf == StateFormat::kInt8;
  AlignedBuffer pc = std::move(*AlignedBuffer::Allocate(n * 2));
  AlignedBuffer s0 = std::move(*AlignedBuffer::Allocate(n * 2));
  AlignedBuffer s1 = std::move(*AlignedBuffer::Allocate(n * 2));
  const size_t blocks = (n + kStateBlock - 1) / kStateBlock;
  std::vector<float> sc0(blocks), sc1(blocks);
  for (size_t i = 0; i < n; ++i) pc.as<uint16_t>()[i] = FloatToBf16Bits(b.p.as<float>()[i]);
  if (int8) {
    table->quantize_q8[0](b.m.as<float>(), n, s0.as<uint8_t>(), sc0.data());
    table->quantize_q8[1](b.v.as<float>(), n, s1.as<uint8_t>(), sc1.data());
  } else {
    table->f32_to_bf16(b.m.as<float>(), s0.as<uint16_t>(), n);
    table->f32_to_bf16(b.v.as<float>(), s1.as<uint16_t>(), n);
  }
  KernelArgs a;
  a.param = b.p.as<float>();
  a.param_c = pc.data();
  a.grad = b.g.data();
  a.state0_c = s0.data();
  a.state1_c = s1.data();
  a.scale0 = sc0.data();
  a.scale1 = sc1.data();
  a.n = n;
  a.c.neg_step = -1e-6f;
  a.c.grad_scale = 1e-3f;
  a.sr_key0 = 0x12345678u;
  a.sr_key1 = 0x9abcdef0u;
  const StepFn fn = table->compact[static_cast<int>(sf) - 1][static_cast<int>(op)][0];
  for (auto _ : state) {
    benchmark::DoNotOptimize(fn(a, false));
    benchmark::ClobberMemory();
  }
  // (The roofline kernel moves AdamW's arrays.)
  const double bytes = BytesPerElement(Algorithm::kAdamW, DType::kFp32, std::nullopt, sf);
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * n));
  state.SetBytesProcessed(
      static_cast<int64_t>(static_cast<double>(state.iterations() * n) * bytes));
}

const char* OpName(KernelOp op) {
  switch (op) {
    case KernelOp::kAdam:
      return "Adam";
    case KernelOp::kAdamW:
      return "AdamW";
    case KernelOp::kAdagrad:
      return "Adagrad";
    case KernelOp::kLion:
      return "Lion";
    case KernelOp::kRoofline:
      return "Roofline";
  }
  return "?";
}

int RegisterAll() {
  const char* gnames[] = {"fp32", "fp16", "bf16"};
  const char* cnames[] = {"none", "fp32", "fp16", "bf16"};
  for (const KernelTable* t : UsableTables()) {
    for (KernelOp op : {KernelOp::kAdamW, KernelOp::kAdam, KernelOp::kAdagrad, KernelOp::kLion,
                        KernelOp::kRoofline}) {
      for (int gd = 0; gd < 3; ++gd) {
        for (CopyOut co : {CopyOut::kNone, CopyOut::kFp16, CopyOut::kBf16}) {
          for (size_t n : {size_t{16} << 10, size_t{8} << 20}) {
            for (bool stream : {false, true}) {
              if (stream && (co == CopyOut::kNone || n < (size_t{1} << 20) || t->lanes == 1))
                continue;
              const std::string name = std::string(OpName(op)) + "/" + std::string(t->isa) +
                                       "/grad_" + gnames[gd] + "/copy_" +
                                       cnames[static_cast<int>(co)] + "/n_" + std::to_string(n) +
                                       (stream ? "/nt_copy" : "");
              benchmark::RegisterBenchmark(name.c_str(), BM_Kernel, t, op, gd, co, n, stream)
                  ->Unit(benchmark::kMicrosecond);
            }
          }
        }
      }
    }
  }
  for (const KernelTable* t : UsableTables()) {
    for (StateFormat sf : {StateFormat::kBf16, StateFormat::kBf16Master, StateFormat::kInt8}) {
      for (KernelOp op : {KernelOp::kAdamW, KernelOp::kRoofline}) {
        for (size_t n : {size_t{16} << 10, size_t{8} << 20}) {
          const std::string name = "Compact/" + std::string(StateFormatName(sf)) + "/" +
                                   OpName(op) + "/" + std::string(t->isa) + "/n_" +
                                   std::to_string(n);
          benchmark::RegisterBenchmark(name.c_str(), BM_Compact, t, sf, op, n)
              ->Unit(benchmark::kMicrosecond);
        }
      }
    }
  }
  return 0;
}

const int registered = RegisterAll();

}  // namespace
}  // namespace strata::cpu_adam::internal

BENCHMARK_MAIN();
