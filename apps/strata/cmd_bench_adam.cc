// strata bench adam: one run measures, interleaved and repeated (medians),
//   (1) roofline: the same loads and stores as the optimizer with trivial
//       arithmetic (Options::roofline_kernel) — the memory bound of the pattern;
//   (2) scalar:   the plain one-element-at-a-time loop on the same threads;
//   (3) strata:   the fused SIMD kernel chosen at run time;
//   (4) with a copy-out: fp32 grads, no copy, then a separate cast pass —
//       what an unfused mixed-precision step costs, for comparison.
// All variants run on the same arrays (placement in memory matters on a VM).
// --states picks the optimizer-state format (fp32, bf16, bf16-master, int8):
// the arrays are stored in it, and the roofline is that format's own
// roofline kernel (the same loads and stores as its Adam), so each format is
// compared to its own memory bound; bytes/param count the stored sizes.
// The unfused two-pass variant (a separate cast of an fp32 master) exists
// for fp32 state only.
//
// The fraction of the roofline is measured in pairs (MeasurePairs in
// bench_stats.h): roofline and optimizer back to back on each slab of the
// arrays, the median of the pairs' fractions with their spread.
#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
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

using cpu_adam::Algorithm;
using cpu_adam::StateFormat;
using nlohmann::json;

struct BenchAdamArgs {
  std::string params = "100000000";
  int threads = 0;
  std::string grad_dtype = "fp32";
  std::string copy_out = "none";
  std::string optimizer = "adamw";
  std::string states = "fp32";
  std::string isa = "auto";
  std::string streaming = "auto";
  int reps = 7;
  bool json = false;
};

constexpr char kCommand[] = "bench adam";

// Arrays for one variant, filled with deterministic non-zero pseudo-random
// values (fast enough for 100M elements, touched before timing).
// p, m, v stored in format `f` (int8 moments with their block scales sm, sv).
struct Arrays {
  StateFormat f = StateFormat::kFp32;
  AlignedBuffer p, g, m, v, c, sm, sv;
};

StatusOr<Arrays> MakeArrays(size_t n, DType gd, std::optional<DType> cd, StateFormat f) {
  using cpu_adam::StateElementBytes;
  using cpu_adam::StateRole;
  Arrays a;
  a.f = f;
  ASSIGN_OR_RETURN(a.p, AlignedBuffer::Allocate(n * StateElementBytes(f, StateRole::kParam), 64));
  ASSIGN_OR_RETURN(a.g, AlignedBuffer::Allocate(n * DTypeSize(gd), 64));
  const size_t sb = StateElementBytes(f, StateRole::kExpAvg);
  ASSIGN_OR_RETURN(a.m, AlignedBuffer::Allocate(n * sb, 64));
  ASSIGN_OR_RETURN(a.v, AlignedBuffer::Allocate(n * sb, 64));
  const size_t nsc = cpu_adam::StateScaleCount(f, StateRole::kExpAvg, n);
  if (nsc != 0) {
    ASSIGN_OR_RETURN(a.sm, AlignedBuffer::Allocate(nsc * 4, 64));
    ASSIGN_OR_RETURN(a.sv, AlignedBuffer::Allocate(nsc * 4, 64));
  }
  if (cd) {
    ASSIGN_OR_RETURN(a.c, AlignedBuffer::Allocate(n * DTypeSize(*cd), 64));
    std::memset(a.c.data(), 0, n * DTypeSize(*cd));
  }
  // Generated in fp32 chunk by chunk (a multiple of the int8 block), then
  // stored in the format.
  constexpr size_t kChunk = size_t{1} << 20;
  std::vector<float> p(std::min(n, kChunk)), m(p.size()), v(p.size());
  for (size_t lo = 0; lo < n; lo += kChunk) {
    const size_t len = std::min(kChunk, n - lo);
    for (size_t k = 0; k < len; ++k) {
      const size_t i = lo + k;
      p[k] = Hash01(i, 1) - 0.5f;
      m[k] = (Hash01(i, 2) - 0.5f) * 0.01f;
      v[k] = Hash01(i, 3) * 1e-4f;
      const float g = (Hash01(i, 4) - 0.5f) * 0.1f;
      if (gd == DType::kFp32)
        a.g.as<float>()[i] = g;
      else
        a.g.as<uint16_t>()[i] = gd == DType::kFp16 ? FloatToHalfBits(g) : FloatToBf16Bits(g);
    }
    const size_t blk = lo / cpu_adam::kStateBlock;
    RETURN_IF_ERROR(cpu_adam::EncodeState(
        f, StateRole::kParam, p.data(), len,
        a.p.as<char>() + lo * StateElementBytes(f, StateRole::kParam), nullptr));
    RETURN_IF_ERROR(cpu_adam::EncodeState(f, StateRole::kExpAvg, m.data(), len,
                                          a.m.as<char>() + lo * sb,
                                          nsc ? a.sm.as<float>() + blk : nullptr));
    RETURN_IF_ERROR(cpu_adam::EncodeState(f, StateRole::kExpAvgSq, v.data(), len,
                                          a.v.as<char>() + lo * sb,
                                          nsc ? a.sv.as<float>() + blk : nullptr));
  }
  return a;
}

