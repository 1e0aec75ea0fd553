#include "src/scheduler/state_homes.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "src/common/dtype.h"
#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"

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
  const auto [own0, own1] = range_.second > range_.first ? range_ : ctx_->part->elems();
  const int64_t ob = std::max(own0, p.elem_off);
  return {ob, std::max(ob, std::min(own1, p.elem_off + p.numel))};
}

void StateArrays::Point(int64_t e, cpu_adam::ShardStep* st) const {
  using cpu_adam::StateFormat;
  const auto i = static_cast<size_t>(e - first);
  const bool lion = st->hp.algorithm == cpu_adam::Algorithm::kLion;
  st->states = format;
  st->element_offset = static_cast<uint64_t>(e);
  switch (format) {
    case StateFormat::kFp32:
      st->param = static_cast<float*>(master) + i;
      st->exp_avg = static_cast<float*>(exp_avg) + i;
      st->exp_avg_sq = static_cast<float*>(exp_avg_sq) + i;
      return;
    case StateFormat::kBf16:
    case StateFormat::kBf16Master:
      if (format == StateFormat::kBf16)
        st->param = static_cast<float*>(master) + i;
      else
        st->param_c = static_cast<uint16_t*>(master) + i;
      st->exp_avg_c = static_cast<uint16_t*>(exp_avg) + i;
      st->exp_avg_sq_c = lion ? nullptr : static_cast<uint16_t*>(exp_avg_sq) + i;
      return;
    case StateFormat::kInt8:
      st->param = static_cast<float*>(master) + i;
      st->exp_avg_c = static_cast<uint8_t*>(exp_avg) + i;
      st->exp_avg_scale = exp_avg_scale + i / cpu_adam::kStateBlock;
      if (!lion) {
        st->exp_avg_sq_c = static_cast<uint8_t*>(exp_avg_sq) + i;
        st->exp_avg_sq_scale = exp_avg_sq_scale + i / cpu_adam::kStateBlock;
      }
      return;
  }
}

std::pair<uint8_t*, float*> StateArrays::At(cpu_adam::StateRole role, int64_t e) const {
  const auto i = static_cast<size_t>(e - first);
  const auto r = static_cast<size_t>(role);
  void* const base[] = {master, exp_avg, exp_avg_sq};
  float* const scales[] = {nullptr, exp_avg_scale, exp_avg_sq_scale};
  return {static_cast<uint8_t*>(base[r]) + i * cpu_adam::StateElementBytes(format, role),
          scales[r] != nullptr ? scales[r] + i / cpu_adam::kStateBlock : nullptr};
}

Status StateArrays::Decode(int64_t e, int64_t n, float* out, int64_t stride) const {
  if (stride < 0) stride = n;
  for (int a = 0; a < kOptimizerStateArrays; ++a) {
    const auto role = static_cast<cpu_adam::StateRole>(a);
    const auto [src, scales] = At(role, e);
    RETURN_IF_ERROR(
        cpu_adam::DecodeState(format, role, src, scales, static_cast<size_t>(n), out + a * stride));
  }
  return Status();
}

Status StateArrays::Encode(const float* in, int64_t e, int64_t n, int64_t stride) const {
  if (stride < 0) stride = n;
  for (int a = 0; a < kOptimizerStateArrays; ++a) {
    const auto role = static_cast<cpu_adam::StateRole>(a);
    const auto [dst, scales] = At(role, e);
    RETURN_IF_ERROR(
        cpu_adam::EncodeState(format, role, in + a * stride, static_cast<size_t>(n), dst, scales));
  }
  return Status();
}

StateArrays GroupBufferStates(const SubGroup& sg, cpu_adam::StateFormat f, void* buf) {
  return StatesInBuffer(f, sg.elem_begin, sg.elems(), buf);
}

namespace {
// `bytes` from src to dst: the whole floats with adam->Copy when both ends
// are float-aligned, the rest with memcpy.
Status CopyBytes(cpu_adam::CpuOptimizer* adam, void* dst, const void* src, size_t bytes) {
  size_t floats = 0;
  if (reinterpret_cast<uintptr_t>(dst) % alignof(float) == 0 &&
      reinterpret_cast<uintptr_t>(src) % alignof(float) == 0) {
    floats = bytes / sizeof(float);
    if (floats > 0)
      RETURN_IF_ERROR(adam->Copy(static_cast<float*>(dst), static_cast<const float*>(src), floats));
  }
  const size_t done = floats * sizeof(float);
  if (done < bytes)
    std::memcpy(static_cast<uint8_t*>(dst) + done, static_cast<const uint8_t*>(src) + done,
                bytes - done);
  return Status();
}
}  // namespace

Status CopyStates(cpu_adam::CpuOptimizer* adam, const StateArrays& from, const StateArrays& to,
                  int64_t lo, int64_t hi) {
  if (hi <= lo) return Status();
  const auto n = static_cast<size_t>(hi - lo);
  for (int a = 0; a < kOptimizerStateArrays; ++a) {
    const auto role = static_cast<cpu_adam::StateRole>(a);
    const auto [src, src_scales] = from.At(role, lo);
    const auto [dst, dst_scales] = to.At(role, lo);
    RETURN_IF_ERROR(CopyBytes(adam, dst, src, n * cpu_adam::StateElementBytes(from.format, role)));
    if (src_scales != nullptr && dst_scales != nullptr)
      RETURN_IF_ERROR(CopyBytes(adam, dst_scales, src_scales,
                                sizeof(float) * cpu_adam::StateScaleCount(from.format, role, n)));
  }
  return Status();
}

StateArrays StatesInBuffer(cpu_adam::StateFormat f, int64_t first, int64_t elems, void* buf) {
  const GroupStateLayout l = GroupStatesIn(f, elems);
  auto* b = static_cast<uint8_t*>(buf);
  const bool scaled = l.bytes > l.exp_avg_scale;
  return {.format = f,
          .first = first,
          .master = b + l.master,
          .exp_avg = b + l.exp_avg,
          .exp_avg_sq = b + l.exp_avg_sq,
          .exp_avg_scale = scaled ? reinterpret_cast<float*>(b + l.exp_avg_scale) : nullptr,
          .exp_avg_sq_scale = scaled ? reinterpret_cast<float*>(b + l.exp_avg_sq_scale) : nullptr};
}

