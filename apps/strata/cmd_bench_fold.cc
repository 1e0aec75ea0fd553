// strata bench fold: what folding the window's last micro-batch into the
// optimizer saves on the CPU, per window, for AdamW with bf16 gradients and
// a bf16 copy-out (the engine's usual case). Interleaved and repeated
// (medians), on the same arrays:
//   accumulate:  Accumulate(acc, g) — the worker's pass over the last
//                micro-batch — then StepMany with grad = acc (fp32), then
//                the accumulator zeroed (as the step's sub-groups are);
//   fold:        StepMany with ShardStep::fold (acc + g in the optimizer's
//                pass), then the accumulator zeroed.
// With --micro-batches 1 the accumulator holds nothing before the last
// micro-batch: the fold reads no accumulator (0 + g) and zeroes nothing.
// Bytes per element: accumulate 10 + step 30 + zero 4 = 44; fold with an
// accumulator 32 + 4 = 36, without one 28.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

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

struct BenchFoldArgs {
  std::string params = "50000000";
  int threads = 0;
  int micro_batches = 2;
  int reps = 7;
  bool json = false;
};

constexpr char kCommand[] = "bench fold";

void Check(const Status& s) {
  if (s.ok()) return;
  std::fprintf(stderr, "strata bench fold: %s\n", s.ToString().c_str());
  std::exit(ExitCodeOf(s));
}

int RunBenchFold(const BenchFoldArgs& args) {
  int64_t count = 0;
  if (!ParseCount(args.params, &count) || count < 1 || count > 2'000'000'000)
    return Fail(kCommand,
                "--params: \"" + args.params + "\" is not a whole number of elements in [1, 2e9]");
  if (args.reps < 1) return Fail(kCommand, "--reps must be at least 1");
  if (args.micro_batches < 1) return Fail(kCommand, "--micro-batches must be at least 1");
  const size_t n = static_cast<size_t>(count);
  // master, m, v, acc (fp32), grad and copy (bf16).
  if (Status s = CheckHostMemory("--params " + std::to_string(n) + " (20 bytes/element)", 20 * n);
      !s.ok())
    return Fail(kCommand, s);
  cpu_adam::Options o;
  o.threads = args.threads;
  auto opt = cpu_adam::CpuOptimizer::Create(o);
  if (!opt.ok()) return Fail(kCommand, opt.status());

  std::vector<AlignedBuffer> bufs;
  for (size_t bytes : {4 * n, 4 * n, 4 * n, 4 * n, 2 * n, 2 * n}) {
    auto b = AlignedBuffer::Allocate(bytes, 64);
    if (!b.ok()) return Fail(kCommand, b.status());
    bufs.push_back(std::move(*b));
  }
  float* master = bufs[0].as<float>();
  float* m = bufs[1].as<float>();
  float* v = bufs[2].as<float>();
  float* acc = bufs[3].as<float>();
  uint16_t* grad = bufs[4].as<uint16_t>();
  uint16_t* copy = bufs[5].as<uint16_t>();
  for (size_t i = 0; i < n; ++i) {
    master[i] = static_cast<float>(i % 1000) * 1e-3f - 0.5f;
    m[i] = 0.f;
    v[i] = 1e-4f;
    acc[i] = 0.f;
    grad[i] = FloatToBf16Bits(static_cast<float>(i % 7) * 1e-3f - 3e-3f);
    copy[i] = 0;
  }
  const bool with_acc = args.micro_batches > 1;
  cpu_adam::ShardStep s;
  s.param = master;
  s.exp_avg = m;
  s.exp_avg_sq = v;
  s.count = n;
  s.copy_out = copy;
  s.copy_dtype = DType::kBf16;
  s.hp.weight_decay = 0.01;
  // The plain path: accumulate the last micro-batch, step on the sum, zero.
  auto accumulate = [&] {
    Stopwatch sw;
    Check(opt->get()->Accumulate(acc, grad, DType::kBf16, n));
    cpu_adam::ShardStep st = s;
    st.grad = acc;
    st.grad_dtype = DType::kFp32;
    Check(opt->get()->Step(st).status());
    std::memset(acc, 0, n * 4);
    return sw.Seconds();
  };
  // The fold: one pass reading acc (if any) and the last micro-batch.
  auto fold = [&] {
    Stopwatch sw;
    cpu_adam::ShardStep st = s;
    st.grad = grad;
    st.grad_dtype = DType::kBf16;
    st.fold = true;
    st.fold_acc = with_acc ? acc : nullptr;
    Check(opt->get()->Step(st).status());
    if (with_acc) std::memset(acc, 0, n * 4);
    return sw.Seconds();
  };
  accumulate();  // warm-up: page faults, threads
  fold();
  const double load_before = LoadAverage();
  std::vector<double> ta, tf;
  for (int r = 0; r < args.reps; ++r) {
    if (r % 2 == 0) {
      ta.push_back(accumulate());
      tf.push_back(fold());
    } else {
      tf.push_back(fold());
      ta.push_back(accumulate());
    }
  }
  const double load_after = LoadAverage();
  const double a = Median(ta), f = Median(tf);
  const int bytes_acc = 44, bytes_fold = with_acc ? 36 : 28;
  json j;
  j["params"] = n;
  j["threads"] = opt->get()->threads();
  j["isa"] = std::string(opt->get()->isa());
  j["micro_batches"] = args.micro_batches;
  j["reps"] = args.reps;
  j["load_average"] = {load_before, load_after};
  j["accumulate_s"] = a;
  j["fold_s"] = f;
  j["fold_over_accumulate"] = f / a;
  j["accumulate_bytes_per_element"] = bytes_acc;
  j["fold_bytes_per_element"] = bytes_fold;
  if (args.json) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf(
      "strata bench fold: %zu elements, AdamW bf16 grads -> bf16 copy, %d micro-batch(es), %d "
      "threads, isa %s, %d reps (medians), load %.2f-%.2f\n",
      n, args.micro_batches, opt->get()->threads(), std::string(opt->get()->isa()).c_str(),
      args.reps, load_before, load_after);
  std::printf("  accumulate + step + zero  %8.4f s  %2d B/element  %6.1f GB/s\n", a, bytes_acc,
              static_cast<double>(n) * bytes_acc / a * 1e-9);
  std::printf("  fold step%s  %8.4f s  %2d B/element  %6.1f GB/s\n",
              with_acc ? " + zero       " : " (no acc)     ", f, bytes_fold,
              static_cast<double>(n) * bytes_fold / f * 1e-9);
  std::printf("  fold / accumulate         %8.3f\n", f / a);
  return 0;
}

CommandRegistrar reg("bench", [](CLI::App& bench, CliResult& r) {
  auto args = std::make_shared<BenchFoldArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "fold",
      "Benchmark the window's last micro-batch folded into the optimizer vs accumulated first");
  cmd->add_option("--params", args->params, "Elements, e.g. 50000000, 5e7, 50M")
      ->capture_default_str();
  cmd->add_option("--threads", args->threads, "Threads (0 = all PUs; at most the PUs)")
      ->capture_default_str()
      ->transform(ThreadCount());
  cmd->add_option("--micro-batches", args->micro_batches,
                  "gradient_accumulation_steps (1: no accumulator to read)")
      ->capture_default_str();
  cmd->add_option("--reps", args->reps, "Timed repetitions per variant (interleaved)")
      ->capture_default_str()
      ->transform(CountSuffix());
  cmd->add_flag("--json", args->json, "Machine-readable output");
  cmd->callback([args, &r] { r.exit_code = RunBenchFold(*args); });
});

}  // namespace
}  // namespace strata::cli
