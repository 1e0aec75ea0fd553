#include "src/scheduler/optimizer_step.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <system_error>

#include "src/common/status_util.h"
#include "src/common/timer.h"

namespace strata::scheduler {

// ---- SpeculationFeed -----------------------------------------------------------

void SpeculationFeed::Push(Item item) {
  {
    MutexLock lock(&mu_);
    if (closed_) return;
    items_.push_back(std::move(item));
  }
  cv_.NotifyAll();
}

std::optional<SpeculationFeed::Item> SpeculationFeed::Next() {
  MutexLock lock(&mu_);
  while (!closed_ && items_.empty()) cv_.Wait(&mu_);
  if (items_.empty()) return std::nullopt;
  Item item = std::move(items_.front());
  items_.pop_front();
  return item;
}

void SpeculationFeed::Close(bool keep_pending) {
  {
    MutexLock lock(&mu_);
    closed_ = true;
    if (!keep_pending) items_.clear();
  }
  cv_.NotifyAll();
}

// ---- StateReadAhead ------------------------------------------------------------

std::vector<StateUnit> StateUnits(const Layout& layout, size_t g0, size_t g1) {
  std::vector<StateUnit> units;
  for (size_t g = g0; g < g1; ++g) {
    const std::vector<StatePiece> pieces = layout.StatePieces(g);
    for (size_t k = 0; k < pieces.size(); ++k)
      units.push_back({g, pieces[k], k + 1 == pieces.size(), pieces.size() > 1});
  }
  return units;
}

std::string StateUnit::Name() const {
  return cut ? fmt::format("{} [{}, {})", g, piece.elem_begin, piece.elem_end)
             : fmt::format("{}", g);
}

void StateReadAhead::Start(const StepDeps& deps, size_t max_buffers) {
  // This rank's sub-groups (all of them with one rank), piece by piece.
  const auto [g0, g1] = deps.store->partition().host_groups();
  const std::vector<StateUnit> units = StateUnits(*deps.layout, g0, g1);
  const size_t want = static_cast<size_t>(std::max<int64_t>(1, deps.buffer_count));
  const size_t n =
      std::min({units.size(), StateLookahead(std::min(want, units.size())) + 1, max_buffers});
  for (size_t u = 0; u < n; ++u) {
    StatusOr<gpu::PinnedBuffer> b = deps.store->optimizer_pool()->Acquire(
        static_cast<size_t>(deps.store->optimizer_buffer_bytes()));
    if (!b.ok()) break;  // the ring acquires what it can itself
    buffers_.push_back(std::move(*b));
    issue_ns_.push_back(NowNanos());
    reads_.push_back(deps.store->ReadStates(units[u].g, units[u].piece, buffers_.back().data()));
  }
}

void StateReadAhead::WaitAll() {
  for (auto& h : reads_) h.Wait().IgnoreError();
}

// ---- ParamWriter: updated parameters → NVMe, module by module ----------------

// offload_param nvme. Module buffers come from the store's write-back pool;
// a module's buffer is zeroed when opened (the alignment padding between its
// tensors is written as zeros), filled by the copy-out of the shards that
// cover it, and written to the module's inactive version once the shards up
// to its last element have been stepped. With partitioned parameters a
// buffer holds this rank's piece of the module (StateStore::ModulePiece).
// Once the write has landed the buffer is kept (landed_) for a fetch of the
// module to take (TakeLanded, the main thread), until the step needs it for
// another module. The step's thread but for TakeLanded; landed_ is guarded
// by mu_.
class ParamWriter {
 public:
  explicit ParamWriter(OptimizerStep* step)
      : step_(step), layout_(*step->deps_.layout), store_(*step->deps_.store) {}
  ~ParamWriter() { WaitAll(nullptr); }