cpu_adam::ShardStep MakeStep(Arrays& a, size_t n, DType gd, std::optional<DType> cd,
                             Algorithm alg) {
  cpu_adam::ShardStep s;
  s.states = a.f;
  s.grad = a.g.data();
  s.grad_dtype = gd;
  if (a.f == StateFormat::kFp32) {
    s.param = a.p.as<float>();
    s.exp_avg = a.m.as<float>();
    s.exp_avg_sq = a.v.as<float>();
    if (alg == Algorithm::kAdagrad) s.exp_avg = nullptr;
    if (alg == Algorithm::kLion) s.exp_avg_sq = nullptr;
  } else {
    if (a.f == StateFormat::kBf16Master) {
      s.param_c = a.p.data();
    } else {
      s.param = a.p.as<float>();
    }
    s.exp_avg_c = a.m.data();
    s.exp_avg_sq_c = a.v.data();
    if (a.f == StateFormat::kInt8) {
      s.exp_avg_scale = a.sm.as<float>();
      s.exp_avg_sq_scale = a.sv.as<float>();
    }
    if (alg == Algorithm::kLion) {
      s.exp_avg_sq_c = nullptr;
      s.exp_avg_sq_scale = nullptr;
    }
  }
  s.count = n;
  if (cd) {
    s.copy_out = a.c.data();
    s.copy_dtype = *cd;
  }
  s.hp.algorithm = alg;
  s.hp.weight_decay = 0.01;
  s.hp.step = 10;
  s.hp.grad_scale = 1.0 / 1024;
  return s;
}

// Elements [off, off + count) of s (off a multiple of kStateBlock for int8).
cpu_adam::ShardStep Slice(const cpu_adam::ShardStep& s, size_t off, size_t count) {
  using cpu_adam::StateElementBytes;
  using cpu_adam::StateRole;
  cpu_adam::ShardStep r = s;
  if (r.param) r.param += off;
  r.grad = static_cast<const char*>(s.grad) + off * DTypeSize(s.grad_dtype);
  if (r.exp_avg) r.exp_avg += off;
  if (r.exp_avg_sq) r.exp_avg_sq += off;
  const size_t sb = StateElementBytes(s.states, StateRole::kExpAvg);
  if (r.param_c) r.param_c = static_cast<char*>(r.param_c) + off * 2;
  if (r.exp_avg_c) r.exp_avg_c = static_cast<char*>(r.exp_avg_c) + off * sb;
  if (r.exp_avg_sq_c) r.exp_avg_sq_c = static_cast<char*>(r.exp_avg_sq_c) + off * sb;
  if (r.exp_avg_scale) r.exp_avg_scale += off / cpu_adam::kStateBlock;
  if (r.exp_avg_sq_scale) r.exp_avg_sq_scale += off / cpu_adam::kStateBlock;
  r.element_offset = s.element_offset + off;
  if (r.copy_out) r.copy_out = static_cast<char*>(s.copy_out) + off * DTypeSize(s.copy_dtype);
  r.count = count;
  return r;
}

