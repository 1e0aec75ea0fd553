// The tier plan on hand-made inputs: what each tier holds for a placement,
// when it fits, the exact over-budget table, the NVMe tier and its headroom,
// pin_memory and delayed_param_update, and the NVMe directories of a config.
#include "src/scheduler/plan.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "src/common/units.h"
#include "src/scheduler/hyperparams.h"
#include "src/scheduler/layout.h"

namespace strata::scheduler {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// Sizes of a tiny model: 1001 elements, 8 KiB of parameters in 2 modules,
// 2 sub-groups.
LayoutSizes TinySizes() {
  LayoutSizes s;
  s.total_elems = 1001;
  s.total_param_bytes = 8192;
  s.persistent_param_bytes = 512;
  s.max_module_bytes = 4096;
  s.max_group_elems = 1000;
  s.grad_staging_bytes = 4096;
  s.num_groups = 2;
  s.num_modules = 2;
  return s;
}

Placement Place(OffloadDevice opt, OffloadDevice par) {
  Placement p;
  p.optimizer = opt;
  p.params = par;
  p.stage = 3;
  p.sub_group_size = 1000;
  return p;
}

const TierBudget* Find(const TierPlan& plan, const std::string& tier) {
  for (const TierBudget& t : plan.budgets)
    if (t.tier == tier) return &t;
  return nullptr;
}

std::vector<std::string> Tiers(const TierPlan& plan) {
  std::vector<std::string> out;
  for (const TierBudget& t : plan.budgets) out.push_back(t.tier);
  return out;
}

int64_t Needed(const TierPlan& plan, const std::string& tier) {
  const TierBudget* t = Find(plan, tier);
  EXPECT_NE(t, nullptr) << tier;
  return t ? t->needed_bytes : -1;
}

TEST(PlanTest, EverythingInHbmFitsAndAddsUp) {
  const LayoutSizes s = TinySizes();
  Placement pl = Place(OffloadDevice::kNone, OffloadDevice::kNone);
  pl.overlap_optimizer = false;
  TierFacts f;
  f.hbm_budget = 1 << 20;
  f.pinned_budget = 1 << 20;
  f.dram_available = 1 << 20;
  const TierPlan plan = ComputeTierPlan(pl, s, f);
  EXPECT_TRUE(plan.fits);
  EXPECT_THAT(Tiers(plan), ElementsAre("hbm", "pinned", "dram"));
  EXPECT_EQ(plan.nvme_bytes(), 0);
  // parameters + 2 gradient buffers + 12 B/element of states.
  EXPECT_EQ(Needed(plan, "hbm"), 8192 + 2 * 4096 + 12 * 1001);
  // Staging + the updated parameters (they cross PCIe every step and fit the
  // pinned budget; no mirror without overlap_optimizer).
  EXPECT_TRUE(plan.pin_param_copies);
  EXPECT_EQ(Needed(plan, "pinned"), 4 * 4096 + 8192);
  EXPECT_EQ(Needed(plan, "dram"), 4 * 1001);
  EXPECT_THAT(Find(plan, "hbm")->detail, HasSubstr("optimizer states"));
  EXPECT_EQ(Find(plan, "hbm")->available_bytes, 1 << 20);

  // States updated in place (here in HBM): the overlapping optimizer
  // uploads modules as it finishes them and keeps no mirror (a step that
  // finished a module is committed).
  pl.overlap_optimizer = true;
  EXPECT_FALSE(pl.param_mirror());
  EXPECT_EQ(Needed(ComputeTierPlan(pl, s, f), "pinned"), 4 * 4096 + 8192);
  // States on NVMe have two versions and a failed step is rolled back: a
  // mirror of the device parameters undoes the modules it uploaded.
  pl.optimizer = OffloadDevice::kNvme;
  EXPECT_TRUE(pl.param_mirror());
  const TierPlan mirrored = ComputeTierPlan(pl, s, f);
  // It swaps with the updated parameters, so both are pinned.
  EXPECT_TRUE(mirrored.pin_param_copies);
  EXPECT_THAT(Find(mirrored, "pinned")->detail, HasSubstr("parameter copies 2 x 8.00 KiB"));
  // Without room in the pinned budget they are pageable DRAM.
  f.pinned_budget = Needed(mirrored, "pinned") - 1;
  const TierPlan tight = ComputeTierPlan(pl, s, f);
  EXPECT_FALSE(tight.pin_param_copies);
  EXPECT_THAT(Find(tight, "dram")->detail, HasSubstr("parameter mirror"));
  EXPECT_THAT(Find(tight, "dram")->detail, HasSubstr("updated parameters"));
}

TEST(PlanTest, OffloadedParametersUseTheLiveWorkingSet) {
  LayoutSizes s = TinySizes();
  Placement pl = Place(OffloadDevice::kCpu, OffloadDevice::kCpu);
  pl.max_live_parameters = 100;  // 800 B < 2 modules: the working set is 2 modules
  const TierPlan plan = ComputeTierPlan(pl, s, {});
  // persistent + min(offloaded 7680, max(800, 8192)) in whole 4096 B slots
  // (2) + 2 gradient slots.
  EXPECT_EQ(Needed(plan, "hbm"), 512 + 2 * 4096 + 2 * 4096);
  EXPECT_EQ(plan.device_slots, 4);
  EXPECT_EQ(plan.slot_bytes, 4096);
  pl.max_live_parameters = 500;  // 4000 B: still below 2 modules (8192 B)
  EXPECT_EQ(Needed(ComputeTierPlan(pl, s, {}), "hbm"), 512 + 2 * 4096 + 2 * 4096);
  s.max_module_bytes = 1024;  // now the live limit (500 x 8 B) decides: 4 slots of 1 KiB
  const TierPlan small = ComputeTierPlan(pl, s, {});
  EXPECT_EQ(Needed(small, "hbm"), 512 + 4 * 1024 + 2 * 1024);
  EXPECT_EQ(small.device_slots, 6);
  EXPECT_THAT(Find(small, "hbm")->detail, HasSubstr("parameter slots 4 x 1.00 KiB"));
  // offload_param cpu: the host copy and the updated parameters are pinned
  // (the pinned budget is unknown: no limit); DRAM keeps the rest.
  EXPECT_EQ(Needed(plan, "dram"), 4 * 1001 + 12 * 1001);
  EXPECT_EQ(Needed(plan, "pinned"), 4 * 4096 + 2 * 8192);
  // Unknown budgets (0) never fail a plan.
  EXPECT_TRUE(plan.fits);
}

// Each tier over its budget by one byte fails the plan; at the budget it fits.
TEST(PlanTest, EachTierOverBudgetFailsAtTheBoundary) {
  const LayoutSizes s = TinySizes();
  Placement pl = Place(OffloadDevice::kNvme, OffloadDevice::kNvme);
  pl.pin_param_copies = true;  // pinned on request: they must fit (optional pinning never fails)
  TierFacts f;
  f.nvme_paths = {"/nv0"};
  const TierPlan unlimited = ComputeTierPlan(pl, s, f);
  ASSERT_TRUE(unlimited.fits);
  ASSERT_THAT(Tiers(unlimited), ElementsAre("hbm", "pinned", "nvme", "dram"));
  for (const std::string tier : {"hbm", "pinned", "nvme", "dram"}) {
    SCOPED_TRACE(tier);
    const int64_t need = Needed(unlimited, tier);
    ASSERT_GT(need, 0);
    for (const int64_t avail : {need, need - 1}) {
      TierFacts g = f;
      // Every other tier has room to spare.
      g.hbm_budget = g.pinned_budget = g.dram_available = g.nvme_available = int64_t{1} << 40;
      if (tier == "hbm") g.hbm_budget = avail;
      if (tier == "pinned") g.pinned_budget = avail;
      if (tier == "nvme") g.nvme_available = avail;
      if (tier == "dram") g.dram_available = avail;
      const TierPlan plan = ComputeTierPlan(pl, s, g);
      EXPECT_EQ(plan.fits, avail == need) << avail;
      const std::string table = OverBudgetTable(plan, pl, s);
      // "<-- over" on the tier's row only, and only when it is over.
      for (const std::string& row :
           {std::string("hbm"), std::string("pinned"), std::string("nvme"), std::string("dram")}) {
        const size_t at = table.find("\n  " + row + " ");
        ASSERT_NE(at, std::string::npos) << row;
        const std::string line = table.substr(at + 1, table.find('\n', at + 1) - at - 1);
        if (row == tier && avail < need) {
          EXPECT_THAT(line, HasSubstr("<-- over"));
        } else {
          EXPECT_THAT(line, Not(HasSubstr("<-- over")));
        }
      }
    }
  }
}

TEST(PlanTest, OverBudgetTableExactText) {
  const LayoutSizes s = TinySizes();
  Placement pl = Place(OffloadDevice::kCpu, OffloadDevice::kNvme);
  pl.max_live_parameters = 100;
  TierFacts f;
  f.hbm_budget = 8 << 20;
  f.pinned_budget = 60000;
  f.dram_available = 15000;
  f.nvme_paths = {"/nv0"};
  f.nvme_available = int64_t{1} << 30;
  const TierPlan plan = ComputeTierPlan(pl, s, f);
  EXPECT_FALSE(plan.fits);
  // By hand:
  //   hbm    512 + 2 slots for min(8192 - 512, max(100 x 8, 2 x 4096)) + 2 x 4096 = 16896
  //   pinned 4 x 4096 staging + 5 x 4096 fetch + 4 x 4096 write-back = 53248
  //   nvme   2 x 8192 = 16384 (one path: no striping headroom; the modules
  //          are page-aligned already)
  //   dram   4 x 1001 + 12 x 1001 = 16016 (15.640625 KiB) > 15000 (14.6484375 KiB)
  const std::string expected =
      "the placement does not fit:\n"
      "  tier          needed    available  made of\n"
      "  hbm        16.50 KiB     8.00 MiB  persistent parameters 512 B + parameter slots 2 x "
      "4.00 KiB + gradient slots 2 x 4.00 KiB\n"
      "  pinned     52.00 KiB    58.59 KiB  gradient staging 16.00 KiB + parameter fetch 5 x "
      "4.00 KiB + parameter write-back 4 x 4.00 KiB\n"
      "  nvme       16.00 KiB     1.00 GiB  parameters 2 x 8.00 KiB on /nv0\n"
      "  dram       15.64 KiB    14.65 KiB  gradient accumulator 3.91 KiB + optimizer states "
      "11.73 KiB + last micro-batch accumulated (rates not measured)  <-- over\n"
      "  (stage 3, offload_optimizer cpu, offload_param nvme, 1001 parameters in 2 modules, "
      "sub_group_size 1000)";
  EXPECT_EQ(OverBudgetTable(plan, pl, s), expected);
  EXPECT_EQ(plan.nvme_bytes(), 16384);
}

TEST(PlanTest, NvmeTierOnlyWithPathsAndHeadroomPerShardPerPath) {
  const LayoutSizes s = TinySizes();
  const Placement pl = Place(OffloadDevice::kNvme, OffloadDevice::kNvme);
  // No directories: no NVMe row (and no capacity to open).
  const TierPlan none = ComputeTierPlan(pl, s, {});
  EXPECT_THAT(Tiers(none), ElementsAre("hbm", "pinned", "dram"));
  EXPECT_EQ(none.nvme_bytes(), 0);

  // Two versions of the states, each sub-group's shard rounded up to whole
  // pages (a page at most); over several paths, per path each shard's bytes
  // up to a 1 MiB stripe (the states' shards: the largest sub-group's 12000
  // bytes and its page; the modules': 4096 bytes).
  const int64_t states = 12 * 1001, params = 8192;
  const int64_t pages = 2 * 2;  // 2 versions x 2 sub-groups
  for (const std::vector<std::string>& paths :
       {std::vector<std::string>{"/a"}, std::vector<std::string>{"/a", "/b", "/c"}}) {
    TierFacts f;
    f.nvme_paths = paths;
    const TierPlan plan = ComputeTierPlan(pl, s, f);
    const int64_t p = static_cast<int64_t>(paths.size());
    const int64_t headroom = p == 1 ? 0 : p * (2 * 2 * (12000 + 4096) + 2 * 2 * 4096);
    EXPECT_EQ(plan.nvme_bytes(), 2 * states + 2 * params + pages * 4096 + headroom);
    EXPECT_EQ(Needed(plan, "nvme"), plan.nvme_bytes());
    EXPECT_THAT(Find(plan, "nvme")->detail, HasSubstr("page rounding 16.00 KiB (4 shards"));
    if (p > 1) {
      EXPECT_THAT(Find(plan, "nvme")->detail,
                  HasSubstr("striping headroom " + FormatBytes(headroom)));
    }
    EXPECT_THAT(Find(plan, "nvme")->detail,
                HasSubstr(paths.size() == 1 ? " on /a" : " on /a, /b, /c"));
  }
  // Only the optimizer on NVMe: its two versions, no parameters.
  TierFacts f;
  f.nvme_paths = {"/a"};
  const TierPlan opt_only = ComputeTierPlan(Place(OffloadDevice::kNvme, OffloadDevice::kCpu), s, f);
  EXPECT_EQ(opt_only.nvme_bytes(), 2 * states + pages * 4096);
  EXPECT_THAT(Find(opt_only, "nvme")->detail, Not(HasSubstr("parameters")));
  // The optimizer pipeline's pinned buffers: buffer_count x one sub-group's states.
  Placement ring = Place(OffloadDevice::kNvme, OffloadDevice::kCpu);
  ring.optimizer_buffer_count = 3;
  // (+ the parameter copies, pinned: no pinned budget given.)
  EXPECT_EQ(Needed(ComputeTierPlan(ring, s, f), "pinned"),
            4 * 4096 + 3 * IoBytes(12 * 1000) + 2 * 8192);
}

// A pinned budget that does not hold buffer_count buffers of the largest
// sub-group beside the fixed pools streams the sub-groups in pieces: the
// largest multiple of kStatePieceQuantum whose buffers fit, each piece
// page-rounded on NVMe; below one quantum the row is over and says so.
TEST(PlanTest, PinnedBudgetCutsTheSubGroupsIntoPieces) {
  LayoutSizes s = TinySizes();
  s.total_elems = 10'000'000;
  s.max_group_elems = 1'000'000;
  s.num_groups = 10;
  s.max_module_bytes = 1 << 20;
  s.total_param_bytes = 20 << 20;
  s.num_modules = 20;
  Placement pl = Place(OffloadDevice::kNvme, OffloadDevice::kNvme);
  pl.optimizer_buffer_count = 4;
  pl.param_buffer_count = 5;
  TierFacts f;
  f.nvme_paths = {"/a"};
  // The fixed pools: staging 4 x 4 KiB, fetch 5 + write-back 4 module buffers.
  const int64_t fixed = 4 * 4096 + 9 * (int64_t{1} << 20);
  const int64_t whole = OptimizerBufferBytes(1'000'000, false);
  f.pinned_budget = fixed + 4 * whole;  // exactly holds whole sub-groups
  TierPlan plan = ComputeTierPlan(pl, s, f);
  EXPECT_TRUE(plan.fits);
  EXPECT_EQ(plan.state_piece_elems, 0);
  EXPECT_EQ(plan.optimizer_buffer_bytes, whole);
  const int64_t nvme_whole = plan.nvme_bytes();

  f.pinned_budget = fixed + 4 * whole - 1;  // one byte short: pieces
  plan = ComputeTierPlan(pl, s, f);
  EXPECT_TRUE(plan.fits);
  EXPECT_EQ(plan.state_piece_elems, 983'040);  // 15 quanta of 65536
  EXPECT_EQ(plan.optimizer_buffer_bytes, OptimizerBufferBytes(983'040, false));
  EXPECT_THAT(Find(plan, "pinned")->detail,
              HasSubstr("sub-groups of 1000000 elements in pieces of 983040"));
  // Each shard's two pieces are page-rounded: a page more per shard.
  EXPECT_EQ(plan.nvme_bytes(), nvme_whole + 2 * 10 * kIoAlign);

  f.pinned_budget = fixed + 4 * OptimizerBufferBytes(200'000, false);
  plan = ComputeTierPlan(pl, s, f);
  EXPECT_TRUE(plan.fits);
  EXPECT_EQ(plan.state_piece_elems, 196'608);
  EXPECT_LE(Needed(plan, "pinned"), f.pinned_budget);

  // With the gradient sums on NVMe each buffer carries them too (16 B/element).
  pl.grad_tier = GradTier::kNvme;
  plan = ComputeTierPlan(pl, s, f);
  EXPECT_EQ(plan.state_piece_elems, 131'072);
  EXPECT_EQ(plan.optimizer_buffer_bytes, OptimizerBufferBytes(131'072, true));
  EXPECT_LE(Needed(plan, "pinned"), f.pinned_budget);
  pl.grad_tier = GradTier::kDram;

  // Compact formats fit larger pieces in the same budget.
  pl.optimizer_states = OptimizerStates::kInt8;
  plan = ComputeTierPlan(pl, s, f);
  EXPECT_GT(plan.state_piece_elems, 196'608);
  EXPECT_EQ(plan.state_piece_elems % kStatePieceQuantum, 0);
  pl.optimizer_states = OptimizerStates::kFp32;

  // Less than four buffers of one quantum: over, and the row names the
  // smallest pipeline.
  f.pinned_budget = fixed + 4 * OptimizerBufferBytes(kStatePieceQuantum, false) - 1;
  plan = ComputeTierPlan(pl, s, f);
  EXPECT_FALSE(plan.fits);
  EXPECT_EQ(plan.state_piece_elems, kStatePieceQuantum);
  EXPECT_THAT(Find(plan, "pinned")->detail, HasSubstr("in pieces of 65536: the smallest pipeline"));
  const std::string table = OverBudgetTable(plan, pl, s);
  EXPECT_THAT(table, HasSubstr("the smallest pipeline"));
  EXPECT_THAT(table, HasSubstr("<-- over"));

  // No pinned budget (0: no limit): whole sub-groups.
  f.pinned_budget = 0;
  EXPECT_EQ(ComputeTierPlan(pl, s, f).state_piece_elems, 0);
}

// The compact state formats: every row that holds the optimizer states
// (DRAM, pinned with pin_memory, NVMe's two versions), the pipeline buffers
// and the step's NVMe bytes count the format's, labelled with it.
TEST(PlanTest, CompactStateFormatsShrinkEveryRowThatHoldsTheStates) {
  const LayoutSizes s = TinySizes();
  TierFacts f;
  f.nvme_paths = {"/a"};
  StepRates r;
  r.nvme_read_gbps = r.nvme_write_gbps = 1e-6;
  for (OptimizerStates states : {OptimizerStates::kFp32, OptimizerStates::kBf16,
                                 OptimizerStates::kBf16Master, OptimizerStates::kInt8}) {
    const cpu_adam::StateFormat fmt = states;
    SCOPED_TRACE(std::string(OptimizerStatesName(states)));
    // 1001 elements: 12 / 8 / 6 bytes each; int8 6 and a scale per moment
    // for each of its 4 blocks.
    const int64_t bytes = StateArrayBytes(fmt, 1001);
    EXPECT_EQ(bytes, states == OptimizerStates::kFp32   ? 12 * 1001
                     : states == OptimizerStates::kBf16 ? 8 * 1001
                     : states == OptimizerStates::kInt8 ? 6 * 1001 + 2 * 4 * 4
                                                        : 6 * 1001);
    Placement cpu = Place(OffloadDevice::kCpu, OffloadDevice::kCpu);
    cpu.optimizer_states = states;
    Placement fp32 = cpu;
    fp32.optimizer_states = OptimizerStates::kFp32;
    EXPECT_EQ(Needed(ComputeTierPlan(cpu, s, {}), "dram"),
              Needed(ComputeTierPlan(fp32, s, {}), "dram") - 12 * 1001 + bytes);
    const std::string label =
        states == OptimizerStates::kFp32 ? "" : fmt::format(" ({})", OptimizerStatesName(states));
    EXPECT_THAT(Find(ComputeTierPlan(cpu, s, {}), "dram")->detail,
                HasSubstr("optimizer states " + FormatBytes(bytes) + label));
    Placement nv = Place(OffloadDevice::kNvme, OffloadDevice::kCpu);
    nv.optimizer_states = states;
    nv.optimizer_buffer_count = 3;
    const TierPlan plan = ComputeTierPlan(nv, s, f);
    EXPECT_EQ(plan.nvme_bytes(), 2 * bytes + 2 * 2 * kIoAlign);
    EXPECT_EQ(plan.optimizer_buffer_bytes, IoBytes(StateArrayBytes(fmt, 1000)));
    EXPECT_EQ(Needed(plan, "pinned"),
              4 * 4096 + 3 * IoBytes(StateArrayBytes(fmt, 1000)) + 2 * 8192);
    const StepPrediction p = PredictStep(nv, s, plan, r);
    for (const auto& t : p.terms) {
      if (t.resource == "nvme_read" || t.resource == "nvme_write") {
        EXPECT_EQ(t.amount, static_cast<double>(bytes)) << t.resource;
      }
    }
  }
}

TEST(PlanTest, PinMemoryMovesOptimizerStatesFromDramToPinned) {
  const LayoutSizes s = TinySizes();
  Placement pl = Place(OffloadDevice::kCpu, OffloadDevice::kCpu);
  const TierPlan pageable = ComputeTierPlan(pl, s, {});
  pl.pin_optimizer_states = true;
  const TierPlan pinned = ComputeTierPlan(pl, s, {});
  const int64_t states = 12 * 1001;
  EXPECT_EQ(Needed(pinned, "pinned"), Needed(pageable, "pinned") + states);
  EXPECT_EQ(Needed(pinned, "dram"), Needed(pageable, "dram") - states);
  EXPECT_THAT(Find(pinned, "pinned")->detail, HasSubstr("optimizer states"));
  EXPECT_THAT(Find(pinned, "dram")->detail, Not(HasSubstr("optimizer states")));
  EXPECT_THAT(Find(pageable, "pinned")->detail, Not(HasSubstr("optimizer states")));
  // States on NVMe are not pinned whole, pin_memory or not.
  Placement nv = Place(OffloadDevice::kNvme, OffloadDevice::kCpu);
  const int64_t nv_pinned = Needed(ComputeTierPlan(nv, s, {}), "pinned");
  nv.pin_optimizer_states = true;
  EXPECT_EQ(Needed(ComputeTierPlan(nv, s, {}), "pinned"), nv_pinned);
}

// Pinned placement: what crosses PCIe every step is pinned within the
// budget, never beyond it unless pin_memory asks; nothing else is pinned.
// Stage 3 with several ranks and offload_param none: HBM holds this rank's
// part of the parameters instead of all of them, the modules come into
// slots as offloaded ones do (the live working set), and buffer_count - 1
// device buffers receive the modules gathered ahead; nothing is gathered
// into pinned memory, and the host arrays (the updated parameters and the
// mirror) hold the part.
TEST(PlanTest, PartitionedParametersInHbmHoldThePartAndTheSlots) {
  LayoutSizes s = TinySizes();
  s.partitioned_param_bytes = 4096;
  Placement pl = Place(OffloadDevice::kNone, OffloadDevice::kNone);
  pl.world_size = 2;
  pl.max_live_parameters = 100;  // the working set: 2 modules
  pl.param_buffer_count = 3;     // 2 gathered ahead
  pl.overlap_optimizer = true;   // (with several ranks the step runs inline: no mirror)
  const TierPlan plan = ComputeTierPlan(pl, s, {});
  // part + 2 gather buffers + persistent + 2 parameter slots + 2 gradient
  // slots + 12 B/element of states.
  EXPECT_EQ(Needed(plan, "hbm"), 4096 + 2 * 4096 + 512 + 2 * 4096 + 2 * 4096 + 12 * 1001);
  EXPECT_EQ(plan.device_slots, 4);
  const std::string& hbm = Find(plan, "hbm")->detail;
  EXPECT_THAT(hbm, HasSubstr("parameters (this rank's part of 2) 4.00 KiB"));
  EXPECT_THAT(hbm, HasSubstr("parameter gather 2 x 4.00 KiB"));
  EXPECT_THAT(Find(plan, "pinned")->detail, Not(HasSubstr("parameter gather")));
  EXPECT_THAT(Find(plan, "pinned")->detail, HasSubstr("updated parameters 4.00 KiB"));
  EXPECT_EQ(plan.param_copy_bytes, 4096);
  EXPECT_FALSE(pl.overlap_step());
  EXPECT_FALSE(pl.param_mirror());
  // Not partitioned: every parameter in HBM, no slots for them.
  s.partitioned_param_bytes = 0;
  const TierPlan whole = ComputeTierPlan(pl, s, {});
  EXPECT_EQ(Needed(whole, "hbm"), 8192 + 2 * 4096 + 12 * 1001);
  EXPECT_EQ(whole.device_slots, 2);
}

TEST(PlanTest, PinsTheParameterCopiesWithinTheBudget) {
  const LayoutSizes s = TinySizes();
  TierFacts f;
  f.pinned_budget = 4 * 4096 + 2 * 8192;  // exactly staging + both copies
  Placement cpu = Place(OffloadDevice::kCpu, OffloadDevice::kCpu);
  TierPlan plan = ComputeTierPlan(cpu, s, f);
  EXPECT_TRUE(plan.fits);
  EXPECT_TRUE(plan.pin_param_copies);
  EXPECT_EQ(plan.param_copy_bytes, 2 * 8192);
  EXPECT_THAT(Find(plan, "pinned")->detail, HasSubstr("(cross PCIe every step)"));
  EXPECT_THAT(Find(plan, "dram")->detail, Not(HasSubstr("parameters")));
  // One byte less: pageable, and the plan says so; the plan still fits.
  f.pinned_budget -= 1;
  plan = ComputeTierPlan(cpu, s, f);
  EXPECT_TRUE(plan.fits);
  EXPECT_FALSE(plan.pin_param_copies);
  EXPECT_THAT(Find(plan, "pinned")->detail, HasSubstr("not pinned: parameter copies 2 x 8.00 KiB"));
  EXPECT_EQ(Needed(plan, "pinned"), 4 * 4096);
  EXPECT_EQ(Needed(plan, "dram"), 4 * 1001 + 8192 + 12 * 1001 + 8192);
  // offload_param.pin_memory insists: over the budget, the plan fails.
  cpu.pin_param_copies = true;
  plan = ComputeTierPlan(cpu, s, f);
  EXPECT_TRUE(plan.pin_param_copies);
  EXPECT_FALSE(plan.fits);
  // offload_param nvme: no copy over every parameter, module-sized
  // write-back buffers instead.
  const TierPlan nv = ComputeTierPlan(Place(OffloadDevice::kCpu, OffloadDevice::kNvme), s, {});
  EXPECT_EQ(nv.param_copy_bytes, 0);
  EXPECT_EQ(nv.param_write_bytes, kParamWriteBuffers * 4096);
  EXPECT_THAT(Find(nv, "pinned")->detail, HasSubstr("parameter write-back 4 x 4.00 KiB"));
  EXPECT_THAT(Find(nv, "pinned")->detail, Not(HasSubstr("updated parameters")));
  EXPECT_THAT(Find(nv, "dram")->detail, Not(HasSubstr("updated parameters")));
  // With several ranks (partitioned: offload_param is stage 3's) each
  // rank's NVMe holds two versions of its part, a page per module more, and
  // still no array over the parameters.
  Placement ranks = Place(OffloadDevice::kCpu, OffloadDevice::kNvme);
  ranks.world_size = 2;
  LayoutSizes nvme_part = s;
  nvme_part.partitioned_param_bytes = 4096;
  TierFacts disk;
  disk.nvme_paths = {"/nvme"};
  const TierPlan nv2 = ComputeTierPlan(ranks, nvme_part, disk);
  EXPECT_EQ(nv2.param_copy_bytes, 0);
  EXPECT_EQ(nv2.param_write_bytes, kParamWriteBuffers * 4096);
  EXPECT_THAT(Find(nv2, "nvme")->detail,
              HasSubstr("parameters 2 x 12.00 KiB (this rank's part of 2)"));
  EXPECT_THAT(Find(nv2, "pinned")->detail, Not(HasSubstr("updated parameters")));
  EXPECT_THAT(Find(nv2, "pinned")->detail, HasSubstr("parameter fetch 5 x 4.00 KiB"));
  // Stage 3 partitioned parameters: the host copies hold this rank's part,
  // and module-sized buffers receive the gathered modules.
  LayoutSizes half = s;
  half.partitioned_param_bytes = 4096;
  Placement cpu3 = Place(OffloadDevice::kCpu, OffloadDevice::kCpu);
  cpu3.world_size = 2;
  const TierPlan part = ComputeTierPlan(cpu3, half, {});
  EXPECT_EQ(part.param_copy_bytes, 2 * 4096);
  EXPECT_THAT(Find(part, "pinned")->detail, HasSubstr("parameter gather"));
  EXPECT_THAT(Find(part, "pinned")->detail, HasSubstr("parameter copies 2 x 4.00 KiB"));
}

// Gradients on NVMe: chosen by strata.grad_tier nvme, or by auto when the
// DRAM budget cannot hold the fp32 accumulator; never with the optimizer
// elsewhere or delayed_param_update. The DRAM row then holds a cache of two
// sub-groups instead of the accumulator, the NVMe row one gradient shard per
// sub-group, and the pipeline buffers a sub-group's gradients too.
TEST(PlanTest, GradientsOnNvmeByTierOrByTheDramBudget) {
  const LayoutSizes s = TinySizes();
  TierFacts f;
  f.nvme_paths = {"/a"};
  Placement pl = Place(OffloadDevice::kNvme, OffloadDevice::kNvme);
  const TierPlan dram = ComputeTierPlan(pl, s, f);  // no DRAM limit: the faster tier
  EXPECT_FALSE(dram.grads_on_nvme);
  EXPECT_THAT(Find(dram, "dram")->detail, HasSubstr("gradient accumulator 3.91 KiB"));

  pl.grad_tier = GradTier::kNvme;
  const TierPlan nv = ComputeTierPlan(pl, s, f);
  EXPECT_TRUE(nv.grads_on_nvme);
  EXPECT_FALSE(nv.fold_last_micro_batch);
  EXPECT_EQ(nv.grad_cache_bytes, kGradCacheSlots * IoBytes(4 * 1000));
  EXPECT_EQ(Needed(nv, "dram"), nv.grad_cache_bytes);
  EXPECT_THAT(Find(nv, "dram")->detail, HasSubstr("gradient cache 2 sub-groups"));
  EXPECT_THAT(Find(nv, "dram")->detail, Not(HasSubstr("accumulator")));
  // One shard per sub-group (and its page rounding) on NVMe.
  EXPECT_EQ(nv.nvme_bytes(), dram.nvme_bytes() + 4 * 1001 + 2 * kIoAlign);
  EXPECT_THAT(Find(nv, "nvme")->detail, HasSubstr("gradients 3.91 KiB"));
  EXPECT_EQ(nv.optimizer_buffer_bytes, IoBytes(12 * 1000) + IoBytes(4 * 1000));
  EXPECT_EQ(Needed(nv, "pinned") - Needed(dram, "pinned"),
            pl.optimizer_buffer_count * IoBytes(4 * 1000));
  // What the process allocates on the host: pinned + dram (+ hbm on the
  // host device).
  EXPECT_EQ(nv.host_bytes, Needed(nv, "pinned") + Needed(nv, "dram"));
  Placement host_dev = pl;
  host_dev.host_device = true;
  const TierPlan hd = ComputeTierPlan(host_dev, s, f);
  EXPECT_EQ(hd.host_bytes, Needed(hd, "pinned") + Needed(hd, "dram") + Needed(hd, "hbm"));

  // auto: NVMe once the accumulator does not fit the DRAM budget (and the
  // cache needs less), and the plan says why. Eight sub-groups of 1000.
  LayoutSizes big = s;
  big.total_elems = 8001;
  big.num_groups = 9;
  pl.grad_tier = GradTier::kAuto;
  f.dram_available = 0;
  const int64_t big_dram = Needed(ComputeTierPlan(pl, big, f), "dram");
  EXPECT_EQ(big_dram, 4 * 8001);
  f.dram_available = big_dram - 1;
  const TierPlan tight = ComputeTierPlan(pl, big, f);
  EXPECT_TRUE(tight.grads_on_nvme);
  EXPECT_TRUE(tight.fits) << OverBudgetTable(tight, pl, big);
  EXPECT_THAT(tight.grad_path, HasSubstr("does not fit the DRAM budget"));
  f.dram_available = big_dram;
  EXPECT_FALSE(ComputeTierPlan(pl, big, f).grads_on_nvme);
  // A cache no smaller than the accumulator: DRAM stays (the plan fails).
  f.dram_available = Needed(dram, "dram") - 1;
  EXPECT_FALSE(ComputeTierPlan(pl, s, f).grads_on_nvme);
  // dram: kept in DRAM even over the budget (the plan fails instead).
  pl.grad_tier = GradTier::kDram;
  f.dram_available = big_dram - 1;
  const TierPlan kept = ComputeTierPlan(pl, big, f);
  EXPECT_FALSE(kept.grads_on_nvme);
  EXPECT_FALSE(kept.fits);
  // Never with the optimizer in DRAM or delayed_param_update.
  Placement cpu = Place(OffloadDevice::kCpu, OffloadDevice::kNvme);
  cpu.grad_tier = GradTier::kNvme;
  EXPECT_FALSE(ComputeTierPlan(cpu, s, f).grads_on_nvme);
  Placement dpu = Place(OffloadDevice::kNvme, OffloadDevice::kNvme);
  dpu.grad_tier = GradTier::kAuto;
  dpu.delayed_param_update = true;
  EXPECT_FALSE(ComputeTierPlan(dpu, s, f).grads_on_nvme);
}

// Gradients in HBM until the step: chosen by strata.grad_tier hbm, or by
// auto with the optimizer in DRAM when the DRAM budget cannot hold the fp32
// accumulator and the plan then fits; never with several ranks,
// delayed_param_update or the optimizer elsewhere. The sums move from the
// DRAM row to the HBM row, two chunk buffers go into the pinned row, and
// nothing is folded or speculated.
// offload_optimizer.ratio: whole sub-groups from the first, at most
// (1 - ratio) of them; their states and sums in the hbm row and not in the
// dram one; "auto" as many as half the HBM budget holds beside the rest
// (none on the host device); and where it cannot apply, none, saying why.
TEST(PlanTest, RatioSplitsWholeSubGroups) {
  LayoutSizes s = TinySizes();
  s.total_elems = 8001;  // 9 sub-groups of 1000, the last of 1
  s.num_groups = 9;
  TierFacts f;
  f.hbm_budget = 1 << 20;
  Placement pl = Place(OffloadDevice::kCpu, OffloadDevice::kNone);
  const TierPlan whole = ComputeTierPlan(pl, s, f);
  EXPECT_EQ(whole.device_step_groups, 0);
  EXPECT_TRUE(whole.device_step.empty());
  for (const auto& [ratio, groups] : {std::pair{0.5, 4}, {0.25, 6}, {0.01, 8}, {0.95, 0}}) {
    SCOPED_TRACE(ratio);
    pl.cpu_ratio = ratio;
    const TierPlan p = ComputeTierPlan(pl, s, f);
    EXPECT_EQ(p.device_step_groups, groups);
    EXPECT_EQ(p.device_step_elems, 1000 * groups);
    EXPECT_FALSE(p.device_step.empty());
    // 12 bytes of fp32 states and 4 of sums per element move from DRAM to HBM.
    EXPECT_EQ(Needed(p, "hbm"), Needed(whole, "hbm") + 16 * 1000 * groups);
    EXPECT_EQ(Needed(p, "dram"), Needed(whole, "dram") - 12 * 1000 * groups);
    if (groups > 0) {
      EXPECT_THAT(Find(p, "hbm")->detail, HasSubstr("stepped on the device"));
    }
  }
  // The speculative step's spare covers the CPU's part only.
  Placement spec = pl;
  spec.speculative_step = 1;
  spec.cpu_ratio = 0.5;
  EXPECT_EQ(ComputeTierPlan(spec, s, f).speculation_elems, 8001 - 4000);
  // offload_param cpu: their updated parameters' device buffer too.
  Placement cpu_params = pl;
  cpu_params.params = OffloadDevice::kCpu;
  cpu_params.cpu_ratio = 0.5;
  const TierPlan host_copy = ComputeTierPlan(cpu_params, s, f);
  EXPECT_EQ(host_copy.device_step_groups, 4);
  EXPECT_THAT(Find(host_copy, "hbm")->detail, HasSubstr("their updated parameters"));
  // "auto": (1 MiB / 2 - the rest) / 16000 bytes a sub-group, on a GPU.
  pl.cpu_ratio = 1.0;
  pl.cpu_ratio_auto = true;
  const int64_t fit = (f.hbm_budget / 2 - Needed(whole, "hbm")) / 16000;
  ASSERT_GT(fit, 0);
  EXPECT_EQ(ComputeTierPlan(pl, s, f).device_step_groups, std::min<int64_t>(fit, 8));
  pl.host_device = true;
  const TierPlan host = ComputeTierPlan(pl, s, f);
  EXPECT_EQ(host.device_step_groups, 0);
  EXPECT_THAT(host.device_step, HasSubstr("host device"));
  pl.host_device = false;
  // Not applied, saying why.
  pl.cpu_ratio_auto = false;
  pl.cpu_ratio = 0.5;
  Placement nvme = pl;
  nvme.optimizer = OffloadDevice::kNvme;
  Placement nvme_params = pl;
  nvme_params.params = OffloadDevice::kNvme;
  Placement ranks = pl;
  ranks.world_size = 2;
  for (const auto& [what, p] : {std::pair{"offload_optimizer.device", nvme},
                                {"offload_param.device", nvme_params},
                                {"one rank", ranks}}) {
    const TierPlan t = ComputeTierPlan(p, s, f);
    EXPECT_EQ(t.device_step_groups, 0) << what;
    EXPECT_THAT(t.device_step, AllOf(HasSubstr("not applied"), HasSubstr(what)));
  }
  // Every state format splits; the hbm row holds the format's bytes.
  Placement int8 = pl;
  int8.optimizer_states = OptimizerStates::kInt8;
  const TierPlan fp32_split = ComputeTierPlan(pl, s, f), int8_split = ComputeTierPlan(int8, s, f);
  EXPECT_EQ(int8_split.device_step_groups, fp32_split.device_step_groups);
  EXPECT_GT(int8_split.device_step_groups, 0);
  EXPECT_LT(Needed(int8_split, "hbm"), Needed(fp32_split, "hbm"));
}

// "auto" with measured rates: the fewest sub-groups whose predicted bound
// is within 2 % of the best; more take HBM without shortening the step.
// The toy (9 sub-groups, 8001 elements) at 1e6 CPU Adam elements a second:
// the CPU part takes (8001 - 1000 k) us.
TEST(PlanTest, RatioAutoPicksByTheRates) {
  LayoutSizes s = TinySizes();
  s.total_elems = 8001;
  s.num_groups = 9;
  TierFacts f;
  f.hbm_budget = 1 << 20;
  f.adam_elems_per_s = 1e6;
  f.accumulate_gbps = f.d2h_pinned_gbps = f.h2d_gbps = f.device_copy_gbps = 1000;
  Placement pl = Place(OffloadDevice::kCpu, OffloadDevice::kNone);
  pl.cpu_ratio_auto = true;
  // The CPU is the bound at every count: as many as HBM holds (all but one).
  const TierPlan cpu_bound = ComputeTierPlan(pl, s, f);
  EXPECT_EQ(cpu_bound.device_step_groups, 8);
  EXPECT_THAT(cpu_bound.device_step, HasSubstr("predicted bound"));
  // offload_param cpu with a slow link: the fetches (15872 bytes) take 4.5
  // ms whatever the split, so 4 sub-groups (the CPU's part 4.0 ms) are as
  // good as 8; 3 (5.0 ms) are not.
  Placement fetch = pl;
  fetch.params = OffloadDevice::kCpu;
  TierFacts slow_link = f;
  slow_link.h2d_gbps = 15872 / 4.5e-3 / 1e9;
  const TierPlan four = ComputeTierPlan(fetch, s, slow_link);
  EXPECT_EQ(four.device_step_groups, 4);
  EXPECT_THAT(four.device_step, HasSubstr("would not shorten"));
  // A link so slow that no split shortens the step: none.
  slow_link.h2d_gbps /= 100;
  const TierPlan none = ComputeTierPlan(fetch, s, slow_link);
  EXPECT_EQ(none.device_step_groups, 0);
  EXPECT_THAT(none.device_step, AllOf(HasSubstr("every sub-group is stepped on the CPU"),
                                      HasSubstr("would not shorten")));
  // The prediction counts the device Adam's bytes at the device's rate.
  StepRates r;
  r.adam_elems_per_s = 1e6;
  r.device_gbps = 1;
  const StepPrediction pred = PredictStep(pl, s, cpu_bound, r);
  bool device_term = false;
  for (const auto& t : pred.terms)
    if (t.resource == "device_optimizer") {
      device_term = true;
      EXPECT_GT(t.amount, 16.0 * 8000);  // states read and written, sums, parameters
      EXPECT_NEAR(t.seconds, t.amount / 1e9, 1e-12);
    }
  EXPECT_TRUE(device_term);
}

TEST(PlanTest, GradientsInHbmByTierOrByTheDramBudget) {
  LayoutSizes s = TinySizes();
  s.total_elems = 8001;
  s.num_groups = 9;
  TierFacts f;
  f.hbm_budget = 1 << 20;
  Placement pl = Place(OffloadDevice::kCpu, OffloadDevice::kNone);
  pl.gradient_accumulation_steps = 4;
  pl.speculative_step = 1;
  const TierPlan dram = ComputeTierPlan(pl, s, f);  // no DRAM limit: DRAM
  EXPECT_FALSE(dram.grads_in_hbm);
  EXPECT_THAT(Find(dram, "dram")->detail, HasSubstr("gradient accumulator 31.25 KiB"));
  EXPECT_GT(dram.speculation_elems, 0);

  pl.grad_tier = GradTier::kHbm;
  const TierPlan hbm = ComputeTierPlan(pl, s, f);
  EXPECT_TRUE(hbm.grads_in_hbm);
  EXPECT_FALSE(hbm.device_grad_accumulator);
  EXPECT_FALSE(hbm.fold_last_micro_batch);
  EXPECT_EQ(hbm.speculation_elems, 0);
  EXPECT_EQ(hbm.grad_chunk_elems, kSumChunkElems);
  EXPECT_EQ(kSumChunkElems % kNormBlockElems, 0);
  EXPECT_EQ(Needed(hbm, "hbm"), Needed(dram, "hbm") + 4 * 8001);
  EXPECT_THAT(Find(hbm, "hbm")->detail, HasSubstr("window gradient sums 31.25 KiB"));
  EXPECT_THAT(Find(hbm, "dram")->detail, Not(HasSubstr("accumulator")));
  EXPECT_THAT(Find(hbm, "dram")->detail, Not(HasSubstr("spare")));
  // Two buffers of the largest sub-group (smaller than a chunk).
  EXPECT_THAT(Find(hbm, "pinned")->detail, HasSubstr("gradient sums from HBM 2 x 4.00 KiB"));
  EXPECT_THAT(hbm.grad_path, HasSubstr("kept in HBM"));
  // The sums cross PCIe twice (the checks, the step), once each.
  StepRates rates;
  rates.h2d_gbps = rates.d2h_gbps = rates.accumulate_gbps = 10;
  rates.adam_elems_per_s = 1e9;
  const StepPrediction p = PredictStep(pl, s, hbm, rates);
  ASSERT_FALSE(p.terms.empty());
  EXPECT_EQ(p.terms[0].resource, "pcie_d2h");
  EXPECT_EQ(p.terms[0].amount, 8.0 * 8001);

  // auto: HBM once the accumulator does not fit the DRAM budget, and the
  // plan says why. (Without speculation, whose spare takes what DRAM has
  // left.)
  pl.grad_tier = GradTier::kAuto;
  pl.speculative_step = 0;
  const TierPlan plain = ComputeTierPlan(pl, s, f);
  EXPECT_EQ(Needed(plain, "dram"), 16 * 8001);  // the accumulator and the states
  f.dram_available = Needed(plain, "dram") - 1;
  const TierPlan tight = ComputeTierPlan(pl, s, f);
  EXPECT_TRUE(tight.grads_in_hbm);
  EXPECT_TRUE(tight.fits) << OverBudgetTable(tight, pl, s);
  EXPECT_THAT(tight.grad_path, HasSubstr("does not fit the DRAM budget"));
  f.dram_available = Needed(plain, "dram");
  EXPECT_FALSE(ComputeTierPlan(pl, s, f).grads_in_hbm);
  // Not when HBM cannot hold them either: the DRAM plan fails with its table.
  f.dram_available = Needed(plain, "dram") - 1;
  f.hbm_budget = Needed(dram, "hbm") + 4 * 8001 - 1;
  const TierPlan neither = ComputeTierPlan(pl, s, f);
  EXPECT_FALSE(neither.grads_in_hbm);
  EXPECT_FALSE(neither.fits);
  f.hbm_budget = 1 << 20;
  // dram: kept in DRAM even over the budget.
  pl.grad_tier = GradTier::kDram;
  EXPECT_FALSE(ComputeTierPlan(pl, s, f).grads_in_hbm);
  // Never with several ranks, delayed_param_update or states on NVMe.
  for (int variant = 0; variant < 3; ++variant) {
    Placement other = Place(OffloadDevice::kCpu, OffloadDevice::kNone);
    other.gradient_accumulation_steps = 4;
    other.grad_tier = GradTier::kHbm;
    if (variant == 0) other.world_size = 2;
    if (variant == 1) other.delayed_param_update = true;
    if (variant == 2) other.optimizer = OffloadDevice::kNvme;
    EXPECT_FALSE(ComputeTierPlan(other, s, f).grads_in_hbm) << variant;
    other.grad_tier = GradTier::kAuto;
    EXPECT_FALSE(ComputeTierPlan(other, s, f).grads_in_hbm) << variant;
  }
}

// offload_optimizer none on a GPU: the gradient accumulator moves from DRAM
// to HBM.
TEST(PlanTest, DeviceOptimizerKeepsTheAccumulatorInHbm) {
  const LayoutSizes s = TinySizes();
  Placement pl = Place(OffloadDevice::kNone, OffloadDevice::kNone);
  const TierPlan host = ComputeTierPlan(pl, s, {});
  pl.device_optimizer = true;
  const TierPlan dev = ComputeTierPlan(pl, s, {});
  EXPECT_EQ(Needed(dev, "hbm"), Needed(host, "hbm") + 4 * 1001);
  EXPECT_EQ(Needed(dev, "dram"), Needed(host, "dram") - 4 * 1001);
  EXPECT_THAT(Find(dev, "hbm")->detail, HasSubstr("gradient accumulator"));
  EXPECT_THAT(Find(dev, "dram")->detail, Not(HasSubstr("gradient accumulator")));
}

TEST(PlanTest, DelayedParamUpdateAddsTheSecondAccumulator) {
  const LayoutSizes s = TinySizes();
  Placement pl = Place(OffloadDevice::kCpu, OffloadDevice::kCpu);
  const int64_t before = Needed(ComputeTierPlan(pl, s, {}), "dram");
  pl.delayed_param_update = true;
  const TierPlan plan = ComputeTierPlan(pl, s, {});
  EXPECT_EQ(Needed(plan, "dram"), before + 4 * 1001);
  EXPECT_THAT(Find(plan, "dram")->detail, HasSubstr("second gradient accumulator"));
  // Nothing else moves.
  EXPECT_EQ(Needed(plan, "hbm"),
            Needed(ComputeTierPlan(Place(OffloadDevice::kCpu, OffloadDevice::kCpu), s, {}), "hbm"));
}

// strata.speculative_step: 12 bytes of spare states per element in DRAM,
// as many as the DRAM budget holds after the rest; on with a GPU under
// auto, off on the host device unless asked; never where it does not
// apply.
TEST(PlanTest, SpeculativeStepSparesStatesInDram) {
  const LayoutSizes s = TinySizes();
  Placement pl = Place(OffloadDevice::kCpu, OffloadDevice::kNone);
  const int64_t before = Needed(ComputeTierPlan(pl, s, {}), "dram");
  pl.speculative_step = -1;
  TierPlan plan = ComputeTierPlan(pl, s, {});
  EXPECT_EQ(plan.speculation_elems, s.total_elems);
  EXPECT_EQ(Needed(plan, "dram"), before + 12 * s.total_elems);
  EXPECT_THAT(Find(plan, "dram")->detail, HasSubstr("speculative step's spare states"));
  // A budget that holds half of the spare: the last half of the elements.
  TierFacts f;
  f.dram_available = before + 6 * s.total_elems;
  plan = ComputeTierPlan(pl, s, f);
  EXPECT_EQ(plan.speculation_elems, s.total_elems / 2);
  EXPECT_TRUE(plan.fits);
  EXPECT_THAT(Find(plan, "dram")->detail, HasSubstr("(the last 50 % of the elements)"));
  // No room: none, and the plan still fits.
  f.dram_available = before;
  plan = ComputeTierPlan(pl, s, f);
  EXPECT_EQ(plan.speculation_elems, 0);
  EXPECT_TRUE(plan.fits);
  // Where it applies.
  pl.host_device = true;
  EXPECT_FALSE(pl.speculate());
  pl.speculative_step = 1;
  EXPECT_TRUE(pl.speculate());
  // States on NVMe: no spare (their inactive versions take the new
  // states), every element, with the window's sums in DRAM or on NVMe.
  for (auto [opt, par] : {std::pair{OffloadDevice::kNvme, OffloadDevice::kCpu},
                          std::pair{OffloadDevice::kNvme, OffloadDevice::kNvme}}) {
    Placement q = Place(opt, par);
    const int64_t dram = Needed(ComputeTierPlan(q, s, {}), "dram");
    q.speculative_step = 1;
    EXPECT_TRUE(q.speculate());
    const TierPlan spec = ComputeTierPlan(q, s, {});
    EXPECT_EQ(spec.speculation_elems, s.total_elems);
    EXPECT_EQ(Needed(spec, "dram"), dram);
    TierFacts disk;
    disk.nvme_paths = {"/nvme"};
    const TierPlan with_disk = ComputeTierPlan(q, s, disk);
    const TierBudget* nvme = Find(with_disk, "nvme");
    ASSERT_NE(nvme, nullptr);
    EXPECT_THAT(nvme->detail,
                HasSubstr("(the speculative step writes the inactive one during backward)"));
    q.grad_tier = GradTier::kNvme;
    const TierPlan sums_on_nvme = ComputeTierPlan(q, s, {});
    EXPECT_TRUE(sums_on_nvme.grads_on_nvme);
    EXPECT_EQ(sums_on_nvme.speculation_elems, s.total_elems);
  }
  Placement nvme_params = Place(OffloadDevice::kCpu, OffloadDevice::kNvme);
  nvme_params.speculative_step = 1;
  EXPECT_TRUE(nvme_params.speculate());
  Placement q = pl;
  q.world_size = 2;
  EXPECT_FALSE(q.speculate());
  q = pl;
  q.delayed_param_update = true;
  EXPECT_FALSE(q.speculate());
  q = pl;
  q.device_optimizer = true;
  EXPECT_FALSE(q.speculate());
}

TEST(PlanTest, SizesOfABuiltLayout) {
  LayoutOptions o;
  o.sub_group_size = 100;
  o.params_offloaded = true;
  o.persistence_threshold = 50;
  std::vector<ParamRec> recs(3);
  recs[0] = {"a", 30, DType::kFp32, 0};
  recs[1] = {"b", 200, DType::kBf16, 1};
  recs[2] = {"c", 7, DType::kFp16, 1};
  const Layout l = Layout::Build(recs, o);
  const LayoutSizes s = LayoutSizes::Of(l);
  EXPECT_EQ(s.total_elems, 239);  // b starts on a multiple of 4 elements: 2 of padding after a
  EXPECT_EQ(s.total_param_bytes, 8192);      // module 1 starts at 4096, ends at 4096 + 512 + 256
  EXPECT_EQ(s.persistent_param_bytes, 256);  // module 0: 30 < 50 elements
  EXPECT_EQ(s.max_module_bytes, 768);
  EXPECT_EQ(s.max_group_elems, 100);
  EXPECT_EQ(s.num_groups, 3);
  EXPECT_EQ(s.num_modules, 2);
  EXPECT_EQ(s.grad_staging_bytes, 4096);
}

TEST(PlanTest, UsedNvmePathsDedupesOptimizerFirst) {
  Config c;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero_optimization.offload_optimizer.nvme_path = {"/b", "/a", "/b"};
  c.zero_optimization.offload_param.device = OffloadDevice::kNvme;
  c.zero_optimization.offload_param.nvme_path = {"/c", "/a", "/d"};
  EXPECT_THAT(UsedNvmePaths(c), ElementsAre("/b", "/a", "/c", "/d"));
  // A device that is not nvme contributes nothing, even with a path set.
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  EXPECT_THAT(UsedNvmePaths(c), ElementsAre("/c", "/a", "/d"));
  c.zero_optimization.offload_param.device = OffloadDevice::kCpu;
  EXPECT_TRUE(UsedNvmePaths(c).empty());
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  EXPECT_THAT(UsedNvmePaths(c), ElementsAre("/b", "/a"));
}

// The gradient path: fold the last micro-batch into the optimizer's pass
// when the accumulation time it saves (at the measured rate) exceeds what a
// pageable landing buffer adds to the copy; the landing buffer is pinned
// when the budget holds it; never with the device optimizer or DPU.
TEST(PlanTest, GradPathFromSizesAndRates) {
  const LayoutSizes s = TinySizes();  // 8192 B of parameters, 1001 elements (G ~ 8.2 B)
  Placement pl = Place(OffloadDevice::kCpu, OffloadDevice::kCpu);
  TierFacts f;
  f.hbm_budget = 8 << 20;
  f.pinned_budget = 1 << 20;
  f.dram_available = 1 << 20;
  // No rates measured: the plain path, and the table says why.
  TierPlan plan = ComputeTierPlan(pl, s, f);
  EXPECT_FALSE(plan.fold_last_micro_batch);
  EXPECT_THAT(Find(plan, "dram")->detail,
              HasSubstr("last micro-batch accumulated (rates not measured)"));
  // Measured, pinned budget room: fold, the landing buffer pinned.
  f.accumulate_gbps = 10;
  f.d2h_pinned_gbps = 50;
  f.d2h_pageable_gbps = 15;
  plan = ComputeTierPlan(pl, s, f);
  EXPECT_TRUE(plan.fold_last_micro_batch);
  EXPECT_TRUE(plan.pin_grad_landing);
  EXPECT_EQ(plan.grad_landing_bytes, 8192);
  EXPECT_THAT(Find(plan, "pinned")->detail,
              HasSubstr("gradient landing 8.00 KiB (last micro-batch folded into the optimizer"));
  EXPECT_EQ(Needed(plan, "pinned"), 4 * 4096 + 2 * 8192 + 8192);
  // No pinned room left: a pageable landing buffer still pays while the
  // copy penalty is below the accumulation saved...
  f.pinned_budget = 4 * 4096 + 2 * 8192;
  plan = ComputeTierPlan(pl, s, f);
  EXPECT_TRUE(plan.fold_last_micro_batch);
  EXPECT_FALSE(plan.pin_grad_landing);
  EXPECT_THAT(Find(plan, "dram")->detail, HasSubstr("gradient landing 8.00 KiB"));
  EXPECT_THAT(Find(plan, "dram")->detail, HasSubstr("pageable copy +"));
  // ... and not once pageable copies are slow enough: with one micro-batch
  // per window the fold saves 20 - G B/element = ~11.8 KB, 1.2 us at
  // 10 GB/s; 8 KiB at 1 GB/s vs 50 GB/s costs ~8 us.
  f.d2h_pageable_gbps = 1;
  plan = ComputeTierPlan(pl, s, f);
  EXPECT_FALSE(plan.fold_last_micro_batch);
  EXPECT_THAT(Find(plan, "dram")->detail, HasSubstr("of pageable copy"));
  // With pinned room again but no DRAM... pinned: folds; pageable and no
  // DRAM left: does not, and the plan still fits.
  f.d2h_pageable_gbps = 15;
  f.dram_available =
      Needed(ComputeTierPlan(Place(OffloadDevice::kCpu, OffloadDevice::kCpu), s, TierFacts{}),
             "dram") +
      100;
  plan = ComputeTierPlan(pl, s, f);
  EXPECT_TRUE(plan.fits);
  EXPECT_FALSE(plan.fold_last_micro_batch);
  EXPECT_THAT(Find(plan, "dram")->detail, HasSubstr("no DRAM left for a landing buffer"));
  f.dram_available = 1 << 20;
  // Never with DPU or the device optimizer; the override forces either way.
  Placement dpu = pl;
  dpu.delayed_param_update = true;
  EXPECT_FALSE(ComputeTierPlan(dpu, s, f).fold_last_micro_batch);
  Placement dev = Place(OffloadDevice::kNone, OffloadDevice::kNone);
  dev.device_optimizer = true;
  EXPECT_FALSE(ComputeTierPlan(dev, s, f).fold_last_micro_batch);
  Placement off = pl;
  off.fold_override = 0;
  EXPECT_FALSE(ComputeTierPlan(off, s, f).fold_last_micro_batch);
  Placement on = pl;
  on.fold_override = 1;
  f.d2h_pageable_gbps = 1;
  EXPECT_TRUE(ComputeTierPlan(on, s, f).fold_last_micro_batch);
}

// The predicted step counts the bytes each placement moves per window and
// divides by the rates; shared resources (the disk, the CPU) add up.
TEST(PlanTest, PredictedStepCountsThePlacementsBytes) {
  const LayoutSizes s = TinySizes();
  StepRates r;
  r.h2d_gbps = r.d2h_gbps = 1e-6;  // 1000 bytes/s
  r.accumulate_gbps = 1e-5;
  r.adam_elems_per_s = 1001;
  r.nvme_read_gbps = 2e-6;
  r.nvme_write_gbps = 1e-6;
  auto amount = [](const StepPrediction& p, const std::string& res) {
    for (const auto& t : p.terms)
      if (t.resource == res) return t.amount;
    return -1.0;
  };
  Placement nn = Place(OffloadDevice::kNvme, OffloadDevice::kNvme);
  nn.gradient_accumulation_steps = 3;
  TierFacts f;
  TierPlan plan = ComputeTierPlan(nn, s, f);
  plan.fold_last_micro_batch = false;
  StepPrediction p = PredictStep(nn, s, plan, r);
  EXPECT_EQ(amount(p, "pcie_d2h"), 3 * 8192.0);
  // 8 + G bytes per element and accumulated micro-batch (G = 8192 / 1001).
  EXPECT_DOUBLE_EQ(amount(p, "cpu_accumulate"), 3 * (8 * 1001.0 + 8192));
  EXPECT_EQ(amount(p, "cpu_optimizer"), 1001.0);
  EXPECT_EQ(amount(p, "pcie_h2d"), 2 * 3 * (8192.0 - 512) + 512);
  EXPECT_EQ(amount(p, "nvme_read"), 12 * 1001.0 + 2 * 3 * (8192.0 - 512));
  EXPECT_EQ(amount(p, "nvme_write"), 12 * 1001.0 + 8192);
  // The disk: reads at 2000 B/s plus writes at 1000 B/s, the largest.
  EXPECT_EQ(p.bound_by, "nvme");
  EXPECT_DOUBLE_EQ(p.bound_s, (12 * 1001.0 + 6 * 7680) / 2000 + (12 * 1001.0 + 8192) / 1000);
  // Folding the last micro-batch saves one accumulation pass.
  plan.fold_last_micro_batch = true;
  EXPECT_DOUBLE_EQ(amount(PredictStep(nn, s, plan, r), "cpu_accumulate"), 2 * (8 * 1001.0 + 8192));
  // Over PCIe a module moves its own extent, on NVMe its page-aligned one.
  LayoutSizes extents = s;
  extents.module_param_bytes = 8000;
  plan.fold_last_micro_batch = false;
  p = PredictStep(nn, extents, plan, r);
  EXPECT_EQ(amount(p, "pcie_d2h"), 3 * 8000.0);
  EXPECT_EQ(amount(p, "pcie_h2d"), 2 * 3 * (8000.0 - 512) + 512);
  EXPECT_EQ(amount(p, "nvme_write"), 12 * 1001.0 + 8192);
  EXPECT_EQ(amount(p, "nvme_read"), 12 * 1001.0 + 2 * 3 * (8192.0 - 512));
  // cpu/none: no NVMe, the updated parameters uploaded once.
  const Placement cn = Place(OffloadDevice::kCpu, OffloadDevice::kNone);
  p = PredictStep(cn, s, ComputeTierPlan(cn, s, f), r);
  EXPECT_EQ(amount(p, "pcie_h2d"), 8192.0);
  EXPECT_EQ(amount(p, "nvme_read"), -1.0);
  // The device optimizer moves nothing over PCIe; an unmeasured rate
  // leaves its term at 0 seconds.
  Placement dev = Place(OffloadDevice::kNone, OffloadDevice::kNone);
  dev.device_optimizer = true;
  EXPECT_TRUE(PredictStep(dev, s, ComputeTierPlan(dev, s, f), r).terms.empty());
  p = PredictStep(cn, s, ComputeTierPlan(cn, s, f), StepRates());
  for (const auto& t : p.terms) EXPECT_EQ(t.seconds, 0.0) << t.resource;
  EXPECT_EQ(p.bound_s, 0.0);
}

// The window's gradients in HBM: chosen when asked, or (auto) when one fp32
// copy and pass per window beat every micro-batch's copy and pass at the
// measured rates and the accumulator leaves half of the HBM budget; never
// with one micro-batch, delayed_param_update or the device optimizer. It
// takes an HBM row and replaces the fold.
TEST(PlanTest, DeviceGradAccumulatorRule) {
  const LayoutSizes s = TinySizes();  // 1001 elements: a 4004-byte accumulator
  Placement p = Place(OffloadDevice::kCpu, OffloadDevice::kCpu);
  p.gradient_accumulation_steps = 2;
  TierFacts f;
  f.hbm_budget = 1 << 20;
  f.d2h_pinned_gbps = 10;
  f.d2h_pageable_gbps = 5;
  f.accumulate_gbps = 20;
  TierPlan plan = ComputeTierPlan(p, s, f);
  EXPECT_TRUE(plan.device_grad_accumulator) << plan.grad_path;
  EXPECT_EQ(plan.device_accumulator_bytes, 4004);
  EXPECT_FALSE(plan.fold_last_micro_batch);
  EXPECT_THAT(Find(plan, "hbm")->detail, HasSubstr("window gradient accumulator"));
  EXPECT_THAT(plan.grad_path, HasSubstr("summed in HBM"));
  // Half of the budget would be taken: the host sums.
  TierFacts small = f;
  small.hbm_budget = 2 * Needed(plan, "hbm");
  EXPECT_TRUE(ComputeTierPlan(p, s, small).device_grad_accumulator);
  small.hbm_budget -= 2;
  EXPECT_FALSE(ComputeTierPlan(p, s, small).device_grad_accumulator);
  // The host device: auto leaves the adds to the CPU optimizer's threads.
  Placement host = p;
  host.host_device = true;
  EXPECT_FALSE(ComputeTierPlan(host, s, f).device_grad_accumulator);
  // Rates not measured: the host sums (auto decides from them).
  TierFacts unmeasured = f;
  unmeasured.accumulate_gbps = 0;
  EXPECT_FALSE(ComputeTierPlan(p, s, unmeasured).device_grad_accumulator);
  // Asked for: chosen whatever the rates; host: never.
  p.grad_accumulator = GradAccumulatorPlace::kDevice;
  EXPECT_TRUE(ComputeTierPlan(p, s, unmeasured).device_grad_accumulator);
  p.grad_accumulator = GradAccumulatorPlace::kHost;
  EXPECT_FALSE(ComputeTierPlan(p, s, f).device_grad_accumulator);
  p.grad_accumulator = GradAccumulatorPlace::kDevice;
  Placement one = p;
  one.gradient_accumulation_steps = 1;
  EXPECT_FALSE(ComputeTierPlan(one, s, f).device_grad_accumulator);
  Placement dpu = p;
  dpu.delayed_param_update = true;
  EXPECT_FALSE(ComputeTierPlan(dpu, s, f).device_grad_accumulator);
  Placement dev = Place(OffloadDevice::kNone, OffloadDevice::kNone);
  dev.device_optimizer = true;
  dev.gradient_accumulation_steps = 2;
  dev.grad_accumulator = GradAccumulatorPlace::kDevice;
  EXPECT_FALSE(ComputeTierPlan(dev, s, f).device_grad_accumulator);
}

}  // namespace
}  // namespace strata::scheduler