  // The copy-out base of module m (its first byte), or null when no buffer
  // is free.
  uint8_t* BufferOf(int m) {
    for (Open& o : open_)
      if (o.module == m) return o.buf.as<uint8_t>();
    const auto bytes =
        static_cast<size_t>(IoBytes(std::max<int64_t>(layout_.max_module_bytes(), 1)));
    StatusOr<gpu::PinnedBuffer> b = store_.param_write_pool()->Acquire(bytes);
    if (!b.ok() && ReleaseLanded()) b = store_.param_write_pool()->Acquire(bytes);
    if (!b.ok()) return nullptr;
    // (Partitioned: this rank's piece of the module, from the buffer's
    // start; it ends with the module or with the rank's elements.)
    const ModuleExtent& me = layout_.module(m);
    const auto [lo, hi] = store_.partition().ModulePiece(m);
    std::memset(b->data(), 0, static_cast<size_t>(IoBytes(hi - lo)));
    // The elements of the module this rank steps.
    const auto [own0, own1] = store_.partition().host_elems();
    int64_t elems = 0;
    for (int p : me.params) {
      const ParamRec& r = layout_.param(p);
      elems +=
          std::max<int64_t>(0, std::min(r.elem_off + r.numel, own1) - std::max(r.elem_off, own0));
    }
    open_.push_back({m, elems, std::move(*b)});
    return open_.back().buf.as<uint8_t>();
  }
  // The modules stepped in part (their buffers), for the step that steps
  // the rest; and that step's adoption of them.
  std::vector<OpenModule> TakeOpen() { return std::exchange(open_, {}); }
  void Adopt(std::vector<OpenModule>&& open) {
    for (OpenModule& o : open) open_.push_back(std::move(o));
  }
  // `elems` more elements of module m (open) have been stepped.
  void Stepped(int m, int64_t elems) {
    for (Open& o : open_)
      if (o.module == m) o.remaining -= elems;
  }
  // The modules all of whose elements have been stepped are written (in
  // whatever order their elements were: a speculative step goes from the
  // top down).
  void Complete() {
    for (auto it = open_.begin(); it != open_.end();) {
      if (it->remaining > 0) {
        ++it;
        continue;
      }
      Write w;
      w.module = it->module;
      w.issue_ns = NowNanos();
      w.handle = store_.WriteModule(it->module, it->buf.data());
      w.buf = std::move(it->buf);
      writes_.push_back(std::move(w));
      it = open_.erase(it);
    }
  }
  // Notes the writes that have landed (their modules become ready); with
  // `oldest`, waits for the oldest one first. False when there was nothing
  // to wait for.
  bool Reap(bool oldest) {
    bool waited = false;
    if (oldest && !writes_.empty()) {
      writes_.front().handle.Wait().IgnoreError();
      waited = true;
    }
    for (auto it = writes_.begin(); it != writes_.end();) {
      if (!it->handle.Poll()) {
        ++it;
        continue;
      }
      Note(*it);
      it = writes_.erase(it);
    }
    return waited;
  }
  // Waits for every write; the modules written and failed go to `outcome`.
  void WaitAll(StepOutcome* outcome) {
    for (Write& w : writes_) {
      w.handle.Wait().IgnoreError();
      Note(w);
    }
    writes_.clear();
    if (outcome != nullptr) {
      outcome->param_written.insert(outcome->param_written.end(), written_.begin(), written_.end());
      outcome->param_write_failed.insert(outcome->param_write_failed.end(), failed_.begin(),
                                         failed_.end());
    }
    written_.clear();
    failed_.clear();
  }
  const Status& first_error() const { return first_error_; }

  // The main thread: module m's landed buffer, if still kept.
  gpu::PinnedBuffer TakeLanded(int m) EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    for (auto it = landed_.begin(); it != landed_.end(); ++it)
      if (it->first == m) {
        gpu::PinnedBuffer b = std::move(it->second);
        landed_.erase(it);
        return b;
      }
    return {};
  }

 private:
  // Returns the oldest kept buffer to the pool; false when none is kept.
  bool ReleaseLanded() EXCLUDES(mu_) {
    gpu::PinnedBuffer b;
    {
      MutexLock lock(&mu_);
      if (landed_.empty()) return false;
      b = std::move(landed_.front().second);
      landed_.pop_front();
    }
    return true;  // b returns to the pool here
  }

  using Open = OpenModule;
  struct Write {
    int module = 0;
    int64_t issue_ns = 0;
    nvme::IoHandle handle;
    gpu::PinnedBuffer buf;
  };
  void Note(Write& w) {
    Status s = w.handle.status();
    step_->deps_.counters->NoteNvme(w.issue_ns, NowNanos(), static_cast<int64_t>(w.handle.bytes()),
                                    true, fmt::format("write params {}", w.module));
    if (s.ok()) {
      {
        MutexLock lock(&mu_);
        landed_.emplace_back(w.module, std::move(w.buf));
      }
      written_.push_back(w.module);
      step_->ModuleWritten(w.module);
      return;
    }
    w.buf.Reset();
    failed_.push_back(w.module);
    if (first_error_.ok())
      first_error_ = s.WithContext(
          fmt::format("writing the updated parameters of module {} to NVMe", w.module));
  }

  OptimizerStep* step_;
  const Layout& layout_;
  StateStore& store_;
  std::vector<Open> open_;
  std::deque<Write> writes_;
  std::vector<int> written_, failed_;
  Status first_error_;
  Mutex mu_;
  std::deque<std::pair<int, gpu::PinnedBuffer>> landed_ GUARDED_BY(mu_);
};

// ---- StateRing: NVMe read → CPU Adam → NVMe write ---------------------------

// Streams every sub-group's states, piece by piece (StateUnits), through B
// pinned buffers: unit u uses buffer u % B; its read is issued once the
// buffer's previous write (unit u - B) has landed, up to StateLookahead(B)
// units ahead.
class StateRing {
 public:
  explicit StateRing(OptimizerStep* step)
      : step_(step),
        layout_(*step->deps_.layout),
        store_(*step->deps_.store),
        counters_(*step->deps_.counters),
        units_(StateUnits(layout_, store_.partition().host_groups().first,
                          store_.partition().host_groups().second)),
        U_(units_.size()),
        reads_(U_),
        grad_reads_(U_),
        writes_(U_),
        grad_src_(U_, nullptr),
        read_issue_(U_, 0),
        write_issue_(U_, 0),
        write_noted_(U_, false) {}

