// Layout::Build on a hand-made layout with mixed dtypes, an empty module and
// sub-groups that split parameters: offsets, extents, sub-groups and the
// slicing helpers; then the same invariants on random layouts.
#include "src/scheduler/layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <ostream>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace strata::scheduler {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

ParamRec Rec(std::string name, int64_t numel, DType dtype, int module) {
  ParamRec p;
  p.name = std::move(name);
  p.numel = numel;
  p.dtype = dtype;
  p.module = module;
  return p;
}

// Registered out of module order: c (m2), a (m0), d (m2), b (m0); module 1
// has no parameters.
Layout HandMade(bool offloaded = true, int64_t reduce_bucket = 3000) {
  LayoutOptions o;
  o.sub_group_size = 1000;
  o.params_offloaded = offloaded;
  o.persistence_threshold = 400;
  o.reduce_bucket_size = reduce_bucket;
  return Layout::Build({Rec("c", 5000, DType::kFp16, 2), Rec("a", 10, DType::kFp32, 0),
                        Rec("d", 7, DType::kFp32, 2), Rec("b", 300, DType::kBf16, 0)},
                       o);
}

struct S {
  int param;
  int64_t elem_begin, elem_end, byte_offset;
  bool operator==(const S&) const = default;
};
std::vector<S> Of(const std::vector<Layout::Slice>& v) {
  std::vector<S> out;
  for (const auto& s : v) out.push_back({s.param, s.elem_begin, s.elem_end, s.byte_offset});
  return out;
}
void PrintTo(const S& s, std::ostream* os) {
  *os << "{p" << s.param << " [" << s.elem_begin << "," << s.elem_end << ") @" << s.byte_offset
      << "}";
}

TEST(LayoutTest, OffsetsModulesOnPagesTensorsOn256) {
  const Layout l = HandMade();
  ASSERT_EQ(l.params().size(), 4u);
  // Ids keep registration order; offsets follow (module, registration order).
  EXPECT_EQ(l.param(1).name, "a");
  EXPECT_EQ(l.param(1).elem_off, 0);
  EXPECT_EQ(l.param(1).byte_off, 0);
  EXPECT_EQ(l.param(3).elem_off, 10);
  EXPECT_EQ(l.param(3).byte_off, 256);  // 40 bytes of a, rounded to 256
  EXPECT_EQ(l.param(0).elem_off, 310);
  EXPECT_EQ(l.param(0).byte_off, 4096);  // module 2 starts on a page
  EXPECT_EQ(l.param(2).elem_off, 5310);
  EXPECT_EQ(l.param(2).byte_off, 14336);  // 4096 + 10000 rounded to 256

  ASSERT_EQ(l.num_modules(), 3);
  const ModuleExtent& m0 = l.module(0);
  EXPECT_THAT(m0.params, ElementsAre(1, 3));
  EXPECT_EQ(m0.elem_begin, 0);
  EXPECT_EQ(m0.elem_end, 310);
  EXPECT_EQ(m0.byte_begin, 0);
  EXPECT_EQ(m0.byte_end, 1024);  // 256 + 600 rounded to 256
  EXPECT_TRUE(m0.registered);
  EXPECT_TRUE(m0.persistent);  // 310 < 400 elements
  EXPECT_EQ(m0.last_group, 0);
  const ModuleExtent& m1 = l.module(1);
  EXPECT_THAT(m1.params, IsEmpty());
  EXPECT_FALSE(m1.registered);
  EXPECT_EQ(m1.elems(), 0);
  EXPECT_EQ(m1.bytes(), 0);
  EXPECT_EQ(m1.byte_begin, 4096);
  EXPECT_EQ(m1.last_group, -1);
  const ModuleExtent& m2 = l.module(2);
  EXPECT_THAT(m2.params, ElementsAre(0, 2));
  EXPECT_EQ(m2.elem_begin, 310);
  EXPECT_EQ(m2.elem_end, 5317);
  EXPECT_EQ(m2.byte_begin, 4096);
  EXPECT_EQ(m2.byte_end, 14592);  // 14336 + 28 rounded to 256
  EXPECT_FALSE(m2.persistent);
  EXPECT_EQ(m2.last_group, 5);  // element 5316

  EXPECT_EQ(l.total_elems(), 5317);
  EXPECT_EQ(l.total_param_bytes(), 16384);  // page-rounded
  EXPECT_EQ(l.max_module_bytes(), 10496);
  EXPECT_EQ(l.persistent_param_bytes(), 1024);
  EXPECT_EQ(l.grad_staging_bytes(), 6000);  // 2 x reduce_bucket_size < the module

  // Not offloaded: every module stays on the device.
  const Layout resident = HandMade(false);
  EXPECT_TRUE(resident.module(2).persistent);
  EXPECT_EQ(resident.persistent_param_bytes(), 1024 + 10496);
}

