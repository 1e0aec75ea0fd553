#include "src/scheduler/grad_store.h"

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>

#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/scheduler/state_store.h"

namespace strata::scheduler {

int64_t NormBlockCount(const SubGroup& sg) { return (sg.elems() + kNormBlock - 1) / kNormBlock; }

void NormBlocks(const float* sums, int64_t n, double* partial, uint8_t* bad) {
  const int64_t blocks = (n + kNormBlock - 1) / kNormBlock;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, blocks), [&](const auto& r) {
    for (int64_t blk = r.begin(); blk < r.end(); ++blk) {
      const int64_t b = blk * kNormBlock, e = std::min(n, b + kNormBlock);
      // The squares of a chunk first (a loop the compiler vectorizes), then
      // added one at a time in element order.
      constexpr int64_t kChunk = 256;
      alignas(64) double sq[kChunk];
      double s = 0;
      for (int64_t c = b; c < e; c += kChunk) {
        const int64_t k_end = std::min(kChunk, e - c);
        for (int64_t k = 0; k < k_end; ++k) {
          const double x = sums[c + k];
          sq[k] = x * x;
        }
        for (int64_t k = 0; k < k_end; ++k) s += sq[k];
      }
      // A finite float squared is below 1.2e77 in double; kNormBlock of them
      // stay finite, so only an inf/nan element makes the block's sum so.
      partial[blk] = s;
      bad[blk] = !std::isfinite(s);
    }
  });
}

void CombineBlocks(const std::vector<double>& partial, const std::vector<uint8_t>& bad,
                   bool* overflow, double* sumsq) {
  double sum = 0;
  bool any_bad = false;
  for (size_t b = 0; b < partial.size(); ++b) {  // fixed order: deterministic
    sum += partial[b];
    any_bad |= bad[b] != 0;
  }
  *overflow = any_bad;
  *sumsq = sum;
}

GradStore::GradStore(const Layout* layout, StateStore* store, StepCounters* counters, int64_t slots)
    : layout_(layout),
      store_(store),
      counters_(counters),
      num_slots_(std::max<int64_t>(2, slots)) {}

GradStore::~GradStore() { DropWindow(); }

int64_t GradStore::io_bytes(size_t g) const {
  return IoBytes(kGradAccBytesPerElem * layout_->group(g).elems());
}

Status GradStore::Open() {
  MutexLock lock(&mu_);
  const auto bytes = static_cast<size_t>(GradSlotBytes(layout_->max_group_elems()));
  slots_.clear();
  for (int64_t i = 0; i < num_slots_; ++i) {
    Slot s;
    s.buf = std::make_unique<HostArray>();
    RETURN_IF_ERROR(s.buf->Allocate(static_cast<int64_t>(bytes), nullptr, "gradient cache"));
    slots_.push_back(std::move(s));
  }
  records_.assign(layout_->num_groups(), Record{});
  return Status();
}

void GradStore::ComputeNorm(size_t g, const float* sums) {
  Record& r = records_[g];
  const auto blocks = static_cast<size_t>(NormBlockCount(layout_->group(g)));
  r.partial.resize(blocks);
  r.bad.resize(blocks);
  NormBlocks(sums, layout_->group(g).elems(), r.partial.data(), r.bad.data());
  r.norm_valid = true;
}

void GradStore::WriteBehind(int s) {
  Slot& slot = slots_[static_cast<size_t>(s)];
  const auto g = static_cast<size_t>(slot.group);
  Record& r = records_[g];
  ComputeNorm(g, slot.buf->as<float>());
  slot.write_issue_ns = NowNanos();
  slot.write = store_->WriteGrads(g, slot.buf->data(), io_bytes(g));
  r.dirty = false;
}

Status GradStore::WaitWrite(int s) {
  Slot& slot = slots_[static_cast<size_t>(s)];
  if (!slot.write.valid()) return Status();
  Status st = slot.write.Wait();
  const auto bytes = static_cast<int64_t>(slot.write.bytes());
  slot.write = nvme::IoHandle();
  counters_->NoteNvme(slot.write_issue_ns, NowNanos(), bytes, true,
                      fmt::format("write grads {}", slot.group));
  // A sub-group consumed or dropped since: its sums no longer matter.
  if (st.ok() || slot.group < 0) return Status();
  {
    // The shard does not hold the sums; the slot still does.
    records_[static_cast<size_t>(slot.group)].dirty = true;
  }
  return st.WithContext(
      fmt::format("writing the gradients of sub-group {} to NVMe; the window's gradients are "
                  "dropped",
                  slot.group));
}

