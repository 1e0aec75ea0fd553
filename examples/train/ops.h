// Element-wise host loops of the example model (the parts that are not
// GEMMs). Row-major fp32; N rows (tokens), H/F/V columns. Shared by the host
// backend; tests/train/model_test.cc checks the whole model against an
// independent double-precision reference.
#pragma once

#include <cstdint>

namespace strata::example::ops {

constexpr float kRmsEps = 1e-5f;

// h0[b, t] = tok[x_t] + prev1[x_{t-1}] + prev2[x_{t-2}] (terms before the
// start of a sequence are left out).
void EmbedForward(const int32_t* x, int64_t batch, int64_t seq, int64_t H, const float* tok, const float* prev1,
                  const float* prev2, float* h0);
// Gradients of the three tables (overwritten, then scatter-added).
void EmbedBackward(const int32_t* x, int64_t batch, int64_t seq, int64_t H, int64_t V, const float* dh, float* gtok,
                   float* gprev1, float* gprev2);
// u = h / r, r[n] = sqrt(mean(h[n]²) + eps).
void RmsNormForward(const float* h, int64_t N, int64_t H, float* u, float* r);
// dh (=, or += when accumulate) (du − u · mean(du ⊙ u)) / r.
void RmsNormBackward(const float* h, const float* u, const float* r, const float* du, int64_t N, int64_t H,
                     bool accumulate, float* dh);
// a += b (per column); g = gelu(a) (tanh form).
void AddBiasGelu(float* a, const float* b, int64_t N, int64_t F, float* g);
// dg (in place) *= gelu'(a).
void GeluBackward(const float* a, float* dg, int64_t n);
// out[j] = Σ_n x[n, j].
void ColumnSum(const float* x, int64_t N, int64_t C, float* out);
// Mean cross-entropy of softmax(z) against targets (double); z becomes
// (softmax(z) − onehot) · grad_scale.
double SoftmaxCrossEntropy(float* z, const int32_t* targets, int64_t N, int64_t V, float grad_scale);

float Gelu(float a);
float GeluGrad(float a);

}  // namespace strata::example::ops
