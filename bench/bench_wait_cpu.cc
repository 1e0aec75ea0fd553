// bench_wait_cpu: the CPU optimizer's rate while host threads wait for the
// GPU, against its rate with nobody waiting. During a step the gradient worker
// waits on events (Event::Synchronize) and the engine thread on events and
// streams (Stream::Synchronize) while CPU Adam wants every core; a wait that
// spins takes a core from it. CudaDevice makes those waits block
// (cudaEventBlockingSync; see src/gpu/cuda_device.cc), and this measures it.
//
//   build/bench/bench_wait_cpu [--device cuda|host] [--elems N] [--reps R]
//       [--waiters W] [--json]
//
// Interleaved rounds (R, medians): "idle" steps AdamW over N fp32 elements on
// all cores with the GPU idle and no waiter; "waiting" does the same while W
// threads (default 2: the gradient worker and the engine thread) keep the
// device busy with 64 MiB device-to-device copies and wait for each batch,
// alternating Event::Synchronize and Stream::Synchronize. Reports both rates
// (elements/s) and waiting/idle: near 1 when waits block, about
// (cores - W) / cores when they spin. Without a GPU and --device cuda it says
// so and exits 0; --device host measures the host backend (labelled).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/gpu/device.h"

namespace {

using namespace strata;

[[noreturn]] void Usage(const char* why) {
  std::fprintf(stderr,
               "bench_wait_cpu: %s\nusage: bench_wait_cpu [--device cuda|host] [--elems N] "
               "[--reps R] [--waiters W] [--json]\n",
               why);
  std::exit(2);
}

template <typename T>
T Value(StatusOr<T> v, const char* what) {
  return bench::ValueOrExit(std::move(v), "bench_wait_cpu", what);
}

using bench::Median;

}  // namespace

