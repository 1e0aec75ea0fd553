// Engine checkpoints on the host device: k steps + save + a fresh engine +
// load + N - k steps equals N steps bitwise for every placement (and across
// placements); a checkpoint of another config or layout is refused naming the
// difference; corrupt, truncated and half-written checkpoints; retention; the
// C API.
#include "src/scheduler/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "src/common/crc32c.h"
#include "src/common/dtype.h"
#include "src/common/half.h"
#include "src/config/config_internal.h"
#include "src/scheduler/scheduler.h"
#include "strata/engine.h"
#include "strata/strata_c.h"
#include "tests/scheduler/toy_engine_model.h"
#include "tests/test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

using testing::BitwiseEqual;
using testing::Load;
using testing::ReadAll;
using testing::Store;

constexpr int kModules = 5;

int64_t Numel(int m, int i) { return testing::ToyNumel(m, i); }
DType DTypeOf(int m, int i) { return testing::ToyDType(m, i); }

// The engine tests' config with accumulation, clipping and dynamic loss
// scaling whose scale moves every other step: its state must survive a
// checkpoint.
Config BaseConfig(OffloadDevice opt, OffloadDevice par, const std::string& nvme_dir) {
  Config c = testing::ToyConfig(opt, par, nvme_dir);
  c.gradient_accumulation_steps = c.train_batch_size = 2;
  c.gradient_clipping = 2.0;
  c.fp16.enabled = true;
  c.fp16.initial_scale_power = 3;
  c.fp16.loss_scale_window = 2;
  return c;
}

void Register(Engine& e, uint64_t seed, int64_t extra_numel = 0) {
  testing::RegisterToy(e, seed, kModules, extra_numel);
}

double MicroBatch(Engine& e, int batch) { return testing::ToyMicroBatch(e, batch, kModules); }
void TrainSteps(Engine& e, const Config& c, int from, int to, std::vector<double>* losses) {
  testing::TrainToySteps(e, c, from, to, kModules, losses);
}

std::unique_ptr<Engine> NewEngine(const Config& c, uint64_t seed) {
  auto e = CreateEngine(c);
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return nullptr;
  Register(**e, seed);
  return std::move(*e);
}

constexpr int kSteps = 5;
constexpr int kSaveAt = 2;

struct RunResult {
  std::vector<double> losses;
  std::vector<std::vector<float>> params;
  double loss_scale = 0;
};

RunResult Uninterrupted(const Config& c, uint64_t seed) {
  RunResult r;
  auto e = NewEngine(c, seed);
  if (!e) return r;
  TrainSteps(*e, c, 0, kSteps, &r.losses);
  r.params = ReadAll(*e);
  r.loss_scale = e->loss_scale();
  return r;
}

// kSaveAt steps with `save`, then a fresh engine with `load` (registered
// with other initial values: the checkpoint must replace them) for the rest.
RunResult Resumed(const Config& save, const Config& load, uint64_t seed, const std::string& ckpt) {
  RunResult r;
  {
    auto e = NewEngine(save, seed);
    if (!e) return r;
    TrainSteps(*e, save, 0, kSaveAt, &r.losses);
    CheckpointInfo info;
    info.data_position = kSaveAt;
    info.note = "{\"epoch\": 0}";
    Status s = e->SaveCheckpoint(ckpt, info);
    EXPECT_TRUE(s.ok()) << s;
  }
  auto e = NewEngine(load, seed + 1);
  if (!e) return r;
  CheckpointInfo info;
  Status s = e->LoadCheckpoint(ckpt, &info);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(info.data_position, kSaveAt);
  EXPECT_EQ(info.note, "{\"epoch\": 0}");
  EXPECT_EQ(info.optimizer_step, kSaveAt);
  EXPECT_THAT(info.path, HasSubstr("ckpt-"));
  TrainSteps(*e, load, static_cast<int>(info.data_position), kSteps, &r.losses);
  r.params = ReadAll(*e);
  r.loss_scale = e->loss_scale();
  return r;
}

class ResumeTest : public ::testing::TestWithParam<std::tuple<OffloadDevice, OffloadDevice, bool>> {
};

TEST_P(ResumeTest, BitwiseEqualToUninterrupted) {
  testing::ScratchDir dir;
  uint64_t seed = 0;
  testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto [opt, par, overlap] = GetParam();
  Config c = BaseConfig(opt, par, dir.str());
  c.strata.overlap_optimizer = overlap;
  const RunResult want = Uninterrupted(c, seed);
  const RunResult got = Resumed(c, c, seed, dir.str() + "/ckpt");
  ASSERT_EQ(want.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_TRUE(BitwiseEqual(want.losses, got.losses));
  EXPECT_TRUE(BitwiseEqual(want.params, got.params));
  EXPECT_EQ(want.loss_scale, got.loss_scale);
  EXPECT_GT(want.loss_scale, 8.0);  // the scale moved: its state was restored
  // It can fail: the run from other initial values without the checkpoint differs.
  auto other = NewEngine(c, seed + 1);
  ASSERT_TRUE(other);
  EXPECT_FALSE(BitwiseEqual(ReadAll(*other), want.params));
}

INSTANTIATE_TEST_SUITE_P(AllPlacements, ResumeTest, testing::AllPlacementsAndOverlap(),
                         testing::PlacementOverlapName);

// The window's sums kept in HBM (strata.grad_tier hbm): a resume gives the
// bits of the uninterrupted run, and those of the sums in DRAM, also when
// the run saved with one and resumed with the other.
TEST(CheckpointTest, SumsInHbmResumeBitwise) {
  testing::ScratchDir dir;
  Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kNone, dir.str());
  c.strata.grad_tier = GradTier::kHbm;
  const RunResult want = Uninterrupted(c, 23);
  const RunResult got = Resumed(c, c, 23, dir.str() + "/ckpt");
  ASSERT_EQ(want.losses.size(), static_cast<size_t>(kSteps));
  EXPECT_TRUE(BitwiseEqual(want.losses, got.losses));
  EXPECT_TRUE(BitwiseEqual(want.params, got.params));
  Config dram = c;
  dram.strata.grad_tier = GradTier::kDram;
  EXPECT_TRUE(BitwiseEqual(Uninterrupted(dram, 23).params, want.params));
  // Saved with the sums in DRAM, resumed with them in HBM: the same bits.
  EXPECT_TRUE(BitwiseEqual(Resumed(dram, c, 23, dir.str() + "/across").params, want.params));
}