// "param 4r+4w + grad 2r + exp_avg 1r+1w + exp_avg_sq 1r+1w + scales 0.0625r+0.0625w
// = 14.125": the bytes one step moves per param, array by array.
std::string BytesFormula(StateFormat f, DType gd, std::optional<DType> cd, bool two_states,
                         double bpp) {
  using cpu_adam::StateElementBytes;
  using cpu_adam::StateRole;
  auto rw = [](double b) {
    const std::string s = fmt::format("{:g}", b);
    return s + "r+" + s + "w";
  };
  const size_t pb = StateElementBytes(f, StateRole::kParam);
  const size_t sb = StateElementBytes(f, StateRole::kExpAvg);
  std::string out = "param " + rw(double(pb)) + " + grad " + std::to_string(DTypeSize(gd)) + "r + ";
  out += two_states ? "exp_avg " + rw(double(sb)) + " + exp_avg_sq " + rw(double(sb))
                    : "state " + rw(double(sb));
  if (f == StateFormat::kInt8)
    out += " + scales " + rw((two_states ? 2 : 1) * 4.0 / double(cpu_adam::kStateBlock));
  if (cd) out += " + copy " + std::to_string(DTypeSize(*cd)) + "w";
  return out + " = " + fmt::format("{:g}", bpp);
}

// Steps s, or exits with the step's error (a benchmark has nothing to
// recover).
void RunStepOrExit(cpu_adam::CpuOptimizer& o, const cpu_adam::ShardStep& s) {
  auto r = o.Step(s);
  if (!r.ok()) {
    std::fprintf(stderr, "strata bench adam: %s\n", r.status().ToString().c_str());
    std::exit(ExitCodeOf(r.status()));
  }
}

// Seconds fn() takes.
template <class Fn>
double TimeIt(Fn&& fn) {
  Stopwatch sw;
  fn();
  return sw.Seconds();
}

// What every run reports of itself: the optimizer, size, threads, ISA,
// dtypes and repetitions.
json RunFields(const BenchAdamArgs& args, size_t n, const cpu_adam::CpuOptimizer& o) {
  json j;
  j["optimizer"] = args.optimizer;
  j["params"] = n;
  j["threads"] = o.threads();
  j["isa"] = std::string(o.isa());
  j["grad_dtype"] = args.grad_dtype;
  j["copy_out"] = args.copy_out;
  j["reps"] = args.reps;
  return j;
}

// --states: one format, a comma-separated list, or "all" (every format the
// optimizer supports), in the order given; a list is measured interleaved.
StatusOr<std::vector<StateFormat>> ParseStatesList(const std::string& text, Algorithm alg,
                                                   const std::string& optimizer) {
  static constexpr char kAllowed[] =
      "fp32, bf16, bf16-master, int8, a comma-separated list of them, or all";
  static constexpr char kSupport[] =
      "Adam/AdamW: every format; Lion: fp32, bf16, int8; Adagrad: fp32";
  std::vector<StateFormat> out;
  if (text == "all") {
    for (StateFormat f :
         {StateFormat::kFp32, StateFormat::kBf16, StateFormat::kBf16Master, StateFormat::kInt8})
      if (cpu_adam::SupportsStateFormat(alg, f)) out.push_back(f);
    return out;
  }
  size_t b = 0;
  while (b <= text.size()) {
    size_t e = text.find(',', b);
    if (e == std::string::npos) e = text.size();
    const std::string name = text.substr(b, e - b);
    const auto f = cpu_adam::ParseStateFormat(name);
    if (!f)
      return InvalidArgumentError("--states: \"" + name + "\" is not a state format (" + kAllowed +
                                  ")");
    if (!cpu_adam::SupportsStateFormat(alg, *f))
      return InvalidArgumentError("--states " + name + " is not supported for --optimizer " +
                                  optimizer + " (" + kSupport + ")");
    if (std::find(out.begin(), out.end(), *f) != out.end())
      return InvalidArgumentError("--states lists " + name + " twice");
    out.push_back(*f);
    b = e + 1;
  }
  return out;
}

