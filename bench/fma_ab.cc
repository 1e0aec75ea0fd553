// bench/fma_ab.sh's program: the AVX2 kernels with fused multiply-adds (as
// they were up to commit f25a2df) against the unfused ones (MulAdd), in one
// process, interleaved, with the roofline kernel (the same loads and stores,
// no arithmetic) as the bound. Prints medians of 15 repetitions.
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "src/cpu_adam/kernel.h"
namespace strata::cpu_adam::internal {
KernelTable MakeNew();
KernelTable MakeOld();
}  // namespace strata::cpu_adam::internal
using namespace strata::cpu_adam;
using internal::KernelArgs;
using internal::KernelTable;

int main(int argc, char** argv) {
  const size_t n = size_t{1} << 26;
  const int threads = argc > 1 ? atoi(argv[1]) : 2;
  const int reps = 15;
  std::vector<float> p(n), m(n), v(n);
  std::vector<uint16_t> g(n), cp(n), m16(n), v16(n);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  for (size_t i = 0; i < n; ++i) {
    p[i] = u(rng);
    m[i] = u(rng) * 0.1f;
    v[i] = std::fabs(u(rng)) * 1e-2f + 1e-6f;
    const float gg = u(rng);
    uint32_t b;
    memcpy(&b, &gg, 4);
    g[i] = b >> 16;
    m16[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(m[i]) >> 16);
    v16[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(v[i]) >> 16);
  }
  const KernelTable tn = internal::MakeNew();
  const KernelTable to = internal::MakeOld();
  std::printf("probe: new fused_fma=%d old fused_fma=%d\n", tn.fused_fma, to.fused_fma);
  internal::Coeffs c;
  c.decay = 1 - 1e-7f;
  c.neg_step = -1e-7f;
  auto run = [&](const KernelTable& t, int op, bool compact, bool copy) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> th;
    const size_t per = n / threads;
    for (int k = 0; k < threads; ++k)
      th.emplace_back([&, k] {
        KernelArgs a;
        const size_t off = k * per;
        a.param = p.data() + off;
        a.grad = g.data() + off;
        a.n = per;
        a.c = c;
        if (compact) {
          a.state0_c = m16.data() + off;
          a.state1_c = v16.data() + off;
          a.copy = copy ? internal::CopyOut::kBf16 : internal::CopyOut::kNone;
          a.copy_out = copy ? cp.data() + off : nullptr;
          a.index0 = off;
          t.compact[0][op][2](a, false);
        } else {
          a.state0 = m.data() + off;
          a.state1 = v.data() + off;
          a.copy_out = copy ? cp.data() + off : nullptr;
          t.step[op][2][copy ? 3 : 0](a, false);
        }
      });
    for (auto& x : th) x.join();
    return n / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  auto med2 = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  for (bool compact : {false, true}) {
    std::vector<double> roof, fresh, old, rn, ro, pair;
    for (int r = 0; r < reps; ++r) {
      const double a = run(tn, 4, compact, true);
      double b, d;
      if (r % 2) {
        b = run(tn, 1, compact, true);
        d = run(to, 1, compact, true);
      } else {
        d = run(to, 1, compact, true);
        b = run(tn, 1, compact, true);
      }
      roof.push_back(a);
      fresh.push_back(b);
      old.push_back(d);
      rn.push_back(b / a);
      ro.push_back(d / a);
      pair.push_back(b / d);
    }
    auto med = [](std::vector<double> x) {
      std::sort(x.begin(), x.end());
      return x[x.size() / 2];
    };
    std::printf(
        "%s states, bf16 grad, bf16 copy, %d threads, %zu elements, %d reps (medians):\n"
        "  roofline %.0f Mparams/s\n  AdamW unfused (new) %.0f Mparams/s = %.3f of roofline\n"
        "  AdamW fused (old)   %.0f Mparams/s = %.3f of roofline\n  new/old = %.3f\n",
        compact ? "bf16" : "fp32", threads, n, reps, med(roof) * 1e-6, med(fresh) * 1e-6, med(rn),
        med(old) * 1e-6, med(ro), med(fresh) / med(old), med(pair));
    std::printf(
        "  median over reps of new/old (same rep) = %.3f; of new/roofline %.3f, old/roofline "
        "%.3f\n",
        med2(pair), med2(rn), med2(ro));
  }
}