// The compact state formats: checkpoints hold the decoded fp32 states, and
// loading encodes them again, giving the bits they had (bf16 exactly; int8's
// codes and scales, StateFormatTest); a resume with another format is
// refused naming both.
TEST(CheckpointTest, CompactStateFormatsResumeBitwise) {
  testing::ScratchDir dir;
  for (OptimizerStates f :
       {OptimizerStates::kBf16, OptimizerStates::kBf16Master, OptimizerStates::kInt8}) {
    SCOPED_TRACE(std::string(OptimizerStatesName(f)));
    // States in DRAM, and on NVMe for int8.
    Config c = BaseConfig(f == OptimizerStates::kInt8 ? OffloadDevice::kNvme : OffloadDevice::kCpu,
                          OffloadDevice::kCpu, dir.str());
    c.strata.optimizer_states = f;
    const std::string root = dir.str() + "/" + std::string(OptimizerStatesName(f));
    const RunResult want = Uninterrupted(c, 31);
    const RunResult got = Resumed(c, c, 31, root);
    EXPECT_TRUE(BitwiseEqual(want.params, got.params));
    EXPECT_TRUE(BitwiseEqual(want.losses, got.losses));
    Config other = c;
    other.strata.optimizer_states =
        f == OptimizerStates::kInt8 ? OptimizerStates::kBf16 : OptimizerStates::kInt8;
    auto e = NewEngine(other, 31);
    ASSERT_TRUE(e);
    CheckpointInfo info;
    const Status s = e->LoadCheckpoint(root, &info);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr(fmt::format("strata.optimizer_states: {} in the checkpoint, {} now",
                                      OptimizerStatesName(f),
                                      OptimizerStatesName(other.strata.optimizer_states))));
  }
}

// Asked explicitly (CheckpointInfo::convert_optimizer_states), a checkpoint
// of one format loads into an engine of another: its fp32 states encoded
// in the new format (a bf16 master rounded to nearest), and the run goes on.
// Not between int8 and the others, whose layouts differ.
TEST(CheckpointTest, ConvertsAnotherStateFormatWhenAsked) {
  testing::ScratchDir dir;
  Config bf16 = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  bf16.strata.optimizer_states = OptimizerStates::kBf16;
  const std::string root = dir.str() + "/ckpt";
  std::vector<std::vector<float>> saved;
  {
    auto e = NewEngine(bf16, 41);
    ASSERT_TRUE(e);
    std::vector<double> losses;
    TrainSteps(*e, bf16, 0, 2, &losses);
    saved = ReadAll(*e);
    CheckpointInfo info;
    ASSERT_TRUE(e->SaveCheckpoint(root, info).ok());
  }
  for (OptimizerStates to : {OptimizerStates::kFp32, OptimizerStates::kBf16Master}) {
    SCOPED_TRACE(std::string(OptimizerStatesName(to)));
    Config c = bf16;
    c.strata.optimizer_states = to;
    auto e = NewEngine(c, 42);
    ASSERT_TRUE(e);
    CheckpointInfo info;
    Status s = e->LoadCheckpoint(root, &info);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("convert_optimizer_states"));
    info.convert_optimizer_states = true;
    s = e->LoadCheckpoint(root, &info);
    ASSERT_TRUE(s.ok()) << s;
    std::vector<std::vector<float>> want = saved;
    if (to == OptimizerStates::kBf16Master)
      for (auto& p : want)
        for (float& v : p) v = Bf16BitsToFloat(FloatToBf16Bits(v));
    EXPECT_TRUE(BitwiseEqual(ReadAll(*e), want));
    std::vector<double> losses;
    TrainSteps(*e, c, 2, 3, &losses);
    EXPECT_TRUE(std::isfinite(losses.back()));
  }
  Config int8 = bf16;
  int8.strata.optimizer_states = OptimizerStates::kInt8;
  auto e = NewEngine(int8, 43);
  ASSERT_TRUE(e);
  CheckpointInfo info;
  info.convert_optimizer_states = true;
  const Status s = e->LoadCheckpoint(root, &info);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("converting its optimizer states from bf16 to int8 is not offered"));
}

TEST(CheckpointTest, LoadsIntoAnotherPlacement) {
  // The format does not depend on where states live: saved from NVMe, loaded
  // into DRAM/HBM and the reverse, the run continues bitwise.
  testing::ScratchDir dir;
  const Config nvme = BaseConfig(OffloadDevice::kNvme, OffloadDevice::kNvme, dir.str());
  const Config mem = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kNone, dir.str());
  const RunResult want = Uninterrupted(mem, 21);
  const RunResult a = Resumed(nvme, mem, 21, dir.str() + "/a");
  const RunResult b = Resumed(mem, nvme, 21, dir.str() + "/b");
  EXPECT_TRUE(BitwiseEqual(want.params, a.params));
  EXPECT_TRUE(BitwiseEqual(want.params, b.params));
  EXPECT_TRUE(BitwiseEqual(want.losses, a.losses));
}

// An engine trained kSaveAt steps and checkpointed into dir/ckpt.
std::unique_ptr<Engine> SavedEngine(const Config& c, const std::string& root, int saves = 1) {
  auto e = NewEngine(c, 5);
  std::vector<double> losses;
  for (int i = 0; i < saves; ++i) {
    TrainSteps(*e, c, i, i + 1, &losses);
    CheckpointInfo info;
    info.data_position = i + 1;
    Status s = e->SaveCheckpoint(root, info);
    EXPECT_TRUE(s.ok()) << s;
  }
  return e;
}

TEST(CheckpointTest, RefusesAnotherConfigOrLayoutNamingTheDifference) {
  testing::ScratchDir dir;
  const std::string root = dir.str() + "/ckpt";
  Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  SavedEngine(c, root);

  Config lr = c;
  lr.optimizer.lr = 2e-2;
  auto e = NewEngine(lr, 9);
  const auto before = ReadAll(*e);
  Status s = e->LoadCheckpoint(root, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.ToString(), HasSubstr("optimizer.params.lr: 0.01 in the checkpoint, 0.02 now"));
  EXPECT_TRUE(BitwiseEqual(before, ReadAll(*e)));  // untouched

  Config sg = c;
  sg.zero_optimization.sub_group_size = 700;
  s = NewEngine(sg, 9)->LoadCheckpoint(root, nullptr);
  EXPECT_THAT(s.ToString(),
              HasSubstr("zero_optimization.sub_group_size: 1000 in the checkpoint, 700 now"));

  auto wider = CreateEngine(c);
  ASSERT_TRUE(wider.ok());
  Register(**wider, 9, /*extra_numel=*/1);
  s = (*wider)->LoadCheckpoint(root, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.ToString(), HasSubstr("parameter m3.weight: numel 591 in the checkpoint, 592 now"));

  // The placement is not part of the identity.
  Config placed = c;
  placed.zero_optimization.offload_optimizer.device = OffloadDevice::kNone;
  EXPECT_TRUE(NewEngine(placed, 9)->LoadCheckpoint(root, nullptr).ok());
}

