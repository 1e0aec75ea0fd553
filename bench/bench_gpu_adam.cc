// bench_gpu_adam: throughput of Device::AdamStep (the fused multi-tensor
// Adam/AdamW for `offload_optimizer: none`) as a fraction of HBM bandwidth.
//
//   build/bench/bench_gpu_adam [--device cuda|host] [--params N] [--tensors T]
//       [--grad-dtype fp32|fp16|bf16] [--copy-out none|fp16|bf16]
//       [--states fp32|bf16|bf16-master|int8] [--reps R] [--peak-gbs P] [--json]
//
// --states is the state format (strata.optimizer_states in HBM): fp32, bf16
// moments, a bf16 master with bf16 moments, or int8 moments with one fp32
// scale per 256 elements (--moments fp32|bf16 is the older spelling).
//
// Times R steps with timing events on the compute stream (median per step)
// and reports bytes moved per step / time (AdamBytesPerElement × N), against
// the same device's CopyD2D bandwidth over a buffer of the same traffic (read
// + write; the achievable roofline) and, with --peak-gbs, the nominal peak
// (H100 SXM5 HBM3: 3350 GB/s). Without a GPU and with --device cuda it says
// so and exits 0; --device host measures the host reference (labelled).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "src/gpu/device.h"

namespace {

using namespace strata;

[[noreturn]] void Usage(const char* why) {
  std::fprintf(stderr,
               "bench_gpu_adam: %s\nusage: bench_gpu_adam [--device cuda|host] [--params N] "
               "[--tensors T] [--grad-dtype fp32|fp16|bf16] [--copy-out none|fp16|bf16] "
               "[--states fp32|bf16|bf16-master|int8] [--reps R] [--peak-gbs P] [--json]\n",
               why);
  std::exit(2);
}

bool ParseDType(const std::string& s, DType* t) {
  if (s == "fp32")
    *t = DType::kFp32;
  else if (s == "fp16")
    *t = DType::kFp16;
  else if (s == "bf16")
    *t = DType::kBf16;
  else
    return false;
  return true;
}

template <typename T>
T Value(StatusOr<T> v, const char* what) {
  return bench::ValueOrExit(std::move(v), "bench_gpu_adam", what);
}

// Median over `reps` of the seconds `work` takes on the compute stream.
template <typename Work>
double TimeMedian(gpu::Device& d, int reps, Work work) {
  auto t0 = Value(d.CreateEvent({.timing = true}), "CreateEvent");
  auto t1 = Value(d.CreateEvent({.timing = true}), "CreateEvent");
  std::vector<double> s;
  for (int r = 0; r < reps; ++r) {
    BENCH_CHECK_OK(d.compute().Record(*t0));
    work();
    BENCH_CHECK_OK(d.compute().Record(*t1));
    BENCH_CHECK_OK(t1->Synchronize());
    s.push_back(Value(d.ElapsedSeconds(*t0, *t1), "ElapsedSeconds"));
  }
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string kind = "cuda";
  size_t params = size_t{256} << 20, tensors = 64;
  int reps = 20;
  double peak_gbs = 0;
  bool json = false, copy = false;
  std::string states = "fp32";
  DType grad = DType::kBf16, copy_dtype = DType::kBf16;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) Usage(("missing value for " + a).c_str());
      return argv[++i];
    };
    if (a == "--device")
      kind = next();
    else if (a == "--params")
      params = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--tensors")
      tensors = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--reps")
      reps = std::atoi(next().c_str());
    else if (a == "--peak-gbs")
      peak_gbs = std::atof(next().c_str());
    else if (a == "--json")
      json = true;
    else if (a == "--grad-dtype") {
      if (!ParseDType(next(), &grad)) Usage("--grad-dtype: fp32, fp16 or bf16");
    } else if (a == "--moments" || a == "--states") {
      states = next();
      if (states != "fp32" && states != "bf16" && states != "bf16-master" && states != "int8")
        Usage("--states: fp32, bf16, bf16-master or int8");
    } else if (a == "--copy-out") {
      const std::string c = next();
      copy = c != "none";
      if (copy && (!ParseDType(c, &copy_dtype) || copy_dtype == DType::kFp32))
        Usage("--copy-out: none, fp16 or bf16");
    } else {
      Usage(("unknown argument " + a).c_str());
    }
  }
  if ((kind != "cuda" && kind != "host") || params == 0 || tensors == 0 || tensors > params ||
      reps < 1)
    Usage("bad arguments");

  // Arrays: param, m, v (fp32), grad, copy; one allocation each, tensors cut
  // from them at 256-byte boundaries (as the engine's arena places them).
  const size_t per = (params + tensors - 1) / tensors;
  // Elements; keeps every tensor 256-byte aligned and on an int8 block.
  const size_t stride = (per + 255) / 256 * 256;
  const size_t n_alloc = stride * tensors;
  const size_t gs = DTypeSize(grad), cs = copy ? DTypeSize(copy_dtype) : 0;
  gpu::DeviceOptions o;
  o.kind = kind == "host" ? DeviceKind::kHost : DeviceKind::kCuda;
  const bool master16 = states == "bf16-master", int8 = states == "int8";
  const bool bf16_moments = states == "bf16" || master16;
  const size_t ms = bf16_moments ? 2 : int8 ? 1 : 4;  // bytes a moment
  const size_t ps = master16 ? 2 : 4;                 // bytes a master
  const size_t nscales = (n_alloc + 255) / 256;
  o.hbm_budget_bytes =
      n_alloc * (2 * ps + 2 * ms + gs + cs) + 8 * nscales + (size_t{64} << 20);  // (+ the copy's)
  auto dev = gpu::CreateDevice(o);
  if (!dev.ok()) {
    std::printf("bench_gpu_adam: %s\n", dev.status().ToString().c_str());
    // No GPU here: nothing to measure. A GPU that is present but unusable
    // (FailedPrecondition, e.g. a driver older than the runtime) is a failure.
    const StatusCode code = dev.status().code();
    return kind == "cuda" && (code == StatusCode::kUnavailable || code == StatusCode::kNotSupported)
               ? 0
               : 1;
  }
  gpu::Device& d = **dev;
  auto p = Value(d.Allocate(n_alloc * ps), "param");
  auto m = Value(d.Allocate(n_alloc * ms), "exp_avg");
  auto v = Value(d.Allocate(n_alloc * ms), "exp_avg_sq");
  auto g = Value(d.Allocate(n_alloc * gs), "grad");
  gpu::DeviceBuffer c;
  if (copy) c = Value(d.Allocate(n_alloc * cs), "copy");
  gpu::DeviceBuffer s0, s1;  // int8's scales
  if (int8) {
    s0 = Value(d.Allocate(nscales * 4), "exp_avg_scale");
    s1 = Value(d.Allocate(nscales * 4), "exp_avg_sq_scale");
  }
  BENCH_CHECK_OK(
      d.Fill(p.data(), master16 ? DType::kBf16 : DType::kFp32, n_alloc, 0.5f, d.compute()));
  if (int8) {  // every code 0x38 (a normal code of either moment) at small scales
    BENCH_CHECK_OK(d.FillInt32(m.as<int32_t>(), n_alloc / 4, 0x38383838, d.compute()));
    BENCH_CHECK_OK(d.FillInt32(v.as<int32_t>(), n_alloc / 4, 0x38383838, d.compute()));
    BENCH_CHECK_OK(d.Fill(s0.data(), DType::kFp32, nscales, 1e-4f, d.compute()));
    BENCH_CHECK_OK(d.Fill(s1.data(), DType::kFp32, nscales, 1e-8f, d.compute()));
  } else {
    const DType md = bf16_moments ? DType::kBf16 : DType::kFp32;
    BENCH_CHECK_OK(d.Fill(m.data(), md, n_alloc, 0.01f, d.compute()));
    BENCH_CHECK_OK(d.Fill(v.data(), md, n_alloc, 1e-4f, d.compute()));
  }
  BENCH_CHECK_OK(d.Fill(g.data(), grad, n_alloc, 0.02f, d.compute()));

  std::vector<gpu::AdamShard> shards;
  size_t left = params;
  for (size_t t = 0; t < tensors && left > 0; ++t) {
    const size_t n = std::min(per, left), off = t * stride;
    gpu::AdamShard sh;
    if (master16)
      sh.param_bf16 = p.as<uint16_t>() + off;
    else
      sh.param = p.as<float>() + off;
    sh.grad = g.as<char>() + off * gs;
    sh.grad_dtype = grad;
    sh.index0 = off;
    if (int8) {
      sh.exp_avg_q8 = m.as<uint8_t>() + off;
      sh.exp_avg_sq_q8 = v.as<uint8_t>() + off;
      sh.exp_avg_scale = s0.as<float>() + off / 256;
      sh.exp_avg_sq_scale = s1.as<float>() + off / 256;
    } else if (bf16_moments) {
      sh.exp_avg_bf16 = m.as<uint16_t>() + off;
      sh.exp_avg_sq_bf16 = v.as<uint16_t>() + off;
    } else {
      sh.exp_avg = m.as<float>() + off;
      sh.exp_avg_sq = v.as<float>() + off;
    }
    sh.copy_out = copy ? c.as<char>() + off * cs : nullptr;
    sh.copy_dtype = copy_dtype;
    sh.count = n;
    shards.push_back(sh);
    left -= n;
  }
  gpu::AdamHyperParams hp;
  hp.weight_decay = 0.01;
  int64_t step = 0;
  auto adam = [&] {
    hp.step = ++step;
    BENCH_CHECK_OK(d.AdamStep(shards, hp, nullptr, d.compute()));
  };
  for (int w = 0; w < 2; ++w) adam();  // warm-up
  const double adam_s = TimeMedian(d, reps, adam);

  // Roofline: a device-to-device copy moving the same bytes (read + write),
  // into the master from a buffer of its size.
  const gpu::AdamStates sf = master16       ? gpu::AdamStates::kBf16Master
                             : int8         ? gpu::AdamStates::kInt8
                             : bf16_moments ? gpu::AdamStates::kBf16
                                            : gpu::AdamStates::kFp32;
  const double bpe = gpu::AdamBytesPerElement(sf, grad, copy, copy_dtype);
  const auto traffic = static_cast<size_t>(bpe * static_cast<double>(params));
  const size_t roof_bytes = std::min(traffic / 2, n_alloc * ps);  // into param from grad/m
  gpu::DeviceBuffer roof_src = Value(d.Allocate(roof_bytes), "the copy's source");
  const double copy_s = TimeMedian(d, reps, [&] {
    BENCH_CHECK_OK(d.CopyD2D(p.data(), roof_src.data(), roof_bytes, d.compute()));
  });
  const double adam_gbs = traffic / adam_s / 1e9;
  const double copy_gbs = 2.0 * roof_bytes / copy_s / 1e9;
  const std::string gstr(DTypeName(grad)),
      cstr = copy ? std::string(DTypeName(copy_dtype)) : "none";
  const char* gname = gstr.c_str();
  const char* cname = cstr.c_str();
  if (json) {
    std::printf(
        "{\"device\": \"%s\", \"params\": %zu, \"tensors\": %zu, \"grad_dtype\": \"%s\", "
        "\"copy_out\": \"%s\", \"moments\": \"%s\", \"bytes_per_element\": %.4g, \"step_s\": %.6g, "
        "\"params_per_s\": %.6g, \"adam_gbytes_per_s\": %.6g, \"d2d_copy_gbytes_per_s\": %.6g, "
        "\"fraction_of_copy\": %.4f, \"fraction_of_peak\": %.4f}\n",
        d.Describe().c_str(), params, shards.size(), gname, cname, states.c_str(), bpe, adam_s,
        params / adam_s, adam_gbs, copy_gbs, adam_gbs / copy_gbs,
        peak_gbs > 0 ? adam_gbs / peak_gbs : 0.0);
  } else {
    std::printf(
        "device %s: AdamW over %zu params in %zu tensors, grad %s, copy-out %s, states %s\n",
        d.Describe().c_str(), params, shards.size(), gname, cname, states.c_str());
    std::printf("  step %.3f ms (median of %d), %.3g params/s, %.4g B/param\n", adam_s * 1e3, reps,
                params / adam_s, bpe);
    std::printf("  %.1f GB/s moved; D2D copy %.1f GB/s (read+write): %.3f of the copy roofline",
                adam_gbs, copy_gbs, adam_gbs / copy_gbs);
    if (peak_gbs > 0) std::printf(", %.3f of %.0f GB/s peak", adam_gbs / peak_gbs, peak_gbs);
    std::printf("\n");
  }
  return 0;
}
