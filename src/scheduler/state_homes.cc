#include "src/scheduler/state_homes.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "src/common/status_util.h"
#include "src/scheduler/state_store.h"

namespace strata::scheduler {

std::string ModuleShardName(int module, int version) {
  return fmt::format("param.m{}.v{}", module, version);
}

std::string StateShardName(size_t group, int version) {
  return fmt::format("state.g{}.v{}", group, version);
}

int64_t StateHome::pinned_bytes() const {
  int64_t bytes = 0;
  for (const HostArray& a : arrays_) bytes += a.pinned() ? a.bytes() : 0;
  return bytes;
}

std::pair<int64_t, int64_t> StateHome::Owned(const ParamRec& p) const {
  const auto [own0, own1] = ctx_->part->elems();
  const int64_t ob = std::max(own0, p.elem_off);
  return {ob, std::max(ob, std::min(own1, p.elem_off + p.numel))};
}

namespace {

constexpr size_t kF = sizeof(float);

// offload_optimizer cpu: three DRAM arrays (page-locked with pin_memory).
class HostStates final : public StateHome {
 public:
  explicit HostStates(const StoreContext* ctx) : StateHome(ctx) {}

  Status Allocate(bool pinned) override {
    const int64_t bytes = kMasterBytesPerElem * ctx_->layout->partition_elems();
    for (HostArray& a : arrays_)
      RETURN_IF_ERROR(a.Allocate(bytes, pinned ? ctx_->dev : nullptr, "optimizer states"));
    master_ = arrays_[0].as<float>();
    exp_avg_ = arrays_[1].as<float>();
    exp_avg_sq_ = arrays_[2].as<float>();
    // The layout's alignment padding holds zeros (layout.h).
    std::memset(master_, 0, static_cast<size_t>(bytes));
    return Status();
  }
  StatusOr<float*> InitTarget(size_t g) override {
    return master_ + (ctx_->layout->group(g).elem_begin - ctx_->part->state_base());
  }
  Status InitGroup(size_t, int64_t*) override { return Status(); }
  Status FinishInit() override {
    const auto n = static_cast<size_t>(ctx_->layout->partition_elems());
    std::memset(exp_avg_, 0, n * kF);
    std::memset(exp_avg_sq_, 0, n * kF);
    return Status();
  }
  Status ReadGroup(size_t g, void* buf) override {
    const SubGroup& sg = ctx_->layout->group(g);
    const int64_t at = sg.elem_begin - ctx_->part->state_base();
    const size_t bytes = static_cast<size_t>(sg.elems()) * kF;
    const float* arrays[] = {master_, exp_avg_, exp_avg_sq_};
    for (int a = 0; a < kOptimizerStateArrays; ++a)
      std::memcpy(static_cast<uint8_t*>(buf) + a * bytes, arrays[a] + at, bytes);
    return Status();
  }
  Status WriteGroup(size_t g, const void* buf) override {
    const SubGroup& sg = ctx_->layout->group(g);
    const int64_t at = sg.elem_begin - ctx_->part->state_base();
    const size_t bytes = static_cast<size_t>(sg.elems()) * kF;
    float* arrays[] = {master_, exp_avg_, exp_avg_sq_};
    for (int a = 0; a < kOptimizerStateArrays; ++a)
      std::memcpy(arrays[a] + at, static_cast<const uint8_t*>(buf) + a * bytes, bytes);
    return Status();
  }
  Status ReadMaster(const ParamRec& p, std::span<float> out) override {
    const auto [ob, oe] = Owned(p);
    if (ob < oe)
      std::memcpy(out.data() + (ob - p.elem_off), master_ + (ob - ctx_->part->state_base()),
                  static_cast<size_t>(oe - ob) * kF);
    return Status();
  }
  Status WriteMaster(const ParamRec& p, std::span<const float> values) override {
    const auto [ob, oe] = Owned(p);
    if (ob < oe)
      std::memcpy(master_ + (ob - ctx_->part->state_base()), values.data() + (ob - p.elem_off),
                  static_cast<size_t>(oe - ob) * kF);
    return Status();
  }
};

// offload_optimizer none: three arrays in the device arena.
class DeviceStates final : public StateHome {
 public:
  explicit DeviceStates(const StoreContext* ctx) : StateHome(ctx) {}