// Leaf values of a JSON object by key path ("a.b", "a.b[0]").
void Leaves(const nlohmann::json& j, const std::string& path,
            std::vector<std::pair<std::string, nlohmann::json>>* out) {
  if (j.is_object() && !j.empty()) {
    for (const auto& [k, v] : j.items()) Leaves(v, path.empty() ? k : path + "." + k, out);
  } else if (j.is_array() && !j.empty()) {
    for (size_t i = 0; i < j.size(); ++i) Leaves(j[i], path + "[" + std::to_string(i) + "]", out);
  } else {
    out->emplace_back(path, j);
  }
}

nlohmann::json::json_pointer Pointer(const std::string& path) {
  std::string p;
  for (char ch : path) p += ch == '.' || ch == '[' ? '/' : ch == ']' ? '\0' : ch;
  p.erase(std::remove(p.begin(), p.end(), '\0'), p.end());
  return nlohmann::json::json_pointer("/" + p);
}

// Whether the config schema marks `key` (a ConfigToJson path) or a key above
// it as free to differ on resume (its free_on_resume column).
bool SchemaMarksFree(const std::string& key) {
  std::string path = key.substr(0, key.find('['));
  for (;;) {
    const config_internal::KeySpec* k = config_internal::FindKey(path);
    if (k != nullptr && !k->free_on_resume.empty()) return true;
    const size_t dot = path.rfind('.');
    if (dot == std::string::npos) return false;
    path.resize(dot);
  }
}

// Every key of the effective config, changed one at a time: the ones the
// schema marks free (CheckpointFreeKeys) load, every other one is refused
// naming it.
TEST(CheckpointTest, EveryConfigKeyIsComparedButTheFreeOnes) {
  testing::ScratchDir dir;
  Config c = BaseConfig(OffloadDevice::kNvme, OffloadDevice::kCpu, dir.str());
  c.strata.application_sections["model"] =
      R"({"layers": 2, "hidden": 32, "seq_len": 16, "vocab": 256, "seed": 1234, "steps": 0})";
  const std::string base = ConfigToJson(c);
  std::vector<std::pair<std::string, nlohmann::json>> leaves;
  Leaves(nlohmann::json::parse(base), "", &leaves);
  ASSERT_GT(leaves.size(), 50u);
  std::set<std::string> free_seen;
  for (const auto& [key, value] : leaves) {
    SCOPED_TRACE(key);
    nlohmann::json changed = nlohmann::json::parse(base);
    nlohmann::json& v = changed[Pointer(key)];
    if (v.is_boolean())
      v = !v.get<bool>();
    else if (v.is_number_integer())
      v = v.get<int64_t>() + 1;
    else if (v.is_number())
      v = v.get<double>() * 2 + 0.5;
    else if (v.is_string())
      v = v.get<std::string>() + "x";
    else
      v = 1;
    const std::string diff = scheduler::CheckpointConfigDifference(base, changed.dump());
    if (SchemaMarksFree(key)) {
      EXPECT_TRUE(scheduler::CheckpointKeyMayDiffer(key));
      EXPECT_EQ(diff, "");
      for (const scheduler::CheckpointFreeKey& f : scheduler::CheckpointFreeKeys())
        if (key.rfind(f.key, 0) == 0) free_seen.insert(std::string(f.key));
    } else {
      EXPECT_FALSE(scheduler::CheckpointKeyMayDiffer(key));
      EXPECT_THAT(diff, ::testing::StartsWith(key + ": "));
    }
  }
  // The free keys are exactly the schema's marked ones, in its order, with
  // its reasons; each is a key of the config and says why.
  std::vector<std::pair<std::string_view, std::string_view>> marked;
  for (const config_internal::KeySpec& k : config_internal::Schema())
    if (!k.free_on_resume.empty()) marked.emplace_back(k.path, k.free_on_resume);
  ASSERT_EQ(scheduler::CheckpointFreeKeys().size(), marked.size());
  for (size_t i = 0; i < marked.size(); ++i) {
    const scheduler::CheckpointFreeKey& f = scheduler::CheckpointFreeKeys()[i];
    EXPECT_EQ(f.key, marked[i].first);
    EXPECT_EQ(f.reason, marked[i].second);
    EXPECT_TRUE(free_seen.count(std::string(f.key))) << f.key << " is no key of the config";
    EXPECT_GT(f.reason.size(), 10u) << f.key;
  }
  // The arithmetic the issue named: seed, seq_len, micro-batch.
  EXPECT_FALSE(scheduler::CheckpointKeyMayDiffer("strata.model.seed"));
  EXPECT_FALSE(scheduler::CheckpointKeyMayDiffer("strata.model.seq_len"));
  // The global batch is compared; its split over ranks, micro-batches and
  // accumulation may change (a checkpoint loads at another number of ranks).
  EXPECT_FALSE(scheduler::CheckpointKeyMayDiffer("train_batch_size"));
  EXPECT_TRUE(scheduler::CheckpointKeyMayDiffer("train_micro_batch_size_per_gpu"));
  EXPECT_TRUE(scheduler::CheckpointKeyMayDiffer("zero_optimization.offload_param.nvme_path[0]"));
  EXPECT_FALSE(scheduler::CheckpointKeyMayDiffer("zero_optimization.offload_parameters"));
}

TEST(CheckpointTest, ConfigDifferencesThroughTheEngine) {
  testing::ScratchDir dir;
  const std::string root = dir.str() + "/ckpt";
  Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  c.strata.application_sections["model"] = R"({"seed": 1234, "seq_len": 64})";
  SavedEngine(c, root);
  Config seed = c;
  seed.strata.application_sections["model"] = R"({"seed": 99, "seq_len": 32})";
  Status s = NewEngine(seed, 9)->LoadCheckpoint(root, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.ToString(), HasSubstr("strata.model.seed: 1234 in the checkpoint, 99 now (also: "
                                      "strata.model.seq_len)"));
  Config mb = c;
  mb.train_micro_batch_size_per_gpu = 2;
  mb.train_batch_size = 4;
  s = NewEngine(mb, 9)->LoadCheckpoint(root, nullptr);
  EXPECT_THAT(s.ToString(), HasSubstr("train_batch_size: 2 in the checkpoint, 4 now"));
  Config free = c;
  free.strata.threads = 1;
  free.strata.hbm_budget_bytes *= 2;
  free.aio.queue_depth = 3;
  // strata.model.steps: an application's key, marked free in the schema.
  free.strata.application_sections["model"] = R"({"seed": 1234, "seq_len": 64, "steps": 7})";
  EXPECT_TRUE(NewEngine(free, 9)->LoadCheckpoint(root, nullptr).ok());
  // Where the window's sums are kept: the same bits anywhere.
  Config tier = c;
  tier.strata.grad_tier = GradTier::kDram;
  EXPECT_TRUE(NewEngine(tier, 9)->LoadCheckpoint(root, nullptr).ok());
  // An unmarked key of the engine's own: refused.
  Config dpu = c;
  dpu.strata.delayed_param_update = true;
  s = NewEngine(dpu, 9)->LoadCheckpoint(root, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.ToString(),
              HasSubstr("strata.delayed_param_update: false in the checkpoint, true now"));
}

