// DeviceSums on the host device: the window's sums kept in "HBM" give the
// global checks the bits of the sums in DRAM (NormBlocks over each
// sub-group), and the step's stream hands every element over once, in
// chunks of whole norm blocks from each sub-group's first element, zeroing
// each sub-group before publishing it; an error stops it with the sub-groups
// not reached left as they were.
#include "src/scheduler/device_sums.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "src/scheduler/grad_store.h"
#include "tests/scheduler/parts_test_util.h"

namespace strata::scheduler {
namespace {

using ::testing::HasSubstr;
using testing::Rec;

// Sub-groups of 150000 elements over modules of odd sizes: chunks of one
// norm block (65536) cut each sub-group in three, the last one short.
Layout MakeLayout() {
  std::vector<ParamRec> recs;
  recs.push_back(Rec("a", 70001, DType::kBf16, 0));
  recs.push_back(Rec("b", 150003, DType::kFp32, 1));
  recs.push_back(Rec("c", 9000, DType::kFp16, 2));
  recs.push_back(Rec("d", 140000, DType::kBf16, 3));
  LayoutOptions o;
  o.sub_group_size = 150000;
  return Layout::Build(std::move(recs), o);
}

class DeviceSumsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rng_ = ::strata::testing::MakeRng(&seed_);
    layout_ = MakeLayout();
    ASSERT_GT(layout_.num_groups(), 2u);
    dev_ = testing::MakeHostDevice(64 << 20);
    ASSERT_NE(dev_, nullptr);
    sums_ = std::make_unique<DeviceSums>(dev_.get(), &layout_, &counters_, kNormBlock, true);
    int64_t pinned = 0;
    ASSERT_OK(sums_->Open(&pinned));
    // Random sums in the array (never zeros).
    host_ = ::strata::testing::RandomFloats(rng_, static_cast<size_t>(layout_.total_elems()), -2.f,
                                            2.f);
    Upload();
  }
  void Upload() {
    ASSERT_OK(
        dev_->CopyH2D(sums_->data(), host_.data(), host_.size() * sizeof(float), dev_->compute()));
  }
  std::vector<float> Download() {
    std::vector<float> out(host_.size());
    EXPECT_OK(dev_->compute().Synchronize());
    EXPECT_OK(
        dev_->CopyD2H(out.data(), sums_->data(), out.size() * sizeof(float), dev_->compute()));
    EXPECT_OK(dev_->compute().Synchronize());
    return out;
  }
  // The blocks GradOffloader takes over the sums in DRAM.
  void Reference(std::vector<double>* partial, std::vector<uint8_t>* bad) const {
    for (size_t g = 0; g < layout_.num_groups(); ++g) {
      const SubGroup& sg = layout_.group(g);
      const size_t at = partial->size();
      const auto n = static_cast<size_t>(NormBlockCount(sg));
      partial->resize(at + n);
      bad->resize(at + n);
      NormBlocks(host_.data() + sg.elem_begin, sg.elems(), partial->data() + at, bad->data() + at);
    }
  }

  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  Layout layout_;
  StepCounters counters_{false};
  std::unique_ptr<gpu::Device> dev_;
  std::unique_ptr<DeviceSums> sums_;
  std::vector<float> host_;
};

