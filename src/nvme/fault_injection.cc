// FaultInjectionEngine: forwards ops to its target and replaces the result of
// the ones a rule picks (EIO, ENOSPC, EAGAIN, or a short transfer). The op is
// still performed by the target, so a fault arrives on an engine thread like a
// real one.
#include <algorithm>
#include <atomic>
#include <vector>

#include "src/common/thread_annotations.h"
#include "src/nvme/nvme.h"

namespace strata::nvme {

namespace {
// What replaces the caller's op while the target runs it.
struct Shadow {
  IoOp op;
  IoOp* orig;
  bool short_fault;  // report `short_bytes` instead of the result
  int64_t err;       // -errno to report when !short_fault
  uint32_t short_bytes;
};

void ShadowDone(IoOp* op, int64_t result) {
  auto* s = static_cast<Shadow*>(op->ctx);
  IoOp* orig = s->orig;
  int64_t r =
      s->short_fault ? (result < 0 ? result : std::min<int64_t>(result, s->short_bytes)) : s->err;
  delete s;
  orig->done(orig, r);
}
}  // namespace

struct FaultInjectionEngine::State {
  struct Armed {
    Rule rule;
    int64_t seen = 0;
  };
  Mutex mu;
  std::vector<Armed> rules GUARDED_BY(mu);
  std::atomic<int64_t> injected{0};
};

FaultInjectionEngine::FaultInjectionEngine(std::unique_ptr<IoEngine> target)
    : IoEngineWrapper(std::move(target)), state_(std::make_unique<State>()) {}
FaultInjectionEngine::~FaultInjectionEngine() { Shutdown(); }

void FaultInjectionEngine::AddRule(const Rule& rule) {
  MutexLock lock(&state_->mu);
  state_->rules.push_back({rule, 0});
}

void FaultInjectionEngine::ClearRules() {
  MutexLock lock(&state_->mu);
  state_->rules.clear();
}

int64_t FaultInjectionEngine::faults_injected() const { return state_->injected.load(); }

Status FaultInjectionEngine::Submit(std::span<IoOp* const> ops) {
  std::vector<IoOp*> out(ops.begin(), ops.end());
  std::vector<Shadow*> shadows;
  {
    MutexLock lock(&state_->mu);
    for (auto& op : out) {
      for (auto& a : state_->rules) {
        const Rule& r = a.rule;
        if (r.kind != op->kind) continue;
        if (r.at_offset >= 0 && (static_cast<uint64_t>(r.at_offset) < op->offset ||
                                 static_cast<uint64_t>(r.at_offset) >= op->offset + op->len))
          continue;
        ++a.seen;
        if (a.seen < r.nth || a.seen >= r.nth + r.times) continue;
        auto* s = new Shadow{*op, op, r.fault == Fault::kShort, -std::abs(r.err),
                             std::min<uint32_t>(r.short_bytes, op->len)};
        s->op.ctx = s;
        s->op.done = &ShadowDone;
        // A short fault reports fewer bytes than the target moved (the op
        // keeps its length, so O_DIRECT alignment still holds).
        shadows.push_back(s);
        op = &s->op;
        state_->injected.fetch_add(1);
        break;
      }
    }
  }
  Status st = IoEngineWrapper::Submit(out);
  if (!st.ok()) {
    for (Shadow* s : shadows) delete s;
  }
  return st;
}

}  // namespace strata::nvme
