// GradOffloader on the host device: gradients of fp32/fp16/bf16 modules,
// offloaded over several micro-batches in chunks smaller than a module, sum
// to exactly the scalar reference in enqueue order; the global inf/nan check
// and sum of squares; errors (a bad device pointer, a failing copy event)
// reach the caller once; the two accumulators of delayed_param_update.
#include "src/scheduler/grad_offloader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "src/common/status_util.h"
#include "src/gpu/arena.h"
#include "tests/scheduler/parts_test_util.h"

namespace strata::scheduler {
namespace {

using ::testing::HasSubstr;
using testing::Rec;

// ---- A device whose events fail on demand ----------------------------------

// Event::Synchronize fails while *fail > 0 (each failure takes one), with a
// message numbering the failures.
class FlakyEvent : public gpu::Event {
 public:
  FlakyEvent(std::unique_ptr<gpu::Event> inner, std::atomic<int>* fail, std::atomic<int>* count)
      : inner_(std::move(inner)), fail_(fail), count_(count) {}
  StatusOr<bool> Query() override { return inner_->Query(); }
  bool timing() const override { return inner_->timing(); }
  Status Synchronize() override {
    int f = fail_->load();
    while (f > 0 && !fail_->compare_exchange_weak(f, f - 1)) {
    }
    if (f > 0) return InternalError("injected event failure #" + std::to_string(++*count_));
    return inner_->Synchronize();
  }
  gpu::Event& inner() { return *inner_; }

 private:
  std::unique_ptr<gpu::Event> inner_;
  std::atomic<int>* fail_;
  std::atomic<int>* count_;
};

gpu::Event& Inner(gpu::Event& e) { return static_cast<FlakyEvent&>(e).inner(); }

class WrapStream : public gpu::Stream {
 public:
  explicit WrapStream(gpu::Stream* s) : s_(s) {}
  const std::string& name() const override { return s_->name(); }
  Status Record(gpu::Event& e) override { return s_->Record(Inner(e)); }
  Status Wait(gpu::Event& e) override { return s_->Wait(Inner(e)); }
  Status EnqueueHostCallback(std::function<void()> fn) override {
    return s_->EnqueueHostCallback(std::move(fn));
  }
  Status Synchronize() override { return s_->Synchronize(); }
  StatusOr<bool> Query() override { return s_->Query(); }
  void* native_handle() const override { return s_->native_handle(); }
  gpu::Stream& inner() { return *s_; }

 private:
  gpu::Stream* s_;
};

// The host device, with its own arena over a block of the inner device's
// arena (so the inner device's copies accept its pointers) and events that
// fail while fail > 0.
class FlakyDevice : public gpu::Device {
 public:
  FlakyDevice(std::unique_ptr<gpu::Device> inner, gpu::DeviceBuffer block)
      : Device(true, std::make_unique<gpu::Arena>(block.data(), block.size(), "flaky arena")),
        inner_(std::move(inner)),
        block_(std::move(block)) {
    compute_ = std::make_unique<WrapStream>(&inner_->compute());
    h2d_ = std::make_unique<WrapStream>(&inner_->h2d());
    d2h_ = std::make_unique<WrapStream>(&inner_->d2h());
  }
  std::atomic<int> fail{0};
  std::atomic<int> failures{0};