  Status Run(StepOutcome* outcome);

 private:
  Status AcquireBuffers();
  void IssueRead(size_t u);
  // Gradients on NVMe: unit u's sums, from the GradStore.
  void IssueGradRead(size_t u);
  void NoteWrite(size_t u);
  void NoteWrites(bool wait);
  bool BufferFree(size_t j, size_t u) const {
    return j < B_ || write_noted_[j - B_] || !writes_[j - B_].valid() || j - B_ < u;
  }
  gpu::PinnedBuffer& BufferOf(size_t u) { return buffers_[u % B_]; }

  OptimizerStep* step_;
  const Layout& layout_;
  StateStore& store_;
  StepCounters& counters_;
  // The pieces of the sub-groups this rank steps (every one with one rank),
  // in order.
  const std::vector<StateUnit> units_;
  const size_t U_;
  size_t B_ = 0;
  std::vector<gpu::PinnedBuffer> buffers_;
  std::vector<nvme::IoHandle> reads_, grad_reads_, writes_;
  std::vector<const float*> grad_src_;
  std::vector<int64_t> read_issue_, write_issue_;
  std::vector<bool> write_noted_;
  Status error_;
};

Status StateRing::AcquireBuffers() {
  StateReadAhead& pre = step_->read_ahead_;
  // The units read ahead during backward come first.
  buffers_ = std::move(pre.buffers_);
  pre.buffers_.clear();
  for (size_t k = 0; k < pre.reads_.size() && k < U_; ++k) {
    reads_[k] = std::move(pre.reads_[k]);
    read_issue_[k] = pre.issue_ns_[k];
  }
  pre.reads_.clear();
  pre.issue_ns_.clear();
  const int64_t want = std::max<int64_t>(1, step_->deps_.buffer_count);
  for (int64_t i = static_cast<int64_t>(buffers_.size()); i < want && i < static_cast<int64_t>(U_);
       ++i) {
    StatusOr<gpu::PinnedBuffer> b =
        store_.optimizer_pool()->Acquire(static_cast<size_t>(store_.optimizer_buffer_bytes()));
    if (!b.ok()) {
      if (buffers_.empty()) return b.status().WithContext("optimizer pipeline buffers");
      break;
    }
    buffers_.push_back(std::move(*b));
  }
  B_ = buffers_.size();
  // The units read ahead had no final gradients then; they do now.
  for (size_t u = 0; u < U_; ++u)
    if (reads_[u].valid()) IssueGradRead(u);
  return Status();
}

void StateRing::IssueGradRead(size_t u) {
  GradStore* grads = step_->deps_.grads;
  if (grads == nullptr) return;
  auto* buf = reinterpret_cast<float*>(BufferOf(u).as<uint8_t>() + store_.grad_buffer_offset());
  grad_reads_[u] = grads->Source(units_[u].g, units_[u].piece, buf, &grad_src_[u]);
}

void StateRing::NoteWrite(size_t u) {
  Status s = writes_[u].Wait();
  counters_.NoteNvme(write_issue_[u], NowNanos(), units_[u].piece.io_bytes, true,
                     "write state " + units_[u].Name());
  write_noted_[u] = true;
  if (!s.ok() && error_.ok())
    error_ = s.WithContext("writing optimizer state of sub-group " + units_[u].Name());
}

void StateRing::NoteWrites(bool wait) {
  for (size_t u = 0; u < U_; ++u) {
    if (!writes_[u].valid() || write_noted_[u]) continue;
    if (!wait && !writes_[u].Poll()) continue;
    NoteWrite(u);
  }
}

void StateRing::IssueRead(size_t u) {
  // The buffer may still be being written out for unit u - B.
  if (u >= B_ && writes_[u - B_].valid() && !write_noted_[u - B_]) NoteWrite(u - B_);
  read_issue_[u] = NowNanos();
  reads_[u] = store_.ReadStates(units_[u].g, units_[u].piece, BufferOf(u).data());
  IssueGradRead(u);
}

