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

namespace strata::scheduler {

using gpu::Device;
using gpu::PinnedPool;

// ---- StateStore --------------------------------------------------------------

StateStore::StateStore(Device* device, const Layout* layout, const Partition& partition,
                       StepCounters* counters, const Config* config)
    : dev_(device), layout_(layout), counters_(counters), cfg_(config), part_(partition) {
  ctx_.dev = device;
  ctx_.layout = layout;
  ctx_.part = &partition;
  ctx_.counters = counters;
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
  return OptimizerBufferBytes(layout_->max_group_elems(), false);
}

int64_t StateStore::optimizer_buffer_bytes() const {
  return OptimizerBufferBytes(layout_->max_group_elems(), grads_on_nvme_);
}

nvme::IoHandle StateStore::ReadGrads(size_t g, void* buf, int64_t bytes) {
  return swap_->Read(GradShard(g), 0, buf, static_cast<size_t>(bytes));
}

nvme::IoHandle StateStore::WriteGrads(size_t g, const void* buf, int64_t bytes) {
  return swap_->Write(GradShard(g), 0, buf, static_cast<size_t>(bytes));
}

int64_t StateStore::pinned_array_bytes() const {
  int64_t bytes = 0;
  for (const HostArray* a : {&host_params_, &next_params_}) bytes += a->pinned() ? a->bytes() : 0;
  return bytes + (states_ ? states_->pinned_bytes() : 0);
}

Status StateStore::Open(
    const TierPlan& plan, const std::vector<PinnedPool::Region>& extra_fixed_buffers,
    const std::function<std::unique_ptr<nvme::IoEngine>(std::unique_ptr<nvme::IoEngine>)>&
        wrap_io_engine,
    int64_t* pinned_bytes) {
  placement_ = plan.placement;
  const int64_t param_bytes = param_array_bytes();
  Device* pin_par = plan.pin_param_copies ? dev_ : nullptr;
  grads_on_nvme_ = plan.grads_on_nvme;
  // offload_param nvme: updated parameters go through write-back buffers
  // (with several ranks too: the parameters are partitioned, offload_param
  // being stage 3's).
  if (placement_.params != OffloadDevice::kNvme)
    RETURN_IF_ERROR(next_params_.Allocate(param_bytes, pin_par, "updated parameters"));

  states_ = StateHome::For(placement_.optimizer, &ctx_);
  if (placement_.optimizer == OffloadDevice::kNvme)
    nvme_states_ = static_cast<NvmeStates*>(states_.get());
  RETURN_IF_ERROR(states_->Allocate(placement_.pin_optimizer_states));
  switch (placement_.params) {
    case OffloadDevice::kNone: {
      ASSIGN_OR_RETURN(device_params_, dev_->Allocate(static_cast<size_t>(param_bytes)));
      ASSIGN_OR_RETURN(params_uploaded_, dev_->CreateEvent());
      // With the step overlapping the next forward, modules are uploaded
      // one by one as the step finishes them; the mirror holds the previous
      // parameters so that a step failing half-way can be undone.
      mirror_params_ = placement_.param_mirror();
      if (mirror_params_)
        RETURN_IF_ERROR(host_params_.Allocate(param_bytes, pin_par, "parameter mirror"));
      break;
    }
    case OffloadDevice::kCpu:
      RETURN_IF_ERROR(host_params_.Allocate(param_bytes, pin_par, "parameters"));
      break;
    case OffloadDevice::kNvme:
      module_version_.assign(static_cast<size_t>(layout_->num_modules()), 0);
      break;
  }
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
  // (the all-parameter array, or with offload_param nvme the module's NVMe
  // version written when the next module begins). Nothing over every
  // parameter is held when both live on NVMe.
  const bool nvme_params = placement_.params == OffloadDevice::kNvme;
  uint8_t* next = next_params();  // null with offload_param nvme
  if (next != nullptr) std::memset(next, 0, static_cast<size_t>(param_array_bytes()));
  // Partitioned parameters: only this rank's elements are published.
  const auto [own0, own1] = part_.elems();
  const int64_t pbase = param_byte_base();
  // (The layout's alignment padding holds zeros: layout.h.)
  if (nvme_states_ != nullptr) {
    ASSIGN_OR_RETURN(gpu::PinnedBuffer group_buf,
                     opt_pool_->Acquire(static_cast<size_t>(optimizer_buffer_bytes())));
    nvme_states_->set_init_buffer(std::move(group_buf));
  }
  gpu::PinnedBuffer module_buf;
  if (nvme_params) {
    ASSIGN_OR_RETURN(module_buf, param_write_pool_->Acquire(static_cast<size_t>(
                                     IoBytes(std::max<int64_t>(layout_->max_module_bytes(), 1)))));
  }
  int open_module = -1;
  auto write_module = [&]() -> Status {
    if (open_module < 0) return Status();
    // Partitioned: this rank's piece, moved to the buffer's start.
    const auto [lo, hi] = ModulePiece(open_module);
    if (hi <= lo) {
      open_module = -1;
      return Status();
    }
    const int64_t begin = layout_->module(open_module).byte_begin;
    if (lo > begin)
      std::memmove(module_buf.data(), module_buf.as<uint8_t>() + (lo - begin),
                   static_cast<size_t>(hi - lo));
    const int64_t bytes = IoBytes(hi - lo);
    nvme::IoHandle h =
        swap_->Write(ModuleShard(open_module, 0), 0, module_buf.data(), static_cast<size_t>(bytes));
    RETURN_IF_ERROR(h.Wait().WithContext(
        fmt::format("initializing the parameters of module {} on NVMe", open_module)));
    counters_->AddNvmeWritten(bytes);
    initial_nvme_bytes_ += bytes;
    open_module = -1;
    return Status();
  };
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
      uint8_t* param_bytes = nullptr;
      if (nvme_params) {
        const ModuleExtent& me = layout_->module(p.module);
        if (p.module != open_module) {
          RETURN_IF_ERROR(write_module());
          open_module = p.module;
          std::memset(module_buf.data(), 0, static_cast<size_t>(IoBytes(me.bytes())));
        }
        param_bytes = module_buf.as<uint8_t>() + (p.byte_off - me.byte_begin);
      } else if (params_partitioned()) {
        // Element i of p at byte p.byte_off + i * size, this rank's from pbase.
        const int64_t lo = std::max(sl.elem_begin, own0) - p.elem_off;
        const int64_t hi = std::min(sl.elem_end, own1) - p.elem_off;
        for (int64_t i = lo; i < hi; ++i)
          StoreFromFloat(next + (p.byte_off - pbase), p.dtype, static_cast<size_t>(i),
                         values[static_cast<size_t>(i)]);
        continue;
      } else {
        param_bytes = next + p.byte_off;
      }
      for (int64_t i = first; i < first + count; ++i)
        StoreFromFloat(param_bytes, p.dtype, static_cast<size_t>(i),
                       values[static_cast<size_t>(i)]);
    }
    if (owned) RETURN_IF_ERROR(states_->InitGroup(g, &initial_nvme_bytes_));
  }
  RETURN_IF_ERROR(write_module());
  RETURN_IF_ERROR(states_->FinishInit());
  // Publish the initial parameters (offload_param nvme: written above).
  const int64_t param_bytes = param_array_bytes();
  switch (placement_.params) {
    case OffloadDevice::kNone:
      RETURN_IF_ERROR(dev_->CopyH2D(device_params_.data(), next, static_cast<size_t>(param_bytes),
                                    dev_->h2d()));
      RETURN_IF_ERROR(dev_->h2d().Record(*params_uploaded_));
      RETURN_IF_ERROR(dev_->h2d().Synchronize());
      counters_->AddCopyBytes(Link::kH2D, param_bytes);
      if (mirror_params_) std::memcpy(host_params_.data(), next, static_cast<size_t>(param_bytes));
      break;
    case OffloadDevice::kCpu:
      std::memcpy(host_params_.data(), next, static_cast<size_t>(param_bytes));
      break;
    case OffloadDevice::kNvme:
      break;
  }
  return Status();
}