void FlipByte(const std::string& path, int64_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  char b = 0;
  f.read(&b, 1);
  b ^= 0x10;
  f.seekp(at);
  f.write(&b, 1);
}

TEST(CheckpointTest, CorruptTruncatedAndHalfWrittenCheckpoints) {
  testing::ScratchDir dir;
  const std::string root = dir.str() + "/ckpt";
  Config c = BaseConfig(OffloadDevice::kNvme, OffloadDevice::kCpu, dir.str());
  SavedEngine(c, root, /*saves=*/2);
  const std::string first = root + "/ckpt-00000001", second = root + "/ckpt-00000002";
  ASSERT_TRUE(fs::exists(second + "/MANIFEST.json"));

  auto e = NewEngine(c, 9);
  const auto before = ReadAll(*e);
  // A flipped bit in the newest checkpoint's states: refused, naming the file.
  FlipByte(second + "/states.bin", 1234);
  Status s = e->LoadCheckpoint(root, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.ToString(), HasSubstr(second + "/states.bin: crc32c"));
  EXPECT_THAT(s.ToString(), HasSubstr("does not match the manifest"));
  EXPECT_TRUE(BitwiseEqual(before, ReadAll(*e)));
  FlipByte(second + "/states.bin", 1234);  // repaired
  CheckpointInfo info;
  ASSERT_TRUE(e->LoadCheckpoint(root, &info).ok());
  EXPECT_EQ(info.data_position, 2);

  // Truncated parameters.
  const auto size = fs::file_size(second + "/params.bin");
  fs::resize_file(second + "/params.bin", size - 10);
  s = e->LoadCheckpoint(root, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.ToString(), HasSubstr(second + "/params.bin: " + std::to_string(size - 10) +
                                      " bytes, the manifest says " + std::to_string(size)));

  // The loader can be pointed at an older checkpoint directly.
  ASSERT_TRUE(e->LoadCheckpoint(first, &info).ok());
  EXPECT_EQ(info.data_position, 1);

  // A save interrupted before its manifest was renamed into place (its data
  // and a temporary manifest on disk) is not a checkpoint: the previous one
  // loads.
  fs::remove(second + "/MANIFEST.json");
  fs::create_directory(root + "/ckpt-00000003");
  std::ofstream(root + "/ckpt-00000003/MANIFEST.json.tmp") << "{\"format\": \"strata-chec";
  ASSERT_TRUE(e->LoadCheckpoint(root, &info).ok());
  EXPECT_EQ(info.data_position, 1);
  EXPECT_EQ(info.path, first);

  // The next save is number 4; it removes the interrupted ones and keeps two.
  std::vector<double> losses;
  TrainSteps(*e, c, 1, 2, &losses);
  ASSERT_TRUE(e->SaveCheckpoint(root, {}).ok());
  TrainSteps(*e, c, 2, 3, &losses);
  ASSERT_TRUE(e->SaveCheckpoint(root, {}).ok());
  std::vector<std::string> left;
  for (const auto& d : fs::directory_iterator(root)) left.push_back(d.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_THAT(left, ::testing::ElementsAre("LOCK", "ckpt-00000004", "ckpt-00000005"));

  // Nothing there at all.
  s = e->LoadCheckpoint(dir.str() + "/none", nullptr);
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s;
}

TEST(CheckpointTest, AnEditedManifestIsRefusedASkippedSaveIsLogged) {
  testing::ScratchDir dir;
  const Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  const std::string root = dir.str() + "/ckpt";
  SavedEngine(c, root, /*saves=*/2);
  const std::string manifest = root + "/ckpt-00000002/MANIFEST.json";
  std::string text;
  {
    std::ifstream f(manifest);
    text.assign(std::istreambuf_iterator<char>(f), {});
  }
  const size_t at = text.find("\"optimizer_step\": 2");
  ASSERT_NE(at, std::string::npos);
  std::string edited = text;
  edited.replace(at, 19, "\"optimizer_step\": 1");
  std::ofstream(manifest) << edited;
  auto e = NewEngine(c, 9);
  Status s = e->LoadCheckpoint(root, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.ToString(), HasSubstr("checkpoint manifest " + manifest + ": its content has"));
  EXPECT_THAT(s.ToString(), HasSubstr("(edited or corrupt)"));
  std::ofstream(manifest) << text;
  // A newer directory without a manifest is skipped, named in one line.
  fs::create_directory(root + "/ckpt-00000003");
  ::testing::internal::CaptureStderr();
  CheckpointInfo info;
  s = e->LoadCheckpoint(root, &info);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(info.optimizer_step, 2);
  EXPECT_THAT(log, HasSubstr("skipped the newer " + root +
                             "/ckpt-00000003 (no MANIFEST.json: an interrupted save)"));
}

TEST(CheckpointTest, AManifestOfFormatOneIsRefusedSayingWhy) {
  testing::ScratchDir dir;
  const Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  const std::string root = dir.str() + "/ckpt";
  fs::create_directories(root + "/ckpt-00000001");
  std::ofstream(root + "/ckpt-00000001/MANIFEST.json")
      << R"({"format": "strata-checkpoint", "version": 1, "sequence": 1})";
  Status s = NewEngine(c, 9)->LoadCheckpoint(root, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s;
  EXPECT_THAT(s.ToString(), HasSubstr("format version 1, this build reads versions 2 to 4"));
}

// Version 3 had one states.bin and no list of states files: such a
// manifest loads the same values as the version-4 one.
TEST(CheckpointTest, AVersionThreeCheckpointLoads) {
  testing::ScratchDir dir;
  const Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kNone, dir.str());
  const std::string root = dir.str() + "/ckpt";
  SavedEngine(c, root);
  auto a = NewEngine(c, 9);
  ASSERT_TRUE(a->LoadCheckpoint(root, nullptr).ok());  // as saved (version 4)
  const auto loaded = testing::ReadAll(*a);
  a.reset();  // drops the root's lock
  const std::string manifest = root + "/ckpt-00000001/MANIFEST.json";
  std::string text;
  {
    std::ifstream f(manifest);
    text.assign(std::istreambuf_iterator<char>(f), {});
  }
  nlohmann::ordered_json m = nlohmann::ordered_json::parse(text);
  ASSERT_EQ(m.at("states").size(), 1u);
  EXPECT_EQ(m.at("states")[0].at("file"), "states.bin");
  m["version"] = scheduler::kSingleStatesFileVersion;
  m.erase("states");
  m.erase("ranks");
  m.erase("manifest_crc32c");
  const std::string content = m.dump();
  m["manifest_crc32c"] = fmt::format("{:08x}", Crc32c(content.data(), content.size()));
  std::ofstream(manifest) << m.dump();
  auto b = NewEngine(c, 9);
  ASSERT_TRUE(b->LoadCheckpoint(root, nullptr).ok());
  EXPECT_TRUE(testing::BitwiseEqual(loaded, testing::ReadAll(*b)));
  auto in = scheduler::InspectCheckpoint(root, /*verify=*/true);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_TRUE(in->validity.ok()) << in->validity;
  EXPECT_EQ(in->version, scheduler::kSingleStatesFileVersion);
}

// Version 2 laid the optimizer states out densely; this build starts each
// tensor on a multiple of 4 elements. The toy model has a 397-element tensor
// (module 1) before others, so a version-2 checkpoint of it would be read
// from the wrong offsets: refused, naming the version and the tensor that
// moves, on restore and on inspection alike.
TEST(CheckpointTest, ADenseVersionTwoCheckpointWhoseTensorsMoveIsRefused) {
  testing::ScratchDir dir;
  const Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  const std::string root = dir.str() + "/ckpt";
  SavedEngine(c, root);
  const std::string manifest = root + "/ckpt-00000001/MANIFEST.json";
  std::string text;
  {
    std::ifstream f(manifest);
    text.assign(std::istreambuf_iterator<char>(f), {});
  }
  nlohmann::json m = nlohmann::json::parse(text);
  EXPECT_EQ(m.at("version"), scheduler::kCheckpointFormatVersion);
  m["version"] = scheduler::kDenseLayoutCheckpointVersion;
  m.erase("manifest_crc32c");
  const std::string content = m.dump();
  m["manifest_crc32c"] = fmt::format("{:08x}", Crc32c(content.data(), content.size()));
  std::ofstream(manifest) << m.dump();
  Status s = NewEngine(c, 9)->LoadCheckpoint(root, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kNotSupported) << s;
  EXPECT_THAT(s.ToString(), HasSubstr("format version 2 stores the optimizer states densely"));
  EXPECT_THAT(s.ToString(), HasSubstr("this build reads version 4"));
  // m0: 300 + 20, m1.weight: 397 elements; m1.bias would start at 720.
  EXPECT_THAT(s.ToString(), HasSubstr("tensor m1.bias would move (the tensors before it hold 717"));
  auto in = scheduler::InspectCheckpoint(root + "/ckpt-00000001", /*verify=*/false);
  EXPECT_EQ(in.status().code(), StatusCode::kNotSupported) << in.status();
}

TEST(CheckpointTest, ResumeRemovesWhatAnInterruptedCleanupLeft) {
  // A save of checkpoint 4 killed after its rename, while removing number 2
  // (its manifest gone, its data left): a resume that has nothing left to
  // train saves nothing, so the load itself tidies: 3 and 4 are left.
  testing::ScratchDir dir;
  const Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  const std::string root = dir.str() + "/ckpt";
  auto e = SavedEngine(c, root, /*saves=*/3);
  fs::copy(root + "/ckpt-00000003", root + "/ckpt-00000004");
  ASSERT_TRUE(fs::remove(root + "/ckpt-00000002/MANIFEST.json"));
  CheckpointInfo info;
  Status s = e->LoadCheckpoint(root, &info);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(info.path, root + "/ckpt-00000004");
  std::vector<std::string> left;
  for (const auto& d : fs::directory_iterator(root)) left.push_back(d.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_THAT(left, ::testing::ElementsAre("LOCK", "ckpt-00000003", "ckpt-00000004"));
  // Pointed at one checkpoint directly, the loader leaves its siblings alone.
  fs::create_directory(root + "/ckpt-00000001");
  ASSERT_TRUE(e->LoadCheckpoint(root + "/ckpt-00000003", &info).ok());
  EXPECT_TRUE(fs::exists(root + "/ckpt-00000001"));
}

std::vector<std::string> Listing(const std::string& root) {
  std::vector<std::string> left;
  for (const auto& d : fs::directory_iterator(root)) left.push_back(d.path().filename().string());
  std::sort(left.begin(), left.end());
  return left;
}

TEST(CheckpointTest, AnotherRunsCheckpointsAreRefusedNeverRemoved) {
  testing::ScratchDir dir;
  const Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  const std::string root = dir.str() + "/ckpt";
  std::string first_run;
  {
    auto a = SavedEngine(c, root, /*saves=*/2);
    CheckpointInfo info;
    ASSERT_TRUE(a->LoadCheckpoint(root, &info).ok());
    first_run = info.run_id;
  }
  ASSERT_EQ(first_run.size(), 16u);
  // A fresh engine is another run: its save is refused, naming what is there.
  auto b = NewEngine(c, 7);
  std::vector<double> losses;
  TrainSteps(*b, c, 0, 1, &losses);
  Status s = b->SaveCheckpoint(root, {});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.ToString(), HasSubstr("holds 2 checkpoints of run " + first_run + " up to step 2"));
  CheckpointInfo mine;
  mine.run_id = "0123456789abcdef";
  s = b->SaveCheckpoint(root, mine);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(Listing(root), ::testing::ElementsAre("LOCK", "ckpt-00000001", "ckpt-00000002"));
  // Loaded, the run continues that lineage: its saves prune its own.
  CheckpointInfo info;
  ASSERT_TRUE(b->LoadCheckpoint(root, &info).ok());
  EXPECT_EQ(info.run_id, first_run);
  TrainSteps(*b, c, 2, 3, &losses);
  ASSERT_TRUE(b->SaveCheckpoint(root, {}).ok());
  EXPECT_THAT(Listing(root), ::testing::ElementsAre("LOCK", "ckpt-00000002", "ckpt-00000003"));
  ASSERT_TRUE(b->LoadCheckpoint(root, &info).ok());
  EXPECT_EQ(info.run_id, first_run);
  EXPECT_EQ(info.path, root + "/ckpt-00000003");
}

TEST(CheckpointTest, ARootLockedByAnotherProcessIsRefusedNamingTheHolder) {
  testing::ScratchDir dir;
  const Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  const std::string root = dir.str() + "/ckpt";
  SavedEngine(c, root, /*saves=*/1);
  // Another open file description of the lock file stands for another
  // process (flock conflicts between them).
  const int fd = ::open((root + "/LOCK").c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  const std::string holder = "pid 4242 run feedfacecafebeef\n";
  ASSERT_EQ(::ftruncate(fd, 0), 0);
  ASSERT_EQ(::pwrite(fd, holder.data(), holder.size(), 0), static_cast<ssize_t>(holder.size()));
  auto e = NewEngine(c, 5);
  Status s = e->LoadCheckpoint(root, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_THAT(s.ToString(), HasSubstr("in use by another run (pid 4242 run feedfacecafebeef; " +
                                      root + "/LOCK is locked)"));
  std::vector<double> losses;
  TrainSteps(*e, c, 0, 1, &losses);
  s = e->SaveCheckpoint(root, {});
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_THAT(Listing(root), ::testing::ElementsAre("LOCK", "ckpt-00000001"));
  ::close(fd);
  // Released: the engine loads, then holds the root until it is destroyed.
  ASSERT_TRUE(e->LoadCheckpoint(root, nullptr).ok());
  const int again = ::open((root + "/LOCK").c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(again, 0);
  EXPECT_NE(::flock(again, LOCK_EX | LOCK_NB), 0);
  e.reset();
  EXPECT_EQ(::flock(again, LOCK_EX | LOCK_NB), 0);
  ::close(again);
}

TEST(CheckpointTest, SaveInTheMiddleOfAWindowIsRefused) {
  testing::ScratchDir dir;
  Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  auto e = NewEngine(c, 3);
  MicroBatch(*e, 0);
  ASSERT_TRUE(e->Step().ok());  // 1 of 2 micro-batches
  Status s = e->SaveCheckpoint(dir.str() + "/ckpt", {});
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.ToString(), HasSubstr("1 of 2 micro-batches"));
  EXPECT_FALSE(fs::exists(dir.str() + "/ckpt/ckpt-00000001"));
  MicroBatch(*e, 1);
  ASSERT_TRUE(e->Step().ok());
  EXPECT_TRUE(e->SaveCheckpoint(dir.str() + "/ckpt", {}).ok());
}

// One optimizer step through the C API of an engine with one module of one
// 700-element fp32 parameter: gradients 0.01 (i % 7).
void CApiOneStep(strata_engine* e) {
  void* p[1];
  void* g[1];
  int n = 0;
  ASSERT_EQ(strata_before_forward(e, 0, p, 1, &n), 0);
  ASSERT_EQ(strata_after_forward(e, 0), 0);
  ASSERT_EQ(strata_before_backward(e, 0, p, g, 1, &n), 0);
  for (int i = 0; i < 700; ++i) static_cast<float*>(g[0])[i] = 0.01f * static_cast<float>(i % 7);
  ASSERT_EQ(strata_after_backward(e, 0), 0);
  ASSERT_EQ(strata_step(e, nullptr), 0);
}

// strata_load_checkpoint_flags: another state format is refused without
// STRATA_LOAD_CONVERT_OPTIMIZER_STATES and loaded with it; unknown bits are
// refused naming them.
TEST(CheckpointTest, CApiConvertsAnotherStateFormatWithTheFlag) {
  testing::ScratchDir dir;
  auto json = [](const char* states) {
    return fmt::format(R"({{"bf16": {{"enabled": true}}, "zero_optimization": {{"stage": 3,
        "offload_optimizer": {{"device": "cpu"}}, "offload_param": {{"device": "cpu"}}}},
      "strata": {{"device": "host", "hbm_budget": "8M", "threads": 2,
        "optimizer_states": "{}"}}}})",
                       states);
  };
  auto make = [&](const char* states, const float* init) {
    strata_engine* e = nullptr;
    EXPECT_EQ(strata_engine_create_from_json(json(states).c_str(), &e), STRATA_OK)
        << strata_last_error();
    if (e == nullptr) return e;
    EXPECT_EQ(strata_register_parameter(e, "w", 700, STRATA_FP32, 0, init, nullptr), 0);
    return e;
  };
  std::vector<float> init(700);
  for (int i = 0; i < 700; ++i) init[static_cast<size_t>(i)] = 0.001f * static_cast<float>(i % 97);
  strata_engine* a = make("bf16", init.data());
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(strata_plan(a), 0) << strata_last_error();
  CApiOneStep(a);
  const std::string root = dir.str() + "/ckpt";
  ASSERT_EQ(strata_save_checkpoint(a, root.c_str(), 7, nullptr), 0) << strata_last_error();
  std::vector<float> want(700), got(700);
  ASSERT_EQ(strata_read_parameter(a, 0, want.data(), 700), 0);
  strata_engine_destroy(a);

  strata_engine* b = make("fp32", nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(strata_load_checkpoint(b, root.c_str(), nullptr, nullptr, nullptr, 0, nullptr),
            STRATA_FAILED_PRECONDITION);
  EXPECT_THAT(strata_last_error(), HasSubstr("bf16"));
  EXPECT_EQ(
      strata_load_checkpoint_flags(b, root.c_str(), 6u, nullptr, nullptr, nullptr, 0, nullptr),
      STRATA_INVALID_ARGUMENT);
  EXPECT_THAT(strata_last_error(), HasSubstr("unknown flags 0x6"));
  int64_t pos = 0, step = 0;
  ASSERT_EQ(strata_load_checkpoint_flags(b, root.c_str(), STRATA_LOAD_CONVERT_OPTIMIZER_STATES,
                                         &pos, &step, nullptr, 0, nullptr),
            0)
      << strata_last_error();
  EXPECT_EQ(pos, 7);
  EXPECT_EQ(step, 1);
  ASSERT_EQ(strata_read_parameter(b, 0, got.data(), 700), 0);
  EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * 4));
  strata_engine_destroy(b);
}

