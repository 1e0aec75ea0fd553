// strata bench accumulate: gradient accumulation (acc[i] += float(grad[i]),
// fp32 accumulator, fp32/fp16/bf16 gradients) through CpuOptimizer::Accumulate.
// One run measures, interleaved and repeated (medians), on the same arrays:
//   (1) roofline: the same loads and stores with trivial integer arithmetic
//       (Options::roofline_kernel; acc keeps its bits) — the memory bound;
//   (2) strata:   the SIMD kernel chosen at run time on the arena's threads;
//   (3) scalar:   the plain one-element-at-a-time loop on the same threads;
//   (4) scalar, 1 thread: the plain loop on one thread (what the scheduler's
//       gradient worker did before this kernel).
// Bytes per element: acc 4r + 4w + grad 4r (fp32) or 2r (fp16/bf16).
// The fraction of the roofline is measured in pairs (MeasurePairs in
// bench_stats.h): the roofline and the kernel back to back on each slab,
// the median of the pairs' fractions with their spread.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/strata/bench_optimizers.h"
#include "apps/strata/bench_stats.h"
#include "apps/strata/commands.h"
#include "src/common/aligned_buffer.h"
#include "src/common/half.h"
#include "src/common/host_memory.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/common/units.h"
#include "src/cpu_adam/cpu_adam.h"

