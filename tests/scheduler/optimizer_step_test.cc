// OptimizerStep with a StateStore, without an Engine: a step with the
// optimizer states on NVMe (the state ring) computes bitwise what the same
// step computes with the states in memory; a read error, a write error or a
// short read fails the step naming the sub-group, writes nothing current, and
// after the rollback the next step is the one that would have followed had
// the failed one never run; the main thread sees modules become ready as the
// step goes.
#include "src/scheduler/optimizer_step.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "src/common/aligned_buffer.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/nvme/nvme.h"
#include "tests/scheduler/parts_test_util.h"

namespace strata::scheduler {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using testing::Rec;

// Six modules of mixed dtypes and odd sizes; sub-groups of 700 elements split
// parameters and modules.
Layout MakeLayout() {
  static const DType kTypes[] = {DType::kBf16, DType::kFp16, DType::kFp32};
  std::vector<ParamRec> recs;
  for (int m = 0; m < 6; ++m) {
    std::string w = "m", b = "m";
    w += std::to_string(m) + ".w";
    b += std::to_string(m) + ".b";
    recs.push_back(Rec(w, 900 + 131 * m, kTypes[m % 3], m));
    recs.push_back(Rec(b, 5 + 3 * m, kTypes[(m + 2) % 3], m));
  }
  LayoutOptions o;
  o.sub_group_size = 700;
  o.params_offloaded = true;
  return Layout::Build(std::move(recs), o);
}

// Everything of one store: master, exp_avg, exp_avg_sq and the current
// parameter bytes.
struct Snapshot {
  std::vector<float> master, m, v;
  std::vector<uint8_t> params;
};

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// A device and a StateStore (offload_param cpu) with the optimizer states on
// NVMe (I/O through a FaultInjectionEngine) or in DRAM.
struct Rig {
  Rig(const Layout& layout, const std::vector<std::vector<float>>& init, OffloadDevice opt,
      int64_t buffer_count)
      : layout(layout), part(&layout) {
    dev = testing::MakeHostDevice(1 << 20);
    if (dev == nullptr) return;
    cfg = testing::StoreConfig(opt, OffloadDevice::kCpu, dir.str(), buffer_count);
    store = std::make_unique<StateStore>(dev.get(), &layout, part, &counters, &cfg);
    open = testing::OpenStore(
        *store, cfg, layout, init,
        [this](std::unique_ptr<nvme::IoEngine> inner) -> std::unique_ptr<nvme::IoEngine> {
          auto f = std::make_unique<nvme::FaultInjectionEngine>(std::move(inner));
          faults = f.get();
          return f;
        });
    cpu_adam::Options ao;
    ao.threads = 2;
    auto a = cpu_adam::CpuOptimizer::Create(ao);
    if (!a.ok()) {
      open = a.status();
      return;
    }
    adam = std::move(a).value();
  }
  ~Rig() {
    store.reset();
    dev.reset();
  }

  StepDeps Deps(std::function<void(size_t)> hook = {}) {
    StepDeps d;
    d.layout = &layout;
    d.store = store.get();
    d.adam = adam.get();
    d.counters = &counters;
    d.buffer_count = cfg.zero_optimization.offload_optimizer.buffer_count;
    d.before_sub_group = std::move(hook);
    return d;
  }

  // Runs optimizer step `step` on `grads` (consumed: zeroed as it goes) and
  // joins it.
  StepOutcome Step(int64_t step, std::vector<float>& grads, bool background,
                   std::function<void(size_t)> hook = {}) {
    StepParams p;
    p.hp.algorithm = cpu_adam::Algorithm::kAdamW;
    p.hp.lr = 1e-2;
    p.hp.weight_decay = 0.01;
    p.hp.step = step;
    p.step = step;
    p.background = background;
    p.grads = grads.data();
    auto run = OptimizerStep::Launch(Deps(std::move(hook)), p, nullptr);
    EXPECT_TRUE(run.ok()) << run.status();
    if (!run.ok()) {
      StepOutcome failed;
      failed.status = run.status();
      return failed;
    }
    return (*run)->Join();
  }