Status StateRing::Run(StepOutcome* outcome) {
  // Sub-groups from `spec` on were stepped and written by the speculative
  // step being committed: they are only published here.
  const int64_t spec = step_->params_.speculated_from;
  const auto [g0, g1] = store_.partition().host_groups();
  size_t g_spec = g1;
  while (g_spec > g0 && layout_.group(g_spec - 1).elem_begin >= spec) --g_spec;
  if (g_spec == g0) {
    // All of them (no buffer needed); the reads begun during backward end
    // before their buffers go back.
    for (size_t g = g0; g < g1; ++g) step_->GroupDone(g);
    step_->read_ahead_.WaitAll();
    if (step_->writer_) {
      step_->writer_->WaitAll(outcome);
      if (!step_->writer_->first_error().ok()) return step_->writer_->first_error();
      step_->AddSpeculatedWritten(outcome);
    }
    outcome->states_written = true;
    return Status();
  }
  // The units before u_spec are stepped here.
  size_t u_spec = 0;
  while (u_spec < U_ && units_[u_spec].g < g_spec) ++u_spec;
  RETURN_IF_ERROR(AcquireBuffers());
  const size_t lookahead = StateLookahead(B_);
  const cpu_adam::StateFormat f = layout_.state_format();
  for (size_t u = 0; u < U_ && error_.ok(); ++u) {
    const StateUnit& unit = units_[u];
    const size_t g = unit.g;
    if (u >= u_spec) {
      if (unit.last) step_->GroupDone(g);
      continue;
    }
    if (!reads_[u].valid()) IssueRead(u);
    for (size_t j = u + 1; j < u_spec && j <= u + lookahead; ++j)
      if (!reads_[j].valid() && BufferFree(j, u)) IssueRead(j);
    if (step_->deps_.before_sub_group && unit.piece.elem_begin == layout_.group(g).elem_begin)
      step_->deps_.before_sub_group(g);
    Status rs = reads_[u].Wait();
    counters_.NoteNvme(read_issue_[u], NowNanos(), unit.piece.io_bytes, false,
                       "read state " + unit.Name());
    if (!rs.ok()) {
      error_ = rs.WithContext("reading optimizer state of sub-group " + unit.Name());
      break;
    }
    if (grad_reads_[u].valid()) {
      const int64_t t0 = NowNanos();
      Status gs = grad_reads_[u].Wait();
      if (grad_reads_[u].bytes() > 0)
        counters_.NoteNvme(t0, NowNanos(), static_cast<int64_t>(grad_reads_[u].bytes()), false,
                           "read grads " + unit.Name());
      if (!gs.ok()) {
        error_ = gs.WithContext("reading the gradients of sub-group " + unit.Name());
        break;
      }
    }
    if (!error_.ok()) break;  // a write behind it failed
    const StatePiece& pc = unit.piece;
    void* buf = BufferOf(u).data();
    Status ss = step_->StepRange(g, pc.elem_begin, pc.elem_end,
                                 StatesInBuffer(f, pc.elem_begin, pc.elems(), buf), grad_src_[u]);
    if (!ss.ok()) {
      error_ = ss;
      break;
    }
    write_issue_[u] = NowNanos();
    writes_[u] = store_.WriteStates(g, pc, buf);
    if (unit.last) step_->GroupDone(g);
    NoteWrites(false);
  }
  // Everything in flight lands before the buffers go back to the pool.
  for (size_t u = 0; u < U_; ++u) {
    if (reads_[u].valid()) reads_[u].Wait().IgnoreError();
    if (grad_reads_[u].valid()) grad_reads_[u].Wait().IgnoreError();
  }
  NoteWrites(true);
  if (step_->writer_) {
    step_->writer_->WaitAll(outcome);
    if (error_.ok() && !step_->writer_->first_error().ok()) error_ = step_->writer_->first_error();
    step_->AddSpeculatedWritten(outcome);
  }
  if (!error_.ok()) {
    return error_.WithContext(
        fmt::format("step {} failed; the previous parameters and optimizer states are intact (the "
                    "new versions were not committed)",
                    step_->params_.step));
  }
  outcome->states_written = true;
  return Status();
}

// ---- OptimizerStep -----------------------------------------------------------

StatusOr<std::unique_ptr<OptimizerStep>> OptimizerStep::Launch(const StepDeps& deps,
                                                               const StepParams& params,
                                                               StateReadAhead* read_ahead) {
  std::unique_ptr<OptimizerStep> step(new OptimizerStep(deps, params));
  if (read_ahead != nullptr) step->read_ahead_ = std::move(*read_ahead);
  if (deps.store->param_place() == OffloadDevice::kNvme && deps.store->next_params() == nullptr) {
    const auto n = static_cast<size_t>(deps.layout->num_modules());
    step->written_ = std::make_unique<std::atomic<bool>[]>(n);
    for (size_t m = 0; m < n; ++m) step->written_[m].store(false, std::memory_order_relaxed);
    for (int m : params.speculated_written)
      step->written_[static_cast<size_t>(m)].store(true, std::memory_order_relaxed);
    step->writer_ = std::make_unique<ParamWriter>(step.get());
    if (params.speculated_open) step->writer_->Adopt(std::move(*params.speculated_open));
  }
  if (!params.background) {
    step->Run();
    return step;
  }
  OptimizerStep* s = step.get();
  try {
    step->thread_ = std::thread([s] { s->Run(); });
  } catch (const std::system_error& e) {
    return ResourceExhaustedError(fmt::format(
        "starting the optimizer thread for step {}: {} (RLIMIT_NPROC?)", params.step, e.what()));
  }
  return step;
}