nvme::IoHandle StateStore::ReadStates(size_t g, void* buf) { return nvme_states_->Read(g, buf); }

nvme::IoHandle StateStore::WriteStates(size_t g, const void* buf) {
  return nvme_states_->Write(g, buf);
}

nvme::IoHandle StateStore::ReadModule(int m, void* buf, bool updated) {
  const int v = module_version_[static_cast<size_t>(m)];
  const auto [lo, hi] = ModulePiece(m);
  return swap_->Read(ModuleShard(m, updated ? 1 - v : v), 0, buf,
                     static_cast<size_t>(IoBytes(hi - lo)));
}

nvme::IoHandle StateStore::WriteModule(int m, const void* buf) {
  const auto [lo, hi] = ModulePiece(m);
  return swap_->Write(ModuleShard(m, 1 - module_version_[static_cast<size_t>(m)]), 0, buf,
                      static_cast<size_t>(IoBytes(hi - lo)));
}

Status StateStore::ReadPiece(int m, AlignedBuffer* piece) {
  const auto [lo, hi] = ModulePiece(m);
  ASSIGN_OR_RETURN(
      *piece, AlignedBuffer::Allocate(static_cast<size_t>(IoBytes(std::max<int64_t>(1, hi - lo))),
                                      kIoAlign));
  if (hi <= lo) return Status();
  const int64_t t0 = NowNanos();
  RETURN_IF_ERROR(
      ReadModule(m, piece->data())
          .Wait()
          .WithContext(fmt::format("reading this rank's part of module {} from NVMe", m)));
  counters_->NoteNvme(t0, NowNanos(), IoBytes(hi - lo), false, fmt::format("read module {}", m));
  return Status();
}

