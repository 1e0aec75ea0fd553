#include "src/scheduler/optimizer_step.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <system_error>

#include "src/common/status_util.h"
#include "src/common/timer.h"

namespace strata::scheduler {

// ---- StateReadAhead ------------------------------------------------------------

void StateReadAhead::Start(const StepDeps& deps) {
  const Layout& layout = *deps.layout;
  const size_t want = static_cast<size_t>(std::max<int64_t>(1, deps.buffer_count));
  const size_t n =
      std::min(layout.num_groups(), StateLookahead(std::min(want, layout.num_groups())) + 1);
  for (size_t g = 0; g < n; ++g) {
    StatusOr<gpu::PinnedBuffer> b = deps.store->optimizer_pool()->Acquire(
        static_cast<size_t>(kOptimizerStateBytesPerElem * layout.max_group_elems()));
    if (!b.ok()) break;  // the ring acquires what it can itself
    buffers_.push_back(std::move(*b));
    issue_ns_.push_back(NowNanos());
    reads_.push_back(deps.store->ReadStates(g, buffers_.back().data()));
  }
}

void StateReadAhead::WaitAll() {
  for (auto& h : reads_) h.Wait().IgnoreError();
}

// ---- StateRing: NVMe read → CPU Adam → NVMe write ---------------------------

// Streams every sub-group's states through B pinned buffers: sub-group g
// uses buffer g % B; its read is issued once the buffer's previous write
// (sub-group g - B) has landed, up to StateLookahead(B) sub-groups ahead.
class StateRing {
 public:
  explicit StateRing(OptimizerStep* step)
      : step_(step),
        layout_(*step->deps_.layout),
        store_(*step->deps_.store),
        counters_(*step->deps_.counters),
        G_(layout_.num_groups()),
        reads_(G_),
        writes_(G_),
        read_issue_(G_, 0),
        write_issue_(G_, 0),
        write_noted_(G_, false) {}

  Status Run(StepOutcome* outcome);

 private:
  Status AcquireBuffers();
  void IssueRead(size_t g);
  void NoteWrite(size_t g);
  void NoteWrites(bool wait);
  bool BufferFree(size_t j, size_t g) const {
    return j < B_ || write_noted_[j - B_] || !writes_[j - B_].valid() || j - B_ < g;
  }