int main(int argc, char** argv) {
  std::string kind = "cuda";
  size_t elems = size_t{32} << 20;
  int reps = 7, waiters = 2;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) Usage(("missing value for " + a).c_str());
      return argv[++i];
    };
    if (a == "--device")
      kind = next();
    else if (a == "--elems")
      elems = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--reps")
      reps = std::atoi(next().c_str());
    else if (a == "--waiters")
      waiters = std::atoi(next().c_str());
    else if (a == "--json")
      json = true;
    else
      Usage(("unknown argument " + a).c_str());
  }
  if ((kind != "cuda" && kind != "host") || elems == 0 || reps < 1 || waiters < 1)
    Usage("bad arguments");

  constexpr size_t kCopyBytes = size_t{64} << 20;
  gpu::DeviceOptions o;
  o.kind = kind == "host" ? DeviceKind::kHost : DeviceKind::kCuda;
  o.hbm_budget_bytes = 2 * kCopyBytes * static_cast<size_t>(waiters) + (size_t{16} << 20);
  auto dev = gpu::CreateDevice(o);
  if (!dev.ok()) {
    std::printf("bench_wait_cpu: %s\n", dev.status().ToString().c_str());
    // No GPU here: nothing to measure. A GPU that is present but unusable
    // (FailedPrecondition, e.g. a driver older than the runtime) is a failure.
    const StatusCode code = dev.status().code();
    return kind == "cuda" && (code == StatusCode::kUnavailable || code == StatusCode::kNotSupported)
               ? 0
               : 1;
  }
  gpu::Device& d = **dev;

  auto opt = Value(cpu_adam::CpuOptimizer::Create(), "CpuOptimizer::Create");
  std::vector<float> param(elems, 0.5f), grad(elems, 0.02f), m(elems, 0.f), v(elems, 0.f);
  cpu_adam::ShardStep shard;
  shard.param = param.data();
  shard.grad = grad.data();
  shard.grad_dtype = DType::kFp32;
  shard.exp_avg = m.data();
  shard.exp_avg_sq = v.data();
  shard.count = elems;
  shard.hp.weight_decay = 0.01;
  int64_t step = 0;
  // Elements per second of 3 CPU optimizer steps.
  auto cpu_rate = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < 3; ++k) {
      shard.hp.step = ++step;
      Value(opt->Step(shard), "CPU Adam step");
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return 3.0 * static_cast<double>(elems) / s;
  };

  // Each waiter owns a stream and two buffers; it enqueues a batch of copies
  // and waits for it, alternating an event wait and a stream wait.
  struct Waiter {
    std::unique_ptr<gpu::Stream> stream;
    std::unique_ptr<gpu::Event> done;
    gpu::DeviceBuffer a, b;
  };
  std::vector<Waiter> ws(static_cast<size_t>(waiters));
  for (int w = 0; w < waiters; ++w) {
    Waiter& x = ws[static_cast<size_t>(w)];
    x.stream = Value(d.CreateStream("waiter" + std::to_string(w)), "CreateStream");
    x.done = Value(d.CreateEvent(), "CreateEvent");
    x.a = Value(d.Allocate(kCopyBytes), "Allocate");
    x.b = Value(d.Allocate(kCopyBytes), "Allocate");
    BENCH_CHECK_OK(d.Fill(x.a.data(), DType::kFp32, kCopyBytes / 4, 1.f, *x.stream));
  }
  BENCH_CHECK_OK(d.Synchronize());
  std::atomic<bool> stop{false};
  std::atomic<int64_t> waits{0};
  auto wait_loop = [&](Waiter& x) {
    for (int64_t k = 0; !stop.load(std::memory_order_relaxed); ++k) {
      for (int c = 0; c < 8; ++c)
        BENCH_CHECK_OK(d.CopyD2D(c % 2 ? x.a.data() : x.b.data(), c % 2 ? x.b.data() : x.a.data(),
                                 kCopyBytes, *x.stream));
      if (k % 2 == 0) {
        BENCH_CHECK_OK(x.stream->Record(*x.done));
        BENCH_CHECK_OK(x.done->Synchronize());
      } else {
        BENCH_CHECK_OK(x.stream->Synchronize());
      }
      waits.fetch_add(1, std::memory_order_relaxed);
    }
  };

  cpu_rate();  // warm-up (page faults, thread pool)
  std::vector<double> idle, waiting;
  for (int r = 0; r < reps; ++r) {
    idle.push_back(cpu_rate());
    stop = false;
    std::vector<std::thread> threads;
    for (Waiter& x : ws) threads.emplace_back(wait_loop, std::ref(x));
    waiting.push_back(cpu_rate());
    stop = true;
    for (std::thread& t : threads) t.join();
  }
  const double i_med = Median(idle), w_med = Median(waiting);
  const std::string label = d.is_host() ? "host backend (no GPU): " + d.Describe() : d.Describe();
  if (json) {
    std::printf(
        "{\"device\": \"%s\", \"cpu_threads\": %d, \"isa\": \"%.*s\", \"elems\": %zu, "
        "\"waiters\": %d, \"reps\": %d, \"idle_elems_per_s\": %.6g, "
        "\"waiting_elems_per_s\": %.6g, \"waiting_over_idle\": %.4f, \"waits\": %lld}\n",
        label.c_str(), opt->threads(), static_cast<int>(opt->isa().size()), opt->isa().data(),
        elems, waiters, reps, i_med, w_med, w_med / i_med, static_cast<long long>(waits.load()));
  } else {
    std::printf("device %s; CPU AdamW on %d threads (%.*s), %zu fp32 elements\n", label.c_str(),
                opt->threads(), static_cast<int>(opt->isa().size()), opt->isa().data(), elems);
    std::printf("  idle:    %.3g elements/s (median of %d)\n", i_med, reps);
    std::printf("  waiting: %.3g elements/s with %d threads waiting on the device (%lld waits)\n",
                w_med, waiters, static_cast<long long>(waits.load()));
    std::printf("  waiting / idle: %.3f\n", w_med / i_med);
  }
  return 0;
}