  Snapshot Take() {
    Snapshot s;
    const size_t n = static_cast<size_t>(layout.total_elems());
    if (store->optimizer_place() == OffloadDevice::kNvme) {
      s.master.resize(n);
      s.m.resize(n);
      s.v.resize(n);
      for (size_t g = 0; g < layout.num_groups(); ++g) {
        const SubGroup& sg = layout.group(g);
        auto buf = AlignedBuffer::Allocate(
            static_cast<size_t>(IoBytes(kOptimizerStateBytesPerElem * sg.elems())), kIoAlign);
        EXPECT_TRUE(buf.ok());
        if (!buf.ok()) return s;
        // (The active version decoded: master | m | v, whatever the pieces.)
        EXPECT_OK(store->ReadGroupStates(g, buf->data()));
        const float* f = buf->as<float>();
        const size_t e = static_cast<size_t>(sg.elems()), b = static_cast<size_t>(sg.elem_begin);
        std::memcpy(s.master.data() + b, f, e * 4);
        std::memcpy(s.m.data() + b, f + e, e * 4);
        std::memcpy(s.v.data() + b, f + 2 * e, e * 4);
      }
    } else {
      s.master.assign(store->master(), store->master() + n);
      s.m.assign(store->exp_avg(), store->exp_avg() + n);
      s.v.assign(store->exp_avg_sq(), store->exp_avg_sq() + n);
    }
    const uint8_t* p = store->FetchSource(0, false);
    s.params.assign(p, p + layout.total_param_bytes());
    return s;
  }

  const Layout& layout;
  Partition part;  // one rank
  ::strata::testing::ScratchDir dir;
  StepCounters counters{false};
  std::unique_ptr<gpu::Device> dev;
  Config cfg;
  std::unique_ptr<StateStore> store;
  std::unique_ptr<cpu_adam::CpuOptimizer> adam;
  nvme::FaultInjectionEngine* faults = nullptr;
  Status open;
};

void ExpectSame(const Snapshot& a, const Snapshot& b) {
  EXPECT_TRUE(BitwiseEqual(a.master, b.master));
  EXPECT_TRUE(BitwiseEqual(a.m, b.m));
  EXPECT_TRUE(BitwiseEqual(a.v, b.v));
  EXPECT_TRUE(a.params == b.params);
}

class OptimizerStepTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rng_ = ::strata::testing::MakeRng(&seed_);
    layout_ = MakeLayout();
    ASSERT_GT(layout_.num_groups(), 8u);
    init_ = testing::RandomInit(layout_, rng_);
  }
  std::vector<float> Grads() {
    return ::strata::testing::RandomFloats(rng_, static_cast<size_t>(layout_.total_elems()));
  }
  std::unique_ptr<Rig> MakeRig(OffloadDevice opt, int64_t buffer_count) {
    auto r = std::make_unique<Rig>(layout_, init_, opt, buffer_count);
    EXPECT_TRUE(r->open.ok()) << r->open;
    if (opt == OffloadDevice::kNvme) {
      EXPECT_NE(r->faults, nullptr);
    }
    return r->open.ok() ? std::move(r) : nullptr;
  }

  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  Layout layout_;
  std::vector<std::vector<float>> init_;
};

// (buffer_count, background, piece elements: 0 whole sub-groups, else each
// NVMe shard streamed through the buffers in pieces of that many elements)
class CleanStepTest : public OptimizerStepTest,
                      public ::testing::WithParamInterface<std::tuple<int, bool, int>> {};