  OptimizerStep* step_;
  const Layout& layout_;
  StateStore& store_;
  StepCounters& counters_;
  const size_t G_;
  size_t B_ = 0;
  std::vector<gpu::PinnedBuffer> buffers_;
  std::vector<nvme::IoHandle> reads_, writes_;
  std::vector<int64_t> read_issue_, write_issue_;
  std::vector<bool> write_noted_;
  Status error_;
};

Status StateRing::AcquireBuffers() {
  StateReadAhead& pre = step_->read_ahead_;
  // The sub-groups read ahead during backward come first.
  buffers_ = std::move(pre.buffers_);
  pre.buffers_.clear();
  for (size_t g = 0; g < pre.reads_.size(); ++g) {
    reads_[g] = std::move(pre.reads_[g]);
    read_issue_[g] = pre.issue_ns_[g];
  }
  pre.reads_.clear();
  pre.issue_ns_.clear();
  const int64_t want = std::max<int64_t>(1, step_->deps_.buffer_count);
  for (int64_t i = static_cast<int64_t>(buffers_.size()); i < want && i < static_cast<int64_t>(G_);
       ++i) {
    StatusOr<gpu::PinnedBuffer> b = store_.optimizer_pool()->Acquire(
        static_cast<size_t>(kOptimizerStateBytesPerElem * layout_.max_group_elems()));
    if (!b.ok()) {
      if (buffers_.empty()) return b.status().WithContext("optimizer pipeline buffers");
      break;
    }
    buffers_.push_back(std::move(*b));
  }
  B_ = buffers_.size();
  return Status();
}

void StateRing::NoteWrite(size_t g) {
  Status s = writes_[g].Wait();
  counters_.NoteNvme(write_issue_[g], NowNanos(), layout_.group(g).state_io_bytes(), true,
                     fmt::format("write state {}", g));
  write_noted_[g] = true;
  if (!s.ok() && error_.ok())
    error_ = s.WithContext(fmt::format("writing optimizer state of sub-group {}", g));
}

void StateRing::NoteWrites(bool wait) {
  for (size_t g = 0; g < G_; ++g) {
    if (!writes_[g].valid() || write_noted_[g]) continue;
    if (!wait && !writes_[g].Poll()) continue;
    NoteWrite(g);
  }
}

void StateRing::IssueRead(size_t g) {
  // The buffer may still be being written out for sub-group g - B.
  if (g >= B_ && writes_[g - B_].valid() && !write_noted_[g - B_]) NoteWrite(g - B_);
  read_issue_[g] = NowNanos();
  reads_[g] = store_.ReadStates(g, buffers_[g % B_].data());
}

Status StateRing::Run(StepOutcome* outcome) {
  RETURN_IF_ERROR(AcquireBuffers());
  std::vector<std::pair<int, nvme::IoHandle>> param_writes;
  const size_t lookahead = StateLookahead(B_);
  for (size_t g = 0; g < G_ && error_.ok(); ++g) {
    if (!reads_[g].valid()) IssueRead(g);
    for (size_t j = g + 1; j < G_ && j <= g + lookahead; ++j)
      if (!reads_[j].valid() && BufferFree(j, g)) IssueRead(j);
    if (step_->deps_.before_sub_group) step_->deps_.before_sub_group(g);
    Status rs = reads_[g].Wait();
    counters_.NoteNvme(read_issue_[g], NowNanos(), layout_.group(g).state_io_bytes(), false,
                       fmt::format("read state {}", g));
    if (!rs.ok()) {
      error_ = rs.WithContext(fmt::format("reading optimizer state of sub-group {}", g));
      break;
    }
    if (!error_.ok()) break;  // a write behind it failed
    const SubGroup& sg = layout_.group(g);
    float* buf = buffers_[g % B_].as<float>();
    const int64_t e = sg.elems();
    std::vector<cpu_adam::ShardStep> shards =
        step_->Shards(g, sg.elem_begin, buf, buf + e, buf + 2 * e);
    Status ss = step_->StepShards(g, shards);
    if (!ss.ok()) {
      error_ = ss;
      break;
    }
    write_issue_[g] = NowNanos();
    writes_[g] = store_.WriteStates(g, buf);
    if (store_.param_place() == OffloadDevice::kNvme) step_->WriteModulesOf(g, &param_writes);
    step_->GroupDone(g);
    NoteWrites(false);
  }
  // Everything in flight lands before the buffers go back to the pool.
  for (size_t g = 0; g < G_; ++g)
    if (reads_[g].valid()) reads_[g].Wait().IgnoreError();
  NoteWrites(true);
  const int64_t pw0 = NowNanos();
  for (auto& [module, h] : param_writes) {
    Status s = h.Wait();
    counters_.AddNvmeWritten(static_cast<int64_t>(h.bytes()));
    if (s.ok()) outcome->param_written.push_back(module);
    if (!s.ok() && error_.ok())
      error_ =
          s.WithContext(fmt::format("writing the updated parameters of module {} to NVMe", module));
  }
  if (!param_writes.empty()) counters_.AddNvmeInterval(pw0, NowNanos());
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

OptimizerStep::~OptimizerStep() {
  if (thread_.joinable()) thread_.join();
}

bool OptimizerStep::ModuleReady(int m) const {
  const int g = deps_.layout->module(m).last_group;
  return g < 0 || groups_done_.load(std::memory_order_acquire) > static_cast<size_t>(g);
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
  if (deps_.store->optimizer_place() == OffloadDevice::kNvme) {
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

std::vector<cpu_adam::ShardStep> OptimizerStep::Shards(size_t g, int64_t base, float* master,
                                                       float* m, float* v) const {
  const Layout& layout = *deps_.layout;
  const SubGroup& sg = layout.group(g);
  uint8_t* next = deps_.store->next_params();
  std::vector<cpu_adam::ShardStep> out;
  for (const Layout::Slice& s : layout.Slices(sg.elem_begin, sg.elem_end)) {
    const ParamRec& p = layout.param(s.param);
    cpu_adam::ShardStep st;
    st.param = master + (s.elem_begin - base);
    st.grad = params_.grads + s.elem_begin;
    st.grad_dtype = DType::kFp32;
    const uint8_t mode = FoldModeOf(s.param);
    if (mode != kAccOnly) {
      // The landed gradients beside the accumulator, in the optimizer's pass.
      st.grad = params_.landing + s.byte_offset;
      st.grad_dtype = p.dtype;
      st.fold = true;
      st.fold_acc = mode == kFoldAcc ? params_.grads + s.elem_begin : nullptr;
    }
    st.exp_avg = m + (s.elem_begin - base);
    st.exp_avg_sq = v + (s.elem_begin - base);
    st.count = static_cast<size_t>(s.elem_end - s.elem_begin);
    st.copy_out = next + s.byte_offset;
    st.copy_dtype = p.dtype;
    st.hp =
        params_.group_hp.empty() ? params_.hp : params_.group_hp.at(static_cast<size_t>(p.group));
    out.push_back(st);
  }
  return out;
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
  if (params_.fold_modes.empty()) {
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

void OptimizerStep::WriteModulesOf(size_t g, std::vector<std::pair<int, nvme::IoHandle>>* writes) {
  // A module is written whole (page-aligned, see kIoAlign) once the sub-group
  // holding its last element has been stepped: sub-groups run in order, so
  // all of its elements have been copied out by then.
  const SubGroup& sg = deps_.layout->group(g);
  // The bytes count when the write is waited for.
  for (int m : deps_.layout->ModulesEndingIn(sg.elem_begin, sg.elem_end))
    writes->emplace_back(m, deps_.store->WriteModule(m));
}

Status OptimizerStep::StepInMemory() {
  StateStore& store = *deps_.store;
  std::vector<std::pair<int, nvme::IoHandle>> writes;
  std::vector<int64_t> write_issue;
  Status step_error;
  for (size_t g = 0; g < deps_.layout->num_groups(); ++g) {
    if (deps_.before_sub_group) deps_.before_sub_group(g);
    std::vector<cpu_adam::ShardStep> shards =
        Shards(g, 0, store.master(), store.exp_avg(), store.exp_avg_sq());
    step_error = StepShards(g, shards);
    if (!step_error.ok()) break;
    const int64_t t1 = NowNanos();
    outcome_.advanced = true;
    if (store.param_place() == OffloadDevice::kNvme) {
      const size_t before = writes.size();
      WriteModulesOf(g, &writes);
      for (size_t i = before; i < writes.size(); ++i) write_issue.push_back(t1);
    }
    GroupDone(g);
  }
  // Every write issued lands before this thread ends (io_uring may cancel
  // requests of a thread that has exited).
  Status first_error;
  for (size_t i = 0; i < writes.size(); ++i) {
    Status s = writes[i].second.Wait();
    deps_.counters->NoteNvme(write_issue[i], NowNanos(),
                             static_cast<int64_t>(writes[i].second.bytes()), true, "write params");
    if (s.ok()) {
      outcome_.param_written.push_back(writes[i].first);
      continue;
    }
    outcome_.param_write_failed.push_back(writes[i].first);
    if (first_error.ok()) first_error = s;
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

}  // namespace strata::scheduler