  Status Allocate(bool) override {
    const auto bytes = static_cast<size_t>(kMasterBytesPerElem * ctx_->layout->partition_elems());
    for (gpu::DeviceBuffer* b : {&master_d_, &exp_avg_d_, &exp_avg_sq_d_}) {
      ASSIGN_OR_RETURN(*b, ctx_->dev->Allocate(bytes));
    }
    master_ = master_d_.as<float>();
    exp_avg_ = exp_avg_d_.as<float>();
    exp_avg_sq_ = exp_avg_sq_d_.as<float>();
    return Status();
  }
  // The masters are gathered in host memory, copied to the arena at the end.
  StatusOr<float*> InitTarget(size_t g) override {
    if (init_.empty()) init_.assign(static_cast<size_t>(ctx_->layout->partition_elems()), 0.f);
    return init_.data() + (ctx_->layout->group(g).elem_begin - ctx_->part->state_base());
  }
  Status InitGroup(size_t, int64_t*) override { return Status(); }
  Status FinishInit() override {
    const auto n = static_cast<size_t>(ctx_->layout->partition_elems());
    if (init_.empty()) init_.assign(n, 0.f);  // (no owned sub-group)
    gpu::Stream& s = ctx_->dev->compute();
    RETURN_IF_ERROR(ctx_->dev->CopyH2D(master_, init_.data(), n * kF, s));
    RETURN_IF_ERROR(ctx_->dev->Fill(exp_avg_, DType::kFp32, n, 0.f, s));
    RETURN_IF_ERROR(ctx_->dev->Fill(exp_avg_sq_, DType::kFp32, n, 0.f, s));
    RETURN_IF_ERROR(s.Synchronize());
    init_ = std::vector<float>();
    return Status();
  }
  Status ReadGroup(size_t g, void* buf) override {
    const SubGroup& sg = ctx_->layout->group(g);
    const int64_t at = sg.elem_begin - ctx_->part->state_base();
    const size_t bytes = static_cast<size_t>(sg.elems()) * kF;
    const float* arrays[] = {master_, exp_avg_, exp_avg_sq_};
    gpu::Stream& s = ctx_->dev->d2h();
    for (int a = 0; a < kOptimizerStateArrays; ++a)
      RETURN_IF_ERROR(
          ctx_->dev->CopyD2H(static_cast<uint8_t*>(buf) + a * bytes, arrays[a] + at, bytes, s));
    return s.Synchronize();
  }
  Status WriteGroup(size_t g, const void* buf) override {
    const SubGroup& sg = ctx_->layout->group(g);
    const int64_t at = sg.elem_begin - ctx_->part->state_base();
    const size_t bytes = static_cast<size_t>(sg.elems()) * kF;
    float* arrays[] = {master_, exp_avg_, exp_avg_sq_};
    gpu::Stream& s = ctx_->dev->h2d();
    for (int a = 0; a < kOptimizerStateArrays; ++a)
      RETURN_IF_ERROR(ctx_->dev->CopyH2D(arrays[a] + at,
                                         static_cast<const uint8_t*>(buf) + a * bytes, bytes, s));
    return s.Synchronize();
  }
  Status ReadMaster(const ParamRec& p, std::span<float> out) override {
    const auto [ob, oe] = Owned(p);
    if (ob >= oe) return Status();
    gpu::Stream& s = ctx_->dev->compute();
    RETURN_IF_ERROR(ctx_->dev->CopyD2H(out.data() + (ob - p.elem_off),
                                       master_ + (ob - ctx_->part->state_base()),
                                       static_cast<size_t>(oe - ob) * kF, s));
    return s.Synchronize().WithContext("ReadParameter " + p.name);
  }
  Status WriteMaster(const ParamRec& p, std::span<const float> values) override {
    const auto [ob, oe] = Owned(p);
    if (ob >= oe) return Status();
    gpu::Stream& s = ctx_->dev->compute();
    RETURN_IF_ERROR(ctx_->dev->CopyH2D(master_ + (ob - ctx_->part->state_base()),
                                       values.data() + (ob - p.elem_off),
                                       static_cast<size_t>(oe - ob) * kF, s));
    return s.Synchronize().WithContext("WriteParameter " + p.name);
  }