  std::string Describe() const override { return "flaky host"; }
  int ordinal() const override { return -1; }
  StatusOr<std::unique_ptr<gpu::Stream>> CreateStream(const std::string&) override {
    return NotSupportedError("FlakyDevice::CreateStream");
  }
  StatusOr<std::unique_ptr<gpu::Event>> CreateEvent(gpu::EventOptions options) override {
    ASSIGN_OR_RETURN(std::unique_ptr<gpu::Event> e, inner_->CreateEvent(options));
    return std::unique_ptr<gpu::Event>(new FlakyEvent(std::move(e), &fail, &failures));
  }
  StatusOr<double> ElapsedSeconds(gpu::Event& start, gpu::Event& end) override {
    return inner_->ElapsedSeconds(Inner(start), Inner(end));
  }
  Status AdamStep(std::span<const gpu::AdamShard> shards, const gpu::AdamHyperParams& hp,
                  const int32_t* skip_if_set, gpu::Stream& s) override {
    return inner_->AdamStep(shards, hp, skip_if_set, U(s));
  }
  Status Synchronize() override { return inner_->Synchronize(); }
  Status CopyH2D(void* d, const void* h, size_t n, gpu::Stream& s) override {
    return inner_->CopyH2D(d, h, n, U(s));
  }
  Status CopyD2H(void* h, const void* d, size_t n, gpu::Stream& s) override {
    return inner_->CopyD2H(h, d, n, U(s));
  }
  Status CopyD2D(void* d, const void* s2, size_t n, gpu::Stream& s) override {
    return inner_->CopyD2D(d, s2, n, U(s));
  }
  Status Cast(const void* src, DType st, void* dst, DType dt, size_t n, gpu::Stream& s) override {
    return inner_->Cast(src, st, dst, dt, n, U(s));
  }
  Status UnscaleAndCheck(void* x, DType t, size_t n, float inv, int32_t* f,
                         gpu::Stream& s) override {
    return inner_->UnscaleAndCheck(x, t, n, inv, f, U(s));
  }
  Status SumSquares(const void* x, DType t, size_t n, double* sum, gpu::Stream& s) override {
    return inner_->SumSquares(x, t, n, sum, U(s));
  }
  Status Fill(void* x, DType t, size_t n, float v, gpu::Stream& s) override {
    return inner_->Fill(x, t, n, v, U(s));
  }
  Status FillInt32(int32_t* x, size_t n, int32_t v, gpu::Stream& s) override {
    return inner_->FillInt32(x, n, v, U(s));
  }
  Status FillDouble(double* x, size_t n, double v, gpu::Stream& s) override {
    return inner_->FillDouble(x, n, v, U(s));
  }
  Status AddToFp32(float* acc, const void* x, DType t, size_t n, gpu::Stream& s) override {
    return inner_->AddToFp32(acc, x, t, n, U(s));
  }
  Status PinHostMemory(void* p, size_t n) override { return inner_->PinHostMemory(p, n); }
  Status UnpinHostMemory(void* p, size_t n) override { return inner_->UnpinHostMemory(p, n); }

 private:
  static gpu::Stream& U(gpu::Stream& s) { return static_cast<WrapStream&>(s).inner(); }
  std::unique_ptr<gpu::Device> inner_;
  gpu::DeviceBuffer block_;
};

// ---- Fixture -------------------------------------------------------------------

// Six modules of 11000..13000 elements (more than one 64 Ki-element block of
// the norm in all) with fp32, fp16 and bf16 tensors of odd sizes.
Layout MakeLayout(int64_t reduce_bucket_size) {
  static const DType kTypes[] = {DType::kFp32, DType::kFp16, DType::kBf16};
  std::vector<ParamRec> recs;
  for (int m = 0; m < 6; ++m) {
    for (int i = 0; i < 3; ++i) {
      std::string name = "m";
      name += std::to_string(m) + "." + std::to_string(i);
      recs.push_back(Rec(name, (i == 0 ? 9001 : 1001) + 113 * m + 7 * i, kTypes[(m + i) % 3], m));
    }
  }
  LayoutOptions o;
  o.sub_group_size = 5000;
  o.params_offloaded = true;
  o.reduce_bucket_size = reduce_bucket_size;
  return Layout::Build(std::move(recs), o);
}

class GradOffloaderTest : public ::testing::Test {
 protected:
  void Build(int64_t reduce_bucket_size, bool second_accumulator, bool flaky = false) {
    rng_ = ::strata::testing::MakeRng(&seed_);
    layout_ = MakeLayout(reduce_bucket_size);
    auto host = testing::MakeHostDevice(16 << 20);
    ASSERT_NE(host, nullptr);
    if (flaky) {
      auto block = host->Allocate(8 << 20);
      ASSERT_TRUE(block.ok()) << block.status();
      auto f = std::make_unique<FlakyDevice>(std::move(host), std::move(*block));
      flaky_ = f.get();
      dev_ = std::move(f);
    } else {
      dev_ = std::move(host);
    }
    cpu_adam::Options aopts;
    aopts.threads = 2;
    aopts.block_elems = 1024;             // several blocks per module: the arena splits them
    aopts.accumulate_inline_elems = 256;  // and small chunks go through it too
    auto adam = cpu_adam::CpuOptimizer::Create(aopts);
    ASSERT_TRUE(adam.ok()) << adam.status();
    adam_ = std::move(*adam);
    off_ = std::make_unique<GradOffloader>(dev_.get(), &layout_, adam_.get(), &counters_);
    int64_t pinned = 0;
    ASSERT_OK(off_->Start(second_accumulator, &pinned));
    EXPECT_GE(pinned, kGradStagingBuffers * layout_.grad_staging_bytes());
    ref_.assign(static_cast<size_t>(layout_.total_elems()), 0.f);
  }
  void TearDown() override {
    if (off_) EXPECT_OK(off_->Drain());
    if (dev_) EXPECT_OK(dev_->Synchronize());
    off_.reset();
    held_.clear();
  }