StatusOr<int> GradStore::AcquireSlot(size_t g) {
  int pick = -1;
  for (int s = 0; s < static_cast<int>(slots_.size()); ++s)
    if (slots_[static_cast<size_t>(s)].group < 0) {
      pick = s;
      break;
    }
  if (pick < 0) {
    // The least recently used sub-group the step does not hold, one already
    // written out first (a dirty one may still get adds: evicting it would
    // cost a read back).
    for (const bool clean_only : {true, false}) {
      for (int s = 0; s < static_cast<int>(slots_.size()); ++s) {
        const Slot& c = slots_[static_cast<size_t>(s)];
        if (c.busy || c.group == static_cast<int>(g)) continue;
        if (clean_only && records_[static_cast<size_t>(c.group)].dirty) continue;
        if (pick < 0 || c.used < slots_[static_cast<size_t>(pick)].used) pick = s;
      }
      if (pick >= 0) break;
    }
    if (pick < 0)
      return FailedPreconditionError(fmt::format(
          "gradient cache: all {} slots are held by the optimizer step", slots_.size()));
    Slot& victim = slots_[static_cast<size_t>(pick)];
    Record& vr = records_[static_cast<size_t>(victim.group)];
    if (vr.dirty && !victim.write.valid()) WriteBehind(pick);
  }
  // Its previous contents must have reached NVMe (or belong to a window
  // already consumed) before the slot is overwritten.
  RETURN_IF_ERROR(WaitWrite(pick));
  Slot& slot = slots_[static_cast<size_t>(pick)];
  if (slot.group >= 0) {
    // Its write landed (adds wait for a write-behind, so it is not dirty).
    Record& vr = records_[static_cast<size_t>(slot.group)];
    vr.where = Where::kNvme;
    vr.slot = -1;
  }
  slot.group = static_cast<int>(g);
  return pick;
}

Status GradStore::Update(size_t g, const std::function<Status(float* sums)>& add,
                         const Progress* progress) {
  MutexLock lock(&mu_);
  if (progress == nullptr && last_group_ >= 0 && static_cast<size_t>(last_group_) != g) {
    // Moving on: the previous sub-group is written out behind (most often
    // it is complete for this micro-batch; if not, it is written again).
    Record& prev = records_[static_cast<size_t>(last_group_)];
    if (prev.where == Where::kCached && prev.dirty &&
        !slots_[static_cast<size_t>(prev.slot)].write.valid())
      WriteBehind(prev.slot);
  }
  last_group_ = static_cast<int>(g);
  Record& r = records_[g];
  int s = r.slot;
  if (r.where == Where::kCached) {
    RETURN_IF_ERROR(WaitWrite(s));  // the write reads the slot
  } else {
    ASSIGN_OR_RETURN(s, AcquireSlot(g));
    float* sums = slots_[static_cast<size_t>(s)].buf->as<float>();
    if (r.where == Where::kNvme) {
      // Part of this window's sum (an earlier micro-batch): read back.
      const int64_t t0 = NowNanos();
      nvme::IoHandle h = store_->ReadGrads(g, sums, io_bytes(g));
      Status st = h.Wait();
      counters_->NoteNvme(t0, NowNanos(), io_bytes(g), false, fmt::format("read grads {}", g));
      if (!st.ok()) {
        slots_[static_cast<size_t>(s)].group = -1;
        return st.WithContext(fmt::format(
            "reading back the gradients of sub-group {} from NVMe; the window's gradients are "
            "dropped",
            g));
      }
    } else {
      std::memset(sums, 0, static_cast<size_t>(io_bytes(g)));
    }
    r.where = Where::kCached;
    r.slot = s;
  }
  Slot& slot = slots_[static_cast<size_t>(s)];
  slot.used = ++clock_;
  r.dirty = true;
  r.norm_valid = false;
  RETURN_IF_ERROR(add(slot.buf->as<float>()));
  // The cached sub-groups no later add of this micro-batch reaches (in the
  // usual order) are written out behind now, each once, so that their slots
  // are free for the sub-groups below. Once the adds have reached the first
  // element nothing is below: the last sub-groups stay cached for the step
  // (or the next micro-batch's first adds write them out).
  if (progress == nullptr || progress->module_begin <= 0) return Status();
  for (int k = 0; k < static_cast<int>(slots_.size()); ++k) {
    Slot& c = slots_[static_cast<size_t>(k)];
    if (c.group < 0 || c.write.valid()) continue;
    const Record& cr = records_[static_cast<size_t>(c.group)];
    if (cr.where != Where::kCached || !cr.dirty) continue;
    // Complete: inside [module_begin, chunk_end) ∪ [module_end, ∞), which
    // is [module_begin, ∞) once the module's last chunk is in.
    const SubGroup& sg = layout_->group(static_cast<size_t>(c.group));
    const bool module_done = progress->chunk_end >= progress->module_end;
    if (sg.elem_begin >= progress->module_end ||
        (sg.elem_begin >= progress->module_begin &&
         (module_done || sg.elem_end <= progress->chunk_end)))
      WriteBehind(k);
  }
  return Status();
}