namespace {

constexpr size_t kF = sizeof(float);

// offload_optimizer cpu: the states in DRAM (page-locked with pin_memory),
// in their format: master, exp_avg, exp_avg_sq and, for int8, the moments'
// scales (exp_avg's, then exp_avg_sq's).
class HostStates final : public StateHome {
 public:
  // The elements [first, first + n): the partition's, or with sub-groups
  // stepped on the device the rest (SplitStates).
  HostStates(const StoreContext* ctx, int64_t first, int64_t n) : StateHome(ctx), n_(n) {
    range_ = {first, first + n};
  }

  Status Allocate(bool pinned) override {
    using cpu_adam::StateRole;
    const cpu_adam::StateFormat f = ctx_->state_format;
    const int64_t n = n_;
    const int64_t blocks = static_cast<int64_t>(
        cpu_adam::StateScaleCount(f, StateRole::kExpAvg, static_cast<size_t>(n)));
    const StateRole roles[] = {StateRole::kParam, StateRole::kExpAvg, StateRole::kExpAvgSq};
    for (int a = 0; a < kOptimizerStateArrays; ++a)
      RETURN_IF_ERROR(
          arrays_[a].Allocate(n * static_cast<int64_t>(cpu_adam::StateElementBytes(f, roles[a])),
                              pinned ? ctx_->dev : nullptr, "optimizer states"));
    if (blocks > 0)
      RETURN_IF_ERROR(arrays_[3].Allocate(2 * blocks * static_cast<int64_t>(kF),
                                          pinned ? ctx_->dev : nullptr, "optimizer state scales"));
    view_.format = f;
    view_.first = range_.first;
    view_.master = arrays_[0].data();
    view_.exp_avg = arrays_[1].data();
    view_.exp_avg_sq = arrays_[2].data();
    if (blocks > 0) {
      view_.exp_avg_scale = arrays_[3].as<float>();
      view_.exp_avg_sq_scale = view_.exp_avg_scale + blocks;
    }
    if (f == cpu_adam::StateFormat::kFp32) {
      master_ = arrays_[0].as<float>();
      exp_avg_ = arrays_[1].as<float>();
      exp_avg_sq_ = arrays_[2].as<float>();
    }
    // The layout's alignment padding holds zeros (layout.h).
    std::memset(arrays_[0].data(), 0, static_cast<size_t>(arrays_[0].bytes()));
    return Status();
  }
  StatusOr<float*> InitTarget(size_t g) override {
    if (view_.format != cpu_adam::StateFormat::kBf16Master)
      return static_cast<float*>(view_.master) + (ctx_->layout->group(g).elem_begin - view_.first);
    init_.resize(static_cast<size_t>(ctx_->layout->group(g).elems()));
    return init_.data();
  }
  Status InitGroup(size_t g, int64_t*) override {
    if (view_.format != cpu_adam::StateFormat::kBf16Master) return Status();
    const SubGroup& sg = ctx_->layout->group(g);
    return cpu_adam::EncodeState(
        view_.format, cpu_adam::StateRole::kParam, init_.data(), static_cast<size_t>(sg.elems()),
        static_cast<uint16_t*>(view_.master) + (sg.elem_begin - view_.first), nullptr);
  }
  Status FinishInit() override {
    // Zero moments: every format's zero is all-zero bits (int8: code 0 at
    // scale 0).
    init_ = std::vector<float>();
    for (int a = 1; a < 4; ++a)
      if (arrays_[a].bytes() > 0)
        std::memset(arrays_[a].data(), 0, static_cast<size_t>(arrays_[a].bytes()));
    return Status();
  }
  // Checkpoints hold fp32 (master | exp_avg | exp_avg_sq): decoded here,
  // encoded back (exact for bf16; int8's codes and scales come back as they
  // were, StateFormatTest).
  Status ReadGroup(size_t g, void* buf) override {
    const SubGroup& sg = ctx_->layout->group(g);
    return view_.Decode(sg.elem_begin, sg.elems(), static_cast<float*>(buf));
  }
  Status WriteGroup(size_t g, const void* buf) override {
    const SubGroup& sg = ctx_->layout->group(g);
    return view_.Encode(static_cast<const float*>(buf), sg.elem_begin, sg.elems());
  }
  Status ReadMaster(const ParamRec& p, std::span<float> out) override {
    const auto [ob, oe] = Owned(p);
    if (ob >= oe) return Status();
    return cpu_adam::DecodeState(view_.format, cpu_adam::StateRole::kParam,
                                 view_.At(cpu_adam::StateRole::kParam, ob).first, nullptr,
                                 static_cast<size_t>(oe - ob), out.data() + (ob - p.elem_off));
  }
  Status WriteMaster(const ParamRec& p, std::span<const float> values) override {
    const auto [ob, oe] = Owned(p);
    if (ob >= oe) return Status();
    return cpu_adam::EncodeState(view_.format, cpu_adam::StateRole::kParam,
                                 values.data() + (ob - p.elem_off), static_cast<size_t>(oe - ob),
                                 view_.At(cpu_adam::StateRole::kParam, ob).first, nullptr);
  }

 private:
  int64_t n_;
  std::vector<float> init_;  // bf16-master: a sub-group's fp32 masters at initialization
};

// offload_optimizer none (and the sub-groups offload_optimizer.ratio steps
// on the device): the states in the device arena, in their format, laid
// out as HostStates lays them out in DRAM: master, exp_avg, exp_avg_sq
// and, for int8, the moments' scales (exp_avg's, then exp_avg_sq's).
// Checkpoints and parameter reads go through a staging copy in host memory
// in the same layout, decoded and encoded there as HostStates does.
class DeviceStates final : public StateHome {
 public:
  // The elements [first, first + n): the partition's (offload_optimizer
  // none), or the sub-groups stepped on the device (SplitStates).
  DeviceStates(const StoreContext* ctx, int64_t first, int64_t n) : StateHome(ctx), n_(n) {
    range_ = {first, first + n};
  }