  // Module m's gradient bytes (random, in its dtypes, zero padding).
  std::vector<uint8_t> RandomModule(int m, float scale = 4.f) {
    const ModuleExtent& me = layout_.module(m);
    std::vector<uint8_t> bytes(static_cast<size_t>(me.bytes()), 0);
    for (int id : me.params) {
      const ParamRec& p = layout_.param(id);
      const auto v =
          ::strata::testing::RandomFloats(rng_, static_cast<size_t>(p.numel), -scale, scale);
      for (size_t i = 0; i < v.size(); ++i)
        StoreFromFloat(bytes.data() + (p.byte_off - me.byte_begin), p.dtype, i, v[i]);
    }
    return bytes;
  }
  // ref += the module's gradients, element by element (the reference order).
  void AddToRef(int m, const std::vector<uint8_t>& bytes, std::vector<float>& ref) {
    const ModuleExtent& me = layout_.module(m);
    for (int id : me.params) {
      const ParamRec& p = layout_.param(id);
      const uint8_t* src = bytes.data() + (p.byte_off - me.byte_begin);
      for (int64_t i = 0; i < p.numel; ++i)
        ref[static_cast<size_t>(p.elem_off + i)] +=
            LoadAsFloat(src, p.dtype, static_cast<size_t>(i));
    }
  }
  // Copies `bytes` into a new device buffer (kept until TearDown), records
  // its `computed` event on the compute stream and offloads it.
  Status Offload(int m, const std::vector<uint8_t>& bytes) {
    ASSIGN_OR_RETURN(gpu::DeviceBuffer buf, dev_->Allocate(bytes.size()));
    RETURN_IF_ERROR(dev_->CopyH2D(buf.data(), bytes.data(), bytes.size(), dev_->h2d()));
    RETURN_IF_ERROR(dev_->h2d().Synchronize());
    ASSIGN_OR_RETURN(std::unique_ptr<gpu::Event> computed, dev_->CreateEvent());
    RETURN_IF_ERROR(dev_->compute().Record(*computed));
    Status s = off_->Offload(m, buf.data(), *computed);
    held_.push_back({std::move(buf), std::move(computed)});
    return s;
  }
  // One backward pass: every module, last first, into ref.
  void MicroBatch(std::vector<float>& ref) {
    for (int m = layout_.num_modules() - 1; m >= 0; --m) {
      const std::vector<uint8_t> g = RandomModule(m);
      AddToRef(m, g, ref);
      ASSERT_OK(Offload(m, g));
    }
  }
  static bool Same(const float* a, const std::vector<float>& b) {
    return std::memcmp(a, b.data(), b.size() * sizeof(float)) == 0;
  }
  size_t FreeStaging() const { return off_->staging_pool()->GetStats().free_per_class.at(0); }