Status StateStore::WritePiece(int m, const AlignedBuffer& piece) {
  const auto [lo, hi] = ModulePiece(m);
  if (hi <= lo) return Status();
  return swap_
      ->Write(ModuleShard(m, module_version_[static_cast<size_t>(m)]), 0, piece.data(),
              static_cast<size_t>(IoBytes(hi - lo)))
      .Wait()
      .WithContext(fmt::format("writing this rank's part of module {} to NVMe", m));
}

StatusOr<PartBytes> StateStore::PartOf(int m, bool updated, bool to_host, AlignedBuffer* piece) {
  if (!params_partitioned())
    return FailedPreconditionError(
        fmt::format("PartOf({}): the parameters are not partitioned", m));
  if (placement_.params == OffloadDevice::kNvme) {
    RETURN_IF_ERROR(ReadPiece(m, piece));
    return PartBytes{piece->as<uint8_t>(), ModulePiece(m).first};
  }
  if (gathers_on_device() && to_host) {
    const auto [lo, hi] = ModulePiece(m);
    ASSIGN_OR_RETURN(*piece, AlignedBuffer::Allocate(
                                 static_cast<size_t>(std::max<int64_t>(1, hi - lo)), kIoAlign));
    if (hi > lo) {
      // The device block is current once its last upload has landed.
      RETURN_IF_ERROR(params_uploaded_->Synchronize());
      RETURN_IF_ERROR(dev_->CopyD2H(piece->data(), device_params() + (lo - param_byte_base()),
                                    static_cast<size_t>(hi - lo), dev_->d2h()));
      RETURN_IF_ERROR(dev_->d2h().Synchronize());
    }
    return PartBytes{piece->as<uint8_t>(), lo};
  }
  if (gathers_on_device()) return PartBytes{device_params(), param_byte_base()};
  return PartBytes{updated ? next_params() : host_params_.as<uint8_t>(), param_byte_base()};
}

const uint8_t* StateStore::FetchSource(int m, bool updated) {
  const int64_t off = layout_->module(m).byte_begin;
  if (placement_.params == OffloadDevice::kNvme || params_partitioned()) return nullptr;
  if (updated) return next_params() + off;
  if (placement_.params == OffloadDevice::kCpu) return host_params_.as<uint8_t>() + off;
  return nullptr;
}

Status StateStore::UploadModule(int m, gpu::Event& ready) {
  const ModuleExtent& me = layout_->module(m);
  RETURN_IF_ERROR(counters_->TimedCopy(
      dev_->h2d(), Link::kH2D, fmt::format("updated module {}", m), me.bytes(), [&] {
        return dev_->CopyH2D(device_params() + me.byte_begin, next_params() + me.byte_begin,
                             static_cast<size_t>(me.bytes()), dev_->h2d());
      }));
  return dev_->h2d().Record(ready);
}

Status StateStore::UploadPart(int64_t offset, size_t bytes) {
  RETURN_IF_ERROR(params_uploaded_->Synchronize());
  RETURN_IF_ERROR(
      dev_->CopyH2D(device_params() + offset, next_params() + offset, bytes, dev_->h2d()));
  RETURN_IF_ERROR(dev_->h2d().Record(*params_uploaded_));
  return dev_->h2d().Synchronize();
}

