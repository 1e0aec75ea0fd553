// Adam/AdamW on the host: the plain reference loop of Device::AdamStep (see
// host_kernels.h). Mirrors src/cpu_adam/kernel_scalar.cc line for line for
// kAdam/kAdamW in every state format (fp32, bf16 moments, a bf16 master,
// int8 moments); tests/gpu/adam_test.cc checks that the two agree bitwise.
// Built with -ffp-contract=off (src/gpu/CMakeLists.txt).
#include <algorithm>
#include <cmath>

#include "src/common/half.h"
#include "src/common/state_codes.h"
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
  const codes::SrKey key = codes::MakeSrKey(hp.seed, hp.step);
  c.sr_key0 = key.k0;
  c.sr_key1 = key.k1;
  return c;
}

namespace {

// One element of Adam/AdamW: kernel_scalar.cc's order of operations.
inline void AdamElement(float& p, float g, float& m, float& v, const AdamCoeffs& c) {
  g = g * c.grad_scale;
  if (!c.adamw) g = c.l2 * p + g;                             // Adam: L2 into the gradient
  m = c.w1 * (g - m) + m;                                     // m = lerp(m, g, 1-b1)
  v = c.w2 * (g * g) + c.beta2 * v;                           // v = b2 v + (1-b2) g²
  const float denom = std::sqrt(v) * c.inv_bc2_sqrt + c.eps;  // sqrt(v̂) + eps
  if (c.adamw) p = p * c.decay;                               // AdamW: decoupled decay
  p = c.neg_step * (m / denom) + p;                           // p -= lr m̂ / denom
}

// int8 moments, block by block: the new moments of a block first, then its
// absmax (NaN never wins: a comparison with NaN is false), its scales and
// the codes — kernel_scalar.cc's order.
void AdamStepInt8(const AdamShard& s, const AdamCoeffs& c) {
  float mb[codes::kQuantBlock], vb[codes::kQuantBlock];
  for (size_t b0 = 0, blk = 0; b0 < s.count; b0 += codes::kQuantBlock, ++blk) {
    const size_t e = std::min(s.count, b0 + codes::kQuantBlock);
    const float sc0 = s.exp_avg_scale[blk], sc1 = s.exp_avg_sq_scale[blk];
    float amax0 = 0.f, amax1 = 0.f;
    for (size_t i = b0; i < e; ++i) {
      float p = s.param[i];
      float m = codes::DecodeExpAvg8(s.exp_avg_q8[i]) * sc0;
      float v = codes::DecodeExpAvgSq8(s.exp_avg_sq_q8[i]) * sc1;
      AdamElement(p, LoadAsFloat(s.grad, s.grad_dtype, i), m, v, c);
      s.param[i] = p;
      mb[i - b0] = m;
      vb[i - b0] = v;
      const float am = std::fabs(m), av = std::fabs(v);
      amax0 = am > amax0 ? am : amax0;
      amax1 = av > amax1 ? av : amax1;
      if (s.copy_out != nullptr) StoreFromFloat(s.copy_out, s.copy_dtype, i, p);
    }
    const codes::BlockScale q0 = codes::MakeBlockScale(amax0, codes::kExpAvgCodeMax);
    const codes::BlockScale q1 = codes::MakeBlockScale(amax1, codes::kExpAvgSqCodeMax);
    s.exp_avg_scale[blk] = q0.scale;
    s.exp_avg_sq_scale[blk] = q1.scale;
    for (size_t i = b0; i < e; ++i) {
      s.exp_avg_q8[i] = codes::EncodeExpAvg8(mb[i - b0], q0.inv);
      s.exp_avg_sq_q8[i] = codes::EncodeExpAvgSq8(vb[i - b0], q1.inv);
    }
  }
}

}  // namespace

void AdamStep(const AdamShard& s, const AdamCoeffs& c) {
  const AdamStates f = AdamShardStates(s);
  if (f == AdamStates::kInt8) return AdamStepInt8(s, c);
  const bool master16 = f == AdamStates::kBf16Master;
  const bool bf16 = s.exp_avg_bf16 != nullptr;  // bf16 moments
  const codes::SrKey key{c.sr_key0, c.sr_key1};
  for (size_t i = 0; i < s.count; ++i) {
    float p = master16 ? LoadAsFloat(s.param_bf16, DType::kBf16, i) : s.param[i];
    float m = bf16 ? LoadAsFloat(s.exp_avg_bf16, DType::kBf16, i) : s.exp_avg[i];
    float v = bf16 ? LoadAsFloat(s.exp_avg_sq_bf16, DType::kBf16, i) : s.exp_avg_sq[i];
    AdamElement(p, LoadAsFloat(s.grad, s.grad_dtype, i), m, v, c);
    if (bf16) {
      StoreFromFloat(s.exp_avg_bf16, DType::kBf16, i, m);  // round to nearest even
      StoreFromFloat(s.exp_avg_sq_bf16, DType::kBf16, i, v);
    } else {
      s.exp_avg[i] = m;
      s.exp_avg_sq[i] = v;
    }
    if (master16) {  // stochastic rounding; the copy is of the stored master
      s.param_bf16[i] = codes::FloatToBf16Stochastic(p, codes::SrBits(s.index0 + i, key));
      p = LoadAsFloat(s.param_bf16, DType::kBf16, i);
    } else {
      s.param[i] = p;
    }
    if (s.copy_out != nullptr) StoreFromFloat(s.copy_out, s.copy_dtype, i, p);
  }
}

}  // namespace strata::gpu::host
