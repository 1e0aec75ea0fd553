#include "src/scheduler/device_sums.h"

#include <fmt/format.h>

#include <algorithm>

#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/scheduler/grad_store.h"
#include "src/scheduler/plan.h"

namespace strata::scheduler {

DeviceSums::DeviceSums(gpu::Device* device, const Layout* layout, StepCounters* counters,
                       int64_t chunk_elems, bool pin)
    : dev_(device),
      layout_(layout),
      counters_(counters),
      chunk_elems_(std::max<int64_t>(1, chunk_elems / kNormBlock) * kNormBlock),
      pin_(pin) {}

DeviceSums::~DeviceSums() {
  if (stream_) stream_->Synchronize().IgnoreError();
}

Status DeviceSums::Open(int64_t* pinned_bytes) {
  const auto n = static_cast<size_t>(std::max<int64_t>(1, layout_->total_elems()));
  ASSIGN_OR_RETURN(sums_, dev_->Allocate(n * sizeof(float)));
  ASSIGN_OR_RETURN(stream_, dev_->CreateStream("gradient sums"));
  RETURN_IF_ERROR(dev_->Fill(sums_.data(), DType::kFp32, n, 0.f, *stream_));
  RETURN_IF_ERROR(stream_->Synchronize());
  ASSIGN_OR_RETURN(compute_done_, dev_->CreateEvent());
  ASSIGN_OR_RETURN(zeroed_, dev_->CreateEvent());
  // (No larger than the largest sub-group needs.)
  const int64_t elems = std::min(chunk_elems_, std::max<int64_t>(1, layout_->max_group_elems()));
  for (int b = 0; b < 2; ++b) {
    ASSIGN_OR_RETURN(copied_[b], dev_->CreateEvent());
    RETURN_IF_ERROR(buf_[b].Allocate(IoBytes(kGradAccBytesPerElem * elems), pin_ ? dev_ : nullptr,
                                     "gradient sums from HBM"));
    if (buf_[b].pinned()) *pinned_bytes += buf_[b].bytes();
  }
  return Status();
}

Status DeviceSums::Begin() {
  RETURN_IF_ERROR(dev_->compute().Record(*compute_done_));
  return stream_->Wait(*compute_done_);
}

std::vector<DeviceSums::Chunk> DeviceSums::ChunksOf(size_t g0, size_t g1) const {
  std::vector<Chunk> out;
  g1 = std::min(g1, layout_->num_groups());
  for (size_t g = g0; g < g1; ++g) {
    const SubGroup& sg = layout_->group(g);
    for (int64_t lo = sg.elem_begin; lo < sg.elem_end; lo += chunk_elems_) {
      const int64_t hi = std::min(sg.elem_end, lo + chunk_elems_);
      out.push_back(Chunk{g, lo, hi, hi == sg.elem_end});
    }
  }
  return out;
}

Status DeviceSums::Issue(const Chunk& c, int b) {
  const int64_t bytes = kGradAccBytesPerElem * (c.hi - c.lo);
  RETURN_IF_ERROR(dev_->CopyD2H(buf_[b].data(), data() + c.lo, static_cast<size_t>(bytes), *stream_)
                      .WithContext(fmt::format("copying the gradient sums of elements [{}, {}) "
                                               "of sub-group {} from HBM",
                                               c.lo, c.hi, c.g)));
  counters_->AddCopyBytes(Link::kD2H, bytes);
  return stream_->Record(*copied_[b]);
}

Status DeviceSums::BlockChecks(size_t g0, size_t g1, std::vector<double>* partial,
                               std::vector<uint8_t>* bad) {
  partial->clear();
  bad->clear();
  const std::vector<Chunk> chunks = ChunksOf(g0, g1);
  for (size_t i = 0; i < chunks.size() && i < 2; ++i)
    RETURN_IF_ERROR(Issue(chunks[i], static_cast<int>(i)));
  for (size_t i = 0; i < chunks.size(); ++i) {
    const int b = static_cast<int>(i % 2);
    RETURN_IF_ERROR(copied_[b]->Synchronize());
    const Chunk& c = chunks[i];
    const int64_t n = c.hi - c.lo;
    const size_t at = partial->size();
    const auto blocks = static_cast<size_t>((n + kNormBlock - 1) / kNormBlock);
    partial->resize(at + blocks);
    bad->resize(at + blocks);
    NormBlocks(buf_[b].as<float>(), n, partial->data() + at, bad->data() + at);
    if (i + 2 < chunks.size()) RETURN_IF_ERROR(Issue(chunks[i + 2], b));
  }
  return Status();
}

Status DeviceSums::GlobalChecks(bool* overflow, double* sumsq) {
  std::vector<double> partial;
  std::vector<uint8_t> bad;
  RETURN_IF_ERROR(BlockChecks(0, layout_->num_groups(), &partial, &bad));
  CombineBlocks(partial, bad, overflow, sumsq);
  return Status();
}

Status DeviceSums::Stream(size_t g0, size_t g1, const ChunkFn& step,
                          const std::function<void(size_t)>& done) {
  const std::vector<Chunk> chunks = ChunksOf(g0, g1);
  Status s;
  size_t issued = 0;
  for (; issued < chunks.size() && issued < 2 && s.ok(); ++issued)
    s = Issue(chunks[issued], static_cast<int>(issued));
  for (size_t i = 0; i < chunks.size() && s.ok(); ++i) {
    const int b = static_cast<int>(i % 2);
    const Chunk& c = chunks[i];
    s = copied_[b]->Synchronize();
    if (s.ok()) s = step(c.g, c.lo, c.hi, buf_[b].as<float>());
    if (!s.ok()) break;
    if (c.last) {
      // Zeroed for the next window before the sub-group is published.
      const SubGroup& sg = layout_->group(c.g);
      s = dev_->Fill(data() + sg.elem_begin, DType::kFp32, static_cast<size_t>(sg.elems()), 0.f,
                     *stream_);
      if (s.ok()) s = stream_->Record(*zeroed_);
    }
    // The buffer is free again: the chunk after the next one goes into it.
    if (s.ok() && issued < chunks.size()) s = Issue(chunks[issued++], b);
    if (s.ok() && c.last) s = zeroed_->Synchronize();
    if (!s.ok()) {
      s = s.WithContext(fmt::format("the gradient sums of sub-group {} in HBM", c.g));
      break;
    }
    if (c.last) done(c.g);
  }
  // Nothing of this pass is left in flight on the buffers.
  Status drained = stream_->Synchronize();
  return s.ok() ? drained : s;
}

}  // namespace strata::scheduler