 private:
  gpu::DeviceBuffer master_d_, exp_avg_d_, exp_avg_sq_d_;
  std::vector<float> init_;
};

}  // namespace

std::unique_ptr<StateHome> StateHome::For(OffloadDevice place, const StoreContext* ctx) {
  switch (place) {
    case OffloadDevice::kNone:
      return std::make_unique<DeviceStates>(ctx);
    case OffloadDevice::kCpu:
      return std::make_unique<HostStates>(ctx);
    case OffloadDevice::kNvme:
      return std::make_unique<NvmeStates>(ctx);
  }
  return nullptr;
}

// ---- NvmeStates ----------------------------------------------------------------

Status NvmeStates::Allocate(bool) {
  version_.assign(ctx_->layout->num_groups(), 0);
  return Status();
}

StatusOr<float*> NvmeStates::InitTarget(size_t g) {
  if (init_buf_.data() == nullptr)
    return FailedPreconditionError("NvmeStates: no buffer to initialize the states in");
  // master | exp_avg = 0 | exp_avg_sq = 0
  std::memset(init_buf_.data(), 0, static_cast<size_t>(ctx_->layout->group(g).state_io_bytes()));
  return init_buf_.as<float>();
}

Status NvmeStates::InitGroup(size_t g, int64_t* nvme_bytes) {
  const int64_t bytes = ctx_->layout->group(g).state_io_bytes();
  nvme::IoHandle h =
      ctx_->swap->Write(StateShardName(g, 0), 0, init_buf_.data(), static_cast<size_t>(bytes));
  RETURN_IF_ERROR(h.Wait().WithContext("initializing optimizer state on NVMe"));
  ctx_->counters->AddNvmeWritten(bytes);
  *nvme_bytes += bytes;
  return Status();
}

Status NvmeStates::FinishInit() {
  init_buf_ = gpu::PinnedBuffer();
  return Status();
}

nvme::IoHandle NvmeStates::Read(size_t g, void* buf) {
  return ctx_->swap->Read(StateShardName(g, version_[g]), 0, buf,
                          static_cast<size_t>(ctx_->layout->group(g).state_io_bytes()));
}

nvme::IoHandle NvmeStates::Write(size_t g, const void* buf) {
  return ctx_->swap->Write(StateShardName(g, 1 - version_[g]), 0, buf,
                           static_cast<size_t>(ctx_->layout->group(g).state_io_bytes()));
}

Status NvmeStates::ReadGroup(size_t g, void* buf) {
  return Read(g, buf).Wait().WithContext(
      fmt::format("reading the optimizer states of sub-group {} for a checkpoint", g));
}

// (The active version, in place: the swap store is scratch space; the next
// step reads it.)
Status NvmeStates::WriteGroup(size_t g, const void* buf) {
  return ctx_->swap
      ->Write(StateShardName(g, version_[g]), 0, buf,
              static_cast<size_t>(ctx_->layout->group(g).state_io_bytes()))
      .Wait()
      .WithContext(fmt::format("restoring the optimizer states of sub-group {}", g));
}

Status NvmeStates::ReadMaster(const ParamRec& p, std::span<float> out) {
  // From the sub-groups' active versions: the master is the first third.
  const auto [g0, g1] = ctx_->part->groups();
  for (size_t g = g0; g < g1; ++g) {
    const SubGroup& sg = ctx_->layout->group(g);
    const int64_t b = std::max(sg.elem_begin, p.elem_off);
    const int64_t e = std::min(sg.elem_end, p.elem_off + p.numel);
    if (b >= e) continue;
    // The master's pages of this group, read whole (page-aligned, see kIoAlign).
    const int64_t first = kMasterBytesPerElem * (b - sg.elem_begin);
    const int64_t last = kMasterBytesPerElem * (e - sg.elem_begin);
    const int64_t page0 = first / kIoAlign * kIoAlign;
    const int64_t len = IoBytes(last) - page0;
    ASSIGN_OR_RETURN(AlignedBuffer tmp,
                     AlignedBuffer::Allocate(static_cast<size_t>(len), kIoAlign));
    nvme::IoHandle h =
        ctx_->swap->Read(StateShardName(g, version_[g]), static_cast<uint64_t>(page0), tmp.data(),
                         static_cast<size_t>(len));
    RETURN_IF_ERROR(h.Wait().WithContext("ReadParameter " + p.name));
    std::memcpy(out.data() + (b - p.elem_off), tmp.as<uint8_t>() + (first - page0),
                static_cast<size_t>(last - first));
  }
  return Status();
}

Status NvmeStates::WriteMaster(const ParamRec& p, std::span<const float> values) {
  // Into the sub-groups' active versions (master | exp_avg | exp_avg_sq),
  // each group read and written whole.
  const auto [g0, g1] = ctx_->part->groups();
  for (size_t g = g0; g < g1; ++g) {
    const SubGroup& sg = ctx_->layout->group(g);
    const int64_t b = std::max(sg.elem_begin, p.elem_off);
    const int64_t e = std::min(sg.elem_end, p.elem_off + p.numel);
    if (b >= e) continue;
    ASSIGN_OR_RETURN(AlignedBuffer states,
                     AlignedBuffer::Allocate(static_cast<size_t>(sg.state_io_bytes()), kIoAlign));
    RETURN_IF_ERROR(ReadGroup(g, states.data()));
    std::memcpy(states.as<float>() + (b - sg.elem_begin), values.data() + (b - p.elem_off),
                static_cast<size_t>(e - b) * kF);
    RETURN_IF_ERROR(WriteGroup(g, states.data()));
  }
  return Status();
}

void NvmeStates::Commit(const StepOutcome& outcome) {
  if (outcome.states_written)
    for (int& v : version_) v = 1 - v;
}

}  // namespace strata::scheduler
