// ParamFetcher on the host device with a StateStore (offload_param cpu, and
// nvme on a scratch directory) and a fake StepProgress, driven through the
// engine's calls (Acquire / Release / ReleaseGrad / NextStep): the device copies hold
// the modules' bytes, prefetch follows the recorded trace within its budgets,
// eviction under budget pressure picks the module used furthest ahead while a
// prefetch stops instead of evicting, and frees wait for the stream.
#include "src/scheduler/param_fetcher.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "src/common/timer.h"
#include "tests/scheduler/parts_test_util.h"

namespace strata::scheduler {
namespace {

using testing::MakeHostDevice;
using testing::Rec;
using testing::ToBytes;

class FakeProgress : public StepProgress {
 public:
  bool reading_next_params() const override { return reading; }
  bool module_ready(int m) const override { return ready.count(m) != 0; }
  Status AwaitModule(int) override { return Status(); }
  bool reading = false;
  std::set<int> ready;
};

// Blocks a stream with a host callback until Release() (or destruction).
class StreamBlocker {
 public:
  explicit StreamBlocker(gpu::Stream& s) {
    auto f = gate_.get_future().share();
    ok_ = s.EnqueueHostCallback([f] { f.wait(); }).ok();
  }
  ~StreamBlocker() { Release(); }
  bool ok() const { return ok_; }
  void Release() {
    if (!released_) gate_.set_value();
    released_ = true;
  }

 private:
  std::promise<void> gate_;
  bool ok_ = false;
  bool released_ = false;
};

// Module sizes (elements of a fp16/bf16/fp32 weight and a bias) of the layouts
// below; `same_size`: every module 4352 bytes (4000 + 240 bytes, each tensor
// rounded to 256), except module `small` (512 bytes) if >= 0.
std::string Name(int m, const char* suffix) {
  std::string s = "m";
  s += std::to_string(m);
  s += suffix;
  return s;
}

std::vector<ParamRec> Params(int modules, bool same_size, int small = -1) {
  static const DType kTypes[] = {DType::kBf16, DType::kFp16, DType::kFp32};
  std::vector<ParamRec> recs;
  for (int m = 0; m < modules; ++m) {
    if (same_size && m == small) {
      recs.push_back(Rec(Name(m, ".w"), 100, DType::kFp16, m));
      recs.push_back(Rec(Name(m, ".b"), 10, DType::kFp32, m));
    } else if (same_size) {
      recs.push_back(Rec(Name(m, ".w"), 2000, DType::kFp16, m));
      recs.push_back(Rec(Name(m, ".b"), 60, DType::kFp32, m));
    } else {
      recs.push_back(Rec(Name(m, ".w"), 1000 + 137 * m, kTypes[m % 3], m));
      recs.push_back(Rec(Name(m, ".b"), 3 + m, kTypes[(m + 1) % 3], m));
    }
  }
  return recs;
}

constexpr int64_t kSameModuleBytes = 4352;

// A device, layout, store and fetcher; offload_param `place` (cpu or nvme).
class FetcherTest : public ::testing::TestWithParam<OffloadDevice> {
 protected:
  void Build(std::vector<ParamRec> recs, size_t hbm_budget, FetchOptions fo) {
    LayoutOptions lo;
    lo.sub_group_size = 1000;
    lo.params_offloaded = true;
    lo.persistence_threshold = 0;
    layout_ = Layout::Build(std::move(recs), lo);
    dev_ = MakeHostDevice(hbm_budget);
    ASSERT_NE(dev_, nullptr);
    cfg_ = testing::StoreConfig(OffloadDevice::kCpu, GetParam(), dir_.str());
    auto rng = ::strata::testing::MakeRng(&seed_);
    init_ = testing::RandomInit(layout_, rng);
    store_ = std::make_unique<StateStore>(dev_.get(), &layout_, part_, &counters_, &cfg_);
    ASSERT_OK(testing::OpenStore(*store_, cfg_, layout_, init_));
    fetcher_ = std::make_unique<ParamFetcher>(dev_.get(), &layout_, store_.get(), nullptr,
                                              &counters_, &gate_, fo);
    ASSERT_OK(fetcher_->Init());
  }
  // A new fetcher (and trace) with other options.
  void Refetcher(FetchOptions fo) {
    fetcher_ = std::make_unique<ParamFetcher>(dev_.get(), &layout_, store_.get(), nullptr,
                                              &counters_, &gate_, fo);
    ASSERT_OK(fetcher_->Init());
  }
  void TearDown() override {
    if (dev_) EXPECT_OK(dev_->Synchronize());
    fetcher_.reset();
    store_.reset();
  }