// One format's arrays, its optimizer and roofline steps, and its figures.
struct FormatRun {
  StateFormat f = StateFormat::kFp32;
  std::string name;
  Arrays arrays;
  cpu_adam::ShardStep roof_step, strata_step;
  double bpp = 0;       // bytes one step moves per param, at the stored sizes
  double roof_bpp = 0;  // the same for the roofline kernel (Adam's arrays)
  PairedBound pairs;
};

// Times the roofline and optimizer of `fr` in pairs, `reps` repetitions
// numbered from `first_rep`; `between(r)` after each (untimed comparisons).
template <class Between>
PairedBound MeasureFormat(FormatRun& fr, size_t n, int reps, cpu_adam::CpuOptimizer& strata_opt,
                          cpu_adam::CpuOptimizer& roof_opt, Between&& between, int first_rep) {
  // Slab bounds moved down to an int8 block boundary (a shard starts at a
  // block); the same function of the bound for both neighbours of a cut, so
  // the slabs still tile [0, n).
  const auto block_bound = [&](size_t x) {
    return x == n ? n : x / cpu_adam::kStateBlock * cpu_adam::kStateBlock;
  };
  // For Adagrad/Lion (fewer state bytes than the roofline's Adam pattern)
  // the roofline time is scaled to the optimizer's own bytes/param.
  return MeasurePairs(
      n, reps, fr.bpp / fr.roof_bpp,
      [&](size_t b, size_t e) {
        b = block_bound(b);
        e = block_bound(e);
        const auto rs = Slice(fr.roof_step, b, e - b);
        return TimeIt([&] { RunStepOrExit(roof_opt, rs); });
      },
      [&](size_t b, size_t e) {
        b = block_bound(b);
        e = block_bound(e);
        const auto ss = Slice(fr.strata_step, b, e - b);
        return TimeIt([&] { RunStepOrExit(strata_opt, ss); });
      },
      between, first_rep);
}

// The figures every format reports: rate, bytes, its roofline and the pairs.
// The roofline kernel moves Adam's arrays (28 bytes/param with fp32 grads);
// for Adagrad/Lion its bandwidth is converted to the params/s it would give
// at the optimizer's own bytes/param.
json FormatFigures(const FormatRun& fr, Algorithm alg, DType gd, std::optional<DType> cd,
                   size_t n) {
  const bool fp32_states = fr.f == StateFormat::kFp32;
  const double roof_adam_pps = n / Median(fr.pairs.bound_s);
  const double strata_pps = n / Median(fr.pairs.measured_s);
  const bool two_states = alg == Algorithm::kAdam || alg == Algorithm::kAdamW;
  json j;
  j["states"] = fr.name;
  j["state_bytes_per_param"] = cpu_adam::StateBytesPerParam(fr.f, alg);
  j["params_per_s"] = strata_pps;
  if (fp32_states) {
    j["bytes_per_param"] = static_cast<size_t>(fr.bpp);  // whole numbers, as before
  } else {
    j["bytes_per_param"] = fr.bpp;
  }
  j["bytes_per_param_formula"] = BytesFormula(fr.f, gd, cd, two_states, fr.bpp);
  j["gbytes_per_s"] = strata_pps * fr.bpp / 1e9;
  j["roofline_params_per_s"] = roof_adam_pps * fr.roof_bpp / fr.bpp;
  if (fp32_states) {
    j["roofline_bytes_per_param"] = static_cast<size_t>(fr.roof_bpp);
  } else {
    j["roofline_bytes_per_param"] = fr.roof_bpp;
  }
  j["roofline_gbytes_per_s"] = roof_adam_pps * fr.roof_bpp / 1e9;
  fr.pairs.AddTo(j);
  return j;
}