TEST(CheckpointTest, CApiRoundTrip) {
  testing::ScratchDir dir;
  const std::string json = R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    "strata": {"device": "host", "hbm_budget": "8M", "threads": 2}})";
  strata_engine* a = nullptr;
  ASSERT_EQ(strata_engine_create_from_json(json.c_str(), &a), STRATA_OK) << strata_last_error();
  std::vector<float> init(700, 0.25f);
  ASSERT_EQ(strata_register_parameter(a, "w", 700, STRATA_FP32, 0, init.data(), nullptr), 0);
  ASSERT_EQ(strata_plan(a), 0);
  CApiOneStep(a);
  const std::string root = dir.str() + "/ckpt";
  ASSERT_EQ(strata_save_checkpoint(a, root.c_str(), 42, "loader state"), 0) << strata_last_error();
  std::vector<float> want(700), got(700);
  ASSERT_EQ(strata_read_parameter(a, 0, want.data(), 700), 0);
  strata_engine_destroy(a);

  strata_engine* b = nullptr;
  ASSERT_EQ(strata_engine_create_from_json(json.c_str(), &b), STRATA_OK);
  ASSERT_EQ(strata_register_parameter(b, "w", 700, STRATA_FP32, 0, nullptr, nullptr), 0);
  int64_t pos = 0, step = 0;
  char note[8];
  size_t needed = 0;
  ASSERT_EQ(strata_load_checkpoint(b, root.c_str(), &pos, &step, note, sizeof(note), &needed), 0)
      << strata_last_error();
  EXPECT_EQ(pos, 42);
  EXPECT_EQ(step, 1);
  EXPECT_EQ(needed, 13u);
  EXPECT_STREQ(note, "loader ");  // truncated to the buffer, NUL-terminated
  ASSERT_EQ(strata_read_parameter(b, 0, got.data(), 700), 0);
  EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * 4));
  EXPECT_NE(got[1], 0.25f);
  EXPECT_EQ(strata_load_checkpoint(b, (dir.str() + "/none").c_str(), nullptr, nullptr, nullptr, 0,
                                   nullptr),
            STRATA_NOT_FOUND);
  EXPECT_THAT(strata_last_error(), HasSubstr("no checkpoint in"));
  std::vector<float> fresh(700, -1.5f);
  fresh[699] = 3.0f;
  ASSERT_EQ(strata_write_parameter(b, 0, fresh.data(), 700), 0) << strata_last_error();
  ASSERT_EQ(strata_read_parameter(b, 0, got.data(), 700), 0);
  EXPECT_EQ(got, fresh);
  EXPECT_EQ(strata_write_parameter(b, 0, fresh.data(), 5), STRATA_INVALID_ARGUMENT);
  EXPECT_THAT(strata_last_error(), HasSubstr("5 floats given, parameter has 700"));
  strata_engine_destroy(b);
}