Status StateStore::ReadMaster(const ParamRec& p, std::span<float> out) {
  return states_->ReadMaster(p, out);
}

Status StateStore::WriteMaster(const ParamRec& p, std::span<const float> values) {
  const auto [own0, own1] = part_.elems();
  if (params_partitioned()) {
    // The working-precision copy: this rank's elements, in both arrays.
    const int64_t pbase = param_byte_base();
    const int64_t lo = std::max(own0, p.elem_off) - p.elem_off;
    const int64_t hi = std::min(own1, p.elem_off + p.numel) - p.elem_off;
    for (HostArray* a : {&host_params_, &next_params_}) {
      if (a->data() == nullptr) continue;  // (offload_param none: no mirror)
      for (int64_t i = lo; i < hi; ++i)
        StoreFromFloat(a->as<uint8_t>() + (p.byte_off - pbase), p.dtype, static_cast<size_t>(i),
                       values[static_cast<size_t>(i)]);
    }
    if (placement_.params == OffloadDevice::kNone && lo < hi)
      RETURN_IF_ERROR(UploadPart(p.byte_off - pbase + lo * p.elem_size(),
                                 static_cast<size_t>((hi - lo) * p.elem_size())));
    if (placement_.params == OffloadDevice::kNvme && lo < hi) {
      // This rank's piece of the module on NVMe: read, patched, written back.
      AlignedBuffer piece;
      RETURN_IF_ERROR(ReadPiece(p.module, &piece));
      const int64_t first = ModulePiece(p.module).first;
      for (int64_t i = lo; i < hi; ++i)
        StoreFromFloat(piece.as<uint8_t>() + (p.byte_off - first), p.dtype, static_cast<size_t>(i),
                       values[static_cast<size_t>(i)]);
      RETURN_IF_ERROR(WritePiece(p.module, piece));
    }
  }
  if (!params_partitioned()) RETURN_IF_ERROR(WriteWorkingCopy(p, values));
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
  const ModuleExtent& me = layout_->module(m);
  if (me.bytes() == 0) return Status();
  if (params_partitioned())
    return FailedPreconditionError(fmt::format(
        "ReadModuleParams({}): the parameters are partitioned; the module comes from the ranks",
        m));
  switch (placement_.params) {
    case OffloadDevice::kNone:
      // The device block is current once its last upload has landed.
      RETURN_IF_ERROR(params_uploaded_->Synchronize());
      RETURN_IF_ERROR(dev_->CopyD2H(buf, device_params() + me.byte_begin,
                                    static_cast<size_t>(me.bytes()), dev_->d2h()));
      return dev_->d2h().Synchronize();
    case OffloadDevice::kCpu:
      std::memcpy(buf, host_params_.as<uint8_t>() + me.byte_begin, static_cast<size_t>(me.bytes()));
      return Status();
    case OffloadDevice::kNvme:
      return ReadModule(m, buf).Wait().WithContext(
          fmt::format("reading the parameters of module {} for a checkpoint", m));
  }
  return Status();
}

