// The typed device suite: every case runs against HostDevice and CudaDevice
// (CUDA cases skip with the reason when no device is present). Kernels are
// checked against the scalar reference in src/common/half.h and plain loops.
#include "src/gpu/device.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <future>
#include <limits>
#include <span>
#include <thread>
#include <vector>

#include "src/common/half.h"
#include "src/gpu/host_kernels.h"
#include "strata/build_config.h"
#include "tests/gpu/device_test_util.h"
#include "tests/test_util.h"

#if STRATA_HAVE_CUDA
#include "src/gpu/cuda_status.h"
#endif

namespace strata::gpu::testing {
namespace {

template <typename B>
using TypedDeviceTest = DeviceTest<B>;
TYPED_TEST_SUITE(TypedDeviceTest, Backends);

// Uploads `bytes` to a fresh device buffer (synchronously).
template <typename T>
DeviceBuffer Upload(Device& d, const std::vector<T>& v) {
  auto b = d.Allocate(std::max<size_t>(1, v.size() * sizeof(T)));
  EXPECT_TRUE(b.ok()) << b.status();
  if (!b.ok()) return {};
  EXPECT_OK(d.CopyH2D(b->data(), v.data(), v.size() * sizeof(T), d.h2d()));
  EXPECT_OK(d.h2d().Synchronize());
  return std::move(b).value();
}

template <typename T>
std::vector<T> Download(Device& d, const void* p, size_t n) {
  std::vector<T> v(n);
  EXPECT_OK(d.CopyD2H(v.data(), p, n * sizeof(T), d.d2h()));
  EXPECT_OK(d.d2h().Synchronize());
  return v;
}

bool IsNanBits(uint16_t h, DType t) {
  return t == DType::kFp16 ? ((h & 0x7c00) == 0x7c00 && (h & 0x3ff))
                           : ((h & 0x7f80) == 0x7f80 && (h & 0x7f));
}

// ---- Arena through the device ----

TYPED_TEST(TypedDeviceTest, BudgetEnforcedWithStatistics) {
  Device& d = this->dev();
  const ArenaStats s0 = d.Stats();
  ASSERT_EQ(s0.budget_bytes, this->kBudget);
  EXPECT_EQ(s0.in_use_bytes, 0u);
  auto a = d.Allocate(40 << 20);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = d.Allocate(30 << 20);  // 70 MiB > 64 MiB
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(b.status().message()).find("budget"), std::string::npos);
  EXPECT_EQ(d.Allocate(0).status().code(), StatusCode::kInvalidArgument);
  {
    auto c = d.Allocate(20 << 20);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(d.Stats().in_use_bytes, size_t{60} << 20);
    EXPECT_EQ(d.Stats().allocations, 2u);
  }  // c goes back to the arena here
  const ArenaStats s1 = d.Stats();
  EXPECT_EQ(s1.in_use_bytes, size_t{40} << 20);
  EXPECT_EQ(s1.high_water_bytes, size_t{60} << 20);
  EXPECT_EQ(s1.failed_allocations, 1u);
  EXPECT_EQ(s1.largest_free_bytes, size_t{24} << 20);
  d.ResetHighWater();
  EXPECT_EQ(d.Stats().high_water_bytes, size_t{40} << 20);
  a->Reset();
  EXPECT_EQ(d.Stats().in_use_bytes, 0u);
  EXPECT_TRUE(d.Allocate(this->kBudget).ok());
}

// ---- Copies ----

TYPED_TEST(TypedDeviceTest, CopyRoundTripsOddSizesAndOffsets) {
  Device& d = this->dev();
  uint64_t seed;
  auto rng = strata::testing::MakeRng(&seed);
  SCOPED_TRACE(seed);
  auto a = d.Allocate(4 << 20).value();
  auto b = d.Allocate(4 << 20).value();
  for (size_t size : {size_t{1}, size_t{3}, size_t{255}, size_t{4097}, size_t{(1 << 20) + 13}}) {
    for (size_t off : {size_t{0}, size_t{1}, size_t{7}, size_t{4093}}) {
      const std::vector<uint8_t> src = strata::testing::RandomBytes(rng, size + off);
      std::vector<uint8_t> dst(size + off + 5, 0xEE);
      char* da = a.as<char>() + off;
      char* db = b.as<char>() + (off * 3 % 251);
      ASSERT_OK(d.CopyH2D(da, src.data() + off, size, d.h2d()));
      ASSERT_OK(d.h2d().Synchronize());
      ASSERT_OK(d.CopyD2D(db, da, size, d.compute()));
      ASSERT_OK(d.compute().Synchronize());
      ASSERT_OK(d.CopyD2H(dst.data() + off, db, size, d.d2h()));
      ASSERT_OK(d.d2h().Synchronize());
      ASSERT_EQ(0, std::memcmp(dst.data() + off, src.data() + off, size)) << size << "@" << off;
      EXPECT_EQ(dst[off + size], 0xEE);  // nothing written past the end
      if (off > 0) {
        EXPECT_EQ(dst[off - 1], 0xEE);
      }
    }
  }
}

TYPED_TEST(TypedDeviceTest, PointersOutsideTheArenaAreRejected) {
  Device& d = this->dev();
  auto a = d.Allocate(4096).value();
  std::vector<char> host(8192);
  // A host pointer where a device pointer belongs.
  EXPECT_EQ(d.CopyH2D(host.data(), host.data() + 4096, 16, d.h2d()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(d.CopyD2H(host.data(), host.data() + 4096, 16, d.d2h()).code(),
            StatusCode::kInvalidArgument);
  // Running off the end of the arena.
  char* end = static_cast<char*>(a.data());
  EXPECT_EQ(d.Fill(end, DType::kFp32, this->kBudget, 1.f, d.compute()).code(),
            StatusCode::kInvalidArgument);
  // Partially overlapping device-to-device copy (equal ranges are a no-op).
  EXPECT_EQ(d.CopyD2D(a.as<char>() + 8, a.data(), 64, d.compute()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_OK(d.CopyD2D(a.data(), a.data(), 64, d.compute()));
  // Misaligned elements.
  EXPECT_EQ(d.Fill(a.as<char>() + 2, DType::kFp32, 4, 1.f, d.compute()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(d.SumSquares(a.data(), DType::kFp16, 4, reinterpret_cast<double*>(a.as<char>() + 4),
                         d.compute())
                .code(),
            StatusCode::kInvalidArgument);
  // An element count whose byte size overflows.
  EXPECT_EQ(d.Fill(a.data(), DType::kFp32, SIZE_MAX / 2, 1.f, d.compute()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(d.FillDouble(a.as<double>(), SIZE_MAX / 4, 1.0, d.compute()).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(d.CopyH2D(nullptr, host.data(), 16, d.h2d()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(d.CopyH2D(a.data(), nullptr, 16, d.h2d()).code(), StatusCode::kInvalidArgument);
  // Overlapping cast of different element sizes.
  EXPECT_EQ(d.Cast(a.data(), DType::kFp32, a.as<char>() + 2, DType::kFp16, 100, d.compute()).code(),
            StatusCode::kInvalidArgument);
}

// ---- Streams and events ----

TYPED_TEST(TypedDeviceTest, WorkOnOneStreamRunsInOrder) {
  Device& d = this->dev();
  auto x = d.Allocate(1000 * sizeof(float)).value();
  for (int v = 1; v <= 20; ++v)
    ASSERT_OK(d.Fill(x.data(), DType::kFp32, 1000, float(v), d.compute()));
  std::vector<int> order;
  std::mutex mu;
  for (int i = 0; i < 10; ++i)
    ASSERT_OK(d.compute().EnqueueHostCallback([&, i] {
      std::lock_guard<std::mutex> l(mu);
      order.push_back(i);
    }));
  ASSERT_OK(d.compute().Synchronize());
  ASSERT_EQ(order.size(), 10u);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(order[i], i);
  auto h = Download<float>(d, x.data(), 1000);
  for (float f : h) ASSERT_EQ(f, 20.f);
}

// A copy on d2h waits for a kernel on compute through an event, even while
// the kernel is held back by a gate the test controls.
TYPED_TEST(TypedDeviceTest, CopyWaitsForKernelThroughEvent) {
  Device& d = this->dev();
  const size_t n = 1 << 20;
  auto x = d.Allocate(n * sizeof(float)).value();
  ASSERT_OK(d.Fill(x.data(), DType::kFp32, n, 1.f, d.compute()));
  ASSERT_OK(d.compute().Synchronize());

  // Pinned destination: a D2H copy into pageable memory would block this
  // thread on CUDA until the copy is done (and the gate below never opens).
  // Created before the gate so no pinning call runs while a stream is held.
  auto pool = PinnedPool::Create(PlanPinnedPool(n * sizeof(float), n * sizeof(float)), &d).value();
  ASSERT_TRUE(pool->pinned());
  PinnedBuffer pinned = pool->Acquire(n * sizeof(float)).value();
  float* h = pinned.as<float>();
  std::fill(h, h + n, 0.f);

  auto ev = d.CreateEvent().value();
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  ASSERT_OK(d.compute().EnqueueHostCallback([opened] { opened.wait(); }));
  ASSERT_OK(d.Fill(x.data(), DType::kFp32, n, 7.f, d.compute()));
  ASSERT_OK(d.compute().Record(*ev));
  ASSERT_OK(d.d2h().Wait(*ev));
  ASSERT_OK(d.CopyD2H(h, x.data(), n * sizeof(float), d.d2h()));

  // Held back: neither the event nor the copy can have completed.
  EXPECT_FALSE(ev->Query().value());
  EXPECT_FALSE(d.d2h().Query().value());
  gate.set_value();
  ASSERT_OK(d.d2h().Synchronize());
  EXPECT_TRUE(ev->Query().value());
  for (size_t i = 0; i < n; i += 997) ASSERT_EQ(h[i], 7.f) << i;
  ASSERT_EQ(h[n - 1], 7.f);
}

// Hung on an H100 before kernels were loaded at creation: FillInt32 was
// launched for the first time in the process while h2d was held by a host
// function waiting for this thread, and CUDA's lazy loading of that kernel
// synchronized the context. The fix is
// in CudaDevice (every kernel is loaded at creation); the host device models
// the hazard with host_lazy_kernel_loading (HostLazyKernelLoadingDeadlocks).
// The D2H destination is pinned: this test is about streams, not pageable
// copies (see PageableCopiesAreSynchronous).
TYPED_TEST(TypedDeviceTest, StreamsRunConcurrently) {
  Device& d = this->dev();
  auto pool = PinnedPool::Create(PlanPinnedPool(4096, 4096), &d).value();
  PinnedBuffer pinned = pool->Acquire(64).value();
  // h2d is blocked; d2h and compute must still make progress.
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  ASSERT_OK(d.h2d().EnqueueHostCallback([opened] { opened.wait(); }));
  auto x = d.Allocate(4096).value();
  ASSERT_OK(d.FillInt32(x.as<int32_t>(), 16, 5, d.compute()));
  ASSERT_OK(d.compute().Synchronize());
  ASSERT_OK(d.CopyD2H(pinned.data(), x.data(), 64, d.d2h()));
  ASSERT_OK(d.d2h().Synchronize());
  EXPECT_EQ(pinned.as<int32_t>()[15], 5);
  EXPECT_FALSE(d.h2d().Query().value());
  gate.set_value();
  ASSERT_OK(d.h2d().Synchronize());
}

// Pageable copies block the caller with CUDA's guarantees (device.h,
// Memory): an H2D returns once the source is staged — the source may be
// overwritten at once, but the device-side write is ordered only on its own
// stream, so the d2h stream waits for it through an event; a D2H into pageable
// memory returns with the data there, after the stream's earlier work.
TYPED_TEST(TypedDeviceTest, PageableCopiesAreSynchronous) {
  Device& d = this->dev();
  auto rng = strata::testing::MakeRng();
  std::vector<uint8_t> src = strata::testing::RandomBytes(rng, 100003);
  const std::vector<uint8_t> expected = src;
  auto x = d.Allocate(src.size()).value();
  ASSERT_OK(d.CopyH2D(x.data(), src.data(), src.size(), d.h2d()));
  // The source was staged: overwriting it now must not change what lands.
  std::fill(src.begin(), src.end(), uint8_t{0xAB});
  auto uploaded = d.CreateEvent().value();
  ASSERT_OK(d.h2d().Record(*uploaded));
  ASSERT_OK(d.d2h().Wait(*uploaded));
  ASSERT_OK(d.Fill(x.data(), DType::kFp32, 16, 3.f, d.d2h()));  // earlier work on d2h
  std::vector<uint8_t> dst(src.size());
  ASSERT_OK(d.CopyD2H(dst.data(), x.data(), dst.size(), d.d2h()));
  // No Synchronize: the D2H is complete, and after the Fill.
  EXPECT_EQ(0, std::memcmp(dst.data() + 64, expected.data() + 64, expected.size() - 64));
  float f;
  std::memcpy(&f, dst.data() + 60, 4);
  EXPECT_EQ(f, 3.f);
}

TYPED_TEST(TypedDeviceTest, EventsNeverRecordedAreCompleteAndReRecordWorks) {
  Device& d = this->dev();
  auto ev = d.CreateEvent().value();
  EXPECT_TRUE(ev->Query().value());
  ASSERT_OK(ev->Synchronize());
  ASSERT_OK(d.compute().Wait(*ev));  // no-op
  auto extra = d.CreateStream("extra").value();
  for (int round = 0; round < 3; ++round) {
    std::promise<void> gate;
    std::shared_future<void> opened = gate.get_future().share();
    ASSERT_OK(extra->EnqueueHostCallback([opened] { opened.wait(); }));
    ASSERT_OK(extra->Record(*ev));
    EXPECT_FALSE(ev->Query().value());
    gate.set_value();
    ASSERT_OK(ev->Synchronize());
    EXPECT_TRUE(ev->Query().value());
  }
  ASSERT_OK(d.Synchronize());
}

// Hung on an H100 for the same reason as StreamsRunConcurrently:
// the first FillInt32 launch, lazily loaded while compute was held, waited
// for the context. Destroying the event while queued is fine on both.
TYPED_TEST(TypedDeviceTest, EventMayBeDestroyedWhileRecordAndWaitAreQueued) {
  Device& d = this->dev();
  auto x = d.Allocate(64).value();
  auto pool = PinnedPool::Create(PlanPinnedPool(4096, 4096), &d).value();
  ASSERT_TRUE(pool->pinned()) << "a pageable destination would make the copy below synchronous";
  PinnedBuffer pinned = pool->Acquire(64).value();
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  {
    auto ev = d.CreateEvent().value();
    ASSERT_OK(d.compute().EnqueueHostCallback([opened] { opened.wait(); }));
    ASSERT_OK(d.FillInt32(x.as<int32_t>(), 16, 9, d.compute()));
    ASSERT_OK(d.compute().Record(*ev));
    ASSERT_OK(d.d2h().Wait(*ev));
  }  // destroyed with the record and the wait still queued
  ASSERT_OK(d.CopyD2H(pinned.data(), x.data(), 64, d.d2h()));
  gate.set_value();
  ASSERT_OK(d.d2h().Synchronize());
  EXPECT_EQ(pinned.as<int32_t>()[15], 9);  // the wait still ordered the copy
}

// ---- Event timing ----

TYPED_TEST(TypedDeviceTest, ElapsedSecondsTimesTheWorkBetweenRecords) {
  Device& d = this->dev();
  auto t0 = d.CreateEvent({.timing = true}).value();
  auto t1 = d.CreateEvent({.timing = true}).value();
  EXPECT_TRUE(t0->timing());
  ASSERT_OK(d.compute().Record(*t0));
  ASSERT_OK(d.compute().EnqueueHostCallback(
      [] { std::this_thread::sleep_for(std::chrono::milliseconds(30)); }));
  ASSERT_OK(d.compute().Record(*t1));
  ASSERT_OK(t1->Synchronize());
  auto s = d.ElapsedSeconds(*t0, *t1);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_GE(*s, 0.029);  // the stream waited for the sleeping host function
  auto back = d.ElapsedSeconds(*t1, *t0);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_LT(*back, 0.0);

  // Errors: an event without timing, one never recorded, one not complete.
  auto plain = d.CreateEvent().value();
  EXPECT_FALSE(plain->timing());
  ASSERT_OK(d.compute().Record(*plain));
  ASSERT_OK(d.compute().Synchronize());
  EXPECT_EQ(d.ElapsedSeconds(*t0, *plain).status().code(), StatusCode::kFailedPrecondition);
  auto fresh = d.CreateEvent({.timing = true}).value();
  EXPECT_EQ(d.ElapsedSeconds(*fresh, *t1).status().code(), StatusCode::kFailedPrecondition);
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  ASSERT_OK(d.compute().EnqueueHostCallback([opened] { opened.wait(); }));
  ASSERT_OK(d.compute().Record(*fresh));
  EXPECT_FALSE(fresh->Query().value());  // polling is non-blocking
  EXPECT_EQ(d.ElapsedSeconds(*t0, *fresh).status().code(), StatusCode::kUnavailable);
  gate.set_value();
  ASSERT_OK(fresh->Synchronize());
  EXPECT_TRUE(d.ElapsedSeconds(*t0, *fresh).ok());
}

TYPED_TEST(TypedDeviceTest, AllocationsAreAlignedAndRoundedAlike) {
  Device& d = this->dev();
  auto a = d.Allocate(1).value();
  auto b = d.Allocate(257).value();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % kDeviceAlignment, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % kDeviceAlignment, 0u);
  EXPECT_EQ(d.Stats().in_use_bytes, 3 * kDeviceAlignment);  // 256 + 512
}

// ---- Kernels ----

// fp32 inputs that exercise rounding: every fp16 and bf16 value, the
// midpoints between neighbours and one ulp either side, specials, and random
// bit patterns.
std::vector<float> CastProbeFloats(std::mt19937_64& rng) {
  std::vector<float> v;
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    for (float f : {HalfBitsToFloat(h), Bf16BitsToFloat(h)}) {
      v.push_back(f);
      if (std::isfinite(f)) {
        v.push_back(std::nextafter(f, INFINITY));
        v.push_back(std::nextafter(f, -INFINITY));
      }
    }
    // Midpoint to the next fp16 value (a tie) is exact in fp32.
    const float a = HalfBitsToFloat(h), b = HalfBitsToFloat(static_cast<uint16_t>(h + 1));
    if (std::isfinite(a) && std::isfinite(b) && (h & 0x7fff) != 0x7bff) v.push_back((a + b) / 2);
  }
  for (float f : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::min(),
                  65504.f, 65520.f, 65519.996f, 0.f, -0.f})
    v.push_back(f);
  for (int i = 0; i < (1 << 16); ++i) v.push_back(BitsFloat(static_cast<uint32_t>(rng())));
  return v;
}

TYPED_TEST(TypedDeviceTest, CastFromFloatMatchesReferenceRounding) {
  Device& d = this->dev();
  uint64_t seed;
  auto rng = strata::testing::MakeRng(&seed);
  SCOPED_TRACE(seed);
  const std::vector<float> in = CastProbeFloats(rng);
  const size_t n = in.size() - 1;  // odd count, starting at element 1 (unaligned)
  auto src = Upload(d, in);
  auto dst = d.Allocate(in.size() * 2).value();
  for (DType t : {DType::kFp16, DType::kBf16}) {
    SCOPED_TRACE(std::string(DTypeName(t)));
    ASSERT_OK(d.Cast(src.as<float>() + 1, DType::kFp32, dst.as<uint16_t>() + 1, t, n, d.compute()));
    ASSERT_OK(d.compute().Synchronize());
    auto out = Download<uint16_t>(d, dst.as<uint16_t>() + 1, n);
    int bad = 0;
    for (size_t i = 0; i < n && bad < 10; ++i) {
      const float f = in[i + 1];
      const uint16_t want = t == DType::kFp16 ? FloatToHalfBits(f) : FloatToBf16Bits(f);
      if (std::isnan(f)) {
        if (!IsNanBits(out[i], t)) ++bad, ADD_FAILURE() << "NaN input gave " << out[i];
      } else if (out[i] != want) {
        ++bad;
        ADD_FAILURE() << "input " << f << " (0x" << std::hex << FloatBits(f) << ") → 0x" << out[i]
                      << ", want 0x" << want << std::dec;
      }
    }
  }
}

TYPED_TEST(TypedDeviceTest, CastAllHalfPatternsToFloatAndAcross) {
  Device& d = this->dev();
  std::vector<uint16_t> all(65536 + 1);
  for (uint32_t i = 0; i < 65536; ++i) all[i + 1] = static_cast<uint16_t>(i);  // from element 1
  auto src = Upload(d, all);
  auto f32 = d.Allocate(all.size() * 4).value();
  auto h16 = d.Allocate(all.size() * 2).value();
  for (DType t : {DType::kFp16, DType::kBf16}) {
    SCOPED_TRACE(std::string(DTypeName(t)));
    ASSERT_OK(
        d.Cast(src.as<uint16_t>() + 1, t, f32.as<float>() + 1, DType::kFp32, 65536, d.compute()));
    const DType other = t == DType::kFp16 ? DType::kBf16 : DType::kFp16;
    ASSERT_OK(d.Cast(src.as<uint16_t>() + 1, t, h16.as<uint16_t>() + 1, other, 65536, d.compute()));
    ASSERT_OK(d.compute().Synchronize());
    auto wide = Download<float>(d, f32.as<float>() + 1, 65536);
    auto across = Download<uint16_t>(d, h16.as<uint16_t>() + 1, 65536);
    for (uint32_t i = 0; i < 65536; ++i) {
      const uint16_t h = static_cast<uint16_t>(i);
      const float want = t == DType::kFp16 ? HalfBitsToFloat(h) : Bf16BitsToFloat(h);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(wide[i])) << i;
        ASSERT_TRUE(IsNanBits(across[i], other)) << i;
        continue;
      }
      ASSERT_EQ(FloatBits(wide[i]), FloatBits(want)) << "pattern 0x" << std::hex << i;
      const uint16_t want_x = other == DType::kFp16 ? FloatToHalfBits(want) : FloatToBf16Bits(want);
      ASSERT_EQ(across[i], want_x) << "pattern 0x" << std::hex << i;
    }
  }
}

TYPED_TEST(TypedDeviceTest, CastInPlaceAndSameTypeCopy) {
  Device& d = this->dev();
  auto rng = strata::testing::MakeRng();
  const auto f = strata::testing::RandomFloats(rng, 1001, -100.f, 100.f);
  std::vector<uint16_t> h(f.size());
  for (size_t i = 0; i < f.size(); ++i) h[i] = FloatToHalfBits(f[i]);
  auto x = Upload(d, h);
  auto y = d.Allocate(h.size() * 2).value();
  ASSERT_OK(d.Cast(x.data(), DType::kFp16, y.data(), DType::kFp16, h.size(), d.compute()));
  ASSERT_OK(d.Cast(x.data(), DType::kFp16, x.data(), DType::kBf16, h.size(), d.compute()));
  ASSERT_OK(d.compute().Synchronize());
  EXPECT_EQ(Download<uint16_t>(d, y.data(), h.size()), h);
  auto out = Download<uint16_t>(d, x.data(), h.size());
  for (size_t i = 0; i < h.size(); ++i)
    ASSERT_EQ(out[i], FloatToBf16Bits(HalfBitsToFloat(h[i]))) << i;
}

TYPED_TEST(TypedDeviceTest, UnscaleAndCheckMatchesReferenceAndFlags) {
  Device& d = this->dev();
  uint64_t seed;
  auto rng = strata::testing::MakeRng(&seed);
  SCOPED_TRACE(seed);
  auto flag = d.Allocate(sizeof(int32_t)).value();
  const size_t n = 100003;
  for (DType t : {DType::kFp32, DType::kFp16, DType::kBf16}) {
    SCOPED_TRACE(std::string(DTypeName(t)));
    // Case 0: clean; 1: an inf; 2: a NaN near the end; 3: finite but the
    // unscale overflows the dtype (inv_scale > 1).
    for (int c = 0; c < 4; ++c) {
      SCOPED_TRACE(c);
      std::vector<float> g = strata::testing::RandomFloats(rng, n, -1000.f, 1000.f);
      float inv_scale = 1.f / 1024;
      if (c == 1) g[12345] = INFINITY;
      if (c == 2) g[n - 2] = NAN;
      if (c == 3) {
        g[777] = t == DType::kFp16 ? 60000.f : 3e38f;
        inv_scale = 4.f;
      }
      std::vector<uint8_t> bytes(n * DTypeSize(t));
      for (size_t i = 0; i < n; ++i) host::StoreFromFloat(bytes.data(), t, i, g[i]);
      auto x = Upload(d, bytes);
      ASSERT_OK(d.FillInt32(flag.as<int32_t>(), 1, 0, d.compute()));
      ASSERT_OK(d.UnscaleAndCheck(x.data(), t, n, inv_scale, flag.as<int32_t>(), d.compute()));
      ASSERT_OK(d.compute().Synchronize());
      std::vector<uint8_t> want = bytes;
      const bool want_flag = host::UnscaleAndCheck(want.data(), t, n, inv_scale);
      EXPECT_EQ(want_flag, c != 0);
      EXPECT_EQ(Download<int32_t>(d, flag.data(), 1)[0], c != 0 ? 1 : 0);
      auto got = Download<uint8_t>(d, x.data(), bytes.size());
      for (size_t i = 0; i < n; ++i) {
        const float gw = host::LoadAsFloat(want.data(), t, i);
        const float gg = host::LoadAsFloat(got.data(), t, i);
        if (std::isnan(gw)) {
          ASSERT_TRUE(std::isnan(gg)) << i;
        } else {
          ASSERT_EQ(FloatBits(gg), FloatBits(gw)) << i;
        }
      }
    }
  }
  // The flag is sticky: a clean tensor after a bad one leaves it set.
  auto x = Upload(d, std::vector<float>(1000, 1.f));
  ASSERT_OK(d.FillInt32(flag.as<int32_t>(), 1, 1, d.compute()));
  ASSERT_OK(d.UnscaleAndCheck(x.data(), DType::kFp32, 1000, 0.5f, flag.as<int32_t>(), d.compute()));
  ASSERT_OK(d.compute().Synchronize());
  EXPECT_EQ(Download<int32_t>(d, flag.data(), 1)[0], 1);
}

TYPED_TEST(TypedDeviceTest, SumSquaresAccumulatesAcrossTensors) {
  Device& d = this->dev();
  uint64_t seed;
  auto rng = strata::testing::MakeRng(&seed);
  SCOPED_TRACE(seed);
  auto sum = d.Allocate(sizeof(double)).value();
  for (DType t : {DType::kFp32, DType::kFp16, DType::kBf16}) {
    SCOPED_TRACE(std::string(DTypeName(t)));
    ASSERT_OK(d.FillDouble(sum.as<double>(), 1, 0.0, d.compute()));
    double want = 0;
    for (size_t n : {size_t{1}, size_t{31}, size_t{100003}, size_t{1} << 20}) {
      const auto f = strata::testing::RandomFloats(rng, n, -3.f, 3.f);
      std::vector<uint8_t> bytes(n * DTypeSize(t));
      for (size_t i = 0; i < n; ++i) host::StoreFromFloat(bytes.data(), t, i, f[i]);
      auto x = Upload(d, bytes);
      ASSERT_OK(d.SumSquares(x.data(), t, n, sum.as<double>(), d.compute()));
      ASSERT_OK(d.compute().Synchronize());  // x is freed at the end of this scope
      want += host::SumSquares(bytes.data(), t, n);
    }
    const double got = Download<double>(d, sum.data(), 1)[0];
    EXPECT_NEAR(got, want, 1e-10 * want);
    EXPECT_GT(got, 0.0);
  }
  // inf propagates into the norm (the scheduler checks the flag separately).
  auto bad = Upload(d, std::vector<float>{1.f, INFINITY, 2.f});
  ASSERT_OK(d.FillDouble(sum.as<double>(), 1, 0.0, d.compute()));
  ASSERT_OK(d.SumSquares(bad.data(), DType::kFp32, 3, sum.as<double>(), d.compute()));
  ASSERT_OK(d.compute().Synchronize());
  EXPECT_TRUE(std::isinf(Download<double>(d, sum.data(), 1)[0]));
}

TYPED_TEST(TypedDeviceTest, FillEveryDtype) {
  Device& d = this->dev();
  const size_t n = 4099;
  auto x = d.Allocate((n + 2) * 8).value();
  for (DType t : {DType::kFp32, DType::kFp16, DType::kBf16}) {
    for (float v : {0.1f, -3.0e5f, 1e-7f}) {
      ASSERT_OK(d.FillInt32(x.as<int32_t>(), (n + 2) * 2, 0x5a5a5a5a, d.compute()));
      ASSERT_OK(d.Fill(x.as<char>() + DTypeSize(t), t, n, v, d.compute()));
      ASSERT_OK(d.compute().Synchronize());
      auto got = Download<uint8_t>(d, x.data(), (n + 2) * DTypeSize(t));
      for (size_t i = 0; i < n + 2; ++i) {
        if (i == 0 || i == n + 1) {
          ASSERT_EQ(got[i * DTypeSize(t)], 0x5a) << "written outside the range at " << i;
          continue;
        }
        const float g = host::LoadAsFloat(got.data(), t, i);
        std::vector<uint8_t> one(4);
        host::StoreFromFloat(one.data(), t, 0, v);
        ASSERT_EQ(FloatBits(g), FloatBits(host::LoadAsFloat(one.data(), t, 0))) << i;
      }
    }
  }
  ASSERT_OK(d.FillDouble(x.as<double>(), 3, -2.5, d.compute()));
  ASSERT_OK(d.compute().Synchronize());
  EXPECT_EQ(Download<double>(d, x.data(), 3), (std::vector<double>{-2.5, -2.5, -2.5}));
}

// AddToFp32 is the CPU's accumulation, bit for bit: exact widening, one fp32
// add per element, in range only.
TYPED_TEST(TypedDeviceTest, AddToFp32MatchesThePlainLoop) {
  Device& d = this->dev();
  auto rng = strata::testing::MakeRng();
  for (DType t : {DType::kFp32, DType::kFp16, DType::kBf16}) {
    for (size_t n : {size_t{1}, size_t{7}, size_t{4099}}) {
      const std::vector<float> acc0 = strata::testing::RandomFloats(rng, n + 2, -3.f, 3.f);
      const std::vector<float> xf = strata::testing::RandomFloats(rng, n, -2.f, 2.f);
      std::vector<uint8_t> xb(n * DTypeSize(t));
      for (size_t i = 0; i < n; ++i) StoreFromFloat(xb.data(), t, i, xf[i]);
      auto acc = d.Allocate((n + 2) * 4).value();
      auto x = d.Allocate(xb.size()).value();
      ASSERT_OK(d.CopyH2D(acc.data(), acc0.data(), (n + 2) * 4, d.compute()));
      ASSERT_OK(d.CopyH2D(x.data(), xb.data(), xb.size(), d.compute()));
      ASSERT_OK(d.AddToFp32(acc.as<float>() + 1, x.data(), t, n, d.compute()));
      ASSERT_OK(d.compute().Synchronize());
      const std::vector<float> got = Download<float>(d, acc.data(), n + 2);
      for (size_t i = 0; i < n + 2; ++i) {
        float want = acc0[i];
        if (i >= 1 && i <= n) want += LoadAsFloat(xb.data(), t, i - 1);
        ASSERT_EQ(FloatBits(got[i]), FloatBits(want)) << DTypeName(t) << " n " << n << " i " << i;
      }
    }
  }
}

TYPED_TEST(TypedDeviceTest, ZeroLengthWorkIsANoOp) {
  Device& d = this->dev();
  auto x = d.Allocate(256).value();
  ASSERT_OK(d.Fill(x.data(), DType::kFp32, 0, 1.f, d.compute()));
  ASSERT_OK(d.Cast(x.data(), DType::kFp32, x.data(), DType::kFp32, 0, d.compute()));
  ASSERT_OK(d.compute().Synchronize());
}

// ---- Selection and facts (backend-independent) ----

TEST(DeviceSelectionTest, OptionsFromConfigAndErrorsNameTheKey) {
  Config c;
  c.strata.device = DeviceKind::kHost;
  c.strata.hbm_budget_bytes = 123 << 20;
  c.strata.host_device.link_gbytes_per_s = 12.5;
  c.strata.host_device.link_latency_us = 3;
  auto o = DeviceOptionsFromConfig(c);
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->kind, DeviceKind::kHost);
  EXPECT_EQ(o->hbm_budget_bytes, size_t{123} << 20);
  EXPECT_EQ(o->link_gbytes_per_s, 12.5);
  EXPECT_EQ(o->link_latency_us, 3);
  c.strata.hbm_budget_bytes = -1;
  auto bad = DeviceOptionsFromConfig(c);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("strata.hbm_budget_bytes"), std::string::npos);
  c.strata.hbm_budget_bytes = 0;
  c.strata.host_device.link_gbytes_per_s = -1;
  bad = DeviceOptionsFromConfig(c);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("link_gbytes_per_s"), std::string::npos);
}

TEST(DeviceSelectionTest, AutoFallsBackToHostWithoutAGpu) {
  const CudaDeviceList list = ListCudaDevices();
  DeviceOptions o;
  o.kind = DeviceKind::kAuto;
  o.hbm_budget_bytes = 16 << 20;
  auto d = CreateDevice(o);
  ASSERT_TRUE(d.ok()) << d.status();
  if (list.devices.empty()) {
    EXPECT_FALSE(list.reason.empty());
    EXPECT_TRUE((*d)->is_host());
    EXPECT_EQ((*d)->Describe(), "host");
    o.kind = DeviceKind::kCuda;
    auto c = CreateDevice(o);
    ASSERT_FALSE(c.ok());
    EXPECT_TRUE(c.status().code() == StatusCode::kUnavailable ||
                c.status().code() == StatusCode::kNotSupported)
        << c.status();
  } else {
    EXPECT_FALSE((*d)->is_host());
    EXPECT_GT(list.devices[0].total_bytes, 0u);
    EXPECT_GE(list.devices[0].cc_major, 7);
  }
}

TEST(DeviceSelectionTest, HostLinkModelIsDescribedAndCopiesStillCorrect) {
  DeviceOptions o;
  o.kind = DeviceKind::kHost;
  o.hbm_budget_bytes = 16 << 20;
  o.link_gbytes_per_s = 50;
  o.link_latency_us = 1;
  auto d = CreateDevice(o).value();
  EXPECT_NE(d->Describe().find("link model"), std::string::npos);
  auto rng = strata::testing::MakeRng();
  auto src = strata::testing::RandomBytes(rng, 1 << 20);
  std::vector<uint8_t> dst(src.size());
  auto x = d->Allocate(src.size()).value();
  ASSERT_OK(d->CopyH2D(x.data(), src.data(), src.size(), d->h2d()));
  ASSERT_OK(d->h2d().Synchronize());
  ASSERT_OK(d->CopyD2H(dst.data(), x.data(), src.size(), d->d2h()));
  ASSERT_OK(d->d2h().Synchronize());
  EXPECT_EQ(src, dst);
  o.link_gbytes_per_s = -1;
  EXPECT_EQ(CreateDevice(o).status().code(), StatusCode::kInvalidArgument);
}

#if STRATA_HAVE_CUDA
// The cudaError_t mapping runs without a GPU (values are the runtime's stable
// enum numbers: 1 InvalidValue, 2 MemoryAllocation, 35 InsufficientDriver,
// 100 NoDevice, 712 HostMemoryAlreadyRegistered, 999 Unknown).
TEST(CudaErrorTest, CodesAndMessagesNameTheCall) {
  EXPECT_TRUE(gpu::internal::CudaErrorToStatus(0, "x").ok());
  const Status oom = gpu::internal::CudaErrorToStatus(2, "cudaMalloc(1.00 GiB)");
  EXPECT_EQ(oom.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(oom.message()).find("cudaMalloc(1.00 GiB)"), std::string::npos) << oom;
  EXPECT_NE(std::string(oom.message()).find("cudaErrorMemoryAllocation"), std::string::npos) << oom;
  EXPECT_EQ(gpu::internal::CudaErrorToStatus(35, "c").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(gpu::internal::CudaErrorToStatus(100, "c").code(), StatusCode::kUnavailable);
  EXPECT_EQ(gpu::internal::CudaErrorToStatus(1, "c").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu::internal::CudaErrorToStatus(712, "c").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(gpu::internal::CudaErrorToStatus(999, "c").code(), StatusCode::kIOError);
}

// device=auto falls back only when there is no GPU: cudaGetDeviceCount's
// answers (0 Success, 3 InitializationError, 35 InsufficientDriver,
// 100 NoDevice, 803 SystemDriverMismatch) with the driver's version (0: no
// driver library).
TEST(CudaErrorTest, OnlyAMissingGpuCountsAsNoDevice) {
  using gpu::internal::ClassifyCudaPresence;
  using gpu::internal::CudaPresence;
  EXPECT_EQ(ClassifyCudaPresence(0, 1, 13000), CudaPresence::kPresent);
  EXPECT_EQ(ClassifyCudaPresence(0, 0, 13000), CudaPresence::kNoDevice);
  EXPECT_EQ(ClassifyCudaPresence(100, 0, 13000), CudaPresence::kNoDevice);
  // No NVIDIA driver installed (this is what a machine without one answers).
  EXPECT_EQ(ClassifyCudaPresence(35, 0, 0), CudaPresence::kNoDevice);
  // A driver older than the runtime: a GPU is there, it is an error.
  EXPECT_EQ(ClassifyCudaPresence(35, 0, 12040), CudaPresence::kUnusable);
  EXPECT_EQ(ClassifyCudaPresence(3, 0, 13000), CudaPresence::kUnusable);
  EXPECT_EQ(ClassifyCudaPresence(803, 0, 12080), CudaPresence::kUnusable);
  EXPECT_EQ(ClassifyCudaPresence(999, 0, 13000), CudaPresence::kUnusable);
}

// What this machine answers, through the factory: with a GPU, a device; with
// none, Unavailable (the fallback's code) naming the probe and the versions;
// never FailedPrecondition on a machine whose GPU works.
TEST(CudaErrorTest, TheFactorySaysWhyThereIsNoDevice) {
  DeviceOptions o;
  o.kind = DeviceKind::kCuda;
  o.hbm_budget_bytes = 16 << 20;
  auto d = CreateDevice(o);
  if (d.ok()) GTEST_SKIP() << "a usable GPU: " << (*d)->Describe();
  const std::string msg(d.status().message());
  ASSERT_EQ(d.status().code(), StatusCode::kUnavailable) << d.status();
  EXPECT_NE(msg.find("cudaGetDeviceCount"), std::string::npos) << msg;
  if (msg.find("returned 0") == std::string::npos) {
    EXPECT_NE(msg.find("the runtime is CUDA"), std::string::npos) << msg;
  }
}
#endif

#if STRATA_HAVE_CUDA
// A failed CUDA call that the caller tolerates (a second cudaHostRegister of
// the same range: cudaErrorHostMemoryAlreadyRegistered; the pinned pool and
// the host arrays fall back to pageable memory on such failures) must not
// come back as the next kernel launch's error: the launchers return
// cudaGetLastError(), so the conversion to Status clears it.
TEST(CudaDeviceTest, ToleratedRegisterFailureDoesNotFailTheNextLaunch) {
  auto d = CudaBackend::Make(16 << 20);
  if (!d.ok()) GTEST_SKIP() << "no CUDA device: " << d.status();
  Device& dev = **d;
  // Page-aligned, as the pinned pool's regions are.
  constexpr size_t kCount = 4096;
  std::unique_ptr<float, decltype(&std::free)> mem(
      static_cast<float*>(std::aligned_alloc(4096, kCount * sizeof(float))), &std::free);
  ASSERT_NE(mem, nullptr);
  std::span<float> host(mem.get(), kCount);
  std::fill(host.begin(), host.end(), 1.f);
  ASSERT_OK(dev.PinHostMemory(host.data(), host.size() * sizeof(float)));
  const Status again = dev.PinHostMemory(host.data(), host.size() * sizeof(float));
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.code(), StatusCode::kFailedPrecondition) << again;
  auto x = dev.Allocate(host.size() * sizeof(float)).value();
  EXPECT_OK(dev.Fill(x.data(), DType::kFp32, host.size(), 2.5f, dev.compute()));
  EXPECT_OK(dev.FillInt32(static_cast<int32_t*>(x.data()), 1, 7, dev.compute()));
  EXPECT_OK(dev.CopyD2H(host.data(), x.data(), host.size() * sizeof(float), dev.compute()));
  EXPECT_OK(dev.compute().Synchronize());
  EXPECT_EQ(host[1], 2.5f);
  EXPECT_EQ(host.back(), 2.5f);
  EXPECT_OK(dev.UnpinHostMemory(host.data(), host.size() * sizeof(float)));
  // Unregistering twice fails too, and is as harmless for the next launch.
  EXPECT_FALSE(dev.UnpinHostMemory(host.data(), host.size() * sizeof(float)).ok());
  EXPECT_OK(dev.Fill(x.data(), DType::kFp32, host.size(), 1.f, dev.compute()));
  EXPECT_OK(dev.compute().Synchronize());
}
#endif

TEST(DeviceSelectionTest, MemlockLimitMatchesGetrlimit) {
  struct rlimit rl {};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &rl), 0);
  const MemlockLimit m = ReadMemlockLimit();
  EXPECT_EQ(m.soft_unlimited, rl.rlim_cur == RLIM_INFINITY);
  if (!m.soft_unlimited) {
    EXPECT_EQ(m.soft_bytes, rl.rlim_cur);
  }
}

}  // namespace
}  // namespace strata::gpu::testing
