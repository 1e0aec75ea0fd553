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

#include "src/gpu/device.h"
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
  EXPECT_EQ(l.param(3).elem_off, 12);   // a's 10 elements, padded to 4 (16 bytes of fp32)
  EXPECT_EQ(l.param(3).byte_off, 256);  // 40 bytes of a, rounded to 256
  EXPECT_EQ(l.param(0).elem_off, 312);
  EXPECT_EQ(l.param(0).byte_off, 4096);  // module 2 starts on a page
  EXPECT_EQ(l.param(2).elem_off, 5312);
  EXPECT_EQ(l.param(2).byte_off, 14336);  // 4096 + 10000 rounded to 256

  ASSERT_EQ(l.num_modules(), 3);
  const ModuleExtent& m0 = l.module(0);
  EXPECT_THAT(m0.params, ElementsAre(1, 3));
  EXPECT_EQ(m0.elem_begin, 0);
  EXPECT_EQ(m0.elem_end, 312);
  EXPECT_EQ(m0.byte_begin, 0);
  EXPECT_EQ(m0.byte_end, 1024);  // 256 + 600 rounded to 256
  EXPECT_TRUE(m0.registered);
  EXPECT_TRUE(m0.persistent);  // 312 < 400 elements
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
  EXPECT_EQ(m2.elem_begin, 312);
  EXPECT_EQ(m2.elem_end, 5319);
  EXPECT_EQ(m2.byte_begin, 4096);
  EXPECT_EQ(m2.byte_end, 14592);  // 14336 + 28 rounded to 256
  EXPECT_FALSE(m2.persistent);
  EXPECT_EQ(m2.last_group, 5);  // element 5318

  EXPECT_EQ(l.total_elems(), 5319);  // with a's 2 elements of padding
  EXPECT_EQ(l.param_elems(), 5317);
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
  EXPECT_EQ(l.group(5).elem_end, 5319);
  EXPECT_EQ(l.max_group_elems(), 1000);
  EXPECT_EQ(l.group(5).state_io_bytes(), 4096);   // 12 x 319 = 3828 → a page
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
              ElementsAre(S{1, 0, 10, 0}, S{3, 12, 312, 256}, S{0, 312, 1000, 4096}));
  // Inside a, over a's padding (10, 11), into b.
  EXPECT_THAT(Of(l.Slices(5, 14)), ElementsAre(S{1, 5, 10, 20}, S{3, 12, 14, 256}));
  EXPECT_THAT(l.Slices(10, 12), IsEmpty());  // padding only
  EXPECT_THAT(Of(l.Slices(300, 320)), ElementsAre(S{3, 300, 312, 832}, S{0, 312, 320, 4096}));
  // The last sub-group: the tail of c and all of d.
  EXPECT_THAT(Of(l.Slices(5000, 5319)),
              ElementsAre(S{0, 5000, 5312, 4096 + 2 * 4688}, S{2, 5312, 5319, 14336}));
  EXPECT_THAT(Of(l.Slices(5315, 5319)), ElementsAre(S{2, 5315, 5319, 14336 + 12}));
  // Entirely inside c.
  EXPECT_THAT(Of(l.Slices(1000, 2000)), ElementsAre(S{0, 1000, 2000, 4096 + 2 * 688}));
  EXPECT_THAT(l.Slices(7, 7), IsEmpty());
}

TEST(LayoutTest, ByteSlicesSkipPaddingAndFollowChunks) {
  const Layout l = HandMade();
  // Module 0 whole: the padding after a (40..256) and after b is skipped.
  EXPECT_THAT(Of(l.ByteSlices(0, 0, 1024)), ElementsAre(S{1, 0, 10, 0}, S{3, 12, 312, 256}));
  // Module 2 in chunks of 6000 bytes: the first chunk is 3000 elements of c.
  EXPECT_THAT(Of(l.ByteSlices(2, 4096, 10096)), ElementsAre(S{0, 312, 3312, 4096}));
  // The second: the rest of c, then d after c's padding.
  EXPECT_THAT(Of(l.ByteSlices(2, 10096, 14592)),
              ElementsAre(S{0, 3312, 5312, 10096}, S{2, 5312, 5319, 14336}));
  // A range wholly in padding.
  EXPECT_THAT(l.ByteSlices(2, 14096, 14336), IsEmpty());
  EXPECT_THAT(l.ByteSlices(1, 4096, 4096), IsEmpty());
}