Status StateStore::WriteModuleParams(int m, const void* buf) {
  const ModuleExtent& me = layout_->module(m);
  if (me.bytes() == 0) return Status();
  const size_t bytes = static_cast<size_t>(me.bytes());
  if (params_partitioned()) {
    // This rank's part of the module only.
    const auto [lo, hi] = ModulePiece(m);
    const int64_t b0 = param_byte_base();
    if (lo < hi && placement_.params == OffloadDevice::kNvme) {
      // (The active version of this rank's piece, in place.)
      ASSIGN_OR_RETURN(AlignedBuffer piece,
                       AlignedBuffer::Allocate(static_cast<size_t>(IoBytes(hi - lo)), kIoAlign));
      std::memcpy(piece.data(), static_cast<const uint8_t*>(buf) + (lo - me.byte_begin),
                  static_cast<size_t>(hi - lo));
      return WritePiece(m, piece);
    }
    if (lo < hi) {
      const auto* src = static_cast<const uint8_t*>(buf) + (lo - me.byte_begin);
      const auto n = static_cast<size_t>(hi - lo);
      std::memcpy(next_params() + (lo - b0), src, n);
      // (offload_param none: the mirror, if any, and the device block.)
      if (host_params_.data() != nullptr)
        std::memcpy(host_params_.as<uint8_t>() + (lo - b0), src, n);
      if (placement_.params == OffloadDevice::kNone) RETURN_IF_ERROR(UploadPart(lo - b0, n));
    }
    return Status();
  }
  if (placement_.params != OffloadDevice::kNvme)
    std::memcpy(next_params() + me.byte_begin, buf, bytes);
  switch (placement_.params) {
    case OffloadDevice::kNone:
      RETURN_IF_ERROR(params_uploaded_->Synchronize());
      RETURN_IF_ERROR(dev_->CopyH2D(device_params() + me.byte_begin, buf, bytes, dev_->h2d()));
      RETURN_IF_ERROR(dev_->h2d().Record(*params_uploaded_));
      RETURN_IF_ERROR(dev_->h2d().Synchronize());
      if (mirror_params_) std::memcpy(host_params_.as<uint8_t>() + me.byte_begin, buf, bytes);
      return Status();
    case OffloadDevice::kCpu:
      std::memcpy(host_params_.as<uint8_t>() + me.byte_begin, buf, bytes);
      return Status();
    case OffloadDevice::kNvme:
      return swap_
          ->Write(ModuleShard(m, module_version_[static_cast<size_t>(m)]), 0, buf,
                  static_cast<size_t>(IoBytes(me.bytes())))
          .Wait()
          .WithContext(fmt::format("restoring the parameters of module {}", m));
  }
  return Status();
}

Status StateStore::Commit(const StepOutcome& outcome, const std::vector<uint8_t>& uploaded) {
  states_->Commit(outcome);
  switch (placement_.params) {
    case OffloadDevice::kNone: {
      bool any = false, all = true;
      for (int i = 0; i < layout_->num_modules(); ++i) {
        const bool up = uploaded[static_cast<size_t>(i)] != 0;
        any |= up;
        all &= up || layout_->module(i).bytes() == 0;
      }
      auto upload = [&](int64_t b, int64_t bytes, const std::string& what) {
        return counters_->TimedCopy(dev_->h2d(), Link::kH2D, what, bytes, [&] {
          return dev_->CopyH2D(device_params() + b, next_params() + b, static_cast<size_t>(bytes),
                               dev_->h2d());
        });
      };
      if (!any) {
        RETURN_IF_ERROR(upload(0, param_array_bytes(), "updated parameters"));
      } else if (!all) {
        for (int i = 0; i < layout_->num_modules(); ++i) {
          const ModuleExtent& me = layout_->module(i);
          if (uploaded[static_cast<size_t>(i)] || me.bytes() == 0) continue;
          RETURN_IF_ERROR(upload(me.byte_begin, me.bytes(), fmt::format("updated module {}", i)));
        }
      }
      // The next step's copy-out must not overwrite what these copies read:
      // the engine waits for this event before launching it.
      RETURN_IF_ERROR(dev_->h2d().Record(*params_uploaded_));
      // Partitioned: the next gathers read the block on the collectives'
      // stream, which is not ordered after this one.
      if (params_partitioned()) RETURN_IF_ERROR(dev_->h2d().Synchronize());
      if (mirror_params_) host_params_.swap(next_params_);
      break;
    }
    case OffloadDevice::kCpu:
      host_params_.swap(next_params_);
      break;
    case OffloadDevice::kNvme:
      // Only modules whose new version was written flip; one whose write
      // failed (or was never issued) keeps its previous, consistent version.
      for (int m : outcome.param_written)
        module_version_[static_cast<size_t>(m)] = 1 - module_version_[static_cast<size_t>(m)];
      break;
  }
  return Status();
}

void StateStore::Rollback(const std::vector<uint8_t>& uploaded, int64_t step) {
  bool any = false;
  for (uint8_t u : uploaded) any |= u != 0;
  if (!any || !mirror_params_) return;
  const int64_t bytes = param_array_bytes();
  Status s = dev_->CopyH2D(device_params_.data(), host_params_.data(), static_cast<size_t>(bytes),
                           dev_->h2d());
  if (s.ok()) s = dev_->h2d().Record(*params_uploaded_);
  if (s.ok()) s = dev_->h2d().Synchronize();
  if (!s.ok())
    STRATA_LOG_ERROR("rolling back step {}: restoring the device parameters failed: {}", step,
                     s.ToString());
  counters_->AddCopyBytes(Link::kH2D, bytes);
}

}  // namespace strata::scheduler