OptimizerStep::OptimizerStep(const StepDeps& deps, const StepParams& params)
    : deps_(deps), params_(params) {}

OptimizerStep::~OptimizerStep() {
  if (thread_.joinable()) thread_.join();
  writer_.reset();  // its writes land while the step's members still exist
}

bool OptimizerStep::ModuleReady(int m) const {
  const Layout& layout = *deps_.layout;
  int g = layout.module(m).last_group;
  if (g >= 0 && (layout.world_size() > 1 || deps_.store->partition().device_groups() > 0)) {
    // Several ranks: the last of this rank's sub-groups holding the module's
    // elements; none when the module lies in other ranks' partitions (their
    // sums were zeroed at the reduction, and nothing of it is stepped here).
    // The same with sub-groups stepped on the device: a module whose
    // elements all lie in them is the device step's, ready at once.
    const ModuleExtent& me = layout.module(m);
    const auto [own0, own1] = deps_.store->partition().host_elems();
    const int64_t lo = std::max(me.elem_begin, own0), hi = std::min(me.elem_end, own1);
    g = hi > lo ? static_cast<int>(layout.GroupOf(hi - 1)) : -1;
  }
  if (g < 0) return true;
  // The sub-group done first: its gradients are zeroed (or handed back to
  // the GradStore) before anything may use the module, so the next window's
  // backward never adds into sums the step still reads. With
  // offload_param nvme, also the module's write landed.
  if (groups_done_.load(std::memory_order_acquire) <= static_cast<size_t>(g)) return false;
  return !written_ || written_[static_cast<size_t>(m)].load(std::memory_order_acquire);
}

gpu::PinnedBuffer OptimizerStep::TakeUpdated(int m) {
  if (!writer_ || !ModuleReady(m)) return {};
  return writer_->TakeLanded(m);
}

void OptimizerStep::ModuleWritten(int m) {
  {
    MutexLock lock(&mu_);
    written_[static_cast<size_t>(m)].store(true, std::memory_order_release);
  }
  cv_.NotifyAll();
}

bool OptimizerStep::Finished(bool* ok) const {
  MutexLock lock(&mu_);
  *ok = ok_;
  return finished_;
}

bool OptimizerStep::WaitModule(int m) {
  if (ModuleReady(m)) return true;
  MutexLock lock(&mu_);
  while (!finished_ && !ModuleReady(m)) cv_.Wait(&mu_);
  return ModuleReady(m);
}

StepOutcome OptimizerStep::Join() {
  if (thread_.joinable()) thread_.join();
  return std::move(outcome_);
}

void OptimizerStep::Run() {
  Status s;
  if (params_.feed != nullptr) {
    s = FinishSpeculative(StepSpeculative());
  } else if (deps_.store->optimizer_place() == OffloadDevice::kNvme) {
    StateRing ring(this);
    s = ring.Run(&outcome_);
  } else {
    s = StepInMemory();
  }
  outcome_.status = s;
  {
    MutexLock lock(&mu_);
    finished_ = true;
    ok_ = s.ok();
  }
  cv_.NotifyAll();
}

std::vector<cpu_adam::ShardStep> OptimizerStep::ShardsIn(int64_t lo, int64_t hi,
                                                         const StateArrays& states,
                                                         const float* grads,
                                                         std::vector<Layout::Slice>* slices) const {
  const Layout& layout = *deps_.layout;
  uint8_t* next = deps_.store->next_params();
  const int64_t next_base =
      deps_.store->partition().param_byte_base();  // partitioned: this rank's first byte
  std::vector<cpu_adam::ShardStep> out;
  for (const Layout::Slice& s : layout.Slices(lo, hi)) {
    const ParamRec& p = layout.param(s.param);
    slices->push_back(s);
    cpu_adam::ShardStep st;
    st.hp =
        params_.group_hp.empty() ? params_.hp : params_.group_hp.at(static_cast<size_t>(p.group));
    states.Point(s.elem_begin, &st);
    st.grad = grads != nullptr ? grads + (s.elem_begin - lo) : params_.grads + s.elem_begin;
    st.grad_dtype = DType::kFp32;
    const uint8_t mode = FoldModeOf(s.param);
    if (mode != kAccOnly) {
      // The landed gradients beside the accumulator, in the optimizer's pass.
      st.grad = params_.landing + s.byte_offset;
      st.grad_dtype = p.dtype;
      st.fold = true;
      st.fold_acc = mode == kFoldAcc ? params_.grads + s.elem_begin : nullptr;
    }
    st.count = static_cast<size_t>(s.elem_end - s.elem_begin);
    st.copy_out = next != nullptr ? next + (s.byte_offset - next_base) : nullptr;
    st.copy_dtype = p.dtype;
    out.push_back(st);
  }
  return out;
}

