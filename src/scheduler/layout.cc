#include "src/scheduler/layout.h"

#include <algorithm>

#include "src/common/aligned_buffer.h"

namespace strata::scheduler {

GroupStateLayout GroupStatesIn(cpu_adam::StateFormat f, int64_t elems) {
  using cpu_adam::StateRole;
  const auto n = static_cast<size_t>(elems);
  auto bytes = [&](StateRole r) {
    return static_cast<int64_t>(cpu_adam::StateElementBytes(f, r) * n);
  };
  auto scales = [&](StateRole r) {
    return static_cast<int64_t>(sizeof(float) * cpu_adam::StateScaleCount(f, r, n));
  };
  GroupStateLayout g;
  g.exp_avg = g.master + bytes(StateRole::kParam);
  g.exp_avg_sq = g.exp_avg + bytes(StateRole::kExpAvg);
  g.exp_avg_scale = g.exp_avg_sq + bytes(StateRole::kExpAvgSq);
  g.exp_avg_sq_scale = g.exp_avg_scale + scales(StateRole::kExpAvg);
  g.bytes = g.exp_avg_sq_scale + scales(StateRole::kExpAvgSq);
  return g;
}

int64_t StateArrayBytes(cpu_adam::StateFormat f, int64_t elems) {
  return GroupStatesIn(f, elems).bytes;
}

void Layout::set_state_piece_elems(int64_t elems) {
  state_piece_elems_ = elems > 0 && elems < max_group_elems_ ? elems : 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    SubGroup& sg = groups_[g];
    sg.shard_bytes = -1;
    if (state_piece_elems_ == 0) continue;
    const std::vector<StatePiece> pieces = StatePieces(g);
    sg.shard_bytes = pieces.back().shard_offset + pieces.back().io_bytes;
  }
}

std::vector<StatePiece> Layout::StatePieces(size_t g) const {
  const SubGroup& sg = groups_[g];
  const int64_t p = state_piece_elems_ > 0 ? state_piece_elems_ : std::max<int64_t>(1, sg.elems());
  std::vector<StatePiece> out;
  int64_t off = 0;
  for (int64_t b = sg.elem_begin; b < sg.elem_end || out.empty(); b += p) {
    StatePiece piece;
    piece.elem_begin = b;
    piece.elem_end = std::min(sg.elem_end, b + p);
    piece.shard_offset = off;
    // (One piece: the sub-group's own shard.)
    piece.io_bytes = state_piece_elems_ > 0 ? IoBytes(StateArrayBytes(state_format_, piece.elems()))
                                            : sg.state_io_bytes();
    off += piece.io_bytes;
    out.push_back(piece);
  }
  return out;
}

int64_t IoBytes(int64_t n) {
  return static_cast<int64_t>(AlignUp(static_cast<size_t>(n), static_cast<size_t>(kIoAlign)));
}