  Status Allocate(bool) override {
    using cpu_adam::StateRole;
    const cpu_adam::StateFormat f = ctx_->state_format;
    const auto n = static_cast<size_t>(n_);
    const size_t blocks = cpu_adam::StateScaleCount(f, StateRole::kExpAvg, n);
    const StateRole roles[] = {StateRole::kParam, StateRole::kExpAvg, StateRole::kExpAvgSq};
    for (int a = 0; a < kOptimizerStateArrays; ++a) {
      ASSIGN_OR_RETURN(arrays_d_[a],
                       ctx_->dev->Allocate(n * cpu_adam::StateElementBytes(f, roles[a])));
    }
    if (blocks > 0) {
      ASSIGN_OR_RETURN(arrays_d_[3], ctx_->dev->Allocate(2 * blocks * kF));
    }
    view_ = {.format = f,
             .first = range_.first,
             .master = arrays_d_[0].data(),
             .exp_avg = arrays_d_[1].data(),
             .exp_avg_sq = arrays_d_[2].data(),
             .exp_avg_scale = blocks > 0 ? arrays_d_[3].as<float>() : nullptr,
             .exp_avg_sq_scale = blocks > 0 ? arrays_d_[3].as<float>() + blocks : nullptr};
    if (f == cpu_adam::StateFormat::kFp32) {
      master_ = arrays_d_[0].as<float>();
      exp_avg_ = arrays_d_[1].as<float>();
      exp_avg_sq_ = arrays_d_[2].as<float>();
    }
    return Status();
  }
  // The masters are gathered in host memory, encoded and copied to the
  // arena at the end.
  StatusOr<float*> InitTarget(size_t g) override {
    if (init_.empty()) init_.assign(static_cast<size_t>(n_), 0.f);
    return init_.data() + (ctx_->layout->group(g).elem_begin - range_.first);
  }
  Status InitGroup(size_t, int64_t*) override { return Status(); }
  Status FinishInit() override {
    if (init_.empty()) init_.assign(static_cast<size_t>(n_), 0.f);  // (no owned sub-group)
    // Zero moments and scales: every format's zero is all-zero bits (int8:
    // code 0 at scale 0); the padding's masters are zero too.
    std::vector<uint8_t> host(static_cast<size_t>(StateArrayBytes(view_.format, n_)), 0);
    const StateArrays staged = StatesInBuffer(view_.format, range_.first, n_, host.data());
    RETURN_IF_ERROR(cpu_adam::EncodeState(view_.format, cpu_adam::StateRole::kParam, init_.data(),
                                          static_cast<size_t>(n_), staged.master, nullptr));
    RETURN_IF_ERROR(Upload(staged, range_.first, range_.first + n_, /*master_only=*/false));
    init_ = std::vector<float>();
    return Status();
  }
  // Checkpoints hold fp32 (master | exp_avg | exp_avg_sq): decoded from the
  // staged copy, encoded into it (exact for bf16; int8's codes and scales
  // come back as they were).
  Status ReadGroup(size_t g, void* buf) override {
    const SubGroup& sg = ctx_->layout->group(g);
    std::vector<uint8_t> host;
    ASSIGN_OR_RETURN(StateArrays staged, Download(sg.elem_begin, sg.elem_end, false, &host));
    return staged.Decode(sg.elem_begin, sg.elems(), static_cast<float*>(buf));
  }
  Status WriteGroup(size_t g, const void* buf) override {
    const SubGroup& sg = ctx_->layout->group(g);
    std::vector<uint8_t> host(static_cast<size_t>(StateArrayBytes(view_.format, sg.elems())));
    const StateArrays staged = StatesInBuffer(view_.format, sg.elem_begin, sg.elems(), host.data());
    RETURN_IF_ERROR(staged.Encode(static_cast<const float*>(buf), sg.elem_begin, sg.elems()));
    return Upload(staged, sg.elem_begin, sg.elem_end, false);
  }
  Status ReadMaster(const ParamRec& p, std::span<float> out) override {
    const auto [ob, oe] = Owned(p);
    if (ob >= oe) return Status();
    std::vector<uint8_t> host;
    ASSIGN_OR_RETURN(StateArrays staged, Download(ob, oe, true, &host));
    return cpu_adam::DecodeState(view_.format, cpu_adam::StateRole::kParam, staged.master, nullptr,
                                 static_cast<size_t>(oe - ob), out.data() + (ob - p.elem_off))
        .WithContext("ReadParameter " + p.name);
  }
  Status WriteMaster(const ParamRec& p, std::span<const float> values) override {
    const auto [ob, oe] = Owned(p);
    if (ob >= oe) return Status();
    std::vector<uint8_t> host(static_cast<size_t>(StateArrayBytes(view_.format, oe - ob)));
    const StateArrays staged = StatesInBuffer(view_.format, ob, oe - ob, host.data());
    RETURN_IF_ERROR(cpu_adam::EncodeState(view_.format, cpu_adam::StateRole::kParam,
                                          values.data() + (ob - p.elem_off),
                                          static_cast<size_t>(oe - ob), staged.master, nullptr));
    return Upload(staged, ob, oe, true).WithContext("WriteParameter " + p.name);
  }

 private:
  // Elements [lo, hi) of every array (master only: the master), with int8's
  // scales of the blocks they cover, between the arena and `staged` (host
  // memory laid out by StatesInBuffer from lo), on the compute stream, which
  // orders them after the device Adam's steps.
  // REQUIRES: int8 and not master_only: lo starts a block.
  Status Transfer(const StateArrays& staged, int64_t lo, int64_t hi, bool master_only,
                  bool upload) {
    gpu::Stream& s = ctx_->dev->compute();
    const auto n = static_cast<size_t>(hi - lo);
    for (int a = 0; a < (master_only ? 1 : kOptimizerStateArrays); ++a) {
      const auto role = static_cast<cpu_adam::StateRole>(a);
      const auto [dev, dev_scales] = view_.At(role, lo);
      const auto [host, host_scales] = staged.At(role, lo);
      const size_t bytes = n * cpu_adam::StateElementBytes(view_.format, role);
      RETURN_IF_ERROR(upload ? ctx_->dev->CopyH2D(dev, host, bytes, s)
                             : ctx_->dev->CopyD2H(host, dev, bytes, s));
      if (dev_scales != nullptr && host_scales != nullptr) {
        const size_t sb = kF * cpu_adam::StateScaleCount(view_.format, role, n);
        RETURN_IF_ERROR(upload ? ctx_->dev->CopyH2D(dev_scales, host_scales, sb, s)
                               : ctx_->dev->CopyD2H(host_scales, dev_scales, sb, s));
      }
    }
    return s.Synchronize();
  }
  Status Upload(const StateArrays& staged, int64_t lo, int64_t hi, bool master_only) {
    return Transfer(staged, lo, hi, master_only, true);
  }
  StatusOr<StateArrays> Download(int64_t lo, int64_t hi, bool master_only,
                                 std::vector<uint8_t>* host) {
    host->assign(static_cast<size_t>(StateArrayBytes(view_.format, hi - lo)), 0);
    const StateArrays staged = StatesInBuffer(view_.format, lo, hi - lo, host->data());
    RETURN_IF_ERROR(Transfer(staged, lo, hi, master_only, false));
    return staged;
  }