  struct Held {
    gpu::DeviceBuffer buf;
    std::unique_ptr<gpu::Event> computed;
  };
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  Layout layout_;
  StepCounters counters_{false};
  std::unique_ptr<gpu::Device> dev_;
  FlakyDevice* flaky_ = nullptr;
  std::unique_ptr<cpu_adam::CpuOptimizer> adam_;
  std::unique_ptr<GradOffloader> off_;
  std::vector<Held> held_;
  std::vector<float> ref_;
};

// ---- Accumulation -------------------------------------------------------------

class AccumulateTest : public GradOffloaderTest, public ::testing::WithParamInterface<int64_t> {};

TEST_P(AccumulateTest, SumsEqualTheScalarReferenceInEnqueueOrder) {
  ASSERT_NO_FATAL_FAILURE(Build(GetParam(), false));
  SCOPED_TRACE("seed " + std::to_string(seed_));
  if (GetParam() < 1'000'000) {
    // Chunks smaller than a module, not a multiple of the tensor alignment.
    ASSERT_LT(layout_.grad_staging_bytes(), layout_.max_module_bytes());
    ASSERT_NE(layout_.grad_staging_bytes() % kTensorAlign, 0);
  } else {
    ASSERT_EQ(layout_.grad_staging_bytes(), layout_.max_module_bytes());
  }
  for (int batch = 0; batch < 4; ++batch) ASSERT_NO_FATAL_FAILURE(MicroBatch(ref_));
  ASSERT_OK(off_->Drain());
  EXPECT_TRUE(Same(off_->accumulator(), ref_));
  // Every staging buffer went back to the pool.
  EXPECT_EQ(FreeStaging(), static_cast<size_t>(kGradStagingBuffers));
  // Something was compared.
  EXPECT_FALSE(std::all_of(ref_.begin(), ref_.end(), [](float x) { return x == 0.f; }));
}

std::string BucketName(const ::testing::TestParamInfo<int64_t>& info) {
  return "reduce_bucket_" + std::to_string(info.param);
}

// 2 x 2501 bytes: odd buckets must not split an fp32 element; 3000; one chunk
// per module.
INSTANTIATE_TEST_SUITE_P(Chunks, AccumulateTest,
                         ::testing::Values(int64_t{2501}, int64_t{3000}, int64_t{500'000'000}),
                         BucketName);

// The reference order matters: fp32 sums of the same micro-batches in another
// order differ, so an offloader that reorders chunks fails the test above.
TEST_F(GradOffloaderTest, OrderOfMicroBatchesChangesBits) {
  ASSERT_NO_FATAL_FAILURE(Build(3000, false));
  std::vector<std::vector<uint8_t>> batches;
  for (int b = 0; b < 4; ++b) batches.push_back(RandomModule(2));
  std::vector<float> fwd(ref_.size(), 0.f), bwd(ref_.size(), 0.f);
  for (int b = 0; b < 4; ++b) AddToRef(2, batches[static_cast<size_t>(b)], fwd);
  for (int b = 3; b >= 0; --b) AddToRef(2, batches[static_cast<size_t>(b)], bwd);
  EXPECT_NE(std::memcmp(fwd.data(), bwd.data(), fwd.size() * sizeof(float)), 0);
  for (int b = 0; b < 4; ++b) ASSERT_OK(Offload(2, batches[static_cast<size_t>(b)]));
  ASSERT_OK(off_->Drain());
  EXPECT_TRUE(Same(off_->accumulator(), fwd));
}

// ---- Global checks ---------------------------------------------------------------

TEST_F(GradOffloaderTest, GlobalChecksSumOfSquaresAndNonFinite) {
  ASSERT_NO_FATAL_FAILURE(Build(3000, false));
  ASSERT_GT(layout_.total_elems(), 1 << 16);  // several blocks
  ASSERT_NO_FATAL_FAILURE(MicroBatch(ref_));
  ASSERT_NO_FATAL_FAILURE(MicroBatch(ref_));
  ASSERT_OK(off_->Drain());
  double want = 0;
  for (float x : ref_) want += static_cast<double>(x) * x;
  bool overflow = true;
  double sumsq = 0;
  ASSERT_OK(off_->GlobalChecks(&overflow, &sumsq));
  EXPECT_FALSE(overflow);
  EXPECT_NEAR(sumsq, want, want * 1e-12);
  // Deterministic: the same bits again.
  bool overflow2 = true;
  double sumsq2 = 0;
  ASSERT_OK(off_->GlobalChecks(&overflow2, &sumsq2));
  EXPECT_EQ(std::memcmp(&sumsq, &sumsq2, sizeof(double)), 0);

  float* acc = off_->accumulator();
  const size_t n = ref_.size();
  for (size_t at : {size_t{0}, size_t{1} << 16, n - 1}) {
    for (float bad :
         {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
          std::numeric_limits<float>::quiet_NaN()}) {
      const float keep = acc[at];
      acc[at] = bad;
      ASSERT_OK(off_->GlobalChecks(&overflow, &sumsq));
      EXPECT_TRUE(overflow) << at << " " << bad;
      acc[at] = keep;
    }
  }
  ASSERT_OK(off_->GlobalChecks(&overflow, &sumsq));
  EXPECT_FALSE(overflow);

  // An fp16 gradient past its range arrives as inf.
  const int m = 1;
  std::vector<uint8_t> g = RandomModule(m);
  const ParamRec* half = nullptr;
  for (int id : layout_.module(m).params)
    if (layout_.param(id).dtype == DType::kFp16) half = &layout_.param(id);
  ASSERT_NE(half, nullptr);
  StoreFromFloat(g.data() + (half->byte_off - layout_.module(m).byte_begin), DType::kFp16,
                 static_cast<size_t>(half->numel - 1), 1e6f);
  ASSERT_OK(Offload(m, g));
  ASSERT_OK(off_->Drain());
  ASSERT_OK(off_->GlobalChecks(&overflow, &sumsq));
  EXPECT_TRUE(overflow);
  EXPECT_TRUE(std::isinf(acc[half->elem_off + half->numel - 1]));
}

// ---- Errors -----------------------------------------------------------------------

TEST_F(GradOffloaderTest, BadDevicePointerFailsTheOffloadAndLeaksNothing) {
  ASSERT_NO_FATAL_FAILURE(Build(3000, false));
  const int m = 3;
  const std::vector<uint8_t> g = RandomModule(m);
  std::vector<uint8_t> not_device(g);  // host memory, outside the arena
  auto computed = dev_->CreateEvent();
  ASSERT_TRUE(computed.ok());
  ASSERT_OK(dev_->compute().Record(**computed));
  const Status s = off_->Offload(m, not_device.data(), **computed);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_OK(off_->Drain());  // nothing was queued
  EXPECT_EQ(FreeStaging(), static_cast<size_t>(kGradStagingBuffers));
  EXPECT_TRUE(Same(off_->accumulator(), ref_));  // still zero
  // The offloader still works.
  AddToRef(m, g, ref_);
  ASSERT_OK(Offload(m, g));
  ASSERT_OK(off_->Drain());
  EXPECT_TRUE(Same(off_->accumulator(), ref_));
}

TEST_F(GradOffloaderTest, FailedCopyIsReportedByDrainOnceAndNotAccumulated) {
  ASSERT_NO_FATAL_FAILURE(Build(3000, false, /*flaky=*/true));
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int m = 4;
  ASSERT_GT(layout_.module(m).bytes(), 2 * layout_.grad_staging_bytes());
  const std::vector<uint8_t> g = RandomModule(m);
  // The first two chunks' copies fail; the rest land.
  flaky_->fail = 2;
  ASSERT_OK(Offload(m, g));
  const Status first = off_->Drain();
  ASSERT_FALSE(first.ok());
  EXPECT_THAT(std::string(first.message()), HasSubstr("injected event failure #1"));
  EXPECT_THAT(std::string(first.message()), HasSubstr("gradient copy"));
  EXPECT_OK(off_->Drain());  // reported once
  EXPECT_EQ(flaky_->failures.load(), 2);
  EXPECT_EQ(FreeStaging(), static_cast<size_t>(kGradStagingBuffers));
  // The failed chunks added nothing; the others their gradients.
  std::vector<float> want(ref_.size(), 0.f);
  AddToRef(m, g, want);
  const ModuleExtent& me = layout_.module(m);
  const int64_t lost_end = std::min(me.byte_end, me.byte_begin + 2 * layout_.grad_staging_bytes());
  for (const Layout::Slice& s : layout_.ByteSlices(m, me.byte_begin, lost_end))
    for (int64_t e = s.elem_begin; e < s.elem_end; ++e) want[static_cast<size_t>(e)] = 0.f;
  EXPECT_TRUE(Same(off_->accumulator(), want));
  // And the next offload is clean.
  off_->Zero();
  ASSERT_OK(Offload(m, g));
  ASSERT_OK(off_->Drain());
  std::vector<float> again(ref_.size(), 0.f);
  AddToRef(m, g, again);
  EXPECT_TRUE(Same(off_->accumulator(), again));
}

// ---- Two accumulators ---------------------------------------------------------------

TEST_F(GradOffloaderTest, SwapForStepZeroAndZeroAll) {
  ASSERT_NO_FATAL_FAILURE(Build(3000, /*second_accumulator=*/true));
  const std::vector<float> zeros(ref_.size(), 0.f);
  std::vector<float> a(ref_.size(), 0.f), b(ref_.size(), 0.f);
  ASSERT_NO_FATAL_FAILURE(MicroBatch(a));
  ASSERT_OK(off_->Drain());
  float* const first = off_->accumulator();
  EXPECT_TRUE(Same(first, a));
  // The step takes window A's sums; the next window starts from zero.
  float* step = off_->SwapForStep();
  EXPECT_EQ(step, first);
  EXPECT_NE(off_->accumulator(), step);
  EXPECT_TRUE(Same(off_->accumulator(), zeros));
  ASSERT_NO_FATAL_FAILURE(MicroBatch(b));
  ASSERT_OK(off_->Drain());
  EXPECT_TRUE(Same(off_->accumulator(), b));
  EXPECT_TRUE(Same(step, a));
  // The checks read the current window only.
  step[0] = std::numeric_limits<float>::quiet_NaN();
  bool overflow = true;
  double sumsq = 0;
  ASSERT_OK(off_->GlobalChecks(&overflow, &sumsq));
  EXPECT_FALSE(overflow);
  step[0] = a[0];
  // Zero: the current one only.
  off_->Zero();
  EXPECT_TRUE(Same(off_->accumulator(), zeros));
  EXPECT_TRUE(Same(step, a));
  // ZeroAll: both.
  ASSERT_NO_FATAL_FAILURE(MicroBatch(b));
  ASSERT_OK(off_->Drain());
  off_->ZeroAll();
  EXPECT_TRUE(Same(off_->accumulator(), zeros));
  EXPECT_TRUE(Same(step, zeros));
  // Swapping again hands over the current one and makes the first current.
  float* const current = off_->accumulator();
  EXPECT_EQ(off_->SwapForStep(), current);
  EXPECT_EQ(off_->accumulator(), first);
}

TEST_F(GradOffloaderTest, OneAccumulatorZeroAll) {
  ASSERT_NO_FATAL_FAILURE(Build(3000, false));
  ASSERT_NO_FATAL_FAILURE(MicroBatch(ref_));
  ASSERT_OK(off_->Drain());
  EXPECT_TRUE(Same(off_->accumulator(), ref_));
  off_->ZeroAll();
  EXPECT_TRUE(Same(off_->accumulator(), std::vector<float>(ref_.size(), 0.f)));
}

}  // namespace
}  // namespace strata::scheduler