  // One forward use as the engine's hooks make it: acquire (which prefetches
  // what follows), then release unless `finish` is false.
  void Use(int m, bool finish = true) {
    StatusOr<ModuleView> v = fetcher_->Acquire(m, Phase::kForward);
    ASSERT_OK(v.status());
    ASSERT_EQ(fetcher_->residency(m), Residency::kResident);
    views_[m] = *v;
    if (finish) ASSERT_OK(fetcher_->Release(m));
  }
  // Records `order` as the trace (one step), then begins the next step.
  void Record(const std::vector<int>& order) {
    for (int m : order) ASSERT_NO_FATAL_FAILURE(Use(m));
    fetcher_->NextStep();
    ASSERT_EQ(fetcher_->trace().trace(), order);
    ASSERT_OK(fetcher_->InvalidateAll());
    ASSERT_OK(fetcher_->ReclaimDeferred(true));
  }
  std::vector<uint8_t> ExpectedBytes(int id) const {
    const ParamRec& p = layout_.param(id);
    return ToBytes(init_[static_cast<size_t>(id)], p.dtype);
  }
  // Module m's parameters as the device holds them (its last acquired
  // view), one vector per tensor.
  std::vector<std::vector<uint8_t>> DeviceBytes(int m) {
    std::vector<std::vector<uint8_t>> out;
    const ModuleView& v = views_[m];
    const ModuleExtent& me = layout_.module(m);
    EXPECT_EQ(v.params.size(), me.params.size());
    for (size_t i = 0; i < v.params.size() && i < me.params.size(); ++i) {
      const ParamRec& p = layout_.param(me.params[i]);
      const size_t n = static_cast<size_t>(p.numel * p.elem_size());
      EXPECT_TRUE(dev_->Contains(v.params[i], n));
      const auto* b = static_cast<const uint8_t*>(v.params[i]);
      out.emplace_back(b, b + n);
    }
    return out;
  }
  std::set<int> NotAbsent() const {
    std::set<int> out;
    for (int m = 0; m < layout_.num_modules(); ++m)
      if (fetcher_->residency(m) != Residency::kAbsent) out.insert(m);
    return out;
  }

