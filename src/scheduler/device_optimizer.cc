#include "src/scheduler/device_optimizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "src/common/status_util.h"
#include "src/common/timer.h"

namespace strata::scheduler {

namespace {
constexpr size_t kSumOffset = 8;  // the double sum of squares (the int32 before it is spare)
}  // namespace

gpu::AdamHyperParams ToDeviceHyperParams(const cpu_adam::HyperParams& c) {
  gpu::AdamHyperParams hp;
  hp.decoupled_weight_decay = c.algorithm == cpu_adam::Algorithm::kAdamW;
  hp.lr = c.lr;
  hp.beta1 = c.beta1;
  hp.beta2 = c.beta2;
  hp.eps = c.eps;
  hp.weight_decay = c.weight_decay;
  hp.bias_correction = c.bias_correction;
  hp.step = c.step;
  hp.grad_scale = c.grad_scale;
  return hp;
}

gpu::AdamShard DeviceStateShard(const StateArrays& st, int64_t e, int64_t n) {
  using cpu_adam::StateFormat;
  using cpu_adam::StateRole;
  gpu::AdamShard sh;
  const auto [p, ps] = st.At(StateRole::kParam, e);
  const auto [m, ms] = st.At(StateRole::kExpAvg, e);
  const auto [v, vs] = st.At(StateRole::kExpAvgSq, e);
  switch (st.format) {
    case StateFormat::kFp32:
      sh.param = reinterpret_cast<float*>(p);
      sh.exp_avg = reinterpret_cast<float*>(m);
      sh.exp_avg_sq = reinterpret_cast<float*>(v);
      break;
    case StateFormat::kBf16:
    case StateFormat::kBf16Master:
      if (st.format == StateFormat::kBf16)
        sh.param = reinterpret_cast<float*>(p);
      else
        sh.param_bf16 = reinterpret_cast<uint16_t*>(p);
      sh.exp_avg_bf16 = reinterpret_cast<uint16_t*>(m);
      sh.exp_avg_sq_bf16 = reinterpret_cast<uint16_t*>(v);
      break;
    case StateFormat::kInt8:
      sh.param = reinterpret_cast<float*>(p);
      sh.exp_avg_q8 = m;
      sh.exp_avg_sq_q8 = v;
      sh.exp_avg_scale = ms;
      sh.exp_avg_sq_scale = vs;
      break;
  }
  sh.count = static_cast<size_t>(n);
  sh.index0 = static_cast<uint64_t>(e);
  return sh;
}

Status DeviceOptimizer::Init() {
  const int64_t n = layout_->total_elems();
  ASSIGN_OR_RETURN(acc_, dev_->Allocate(static_cast<size_t>(kGradAccBytesPerElem * n)));
  ASSIGN_OR_RETURN(flags_, dev_->Allocate(kSumOffset + sizeof(double)));
  RETURN_IF_ERROR(Zero());
  return dev_->compute().Synchronize();
}

Status DeviceOptimizer::AddGradients(int m, const void* device_grad, gpu::Event& /*computed*/,
                                     bool /*last*/) {
  const ModuleExtent& me = layout_->module(m);
  const auto* base = static_cast<const uint8_t*>(device_grad);
  for (int id : me.params) {
    const ParamRec& p = layout_->param(id);
    RETURN_IF_ERROR(dev_->AddToFp32(acc_.as<float>() + p.elem_off,
                                    base + (p.byte_off - me.byte_begin), p.dtype,
                                    static_cast<size_t>(p.numel), dev_->compute()));
  }
  return Status();
}

// One read-only pass over the accumulator: the sum of squares, in double.
// It is finite exactly when every element is: a finite fp32 value squared in
// double is at most 1.2e77, so no sum of fewer than 2^64 of them overflows,
// while an inf or NaN element makes the sum inf or NaN (squares are never
// negative, so no inf - inf). So the non-finite flag needs no second pass and
// the accumulator is never written here.
Status DeviceOptimizer::GlobalChecks(bool* overflow, double* sumsq) {
  gpu::Stream& s = dev_->compute();
  // Several ranks: the window's sums averaged into this rank's partition
  // first, and only the partition checked here.
  float* first = acc_.as<float>();
  auto n = static_cast<size_t>(layout_->total_elems());
  if (dp_ != nullptr) {
    RETURN_IF_ERROR(s.Synchronize());
    RETURN_IF_ERROR(dp_->ReduceGradients(first, Memory::kDevice));
    const auto [e0, e1] = store_->partition().elems();
    first += e0;
    n = static_cast<size_t>(e1 - e0);
  }
  double* sum = reinterpret_cast<double*>(flags_.as<uint8_t>() + kSumOffset);
  RETURN_IF_ERROR(dev_->FillDouble(sum, 1, 0.0, s));
  RETURN_IF_ERROR(dev_->SumSquares(first, DType::kFp32, n, sum, s));
  double host_sum = 0;
  RETURN_IF_ERROR(dev_->CopyD2H(&host_sum, sum, sizeof(host_sum), s));
  RETURN_IF_ERROR(s.Synchronize());
  if (dp_ != nullptr)
    return dp_->CombineChecks({host_sum}, {static_cast<uint8_t>(!std::isfinite(host_sum))},
                              overflow, sumsq);
  *overflow = !std::isfinite(host_sum);
  *sumsq = host_sum;
  return Status();
}

Status DeviceOptimizer::Launch(const LaunchParams& p) {
  // One AdamStep per optimizer parameter group (its hyperparameters).
  const size_t ngroups = std::max<size_t>(1, p.group_hp.size());
  std::vector<gpu::AdamHyperParams> hps(ngroups);
  for (size_t g = 0; g < ngroups; ++g)
    hps[g] = ToDeviceHyperParams(p.group_hp.empty() ? p.hp : p.group_hp[g]);
  // The parameters' pieces this rank owns (every element with one rank);
  // the states hold those elements only, from state_base().
  std::vector<std::vector<gpu::AdamShard>> shards(ngroups);
  // (Partitioned: the block holds this rank's bytes, from param_byte_base().)
  uint8_t* params = store_->device_params();
  const Partition& part = store_->partition();
  const int64_t byte_base = part.param_byte_base();
  const auto [e0, e1] = part.elems();
  for (const Layout::Slice& piece : layout_->Slices(e0, std::max(e0, e1))) {
    const ParamRec& r = layout_->param(piece.param);
    gpu::AdamShard sh =
        DeviceStateShard(store_->states(), piece.elem_begin, piece.elem_end - piece.elem_begin);
    sh.grad = acc_.as<float>() + piece.elem_begin;
    sh.grad_dtype = DType::kFp32;
    sh.copy_out = params + (piece.byte_offset - byte_base);
    sh.copy_dtype = r.dtype;
    shards[p.group_hp.empty() ? 0 : static_cast<size_t>(r.group)].push_back(sh);
  }
  // Device copies fetched from the partitioned parameters are stale once
  // the step has run.
  if (copies_ != nullptr && part.params_partitioned()) RETURN_IF_ERROR(copies_->InvalidateAll());
  const int64_t t0 = NowNanos();
  Status s;
  for (size_t g = 0; g < ngroups && s.ok(); ++g)
    if (!shards[g].empty()) s = dev_->AdamStep(shards[g], hps[g], nullptr, dev_->compute());
  if (s.ok()) s = Zero();
  // Several ranks: every rank's partition of the new parameters.
  if (s.ok() && dp_ != nullptr) {
    // (Partitioned: the next gathers on the collectives' stream read the
    // block after this.)
    s = dev_->compute().Synchronize();
    if (s.ok() && !part.params_partitioned())
      s = dp_->GatherParams(params, Memory::kDevice)
              .WithContext(fmt::format(
                  "step {}: this rank's optimizer states have moved to the new step but the "
                  "other ranks' parameters did not arrive; the ranks disagree and the run cannot "
                  "continue",
                  steps_ + 1));
  }
  // On the host device the framework computes on this thread, not on the
  // compute stream: it must see the step's parameters.
  if (s.ok() && dev_->is_host()) s = dev_->compute().Synchronize();
  counters_->AddOptimizerBusy(NowNanos() - t0);
  RETURN_IF_ERROR(s);
  ++steps_;
  scaler_->Update(false);
  window_->grads_since_launch = false;
  return Status();
}

Status DeviceOptimizer::ZeroGrad() {
  window_->Reset();
  return Zero();
}

void DeviceOptimizer::DiscardWindow() {
  Zero().IgnoreError();
  window_->Reset();
}

Status DeviceOptimizer::Zero() {
  return dev_->Fill(acc_.data(), DType::kFp32, static_cast<size_t>(layout_->total_elems()), 0.f,
                    dev_->compute());
}

}  // namespace strata::scheduler