Status OptimizerStep::StepGroup(size_t g, const StateArrays& states, const float* grads) {
  const SubGroup& sg = deps_.layout->group(g);
  return StepRange(g, sg.elem_begin, sg.elem_end, states, grads);
}

Status OptimizerStep::StepRange(size_t g, int64_t lo, int64_t hi, const StateArrays& states,
                                const float* grads) {
  std::vector<Layout::Slice> slices;
  std::vector<cpu_adam::ShardStep> shards = ShardsIn(lo, hi, states, grads, &slices);
  if (!writer_) return StepShards(g, shards);
  // offload_param nvme: each shard copies out into its module's write-back
  // buffer. When none is free, the shards gathered so far are stepped, the
  // modules they complete are written, and the oldest write is waited for.
  const Layout& layout = *deps_.layout;
  size_t first = 0;  // the first shard not stepped yet
  for (size_t i = 0; i < shards.size(); ++i) {
    const ParamRec& p = layout.param(slices[i].param);
    uint8_t* buf = writer_->BufferOf(p.module);
    while (buf == nullptr) {
      if (first < i) {
        RETURN_IF_ERROR(StepShards(g, std::span(shards).subspan(first, i - first)));
        for (size_t k = first; k < i; ++k)
          writer_->Stepped(layout.param(slices[k].param).module,
                           slices[k].elem_end - slices[k].elem_begin);
        writer_->Complete();
        first = i;
      }
      if (!writer_->Reap(/*oldest=*/true))
        return ResourceExhaustedError(fmt::format(
            "sub-group {}: no parameter write-back buffer is free for module {}", g, p.module));
      buf = writer_->BufferOf(p.module);
    }
    shards[i].copy_out =
        buf + (slices[i].byte_offset - deps_.store->partition().ModulePiece(p.module).first);
  }
  if (first < shards.size()) RETURN_IF_ERROR(StepShards(g, std::span(shards).subspan(first)));
  for (size_t k = first; k < shards.size(); ++k)
    writer_->Stepped(layout.param(slices[k].param).module,
                     slices[k].elem_end - slices[k].elem_begin);
  writer_->Complete();
  writer_->Reap(/*oldest=*/false);
  return Status();
}

Status OptimizerStep::StepShards(size_t g, std::span<const cpu_adam::ShardStep> shards) {
  const int64_t t0 = NowNanos();
  StatusOr<cpu_adam::StepResult> r = deps_.adam->StepMany(shards);
  const int64_t t1 = NowNanos();
  deps_.counters->AddOptimizerBusy(t1 - t0);
  deps_.counters->timeline().Add("cpu adam", fmt::format("sub-group {}", g), "optimizer", t0,
                                 t1 - t0, 0);
  if (!r.ok()) return r.status().WithContext(fmt::format("optimizer, sub-group {}", g));
  return Status();
}

uint8_t OptimizerStep::FoldModeOf(int param) const {
  if (params_.fold_modes.empty()) return kAccOnly;
  return params_.fold_modes[static_cast<size_t>(deps_.layout->param(param).module)];
}

void OptimizerStep::GroupDone(size_t g) {
  const SubGroup& sg = deps_.layout->group(g);
  if (deps_.grads != nullptr) {
    deps_.grads->Consumed(g);
  } else if (deps_.sums != nullptr) {
    // Zeroed in HBM by DeviceSums::Stream.
  } else if (params_.keep_grads) {
    // Replaced by the next window's sums (GradOffloader::direct()).
  } else if (params_.fold_modes.empty()) {
    // On the optimizer's threads: one thread's memset of a large sub-group
    // takes as long as the Adam pass over it on all of them.
    Status z = deps_.adam->Zero(params_.grads + sg.elem_begin, static_cast<size_t>(sg.elems()));
    if (!z.ok())  // (only for a null pointer, which the step never hands over)
      std::memset(params_.grads + sg.elem_begin, 0,
                  static_cast<size_t>(sg.elems()) * kGradAccBytesPerElem);
  } else {
    // Modules only landed left their accumulator part at zero.
    for (const Layout::Slice& s : deps_.layout->Slices(sg.elem_begin, sg.elem_end))
      if (FoldModeOf(s.param) != kFoldZero)
        std::memset(params_.grads + s.elem_begin, 0,
                    static_cast<size_t>(s.elem_end - s.elem_begin) * kGradAccBytesPerElem);
  }
  {
    MutexLock lock(&mu_);
    groups_done_.store(g + 1, std::memory_order_release);
  }
  cv_.NotifyAll();
}

