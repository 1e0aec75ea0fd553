#include "src/scheduler/state_store.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <deque>

#include "src/common/dtype.h"
#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/common/units.h"
#include "src/scheduler/hyperparams.h"

namespace strata::scheduler {

using gpu::Device;
using gpu::PinnedPool;

// ---- StateStore --------------------------------------------------------------

StateStore::StateStore(Device* device, const Layout* layout, const Partition& partition,
                       StepCounters* counters, const Config* config)
    : dev_(device), layout_(layout), cfg_(config), part_(partition) {
  ctx_.dev = device;
  ctx_.layout = layout;
  ctx_.part = &partition;
  ctx_.counters = counters;
  if (config != nullptr) ctx_.state_format = config->strata.optimizer_states;
}

StateStore::~StateStore() { Close().IgnoreError(); }

Status StateStore::Close() {
  if (!swap_) return Status();
  Status s = swap_->Close();
  swap_.reset();
  return s;
}

std::string StateStore::ModuleShard(int module, int version) {
  return ModuleShardName(module, version);
}

std::string StateStore::StateShard(size_t group, int version) {
  return StateShardName(group, version);
}

std::string StateStore::GradShard(size_t group) { return fmt::format("grad.g{}", group); }

int64_t StateStore::grad_buffer_offset() const {
  return OptimizerBufferBytes(layout_->max_piece_elems(), false, layout_->state_format());
}

int64_t StateStore::optimizer_buffer_bytes() const {
  return OptimizerBufferBytes(layout_->max_piece_elems(), grads_on_nvme_, layout_->state_format());
}

nvme::IoHandle StateStore::ReadGrads(size_t g, void* buf, int64_t bytes, int64_t offset) {
  return swap_->Read(GradShard(g), static_cast<uint64_t>(offset), buf, static_cast<size_t>(bytes));
}

nvme::IoHandle StateStore::WriteGrads(size_t g, const void* buf, int64_t bytes) {
  return swap_->Write(GradShard(g), 0, buf, static_cast<size_t>(bytes));
}

int64_t StateStore::pinned_array_bytes() const {
  int64_t bytes = 0;
  if (params_) bytes += params_->pinned_bytes();
  return bytes + (states_ ? states_->pinned_bytes() : 0);
}

Status StateStore::Open(
    const TierPlan& plan, const std::vector<PinnedPool::Region>& extra_fixed_buffers,
    const std::function<std::unique_ptr<nvme::IoEngine>(std::unique_ptr<nvme::IoEngine>)>&
        wrap_io_engine,
    int64_t* pinned_bytes) {
  placement_ = plan.placement;
  grads_on_nvme_ = plan.grads_on_nvme;
  states_ = StateHome::For(placement_.optimizer, &ctx_);
  if (placement_.optimizer == OffloadDevice::kNvme)
    nvme_states_ = static_cast<NvmeStates*>(states_.get());
  RETURN_IF_ERROR(states_->Allocate(placement_.pin_optimizer_states));
  params_ = ParamHome::For(placement_, &ctx_);
  if (placement_.params == OffloadDevice::kNone)
    device_params_ = static_cast<DeviceParams*>(params_.get());
  if (placement_.params == OffloadDevice::kNvme)
    nvme_params_ = static_cast<NvmeParams*>(params_.get());
  RETURN_IF_ERROR(params_->Allocate(plan.pin_param_copies));
  RETURN_IF_ERROR(AllocatePools(pinned_bytes));
  if (plan.nvme_bytes() > 0)
    RETURN_IF_ERROR(OpenNvme(plan.nvme_bytes(), extra_fixed_buffers, wrap_io_engine));
  return Status();
}

Status StateStore::AllocatePools(int64_t* pinned_bytes) {
  // One pool per purpose so that no user can starve another (a gradient
  // chunk must never hold an optimizer pipeline buffer). The pinned budget
  // was checked against their total by the plan.
  auto make_pool = [&](std::unique_ptr<PinnedPool>* pool, int64_t bytes, int64_t count) -> Status {
    gpu::PinnedPoolOptions popts;
    popts.classes.push_back({static_cast<size_t>(IoBytes(std::max<int64_t>(bytes, kIoAlign))),
                             static_cast<size_t>(std::max<int64_t>(1, count))});
    popts.allow_pageable_fallback = true;
    ASSIGN_OR_RETURN(*pool, PinnedPool::Create(popts, dev_));
    *pinned_bytes += static_cast<int64_t>((*pool)->total_bytes());
    return Status();
  };
  if (placement_.optimizer == OffloadDevice::kNvme)
    RETURN_IF_ERROR(
        make_pool(&opt_pool_, optimizer_buffer_bytes(), placement_.optimizer_buffer_count));
  // (Partitioned parameters in host memory: the modules are gathered into
  // the same buffers; in device memory, into device buffers.)
  if (placement_.params == OffloadDevice::kNvme || (params_partitioned() && !gathers_on_device()))
    RETURN_IF_ERROR(
        make_pool(&param_pool_, layout_->max_module_bytes(), placement_.param_buffer_count));
  if (placement_.params == OffloadDevice::kNvme) {
    RETURN_IF_ERROR(make_pool(&param_write_pool_, layout_->max_module_bytes(), kParamWriteBuffers));
  }
  return Status();
}

Status StateStore::OpenNvme(
    int64_t capacity, const std::vector<PinnedPool::Region>& extra,
    const std::function<std::unique_ptr<nvme::IoEngine>(std::unique_ptr<nvme::IoEngine>)>& wrap) {
  nvme::IoOptions io = nvme::IoOptionsFromConfig(*cfg_);
  for (const auto& r : extra) io.fixed_buffers.push_back({r.data, r.bytes});
  for (PinnedPool* pool : {opt_pool_.get(), param_pool_.get(), param_write_pool_.get()})
    if (pool != nullptr)
      for (const auto& r : pool->Regions()) io.fixed_buffers.push_back({r.data, r.bytes});
  ASSIGN_OR_RETURN(std::unique_ptr<nvme::IoEngine> engine, nvme::NewIoEngine(io));
  if (wrap) engine = wrap(std::move(engine));
  ASSIGN_OR_RETURN(io_, nvme::IoService::Create(io, std::move(engine)));
  nvme::SwapStoreOptions so;
  so.paths = UsedNvmePaths(*cfg_);
  so.capacity_bytes = static_cast<uint64_t>(capacity);
  ASSIGN_OR_RETURN(swap_, nvme::SwapStore::Open(so, io_.get()));
  ctx_.swap = swap_.get();
  const auto [g0, g1] = part_.groups();
  if (placement_.optimizer == OffloadDevice::kNvme)
    for (size_t g = g0; g < g1; ++g)
      for (int v = 0; v < 2; ++v)
        RETURN_IF_ERROR(swap_->Allocate(StateShard(g, v),
                                        static_cast<uint64_t>(layout_->group(g).state_io_bytes())));
  if (placement_.params == OffloadDevice::kNvme)
    for (int m = 0; m < layout_->num_modules(); ++m) {
      const auto [lo, hi] = ModulePiece(m);
      if (hi > lo)
        for (int v = 0; v < 2; ++v)
          RETURN_IF_ERROR(
              swap_->Allocate(ModuleShard(m, v), static_cast<uint64_t>(IoBytes(hi - lo))));
    }
  if (grads_on_nvme_)
    for (size_t g = 0; g < layout_->num_groups(); ++g)
      RETURN_IF_ERROR(swap_->Allocate(
          GradShard(g),
          static_cast<uint64_t>(IoBytes(kGradAccBytesPerElem * layout_->group(g).elems()))));
  return Status();
}

Status StateStore::Initialize(
    const std::function<std::span<const float>(int id, std::vector<float>& scratch)>& master_of) {
  // One pass over the parameters in element order (sub-group by sub-group):
  // each parameter's master values go to the states (the DRAM array, a
  // host copy for the device arena, or the sub-group's NVMe shard written
  // when the sub-group is complete) and, converted, to the parameter copies
  // (the copy-out target, or with offload_param nvme the module's NVMe
  // version written when the next module begins). Nothing over every
  // parameter is held when both live on NVMe. (The layout's alignment
  // padding holds zeros: layout.h.)
  if (nvme_states_ != nullptr) {
    ASSIGN_OR_RETURN(gpu::PinnedBuffer group_buf,
                     opt_pool_->Acquire(static_cast<size_t>(optimizer_buffer_bytes())));
    nvme_states_->set_init_buffer(std::move(group_buf));
  }
  if (nvme_params_ != nullptr) {
    ASSIGN_OR_RETURN(gpu::PinnedBuffer module_buf,
                     param_write_pool_->Acquire(static_cast<size_t>(
                         IoBytes(std::max<int64_t>(layout_->max_module_bytes(), 1)))));
    nvme_params_->set_init_buffer(std::move(module_buf));
  }
  std::vector<float> scratch;
  std::span<const float> values;
  int current = -1;
  for (size_t g = 0; g < layout_->num_groups(); ++g) {
    const SubGroup& sg = layout_->group(g);
    // Every rank publishes every parameter; only the owner keeps its states.
    const bool owned = part_.OwnsGroup(g);
    float* group_master = nullptr;
    if (owned) {
      ASSIGN_OR_RETURN(group_master, states_->InitTarget(g));
    }
    for (const Layout::Slice& sl : layout_->Slices(sg.elem_begin, sg.elem_end)) {
      const ParamRec& p = layout_->param(sl.param);
      if (sl.param != current) {
        values = master_of(sl.param, scratch);
        current = sl.param;
        if (static_cast<int64_t>(values.size()) < p.numel)
          return InvalidArgumentError(fmt::format("initial values of parameter {}: {} of {}",
                                                  p.name, values.size(), p.numel));
      }
      const int64_t first = sl.elem_begin - p.elem_off;
      const int64_t count = sl.elem_end - sl.elem_begin;
      if (owned)
        std::memcpy(group_master + (sl.elem_begin - sg.elem_begin), values.data() + first,
                    static_cast<size_t>(count) * sizeof(float));
      RETURN_IF_ERROR(params_->InitElems(p, first, count, values, &initial_nvme_bytes_));
    }
    if (owned) RETURN_IF_ERROR(states_->InitGroup(g, &initial_nvme_bytes_));
  }
  RETURN_IF_ERROR(states_->FinishInit());
  return params_->FinishInit(&initial_nvme_bytes_);
}

nvme::IoHandle StateStore::ReadStates(size_t g, const StatePiece& pc, void* buf) {
  return nvme_states_->Read(g, pc, buf);
}

nvme::IoHandle StateStore::WriteStates(size_t g, const StatePiece& pc, const void* buf) {
  return nvme_states_->Write(g, pc, buf);
}

nvme::IoHandle StateStore::ReadModule(int m, void* buf, bool updated) {
  return nvme_params_->Read(m, buf, updated);
}

nvme::IoHandle StateStore::WriteModule(int m, const void* buf) {
  return nvme_params_->Write(m, buf);
}

StatusOr<PartBytes> StateStore::PartOf(int m, bool updated, bool to_host, AlignedBuffer* piece) {
  if (!params_partitioned())
    return FailedPreconditionError(
        fmt::format("PartOf({}): the parameters are not partitioned", m));
  return params_->PartOf(m, updated, to_host, piece);
}

const uint8_t* StateStore::FetchSource(int m, bool updated) {
  return params_->FetchSource(m, updated);
}

Status StateStore::UploadModule(int m, gpu::Event& ready) {
  return device_params_->UploadModule(m, ready);
}

Status StateStore::ReadMaster(const ParamRec& p, std::span<float> out) {
  return states_->ReadMaster(p, out);
}

Status StateStore::WriteMaster(const ParamRec& p, std::span<const float> values) {
  // The working-precision copy: partitioned, this rank's elements; else the
  // whole module read, patched and written back.
  if (params_partitioned()) {
    RETURN_IF_ERROR(params_->WriteOwnedElems(p, values));
  } else {
    RETURN_IF_ERROR(WriteWorkingCopy(p, values));
  }
  return states_->WriteMaster(p, values);
}

Status StateStore::WriteWorkingCopy(const ParamRec& p, std::span<const float> values) {
  // The working-precision copy: the module's bytes, read, patched, written back.
  const ModuleExtent& me = layout_->module(p.module);
  ASSIGN_OR_RETURN(AlignedBuffer mod,
                   AlignedBuffer::Allocate(static_cast<size_t>(IoBytes(me.bytes())), kIoAlign));
  RETURN_IF_ERROR(ReadModuleParams(p.module, mod.data()));
  uint8_t* dst = mod.as<uint8_t>() + (p.byte_off - me.byte_begin);
  for (size_t i = 0; i < values.size(); ++i) StoreFromFloat(dst, p.dtype, i, values[i]);
  return WriteModuleParams(p.module, mod.data());
}

Status StateStore::ReadGroupStates(size_t g, void* buf) { return states_->ReadGroup(g, buf); }

Status StateStore::WriteGroupStates(size_t g, const void* buf) {
  return states_->WriteGroup(g, buf);
}

Status StateStore::ReadModuleParams(int m, void* buf) {
  if (layout_->module(m).bytes() == 0) return Status();
  if (params_partitioned())
    return FailedPreconditionError(fmt::format(
        "ReadModuleParams({}): the parameters are partitioned; the module comes from the ranks",
        m));
  return params_->ReadModule(m, buf);
}

Status StateStore::WriteModuleParams(int m, const void* buf) {
  if (layout_->module(m).bytes() == 0) return Status();
  return params_->WriteModule(m, buf);
}

Status StateStore::Commit(const StepOutcome& outcome, const std::vector<uint8_t>& uploaded) {
  states_->Commit(outcome);
  return params_->Commit(outcome, uploaded);
}

void StateStore::Rollback(const std::vector<uint8_t>& uploaded, int64_t step) {
  params_->Rollback(uploaded, step);
}

}  // namespace strata::scheduler
