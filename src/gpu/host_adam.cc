// Adam/AdamW on the host: the plain reference loop of Device::AdamStep (see
// host_kernels.h). Mirrors src/cpu_adam/kernel_scalar.cc line for line for
// kAdam/kAdamW; tests/gpu/adam_test.cc checks that the two agree bitwise.
// Built with -ffp-contract=off (src/gpu/CMakeLists.txt).
#include <cmath>

#include "src/common/half.h"
#include "src/gpu/host_kernels.h"

namespace strata::gpu::host {

AdamCoeffs MakeAdamCoeffs(const AdamHyperParams& hp) {
  AdamCoeffs c;
  const double lr = hp.lr, b1 = hp.beta1, b2 = hp.beta2, wd = hp.weight_decay;
  c.grad_scale = static_cast<float>(hp.grad_scale);
  c.eps = static_cast<float>(hp.eps);
  c.beta2 = static_cast<float>(b2);
  c.w1 = static_cast<float>(1.0 - b1);
  c.w2 = static_cast<float>(1.0 - b2);
  const double t = static_cast<double>(hp.step);
  const double bc1 = hp.bias_correction ? 1.0 - std::pow(b1, t) : 1.0;
  const double bc2 = hp.bias_correction ? 1.0 - std::pow(b2, t) : 1.0;
  c.neg_step = static_cast<float>(-lr / bc1);
  c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  c.adamw = hp.decoupled_weight_decay;
  if (c.adamw) {
    c.decay = static_cast<float>(1.0 - lr * wd);
  } else {
    c.l2 = static_cast<float>(wd);
  }
  return c;
}

void AdamStep(const AdamShard& s, const AdamCoeffs& c) {
  for (size_t i = 0; i < s.count; ++i) {
    float p = s.param[i];
    float g = LoadAsFloat(s.grad, s.grad_dtype, i) * c.grad_scale;
    const bool bf16 = s.exp_avg_bf16 != nullptr;  // bf16 moments
    float m = bf16 ? LoadAsFloat(s.exp_avg_bf16, DType::kBf16, i) : s.exp_avg[i];
    float v = bf16 ? LoadAsFloat(s.exp_avg_sq_bf16, DType::kBf16, i) : s.exp_avg_sq[i];
    if (!c.adamw) g = c.l2 * p + g;                             // Adam: L2 into the gradient
    m = c.w1 * (g - m) + m;                                     // m = lerp(m, g, 1-b1)
    v = c.w2 * (g * g) + c.beta2 * v;                           // v = b2 v + (1-b2) g²
    const float denom = std::sqrt(v) * c.inv_bc2_sqrt + c.eps;  // sqrt(v̂) + eps
    if (c.adamw) p = p * c.decay;                               // AdamW: decoupled decay
    p = c.neg_step * (m / denom) + p;                           // p -= lr m̂ / denom
    if (bf16) {
      StoreFromFloat(s.exp_avg_bf16, DType::kBf16, i, m);  // round to nearest even
      StoreFromFloat(s.exp_avg_sq_bf16, DType::kBf16, i, v);
    } else {
      s.exp_avg[i] = m;
      s.exp_avg_sq[i] = v;
    }
    s.param[i] = p;
    if (s.copy_out != nullptr) StoreFromFloat(s.copy_out, s.copy_dtype, i, p);
  }
}

}  // namespace strata::gpu::host