Status OptimizerStep::StepInMemory() {
  StateStore& store = *deps_.store;
  Status step_error;
  const auto [g0, g1] = store.partition().host_groups();
  // Elements from speculated_from on were stepped during backward, and are
  // committed now.
  const int64_t spec = params_.speculated_from;
  if (deps_.sums != nullptr) {
    // The sums in HBM, a chunk at a time (no speculation with them).
    if (spec != INT64_MAX) return InternalError("a speculative step with the window's sums in HBM");
    step_error = deps_.sums->Stream(
        g0, g1,
        [&](size_t g, int64_t lo, int64_t hi, const float* sums) {
          if (lo == deps_.layout->group(g).elem_begin && deps_.before_sub_group)
            deps_.before_sub_group(g);
          return StepRange(g, lo, hi, store.states(), sums);
        },
        [&](size_t g) {
          outcome_.advanced = true;
          GroupDone(g);
        });
  }
  for (size_t g = deps_.sums != nullptr ? g1 : g0; g < g1; ++g) {
    const SubGroup& sg = deps_.layout->group(g);
    if (sg.elem_begin >= spec) {
      outcome_.advanced = true;
      GroupDone(g);
      continue;
    }
    if (deps_.before_sub_group) deps_.before_sub_group(g);
    if (sg.elem_end > spec) {
      step_error = StepRange(g, sg.elem_begin, spec, store.states(), nullptr);
    } else {
      step_error = StepGroup(g, store.states(), nullptr);
    }
    if (!step_error.ok()) break;
    outcome_.advanced = true;
    GroupDone(g);
  }
  // Every write issued lands before this thread ends (io_uring may cancel
  // requests of a thread that has exited).
  Status first_error;
  if (writer_) {
    writer_->WaitAll(&outcome_);
    first_error = writer_->first_error();
    AddSpeculatedWritten(&outcome_);
  }
  if (!step_error.ok()) return step_error;
  if (!first_error.ok()) {
    return DataLossError(fmt::format(
        "step {}: the optimizer states and fp32 master parameters were updated, but writing the "
        "updated parameters of {} module(s) to NVMe failed ({}); those modules' parameters on "
        "NVMe stay those of step {} until the next successful step rewrites them",
        params_.step, outcome_.param_write_failed.size(), first_error.ToString(),
        params_.step - 1));
  }
  return Status();
}

std::vector<OpenModule> OptimizerStep::TakeOpenModules() {
  return writer_ ? writer_->TakeOpen() : std::vector<OpenModule>{};
}

void OptimizerStep::AddSpeculatedWritten(StepOutcome* outcome) const {
  // The modules a committed speculative step wrote flip with the rest.
  outcome->param_written.insert(outcome->param_written.end(), params_.speculated_written.begin(),
                                params_.speculated_written.end());
}