namespace strata::cli {
namespace {

using nlohmann::json;

struct BenchAccumulateArgs {
  std::string params = "100000000";
  int threads = 0;
  std::string grad_dtype = "bf16";
  std::string isa = "auto";
  int reps = 9;
  bool json = false;
};

constexpr char kCommand[] = "bench accumulate";

int RunBenchAccumulate(const BenchAccumulateArgs& args) {
  int64_t count = 0;
  if (!ParseCount(args.params, &count) || count < 1 || count > 4'000'000'000)
    return Fail(kCommand,
                "--params: \"" + args.params +
                    "\" is not a whole number of elements in [1, 4e9] (e.g. 1e8, 100M, 1.5B)");
  const size_t n = static_cast<size_t>(count);
  if (args.reps < 1) return Fail(kCommand, "--reps must be at least 1");
  const DType gd = *ParseDType(args.grad_dtype);  // CLI checked membership
  // Before allocating: the accumulator and the gradients must fit.
  const uint64_t per_elem = 4 + DTypeSize(gd);
  if (Status s = CheckHostMemory("--params " + std::to_string(n) + " (" + std::to_string(per_elem) +
                                     " bytes/element of arrays)",
                                 per_elem * n);
      !s.ok())
    return Fail(kCommand, s);

  cpu_adam::Options base;
  base.threads = args.threads;
  base.isa = args.isa;
  auto opts = CreateBenchOptimizers(base);
  if (!opts.ok()) return Fail(kCommand, opts.status());
  auto* const strata_opt = &opts->strata;
  auto* const roof_opt = &opts->roofline;
  auto* const scalar_opt = &opts->scalar;
  cpu_adam::Options so = base;
  so.isa = "scalar";
  so.threads = 1;
  auto scalar1_opt = cpu_adam::CpuOptimizer::Create(so);
  if (!scalar1_opt.ok()) return Fail(kCommand, scalar1_opt.status());

  // One accumulator and one gradient array for every variant: where an array
  // sits in memory changes its bandwidth on a VM (docs/perf.md, "cpu_adam").
  auto acc = AlignedBuffer::Allocate(n * 4, 64);
  if (!acc.ok())
    return Fail(kCommand, Status(acc.status()).WithContext("allocating the accumulator"));
  auto grad = AlignedBuffer::Allocate(n * DTypeSize(gd), 64);
  if (!grad.ok())
    return Fail(kCommand, Status(grad.status()).WithContext("allocating the gradients"));
  float* a = acc->as<float>();
  for (size_t i = 0; i < n; ++i) {
    a[i] = Hash01(i, 1) - 0.5f;
    const float g = (Hash01(i, 4) - 0.5f) * 0.1f;
    if (gd == DType::kFp32)
      grad->as<float>()[i] = g;
    else
      grad->as<uint16_t>()[i] = gd == DType::kFp16 ? FloatToHalfBits(g) : FloatToBf16Bits(g);
  }

  auto run_range = [&](cpu_adam::CpuOptimizer& o, size_t begin, size_t end) {
    Stopwatch sw;
    Status st = o.Accumulate(
        a + begin, static_cast<const char*>(grad->data()) + begin * DTypeSize(gd), gd, end - begin);
    const double s = sw.Seconds();
    if (!st.ok()) {
      std::fprintf(stderr, "strata bench accumulate: %s\n", st.ToString().c_str());
      std::exit(ExitCodeOf(st));
    }
    return s;
  };
  auto run = [&](cpu_adam::CpuOptimizer& o) { return run_range(o, 0, n); };
  cpu_adam::CpuOptimizer* const variants[] = {roof_opt->get(), strata_opt->get(), scalar_opt->get(),
                                              scalar1_opt->get()};
  constexpr int kVariants = 4;
  for (cpu_adam::CpuOptimizer* o : variants) run(*o);  // warm-up: page faults, thread start
  const double load_before = LoadAverage();
  std::vector<double> t[kVariants];
  // The roofline and the kernel in pairs; the two scalar loops (not bounds)
  // once per repetition each, which one first alternating.
  const PairedBound pairs = MeasurePairs(
      n, args.reps, 1.0, [&](size_t b, size_t e) { return run_range(*variants[0], b, e); },
      [&](size_t b, size_t e) { return run_range(*variants[1], b, e); },
      [&](int r) {
        for (int k = 0; k < 2; ++k) {
          const int v = 2 + (r + k) % 2;
          t[v].push_back(run(*variants[v]));
        }
      });
  t[0] = pairs.bound_s;
  t[1] = pairs.measured_s;
  const double load_after = LoadAverage();
  const size_t bpe = cpu_adam::AccumulateBytesPerElement(gd);
  const double roof_eps = n / Median(t[0]);
  const double strata_eps = n / Median(t[1]);
  const double scalar_eps = n / Median(t[2]);
  const double scalar1_eps = n / Median(t[3]);
  const std::string formula =
      "acc 4r+4w + grad " + std::to_string(DTypeSize(gd)) + "r = " + std::to_string(bpe);
  json j;
  j["params"] = n;
  j["threads"] = (*strata_opt)->threads();
  j["isa"] = std::string((*strata_opt)->isa());
  j["grad_dtype"] = args.grad_dtype;
  j["reps"] = args.reps;
  j["bytes_per_element"] = bpe;
  j["bytes_per_element_formula"] = formula;
  j["elements_per_s"] = strata_eps;
  j["gbytes_per_s"] = strata_eps * bpe / 1e9;
  j["roofline_elements_per_s"] = roof_eps;
  j["roofline_gbytes_per_s"] = roof_eps * bpe / 1e9;
  pairs.AddTo(j);
  j["load_average"] = {load_before, load_after};
  j["scalar_elements_per_s"] = scalar_eps;
  j["scalar_gbytes_per_s"] = scalar_eps * bpe / 1e9;
  j["speedup_vs_scalar"] = strata_eps / scalar_eps;
  j["scalar_1thread_elements_per_s"] = scalar1_eps;
  j["speedup_vs_scalar_1thread"] = strata_eps / scalar1_eps;
  if (args.json) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf(
      "strata bench accumulate: %zu elements, %d threads, isa %s, grad %s, %d reps (medians), load "
      "%.2f-%.2f\n",
      n, (*strata_opt)->threads(), std::string((*strata_opt)->isa()).c_str(),
      args.grad_dtype.c_str(), args.reps, load_before, load_after);
  std::printf("  bytes/element     %s\n", formula.c_str());
  std::printf("  roofline          %8.1f Melem/s  %6.1f GB/s\n", roof_eps / 1e6,
              roof_eps * bpe / 1e9);
  std::printf("  scalar loop       %8.1f Melem/s  %6.1f GB/s\n", scalar_eps / 1e6,
              scalar_eps * bpe / 1e9);
  std::printf("  scalar, 1 thread  %8.1f Melem/s  %6.1f GB/s\n", scalar1_eps / 1e6,
              scalar1_eps * bpe / 1e9);
  std::printf(
      "  strata            %8.1f Melem/s  %6.1f GB/s  speedup_vs_scalar %.2f  vs 1-thread scalar "
      "%.2f\n",
      strata_eps / 1e6, strata_eps * bpe / 1e9, strata_eps / scalar_eps, strata_eps / scalar1_eps);
  pairs.Print("strata", args.reps);
  return 0;
}

CommandRegistrar reg("bench", [](CLI::App& bench, CliResult& r) {
  auto args = std::make_shared<BenchAccumulateArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "accumulate",
      "Benchmark gradient accumulation (fp32 += grad) against the roofline and a scalar loop");
  cmd->add_option("--params", args->params, "Elements, e.g. 100000000, 1e8, 100M or 1.5B")
      ->capture_default_str();
  cmd->add_option("--threads", args->threads, "Threads (0 = all PUs; at most the PUs)")
      ->capture_default_str()
      ->transform(ThreadCount());
  cmd->add_option("--grad-dtype", args->grad_dtype, "fp32|fp16|bf16")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}));
  cmd->add_option("--isa", args->isa, "auto|avx512|avx2|sse4.2|scalar")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "avx512", "avx2", "sse4.2", "scalar"}));
  cmd->add_option("--reps", args->reps, "Timed repetitions per variant (interleaved)")
      ->capture_default_str()
      ->transform(CountSuffix());
  cmd->add_flag("--json", args->json, "Machine-readable output");
  cmd->callback([args, &r] { r.exit_code = RunBenchAccumulate(*args); });
});

}  // namespace
}  // namespace strata::cli
