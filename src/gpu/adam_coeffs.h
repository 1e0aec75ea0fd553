// Internal to src/gpu: the coefficients of one Adam/AdamW step, shared by
// the host reference (host_adam.cc) and the CUDA kernel (adam_kernel.cu);
// plain data, so nvcc sees nothing else of the module.
#pragma once

#include <cstdint>

namespace strata::gpu::host {

// The per-step coefficients of Adam/AdamW, computed in double and rounded to
// float once — cpu_adam.cc's MakeCoeffs for kAdam/kAdamW. Shared with the
// CUDA kernel so that both backends multiply by the very same floats.
struct AdamCoeffs {
  float grad_scale = 1.f;    // g = grad * grad_scale
  float l2 = 0.f;            // Adam: g += l2 * p (coupled weight decay); 0 for AdamW
  float decay = 1.f;         // AdamW: p *= decay (1 - lr * weight_decay); 1 for Adam
  float w1 = 0.1f;           // 1 - beta1
  float beta2 = 0.999f;      //
  float w2 = 0.001f;         // 1 - beta2
  float inv_bc2_sqrt = 1.f;  // 1 / sqrt(1 - beta2^t) (1 without bias correction)
  float eps = 1e-8f;         //
  float neg_step = -1e-3f;   // -lr / (1 - beta1^t)
  bool adamw = true;         // decoupled decay (then l2 is unused)
  // A bf16 master's stochastic rounding stream of this step:
  // codes::MakeSrKey(hp.seed, hp.step) (src/common/state_codes.h).
  uint32_t sr_key0 = 0, sr_key1 = 0;
};

}  // namespace strata::gpu::host