// WriteParameter (a framework's load_state_dict): the written values are the
// master and the working copy wherever they live; writing back what
// ReadParameter returned changes nothing (moments and step count kept, the
// run continues bitwise); in the middle of a window it is refused.
class WriteParameterTest
    : public ::testing::TestWithParam<std::tuple<OffloadDevice, OffloadDevice>> {};

TEST_P(WriteParameterTest, ValuesLandEverywhereAndMomentsAreKept) {
  testing::ScratchDir dir;
  const auto [opt, par] = GetParam();
  const Config c = BaseConfig(opt, par, dir.str());
  const RunResult want = Uninterrupted(c, 31);

  auto e = NewEngine(c, 31);
  ASSERT_TRUE(e);
  RunResult got;
  TrainSteps(*e, c, 0, kSaveAt, &got.losses);
  // Same values back: nothing may change.
  for (int id = 0; id < e->num_parameters(); ++id) {
    std::vector<float> v(static_cast<size_t>(Numel(id / 2, id % 2)));
    ASSERT_TRUE(e->ReadParameter(id, v).ok());
    Status s = e->WriteParameter(id, v);
    ASSERT_TRUE(s.ok()) << s;
  }
  TrainSteps(*e, c, kSaveAt, kSteps, &got.losses);
  EXPECT_TRUE(BitwiseEqual(want.losses, got.losses));
  EXPECT_TRUE(BitwiseEqual(want.params, ReadAll(*e)));

  // An evaluation pass leaves modules on the device: they must not be used stale.
  for (int m = 0; m < kModules; ++m) {
    ASSERT_TRUE(e->BeforeForward(m).ok());
    ASSERT_TRUE(e->AfterForward(m).ok());
  }
  // New values: read back exactly; the device sees them rounded to the dtype.
  auto rng = testing::SeededRng(77);
  std::vector<std::vector<float>> fresh;
  for (int id = 0; id < e->num_parameters(); ++id) {
    fresh.push_back(
        testing::RandomFloats(rng, static_cast<size_t>(Numel(id / 2, id % 2)), -2.f, 2.f));
    Status s = e->WriteParameter(id, fresh.back());
    ASSERT_TRUE(s.ok()) << s;
  }
  EXPECT_TRUE(BitwiseEqual(fresh, ReadAll(*e)));
  for (int m = 0; m < kModules; ++m) {
    auto v = e->BeforeForward(m);
    ASSERT_TRUE(v.ok()) << v.status();
    for (int i = 0; i < 2; ++i) {
      const std::vector<float>& want_v = fresh[static_cast<size_t>(2 * m + i)];
      std::vector<uint8_t> rounded(want_v.size() * 4);
      for (size_t j = 0; j < want_v.size(); ++j)
        Store(rounded.data(), DTypeOf(m, i), static_cast<int64_t>(j), want_v[j]);
      for (int64_t j = 0; j < Numel(m, i); ++j)
        ASSERT_EQ(Load(v->params[i], DTypeOf(m, i), j), Load(rounded.data(), DTypeOf(m, i), j))
            << "module " << m << " tensor " << i << " element " << j;
    }
    ASSERT_TRUE(e->AfterForward(m).ok());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Placements, WriteParameterTest,
    ::testing::Values(std::make_tuple(OffloadDevice::kNone, OffloadDevice::kNone),
                      std::make_tuple(OffloadDevice::kCpu, OffloadDevice::kNone),
                      std::make_tuple(OffloadDevice::kCpu, OffloadDevice::kCpu),
                      std::make_tuple(OffloadDevice::kNvme, OffloadDevice::kNvme)),
    testing::PlacementPairName);

TEST(WriteParameterRulesTest, BeforePlanReplacesTheInitialValuesAndMidWindowIsRefused) {
  testing::ScratchDir dir;
  Config c = BaseConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, dir.str());
  auto e = NewEngine(c, 3);
  std::vector<float> v(static_cast<size_t>(Numel(0, 0)), 0.125f);
  ASSERT_TRUE(e->WriteParameter(0, v).ok());
  std::vector<float> out(v.size());
  ASSERT_TRUE(e->ReadParameter(0, out).ok());
  EXPECT_EQ(out, v);
  ASSERT_TRUE(e->Plan().ok());
  ASSERT_TRUE(e->ReadParameter(0, out).ok());
  EXPECT_EQ(out, v);
  EXPECT_EQ(e->WriteParameter(0, std::vector<float>(3)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e->WriteParameter(99, v).code(), StatusCode::kInvalidArgument);
  MicroBatch(*e, 0);
  ASSERT_TRUE(e->Step().ok());  // 1 of 2 micro-batches
  Status s = e->WriteParameter(0, v);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.ToString(), HasSubstr("1 of 2 micro-batches"));
}