StatusOr<FormatRun> MakeFormatRun(StateFormat f, size_t n, DType gd, std::optional<DType> cd,
                                  Algorithm alg) {
  FormatRun fr;
  fr.f = f;
  fr.name = std::string(cpu_adam::StateFormatName(f));
  auto arrays = MakeArrays(n, gd, cd, f);
  if (!arrays.ok())
    return Status(arrays.status())
        .WithContext("allocating " + std::to_string(n) + " params of " + fr.name + " states");
  fr.arrays = std::move(*arrays);
  fr.roof_step = MakeStep(fr.arrays, n, gd, cd, Algorithm::kAdamW);
  fr.strata_step = MakeStep(fr.arrays, n, gd, cd, alg);
  // Bytes per param at the stored sizes (int8: with the block scales, so
  // not whole numbers); the roofline moves the format's Adam arrays.
  fr.bpp = cpu_adam::BytesPerElement(alg, gd, cd, f);
  fr.roof_bpp = cpu_adam::BytesPerElement(Algorithm::kAdamW, gd, cd, f);
  return fr;
}

// Several formats in one process: each keeps its own arrays; every
// repetition measures each format's pairs once, the formats' order rotating,
// so that drift in the machine's memory bandwidth reaches them alike. The
// rate of each against the first format listed is the median over the
// repetitions of that repetition's ratio. The scalar loop and the two-pass
// variant run only with one format.
int RunFormats(const BenchAdamArgs& args, std::vector<FormatRun> runs, size_t n, DType gd,
               std::optional<DType> cd, Algorithm alg, cpu_adam::CpuOptimizer& strata_opt,
               cpu_adam::CpuOptimizer& roof_opt) {
  const size_t k = runs.size();
  for (FormatRun& fr : runs) {  // warm-up: page faults, thread start
    RunStepOrExit(roof_opt, fr.roof_step);
    RunStepOrExit(strata_opt, fr.strata_step);
  }
  for (int r = 0; r < args.reps; ++r)
    for (size_t i = 0; i < k; ++i) {
      FormatRun& fr = runs[(i + static_cast<size_t>(r)) % k];
      fr.pairs.Append(MeasureFormat(
          fr, n, 1, strata_opt, roof_opt, [](int) {}, r));
    }
  json j = RunFields(args, n, strata_opt);
  j["states"] = args.states;
  j["baseline"] = runs[0].name;
  j["formats"] = json::array();
  PairedBound all;
  for (FormatRun& fr : runs) {
    json f = FormatFigures(fr, alg, gd, cd, n);
    std::vector<double> ratio;
    for (int r = 0; r < args.reps; ++r)
      ratio.push_back(runs[0].pairs.measured_s[r] / fr.pairs.measured_s[r]);
    f["speedup_vs_baseline"] = Quantile(ratio, 0.5);
    f["speedup_vs_baseline_p25"] = Quantile(ratio, 0.25);
    f["speedup_vs_baseline_p75"] = Quantile(ratio, 0.75);
    j["formats"].push_back(f);
    all.Append(fr.pairs);
  }
  j["load_average"] = LoadAverage();
  j["involuntary_context_switches_per_s"] = all.switches_per_s();
  j["cores_contended"] = all.contended();
  if (args.json) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf(
      "strata bench adam: %s, %zu params, %d threads, isa %s, grad %s, copy-out %s, states %s "
      "interleaved, %d reps (medians; of roofline: of the format's own roofline kernel, median "
      "of pairs)\n",
      args.optimizer.c_str(), n, strata_opt.threads(), std::string(strata_opt.isa()).c_str(),
      args.grad_dtype.c_str(), args.copy_out.c_str(), args.states.c_str(), args.reps);
  std::printf("  %-12s %11s %10s %7s %10s %12s  %s (p25-p75)\n", "states", "bytes/param",
              "Mparams/s", "GB/s", "roofline", "of roofline", ("vs " + runs[0].name).c_str());
  for (const json& f : j["formats"]) {
    std::printf("  %-12s %11.3f %10.1f %7.1f %10.1f %12.3f  %.2f (%.2f-%.2f)\n",
                f["states"].get<std::string>().c_str(), f["bytes_per_param"].get<double>(),
                f["params_per_s"].get<double>() / 1e6, f["gbytes_per_s"].get<double>(),
                f["roofline_params_per_s"].get<double>() / 1e6,
                f["roofline_fraction"].get<double>(), f["speedup_vs_baseline"].get<double>(),
                f["speedup_vs_baseline_p25"].get<double>(),
                f["speedup_vs_baseline_p75"].get<double>());
  }
  std::printf("  machine      load average %.2f, %.0f involuntary context switches/s%s\n",
              LoadAverage(), all.switches_per_s(),
              all.contended() ? ": the threads did not own their cores, so the rates measure "
                                "the scheduler, not memory"
                              : "");
  return 0;
}