TEST_P(CleanStepTest, NvmeStatesStepBitwiseLikeStatesInMemory) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const auto [buffers, background, pieces] = GetParam();
  layout_.set_state_piece_elems(pieces);
  if (pieces > 0) {
    ASSERT_EQ(layout_.StatePieces(0).size(), 3u);  // 256 + 256 + 188 of 700
  }
  auto nv = MakeRig(OffloadDevice::kNvme, buffers);
  auto mem = MakeRig(OffloadDevice::kCpu, buffers);
  ASSERT_TRUE(nv && mem);
  ExpectSame(nv->Take(), mem->Take());  // initialized alike
  const std::vector<float> zeros(static_cast<size_t>(layout_.total_elems()), 0.f);
  for (int64_t step = 1; step <= 2; ++step) {
    const std::vector<float> g = Grads();
    std::vector<float> g_nv = g, g_mem = g;
    const StepOutcome a = nv->Step(step, g_nv, background);
    const StepOutcome b = mem->Step(step, g_mem, background);
    ASSERT_TRUE(a.status.ok()) << a.status;
    ASSERT_TRUE(b.status.ok()) << b.status;
    EXPECT_TRUE(a.states_written);
    EXPECT_TRUE(b.advanced);
    // The step consumed (zeroed) its gradients.
    EXPECT_TRUE(BitwiseEqual(g_nv, zeros));
    EXPECT_TRUE(BitwiseEqual(g_mem, zeros));
    // Not current until committed: the NVMe versions have not flipped.
    for (size_t gi = 0; gi < layout_.num_groups(); ++gi)
      ASSERT_EQ(nv->store->state_version(gi), static_cast<int>(step - 1) % 2);
    ASSERT_OK(nv->store->Commit(a, {}));
    ASSERT_OK(mem->store->Commit(b, {}));
    for (size_t gi = 0; gi < layout_.num_groups(); ++gi)
      EXPECT_EQ(nv->store->state_version(gi), static_cast<int>(step) % 2);
    SCOPED_TRACE("step " + std::to_string(step));
    const Snapshot sa = nv->Take(), sb = mem->Take();
    ExpectSame(sa, sb);
    EXPECT_FALSE(BitwiseEqual(sa.master, zeros));
  }
}

std::string CleanName(const ::testing::TestParamInfo<std::tuple<int, bool, int>>& info) {
  return "buffers" + std::to_string(std::get<0>(info.param)) +
         (std::get<1>(info.param) ? "_background" : "_inline") +
         (std::get<2>(info.param) > 0 ? "_pieces" + std::to_string(std::get<2>(info.param)) : "");
}

INSTANTIATE_TEST_SUITE_P(
    Ring, CleanStepTest,
    ::testing::Values(std::make_tuple(1, false, 0), std::make_tuple(2, true, 0),
                      std::make_tuple(4, false, 0), std::make_tuple(4, true, 0),
                      std::make_tuple(1, false, 256), std::make_tuple(2, true, 256),
                      std::make_tuple(4, true, 256)),
    CleanName);

enum class FaultKind { kReadError, kWriteError, kShortRead };

// (fault, buffer_count, piece elements as in CleanStepTest)
class StepFaultTest : public OptimizerStepTest,
                      public ::testing::WithParamInterface<std::tuple<FaultKind, int, int>> {};