Layout Layout::Build(std::vector<ParamRec> params, const LayoutOptions& options) {
  Layout l;
  l.params_ = std::move(params);
  int max_module = 0;
  for (const ParamRec& p : l.params_) max_module = std::max(max_module, p.module);
  l.modules_.resize(static_cast<size_t>(max_module) + 1);
  for (int i = 0; i < static_cast<int>(l.params_.size()); ++i)
    l.modules_[static_cast<size_t>(l.params_[static_cast<size_t>(i)].module)].params.push_back(i);
  int64_t elem = 0, byte = 0;
  const int64_t align = std::max(kElemAlign, options.elem_align);
  l.elem_align_ = align;
  auto align_elem = [align](int64_t e) {
    return static_cast<int64_t>(AlignUp(static_cast<size_t>(e), static_cast<size_t>(align)));
  };
  for (ModuleExtent& m : l.modules_) {
    elem = align_elem(elem);
    m.elem_begin = elem;
    byte = IoBytes(byte);  // modules start on a page: whole-module NVMe I/O is aligned
    m.byte_begin = byte;
    for (int id : m.params) {
      ParamRec& p = l.params_[static_cast<size_t>(id)];
      elem = align_elem(elem);  // padding after a tensor whose size is not a multiple of 4
      p.elem_off = elem;
      p.byte_off = byte;
      elem += p.numel;
      l.param_elems_ += p.numel;
      byte += p.numel * p.elem_size();
      byte = static_cast<int64_t>(AlignUp(static_cast<size_t>(byte), kTensorAlign));
    }
    m.elem_end = elem;
    m.byte_end = byte;
    m.registered = !m.params.empty();
    m.persistent = !options.params_offloaded || m.elems() < options.persistence_threshold;
    l.max_module_bytes_ = std::max(l.max_module_bytes_, m.bytes());
  }
  l.total_param_bytes_ = IoBytes(byte);
  const int64_t sg = align > kElemAlign ? align_elem(std::max<int64_t>(1, options.sub_group_size))
                                        : std::max<int64_t>(1, options.sub_group_size);
  l.sub_group_size_ = sg;
  l.world_size_ = std::max(1, options.world_size);
  if (l.world_size_ == 1) {
    l.total_elems_ = elem;
    l.partition_elems_ = elem;
    for (int64_t b = 0; b < l.total_elems_; b += sg) {
      l.groups_.push_back({b, std::min(l.total_elems_, b + sg)});
      l.max_group_elems_ = std::max(l.max_group_elems_, l.groups_.back().elems());
    }
    l.groups_per_rank_ = static_cast<int64_t>(l.groups_.size());
  } else {
    // Equal partitions (the tail padded with zeros, as DeepSpeed pads its
    // flat buffers), each cut into sub-groups of at most sg elements; every
    // partition has the same number of sub-groups, so equal-count
    // collectives move one sub-group's worth from every rank.
    const int64_t w = l.world_size_;
    const int64_t share = std::max<int64_t>(1, (elem + w - 1) / w);
    l.partition_elems_ =
        share >= kBlockAlignedPartition
            ? align_elem(static_cast<int64_t>(
                  AlignUp(static_cast<size_t>(share), static_cast<size_t>(kNormBlockElems))))
            : align_elem(share);
    l.total_elems_ = l.partition_elems_ * w;
    const int64_t per = std::min(sg, l.partition_elems_);
    l.groups_per_rank_ = (l.partition_elems_ + per - 1) / per;
    for (int64_t r = 0; r < w; ++r) {
      const int64_t p0 = r * l.partition_elems_, p1 = p0 + l.partition_elems_;
      for (int64_t b = p0; b < p1; b += per) l.groups_.push_back({b, std::min(p1, b + per)});
    }
    l.max_group_elems_ = per;
  }
  l.state_format_ = options.state_format;
  for (SubGroup& g : l.groups_) g.state_bytes = StateArrayBytes(l.state_format_, g.elems());
  for (ModuleExtent& m : l.modules_)
    m.last_group = m.elems() > 0 ? static_cast<int>(l.GroupOf(m.elem_end - 1)) : -1;
  // A chunk boundary must not split an element: the bucket's bytes are
  // rounded down to a whole number of the largest element (fp32).
  constexpr int64_t kMaxElemBytes = static_cast<int64_t>(DTypeSize(DType::kFp32));
  l.grad_staging_bytes_ = std::min<int64_t>(
      std::max<int64_t>(l.max_module_bytes_, 4096),
      std::max<int64_t>(options.reduce_bucket_size * 2 / kMaxElemBytes * kMaxElemBytes, 4096));
  l.elem_order_.resize(l.params_.size());
  for (size_t i = 0; i < l.elem_order_.size(); ++i) l.elem_order_[i] = static_cast<int>(i);
  std::sort(l.elem_order_.begin(), l.elem_order_.end(), [&](int a, int b) {
    return l.params_[static_cast<size_t>(a)].elem_off < l.params_[static_cast<size_t>(b)].elem_off;
  });
  return l;
}

int64_t Layout::ByteOfElem(int64_t e) const {
  // The first parameter (in element order) that ends after e.
  size_t lo = 0, hi = elem_order_.size();
  while (lo < hi) {
    const size_t mid = (lo + hi) / 2;
    const ParamRec& p = params_[static_cast<size_t>(elem_order_[mid])];
    if (p.elem_off + p.numel <= e)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo == elem_order_.size()) return total_param_bytes_;
  const ParamRec& p = params_[static_cast<size_t>(elem_order_[lo])];
  return p.byte_off + std::max<int64_t>(0, e - p.elem_off) * p.elem_size();
}

int64_t Layout::persistent_param_bytes() const {
  int64_t bytes = 0;
  for (const ModuleExtent& m : modules_) bytes += m.persistent ? m.bytes() : 0;
  return bytes;
}

std::vector<Layout::Slice> Layout::Slices(int64_t eb, int64_t ee) const {
  std::vector<Slice> out;
  // The first parameter whose range may hold eb (binary search by elem_off).
  size_t lo = 0, hi = elem_order_.size();
  while (hi - lo > 1) {
    const size_t mid = (lo + hi) / 2;
    if (params_[static_cast<size_t>(elem_order_[mid])].elem_off <= eb)
      lo = mid;
    else
      hi = mid;
  }
  for (size_t i = lo; i < elem_order_.size(); ++i) {
    const ParamRec& p = params_[static_cast<size_t>(elem_order_[i])];
    if (p.elem_off >= ee) break;
    const int64_t b = std::max(eb, p.elem_off), e = std::min(ee, p.elem_off + p.numel);
    if (b >= e) continue;
    out.push_back({elem_order_[i], b, e, p.byte_off + (b - p.elem_off) * p.elem_size()});
  }
  return out;
}

std::vector<Layout::Slice> Layout::ByteSlices(int m, int64_t byte_begin, int64_t byte_end) const {
  std::vector<Slice> out;
  for (int id : module(m).params) {
    const ParamRec& p = param(id);
    const int64_t es = p.elem_size();
    const int64_t pb = p.byte_off, pe = p.byte_off + p.numel * es;
    const int64_t b = std::max(pb, byte_begin), e = std::min(pe, byte_end);
    if (b >= e) continue;
    const int64_t first = p.elem_off + (b - pb) / es;
    out.push_back({id, first, first + (e - b) / es, b});
  }
  return out;
}

std::vector<int> Layout::ModulesEndingIn(int64_t eb, int64_t ee) const {
  std::vector<int> out;
  for (int mi = 0; mi < num_modules(); ++mi) {
    const ModuleExtent& m = module(mi);
    if (m.elems() == 0 || m.elem_end <= eb || m.elem_end > ee) continue;
    out.push_back(mi);
  }
  return out;
}

}  // namespace strata::scheduler