TEST(LayoutTest, SubGroupsCutTheElementSpace) {
  const Layout l = HandMade();
  ASSERT_EQ(l.num_groups(), 6u);
  for (size_t g = 0; g < 5; ++g) {
    EXPECT_EQ(l.group(g).elem_begin, static_cast<int64_t>(1000 * g));
    EXPECT_EQ(l.group(g).elems(), 1000);
  }
  EXPECT_EQ(l.group(5).elem_begin, 5000);
  EXPECT_EQ(l.group(5).elem_end, 5317);
  EXPECT_EQ(l.max_group_elems(), 1000);
  EXPECT_EQ(l.group(5).state_io_bytes(), 4096);   // 12 x 317 = 3804 → a page
  EXPECT_EQ(l.group(0).state_io_bytes(), 12288);  // 12000 → 3 pages

  // sub_group_size < 1 counts as 1.
  LayoutOptions o;
  o.sub_group_size = 0;
  const Layout one = Layout::Build({Rec("x", 3, DType::kFp32, 0)}, o);
  EXPECT_EQ(one.num_groups(), 3u);
  EXPECT_EQ(one.module(0).last_group, 2);
}

TEST(LayoutTest, SlicesSplitParametersAtSubGroups) {
  const Layout l = HandMade();
  // Sub-group 0: all of a and b, the head of c.
  EXPECT_THAT(Of(l.Slices(0, 1000)),
              ElementsAre(S{1, 0, 10, 0}, S{3, 10, 310, 256}, S{0, 310, 1000, 4096}));
  // Inside a, across into b, across into c.
  EXPECT_THAT(Of(l.Slices(5, 12)), ElementsAre(S{1, 5, 10, 20}, S{3, 10, 12, 256}));
  EXPECT_THAT(Of(l.Slices(300, 320)), ElementsAre(S{3, 300, 310, 836}, S{0, 310, 320, 4096}));
  // The last sub-group: the tail of c and all of d.
  EXPECT_THAT(Of(l.Slices(5000, 5317)),
              ElementsAre(S{0, 5000, 5310, 4096 + 2 * 4690}, S{2, 5310, 5317, 14336}));
  EXPECT_THAT(Of(l.Slices(5315, 5317)), ElementsAre(S{2, 5315, 5317, 14336 + 20}));
  // Entirely inside c.
  EXPECT_THAT(Of(l.Slices(1000, 2000)), ElementsAre(S{0, 1000, 2000, 4096 + 2 * 690}));
  EXPECT_THAT(l.Slices(7, 7), IsEmpty());
}

TEST(LayoutTest, ByteSlicesSkipPaddingAndFollowChunks) {
  const Layout l = HandMade();
  // Module 0 whole: the padding after a (40..256) and after b is skipped.
  EXPECT_THAT(Of(l.ByteSlices(0, 0, 1024)), ElementsAre(S{1, 0, 10, 0}, S{3, 10, 310, 256}));
  // Module 2 in chunks of 6000 bytes: the first chunk is 3000 elements of c.
  EXPECT_THAT(Of(l.ByteSlices(2, 4096, 10096)), ElementsAre(S{0, 310, 3310, 4096}));
  // The second: the rest of c, then d after c's padding.
  EXPECT_THAT(Of(l.ByteSlices(2, 10096, 14592)),
              ElementsAre(S{0, 3310, 5310, 10096}, S{2, 5310, 5317, 14336}));
  // A range wholly in padding.
  EXPECT_THAT(l.ByteSlices(2, 14096, 14336), IsEmpty());
  EXPECT_THAT(l.ByteSlices(1, 4096, 4096), IsEmpty());
}

