// Element-wise host loops of the example model. See ops.h.
#include "examples/train/ops.h"

#include <cmath>
#include <cstring>

namespace strata::example::ops {

namespace {
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;
}  // namespace

float Gelu(float a) { return 0.5f * a * (1.f + std::tanh(kGeluK * (a + kGeluC * a * a * a))); }

float GeluGrad(float a) {
  const float t = std::tanh(kGeluK * (a + kGeluC * a * a * a));
  // d/da [0.5 a (1 + t)] = 0.5 (1 + t) + 0.5 a (1 − t²) k (1 + 3c a²)
  return 0.5f * (1.f + t) + 0.5f * a * (1.f - t * t) * kGeluK * (1.f + 3.f * kGeluC * a * a);
}

void EmbedForward(const int32_t* x, int64_t batch, int64_t seq, int64_t H, const float* tok, const float* prev1,
                  const float* prev2, float* h0) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      const int32_t* xs = x + b * seq;
      float* out = h0 + (b * seq + t) * H;
      const float* e0 = tok + static_cast<int64_t>(xs[t]) * H;
      for (int64_t j = 0; j < H; ++j) out[j] = e0[j];
      if (t >= 1) {
        const float* e1 = prev1 + static_cast<int64_t>(xs[t - 1]) * H;
        for (int64_t j = 0; j < H; ++j) out[j] += e1[j];
      }
      if (t >= 2) {
        const float* e2 = prev2 + static_cast<int64_t>(xs[t - 2]) * H;
        for (int64_t j = 0; j < H; ++j) out[j] += e2[j];
      }
    }
  }
}

void EmbedBackward(const int32_t* x, int64_t batch, int64_t seq, int64_t H, int64_t V, const float* dh, float* gtok,
                   float* gprev1, float* gprev2) {
  std::memset(gtok, 0, static_cast<size_t>(V * H) * 4);
  std::memset(gprev1, 0, static_cast<size_t>(V * H) * 4);
  std::memset(gprev2, 0, static_cast<size_t>(V * H) * 4);
  for (int64_t b = 0; b < batch; ++b) {
    const int32_t* xs = x + b * seq;
    for (int64_t t = 0; t < seq; ++t) {
      const float* d = dh + (b * seq + t) * H;
      float* g0 = gtok + static_cast<int64_t>(xs[t]) * H;
      for (int64_t j = 0; j < H; ++j) g0[j] += d[j];
      if (t >= 1) {
        float* g1 = gprev1 + static_cast<int64_t>(xs[t - 1]) * H;
        for (int64_t j = 0; j < H; ++j) g1[j] += d[j];
      }
      if (t >= 2) {
        float* g2 = gprev2 + static_cast<int64_t>(xs[t - 2]) * H;
        for (int64_t j = 0; j < H; ++j) g2[j] += d[j];
      }
    }
  }
}

void RmsNormForward(const float* h, int64_t N, int64_t H, float* u, float* r) {
  for (int64_t n = 0; n < N; ++n) {
    const float* x = h + n * H;
    double ss = 0;
    for (int64_t j = 0; j < H; ++j) ss += static_cast<double>(x[j]) * x[j];
    const float rn = static_cast<float>(std::sqrt(ss / static_cast<double>(H) + kRmsEps));
    r[n] = rn;
    const float inv = 1.f / rn;
    for (int64_t j = 0; j < H; ++j) u[n * H + j] = x[j] * inv;
  }
}

void RmsNormBackward(const float* h, const float* u, const float* r, const float* du, int64_t N, int64_t H,
                     bool accumulate, float* dh) {
  (void)h;
  for (int64_t n = 0; n < N; ++n) {
    const float* un = u + n * H;
    const float* dn = du + n * H;
    double dot = 0;
    for (int64_t j = 0; j < H; ++j) dot += static_cast<double>(dn[j]) * un[j];
    const float mean = static_cast<float>(dot / static_cast<double>(H));
    const float inv = 1.f / r[n];
    float* out = dh + n * H;
    if (accumulate) {
      for (int64_t j = 0; j < H; ++j) out[j] += (dn[j] - un[j] * mean) * inv;
    } else {
      for (int64_t j = 0; j < H; ++j) out[j] = (dn[j] - un[j] * mean) * inv;
    }
  }
}

void AddBiasGelu(float* a, const float* b, int64_t N, int64_t F, float* g) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < F; ++j) {
      const float v = a[n * F + j] + b[j];
      a[n * F + j] = v;
      g[n * F + j] = Gelu(v);
    }
}

void GeluBackward(const float* a, float* dg, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dg[i] *= GeluGrad(a[i]);
}

void ColumnSum(const float* x, int64_t N, int64_t C, float* out) {
  for (int64_t j = 0; j < C; ++j) out[j] = 0.f;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < C; ++j) out[j] += x[n * C + j];
}

double SoftmaxCrossEntropy(float* z, const int32_t* targets, int64_t N, int64_t V, float grad_scale) {
  double total = 0;
  for (int64_t n = 0; n < N; ++n) {
    float* row = z + n * V;
    float mx = row[0];
    for (int64_t j = 1; j < V; ++j) mx = row[j] > mx ? row[j] : mx;
    double sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<double>(row[j] - mx));
    const int32_t y = targets[n];
    total += std::log(sum) - static_cast<double>(row[y] - mx);
    const double inv = 1.0 / sum;
    for (int64_t j = 0; j < V; ++j) row[j] = static_cast<float>(std::exp(static_cast<double>(row[j] - mx)) * inv);
    row[y] -= 1.f;
    for (int64_t j = 0; j < V; ++j) row[j] *= grad_scale;
  }
  return total / static_cast<double>(N);
}

}  // namespace strata::example::ops
