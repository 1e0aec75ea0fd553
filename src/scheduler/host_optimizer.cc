#include "src/scheduler/host_optimizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/common/units.h"
#include "src/scheduler/device_optimizer.h"
#include "src/scheduler/grad_store.h"

namespace strata::scheduler {

HostOptimizer::HostOptimizer(gpu::Device* device, const Layout* layout,
                             cpu_adam::CpuOptimizer* adam, StepCounters* counters,
                             LossScaler* scaler, GradientWindow* window, Options options)
    : dev_(device),
      layout_(layout),
      adam_(adam),
      counters_(counters),
      scaler_(scaler),
      window_(window),
      opts_(std::move(options)) {}

HostOptimizer::~HostOptimizer() {
  // The issuer waits for this optimizer's gradients: what it was handed is
  // issued before they go.
  if (opts_.dp != nullptr) opts_.dp->AbandonOverlap();
  // A step still running in the background ends first; it is not committed
  // (nothing reads the engine's state any more).
  StopSpeculation().IgnoreError();
  spec_.reset();
  inflight_.reset();
  read_ahead_.WaitAll();
  if (dev_) dev_->Synchronize().IgnoreError();
  grads_.reset();
}

Status HostOptimizer::Start(int64_t* pinned_bytes) {
  if (opts_.dp != nullptr && opts_.overlap_comm) RETURN_IF_ERROR(opts_.dp->StartOverlapIssuer());
  grads_ = std::make_unique<GradOffloader>(dev_, layout_, adam_, counters_);
  // (Several ranks: the reduction rewrites the sums after the window.)
  grads_->set_precompute_checks(opts_.dp == nullptr);
  RETURN_IF_ERROR(grads_->Start(opts_.second_accumulator, pinned_bytes,
                                /*host_accumulator=*/!opts_.grads_on_nvme && !opts_.sums_in_hbm,
                                opts_.landing_bytes, opts_.pin_landing,
                                opts_.device_accumulator && opts_.pin_accumulator));
  ASSIGN_OR_RETURN(upload_ready_, dev_->CreateEvent());
  if (opts_.device_step_elems > 0) {
    split_ = opts_.device_step_elems;
    const auto n = static_cast<size_t>(split_);
    ASSIGN_OR_RETURN(split_sums_, dev_->Allocate(n * sizeof(float)));
    ASSIGN_OR_RETURN(split_sumsq_, dev_->Allocate(sizeof(double)));
    RETURN_IF_ERROR(dev_->Fill(split_sums_.data(), DType::kFp32, n, 0.f, dev_->compute()));
    RETURN_IF_ERROR(dev_->compute().Synchronize());
    ASSIGN_OR_RETURN(split_summed_, dev_->CreateEvent());
    grads_->set_device_stepped(split_);
    grads_->set_precompute_checks(false);  // (the host part's checks start at the split)
  }
  if (opts_.sums_in_hbm) {
    sums_ = std::make_unique<DeviceSums>(dev_, layout_, counters_, opts_.sums_chunk_elems,
                                         opts_.pin_sums);
    RETURN_IF_ERROR(sums_->Open(pinned_bytes).WithContext("the window's gradient sums in HBM"));
    ASSIGN_OR_RETURN(summed_, dev_->CreateEvent());
  }
  if (opts_.device_accumulator) {
    const auto n = static_cast<size_t>(layout_->total_elems());
    ASSIGN_OR_RETURN(device_sum_, dev_->Allocate(n * sizeof(float)));
    RETURN_IF_ERROR(dev_->Fill(device_sum_.data(), DType::kFp32, n, 0.f, dev_->compute()));
    RETURN_IF_ERROR(dev_->compute().Synchronize());
    sum_pending_.assign(static_cast<size_t>(layout_->num_modules()), 0);
    ASSIGN_OR_RETURN(summed_, dev_->CreateEvent());
    ASSIGN_OR_RETURN(zeroed_, dev_->CreateEvent());
  }
  return Status();
}

std::vector<gpu::PinnedPool::Region> HostOptimizer::io_buffers() const {
  return grads_->staging_pool()->Regions();
}

Status HostOptimizer::Bind(StateStore* store) {
  store_ = store;
  const Partition& part = store->partition();
  const bool params_ok = store->param_place() == OffloadDevice::kNone
                             ? store->device_params() != nullptr
                             : store->param_place() == OffloadDevice::kCpu;
  if ((part.device_groups() > 0 ? part.host_elems().first : 0) != split_ ||
      (split_ > 0 && (opts_.dp != nullptr || !params_ok || part.params_partitioned())))
    return InternalError(fmt::format(
        "HostOptimizer: the device-stepped elements ({}) disagree with the store's partition ({} "
        "sub-groups) or placement",
        split_, part.device_groups()));
  if (split_ > 0 && store->param_place() == OffloadDevice::kCpu) {
    ASSIGN_OR_RETURN(split_params_,
                     dev_->Allocate(static_cast<size_t>(layout_->ByteOfElem(split_))));
    ASSIGN_OR_RETURN(split_copied_, dev_->CreateEvent());
  }
  if (opts_.speculate) RETURN_IF_ERROR(StartSpeculation());
  if (!opts_.grads_on_nvme) return Status();
  auto nvme = std::make_unique<GradStore>(layout_, store, counters_, kGradCacheSlots);
  RETURN_IF_ERROR(nvme->Open().WithContext("the gradient cache"));
  grads_->SetNvmeStore(std::move(nvme));
  return Status();
}

Status HostOptimizer::StartSpeculation() {
  const auto [e0, e1] = store_->partition().host_elems();
  // States on NVMe need no spare (their two versions are the undo): every
  // element may be speculated.
  const bool nvme = store_->optimizer_place() == OffloadDevice::kNvme;
  int64_t spare = nvme ? e1 - e0 : std::min(opts_.spare_elems, e1 - e0);
  spare_first_ = e1 - spare;
  if (layout_->state_format() == cpu_adam::StateFormat::kInt8) {
    // The spare starts on a block, as every module does (the plan's row
    // counts the same).
    const auto block = static_cast<int64_t>(cpu_adam::kStateBlock);
    spare_first_ = std::min(e1, (spare_first_ + block - 1) / block * block);
    spare = e1 - spare_first_;
  }
  // The modules with elements, in element order; those the spare holds.
  spec_modules_.clear();
  for (int m = 0; m < layout_->num_modules(); ++m)
    if (layout_->module(m).elems() > 0) spec_modules_.push_back(m);
  std::sort(spec_modules_.begin(), spec_modules_.end(), [&](int a, int b) {
    return layout_->module(a).elem_begin < layout_->module(b).elem_begin;
  });
  spec_first_module_ = spec_modules_.size();
  while (spec_first_module_ > 0 &&
         layout_->module(spec_modules_[spec_first_module_ - 1]).elem_begin >= spare_first_)
    --spec_first_module_;
  if (spec_first_module_ == spec_modules_.size()) {
    STRATA_LOG_INFO(
        "strata.speculative_step: the spare of {} elements holds no whole module; the step runs "
        "after backward",
        spare);
    opts_.speculate = false;
    return Status();
  }
  if (!nvme) {
    const cpu_adam::StateFormat f = layout_->state_format();
    RETURN_IF_ERROR(
        spare_.Allocate(StateArrayBytes(f, spare), nullptr, "the speculative step's spare states"));
    spare_states_ = StatesInBuffer(f, spare_first_, spare, spare_.data());
  }
  spec_events_.clear();
  for (size_t i = 0; i < spec_modules_.size(); ++i) {
    std::unique_ptr<gpu::Event> ev;
    if (i >= spec_first_module_) {
      ASSIGN_OR_RETURN(ev, dev_->CreateEvent());
    }
    spec_events_.push_back(std::move(ev));
  }
  STRATA_LOG_INFO(
      "strata.speculative_step: {} of {} modules may be stepped during the last backward pass "
      "({})",
      spec_modules_.size() - spec_first_module_, spec_modules_.size(),
      nvme ? std::string("states on NVMe: whole sub-groups, into their inactive versions")
           : "spare states " + FormatBytes(spare_.bytes()));
  return Status();
}

StepDeps HostOptimizer::Deps() const {
  StepDeps d;
  d.layout = layout_;
  d.store = store_;
  d.adam = adam_;
  d.counters = counters_;
  d.buffer_count = opts_.buffer_count;
  d.before_sub_group = opts_.before_sub_group;
  d.grads = grads_->nvme_store();
  d.sums = sums_.get();
  return d;
}

// ---- The window's gradients ---------------------------------------------------

Status HostOptimizer::AddGradients(int m, const void* device_grad, gpu::Event& computed,
                                   bool last) {
  const bool spec = last && spec_ && !spec_->stopped;
  if (spec) RETURN_IF_ERROR(SpeculationBefore(m));
  RETURN_IF_ERROR(HandOver(m, device_grad, computed, last));
  return spec ? SpeculationAfter(m) : Status();
}

Status HostOptimizer::HandOver(int m, const void* device_grad, gpu::Event& computed, bool last) {
  RETURN_IF_ERROR(dev_->compute().Record(computed));
  if (split_ > 0) {
    const ModuleExtent& me = layout_->module(m);
    if (me.elems() > 0 && me.elem_begin < split_) {
      RETURN_IF_ERROR(AddSplitSums(m, device_grad));
      // Wholly below the split: nothing for the host.
      if (me.elem_end <= split_) return Status();
    }
  }
  if (sums_) {
    // acc += grad in fp32 on the compute stream, as with the device
    // accumulator; the sums stay there until the checks and the step.
    const ModuleExtent& me = layout_->module(m);
    const auto* base = static_cast<const uint8_t*>(device_grad);
    for (int id : me.params) {
      const ParamRec& p = layout_->param(id);
      RETURN_IF_ERROR(dev_->AddToFp32(sums_->data() + p.elem_off,
                                      base + (p.byte_off - me.byte_begin), p.dtype,
                                      static_cast<size_t>(p.numel), dev_->compute()));
    }
    // The gradient buffer's reuse is ordered after the D2H stream
    // (gradients_read_on), which waits for the adds.
    RETURN_IF_ERROR(dev_->compute().Record(*summed_));
    return dev_->d2h().Wait(*summed_);
  }
  if (opts_.device_accumulator) {
    // acc += grad in fp32 on the compute stream (the order of the host
    // path's adds: micro-batches, then calls, in order), after any zeroing
    // of the accumulator still on the D2H stream.
    RETURN_IF_ERROR(SettleDeviceSum());
    const ModuleExtent& me = layout_->module(m);
    const auto* base = static_cast<const uint8_t*>(device_grad);
    float* sum = device_sum_.as<float>();
    for (int id : me.params) {
      const ParamRec& p = layout_->param(id);
      RETURN_IF_ERROR(dev_->AddToFp32(sum + p.elem_off, base + (p.byte_off - me.byte_begin),
                                      p.dtype, static_cast<size_t>(p.numel), dev_->compute()));
    }
    RETURN_IF_ERROR(dev_->compute().Record(*summed_));
    // The gradient buffer is read on the compute stream; its reuse is
    // ordered after the D2H stream (gradients_read_on), which follows.
    RETURN_IF_ERROR(dev_->d2h().Wait(*summed_));
    sum_pending_[static_cast<size_t>(m)] = 1;
    return last ? OffloadDeviceSum(m) : Status();
  }
  // Fold: the window's last micro-batch lands for the optimizer to read.
  if (opts_.fold && last) return grads_->Land(m, device_grad, computed);
  RETURN_IF_ERROR(grads_->Offload(m, device_grad, computed));
  if (last && opts_.overlap_comm && opts_.dp != nullptr) return OverlapAfter(m);
  return Status();
}

Status HostOptimizer::AddSplitSums(int m, const void* device_grad) {
  const ModuleExtent& me = layout_->module(m);
  const auto* base = static_cast<const uint8_t*>(device_grad);
  for (int id : me.params) {
    const ParamRec& p = layout_->param(id);
    const int64_t n = std::min(p.numel, split_ - p.elem_off);
    if (n <= 0) continue;
    RETURN_IF_ERROR(dev_->AddToFp32(split_sums_.as<float>() + p.elem_off,
                                    base + (p.byte_off - me.byte_begin), p.dtype,
                                    static_cast<size_t>(n), dev_->compute()));
  }
  // The gradient buffer's reuse is ordered after the D2H stream
  // (gradients_read_on), which waits for the adds.
  RETURN_IF_ERROR(dev_->compute().Record(*split_summed_));
  return dev_->d2h().Wait(*split_summed_);
}

Status HostOptimizer::SplitChecks(bool* overflow, double* sumsq) {
  // The split's elements first (element order), on the compute stream.
  gpu::Stream& s = dev_->compute();
  auto* dsum = split_sumsq_.as<double>();
  RETURN_IF_ERROR(dev_->FillDouble(dsum, 1, 0.0, s));
  RETURN_IF_ERROR(dev_->SumSquares(split_sums_.as<float>(), DType::kFp32,
                                   static_cast<size_t>(split_), dsum, s));
  double device_sum = 0;
  RETURN_IF_ERROR(dev_->CopyD2H(&device_sum, dsum, sizeof(device_sum), s));
  RETURN_IF_ERROR(s.Synchronize());
  const auto [h0, h1] = store_->partition().host_groups();
  std::vector<double> partial;
  std::vector<uint8_t> bad;
  RETURN_IF_ERROR(grads_->BlockChecks(h0, h1, &partial, &bad));
  bool host_bad = false;
  double host_sum = 0;
  CombineBlocks(partial, bad, &host_bad, &host_sum);
  // (Finite exactly when every element is: DeviceOptimizer::GlobalChecks.)
  *overflow = host_bad || !std::isfinite(device_sum);
  *sumsq = device_sum + host_sum;
  return Status();
}

void HostOptimizer::ZeroBelowSplit(float* acc) {
  if (acc == nullptr) return;
  for (int m = 0; m < layout_->num_modules(); ++m) {
    const ModuleExtent& me = layout_->module(m);
    if (me.elem_begin < split_ && me.elem_end > split_)
      std::memset(acc + me.elem_begin, 0,
                  static_cast<size_t>(split_ - me.elem_begin) * kGradAccBytesPerElem);
  }
}

Status HostOptimizer::StepDeviceGroups(const LaunchParams& lp) {
  const size_t ngroups = std::max<size_t>(1, lp.group_hp.size());
  std::vector<gpu::AdamHyperParams> hps(ngroups);
  for (size_t g = 0; g < ngroups; ++g)
    hps[g] = ToDeviceHyperParams(lp.group_hp.empty() ? lp.hp : lp.group_hp[g]);
  const StateArrays& st = store_->device_states();
  std::vector<std::vector<gpu::AdamShard>> shards(ngroups);
  for (const Layout::Slice& piece : layout_->Slices(st.first, split_)) {
    const ParamRec& r = layout_->param(piece.param);
    gpu::AdamShard sh = DeviceStateShard(st, piece.elem_begin, piece.elem_end - piece.elem_begin);
    sh.grad = split_sums_.as<float>() + piece.elem_begin;
    sh.grad_dtype = DType::kFp32;
    sh.copy_out =
        (split_params_.data() != nullptr ? split_params_.as<uint8_t>() : store_->device_params()) +
        piece.byte_offset;
    sh.copy_dtype = r.dtype;
    shards[lp.group_hp.empty() ? 0 : static_cast<size_t>(r.group)].push_back(sh);
  }
  const int64_t t0 = NowNanos();
  Status s;
  for (size_t g = 0; g < ngroups && s.ok(); ++g)
    if (!shards[g].empty()) s = dev_->AdamStep(shards[g], hps[g], nullptr, dev_->compute());
  if (s.ok())
    s = dev_->Fill(split_sums_.data(), DType::kFp32, static_cast<size_t>(split_), 0.f,
                   dev_->compute());
  if (s.ok() && split_params_.data() != nullptr) {
    // offload_param cpu: the new parameters below the split into the host
    // copy-out array, where fetches and the commit take them.
    const int64_t bytes = layout_->ByteOfElem(split_);
    s = dev_->compute().Record(*split_summed_);
    if (s.ok()) s = dev_->d2h().Wait(*split_summed_);
    if (s.ok())
      s = counters_->TimedCopy(dev_->d2h(), Link::kD2H, "parameters stepped on the device", bytes,
                               [&] {
                                 return dev_->CopyD2H(store_->next_params(), split_params_.data(),
                                                      static_cast<size_t>(bytes), dev_->d2h());
                               });
    if (s.ok()) s = dev_->d2h().Record(*split_copied_);
  }
  // On the host device the framework computes on this thread: it must see
  // the step's parameters.
  if (s.ok() && dev_->is_host()) s = dev_->compute().Synchronize();
  counters_->AddOptimizerBusy(NowNanos() - t0);
  return s;
}

bool HostOptimizer::SplitParamsLanded(int m) const {
  if (!split_copied_ || layout_->module(m).elem_begin >= split_ || layout_->module(m).elems() == 0)
    return true;
  StatusOr<bool> done = split_copied_->Query();
  return !done.ok() || *done;  // (an error: AwaitModule reports it)
}

Status HostOptimizer::AwaitSplitParams(int m) {
  if (SplitParamsLanded(m)) return Status();
  const int64_t t0 = NowNanos();
  const Status s = split_copied_->Synchronize();
  counters_->AddOptimizerWait(NowNanos() - t0);
  return s;
}

Status HostOptimizer::OverlapAfter(int m) {
  const size_t i = ov_.order.size();
  ov_.order.push_back(m);
  if (i == 0) {  // the last micro-batch's first backward
    ov_.on = !ov_.previous.empty();
    ov_.final_from = layout_->total_elems();
    if (ov_.on) opts_.dp->BeginOverlap(grads_->accumulator());
  }
  const ModuleExtent& me = layout_->module(m);
  if (me.elems() > 0 && me.elem_end > ov_.final_from)
    return FailedPreconditionError(fmt::format(
        "zero_optimization.overlap_comm: module {}'s backward ran again after its gradients were "
        "reduced with the other ranks (this window's backward order left the previous one's at "
        "call {}); set overlap_comm false for a model whose backward order changes",
        m, i + 1));
  if (!ov_.on) return Status();
  if (i >= ov_.previous.size() || ov_.previous[i] != m) {
    ov_.on = false;  // not the previous order: the rest at the window's end
    return Status();
  }
  if (me.elems() > 0) ov_.final_from = std::min(ov_.final_from, me.elem_begin);
  // The sums above final_from are final once the gradients queued so far
  // are accumulated (a failed add fails this rank's step).
  GradOffloader* grads = grads_.get();
  const int64_t ticket = grads->queued();
  opts_.dp->ReduceFromWhenReady(ov_.final_from,
                                [grads, ticket] { return grads->WaitAccumulated(ticket); });
  return Status();
}

void HostOptimizer::EndOverlapWindow(bool keep_order) {
  ov_.previous.clear();
  if (keep_order && std::is_sorted(ov_.order.rbegin(), ov_.order.rend()) &&
      std::adjacent_find(ov_.order.begin(), ov_.order.end()) == ov_.order.end())
    ov_.previous = ov_.order;
  ov_.order.clear();
  ov_.on = false;
  ov_.final_from = layout_->total_elems();
  if (opts_.dp != nullptr) opts_.dp->AbandonOverlap();
}

Status HostOptimizer::OffloadDeviceSum(int m) {
  const ModuleExtent& me = layout_->module(m);
  float* part = device_sum_.as<float>() + me.elem_begin;
  RETURN_IF_ERROR(grads_->OffloadFp32(m, part, *summed_));
  RETURN_IF_ERROR(
      dev_->Fill(part, DType::kFp32, static_cast<size_t>(me.elems()), 0.f, dev_->d2h()));
  RETURN_IF_ERROR(dev_->d2h().Record(*zeroed_));
  zero_in_flight_ = true;
  sum_pending_[static_cast<size_t>(m)] = 0;
  return Status();
}

Status HostOptimizer::SettleDeviceSum() {
  if (!zero_in_flight_) return Status();
  zero_in_flight_ = false;
  return dev_->compute().Wait(*zeroed_);
}

Status HostOptimizer::Drain() {
  // The speculative step ends with the range in progress: the ranges not
  // started are the next step's (and the checks read every sum).
  RETURN_IF_ERROR(StopSpeculation());
  if (opts_.device_accumulator) {
    // Modules not used in the window's last micro-batch: their sums now.
    Status s;
    for (int m = 0; m < layout_->num_modules() && s.ok(); ++m)
      if (sum_pending_[static_cast<size_t>(m)]) s = OffloadDeviceSum(m);
    if (!s.ok()) {
      grads_->Drain().IgnoreError();
      return s;
    }
  }
  return grads_->Drain();
}

Status HostOptimizer::PrepareStep(const std::function<LaunchParams()>& speculative) {
  // (A speculative step on NVMe states needs a pipeline buffer of its own:
  // the read-ahead leaves it one.)
  const bool spec_nvme = opts_.speculate && speculative && spec_skip_ == 0 &&
                         store_->optimizer_place() == OffloadDevice::kNvme;
  if (store_->optimizer_place() == OffloadDevice::kNvme && !read_ahead_.started() && !inflight_)
    read_ahead_.Start(
        Deps(),
        spec_nvme ? static_cast<size_t>(std::max<int64_t>(0, opts_.buffer_count - 1)) : SIZE_MAX);
  if (!opts_.speculate || spec_ || !speculative || spec_skip_ > 0) return Status();
  // The previous step's states are the ones to step from: it ends first (the
  // window's forward passes needed all of it; with DPU no speculation).
  if (inflight_) {
    if (inflight_->run->params().delayed) return Status();
    RETURN_IF_ERROR(Join());
  }
  // The copy-out target must not still be read by the previous publish.
  if (gpu::Event* uploaded = store_->params_uploaded()) RETURN_IF_ERROR(uploaded->Synchronize());
  const LaunchParams lp = speculative();
  auto s = std::make_unique<Speculation>();
  s->hp = lp.hp;
  s->group_hp = lp.group_hp;
  s->module_done.assign(static_cast<size_t>(layout_->num_modules()), 0);
  s->next_module = spec_modules_.size();
  s->next_elem = store_->partition().host_elems().second;
  s->from = s->next_elem;
  StepParams p;
  p.hp = lp.hp;
  p.group_hp = lp.group_hp;
  p.step = lp.hp.step;
  p.background = true;
  p.grads = grads_->accumulator();
  p.landing = grads_->landing();
  p.feed = &s->feed;
  p.spare = spare_states_;
  StatusOr<std::unique_ptr<OptimizerStep>> run = OptimizerStep::Launch(Deps(), p, nullptr);
  if (!run.ok()) {  // (no thread: the window's step runs after backward)
    STRATA_LOG_WARN("strata.speculative_step: {}; this window's step runs after backward",
                    run.status().ToString());
    return Status();
  }
  s->run = std::move(*run);
  spec_ = std::move(s);
  return Status();
}

Status HostOptimizer::SpeculationBefore(int m) {
  Speculation& s = *spec_;
  const ModuleExtent& me = layout_->module(m);
  if (!s.module_done[static_cast<size_t>(m)] || me.elems() <= 0) return Status();
  // A second backward of m in the last micro-batch: its sums change. Handed
  // over already: what was stepped from them is void, and the step must not
  // read them while they change.
  if (me.elem_end > s.next_elem) {
    s.invalid = true;
    return StopSpeculation();
  }
  return Status();
}

Status HostOptimizer::SpeculationAfter(int m) {
  Speculation& s = *spec_;
  if (s.stopped) return Status();
  s.module_done[static_cast<size_t>(m)] = 1;
  // The done modules right below those handed over, as one range: their
  // sums are final once what was queued so far has landed.
  const int64_t hi = s.next_elem;
  int64_t lo = hi;
  while (s.next_module > spec_first_module_ &&
         s.module_done[static_cast<size_t>(spec_modules_[s.next_module - 1])]) {
    --s.next_module;
    lo = layout_->module(spec_modules_[s.next_module]).elem_begin;
  }
  if (lo == hi) return Status();
  gpu::Event* landed = spec_events_[s.next_module].get();
  RETURN_IF_ERROR(dev_->d2h().Record(*landed));
  GradOffloader* grads = grads_.get();
  const int64_t ticket = grads->queued();
  SpeculationFeed::Item item;
  item.elem_begin = lo;
  item.elem_end = hi;
  item.wait = [grads, ticket, landed] {
    RETURN_IF_ERROR(grads->WaitAccumulated(ticket));
    return landed->Synchronize();
  };
  item.fold_modes = grads_->FoldModes();
  s.feed.Push(std::move(item));
  s.next_elem = lo;
  return Status();
}

Status HostOptimizer::StopSpeculation() {
  if (!spec_ || spec_->stopped) return Status();
  spec_->feed.Close(/*keep_pending=*/opts_.speculation_steps_all && !spec_->invalid);
  StepOutcome o = spec_->run->Join();
  spec_->from = spec_->run->speculated_from();
  spec_->status = std::move(o.status);
  spec_->written = std::move(o.param_written);
  spec_->open = spec_->run->TakeOpenModules();
  spec_->stopped = true;
  if (!spec_->status.ok())
    STRATA_LOG_WARN("strata.speculative_step: {}; the window's step is redone after backward",
                    spec_->status.ToString());
  return Status();
}

Status HostOptimizer::RestoreSpeculated(int64_t from) {
  const int64_t end = store_->partition().host_elems().second;
  // NVMe states: the speculation wrote only the inactive versions.
  if (from >= end || store_->optimizer_place() == OffloadDevice::kNvme) return Status();
  return CopyStates(adam_, spare_states_, store_->states(), from, end);
}

int64_t HostOptimizer::GroupsFrom(int64_t from) const {
  const auto [e0, e1] = store_->partition().host_elems();
  if (from >= e1) return 0;
  return static_cast<int64_t>(store_->partition().host_groups().second -
                              layout_->GroupOf(std::max(from, e0)));
}

Status HostOptimizer::DropSpeculation() {
  if (!spec_) return Status();
  RETURN_IF_ERROR(StopSpeculation());
  std::unique_ptr<Speculation> s = std::move(spec_);
  const int64_t n = GroupsFrom(s->from);
  spec_counts_.speculated += n;
  spec_counts_.redone += n;
  return RestoreSpeculated(s->from);
}

Status HostOptimizer::CancelSpeculation() { return DropSpeculation(); }

void HostOptimizer::NoteSpeculationOutcome(bool speculated, bool kept) {
  if (!opts_.speculation_backoff) return;
  if (!speculated) {
    if (spec_skip_ > 0) --spec_skip_;
    return;
  }
  if (kept) {
    spec_backoff_ = 0;
    return;
  }
  constexpr int64_t kMaxSkip = 64;
  spec_backoff_ = spec_backoff_ == 0 ? 1 : std::min(kMaxSkip, 2 * spec_backoff_);
  spec_skip_ = spec_backoff_;
}

HostOptimizer::SpeculationCounts HostOptimizer::TakeSpeculationCounts() {
  return std::exchange(spec_counts_, SpeculationCounts{});
}

Status HostOptimizer::GlobalChecks(bool* overflow, double* sumsq) {
  // (The step in flight has ended: the engine joins it first.)
  grads_->ZeroUnsent();
  DataParallel* dp = opts_.dp;
  if (sums_) {
    if (dp != nullptr)  // (the plan keeps the sums in HBM for one rank only)
      return InternalError("the window's gradient sums in HBM with several ranks");
    RETURN_IF_ERROR(sums_->Begin());
    return sums_->GlobalChecks(overflow, sumsq);
  }
  if (dp == nullptr && split_ > 0) return SplitChecks(overflow, sumsq);
  if (dp == nullptr) return grads_->GlobalChecks(overflow, sumsq);
  // Every rank's window, averaged into this rank's partition (the part
  // overlap_comm has not reduced yet, or all); the checks over the
  // partition, then combined.
  const auto [g0, g1] = store_->partition().groups();
  if (GradStore* nvme = grads_->nvme_store()) {
    // Gradients on NVMe: sub-group by sub-group through the cache, every
    // rank in order; a sub-group another rank owns is dropped once reduced.
    for (size_t g = 0; g < layout_->num_groups(); ++g) {
      RETURN_IF_ERROR(nvme->Update(g, [&](float* sums) { return dp->ReduceGroup(g, sums); }));
      if (g < g0 || g >= g1) nvme->Consumed(g);
    }
    std::vector<double> partial;
    std::vector<uint8_t> bad;
    RETURN_IF_ERROR(nvme->BlockChecks(g0, g1, &partial, &bad));
    return dp->CombineChecks(partial, bad, overflow, sumsq);
  }
  Status reduced;
  if (dp->overlapping()) {
    reduced = dp->FinishOverlap();  // what the issuer was handed, then the rest
  } else {
    reduced = dp->ReduceGradients(grads_->accumulator());
  }
  EndOverlapWindow(reduced.ok());
  RETURN_IF_ERROR(reduced);
  std::vector<double> partial;
  std::vector<uint8_t> bad;
  RETURN_IF_ERROR(grads_->BlockChecks(g0, g1, &partial, &bad));
  return dp->CombineChecks(partial, bad, overflow, sumsq);
}

Status HostOptimizer::ZeroGrad() {
  RETURN_IF_ERROR(DropSpeculation());
  if (reading_next_params()) {
    // The step in flight zeroes the accumulator as it consumes it: with no
    // gradients added since, there is nothing to do (and no reason to wait).
    if (!window_->grads_since_launch) {
      window_->micro_batches = 0;
      return grads_->Drain();
    }
    RETURN_IF_ERROR(Join());
  }
  // With DPU in flight, the step owns the other accumulator; this one is ours.
  RETURN_IF_ERROR(grads_->Drain());
  window_->grads_since_launch = false;
  grads_->Zero();
  RETURN_IF_ERROR(ZeroDeviceSum());
  window_->micro_batches = 0;
  return Status();
}

void HostOptimizer::DiscardWindow() {
  NoteSpeculationOutcome(spec_ != nullptr, false);
  Status dropped = DropSpeculation();
  if (!dropped.ok())  // (a copy between arrays the store owns: never expected)
    STRATA_LOG_ERROR("strata.speculative_step: restoring the saved states failed: {}",
                     dropped.ToString());
  grads_->Drain().IgnoreError();
  EndOverlapWindow(false);
  grads_->ZeroAll();
  ZeroDeviceSum().IgnoreError();
  window_->Reset();
}

Status HostOptimizer::ZeroDeviceSum() {
  if (split_ > 0)
    RETURN_IF_ERROR(dev_->Fill(split_sums_.data(), DType::kFp32, static_cast<size_t>(split_), 0.f,
                               dev_->compute()));
  if (sums_)
    return dev_->Fill(sums_->data(), DType::kFp32, static_cast<size_t>(layout_->total_elems()), 0.f,
                      dev_->compute());
  if (!opts_.device_accumulator) return Status();
  RETURN_IF_ERROR(SettleDeviceSum());
  std::fill(sum_pending_.begin(), sum_pending_.end(), 0);
  return dev_->Fill(device_sum_.data(), DType::kFp32, static_cast<size_t>(layout_->total_elems()),
                    0.f, dev_->compute());
}

// ---- The step -----------------------------------------------------------------

Status HostOptimizer::Launch(const LaunchParams& lp) {
  // The copy-out target must not still be read by the previous publish.
  if (gpu::Event* uploaded = store_->params_uploaded()) RETURN_IF_ERROR(uploaded->Synchronize());
  // Device copies of parameters are stale once the step runs (with DPU: once
  // it is committed, by the next Step()).
  if (!lp.delayed) RETURN_IF_ERROR(copies_->InvalidateAll());
  StepParams p;
  // What a speculative step of this window stepped is kept when it assumed
  // what is true (no clipping, the same loss scale and learning rates, no
  // sums changed after they were read); else its states go back and every
  // sub-group is stepped here.
  if (spec_) {
    RETURN_IF_ERROR(StopSpeculation());
    std::unique_ptr<Speculation> s = std::move(spec_);
    const int64_t n = GroupsFrom(s->from);
    spec_counts_.speculated += n;
    const bool keep = s->status.ok() && !s->invalid && !lp.delayed && lp.hp == s->hp &&
                      lp.group_hp == s->group_hp;
    NoteSpeculationOutcome(true, keep);
    if (keep) {
      p.speculated_from = s->from;
      p.speculated_written = std::move(s->written);
      p.speculated_open = std::make_shared<std::vector<OpenModule>>(std::move(s->open));
    } else {
      spec_counts_.redone += n;
      RETURN_IF_ERROR(RestoreSpeculated(s->from));
    }
  } else {
    NoteSpeculationOutcome(false, false);
  }
  p.hp = lp.hp;
  p.group_hp = lp.group_hp;
  p.step = lp.hp.step;
  p.delayed = lp.delayed;
  p.background = lp.background;
  // DPU: the next window accumulates into the other accumulator.
  p.grads = lp.delayed ? grads_->SwapForStep() : grads_->accumulator();
  p.fold_modes = grads_->FoldModes();
  p.landing = grads_->landing();
  p.keep_grads = grads_->direct();  // the next window's sums replace them
  if (sums_) {
    // The step reads the sums in HBM after the window's adds.
    p.grads = nullptr;
    RETURN_IF_ERROR(sums_->Begin());
  }
  // (A module across the split was handed over whole: what it left below
  // the split in the host accumulator is dropped.)
  if (split_ > 0) ZeroBelowSplit(p.grads);
  StatusOr<std::unique_ptr<OptimizerStep>> run = OptimizerStep::Launch(Deps(), p, &read_ahead_);
  if (!run.ok()) {
    if (lp.delayed) grads_->SwapForStep();  // back as it was
    return run.status();
  }
  auto job = std::make_unique<InFlight>();
  job->run = std::move(*run);
  job->scaler_before = *scaler_;
  job->uploaded.assign(static_cast<size_t>(layout_->num_modules()), 0);
  ++steps_;
  scaler_->Update(false);
  window_->grads_since_launch = false;
  grads_->ForgetWindow();  // the step has the window's fold modes
  inflight_ = std::move(job);
  if (split_ > 0) {
    // The first sub-groups on the device while the CPU steps the rest; their
    // modules' parameters are then in the device block already.
    const Status ds = StepDeviceGroups(lp);
    if (!ds.ok()) {
      Join().IgnoreError();
      return ds.WithContext(fmt::format(
          "optimizer step {}: the sub-groups stepped on the device (offload_optimizer.ratio) did "
          "not advance while the others did; the run cannot continue",
          lp.hp.step));
    }
    inflight_->device_stepped = true;
    for (int m = 0; m < layout_->num_modules(); ++m)
      if (layout_->module(m).elem_end <= split_) inflight_->uploaded[static_cast<size_t>(m)] = 1;
  }
  return lp.background ? Status() : Join();
}

Status HostOptimizer::Poll() {
  if (!inflight_) return Status();
  bool ok = true;
  const bool finished = inflight_->run->Finished(&ok);
  if (!finished || (inflight_->run->params().delayed && ok)) return Status();  // DPU: by Step()
  return Join();
}

Status HostOptimizer::Join() {
  if (!inflight_) return Status();
  std::unique_ptr<InFlight> job = std::move(inflight_);
  StepOutcome outcome = job->run->Join();
  // (offload_param cpu: the device step's parameters land before the commit
  // publishes the array they were copied into.)
  if (job->device_stepped && split_copied_) {
    Status landed = split_copied_->Synchronize();
    if (!landed.ok() && outcome.status.ok()) outcome.status = std::move(landed);
  }
  const StepParams& p = job->run->params();
  const Status& s = outcome.status;
  if (s.ok() || outcome.advanced || job->device_stepped) {
    // DPU: the device copies were used during the step; they go now.
    Status cs = p.delayed ? copies_->InvalidateAll() : Status();
    // Data parallelism: every rank's partition of the new parameters.
    // (Stage 3 partitioned parameters stay partitioned: fetches gather them.)
    if (cs.ok() && s.ok() && opts_.dp != nullptr && !store_->partition().params_partitioned()) {
      cs = opts_.dp->GatherParams(store_->next_params());
      if (!cs.ok())
        cs = cs.WithContext(fmt::format(
            "step {}: this rank's optimizer states have moved to the new step but the other "
            "ranks' parameters did not arrive; the ranks disagree and the run cannot continue",
            p.step));
    }
    if (cs.ok()) cs = store_->Commit(outcome, job->uploaded);
    if (!s.ok()) DiscardWindow();
    // (Several ranks: a step that failed after this rank's states moved,
    // a failed write of its parameters' pieces, leaves the ranks apart.)
    if (!s.ok() && opts_.dp != nullptr)
      return s.WithContext(fmt::format(
          "step {}: this rank's optimizer states have moved to the new step but not all of its "
          "parameters did; the ranks disagree and the run cannot continue",
          p.step));
    return s.ok() ? cs : s;
  }
  Rollback(*job);
  return s.WithContext(
      fmt::format("optimizer step {} (launched by Step(){}); parameters and optimizer states are "
                  "those of step {}, the window's gradients are discarded and a micro-batch in "
                  "progress must be restarted",
                  p.step, p.background ? ", run in the background" : "", p.step - 1));
}

void HostOptimizer::Rollback(InFlight& job) {
  const StepParams& p = job.run->params();
  steps_ = p.step - 1;
  *scaler_ = job.scaler_before;
  if (!p.delayed) {
    // Device copies may hold the new parameters of modules the step reached.
    copies_->InvalidateAll().IgnoreError();
    store_->Rollback(job.uploaded, p.step);
  }
  DiscardWindow();
}

Status HostOptimizer::Abandon() {
  DropSpeculation().IgnoreError();  // (the states are about to be replaced)
  Status s = Join();
  read_ahead_.WaitAll();  // reads of states about to be replaced: dropped
  read_ahead_ = StateReadAhead();
  return s;
}

Status HostOptimizer::AwaitModule(int m) {
  RETURN_IF_ERROR(Poll());
  if (!reading_next_params()) return Status();
  InFlight& job = *inflight_;
  RETURN_IF_ERROR(AwaitSplitParams(m));
  if (!job.run->ModuleReady(m)) {
    const int64_t t0 = NowNanos();
    const bool ready = job.run->WaitModule(m);
    counters_->AddOptimizerWait(NowNanos() - t0);
    // Finished without reaching the module: the step failed (rolled back).
    if (!ready) return Join();
  }
  if (store_->param_place() != OffloadDevice::kNone || job.uploaded[static_cast<size_t>(m)])
    return Status();
  // offload_param none: the module's new parameters go into its part of the
  // device block now, ahead of the rest of the step.
  if (layout_->module(m).bytes() > 0) {
    RETURN_IF_ERROR(store_->UploadModule(m, *upload_ready_));
    RETURN_IF_ERROR(dev_->OrderComputeAfter(*upload_ready_));
  }
  job.uploaded[static_cast<size_t>(m)] = 1;
  return Status();
}

}  // namespace strata::scheduler