TEST(LayoutTest, ModulesEndingIn) {
  const Layout l = HandMade();
  EXPECT_THAT(l.ModulesEndingIn(0, 1000), ElementsAre(0));
  EXPECT_THAT(l.ModulesEndingIn(0, 312), ElementsAre(0));  // last element 311
  EXPECT_THAT(l.ModulesEndingIn(0, 311), IsEmpty());
  EXPECT_THAT(l.ModulesEndingIn(312, 1000), IsEmpty());  // module 1 has no elements
  EXPECT_THAT(l.ModulesEndingIn(1000, 5000), IsEmpty());
  EXPECT_THAT(l.ModulesEndingIn(5000, 5319), ElementsAre(2));
  EXPECT_THAT(l.ModulesEndingIn(0, 5319), ElementsAre(0, 2));
  // Every module with elements ends in exactly one sub-group: its last_group.
  for (size_t g = 0; g < l.num_groups(); ++g)
    for (int m : l.ModulesEndingIn(l.group(g).elem_begin, l.group(g).elem_end))
      EXPECT_EQ(l.module(m).last_group, static_cast<int>(g));
}

// Odd-sized tensors keep every tensor on the device Adam's 16-byte vector
// path: the shards DeviceOptimizer builds (fp32 master, accumulator and
// moments at elem_off, the copy-out at byte_off, arrays from the arena) are
// all 16-byte aligned. Counted by the device: on the host device by the CUDA
// rule, on a GPU by the launcher's decision. The same tensors laid out
// densely fall to the scalar path (the count can fail), the two layouts'
// results are bitwise equal (on a GPU: vector path against scalar path), and
// the padding stays zero.
TEST(LayoutTest, OddSizedTensorsKeepTheDeviceAdamOnItsVectorPath) {
  const std::vector<ParamRec> recs = {
      Rec("a", 7, DType::kBf16, 0),    Rec("b", 13, DType::kFp32, 0), Rec("c", 1, DType::kFp16, 1),
      Rec("d", 4099, DType::kBf16, 1), Rec("e", 30, DType::kBf16, 2), Rec("f", 5, DType::kFp32, 2)};
  const Layout l = Layout::Build(recs, LayoutOptions{});
  ASSERT_GT(l.total_elems(), l.param_elems());  // there is padding
  for (const char* kind : {"host", "cuda"}) {
    SCOPED_TRACE(kind);
    gpu::DeviceOptions o;
    o.kind = std::string(kind) == "host" ? DeviceKind::kHost : DeviceKind::kCuda;
    o.hbm_budget_bytes = 16 << 20;
    auto made = gpu::CreateDevice(o);
    if (!made.ok() && o.kind == DeviceKind::kCuda &&
        (made.status().code() == StatusCode::kUnavailable ||
         made.status().code() == StatusCode::kNotSupported)) {
      std::printf("[ skipped  ] the CUDA half: %s\n", made.status().ToString().c_str());
      continue;
    }
    ASSERT_TRUE(made.ok()) << made.status();
    gpu::Device& d = **made;
    auto rng = testing::MakeRng();
    const size_t n = static_cast<size_t>(l.total_elems());
    // Values at the aligned offsets, padding zero; the dense copy holds the
    // same tensors back to back.
    std::vector<float> master(n, 0.f), grad(n, 0.f), m(n, 0.f), v(n, 0.f);
    std::vector<int64_t> dense_off;
    int64_t dense = 0;
    for (const ParamRec& p : l.params()) {
      const auto at = static_cast<size_t>(p.elem_off);
      const std::vector<float> x = testing::RandomFloats(rng, static_cast<size_t>(p.numel), -1, 1);
      const std::vector<float> g = testing::RandomFloats(rng, static_cast<size_t>(p.numel), -1, 1);
      const std::vector<float> a = testing::RandomFloats(rng, static_cast<size_t>(p.numel), -1, 1);
      const std::vector<float> b = testing::RandomFloats(rng, static_cast<size_t>(p.numel), 0, 1);
      std::copy(x.begin(), x.end(), master.begin() + static_cast<ptrdiff_t>(at));
      std::copy(g.begin(), g.end(), grad.begin() + static_cast<ptrdiff_t>(at));
      std::copy(a.begin(), a.end(), m.begin() + static_cast<ptrdiff_t>(at));
      std::copy(b.begin(), b.end(), v.begin() + static_cast<ptrdiff_t>(at));
      dense_off.push_back(dense);
      dense += p.numel;
    }
    auto to_dense = [&](const std::vector<float>& src) {
      std::vector<float> out(n, 0.f);
      for (size_t i = 0; i < l.params().size(); ++i) {
        const ParamRec& p = l.params()[i];
        std::copy_n(src.begin() + p.elem_off, p.numel,
                    out.begin() + static_cast<ptrdiff_t>(dense_off[i]));
      }
      return out;
    };
    struct Run {
      std::vector<float> master, m, v;
      std::vector<uint8_t> copy;
      gpu::AdamPathCounts paths;
    };
    auto run = [&](bool aligned) -> Run {
      std::vector<gpu::DeviceBuffer> bufs;
      std::vector<float*> arr;
      for (const std::vector<float>* h : {&master, &grad, &m, &v}) {
        const std::vector<float> src = aligned ? *h : to_dense(*h);
        bufs.push_back(d.Allocate(n * 4).value());
        EXPECT_TRUE(d.CopyH2D(bufs.back().data(), src.data(), n * 4, d.compute()).ok());
        arr.push_back(bufs.back().as<float>());
      }
      gpu::DeviceBuffer params = d.Allocate(static_cast<size_t>(l.total_param_bytes())).value();
      std::vector<gpu::AdamShard> shards;
      for (size_t i = 0; i < l.params().size(); ++i) {
        const ParamRec& p = l.params()[i];
        const int64_t off = aligned ? p.elem_off : dense_off[i];
        gpu::AdamShard sh;
        sh.param = arr[0] + off;
        sh.grad = arr[1] + off;
        sh.exp_avg = arr[2] + off;
        sh.exp_avg_sq = arr[3] + off;
        sh.copy_out = params.as<uint8_t>() + p.byte_off;
        sh.copy_dtype = p.dtype;
        sh.count = static_cast<size_t>(p.numel);
        shards.push_back(sh);
      }
      gpu::AdamHyperParams hp;
      hp.lr = 1e-2;
      hp.weight_decay = 0.1;
      hp.step = 3;
      const gpu::AdamPathCounts before = d.adam_path_counts();
      EXPECT_TRUE(d.AdamStep(shards, hp, nullptr, d.compute()).ok());
      const gpu::AdamPathCounts after = d.adam_path_counts();
      Run r;
      r.paths = {after.vector_shards - before.vector_shards,
                 after.scalar_shards - before.scalar_shards};
      std::vector<float>* outs[] = {&r.master, nullptr, &r.m, &r.v};
      for (int a : {0, 2, 3}) {
        std::vector<float> dense_or_not(n);
        EXPECT_TRUE(
            d.CopyD2H(dense_or_not.data(), arr[static_cast<size_t>(a)], n * 4, d.compute()).ok());
        *outs[a] = std::move(dense_or_not);
      }
      r.copy.resize(static_cast<size_t>(l.total_param_bytes()));
      EXPECT_TRUE(d.CopyD2H(r.copy.data(), params.data(), r.copy.size(), d.compute()).ok());
      EXPECT_TRUE(d.compute().Synchronize().ok());
      if (!aligned) {  // back to the aligned positions, for comparison
        for (std::vector<float>* x : {&r.master, &r.m, &r.v}) {
          std::vector<float> back(n, 0.f);
          for (size_t i = 0; i < l.params().size(); ++i)
            std::copy_n(x->begin() + dense_off[i], l.params()[i].numel,
                        back.begin() + l.params()[i].elem_off);
          *x = std::move(back);
        }
      }
      return r;
    };
    const Run fast = run(true), slow = run(false);
    EXPECT_EQ(fast.paths.vector_shards, l.params().size());
    EXPECT_EQ(fast.paths.scalar_shards, 0u);
    EXPECT_GT(slow.paths.scalar_shards, 0u);  // dense offsets: the scalar path
    EXPECT_EQ(fast.master, slow.master);
    EXPECT_EQ(fast.m, slow.m);
    EXPECT_EQ(fast.v, slow.v);
    EXPECT_EQ(fast.copy, slow.copy);
    EXPECT_NE(fast.master, master);  // the step did something
    // The padding: zero before, zero after.
    std::vector<bool> is_param(n, false);
    for (const ParamRec& p : l.params())
      for (int64_t e = p.elem_off; e < p.elem_off + p.numel; ++e)
        is_param[static_cast<size_t>(e)] = true;
    for (size_t e = 0; e < n; ++e)
      if (!is_param[e]) {
        ASSERT_EQ(fast.master[e], 0.f) << e;
        ASSERT_EQ(fast.m[e], 0.f) << e;
        ASSERT_EQ(fast.v[e], 0.f) << e;
      }
  }
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

    int64_t numel = 0;
    for (const ParamRec& p : l.params()) {
      numel += p.numel;
      EXPECT_EQ(p.elem_off % kElemAlign, 0) << p.name;  // 16-byte aligned fp32 states
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
    // Every parameter element exactly once, no padding element ever.
    EXPECT_EQ(l.param_elems(), numel);
    EXPECT_LT(l.total_elems() - numel, kElemAlign * static_cast<int64_t>(l.params().size()) + 1);
    EXPECT_EQ(std::count(by_group.begin(), by_group.end(), 1), numel);
    EXPECT_EQ(std::count(by_group.begin(), by_group.end(), 0), l.total_elems() - numel);

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
    EXPECT_EQ(std::count(by_chunk.begin(), by_chunk.end(), 1), numel);
    EXPECT_EQ(by_chunk, by_group);  // the same elements: the parameters
  }
}

}  // namespace
}  // namespace strata::scheduler