TEST_P(StepFaultTest, FailedStepNamesTheSubGroupAndLeavesNoTrace) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const auto [kind, buffers, pieces] = GetParam();
  layout_.set_state_piece_elems(pieces);
  auto nv = MakeRig(OffloadDevice::kNvme, buffers);
  auto ref = MakeRig(OffloadDevice::kCpu, buffers);
  ASSERT_TRUE(nv && ref);
  // Step 1 on both.
  {
    const std::vector<float> g = Grads();
    std::vector<float> a = g, b = g;
    const StepOutcome oa = nv->Step(1, a, true), ob = ref->Step(1, b, true);
    ASSERT_TRUE(oa.status.ok() && ob.status.ok()) << oa.status << ob.status;
    ASSERT_OK(nv->store->Commit(oa, {}));
    ASSERT_OK(ref->store->Commit(ob, {}));
  }
  const Snapshot after_one = nv->Take();

  // Step 2 fails at the second read or write: sub-group 1's, or with
  // pieces sub-group 0's second piece (with one buffer, reads and writes
  // alternate: read 0, write 0, read 1, write 1, ...).
  nvme::FaultInjectionEngine::Rule rule;
  rule.kind = kind == FaultKind::kWriteError ? nvme::IoOpKind::kWrite : nvme::IoOpKind::kRead;
  rule.nth = 2;
  rule.fault = kind == FaultKind::kShortRead ? nvme::FaultInjectionEngine::Fault::kShort
                                             : nvme::FaultInjectionEngine::Fault::kErrno;
  rule.err = 5;  // EIO
  rule.short_bytes = 0;
  rule.times = kind == FaultKind::kShortRead ? 1000 : 1;  // a short read is resubmitted
  nv->faults->AddRule(rule);
  std::vector<float> lost = Grads();
  const StepOutcome failed = nv->Step(2, lost, true);
  nv->faults->ClearRules();
  ASSERT_FALSE(failed.status.ok());
  EXPECT_GT(nv->faults->faults_injected(), 0);
  const std::string msg(failed.status.message());
  const char* what = kind == FaultKind::kWriteError ? "writing optimizer state of sub-group "
                                                    : "reading optimizer state of sub-group ";
  EXPECT_THAT(msg, HasSubstr(what));
  if (buffers == 1) {
    EXPECT_THAT(msg, HasSubstr(std::string(what) + (pieces > 0 ? "0 [256, 512)" : "1")));
  }
  EXPECT_THAT(msg, ContainsRegex("sub-group [0-9]+"));
  EXPECT_THAT(msg, HasSubstr("step 2 failed"));
  EXPECT_FALSE(failed.states_written);
  EXPECT_FALSE(failed.advanced);

  // Rolled back: the active versions are those of step 1, unchanged.
  nv->store->Rollback({}, 2);
  for (size_t g = 0; g < layout_.num_groups(); ++g) EXPECT_EQ(nv->store->state_version(g), 1);
  ExpectSame(nv->Take(), after_one);

  // The next step is step 2 again, as if the failed one had never run.
  const std::vector<float> g = Grads();
  std::vector<float> a = g, b = g;
  const StepOutcome oa = nv->Step(2, a, true), ob = ref->Step(2, b, true);
  ASSERT_TRUE(oa.status.ok()) << oa.status;
  ASSERT_TRUE(ob.status.ok()) << ob.status;
  ASSERT_OK(nv->store->Commit(oa, {}));
  ASSERT_OK(ref->store->Commit(ob, {}));
  ExpectSame(nv->Take(), ref->Take());
}

std::string FaultName(const ::testing::TestParamInfo<std::tuple<FaultKind, int, int>>& info) {
  static const char* const kNames[] = {"read_eio", "write_eio", "short_read"};
  return std::string(kNames[static_cast<int>(std::get<0>(info.param))]) + "_buffers" +
         std::to_string(std::get<1>(info.param)) + (std::get<2>(info.param) > 0 ? "_pieces" : "");
}

INSTANTIATE_TEST_SUITE_P(Faults, StepFaultTest,
                         ::testing::Combine(::testing::Values(FaultKind::kReadError,
                                                              FaultKind::kWriteError,
                                                              FaultKind::kShortRead),
                                            ::testing::Values(1, 4), ::testing::Values(0, 256)),
                         FaultName);

// Holds the step's thread before sub-group `at` until released.
class Hold {
 public:
  explicit Hold(size_t at) : at_(at), reached_future_(reached_.get_future()) {}
  ~Hold() { Release(); }
  std::function<void(size_t)> Hook() {
    return [this](size_t g) {
      {
        std::lock_guard lock(mu_);
        seen_.push_back(g);
      }
      if (g != at_) return;
      reached_.set_value();
      release_future_.wait();
    };
  }
  void WaitReached() { reached_future_.wait(); }
  void Release() {
    std::lock_guard lock(mu_);
    if (!released_) release_.set_value();
    released_ = true;
  }
  std::vector<size_t> seen() {
    std::lock_guard lock(mu_);
    return seen_;
  }

