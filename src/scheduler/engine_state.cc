// src/scheduler/engine_state.cc — what the Engine does between windows:
// checkpoints, parameters read and written, the learning rate, workspaces
// for the framework, statistics and the timeline (engine_impl.h).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/timer.h"
#include "src/scheduler/engine_impl.h"

namespace strata::scheduler {

Status EngineImpl::SetLearningRate(double lr) {
  for (int g = 0; g < num_param_groups(); ++g) RETURN_IF_ERROR(SetLearningRate(g, lr));
  return Status();
}

Status EngineImpl::SetLearningRate(int group, double lr) {
  RETURN_IF_ERROR(CheckGroup(group, "SetLearningRate"));
  if (!std::isfinite(lr) || lr < 0)
    return InvalidArgumentError(
        fmt::format("SetLearningRate: {} is not allowed; must be >= 0", lr));
  if (cfg_.scheduler.type != LrScheduleType::kNone)
    return FailedPreconditionError(fmt::format(
        "SetLearningRate: the config's scheduler section ({}) sets the learning rate at every "
        "step; remove the section to set the learning rate from outside",
        LrScheduleTypeName(cfg_.scheduler.type)));
  lr_override_[static_cast<size_t>(group)] = lr;
  return Status();
}

double EngineImpl::learning_rate(int group) const {
  if (group < 0 || group >= num_param_groups()) return 0.0;
  const auto g = static_cast<size_t>(group);
  return scheduler::GroupLearningRate(cfg_, planned_ ? backend_->steps() : 0, groups_[g],
                                      lr_override_[g]);
}

// ---------------------------------------------------------------------------
// Checkpoints (checkpoint.h): between windows, nothing in flight
// ---------------------------------------------------------------------------

Status EngineImpl::BetweenWindows(const std::string& call, std::string_view advice) const {
  if (window_.micro_batches == 0 && !window_.grads_since_launch && !fetcher_->any_grad())
    return Status();
  return FailedPreconditionError(fmt::format(
      "{}: in the middle of an accumulation window ({} of {} micro-batches done, gradients not "
      "applied); {}",
      call, window_.micro_batches, gas_, advice));
}

Status EngineImpl::SaveCheckpoint(const std::string& dir, const CheckpointInfo& info) {
  RETURN_IF_ERROR(Plan());
  RETURN_IF_ERROR(BetweenWindows("SaveCheckpoint", "save after the Step() that ends the window"));
  RETURN_IF_ERROR(backend_->Join());
  RETURN_IF_ERROR(dev_->Synchronize());
  scheduler::CheckpointMeta meta;
  meta.optimizer_step = backend_->steps();
  meta.scaler = scaler_.state();
  meta.data_position = info.data_position;
  meta.note = info.note;
  meta.at_point = hooks_.checkpoint_point;
  meta.run_id = info.run_id.empty() ? run_id_ : info.run_id;
  meta.param_groups = groups_;
  const scheduler::CheckpointRanks* ranks = CheckpointRanks();
  Status s = scheduler::WriteCheckpoint(dir, cfg_, layout_, store_.get(), &meta, ranks);
  HoldCheckpointLock(std::move(meta.lock));
  if (!s.ok()) return s.WithContext("SaveCheckpoint " + dir);
  run_id_ = meta.run_id;
  return Status();
}

Status EngineImpl::LoadCheckpoint(const std::string& dir, CheckpointInfo* info) {
  RETURN_IF_ERROR(Plan());
  if (fetcher_->any_grad())
    return FailedPreconditionError(
        "LoadCheckpoint: a module's gradients were not handed over with AfterBackward");
  // A step in flight ends first; its outcome no longer matters.
  Status fs = backend_->Abandon();
  if (!fs.ok()) STRATA_LOG_WARN("LoadCheckpoint: the step in flight failed: {}", fs.ToString());
  RETURN_IF_ERROR(dev_->Synchronize());
  StatusOr<scheduler::CheckpointMeta> meta =
      scheduler::ReadCheckpoint(dir, cfg_, layout_, store_.get(), groups_, CheckpointRanks(),
                                info != nullptr && info->convert_optimizer_states);
  // Device copies of parameters are stale once anything was restored.
  RETURN_IF_ERROR(fetcher_->InvalidateAll());
  if (!meta.ok()) return meta.status().WithContext("LoadCheckpoint " + dir);
  HoldCheckpointLock(std::move(meta->lock));
  run_id_ = meta->run_id;
  backend_->set_steps(meta->optimizer_step);
  scaler_.Restore(meta->scaler);
  backend_->DiscardWindow();
  if (info != nullptr) {
    info->data_position = meta->data_position;
    info->note = meta->note;
    info->optimizer_step = meta->optimizer_step;
    info->path = meta->path;
    info->run_id = meta->run_id;
  }
  return Status();
}

// ---------------------------------------------------------------------------
// The rest of the API
// ---------------------------------------------------------------------------

StatusOr<void*> EngineImpl::AllocateWorkspace(int64_t bytes) {
  if (bytes <= 0) return InvalidArgumentError(fmt::format("AllocateWorkspace: {} bytes", bytes));
  // From the arena's room beyond the plan's blocks (the fetcher's slots are
  // allocated once and never grow).
  ASSIGN_OR_RETURN(gpu::DeviceBuffer b, dev_->Allocate(static_cast<size_t>(bytes)));
  void* p = b.data();
  workspaces_[p] = std::move(b);
  return p;
}

Status EngineImpl::FreeWorkspace(void* ptr) {
  auto it = workspaces_.find(ptr);
  if (it == workspaces_.end())
    return InvalidArgumentError("FreeWorkspace: not a workspace pointer");
  RETURN_IF_ERROR(dev_->compute().Synchronize());
  workspaces_.erase(it);
  return Status();
}

Status EngineImpl::ReadParameter(int id, std::span<float> out) {
  if (id < 0 || id >= static_cast<int>(regs_.size()))
    return InvalidArgumentError(fmt::format("ReadParameter: no parameter {}", id));
  const Registration& r = regs_[static_cast<size_t>(id)];
  if (static_cast<int64_t>(out.size()) != r.rec.numel)
    return InvalidArgumentError(
        fmt::format("ReadParameter {}: buffer of {} floats, parameter has {}", r.rec.name,
                    out.size(), r.rec.numel));
  if (!planned_) {
    if (!r.init.empty()) {
      std::copy(r.init.begin(), r.init.end(), out.begin());
    } else {
      r.initializer(out);
    }
    return Status();
  }
  // A step in flight is finished (and committed) first: its states are read;
  // a speculative one of the window in progress is dropped.
  RETURN_IF_ERROR(backend_->CancelSpeculation());
  RETURN_IF_ERROR(backend_->Join());
  RETURN_IF_ERROR(store_->ReadMaster(layout_.param(id), out));
  // Several ranks: the other partitions' values from their owners.
  if (dp_) return dp_->ShareMaster(layout_.param(id), out);
  return Status();
}

Status EngineImpl::WriteParameter(int id, std::span<const float> values) {
  if (id < 0 || id >= static_cast<int>(regs_.size()))
    return InvalidArgumentError(fmt::format("WriteParameter: no parameter {}", id));
  Registration& r = regs_[static_cast<size_t>(id)];
  if (static_cast<int64_t>(values.size()) != r.rec.numel)
    return InvalidArgumentError(fmt::format("WriteParameter {}: {} floats given, parameter has {}",
                                            r.rec.name, values.size(), r.rec.numel));
  if (!planned_) {
    r.init.assign(values.begin(), values.end());
    r.initializer = nullptr;
    return Status();
  }
  RETURN_IF_ERROR(BetweenWindows("WriteParameter " + r.rec.name, "write between windows"));
  RETURN_IF_ERROR(backend_->Join());
  RETURN_IF_ERROR(dev_->Synchronize());
  RETURN_IF_ERROR(store_->WriteMaster(layout_.param(id), values));
  // Device copies fetched before are stale.
  return fetcher_->InvalidateAll();
}

std::string EngineImpl::StatsJson() const {
  return scheduler::StepStatsJson(last_, dev_->Describe());
}

Status EngineImpl::WriteTimeline() {
  if (cfg_.strata.trace_path.empty())
    return FailedPreconditionError("WriteTimeline: strata.trace_path is not set");
  return counters_.timeline().WriteJson(cfg_.strata.trace_path);
}

}  // namespace strata::scheduler