Status GradStore::EnsureNorm(size_t g, AlignedBuffer* tmp) {
  Record& r = records_[g];
  if (r.norm_valid || r.where == Where::kZero) return Status();  // zero: every block +0
  if (r.where == Where::kCached) {
    ComputeNorm(g, slots_[static_cast<size_t>(r.slot)].buf->as<float>());
    return Status();
  }
  // Only written in an earlier micro-batch of the window: read back.
  if (tmp->data() == nullptr) {
    ASSIGN_OR_RETURN(*tmp,
                     AlignedBuffer::Allocate(
                         static_cast<size_t>(GradSlotBytes(layout_->max_group_elems())), kIoAlign));
  }
  const int64_t t0 = NowNanos();
  Status st = store_->ReadGrads(g, tmp->data(), io_bytes(g)).Wait();
  counters_->NoteNvme(t0, NowNanos(), io_bytes(g), false, fmt::format("read grads {}", g));
  if (!st.ok())
    return st.WithContext(
        fmt::format("reading the gradients of sub-group {} for the global checks", g));
  ComputeNorm(g, tmp->as<float>());
  return Status();
}

Status GradStore::GlobalChecks(bool* overflow, double* sumsq) {
  std::vector<double> partial;
  std::vector<uint8_t> bad;
  RETURN_IF_ERROR(BlockChecks(0, layout_->num_groups(), &partial, &bad));
  CombineBlocks(partial, bad, overflow, sumsq);
  return Status();
}

Status GradStore::BlockChecks(size_t first_group, size_t end_group, std::vector<double>* partial,
                              std::vector<uint8_t>* bad) {
  MutexLock lock(&mu_);
  AlignedBuffer tmp;
  for (size_t g = first_group; g < end_group; ++g) {
    RETURN_IF_ERROR(EnsureNorm(g, &tmp));
    const Record& r = records_[g];
    if (!r.norm_valid) {  // zero: NormBlockCount blocks of +0
      const auto blocks = static_cast<size_t>(NormBlockCount(layout_->group(g)));
      partial->insert(partial->end(), blocks, 0.0);
      bad->insert(bad->end(), blocks, 0);
      continue;
    }
    partial->insert(partial->end(), r.partial.begin(), r.partial.end());
    bad->insert(bad->end(), r.bad.begin(), r.bad.end());
  }
  return Status();
}

nvme::IoHandle GradStore::Source(size_t g, const StatePiece& pc, float* buf, const float** sums) {
  MutexLock lock(&mu_);
  Record& r = records_[g];
  // (Pieces start on kStatePieceQuantum elements of the sub-group: a page
  // of its shard.)
  const int64_t at = pc.elem_begin - layout_->group(g).elem_begin;
  if (r.where == Where::kCached) {
    Slot& slot = slots_[static_cast<size_t>(r.slot)];
    slot.busy = true;
    *sums = slot.buf->as<float>() + at;
    return nvme::IoHandle::Completed(Status());
  }
  *sums = buf;
  if (r.where == Where::kNvme) {
    const int64_t offset = kGradAccBytesPerElem * at;
    return store_->ReadGrads(
        g, buf, std::min(IoBytes(kGradAccBytesPerElem * pc.elems()), io_bytes(g) - offset), offset);
  }
  std::memset(buf, 0, static_cast<size_t>(kGradAccBytesPerElem * pc.elems()));
  return nvme::IoHandle::Completed(Status());
}

nvme::IoHandle GradStore::Peek(size_t g, const StatePiece& pc, float* buf, const float** sums) {
  MutexLock lock(&mu_);
  const Record& r = records_[g];
  const int64_t at = pc.elem_begin - layout_->group(g).elem_begin;
  *sums = buf;
  const auto bytes = static_cast<size_t>(kGradAccBytesPerElem * pc.elems());
  if (r.where == Where::kCached) {
    std::memcpy(buf, slots_[static_cast<size_t>(r.slot)].buf->as<float>() + at, bytes);
    return nvme::IoHandle::Completed(Status());
  }
  if (r.where == Where::kNvme) {
    const int64_t offset = kGradAccBytesPerElem * at;
    return store_->ReadGrads(
        g, buf, std::min(IoBytes(kGradAccBytesPerElem * pc.elems()), io_bytes(g) - offset), offset);
  }
  std::memset(buf, 0, bytes);
  return nvme::IoHandle::Completed(Status());
}

void GradStore::Consumed(size_t g) {
  MutexLock lock(&mu_);
  Record& r = records_[g];
  if (r.where == Where::kCached) {
    Slot& slot = slots_[static_cast<size_t>(r.slot)];
    slot.busy = false;
    slot.group = -1;  // a write still in flight is waited for before reuse
  }
  r.where = Where::kZero;
  r.slot = -1;
  r.dirty = false;
  r.norm_valid = false;
}

void GradStore::DropWindow() {
  MutexLock lock(&mu_);
  for (Slot& slot : slots_) {
    if (slot.write.valid()) slot.write.Wait().IgnoreError();
    slot.write = nvme::IoHandle();
    slot.group = -1;
    slot.busy = false;
  }
  for (Record& r : records_) {
    r.where = Where::kZero;
    r.slot = -1;
    r.dirty = false;
    r.norm_valid = false;
  }
  last_group_ = -1;
}

}  // namespace strata::scheduler