 private:
  const size_t at_;
  std::promise<void> reached_, release_;
  std::future<void> reached_future_;
  std::shared_future<void> release_future_ = release_.get_future().share();
  std::mutex mu_;
  bool released_ = false;
  std::vector<size_t> seen_;
};

TEST_F(OptimizerStepTest, ModulesBecomeReadyAsTheStepGoes) {
  for (OffloadDevice opt : {OffloadDevice::kNvme, OffloadDevice::kCpu}) {
    SCOPED_TRACE(std::string(OffloadDeviceName(opt)));
    auto rig = MakeRig(opt, 2);
    ASSERT_TRUE(rig);
    constexpr size_t kAt = 4;
    Hold hold(kAt);
    std::vector<float> g = Grads();
    StepParams p;
    p.hp.step = 1;
    p.step = 1;
    p.background = true;
    p.grads = g.data();
    auto run = OptimizerStep::Launch(rig->Deps(hold.Hook()), p, nullptr);
    ASSERT_TRUE(run.ok()) << run.status();
    OptimizerStep& step = **run;
    hold.WaitReached();
    // Sub-groups 0..3 are stepped; a module is ready iff its last element is
    // in one of them.
    bool ok = false;
    EXPECT_FALSE(step.Finished(&ok));
    int ready = 0, waiting = 0;
    for (int m = 0; m < layout_.num_modules(); ++m) {
      const bool expect = layout_.module(m).last_group < static_cast<int>(kAt);
      EXPECT_EQ(step.ModuleReady(m), expect) << m;
      if (expect) {
        EXPECT_TRUE(step.WaitModule(m)) << m;  // returns at once
      }
      (expect ? ready : waiting)++;
    }
    ASSERT_GT(ready, 0);
    ASSERT_GT(waiting, 0);
    // Released, every module becomes ready.
    hold.Release();
    const int last = layout_.num_modules() - 1;
    EXPECT_TRUE(step.WaitModule(last));
    const StepOutcome out = step.Join();
    ASSERT_TRUE(out.status.ok()) << out.status;
    EXPECT_TRUE(step.Finished(&ok));
    EXPECT_TRUE(ok);
    for (int m = 0; m < layout_.num_modules(); ++m) EXPECT_TRUE(step.ModuleReady(m));
    std::vector<size_t> all(layout_.num_groups());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    EXPECT_EQ(hold.seen(), all);
  }
}

// A step that fails before reaching a module wakes its waiters: WaitModule
// returns false.
TEST_F(OptimizerStepTest, WaitModuleReturnsFalseWhenTheStepFailsFirst) {
  auto rig = MakeRig(OffloadDevice::kNvme, 1);
  ASSERT_TRUE(rig);
  constexpr size_t kAt = 3;
  Hold hold(kAt);
  // Sub-group kAt + 1's read fails (one buffer: one read per sub-group, in order).
  nvme::FaultInjectionEngine::Rule rule;
  rule.kind = nvme::IoOpKind::kRead;
  rule.nth = kAt + 2;
  rig->faults->AddRule(rule);
  std::vector<float> g = Grads();
  StepParams p;
  p.hp.step = 1;
  p.step = 1;
  p.background = true;
  p.grads = g.data();
  auto run = OptimizerStep::Launch(rig->Deps(hold.Hook()), p, nullptr);
  ASSERT_TRUE(run.ok()) << run.status();
  OptimizerStep& step = **run;
  hold.WaitReached();
  const int last = layout_.num_modules() - 1;
  ASSERT_GT(layout_.module(last).last_group, static_cast<int>(kAt));
  EXPECT_FALSE(step.ModuleReady(last));
  hold.Release();
  EXPECT_FALSE(step.WaitModule(last));
  bool ok = true;
  EXPECT_TRUE(step.Finished(&ok));
  EXPECT_FALSE(ok);
  const StepOutcome out = step.Join();
  EXPECT_THAT(std::string(out.status.message()),
              HasSubstr("reading optimizer state of sub-group " + std::to_string(kAt + 1)));
  EXPECT_FALSE(out.states_written);
}

}  // namespace
}  // namespace strata::scheduler