TEST(LayoutTest, ModulesEndingIn) {
  const Layout l = HandMade();
  EXPECT_THAT(l.ModulesEndingIn(0, 1000), ElementsAre(0));
  EXPECT_THAT(l.ModulesEndingIn(0, 310), ElementsAre(0));  // last element 309
  EXPECT_THAT(l.ModulesEndingIn(0, 309), IsEmpty());
  EXPECT_THAT(l.ModulesEndingIn(310, 1000), IsEmpty());  // module 1 has no elements
  EXPECT_THAT(l.ModulesEndingIn(1000, 5000), IsEmpty());
  EXPECT_THAT(l.ModulesEndingIn(5000, 5317), ElementsAre(2));
  EXPECT_THAT(l.ModulesEndingIn(0, 5317), ElementsAre(0, 2));
  // Every module with elements ends in exactly one sub-group: its last_group.
  for (size_t g = 0; g < l.num_groups(); ++g)
    for (int m : l.ModulesEndingIn(l.group(g).elem_begin, l.group(g).elem_end))
      EXPECT_EQ(l.module(m).last_group, static_cast<int>(g));
}

// Invariants on random layouts: sub-group slices and gradient chunks cover
// every element once, each slice starts on an element at its own byte
// offset, and offsets respect the alignments.
TEST(LayoutTest, RandomLayoutsSliceEveryElementOnce) {
  uint64_t seed = 0;
  auto rng = testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  static const DType kTypes[] = {DType::kFp32, DType::kFp16, DType::kBf16};
  for (int trial = 0; trial < 30; ++trial) {
    std::vector<ParamRec> recs;
    const int modules = 1 + static_cast<int>(rng() % 6);
    const int params = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < params; ++i)
      recs.push_back(Rec(std::string("p").append(std::to_string(i)),
                         1 + static_cast<int64_t>(rng() % 3000), kTypes[rng() % 3],
                         static_cast<int>(rng() % modules)));
    LayoutOptions o;
    o.sub_group_size = 1 + static_cast<int64_t>(rng() % 2500);
    o.params_offloaded = true;
    // Odd bucket sizes too: 2 x 2049 = 4098 bytes is not a whole number of
    // fp32 elements.
    o.reduce_bucket_size = 2048 + static_cast<int64_t>(rng() % 3000);
    const Layout l = Layout::Build(recs, o);
    SCOPED_TRACE("trial " + std::to_string(trial) + " sub_group_size " +
                 std::to_string(o.sub_group_size) + " reduce_bucket_size " +
                 std::to_string(o.reduce_bucket_size));

    for (const ParamRec& p : l.params()) {
      EXPECT_EQ(p.byte_off % kTensorAlign, 0);
      EXPECT_EQ(l.module(p.module).byte_begin % kIoAlign, 0);
    }
    auto check = [&](const Layout::Slice& s, std::vector<int64_t>& covered) {
      const ParamRec& p = l.param(s.param);
      ASSERT_LE(p.elem_off, s.elem_begin);
      ASSERT_LT(s.elem_begin, s.elem_end);
      ASSERT_LE(s.elem_end, p.elem_off + p.numel);
      EXPECT_EQ(s.byte_offset, p.byte_off + (s.elem_begin - p.elem_off) * p.elem_size());
      for (int64_t e = s.elem_begin; e < s.elem_end; ++e) ++covered[static_cast<size_t>(e)];
    };
    std::vector<int64_t> by_group(static_cast<size_t>(l.total_elems()), 0);
    for (size_t g = 0; g < l.num_groups(); ++g)
      for (const Layout::Slice& s : l.Slices(l.group(g).elem_begin, l.group(g).elem_end))
        check(s, by_group);
    EXPECT_EQ(std::count(by_group.begin(), by_group.end(), 1), l.total_elems());

    // Gradient chunks as the offloader cuts them.
    EXPECT_EQ(l.grad_staging_bytes() % 4, 0) << l.grad_staging_bytes();
    std::vector<int64_t> by_chunk(static_cast<size_t>(l.total_elems()), 0);
    for (int m = 0; m < l.num_modules(); ++m) {
      const ModuleExtent& me = l.module(m);
      for (int64_t b = me.byte_begin; b < me.byte_end; b += l.grad_staging_bytes())
        for (const Layout::Slice& s :
             l.ByteSlices(m, b, std::min(me.byte_end, b + l.grad_staging_bytes())))
          check(s, by_chunk);
    }
    EXPECT_EQ(std::count(by_chunk.begin(), by_chunk.end(), 1), l.total_elems());
  }
}

}  // namespace
}  // namespace strata::scheduler