Status OptimizerStep::StepSpeculativeNvme() {
  StateStore& store = *deps_.store;
  const Layout& layout = *deps_.layout;
  const auto [g0, g1] = store.partition().host_groups();
  spec_from_ = store.partition().host_elems().second;
  // The pipeline's buffers the read-ahead left (at least one), each with
  // the write of the piece it held last.
  struct Slot {
    gpu::PinnedBuffer buf;
    nvme::IoHandle write;
    StateUnit unit;  // the piece it holds
    int64_t issued = 0;
  };
  std::vector<Slot> slots;
  const size_t want = static_cast<size_t>(std::max<int64_t>(1, deps_.buffer_count));
  while (slots.size() < want) {
    StatusOr<gpu::PinnedBuffer> b =
        store.optimizer_pool()->Acquire(static_cast<size_t>(store.optimizer_buffer_bytes()));
    if (!b.ok()) break;
    slots.push_back(Slot{std::move(*b), {}, {}, 0});
  }
  if (slots.empty())
    return ResourceExhaustedError(
        "speculative step: no optimizer pipeline buffer free (the read-ahead holds them all)");
  Status error;
  // Waits for a slot's write; the sub-group it wrote counts as speculated
  // only once it has landed.
  auto land = [&](Slot& sl) {
    if (!sl.write.valid()) return;
    Status w = sl.write.Wait();
    deps_.counters->NoteNvme(sl.issued, NowNanos(), sl.unit.piece.io_bytes, true,
                             "write state " + sl.unit.Name() + " (speculative)");
    sl.write = {};
    if (!w.ok() && error.ok())
      error =
          w.WithContext("speculative step: writing optimizer state of sub-group " + sl.unit.Name());
  };
  int64_t handed = spec_from_;  // the lowest element handed over so far
  size_t next = g1;             // the sub-groups from next on are stepped
  size_t k = 0;                 // the slot the next piece uses
  while (error.ok()) {
    std::optional<SpeculationFeed::Item> item = params_.feed->Next();
    if (!item) break;
    const int64_t lo = item->elem_begin, hi = item->elem_end;
    if (hi != handed || lo >= hi)
      return InternalError(fmt::format(
          "speculative step: elements [{}, {}) handed over out of order (next expected to end at "
          "{})",
          lo, hi, handed));
    RETURN_IF_ERROR(item->wait().WithContext(
        fmt::format("speculative step: the gradients of elements [{}, {})", lo, hi)));
    params_.fold_modes = std::move(item->fold_modes);
    handed = lo;
    // Every sub-group handed over in full, from the top down, piece by
    // piece: read its active version, step it, write its inactive one.
    while (error.ok() && next > g0 && layout.group(next - 1).elem_begin >= handed) {
      const size_t g = --next;
      const SubGroup& sg = layout.group(g);
      for (const StateUnit& unit : StateUnits(layout, g, g + 1)) {
        Slot& sl = slots[k];
        k = (k + 1) % slots.size();
        land(sl);
        if (!error.ok()) break;
        const int64_t t0 = NowNanos();
        Status rs = store.ReadStates(g, unit.piece, sl.buf.data()).Wait();
        deps_.counters->NoteNvme(t0, NowNanos(), unit.piece.io_bytes, false,
                                 "read state " + unit.Name() + " (speculative)");
        if (!rs.ok()) {
          error = rs.WithContext("speculative step: reading optimizer state of sub-group " +
                                 unit.Name());
          break;
        }
        const StatePiece& pc = unit.piece;
        // The window's sums on NVMe: the piece's, after its states in the
        // buffer (final: the sub-group was handed over whole).
        const float* sums = nullptr;
        if (deps_.grads != nullptr) {
          auto* gbuf = reinterpret_cast<float*>(sl.buf.as<uint8_t>() + store.grad_buffer_offset());
          const int64_t t1 = NowNanos();
          nvme::IoHandle h = deps_.grads->Peek(g, pc, gbuf, &sums);
          Status gs = h.Wait();
          if (h.bytes() > 0)
            deps_.counters->NoteNvme(t1, NowNanos(), static_cast<int64_t>(h.bytes()), false,
                                     "read grads " + unit.Name() + " (speculative)");
          if (!gs.ok()) {
            error = gs.WithContext("speculative step: reading the gradients of sub-group " +
                                   unit.Name());
            break;
          }
        }
        if (deps_.before_sub_group && unit.piece.elem_begin == sg.elem_begin)
          deps_.before_sub_group(g);
        Status ss = StepRange(
            g, pc.elem_begin, pc.elem_end,
            StatesInBuffer(layout.state_format(), pc.elem_begin, pc.elems(), sl.buf.data()), sums);
        if (!ss.ok()) {
          error = ss;
          break;
        }
        sl.unit = unit;
        sl.issued = NowNanos();
        sl.write = store.WriteStates(g, pc, sl.buf.data());
      }
      if (error.ok()) spec_from_ = sg.elem_begin;
    }
  }
  for (Slot& sl : slots) land(sl);
  return error;
}

Status OptimizerStep::StepSpeculative() {
  if (deps_.store->optimizer_place() == OffloadDevice::kNvme) return StepSpeculativeNvme();
  StateStore& store = *deps_.store;
  const Layout& layout = *deps_.layout;
  spec_from_ = store.partition().host_elems().second;
  while (std::optional<SpeculationFeed::Item> item = params_.feed->Next()) {
    const int64_t lo = item->elem_begin, hi = item->elem_end;
    if (hi != spec_from_ || lo >= hi || lo < params_.spare.first)
      return InternalError(fmt::format(
          "speculative step: elements [{}, {}) handed over out of order or outside the spare "
          "(next expected to end at {}, spare from element {})",
          lo, hi, spec_from_, params_.spare.first));
    RETURN_IF_ERROR(item->wait().WithContext(
        fmt::format("speculative step: the gradients of elements [{}, {})", lo, hi)));
    params_.fold_modes = std::move(item->fold_modes);
    // The previous states first: a rollback copies them back.
    const int64_t t0 = NowNanos();
    RETURN_IF_ERROR(CopyStates(deps_.adam, store.states(), params_.spare, lo, hi));
    deps_.counters->timeline().Add("cpu adam", fmt::format("save elements {}..{}", lo, hi),
                                   "optimizer", t0, NowNanos() - t0, 0);
    spec_from_ = lo;  // from here on the states may have changed
    // Sub-group by sub-group: the part of each in the range, in element
    // order (with offload_param nvme a module is written once every element
    // up to its last has been stepped).
    for (size_t g = layout.GroupOf(lo); g <= layout.GroupOf(hi - 1); ++g) {
      const SubGroup& sg = layout.group(g);
      if (deps_.before_sub_group) deps_.before_sub_group(g);
      RETURN_IF_ERROR(StepRange(g, std::max(lo, sg.elem_begin), std::min(hi, sg.elem_end),
                                store.states(), nullptr));
    }
  }
  return Status();
}

Status OptimizerStep::FinishSpeculative(Status s) {
  // offload_param nvme: every module write lands before this thread ends;
  // one that failed voids the speculation (the step after the checks
  // rewrites every module).
  if (!writer_) return s;
  writer_->WaitAll(&outcome_);
  if (s.ok() && !writer_->first_error().ok()) return writer_->first_error();
  return s;
}

}  // namespace strata::scheduler