TEST_F(DeviceSumsTest, ChecksHaveTheBitsOfTheSumsInDram) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  std::vector<double> want_partial, got_partial;
  std::vector<uint8_t> want_bad, got_bad;
  Reference(&want_partial, &want_bad);
  ASSERT_OK(sums_->Begin());
  ASSERT_OK(sums_->BlockChecks(0, layout_.num_groups(), &got_partial, &got_bad));
  EXPECT_EQ(want_partial, got_partial);  // bitwise: the same doubles
  EXPECT_EQ(want_bad, got_bad);
  double want = 0;
  for (double p : want_partial) want += p;
  bool overflow = true;
  double sumsq = 0;
  ASSERT_OK(sums_->GlobalChecks(&overflow, &sumsq));
  EXPECT_FALSE(overflow);
  EXPECT_EQ(want, sumsq);
  // Only sub-group 1's blocks.
  ASSERT_OK(sums_->BlockChecks(1, 2, &got_partial, &got_bad));
  EXPECT_EQ(got_partial.size(), static_cast<size_t>(NormBlockCount(layout_.group(1))));

  // An inf in the last sub-group's last chunk.
  host_[host_.size() - 3] = std::numeric_limits<float>::infinity();
  Upload();
  ASSERT_OK(sums_->Begin());
  ASSERT_OK(sums_->GlobalChecks(&overflow, &sumsq));
  EXPECT_TRUE(overflow);
}

TEST_F(DeviceSumsTest, StreamHandsOverEveryChunkOnceAndZeroesEachSubGroup) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const std::vector<float> want = host_;
  int64_t next = 0;
  std::vector<size_t> done;
  int chunks = 0;
  ASSERT_OK(sums_->Begin());
  ASSERT_OK(sums_->Stream(
      0, layout_.num_groups(),
      [&](size_t g, int64_t lo, int64_t hi, const float* sums) {
        const SubGroup& sg = layout_.group(g);
        EXPECT_EQ(lo, next);  // in order, no gaps
        EXPECT_GE(lo, sg.elem_begin);
        EXPECT_LE(hi, sg.elem_end);
        EXPECT_EQ((lo - sg.elem_begin) % kNormBlock, 0);  // whole norm blocks
        EXPECT_LE(hi - lo, kNormBlock);
        EXPECT_TRUE(hi == sg.elem_end || hi - lo == kNormBlock);
        EXPECT_TRUE(done.empty() || done.back() + 1 == g);  // g not published yet
        EXPECT_EQ(0, std::memcmp(sums, want.data() + lo, static_cast<size_t>(hi - lo) * 4))
            << "[" << lo << ", " << hi << ")";
        next = hi;
        ++chunks;
        return Status();
      },
      [&](size_t g) { done.push_back(g); }));
  EXPECT_EQ(next, layout_.total_elems());
  EXPECT_GT(chunks, static_cast<int>(layout_.num_groups()));  // sub-groups were cut
  ASSERT_EQ(done.size(), layout_.num_groups());
  for (size_t g = 0; g < done.size(); ++g) EXPECT_EQ(done[g], g);
  const std::vector<float> after = Download();
  for (size_t i = 0; i < after.size(); ++i) ASSERT_EQ(after[i], 0.f) << i;
  StepStats st;
  counters_.EndWindow(0, &st);
  EXPECT_EQ(st.pcie_d2h_bytes, 4 * layout_.total_elems());
}

TEST_F(DeviceSumsTest, AnErrorStopsTheStreamAndLeavesTheRestInPlace) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  std::vector<size_t> done;
  ASSERT_OK(sums_->Begin());
  const Status s = sums_->Stream(
      0, layout_.num_groups(),
      [&](size_t g, int64_t lo, int64_t, const float*) -> Status {
        if (g == 1 && lo > layout_.group(1).elem_begin)
          return DataLossError("injected failure in sub-group 1");
        return Status();
      },
      [&](size_t g) { done.push_back(g); });
  EXPECT_THAT(std::string(s.message()), HasSubstr("injected failure in sub-group 1"));
  EXPECT_EQ(done, std::vector<size_t>{0});
  const std::vector<float> after = Download();
  const int64_t g1 = layout_.group(1).elem_begin;
  for (int64_t i = 0; i < g1; ++i) ASSERT_EQ(after[static_cast<size_t>(i)], 0.f) << i;
  for (size_t i = static_cast<size_t>(g1); i < after.size(); ++i)
    ASSERT_EQ(after[i], host_[i]) << i;
}

}  // namespace
}  // namespace strata::scheduler