  int64_t n_;
  gpu::DeviceBuffer arrays_d_[4];  // master, exp_avg, exp_avg_sq, int8's scales
  std::vector<float> init_;
};

}  // namespace

// offload_optimizer cpu with ratio below 1: the first sub-groups' states in
// the arena (DeviceStates, stepped by the device Adam), the rest in DRAM
// (HostStates, the CPU optimizer's). arrays() is the DRAM part's view (from
// its first element); device_arrays() the arena's.
class SplitStates final : public StateHome {
 public:
  explicit SplitStates(const StoreContext* ctx)
      : StateHome(ctx),
        device_(ctx, ctx->part->device_elems().first,
                ctx->part->device_elems().second - ctx->part->device_elems().first),
        host_(ctx, ctx->part->host_elems().first,
              ctx->part->host_elems().second - ctx->part->host_elems().first) {}

  Status Allocate(bool pinned) override {
    RETURN_IF_ERROR(device_.Allocate(false));
    RETURN_IF_ERROR(host_.Allocate(pinned));
    view_ = host_.arrays();
    device_view_ = device_.arrays();
    return Status();
  }
  int64_t pinned_bytes() const override { return host_.pinned_bytes(); }
  StatusOr<float*> InitTarget(size_t g) override { return Of(g).InitTarget(g); }
  Status InitGroup(size_t g, int64_t* nvme_bytes) override {
    return Of(g).InitGroup(g, nvme_bytes);
  }
  Status FinishInit() override {
    RETURN_IF_ERROR(device_.FinishInit());
    return host_.FinishInit();
  }
  Status ReadGroup(size_t g, void* buf) override { return Of(g).ReadGroup(g, buf); }
  Status WriteGroup(size_t g, const void* buf) override { return Of(g).WriteGroup(g, buf); }
  // (A parameter may lie in both parts: each does its own elements.)
  Status ReadMaster(const ParamRec& p, std::span<float> out) override {
    RETURN_IF_ERROR(device_.ReadMaster(p, out));
    return host_.ReadMaster(p, out);
  }
  Status WriteMaster(const ParamRec& p, std::span<const float> values) override {
    RETURN_IF_ERROR(device_.WriteMaster(p, values));
    return host_.WriteMaster(p, values);
  }

 private:
  StateHome& Of(size_t g) {
    if (ctx_->part->DeviceGroup(g)) return device_;
    return host_;
  }
  DeviceStates device_;
  HostStates host_;
};