int RunBenchAdam(const BenchAdamArgs& args) {
  int64_t count = 0;
  if (!ParseCount(args.params, &count) || count < 1 || count > 4'000'000'000)
    return Fail(kCommand,
                "--params: \"" + args.params +
                    "\" is not a whole number of parameters in [1, 4e9] (e.g. 1e8, 100M, 1.5B)");
  const size_t n = static_cast<size_t>(count);
  if (args.reps < 1) return Fail(kCommand, "--reps must be at least 1");
  const DType gd = *ParseDType(args.grad_dtype);  // CLI checked membership
  std::optional<DType> cd;
  if (args.copy_out != "none") cd = *ParseDType(args.copy_out);
  const Algorithm alg = *cpu_adam::ParseAlgorithm(args.optimizer);
  const auto formats = ParseStatesList(args.states, alg, args.optimizer);
  if (!formats.ok()) return Fail(kCommand, formats.status());
  const StateFormat states = formats->front();
  const bool fp32_states = states == StateFormat::kFp32;
  const bool single = formats->size() == 1;
  // Before allocating: param, grad, exp_avg, exp_avg_sq (and the copy-out,
  // and fp32 grads for the unfused variant) of every format must fit in
  // memory together.
  {
    uint64_t per_param = 0;
    for (StateFormat f : *formats) {
      per_param +=
          static_cast<uint64_t>(std::ceil(cpu_adam::StateBytesPerParam(f))) + DTypeSize(gd);
      if (cd) per_param += DTypeSize(*cd) + (single && gd != DType::kFp32 && fp32_states ? 4 : 0);
    }
    const uint64_t bytes = per_param * n;
    if (Status s = CheckHostMemory("--params " + std::to_string(n) + " (" +
                                       std::to_string(per_param) + " bytes/param of arrays)",
                                   bytes);
        !s.ok())
      return Fail(kCommand, s);
  }
  cpu_adam::StreamingStores ss = cpu_adam::StreamingStores::kAuto;
  if (args.streaming == "off") ss = cpu_adam::StreamingStores::kOff;
  if (args.streaming == "copy") ss = cpu_adam::StreamingStores::kCopyOut;
  if (args.streaming == "all") ss = cpu_adam::StreamingStores::kAll;

  cpu_adam::Options base;
  base.threads = args.threads;
  base.isa = args.isa;
  base.streaming_stores = ss;
  auto opts = CreateBenchOptimizers(base);
  if (!opts.ok()) return Fail(kCommand, opts.status());
  auto* const strata_opt = &opts->strata;
  auto* const roof_opt = &opts->roofline;
  auto* const scalar_opt = &opts->scalar;

  std::vector<FormatRun> runs;
  for (StateFormat f : *formats) {
    auto fr = MakeFormatRun(f, n, gd, cd, alg);
    if (!fr.ok()) return Fail(kCommand, fr.status());
    runs.push_back(std::move(*fr));
  }
  if (!single) return RunFormats(args, std::move(runs), n, gd, cd, alg, **strata_opt, **roof_opt);

  // One format: all variants step the SAME arrays: where an array sits in
  // memory changed its bandwidth by up to 25% on the 2-core VM of
  // docs/perf.md, so separate arrays per variant would bias the comparison.
  // The roofline kernel leaves finite values unchanged; the optimizer steps
  // keep them finite.
  FormatRun& fr = runs.front();
  // The unfused variant needs fp32 gradients (its own array when grads are 16-bit).
  AlignedBuffer grad32;
  const bool two_pass = cd.has_value() && fp32_states;
  if (two_pass && gd != DType::kFp32) {
    auto g = AlignedBuffer::Allocate(n * 4, 64);
    if (!g.ok()) return Fail(kCommand, g.status());
    grad32 = std::move(*g);
    for (size_t i = 0; i < n; ++i) grad32.as<float>()[i] = (Hash01(i, 4) - 0.5f) * 0.1f;
  }
  const auto scalar_step = MakeStep(fr.arrays, n, gd, cd, alg);
  cpu_adam::ShardStep two_step;
  if (two_pass) {
    two_step = MakeStep(fr.arrays, n, DType::kFp32, std::nullopt, alg);
    if (gd != DType::kFp32) two_step.grad = grad32.data();
  }
  auto run_two_pass = [&] {
    RunStepOrExit(**strata_opt, two_step);
    Status st = (*strata_opt)->Cast(two_step.param, fr.arrays.c.data(), *cd, n);
    if (!st.ok()) {
      std::fprintf(stderr, "strata bench adam: %s\n", st.ToString().c_str());
      std::exit(ExitCodeOf(st));
    }
  };
  // Warm-up (page faults, thread start), then interleaved repetitions.
  RunStepOrExit(**roof_opt, fr.roof_step);
  RunStepOrExit(**scalar_opt, scalar_step);
  RunStepOrExit(**strata_opt, fr.strata_step);
  if (two_pass) run_two_pass();
  std::vector<double> t_scalar, t_two;
  fr.pairs = MeasureFormat(
      fr, n, args.reps, **strata_opt, **roof_opt,
      [&](int r) {
        // The comparisons that are not bounds: once per repetition each, on
        // the whole arrays, which one first alternating.
        const auto time_scalar = [&] {
          t_scalar.push_back(TimeIt([&] { RunStepOrExit(**scalar_opt, scalar_step); }));
        };
        if (r % 2 == 0 || !two_pass) time_scalar();
        if (two_pass) t_two.push_back(TimeIt(run_two_pass));
        if (r % 2 == 1 && two_pass) time_scalar();
      },
      0);
  json j = RunFields(args, n, **strata_opt);
  j["streaming_stores"] = (*strata_opt)->streams_state()
                              ? "all"
                              : ((*strata_opt)->streams_copy() && cd ? "copy" : "off");
  j.update(FormatFigures(fr, alg, gd, cd, n));
  const double strata_pps = j["params_per_s"].get<double>();
  const double scalar_pps = n / Median(t_scalar);
  j["scalar_params_per_s"] = scalar_pps;
  j["speedup_vs_scalar"] = strata_pps / scalar_pps;
  if (two_pass) {
    const size_t two_bpp =
        cpu_adam::BytesPerElement(alg, DType::kFp32, std::nullopt) + 4 + DTypeSize(*cd);
    const double two_pps = n / Median(t_two);
    j["two_pass_bytes_per_param"] = two_bpp;
    j["two_pass_formula"] = "step with fp32 grads " + std::to_string(two_bpp - 4 - DTypeSize(*cd)) +
                            " + cast pass 4r+" + std::to_string(DTypeSize(*cd)) +
                            "w = " + std::to_string(two_bpp);
    j["two_pass_params_per_s"] = two_pps;
    j["fused_speedup_vs_two_pass"] = strata_pps / two_pps;
  }
  if (args.json) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf(
      "strata bench adam: %s, %zu params, %d threads, isa %s, grad %s, copy-out %s, states %s, "
      "%d reps (medians)\n",
      args.optimizer.c_str(), n, (*strata_opt)->threads(),
      std::string((*strata_opt)->isa()).c_str(), args.grad_dtype.c_str(), args.copy_out.c_str(),
      args.states.c_str(), args.reps);
  std::printf("  bytes/param     %s\n", j["bytes_per_param_formula"].get<std::string>().c_str());
  std::printf("  roofline        %8.1f Mparams/s  %6.1f GB/s\n",
              j["roofline_params_per_s"].get<double>() / 1e6,
              j["roofline_gbytes_per_s"].get<double>());
  std::printf("  scalar loop     %8.1f Mparams/s  %6.1f GB/s\n", scalar_pps / 1e6,
              scalar_pps * fr.bpp / 1e9);
  std::printf("  strata          %8.1f Mparams/s  %6.1f GB/s  speedup_vs_scalar %.2f\n",
              strata_pps / 1e6, strata_pps * fr.bpp / 1e9, strata_pps / scalar_pps);
  fr.pairs.Print("strata", args.reps);
  if (two_pass) {
    std::printf("  two-pass        %8.1f Mparams/s  (%s)  fused is %.2fx faster\n",
                j["two_pass_params_per_s"].get<double>() / 1e6,
                j["two_pass_formula"].get<std::string>().c_str(),
                j["fused_speedup_vs_two_pass"].get<double>());
  }
  return 0;
}

CommandRegistrar reg("bench", [](CLI::App& bench, CliResult& r) {
  auto args = std::make_shared<BenchAdamArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "adam", "Benchmark the fused CPU optimizer against the roofline and a scalar loop");
  cmd->add_option("--params", args->params,
                  "Parameters (elements), e.g. 100000000, 1e8, 100M or 1.5B")
      ->capture_default_str();
  cmd->add_option("--threads", args->threads, "Threads (0 = all PUs; at most the PUs)")
      ->capture_default_str()
      ->transform(ThreadCount());
  cmd->add_option("--grad-dtype", args->grad_dtype, "fp32|fp16|bf16")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}));
  cmd->add_option("--copy-out", args->copy_out, "none|fp16|bf16|fp32")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "fp16", "bf16", "fp32"}));
  cmd->add_option("--optimizer", args->optimizer, "adam|adamw|adagrad|lion")
      ->capture_default_str()
      ->check(CLI::IsMember({"adam", "adamw", "adagrad", "lion"}));
  cmd->add_option("--states", args->states,
                  "Optimizer-state format: fp32|bf16|bf16-master|int8, each compared to its own "
                  "roofline; a comma-separated list (or all) measures them interleaved, with "
                  "each one's rate against the first")
      ->capture_default_str();
  cmd->add_option("--isa", args->isa, "auto|avx512|avx2|sse4.2|scalar")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "avx512", "avx2", "sse4.2", "scalar"}));
  cmd->add_option("--streaming", args->streaming, "Non-temporal stores: auto|off|copy|all")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "off", "copy", "all"}));
  cmd->add_option("--reps", args->reps, "Timed repetitions per variant (interleaved)")
      ->capture_default_str()
      ->transform(CountSuffix());
  cmd->add_flag("--json", args->json, "Machine-readable output");
  cmd->callback([args, &r] { r.exit_code = RunBenchAdam(*args); });
});

}  // namespace
}  // namespace strata::cli