  ::strata::testing::ScratchDir dir_;
  uint64_t seed_ = 0;
  Layout layout_;
  Partition part_{&layout_};  // one rank
  StepCounters counters_{false};
  std::unique_ptr<gpu::Device> dev_;
  Config cfg_;
  std::vector<std::vector<float>> init_;
  FakeProgress gate_;
  std::map<int, ModuleView> views_;
  std::unique_ptr<StateStore> store_;
  std::unique_ptr<ParamFetcher> fetcher_;
};

FetchOptions Unlimited() {
  FetchOptions fo;
  fo.prefetch_bucket_elems = int64_t{1} << 40;
  fo.max_live_elems = int64_t{1} << 40;
  fo.max_reuse_distance = 0;  // release after use unless reused at once
  return fo;
}

TEST_P(FetcherTest, ViewHoldsTheModulesBytesInTheirDtypes) {
  ASSERT_NO_FATAL_FAILURE(Build(Params(6, false), 1 << 20, Unlimited()));
  SCOPED_TRACE("seed " + std::to_string(seed_));
  for (int m : {4, 0, 5, 2, 1, 3}) {
    // Backward: the parameters, and gradient buffers at the same offsets in
    // a separate device buffer.
    StatusOr<ModuleView> got_view = fetcher_->Acquire(m, Phase::kBackward);
    ASSERT_OK(got_view.status());
    const ModuleView& v = *got_view;
    views_[m] = v;
    const auto got = DeviceBytes(m);
    const ModuleExtent& me = layout_.module(m);
    for (size_t i = 0; i < me.params.size(); ++i)
      EXPECT_EQ(got[i], ExpectedBytes(me.params[i])) << "module " << m << " tensor " << i;
    EXPECT_TRUE(fetcher_->has_grad(m));
    ASSERT_EQ(v.grads.size(), v.params.size());
    for (size_t i = 0; i < v.grads.size(); ++i) {
      EXPECT_EQ(static_cast<uint8_t*>(v.grads[i]) - static_cast<uint8_t*>(v.grads[0]),
                static_cast<uint8_t*>(v.params[i]) - static_cast<uint8_t*>(v.params[0]));
      EXPECT_TRUE(dev_->Contains(v.grads[i], 1));
    }
    EXPECT_NE(v.grads[0], v.params[0]);
    EXPECT_EQ(fetcher_->grad(m), v.grads[0]);
    ASSERT_OK(fetcher_->ReleaseGrad(m, dev_->d2h()));
    EXPECT_FALSE(fetcher_->has_grad(m));
  }
  ASSERT_OK(dev_->Synchronize());
  ASSERT_OK(fetcher_->ReclaimDeferred(false));
  // Every device slot is back; the arena holds only the slot pool (allocated
  // once, by Init).
  EXPECT_EQ(fetcher_->free_device_slots(), fetcher_->device_slots());
  StepStats st;
  counters_.EndWindow(NowNanos(), &st);
  EXPECT_EQ(st.fetch_misses, 6);
  EXPECT_EQ(st.prefetched_modules, 0);
}

// While a step is producing new parameters, a module it has finished is
// fetched from the step's copy-out target (offload_param cpu) or its new NVMe
// version (nvme), not from the current host/NVMe copy.
TEST_P(FetcherTest, UpdatedModulesComeFromTheNextParameters) {
  ASSERT_NO_FATAL_FAILURE(Build(Params(4, false), 1 << 20, Unlimited()));
  auto rng = ::strata::testing::MakeRng();
  // New values of module 2 in next_params(), or written as its new version.
  const ModuleExtent& me = layout_.module(2);
  auto module_buf = AlignedBuffer::Allocate(static_cast<size_t>(IoBytes(me.bytes())), kIoAlign);
  ASSERT_TRUE(module_buf.ok());
  std::memset(module_buf->data(), 0, static_cast<size_t>(IoBytes(me.bytes())));
  std::vector<std::vector<uint8_t>> updated;
  for (int id : me.params) {
    const ParamRec& p = layout_.param(id);
    updated.push_back(
        ToBytes(::strata::testing::RandomFloats(rng, static_cast<size_t>(p.numel)), p.dtype));
    uint8_t* dst = store_->next_params() != nullptr
                       ? store_->next_params() + p.byte_off
                       : module_buf->as<uint8_t>() + (p.byte_off - me.byte_begin);
    std::memcpy(dst, updated.back().data(), updated.back().size());
  }
  if (store_->next_params() == nullptr)
    ASSERT_OK(store_->WriteModule(2, module_buf->data()).Wait());
  gate_.reading = true;
  gate_.ready = {2};
  ASSERT_NO_FATAL_FAILURE(Use(2, false));
  EXPECT_EQ(DeviceBytes(2), updated);
  // Without a step in flight: the current copy.
  gate_.reading = false;
  ASSERT_NO_FATAL_FAILURE(Use(1, false));
  const auto got = DeviceBytes(1);
  EXPECT_EQ(got[0], ExpectedBytes(layout_.module(1).params[0]));
}

TEST_P(FetcherTest, PrefetchFollowsTheRecordedTraceWithinTheBucket) {
  ASSERT_NO_FATAL_FAILURE(Build(Params(6, false), 1 << 20, Unlimited()));
  const std::vector<int> order = {3, 1, 4, 0, 5, 2};
  // Room in the bucket for the next two modules of the trace, not a third.
  FetchOptions fo = Unlimited();
  fo.prefetch_bucket_elems =
      layout_.module(1).elems() + layout_.module(4).elems() + layout_.module(0).elems() - 1;
  ASSERT_NO_FATAL_FAILURE(Refetcher(fo));
  ASSERT_NO_FATAL_FAILURE(Record(order));  // six misses
  ASSERT_NO_FATAL_FAILURE(Use(3, false));  // a miss, then the prefetch
  EXPECT_EQ(NotAbsent(), (std::set<int>{3, 1, 4}));
  ASSERT_OK(fetcher_->Release(3));  // not used again: released
  // Following the trace: each use prefetches what comes next within the
  // bucket (after 1: 4, 0; 5 would exceed it).
  ASSERT_NO_FATAL_FAILURE(Use(1));
  EXPECT_EQ(NotAbsent(), (std::set<int>{4, 0}));
  for (int m : {4, 0, 5, 2}) ASSERT_NO_FATAL_FAILURE(Use(m));
  // The prefetched ones were hits: 1, 4, 0, 5, 2.
  StepStats st;
  counters_.EndWindow(NowNanos(), &st);
  EXPECT_EQ(st.prefetched_modules, 5);
  EXPECT_EQ(st.fetch_misses, 6 + 1);
  // The prefetched copies hold the modules' bytes.
  EXPECT_EQ(fetcher_->NextStep(), 0);  // the step followed the trace
  for (int m : order) {
    ASSERT_NO_FATAL_FAILURE(Use(m, false));
    EXPECT_EQ(DeviceBytes(m)[0], ExpectedBytes(layout_.module(m).params[0])) << m;
    ASSERT_OK(fetcher_->Release(m));
  }
}

TEST_P(FetcherTest, PrefetchStopsAtTheLiveLimitAndAtAStepNotYetThere) {
  ASSERT_NO_FATAL_FAILURE(Build(Params(6, false), 1 << 20, Unlimited()));
  const std::vector<int> order = {0, 1, 2, 3, 4, 5};
  FetchOptions fo = Unlimited();
  // Module 0 in use plus 1 and 2: the limit; 3 would pass it.
  fo.max_live_elems =
      layout_.module(0).elems() + layout_.module(1).elems() + layout_.module(2).elems();
  ASSERT_NO_FATAL_FAILURE(Refetcher(fo));
  ASSERT_NO_FATAL_FAILURE(Record(order));
  ASSERT_NO_FATAL_FAILURE(Use(0, false));
  EXPECT_EQ(NotAbsent(), (std::set<int>{0, 1, 2}));
  ASSERT_OK(fetcher_->Release(0));

  // A step in flight has finished modules 0, 1, 2 and 4 only: the prefetch
  // takes nothing past the first module it has not reached (3), even 4; then
  // goes on from there once it has.
  ASSERT_OK(fetcher_->InvalidateAll());
  ASSERT_NO_FATAL_FAILURE(Refetcher(Unlimited()));
  ASSERT_NO_FATAL_FAILURE(Record(order));
  gate_.reading = true;
  gate_.ready = {0, 1, 2, 4};
  ASSERT_NO_FATAL_FAILURE(Use(0, false));
  EXPECT_EQ(NotAbsent(), (std::set<int>{0, 1, 2}));
  gate_.ready.insert(3);
  ASSERT_NO_FATAL_FAILURE(Use(1, false));  // its prefetch goes on past 3
  EXPECT_EQ(NotAbsent(), (std::set<int>{0, 1, 2, 3, 4}));
}

TEST_P(FetcherTest, ALiveLimitBelowTwoModulesStillPrefetchesTheNext) {
  // stage3_max_live_parameters smaller than one module: the module in use and
  // the next still fit (the plan reserved their slots), a third does not.
  ASSERT_NO_FATAL_FAILURE(Build(Params(6, false), 1 << 20, Unlimited()));
  const std::vector<int> order = {0, 1, 2, 3, 4, 5};
  FetchOptions fo = Unlimited();
  fo.max_live_elems = layout_.module(0).elems() / 2;
  ASSERT_NO_FATAL_FAILURE(Refetcher(fo));
  ASSERT_NO_FATAL_FAILURE(Record(order));
  ASSERT_NO_FATAL_FAILURE(Use(0, false));
  EXPECT_EQ(NotAbsent(), (std::set<int>{0, 1}));
  ASSERT_OK(fetcher_->Release(0));
  ASSERT_NO_FATAL_FAILURE(Use(1, false));
  EXPECT_EQ(NotAbsent(), (std::set<int>{1, 2}));
  ASSERT_OK(fetcher_->Release(1));
  // 0 keeps DeepSpeed's meaning: only the module in use, nothing prefetched.
  ASSERT_OK(fetcher_->InvalidateAll());
  fo.max_live_elems = 0;
  ASSERT_NO_FATAL_FAILURE(Refetcher(fo));
  ASSERT_NO_FATAL_FAILURE(Record(order));
  ASSERT_NO_FATAL_FAILURE(Use(0, false));
  EXPECT_EQ(NotAbsent(), (std::set<int>{0}));
}

// Room for three modules. Modules 0, 1, 2 are cached (reused later in the
// trace) when 3 is needed: the one whose next use is furthest (1) goes, not
// the least (0) or most (2) recently used.
TEST_P(FetcherTest, DemandFetchEvictsTheModuleUsedFurthestAhead) {
  FetchOptions fo = Unlimited();
  fo.prefetch_bucket_elems = 0;
  fo.max_reuse_distance = int64_t{1} << 40;  // keep everything cached
  ASSERT_NO_FATAL_FAILURE(Build(Params(4, true), 3 * kSameModuleBytes, fo));
  ASSERT_EQ(layout_.module(0).bytes(), kSameModuleBytes);
  const std::vector<int> order = {0, 1, 2, 3, 0, 2, 1};
  ASSERT_NO_FATAL_FAILURE(Record(order));
  for (int m : {0, 1, 2}) ASSERT_NO_FATAL_FAILURE(Use(m));
  EXPECT_EQ(NotAbsent(), (std::set<int>{0, 1, 2}));
  ASSERT_NO_FATAL_FAILURE(Use(3, false));
  EXPECT_EQ(NotAbsent(), (std::set<int>{0, 2, 3}));
  EXPECT_EQ(DeviceBytes(3)[0], ExpectedBytes(layout_.module(3).params[0]));
  ASSERT_OK(fetcher_->Release(3));
  // 0 and 2 were kept: no fetch for them, only for 1.
  for (int m : {0, 2, 1}) ASSERT_NO_FATAL_FAILURE(Use(m));
  StepStats st;
  counters_.EndWindow(NowNanos(), &st);
  EXPECT_EQ(st.fetch_misses, 7 + 3 + 1 + 1);  // recording, 0 1 2, 3, 1
}

// The same, with the module used furthest ahead (1) in use: it stays, and
// the next furthest (2) goes.
TEST_P(FetcherTest, DemandFetchNeverEvictsAModuleInUse) {
  FetchOptions fo = Unlimited();
  fo.prefetch_bucket_elems = 0;
  fo.max_reuse_distance = int64_t{1} << 40;
  ASSERT_NO_FATAL_FAILURE(Build(Params(4, true), 3 * kSameModuleBytes, fo));
  ASSERT_NO_FATAL_FAILURE(Record({0, 1, 2, 3, 0, 2, 1}));
  ASSERT_NO_FATAL_FAILURE(Use(0));
  ASSERT_NO_FATAL_FAILURE(Use(1, /*finish=*/false));
  ASSERT_NO_FATAL_FAILURE(Use(2));
  ASSERT_NO_FATAL_FAILURE(Use(3, false));
  EXPECT_EQ(NotAbsent(), (std::set<int>{0, 1, 3}));
  EXPECT_EQ(DeviceBytes(1)[0], ExpectedBytes(layout_.module(1).params[0]));
}

// Room for three modules; 0 is cached (used again at the end). A prefetch
// takes 1 and 2, then stops at 3 (no free slot) without evicting 0 and
// without skipping ahead to the small module 4.
TEST_P(FetcherTest, PrefetchStopsInsteadOfEvicting) {
  FetchOptions fo = Unlimited();
  fo.max_reuse_distance = int64_t{1} << 40;
  ASSERT_NO_FATAL_FAILURE(Build(Params(6, true, /*small=*/4), 3 * kSameModuleBytes, fo));
  ASSERT_LT(layout_.module(4).bytes(), 1024);
  const std::vector<int> order = {0, 1, 2, 3, 4, 5, 0};
  ASSERT_NO_FATAL_FAILURE(Record(order));
  ASSERT_NO_FATAL_FAILURE(Use(0));
  EXPECT_EQ(NotAbsent(), (std::set<int>{0, 1, 2}));
  EXPECT_EQ(fetcher_->device_slots(), 3);
  EXPECT_EQ(fetcher_->free_device_slots(), 0);
  // The prefetched copies are usable and hold the modules' bytes.
  for (int m : {1, 2}) {
    ASSERT_NO_FATAL_FAILURE(Use(m, false));
    EXPECT_EQ(DeviceBytes(m)[0], ExpectedBytes(layout_.module(m).params[0])) << m;
  }
}

// Room for three modules: 0 in use and prefetches of 1 and 2 still in flight
// (not yet waited for) hold every slot when the order diverges and 4 is
// needed. The demand fetch completes a prefetch and drops it instead of
// failing with every slot taken.
TEST_P(FetcherTest, DemandFetchDropsPrefetchesStillInFlight) {
  FetchOptions fo = Unlimited();
  fo.max_reuse_distance = int64_t{1} << 40;
  ASSERT_NO_FATAL_FAILURE(Build(Params(6, true), 3 * kSameModuleBytes, fo));
  ASSERT_NO_FATAL_FAILURE(Record({0, 1, 2, 3, 4, 5}));
  ASSERT_NO_FATAL_FAILURE(Use(0, false));
  EXPECT_EQ(NotAbsent(), (std::set<int>{0, 1, 2}));
  EXPECT_EQ(fetcher_->free_device_slots(), 0);
  for (int m : {1, 2}) EXPECT_NE(fetcher_->residency(m), Residency::kResident) << m;
  ASSERT_NO_FATAL_FAILURE(Use(4, false));  // off the recorded order
  EXPECT_EQ(DeviceBytes(4)[0], ExpectedBytes(layout_.module(4).params[0]));
  EXPECT_EQ(DeviceBytes(0)[0], ExpectedBytes(layout_.module(0).params[0]));  // in use: kept
  const std::set<int> held = NotAbsent();
  EXPECT_EQ(held.size(), 3u);
  EXPECT_TRUE(held.count(0) && held.count(4));
}

// A released device copy is freed only once the compute stream has passed
// the point of its release (work enqueued before may still read it); a
// gradient buffer once the D2H stream has.
TEST_P(FetcherTest, FreesAreDeferredUntilTheStreamPassesThem) {
  ASSERT_NO_FATAL_FAILURE(Build(Params(3, false), 1 << 20, Unlimited()));
  ASSERT_NO_FATAL_FAILURE(Use(1, false));
  const int64_t all = fetcher_->device_slots();
  ASSERT_EQ(fetcher_->free_device_slots(), all - 1);
  {
    StreamBlocker busy(dev_->compute());
    ASSERT_TRUE(busy.ok());
    ASSERT_OK(fetcher_->Release(1));  // not following a trace: released
    EXPECT_EQ(fetcher_->residency(1), Residency::kAbsent);
    ASSERT_OK(fetcher_->ReclaimDeferred(false));
    EXPECT_EQ(fetcher_->free_device_slots(), all - 1);
    busy.Release();
    ASSERT_OK(dev_->compute().Synchronize());
  }
  ASSERT_OK(fetcher_->ReclaimDeferred(false));
  EXPECT_EQ(fetcher_->free_device_slots(), all);

  // Backward: the module's copy and its gradient buffer.
  ASSERT_OK(fetcher_->Acquire(2, Phase::kBackward).status());
  ASSERT_EQ(fetcher_->free_device_slots(), all - 2);
  {
    StreamBlocker busy(dev_->d2h());
    ASSERT_TRUE(busy.ok());
    ASSERT_OK(fetcher_->ReleaseGrad(2, dev_->d2h()));
    EXPECT_FALSE(fetcher_->has_grad(2));
    EXPECT_FALSE(fetcher_->any_grad());
    // Once the compute stream has passed the release, the module's copy is
    // back; the gradient buffer waits for the D2H stream.
    ASSERT_OK(dev_->compute().Synchronize());
    ASSERT_OK(fetcher_->ReclaimDeferred(false));
    EXPECT_EQ(fetcher_->free_device_slots(), all - 1);
    busy.Release();
    // Waiting for every deferred free.
    ASSERT_OK(fetcher_->ReclaimDeferred(true));
  }
  EXPECT_EQ(fetcher_->free_device_slots(), all);
}

std::string PlaceName(const ::testing::TestParamInfo<OffloadDevice>& info) {
  return std::string(OffloadDeviceName(info.param));
}

INSTANTIATE_TEST_SUITE_P(Params, FetcherTest,
                         ::testing::Values(OffloadDevice::kCpu, OffloadDevice::kNvme), PlaceName);

}  // namespace
}  // namespace strata::scheduler
