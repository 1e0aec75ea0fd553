// StepCounters and the step bound: pure arithmetic on hand-made figures.
#include "src/scheduler/step_counters.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "src/common/timer.h"
#include "src/gpu/device.h"
#include "strata/engine.h"

namespace strata {
namespace {

TEST(StepBoundTest, TakesTheBusiestResource) {
  StepStats s;
  s.compute_s = 0.10;
  s.optimizer_s = 0.05;
  s.pcie_h2d_bytes = 2'000'000'000;  // 0.2 s at 10 GB/s
  s.h2d_gbytes_per_s = 10;
  s.pcie_d2h_bytes = 1'000'000'000;  // 0.05 s at 20 GB/s
  s.d2h_gbytes_per_s = 20;
  s.nvme_read_bytes = 300'000'000;  // (0.3 + 0.2) GB at 2 GB/s = 0.25 s
  s.nvme_written_bytes = 200'000'000;
  s.nvme_gbytes_per_s = 2;
  StepBound b = BoundOf(s);
  EXPECT_DOUBLE_EQ(b.seconds, 0.25);
  EXPECT_STREQ(b.by, "nvme");
  s.nvme_gbytes_per_s = 4;  // nvme 0.125 s: the link is the bound now
  b = BoundOf(s);
  EXPECT_DOUBLE_EQ(b.seconds, 0.2);
  EXPECT_STREQ(b.by, "pcie_h2d");
  s.optimizer_s = 0.3;
  EXPECT_STREQ(BoundOf(s).by, "cpu_optimizer");
  s.compute_s = 0.31;
  EXPECT_STREQ(BoundOf(s).by, "compute");
}

// The disk's measured read and write rates, when known, replace the rate of
// the engine's own traffic: one disk, so the read and write times add up.
TEST(StepBoundTest, TheDisksReadAndWriteRatesAddUp) {
  StepStats s;
  s.compute_s = 0.1;
  s.nvme_read_bytes = 300'000'000;     // 0.15 s at 2 GB/s
  s.nvme_written_bytes = 200'000'000;  // 0.2 s at 1 GB/s
  s.nvme_gbytes_per_s = 10;            // the engine's own best: 0.05 s, not used
  s.nvme_read_gbytes_per_s = 2;
  s.nvme_write_gbytes_per_s = 1;
  StepBound b = BoundOf(s);
  EXPECT_DOUBLE_EQ(b.seconds, 0.35);
  EXPECT_STREQ(b.by, "nvme");
  s.nvme_write_gbytes_per_s = 0;  // not measured: the engine's own rate
  b = BoundOf(s);
  EXPECT_DOUBLE_EQ(b.seconds, 0.1);
  EXPECT_STREQ(b.by, "compute");
}

TEST(StepBoundTest, TermsWithoutARateAreLeftOut) {
  StepStats s;
  s.compute_s = 0.01;
  s.pcie_h2d_bytes = 1 << 30;
  s.nvme_read_bytes = 1 << 30;
  const StepBound b = BoundOf(s);  // no rates known: compute only
  EXPECT_DOUBLE_EQ(b.seconds, 0.01);
  EXPECT_STREQ(b.by, "compute");
}

TEST(StepCountersTest, UnionLengthCountsOverlapsOnce) {
  using scheduler::StepCounters;
  EXPECT_EQ(StepCounters::UnionLength({}), 0);
  EXPECT_EQ(StepCounters::UnionLength({{10, 20}, {15, 30}, {40, 45}, {0, 5}}), 5 + 20 + 5);
  EXPECT_EQ(StepCounters::UnionLength({{0, 100}, {10, 20}, {30, 40}}), 100);
}

TEST(StepCountersTest, EndWindowFillsRatesAndBound) {
  scheduler::StepCounters c(false);
  c.SetLinkRates(1.0, 2.0);
  c.NoteNvmeRate(0.5);
  c.NoteNvmeRate(0.25);  // only the best rate counts
  c.StartWindow(0);
  c.AddCopyBytes(scheduler::Link::kH2D, 500'000'000);  // 0.5 s at 1 GB/s
  c.AddOptimizerBusy(100'000'000);                     // 0.1 s
  StepStats st;
  c.EndWindow(1'000'000'000, &st);  // a 1 s window
  EXPECT_DOUBLE_EQ(st.step_time_s, 1.0);
  EXPECT_DOUBLE_EQ(st.h2d_gbytes_per_s, 1.0);
  EXPECT_DOUBLE_EQ(st.d2h_gbytes_per_s, 2.0);
  EXPECT_DOUBLE_EQ(st.nvme_gbytes_per_s, 0.5);
  EXPECT_DOUBLE_EQ(st.bound_s, 0.5);
  EXPECT_STREQ(st.bound_by, "pcie_h2d");
  EXPECT_DOUBLE_EQ(st.bound_efficiency, 0.5);
  // The next window starts empty.
  StepStats next;
  c.EndWindow(2'000'000'000, &next);
  EXPECT_EQ(next.pcie_h2d_bytes, 0);
  EXPECT_DOUBLE_EQ(next.bound_s, 0.0);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// Copies are timed by device events, collected by polling: a copy held up on
// its stream is not counted (and Collect does not wait for it); once it has
// run, its device time and bytes are, on the right link and the timeline.
TEST(StepCountersTest, CopiesAreTimedByDeviceEventsWithoutHostFunctions) {
  gpu::DeviceOptions o;
  o.kind = DeviceKind::kHost;
  o.hbm_budget_bytes = 8 << 20;
  o.link_gbytes_per_s = 0.5;  // 1 MiB: about 2 ms
  auto dev = gpu::CreateDevice(o);
  ASSERT_TRUE(dev.ok()) << dev.status();
  gpu::Device& d = **dev;
  scheduler::StepCounters c(/*timeline_enabled=*/true);
  ASSERT_TRUE(c.StartDeviceClock(&d).ok());
  const size_t bytes = 1 << 20;
  auto buf = d.Allocate(bytes);
  ASSERT_TRUE(buf.ok());
  std::vector<uint8_t> host(bytes, 7);
  ASSERT_TRUE(d.PinHostMemory(host.data(), bytes).ok());
  c.StartWindow(NowNanos());
  // A gate on the compute stream that the H2D stream waits for: the copy is
  // held up until the test opens it.
  auto gate = d.CreateEvent();
  ASSERT_TRUE(gate.ok());
  std::atomic<bool> open{false};
  ASSERT_TRUE(d.compute()
                  .EnqueueHostCallback([&] {
                    while (!open.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
                  })
                  .ok());
  ASSERT_TRUE(d.compute().Record(**gate).ok());
  ASSERT_TRUE(d.h2d().Wait(**gate).ok());
  ASSERT_TRUE(
      c.TimedCopy(d.h2d(), scheduler::Link::kH2D, "test copy", static_cast<int64_t>(bytes), [&] {
         return d.CopyH2D(buf->data(), host.data(), bytes, d.h2d());
       }).ok());
  ASSERT_TRUE(c.Collect().ok());  // does not wait
  open = true;
  ASSERT_TRUE(d.h2d().Synchronize().ok());
  StepStats st;
  c.EndWindow(NowNanos(), &st);
  EXPECT_EQ(st.pcie_h2d_bytes, static_cast<int64_t>(bytes));
  // The copy's modelled time (about 2 ms for 1 MiB) is counted once it has
  // run; a quarter of it leaves room for the stream's thread to be
  // descheduled between the timing event and the copy on a loaded machine.
  EXPECT_GT(st.pcie_busy_s, 0.25 * 2e-3);
  EXPECT_LT(st.pcie_busy_s, st.step_time_s);
  EXPECT_EQ(c.timeline().size(), 1u);
  ASSERT_TRUE(d.UnpinHostMemory(host.data(), bytes).ok());
}

}  // namespace
}  // namespace strata