std::string FileText(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// The lock file removed while a run holds it: with nobody else on the root,
// the next save (LockCheckpointDir of the held root) creates it anew and
// locks it again; after another process created and locked a new one (a
// second run let in), the first run's next save is refused, naming the file,
// and the second keeps its lock.
TEST(CheckpointLock, ALockFileRemovedUnderTheRunIsRecheckedAtEachSave) {
  testing::ScratchDir dir;
  const std::string root = dir.str() + "/c", lock_path = root + "/LOCK";
  StatusOr<std::shared_ptr<scheduler::CheckpointDirLock>> held =
      scheduler::LockCheckpointDir(root, "run1");
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  // Removed, nobody else there: re-created and locked.
  ASSERT_EQ(::unlink(lock_path.c_str()), 0);
  StatusOr<std::shared_ptr<scheduler::CheckpointDirLock>> again =
      scheduler::LockCheckpointDir(root, "");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->get(), held->get());
  {
    const int fd = ::open(lock_path.c_str(), O_RDWR | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    EXPECT_NE(::flock(fd, LOCK_EX | LOCK_NB), 0);  // this process holds the new file
    ::close(fd);
  }
  EXPECT_THAT(FileText(lock_path), HasSubstr("run run1"));
  // Removed, and a second process (run) takes a new lock file first.
  ASSERT_EQ(::unlink(lock_path.c_str()), 0);
  int ready[2], stop[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(stop), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    const char ok = fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) == 0 ? 'y' : 'n';
    if (::write(ready[1], &ok, 1) != 1) ::_exit(2);
    char c;
    if (::read(stop[0], &c, 1) < 0) ::_exit(3);
    ::_exit(ok == 'y' ? 0 : 1);
  }
  char ok = 0;
  ASSERT_EQ(::read(ready[0], &ok, 1), 1);
  EXPECT_EQ(ok, 'y');  // the second run got in
  StatusOr<std::shared_ptr<scheduler::CheckpointDirLock>> refused =
      scheduler::LockCheckpointDir(root, "");
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_THAT(refused.status().message(), HasSubstr("checkpoint lock file " + lock_path +
                                                    " was replaced while this run held it"));
  // A save of the first run through the engine is refused the same way.
  testing::ScratchDir nvme;
  Config c = testing::ToyConfig(OffloadDevice::kCpu, OffloadDevice::kNone, nvme.str());
  StatusOr<std::unique_ptr<Engine>> e = Engine::Create(c);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  testing::RegisterToy(**e, 7, kModules);
  ASSERT_TRUE((*e)->Plan().ok());
  CheckpointInfo info;
  const Status save = (*e)->SaveCheckpoint(root, info);
  EXPECT_EQ(save.code(), StatusCode::kUnavailable) << save.ToString();
  EXPECT_THAT(save.ToString(), HasSubstr(lock_path));
  EXPECT_FALSE(fs::exists(root + "/ckpt-00000001"));
  ASSERT_EQ(::write(stop[1], "x", 1), 1);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  for (int fd : {ready[0], ready[1], stop[0], stop[1]}) ::close(fd);
}

