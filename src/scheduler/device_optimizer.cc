#include "src/scheduler/device_optimizer.h"

#include <algorithm>
#include <vector>

#include "src/common/status_util.h"
#include "src/common/timer.h"

namespace strata::scheduler {

namespace {
constexpr size_t kSumOffset = 8;  // the double after the int32 flag
}  // namespace

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

Status DeviceOptimizer::GlobalChecks(bool* overflow, double* sumsq) {
  const auto n = static_cast<size_t>(layout_->total_elems());
  int32_t* found = flags_.as<int32_t>();
  double* sum = reinterpret_cast<double*>(flags_.as<uint8_t>() + kSumOffset);
  gpu::Stream& s = dev_->compute();
  RETURN_IF_ERROR(dev_->FillInt32(found, 1, 0, s));
  RETURN_IF_ERROR(dev_->FillDouble(sum, 1, 0.0, s));
  // x * 1 is x: the pass only flags inf/nan.
  RETURN_IF_ERROR(dev_->UnscaleAndCheck(acc_.data(), DType::kFp32, n, 1.0f, found, s));
  RETURN_IF_ERROR(dev_->SumSquares(acc_.data(), DType::kFp32, n, sum, s));
  int32_t host_found = 0;
  double host_sum = 0;
  RETURN_IF_ERROR(dev_->CopyD2H(&host_found, found, sizeof(host_found), s));
  RETURN_IF_ERROR(dev_->CopyD2H(&host_sum, sum, sizeof(host_sum), s));
  RETURN_IF_ERROR(s.Synchronize());
  *overflow = host_found != 0;
  *sumsq = host_sum;
  return Status();
}

Status DeviceOptimizer::Launch(const LaunchParams& p) {
  // One AdamStep per optimizer parameter group (its hyperparameters).
  const size_t ngroups = std::max<size_t>(1, p.group_hp.size());
  std::vector<gpu::AdamHyperParams> hps(ngroups);
  for (size_t g = 0; g < ngroups; ++g) {
    const cpu_adam::HyperParams& c = p.group_hp.empty() ? p.hp : p.group_hp[g];
    gpu::AdamHyperParams& hp = hps[g];
    hp.decoupled_weight_decay = c.algorithm == cpu_adam::Algorithm::kAdamW;
    hp.lr = c.lr;
    hp.beta1 = c.beta1;
    hp.beta2 = c.beta2;
    hp.eps = c.eps;
    hp.weight_decay = c.weight_decay;
    hp.bias_correction = c.bias_correction;
    hp.step = c.step;
    hp.grad_scale = c.grad_scale;
  }
  std::vector<std::vector<gpu::AdamShard>> shards(ngroups);
  uint8_t* params = store_->device_params();
  for (const ParamRec& r : layout_->params()) {
    gpu::AdamShard sh;
    sh.param = store_->master() + r.elem_off;
    sh.grad = acc_.as<float>() + r.elem_off;
    sh.grad_dtype = DType::kFp32;
    sh.exp_avg = store_->exp_avg() + r.elem_off;
    sh.exp_avg_sq = store_->exp_avg_sq() + r.elem_off;
    sh.copy_out = params + r.byte_off;
    sh.copy_dtype = r.dtype;
    sh.count = static_cast<size_t>(r.numel);
    shards[p.group_hp.empty() ? 0 : static_cast<size_t>(r.group)].push_back(sh);
  }
  const int64_t t0 = NowNanos();
  Status s;
  for (size_t g = 0; g < ngroups && s.ok(); ++g)
    if (!shards[g].empty()) s = dev_->AdamStep(shards[g], hps[g], nullptr, dev_->compute());
  if (s.ok()) s = Zero();
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