std::unique_ptr<StateHome> StateHome::For(OffloadDevice place, const StoreContext* ctx) {
  const Partition& part = *ctx->part;
  const int64_t n = ctx->layout->partition_elems();
  switch (place) {
    case OffloadDevice::kNone:
      return std::make_unique<DeviceStates>(ctx, part.state_base(), n);
    case OffloadDevice::kCpu:
      if (part.device_groups() > 0) return std::make_unique<SplitStates>(ctx);
      return std::make_unique<HostStates>(ctx, part.state_base(), n);
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
  // master | exp_avg = 0 | exp_avg_sq = 0 (| scales = 0): every format's
  // zero is all-zero bits. An fp32 master of one piece is filled in place.
  const SubGroup& sg = ctx_->layout->group(g);
  if (InitInPlace()) {
    std::memset(init_buf_.data(), 0, static_cast<size_t>(sg.state_io_bytes()));
    return init_buf_.as<float>();
  }
  // (Zeros: the layout's padding elements are not written.)
  init_.assign(static_cast<size_t>(sg.elems()), 0.f);
  return init_.data();
}

Status NvmeStates::InitGroup(size_t g, int64_t* nvme_bytes) {
  const SubGroup& sg = ctx_->layout->group(g);
  const bool in_place = InitInPlace();
  // Piece by piece through the buffer (one pipeline buffer holds a piece).
  for (const StatePiece& pc : ctx_->layout->StatePieces(g)) {
    if (!in_place) {
      std::memset(init_buf_.data(), 0, static_cast<size_t>(pc.io_bytes));
      RETURN_IF_ERROR(cpu_adam::EncodeState(ctx_->state_format, cpu_adam::StateRole::kParam,
                                            init_.data() + (pc.elem_begin - sg.elem_begin),
                                            static_cast<size_t>(pc.elems()), init_buf_.data(),
                                            nullptr));
    }
    nvme::IoHandle h =
        ctx_->swap->Write(StateShardName(g, 0), static_cast<uint64_t>(pc.shard_offset),
                          init_buf_.data(), static_cast<size_t>(pc.io_bytes));
    RETURN_IF_ERROR(h.Wait().WithContext("initializing optimizer state on NVMe"));
    ctx_->counters->AddNvmeWritten(pc.io_bytes);
    *nvme_bytes += pc.io_bytes;
  }
  return Status();
}

Status NvmeStates::FinishInit() {
  init_buf_ = gpu::PinnedBuffer();
  init_ = std::vector<float>();
  return Status();
}

nvme::IoHandle NvmeStates::Read(size_t g, const StatePiece& pc, void* buf) {
  return ctx_->swap->Read(StateShardName(g, version_[g]), static_cast<uint64_t>(pc.shard_offset),
                          buf, static_cast<size_t>(pc.io_bytes));
}

nvme::IoHandle NvmeStates::Write(size_t g, const StatePiece& pc, const void* buf) {
  return ctx_->swap->Write(StateShardName(g, 1 - version_[g]),
                           static_cast<uint64_t>(pc.shard_offset), buf,
                           static_cast<size_t>(pc.io_bytes));
}

Status NvmeStates::ReadShard(size_t g, int version, AlignedBuffer* out) {
  const auto bytes = static_cast<size_t>(ctx_->layout->group(g).state_io_bytes());
  ASSIGN_OR_RETURN(*out, AlignedBuffer::Allocate(bytes, kIoAlign));
  return ctx_->swap->Read(StateShardName(g, version), 0, out->data(), bytes).Wait();
}

Status NvmeStates::ReadGroup(size_t g, void* buf) {
  const std::string what =
      fmt::format("reading the optimizer states of sub-group {} for a checkpoint", g);
  const SubGroup& sg = ctx_->layout->group(g);
  if (Plain())
    return ctx_->swap
        ->Read(StateShardName(g, version_[g]), 0, buf, static_cast<size_t>(sg.state_io_bytes()))
        .Wait()
        .WithContext(what);
  AlignedBuffer shard;
  RETURN_IF_ERROR(ReadShard(g, version_[g], &shard).WithContext(what));
  auto* out = static_cast<float*>(buf);
  for (const StatePiece& pc : ctx_->layout->StatePieces(g))
    RETURN_IF_ERROR(
        StatesInBuffer(ctx_->state_format, pc.elem_begin, pc.elems(),
                       shard.as<uint8_t>() + pc.shard_offset)
            .Decode(pc.elem_begin, pc.elems(), out + (pc.elem_begin - sg.elem_begin), sg.elems()));
  return Status();
}

// (The active version, in place: the swap store is scratch space; the next
// step reads it.)
Status NvmeStates::WriteGroup(size_t g, const void* buf) {
  const SubGroup& sg = ctx_->layout->group(g);
  const auto bytes = static_cast<size_t>(sg.state_io_bytes());
  AlignedBuffer shard;
  if (!Plain()) {
    ASSIGN_OR_RETURN(shard, AlignedBuffer::Allocate(bytes, kIoAlign));
    std::memset(shard.data(), 0, bytes);
    const auto* in = static_cast<const float*>(buf);
    for (const StatePiece& pc : ctx_->layout->StatePieces(g))
      RETURN_IF_ERROR(
          StatesInBuffer(ctx_->state_format, pc.elem_begin, pc.elems(),
                         shard.as<uint8_t>() + pc.shard_offset)
              .Encode(in + (pc.elem_begin - sg.elem_begin), pc.elem_begin, pc.elems(), sg.elems()));
    buf = shard.data();
  }
  return ctx_->swap->Write(StateShardName(g, version_[g]), 0, buf, bytes)
      .Wait()
      .WithContext(fmt::format("restoring the optimizer states of sub-group {}", g));
}

Status NvmeStates::ReadMaster(const ParamRec& p, std::span<float> out) {
  // From the sub-groups' active versions: the master is the first array of
  // each piece.
  const auto [g0, g1] = ctx_->part->groups();
  const auto mb = static_cast<int64_t>(
      cpu_adam::StateElementBytes(ctx_->state_format, cpu_adam::StateRole::kParam));
  for (size_t g = g0; g < g1; ++g) {
    const SubGroup& sg = ctx_->layout->group(g);
    if (std::max(sg.elem_begin, p.elem_off) >= std::min(sg.elem_end, p.elem_off + p.numel))
      continue;
    for (const StatePiece& pc : ctx_->layout->StatePieces(g)) {
      const int64_t b = std::max(pc.elem_begin, p.elem_off);
      const int64_t e = std::min(pc.elem_end, p.elem_off + p.numel);
      if (b >= e) continue;
      // The master's pages of this piece, read whole (page-aligned, see kIoAlign).
      const int64_t first = pc.shard_offset + mb * (b - pc.elem_begin);
      const int64_t last = pc.shard_offset + mb * (e - pc.elem_begin);
      const int64_t page0 = first / kIoAlign * kIoAlign;
      const int64_t len = IoBytes(last) - page0;
      ASSIGN_OR_RETURN(AlignedBuffer tmp,
                       AlignedBuffer::Allocate(static_cast<size_t>(len), kIoAlign));
      nvme::IoHandle h =
          ctx_->swap->Read(StateShardName(g, version_[g]), static_cast<uint64_t>(page0), tmp.data(),
                           static_cast<size_t>(len));
      RETURN_IF_ERROR(h.Wait().WithContext("ReadParameter " + p.name));
      RETURN_IF_ERROR(cpu_adam::DecodeState(
          ctx_->state_format, cpu_adam::StateRole::kParam, tmp.as<uint8_t>() + (first - page0),
          nullptr, static_cast<size_t>(e - b), out.data() + (b - p.elem_off)));
    }
  }
  return Status();
}

Status NvmeStates::WriteMaster(const ParamRec& p, std::span<const float> values) {
  // Into the sub-groups' active versions, each group read (decoded to
  // master | exp_avg | exp_avg_sq) and written (encoded) whole.
  const auto [g0, g1] = ctx_->part->groups();
  for (size_t g = g0; g < g1; ++g) {
    const SubGroup& sg = ctx_->layout->group(g);
    const int64_t b = std::max(sg.elem_begin, p.elem_off);
    const int64_t e = std::min(sg.elem_end, p.elem_off + p.numel);
    if (b >= e) continue;
    ASSIGN_OR_RETURN(
        AlignedBuffer states,
        AlignedBuffer::Allocate(
            static_cast<size_t>(IoBytes(kOptimizerStateBytesPerElem * sg.elems())), kIoAlign));
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

// ---- Parameter copies -------------------------------------------------------------

namespace strata::scheduler {

int64_t ParamHome::pinned_bytes() const {
  return (next_.pinned() ? next_.bytes() : 0) + (host_.pinned() ? host_.bytes() : 0);
}

void ParamHome::StoreOwned(uint8_t* array, const ParamRec& p, int64_t first, int64_t count,
                           std::span<const float> values) const {
  const Partition& part = *ctx_->part;
  int64_t lo = first, hi = first + count;
  if (part.params_partitioned()) {
    const auto [own0, own1] = part.elems();
    lo = std::max(lo, own0 - p.elem_off);
    hi = std::min(hi, own1 - p.elem_off);
  }
  // Element i of p at byte p.byte_off + i * size, the array's from param_byte_base().
  uint8_t* at = array + (p.byte_off - part.param_byte_base());
  for (int64_t i = lo; i < hi; ++i)
    StoreFromFloat(at, p.dtype, static_cast<size_t>(i), values[static_cast<size_t>(i)]);
}

namespace {

// offload_param cpu: the host copy fetches read, swapped with the copy-out
// target at each commit.
class HostParams final : public ParamHome {
 public:
  explicit HostParams(const StoreContext* ctx) : ParamHome(ctx) {}

  Status Allocate(bool pinned) override {
    const int64_t bytes = ctx_->part->param_array_bytes();
    gpu::Device* pin = pinned ? ctx_->dev : nullptr;
    RETURN_IF_ERROR(next_.Allocate(bytes, pin, "updated parameters"));
    RETURN_IF_ERROR(host_.Allocate(bytes, pin, "parameters"));
    std::memset(next_.data(), 0, static_cast<size_t>(bytes));
    return Status();
  }
  Status InitElems(const ParamRec& p, int64_t first, int64_t count, std::span<const float> values,
                   int64_t*) override {
    StoreOwned(next(), p, first, count, values);
    return Status();
  }
  Status FinishInit(int64_t*) override {
    std::memcpy(host_.data(), next_.data(), static_cast<size_t>(ctx_->part->param_array_bytes()));
    return Status();
  }
  StatusOr<PartBytes> PartOf(int, bool updated, bool, AlignedBuffer*) override {
    return PartBytes{updated ? next() : host_.as<uint8_t>(), ctx_->part->param_byte_base()};
  }
  const uint8_t* FetchSource(int m, bool updated) override {
    if (ctx_->part->params_partitioned()) return nullptr;
    const int64_t off = ctx_->layout->module(m).byte_begin;
    return (updated ? next() : host_.as<uint8_t>()) + off;
  }
  Status ReadModule(int m, void* buf) override {
    const ModuleExtent& me = ctx_->layout->module(m);
    std::memcpy(buf, host_.as<uint8_t>() + me.byte_begin, static_cast<size_t>(me.bytes()));
    return Status();
  }
  Status WriteModule(int m, const void* buf) override {
    const ModuleExtent& me = ctx_->layout->module(m);
    const auto [lo, hi] = ctx_->part->ModulePiece(m);
    if (hi <= lo) return Status();
    const int64_t at = lo - ctx_->part->param_byte_base();
    const auto* src = static_cast<const uint8_t*>(buf) + (lo - me.byte_begin);
    std::memcpy(next() + at, src, static_cast<size_t>(hi - lo));
    std::memcpy(host_.as<uint8_t>() + at, src, static_cast<size_t>(hi - lo));
    return Status();
  }
  Status WriteOwnedElems(const ParamRec& p, std::span<const float> values) override {
    StoreOwned(host_.as<uint8_t>(), p, 0, p.numel, values);
    StoreOwned(next(), p, 0, p.numel, values);
    return Status();
  }
  Status Commit(const StepOutcome&, const std::vector<uint8_t>&) override {
    host_.swap(next_);
    return Status();
  }
};

}  // namespace

std::unique_ptr<ParamHome> ParamHome::For(const Placement& placement, const StoreContext* ctx) {
  switch (placement.params) {
    case OffloadDevice::kNone:
      return std::make_unique<DeviceParams>(ctx, placement.param_mirror());
    case OffloadDevice::kCpu:
      return std::make_unique<HostParams>(ctx);
    case OffloadDevice::kNvme:
      return std::make_unique<NvmeParams>(ctx);
  }
  return nullptr;
}

// ---- DeviceParams ----------------------------------------------------------------

Status DeviceParams::Allocate(bool pinned) {
  const int64_t bytes = ctx_->part->param_array_bytes();
  gpu::Device* pin = pinned ? ctx_->dev : nullptr;
  RETURN_IF_ERROR(next_.Allocate(bytes, pin, "updated parameters"));
  std::memset(next_.data(), 0, static_cast<size_t>(bytes));
  ASSIGN_OR_RETURN(block_, ctx_->dev->Allocate(static_cast<size_t>(bytes)));
  ASSIGN_OR_RETURN(uploaded_, ctx_->dev->CreateEvent());
  // With the step overlapping the next forward, modules are uploaded one by
  // one as the step finishes them; the mirror holds the previous parameters
  // so that a step failing half-way can be undone.
  if (mirror_) RETURN_IF_ERROR(host_.Allocate(bytes, pin, "parameter mirror"));
  return Status();
}

Status DeviceParams::InitElems(const ParamRec& p, int64_t first, int64_t count,
                               std::span<const float> values, int64_t*) {
  StoreOwned(next(), p, first, count, values);
  return Status();
}

Status DeviceParams::FinishInit(int64_t*) {
  const int64_t bytes = ctx_->part->param_array_bytes();
  gpu::Device* dev = ctx_->dev;
  RETURN_IF_ERROR(dev->CopyH2D(block_.data(), next(), static_cast<size_t>(bytes), dev->h2d()));
  RETURN_IF_ERROR(dev->h2d().Record(*uploaded_));
  RETURN_IF_ERROR(dev->h2d().Synchronize());
  ctx_->counters->AddCopyBytes(Link::kH2D, bytes);
  if (mirror_) std::memcpy(host_.data(), next(), static_cast<size_t>(bytes));
  return Status();
}

StatusOr<PartBytes> DeviceParams::PartOf(int m, bool, bool to_host, AlignedBuffer* piece) {
  const int64_t base = ctx_->part->param_byte_base();
  if (!to_host) return PartBytes{block(), base};
  const auto [lo, hi] = ctx_->part->ModulePiece(m);
  ASSIGN_OR_RETURN(*piece, AlignedBuffer::Allocate(
                               static_cast<size_t>(std::max<int64_t>(1, hi - lo)), kIoAlign));
  if (hi > lo) {
    // The device block is current once its last upload has landed.
    gpu::Device* dev = ctx_->dev;
    RETURN_IF_ERROR(uploaded_->Synchronize());
    RETURN_IF_ERROR(dev->CopyD2H(piece->data(), block() + (lo - base), static_cast<size_t>(hi - lo),
                                 dev->d2h()));
    RETURN_IF_ERROR(dev->d2h().Synchronize());
  }
  return PartBytes{piece->as<uint8_t>(), lo};
}

Status DeviceParams::ReadModule(int m, void* buf) {
  const ModuleExtent& me = ctx_->layout->module(m);
  gpu::Device* dev = ctx_->dev;
  // The device block is current once its last upload has landed.
  RETURN_IF_ERROR(uploaded_->Synchronize());
  RETURN_IF_ERROR(
      dev->CopyD2H(buf, block() + me.byte_begin, static_cast<size_t>(me.bytes()), dev->d2h()));
  return dev->d2h().Synchronize();
}

Status DeviceParams::WriteModule(int m, const void* buf) {
  const ModuleExtent& me = ctx_->layout->module(m);
  const auto [lo, hi] = ctx_->part->ModulePiece(m);
  if (hi <= lo) return Status();
  const int64_t at = lo - ctx_->part->param_byte_base();
  const auto* src = static_cast<const uint8_t*>(buf) + (lo - me.byte_begin);
  const auto n = static_cast<size_t>(hi - lo);
  std::memcpy(next() + at, src, n);
  if (mirror_) std::memcpy(host_.as<uint8_t>() + at, src, n);
  return UploadPart(at, n);
}

Status DeviceParams::WriteOwnedElems(const ParamRec& p, std::span<const float> values) {
  if (mirror_) StoreOwned(host_.as<uint8_t>(), p, 0, p.numel, values);
  StoreOwned(next(), p, 0, p.numel, values);
  const auto [own0, own1] = ctx_->part->elems();
  const int64_t lo = std::max(own0, p.elem_off) - p.elem_off;
  const int64_t hi = std::min(own1, p.elem_off + p.numel) - p.elem_off;
  if (lo >= hi) return Status();
  return UploadPart(p.byte_off - ctx_->part->param_byte_base() + lo * p.elem_size(),
                    static_cast<size_t>((hi - lo) * p.elem_size()));
}

Status DeviceParams::UploadPart(int64_t offset, size_t bytes) {
  gpu::Device* dev = ctx_->dev;
  RETURN_IF_ERROR(uploaded_->Synchronize());
  RETURN_IF_ERROR(dev->CopyH2D(block() + offset, next() + offset, bytes, dev->h2d()));
  RETURN_IF_ERROR(dev->h2d().Record(*uploaded_));
  return dev->h2d().Synchronize();
}

int64_t DeviceParams::HostSteppedFrom() const {
  const Partition& part = *ctx_->part;
  if (part.device_groups() == 0) return 0;
  return ctx_->layout->ByteOfElem(part.host_elems().first);
}

Status DeviceParams::UploadModule(int m, gpu::Event& ready) {
  const ModuleExtent& me = ctx_->layout->module(m);
  gpu::Device* dev = ctx_->dev;
  // (The bytes the device step wrote in place stay.)
  const int64_t b0 = std::max(me.byte_begin, HostSteppedFrom());
  const int64_t bytes = std::max<int64_t>(0, me.byte_end - b0);
  if (bytes > 0)
    RETURN_IF_ERROR(ctx_->counters->TimedCopy(
        dev->h2d(), Link::kH2D, fmt::format("updated module {}", m), bytes, [&] {
          return dev->CopyH2D(block() + b0, next() + b0, static_cast<size_t>(bytes), dev->h2d());
        }));
  return dev->h2d().Record(ready);
}

Status DeviceParams::Commit(const StepOutcome&, const std::vector<uint8_t>& uploaded) {
  const Layout& layout = *ctx_->layout;
  gpu::Device* dev = ctx_->dev;
  bool any = false, all = true;
  for (int i = 0; i < layout.num_modules(); ++i) {
    const bool up = uploaded[static_cast<size_t>(i)] != 0;
    any |= up;
    all &= up || layout.module(i).bytes() == 0;
  }
  // (Sub-groups stepped on the device wrote their bytes in place: only the
  // CPU step's are uploaded.)
  const int64_t from = HostSteppedFrom();
  auto upload = [&](int64_t b, int64_t bytes, const std::string& what) {
    const int64_t end = b + bytes;
    b = std::max(b, from);
    if (end <= b) return Status();
    return ctx_->counters->TimedCopy(dev->h2d(), Link::kH2D, what, end - b, [&] {
      return dev->CopyH2D(block() + b, next() + b, static_cast<size_t>(end - b), dev->h2d());
    });
  };
  if (!any) {
    RETURN_IF_ERROR(upload(0, ctx_->part->param_array_bytes(), "updated parameters"));
  } else if (!all) {
    for (int i = 0; i < layout.num_modules(); ++i) {
      const ModuleExtent& me = layout.module(i);
      if (uploaded[static_cast<size_t>(i)] || me.bytes() == 0) continue;
      RETURN_IF_ERROR(upload(me.byte_begin, me.bytes(), fmt::format("updated module {}", i)));
    }
  }
  // The next step's copy-out must not overwrite what these copies read: the
  // engine waits for this event before launching it.
  RETURN_IF_ERROR(dev->h2d().Record(*uploaded_));
  // Partitioned: the next gathers read the block on the collectives'
  // stream, which is not ordered after this one.
  if (ctx_->part->params_partitioned()) RETURN_IF_ERROR(dev->h2d().Synchronize());
  if (mirror_) host_.swap(next_);
  return Status();
}

void DeviceParams::Rollback(const std::vector<uint8_t>& uploaded, int64_t step) {
  bool any = false;
  for (uint8_t u : uploaded) any |= u != 0;
  if (!any || !mirror_) return;
  const int64_t bytes = ctx_->part->param_array_bytes();
  gpu::Device* dev = ctx_->dev;
  Status s = dev->CopyH2D(block(), host_.data(), static_cast<size_t>(bytes), dev->h2d());
  if (s.ok()) s = dev->h2d().Record(*uploaded_);
  if (s.ok()) s = dev->h2d().Synchronize();
  if (!s.ok())
    STRATA_LOG_ERROR("rolling back step {}: restoring the device parameters failed: {}", step,
                     s.ToString());
  ctx_->counters->AddCopyBytes(Link::kH2D, bytes);
}

// ---- NvmeParams ------------------------------------------------------------------

Status NvmeParams::Allocate(bool) {
  version_.assign(static_cast<size_t>(ctx_->layout->num_modules()), 0);
  return Status();
}

Status NvmeParams::InitElems(const ParamRec& p, int64_t first, int64_t count,
                             std::span<const float> values, int64_t* nvme_bytes) {
  const ModuleExtent& me = ctx_->layout->module(p.module);
  if (p.module != init_module_) {
    RETURN_IF_ERROR(FlushInitModule(nvme_bytes));
    if (init_buf_.data() == nullptr)
      return FailedPreconditionError("NvmeParams: no buffer to initialize the parameters in");
    init_module_ = p.module;
    std::memset(init_buf_.data(), 0, static_cast<size_t>(IoBytes(me.bytes())));
  }
  uint8_t* at = init_buf_.as<uint8_t>() + (p.byte_off - me.byte_begin);
  for (int64_t i = first; i < first + count; ++i)
    StoreFromFloat(at, p.dtype, static_cast<size_t>(i), values[static_cast<size_t>(i)]);
  return Status();
}

Status NvmeParams::FlushInitModule(int64_t* nvme_bytes) {
  if (init_module_ < 0) return Status();
  const int m = init_module_;
  init_module_ = -1;
  // Partitioned: this rank's piece, moved to the buffer's start.
  const auto [lo, hi] = ctx_->part->ModulePiece(m);
  if (hi <= lo) return Status();
  const int64_t begin = ctx_->layout->module(m).byte_begin;
  if (lo > begin)
    std::memmove(init_buf_.data(), init_buf_.as<uint8_t>() + (lo - begin),
                 static_cast<size_t>(hi - lo));
  const int64_t bytes = IoBytes(hi - lo);
  nvme::IoHandle h =
      ctx_->swap->Write(ModuleShardName(m, 0), 0, init_buf_.data(), static_cast<size_t>(bytes));
  RETURN_IF_ERROR(
      h.Wait().WithContext(fmt::format("initializing the parameters of module {} on NVMe", m)));
  ctx_->counters->AddNvmeWritten(bytes);
  *nvme_bytes += bytes;
  return Status();
}

Status NvmeParams::FinishInit(int64_t* nvme_bytes) {
  RETURN_IF_ERROR(FlushInitModule(nvme_bytes));
  init_buf_ = gpu::PinnedBuffer();
  return Status();
}

nvme::IoHandle NvmeParams::Read(int m, void* buf, bool updated) {
  const int v = version_[static_cast<size_t>(m)];
  const auto [lo, hi] = ctx_->part->ModulePiece(m);
  return ctx_->swap->Read(ModuleShardName(m, updated ? 1 - v : v), 0, buf,
                          static_cast<size_t>(IoBytes(hi - lo)));
}

nvme::IoHandle NvmeParams::Write(int m, const void* buf) {
  const auto [lo, hi] = ctx_->part->ModulePiece(m);
  return ctx_->swap->Write(ModuleShardName(m, 1 - version_[static_cast<size_t>(m)]), 0, buf,
                           static_cast<size_t>(IoBytes(hi - lo)));
}

Status NvmeParams::ReadPiece(int m, AlignedBuffer* piece) {
  const auto [lo, hi] = ctx_->part->ModulePiece(m);
  ASSIGN_OR_RETURN(
      *piece, AlignedBuffer::Allocate(static_cast<size_t>(IoBytes(std::max<int64_t>(1, hi - lo))),
                                      kIoAlign));
  if (hi <= lo) return Status();
  const int64_t t0 = NowNanos();
  RETURN_IF_ERROR(
      Read(m, piece->data())
          .Wait()
          .WithContext(fmt::format("reading this rank's part of module {} from NVMe", m)));
  ctx_->counters->NoteNvme(t0, NowNanos(), IoBytes(hi - lo), false,
                           fmt::format("read module {}", m));
  return Status();
}

Status NvmeParams::WritePiece(int m, const AlignedBuffer& piece) {
  const auto [lo, hi] = ctx_->part->ModulePiece(m);
  if (hi <= lo) return Status();
  return ctx_->swap
      ->Write(ModuleShardName(m, version_[static_cast<size_t>(m)]), 0, piece.data(),
              static_cast<size_t>(IoBytes(hi - lo)))
      .Wait()
      .WithContext(fmt::format("writing this rank's part of module {} to NVMe", m));
}

StatusOr<PartBytes> NvmeParams::PartOf(int m, bool, bool, AlignedBuffer* piece) {
  RETURN_IF_ERROR(ReadPiece(m, piece));
  return PartBytes{piece->as<uint8_t>(), ctx_->part->ModulePiece(m).first};
}

Status NvmeParams::ReadModule(int m, void* buf) {
  return Read(m, buf).Wait().WithContext(
      fmt::format("reading the parameters of module {} for a checkpoint", m));
}

Status NvmeParams::WriteModule(int m, const void* buf) {
  const ModuleExtent& me = ctx_->layout->module(m);
  if (!ctx_->part->params_partitioned())
    return ctx_->swap
        ->Write(ModuleShardName(m, version_[static_cast<size_t>(m)]), 0, buf,
                static_cast<size_t>(IoBytes(me.bytes())))
        .Wait()
        .WithContext(fmt::format("restoring the parameters of module {}", m));
  // (The active version of this rank's piece, in place.)
  const auto [lo, hi] = ctx_->part->ModulePiece(m);
  if (hi <= lo) return Status();
  ASSIGN_OR_RETURN(AlignedBuffer piece,
                   AlignedBuffer::Allocate(static_cast<size_t>(IoBytes(hi - lo)), kIoAlign));
  std::memcpy(piece.data(), static_cast<const uint8_t*>(buf) + (lo - me.byte_begin),
              static_cast<size_t>(hi - lo));
  return WritePiece(m, piece);
}

Status NvmeParams::WriteOwnedElems(const ParamRec& p, std::span<const float> values) {
  // This rank's piece of the module: read, patched, written back.
  const auto [own0, own1] = ctx_->part->elems();
  const int64_t lo = std::max(own0, p.elem_off) - p.elem_off;
  const int64_t hi = std::min(own1, p.elem_off + p.numel) - p.elem_off;
  if (lo >= hi) return Status();
  AlignedBuffer piece;
  RETURN_IF_ERROR(ReadPiece(p.module, &piece));
  const int64_t first = ctx_->part->ModulePiece(p.module).first;
  for (int64_t i = lo; i < hi; ++i)
    StoreFromFloat(piece.as<uint8_t>() + (p.byte_off - first), p.dtype, static_cast<size_t>(i),
                   values[static_cast<size_t>(i)]);
  return WritePiece(p.module, piece);
}

Status NvmeParams::Commit(const StepOutcome& outcome, const std::vector<uint8_t>&) {
  // Only modules whose new version was written flip; one whose write failed
  // (or was never issued) keeps its previous, consistent version.
  for (int m : outcome.param_written)
    version_[static_cast<size_t>(m)] = 1 - version_[static_cast<size_t>(m)];
  return Status();
}

}  // namespace strata::scheduler