// A symlink planted as the lock file is never followed: refused, naming it.
TEST(CheckpointLock, ASymlinkAsTheLockFileIsRefused) {
  testing::ScratchDir dir;
  const std::string root = dir.str() + "/c", victim = dir.str() + "/victim";
  fs::create_directories(root);
  std::ofstream(victim) << "precious";
  ASSERT_EQ(::symlink(victim.c_str(), (root + "/LOCK").c_str()), 0);
  StatusOr<std::shared_ptr<scheduler::CheckpointDirLock>> l =
      scheduler::LockCheckpointDir(root, "run1");
  EXPECT_EQ(l.status().code(), StatusCode::kIOError);
  EXPECT_THAT(l.status().message(), HasSubstr(root + "/LOCK: a symbolic link"));
  EXPECT_EQ(FileText(victim), "precious");
}

// Several ranks: a rank's swap directory (nvme_path/rank-<k>) that is a
// symlink, or a directory of another user or open to others, is refused
// before anything is written; one created gets mode 0700.
TEST(RankSwapDir, OnlyADirectoryOfThisUserIsUsed) {
  testing::ScratchDir dir;
  const std::string nvme = dir.str() + "/nvme", elsewhere = dir.str() + "/elsewhere";
  fs::create_directories(nvme);
  fs::create_directories(elsewhere);
  setenv("WORLD_SIZE", "2", 1);
  setenv("RANK", "0", 1);
  setenv("LOCAL_RANK", "0", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "29500", 1);
  setenv("STRATA_GLOO_DIR", (dir.str() + "/gloo").c_str(), 1);
  setenv("STRATA_COMM_TIMEOUT_S", "1", 1);
  auto create = [&] {
    Config c = testing::ToyConfig(OffloadDevice::kNvme, OffloadDevice::kNone, nvme);
    c.train_batch_size = 2;  // one micro-batch on each of the two ranks
    return Engine::Create(c).status();
  };
  ASSERT_EQ(::symlink(elsewhere.c_str(), (nvme + "/rank-0").c_str()), 0);
  Status s = create();
  EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  EXPECT_THAT(s.ToString(), HasSubstr(nvme + "/rank-0: a symbolic link, not a directory"));
  ASSERT_EQ(::unlink((nvme + "/rank-0").c_str()), 0);
  ASSERT_EQ(::mkdir((nvme + "/rank-0").c_str(), 0700), 0);
  ASSERT_EQ(::chmod((nvme + "/rank-0").c_str(), 0777), 0);
  s = create();
  EXPECT_THAT(s.ToString(), HasSubstr(nvme + "/rank-0: writable by group or others"));
  if (::geteuid() == 0) {
    ASSERT_EQ(::chmod((nvme + "/rank-0").c_str(), 0700), 0);
    ASSERT_EQ(::chown((nvme + "/rank-0").c_str(), 12345, 12345), 0);
    s = create();
    EXPECT_THAT(s.ToString(), HasSubstr(nvme + "/rank-0: owned by uid 12345"));
  }
  fs::remove_all(nvme + "/rank-0");
  const mode_t old = ::umask(022);
  s = create();  // goes on to the rendezvous, which has no peer: not checked here
  ::umask(old);
  struct stat st;
  ASSERT_EQ(::lstat((nvme + "/rank-0").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0700u);
  for (const char* v : {"WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "STRATA_GLOO_DIR", "STRATA_COMM_TIMEOUT_S"})
    unsetenv(v);
  for (auto& d : fs::recursive_directory_iterator(elsewhere))
    ADD_FAILURE() << "written through the symlink: " << d.path();
}

}  // namespace
}  // namespace strata
