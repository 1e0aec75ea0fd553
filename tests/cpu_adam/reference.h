// A plain double-precision reference for the optimizers (PyTorch semantics)
// and the error bounds the fp32 kernels must meet against it.
//
// Bound (u = 2^-24, one fp32 rounding): every kernel output x must satisfy
// |x - x_ref| <= B, where B is a small multiple of u times the magnitude of
// the terms that were added to produce x (first-order error analysis):
//   g    = grad*scale (+ wd*p)           B_g = 2u (|grad*scale| + wd|p|) = 2u S_g
//   m'   = m + (1-b1)(g - m)             B_m = 8u (|m| + S_g)          (may cancel)
//   v'   = b2 v + (1-b2) g^2             B_v = 8u (b2|v| + (1-b2) S_g^2) (no cancellation)
//   p'   = p*decay - s*m'/denom          B_p = 8u (|p| + |U|) + s*B_m/denom + |U| B_v / v'
// with U = s*m'/denom the update. 8 ulps cover the 3 to 4 roundings along
// each chain, with and without FMA (SSE4.2 and scalar round each multiply
// and add separately), plus the 1-ulp difference of 1/sqrt(bc2) precomputed
// as a multiplier instead of PyTorch's division.
#pragma once

#include <cmath>
#include <cstdint>

#include "src/cpu_adam/cpu_adam.h"

namespace strata::cpu_adam::testref {

constexpr double kU = 1.0 / (1 << 24);

struct Elem {
  double p, m, v;           // outputs
  double bp, bm, bv;        // bounds
  bool p_checkable = true;  // Lion: false when sign(u) is within rounding of 0
};

inline Elem Reference(const HyperParams& hp, double p, double grad, double m, double v) {
  Elem e{};
  const double lr = hp.lr, b1 = hp.beta1, b2 = hp.beta2, eps = hp.eps, wd = hp.weight_decay;
  double g = grad * static_cast<double>(hp.grad_scale);
  double sg = std::fabs(g);
  switch (hp.algorithm) {
    case Algorithm::kAdam:
    case Algorithm::kAdamW: {
      if (hp.algorithm == Algorithm::kAdam) {
        g += wd * p;  // L2: grad = grad + wd * param
        sg += wd * std::fabs(p);
      }
      const double t = static_cast<double>(hp.step);
      const double bc1 = hp.bias_correction ? 1 - std::pow(b1, t) : 1;
      const double bc2 = hp.bias_correction ? 1 - std::pow(b2, t) : 1;
      double pd = p;
      if (hp.algorithm == Algorithm::kAdamW) pd = p * (1 - lr * wd);  // decoupled decay first
      e.m = b1 * m + (1 - b1) * g;
      e.v = b2 * v + (1 - b2) * g * g;
      const double denom = std::sqrt(e.v) / std::sqrt(bc2) + eps;
      const double s = lr / bc1;
      const double U = s * e.m / denom;
      e.p = pd - U;
      e.bm = 8 * kU * (std::fabs(m) + sg);
      e.bv = 8 * kU * (b2 * std::fabs(v) + (1 - b2) * sg * sg);
      e.bp = 8 * kU * (std::fabs(p) + std::fabs(U)) + s * e.bm / denom + std::fabs(U) * e.bv / e.v;
      break;
    }
    case Algorithm::kAdagrad: {
      g += wd * p;
      sg += wd * std::fabs(p);
      e.v = v + g * g;  // "sum" lives in exp_avg_sq
      const double denom = std::sqrt(e.v) + eps;
      const double U = lr * g / denom;
      e.p = p - U;
      e.bv = 8 * kU * (std::fabs(v) + sg * sg);
      e.bp = 8 * kU * (std::fabs(p) + std::fabs(U)) + lr * 2 * kU * sg / denom + std::fabs(U) * e.bv / e.v;
      break;
    }
    case Algorithm::kLion: {
      const double u = b1 * m + (1 - b1) * g;
      const double sign = u > 0 ? 1 : (u < 0 ? -1 : 0);
      e.p = p * (1 - lr * wd) - lr * sign;
      e.m = b2 * m + (1 - b2) * g;
      e.bm = 8 * kU * (std::fabs(m) + sg);
      e.bp = 8 * kU * (std::fabs(p) + lr);
      e.p_checkable = std::fabs(u) > 8 * kU * (std::fabs(m) + sg);
      break;
    }
  }
  return e;
}

}  // namespace strata::cpu_adam::testref
