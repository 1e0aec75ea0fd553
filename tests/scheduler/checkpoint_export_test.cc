// Checkpoints read without an engine: InspectCheckpoint reports what a
// checkpoint written by a small engine holds and whether it verifies;
// ExportCheckpoint writes safetensors whose fp32 tensors equal ReadParameter
// bitwise and whose training-dtype tensors equal the engine's working copies
// byte for byte; a corrupt states.bin is refused naming it; the file is mode
// 0600 and a symlink at <out>.tmp or <out> is not followed.
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "src/common/crc32c.h"
#include "src/common/dtype.h"
#include "src/scheduler/checkpoint.h"
#include "src/scheduler/checkpoint_format.h"
#include "src/scheduler/scheduler.h"
#include "strata/engine.h"
#include "tests/scheduler/toy_engine_model.h"
#include "tests/test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using scheduler::ExportCheckpoint;
using scheduler::ExportPrecision;
using scheduler::InspectCheckpoint;
using ::testing::HasSubstr;

constexpr int kModules = 5;

struct Trained {
  std::string root;
  std::vector<std::vector<float>> masters;    // ReadParameter, registration order
  std::vector<std::vector<uint8_t>> working;  // the working-precision bytes
  std::vector<std::string> names;
};

// Trains a toy engine 3 steps (sub-groups of 1000 elements split parameters)
// with its optimizer states in `states`, saves a checkpoint under root, and
// records what the engine holds.
Trained TrainAndSave(const std::string& root, OptimizerStates states = OptimizerStates::kFp32) {
  Trained t;
  t.root = root;
  Config c = testing::ToyConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, "");
  c.strata.optimizer_states = states;
  auto created = CreateEngine(c);
  EXPECT_TRUE(created.ok()) << created.status();
  if (!created.ok()) return t;
  Engine& e = **created;
  testing::RegisterToy(e, 7, kModules);
  for (int step = 0; step < 3; ++step) {
    for (int m = 0; m < kModules; ++m) {
      EXPECT_TRUE(e.BeforeForward(m).ok());
      EXPECT_TRUE(e.AfterForward(m).ok());
    }
    for (int m = kModules - 1; m >= 0; --m) {
      auto v = e.BeforeBackward(m);
      EXPECT_TRUE(v.ok()) << v.status();
      if (!v.ok()) return t;
      for (int i = 0; i < 2; ++i)
        for (int64_t j = 0; j < testing::ToyNumel(m, i); ++j) {
          const float p = testing::Load(v->params[i], testing::ToyDType(m, i), j);
          testing::Store(v->grads[i], testing::ToyDType(m, i), j,
                         0.5f * p + 0.1f * std::sin(static_cast<float>(step) + 0.37f * j + m));
        }
      EXPECT_TRUE(e.AfterBackward(m).ok());
    }
    auto st = e.Step();
    EXPECT_TRUE(st.ok()) << st.status();
  }
  CheckpointInfo info;
  Status s = e.SaveCheckpoint(root, info);
  EXPECT_TRUE(s.ok()) << s;
  t.masters = testing::ReadAll(e);
  for (int m = 0; m < kModules; ++m) {
    auto v = e.BeforeForward(m);
    EXPECT_TRUE(v.ok()) << v.status();
    if (!v.ok()) return t;
    for (int i = 0; i < 2; ++i) {
      const auto* p = static_cast<const uint8_t*>(v->params[i]);
      t.working.emplace_back(p, p + testing::ToyNumel(m, i) *
                                        static_cast<int64_t>(DTypeSize(testing::ToyDType(m, i))));
      t.names.push_back("m" + std::to_string(m) + (i == 0 ? ".weight" : ".bias"));
    }
    EXPECT_TRUE(e.AfterForward(m).ok());
  }
  return t;
}

struct Tensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// A plain safetensors reader: 8-byte little-endian header length, JSON
// header, data.
std::map<std::string, Tensor> ReadSafetensors(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(f)), {});
  std::map<std::string, Tensor> out;
  EXPECT_GE(all.size(), 8u);
  if (all.size() < 8) return out;
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<uint8_t>(all[i])} << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  const auto header = nlohmann::json::parse(all.substr(8, n));
  size_t end = 0;
  for (const auto& [k, v] : header.items()) {
    if (k == "__metadata__") continue;
    Tensor t;
    t.dtype = v["dtype"];
    t.shape = v["shape"].get<std::vector<int64_t>>();
    const size_t b = v["data_offsets"][0], e = v["data_offsets"][1];
    EXPECT_LE(8 + n + e, all.size());
    t.bytes.assign(all.begin() + static_cast<long>(8 + n + b),
                   all.begin() + static_cast<long>(8 + n + e));
    end = std::max(end, e);
    out[k] = std::move(t);
  }
  EXPECT_EQ(8 + n + end, all.size()) << "data beyond the last tensor";
  return out;
}

class CheckpointExportTest : public ::testing::Test {
 protected:
  testing::ScratchDir dir_;
};

TEST_F(CheckpointExportTest, InspectReportsIdentityAndVerifies) {
  const Trained t = TrainAndSave(dir_.str() + "/ckpt");
  ASSERT_FALSE(t.masters.empty());
  auto in = InspectCheckpoint(t.root);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_TRUE(in->validity.ok()) << in->validity;
  EXPECT_THAT(in->path, HasSubstr("ckpt-00000001"));
  EXPECT_EQ(in->optimizer_step, 3);
  EXPECT_EQ(in->version, scheduler::kCheckpointFormatVersion);
  EXPECT_FALSE(in->run_id.empty());
  EXPECT_EQ(in->model_dtype, "fp32");
  EXPECT_DOUBLE_EQ(in->lr, 1e-2);
  EXPECT_EQ(in->sub_group_size, 1000);
  EXPECT_EQ(in->layout.params().size(), size_t{2 * kModules});
  int64_t elems = 0;
  for (int m = 0; m < kModules; ++m) elems += testing::ToyNumel(m, 0) + testing::ToyNumel(m, 1);
  EXPECT_EQ(in->layout.param_elems(), elems);
  EXPECT_GE(in->layout.total_elems(), elems);  // with the alignment padding (layout.h)
  ASSERT_EQ(in->files.size(), 2u);
  for (const auto& f : in->files) {
    EXPECT_TRUE(f.ok) << f.name;
    EXPECT_EQ(f.actual_bytes, f.bytes);
  }
  // The ckpt-<N> directory itself gives the same.
  auto one = InspectCheckpoint(in->path);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->path, in->path);
}

// (Each optimizer state format: the checkpoint holds the states as fp32; with
// int8 the layout starts every tensor on a 256-element block.)
TEST_F(CheckpointExportTest, Fp32EqualsReadParameterAndTrainBytesEqualWorkingCopies) {
  for (OptimizerStates states :
       {OptimizerStates::kFp32, OptimizerStates::kBf16Master, OptimizerStates::kInt8}) {
    const std::string name_of(OptimizerStatesName(states));
    SCOPED_TRACE(name_of);
    const Trained t = TrainAndSave(dir_.str() + "/ckpt-" + name_of, states);
    ASSERT_EQ(t.working.size(), size_t{2 * kModules});
    const std::string fp32 = dir_.str() + "/m-" + name_of + ".safetensors",
                      train = dir_.str() + "/t-" + name_of + ".safetensors";
    auto r = ExportCheckpoint(t.root, fp32, ExportPrecision::kFp32);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->tensors, 2 * kModules);
    EXPECT_EQ(r->bytes, static_cast<int64_t>(fs::file_size(fp32)));
    ASSERT_TRUE(ExportCheckpoint(t.root, train, ExportPrecision::kTrain).ok());
    EXPECT_FALSE(fs::exists(fp32 + ".tmp"));
    const auto a = ReadSafetensors(fp32);
    const auto b = ReadSafetensors(train);
    ASSERT_EQ(a.size(), t.names.size());
    ASSERT_EQ(b.size(), t.names.size());
    for (size_t id = 0; id < t.names.size(); ++id) {
      const std::string& name = t.names[id];
      const int m = static_cast<int>(id) / 2, i = static_cast<int>(id) % 2;
      ASSERT_TRUE(a.count(name)) << name;
      const Tensor& x = a.at(name);
      EXPECT_EQ(x.dtype, "F32") << name;
      EXPECT_EQ(x.shape, std::vector<int64_t>{testing::ToyNumel(m, i)}) << name;
      ASSERT_EQ(x.bytes.size(), t.masters[id].size() * 4) << name;
      EXPECT_EQ(std::memcmp(x.bytes.data(), t.masters[id].data(), x.bytes.size()), 0) << name;
      const Tensor& y = b.at(name);
      const DType d = testing::ToyDType(m, i);
      EXPECT_EQ(y.dtype, d == DType::kFp32 ? "F32" : (d == DType::kBf16 ? "BF16" : "F16")) << name;
      EXPECT_EQ(y.bytes, t.working[id]) << name;
    }
  }
}

TEST_F(CheckpointExportTest, CorruptStatesAreRefusedNamingTheFile) {
  const Trained t = TrainAndSave(dir_.str() + "/ckpt");
  auto in = InspectCheckpoint(t.root);
  ASSERT_TRUE(in.ok()) << in.status();
  const std::string states = in->path + "/states.bin";
  {
    std::fstream f(states, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    char c = 0;
    f.read(&c, 1);
    f.seekp(100);
    c = static_cast<char>(c ^ 0x5a);
    f.write(&c, 1);
  }
  auto bad = InspectCheckpoint(in->path);
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_EQ(bad->validity.code(), StatusCode::kDataLoss);
  EXPECT_THAT(std::string(bad->validity.message()), HasSubstr(states));
  EXPECT_THAT(std::string(bad->validity.message()), HasSubstr("crc32c"));
  const std::string out = dir_.str() + "/m.safetensors";
  for (ExportPrecision p : {ExportPrecision::kFp32, ExportPrecision::kTrain}) {
    auto r = ExportCheckpoint(t.root, out, p);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(states));
    EXPECT_FALSE(fs::exists(out));
    EXPECT_FALSE(fs::exists(out + ".tmp"));
  }
}

// The writer is SafetensorsWriter (tests/scheduler/safetensors_test.cc has
// the rest): mode 0600, a symlink at <out>.tmp skipped, one at <out> refused.
TEST_F(CheckpointExportTest, ExportIsMode0600AndFollowsNoSymlink) {
  const Trained t = TrainAndSave(dir_.str() + "/ckpt");
  const std::string out = dir_.str() + "/m.safetensors", victim = dir_.str() + "/victim";
  std::ofstream(victim) << "keep";
  auto victim_text = [&] {
    std::ifstream f(victim);
    return std::string((std::istreambuf_iterator<char>(f)), {});
  };
  ASSERT_EQ(::symlink(victim.c_str(), (out + ".tmp").c_str()), 0);
  const mode_t old_umask = ::umask(022);
  auto r = ExportCheckpoint(t.root, out, ExportPrecision::kFp32);
  ::umask(old_umask);
  ASSERT_TRUE(r.ok()) << r.status();
  struct stat st;
  ASSERT_EQ(::lstat(out.c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(r->bytes, static_cast<int64_t>(st.st_size));
  EXPECT_TRUE(fs::is_symlink(out + ".tmp"));
  EXPECT_EQ(victim_text(), "keep");

  const std::string linked = dir_.str() + "/l.safetensors";
  ASSERT_EQ(::symlink(victim.c_str(), linked.c_str()), 0);
  auto refused = ExportCheckpoint(t.root, linked, ExportPrecision::kTrain);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("symbolic link"));
  EXPECT_TRUE(fs::is_symlink(linked));
  EXPECT_EQ(victim_text(), "keep");
}

TEST_F(CheckpointExportTest, NoCheckpointIsNotFound) {
  auto in = InspectCheckpoint(dir_.str());
  EXPECT_EQ(in.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(std::string(in.status().message()), HasSubstr(dir_.str()));
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// Shapes and tied names: recorded by the checkpoint, given by the export
// (each tensor in its shape, a tied one under every name, the bytes of its
// first name: for fp32 across the sub-groups it spans), and checked at
// registration.
TEST(CheckpointExportShapes, ShapesAndTiedNamesComeOutOfTheExport) {
  testing::ScratchDir dir;
  Config c = testing::ToyConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, "");
  auto created = CreateEngine(c);
  ASSERT_TRUE(created.ok()) << created.status();
  Engine& e = **created;
  auto rng = testing::SeededRng(5);
  const std::vector<float> w0 = testing::RandomFloats(rng, 105);
  const std::vector<float> b0 = testing::RandomFloats(rng, 2500);  // spans 3 sub-groups
  ParamSpec w;
  w.name = "w";
  w.numel = 105;
  w.dtype = DType::kFp32;
  w.shape = {3, 5, 7};
  w.init = w0;
  ParamSpec b;
  b.name = "embed.weight";
  b.numel = 2500;
  b.dtype = DType::kBf16;
  b.module = 1;
  b.shape = {50, 50};
  b.aliases = {"head.weight", "decoder.head.weight"};
  b.init = b0;
  // Refused: a shape that does not hold numel; an alias that is a name.
  ParamSpec bad = w;
  bad.name = "bad";
  bad.shape = {2, 50};
  Status s = e.RegisterParameter(bad).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("shape [2, 50] holds 100 elements, numel is 105"));
  ASSERT_TRUE(e.RegisterParameter(w).ok());
  ParamSpec clash = b;
  clash.aliases = {"head.weight", "w"};
  s = e.RegisterParameter(clash).status();
  EXPECT_THAT(std::string(s.message()), HasSubstr("alias w is already a parameter's name"));
  ASSERT_TRUE(e.RegisterParameter(b).ok());
  auto found = e.FindParameter("decoder.head.weight");
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(*found, 1);
  for (int m = 0; m < 2; ++m) {
    ASSERT_TRUE(e.BeforeForward(m).ok());
    ASSERT_TRUE(e.AfterForward(m).ok());
  }
  for (int m = 1; m >= 0; --m) {
    auto v = e.BeforeBackward(m);
    ASSERT_TRUE(v.ok()) << v.status();
    const DType t = m == 0 ? DType::kFp32 : DType::kBf16;
    const int64_t n = m == 0 ? 105 : 2500;
    for (int64_t j = 0; j < n; ++j)
      testing::Store(v->grads[0], t, j, 0.3f * std::sin(0.7f * static_cast<float>(j)));
    ASSERT_TRUE(e.AfterBackward(m).ok());
  }
  ASSERT_TRUE(e.Step().ok());
  const std::string root = dir.str() + "/ckpt";
  ASSERT_TRUE(e.SaveCheckpoint(root, {}).ok());
  std::vector<float> w_now(105), b_now(2500);
  ASSERT_TRUE(e.ReadParameter(0, w_now).ok());
  ASSERT_TRUE(e.ReadParameter(1, b_now).ok());
  for (ExportPrecision prec : {ExportPrecision::kFp32, ExportPrecision::kTrain}) {
    SCOPED_TRACE(prec == ExportPrecision::kFp32 ? "fp32" : "train");
    const std::string out = dir.str() + (prec == ExportPrecision::kFp32 ? "/a" : "/b");
    auto r = ExportCheckpoint(root, out, prec);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->tensors, 4);
    const auto t = ReadSafetensors(out);
    ASSERT_EQ(t.size(), 4u);
    EXPECT_EQ(t.at("w").shape, (std::vector<int64_t>{3, 5, 7}));
    for (const char* name : {"embed.weight", "head.weight", "decoder.head.weight"}) {
      EXPECT_EQ(t.at(name).shape, (std::vector<int64_t>{50, 50})) << name;
      EXPECT_EQ(t.at(name).bytes, t.at("embed.weight").bytes) << name;
    }
    if (prec == ExportPrecision::kFp32) {
      ASSERT_EQ(t.at("head.weight").bytes.size(), 2500u * 4);
      EXPECT_EQ(0, std::memcmp(t.at("head.weight").bytes.data(), b_now.data(), 2500 * 4));
      EXPECT_EQ(0, std::memcmp(t.at("w").bytes.data(), w_now.data(), 105 * 4));
    } else {
      EXPECT_EQ(t.at("head.weight").dtype, "BF16");
      EXPECT_EQ(t.at("head.weight").bytes.size(), 2500u * 2);
    }
  }
}

// ---- Forged manifests ------------------------------------------------------------
//
// A manifest's CRC-32C guards against accidents only: a forger recomputes it,
// as Forge does. Whatever a forged manifest says, reading it ends in a
// DataLoss error naming it within seconds: no crash, no hang, no read
// outside the checkpoint's directory, no allocation beyond its files.

using OrderedJson = nlohmann::ordered_json;

std::string ReadText(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Rewrites dir's manifest through `edit`, with its CRC-32C recomputed.
void Forge(const std::string& dir, const std::function<void(OrderedJson&)>& edit) {
  const std::string path = dir + "/MANIFEST.json";
  OrderedJson m = OrderedJson::parse(ReadText(path));
  edit(m);
  m.erase("manifest_crc32c");
  const std::string content = m.dump();
  m["manifest_crc32c"] = fmt::format("{:08x}", Crc32c(content.data(), content.size()));
  std::ofstream(path, std::ios::trunc) << m.dump();
}

// InspectCheckpoint and ExportCheckpoint of `dir` both refuse it with
// DataLoss whose message has `what`, within a few seconds, and write nothing.
void ExpectRefused(const std::string& dir, const std::string& what) {
  const auto t0 = std::chrono::steady_clock::now();
  auto in = InspectCheckpoint(dir, /*verify=*/true);
  const Status s = in.ok() ? in->validity : in.status();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.ToString(), HasSubstr(what));
  EXPECT_THAT(s.ToString(), HasSubstr(dir));
  const std::string out = dir + "/../exported.safetensors";
  auto ex = ExportCheckpoint(dir, out, ExportPrecision::kFp32);
  EXPECT_EQ(ex.status().code(), StatusCode::kDataLoss) << ex.status();
  EXPECT_THAT(ex.status().ToString(), HasSubstr(what));
  EXPECT_FALSE(fs::exists(out));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}

TEST_F(CheckpointExportTest, AManifestNestedTooDeepIsRefusedBeforeAnyWalk) {
  const Trained t = TrainAndSave(dir_.str() + "/ckpt");
  const std::string ckpt = t.root + "/ckpt-00000001";
  // 100,000 levels in the note (about 200 KB): a recursive copy or dump of
  // it would overflow the stack.
  const std::string text = ReadText(ckpt + "/MANIFEST.json");
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const size_t at = text.find("\"note\":");
  ASSERT_NE(at, std::string::npos);
  std::ofstream(ckpt + "/MANIFEST.json", std::ios::trunc)
      << text.substr(0, at) << "\"deep\":" << deep << "," << text.substr(at);
  ExpectRefused(ckpt, "nested deeper than");
  // The root: that checkpoint skipped, none left.
  auto in = InspectCheckpoint(t.root, /*verify=*/true);
  EXPECT_FALSE(in.ok() && in->validity.ok());
  // Just within the bound: read, and refused for its CRC only.
  const int depth = scheduler::checkpoint_internal::kMaxManifestDepth - 1;
  std::ofstream(ckpt + "/MANIFEST.json", std::ios::trunc)
      << text.substr(0, at) << "\"deep\":" << std::string(depth - 1, '[')
      << std::string(depth - 1, ']') << "," << text.substr(at);
  ExpectRefused(ckpt, "manifest_crc32c says");
}

TEST_F(CheckpointExportTest, AManifestNamesOnlyFilesOfItsOwnDirectory) {
  const Trained t = TrainAndSave(dir_.str() + "/ckpt");
  const std::string ckpt = t.root + "/ckpt-00000001";
  // A file only root may read, outside the directory: neither opened nor
  // sized nor checksummed (its size or CRC-32C must not show).
  const std::string secret = dir_.str() + "/secret";
  std::ofstream(secret) << "the secret's 27 bytes here\n";
  ASSERT_EQ(::chmod(secret.c_str(), 0600), 0);
  const uint32_t secret_crc = Crc32c("the secret's 27 bytes here\n", 27);
  for (const std::string& name :
       {std::string("../../secret"), secret, std::string("."), std::string(""),
        std::string("MANIFEST.json"), std::string("states-rank-../x.bin"),
        std::string("params.bin/")}) {
    SCOPED_TRACE(name);
    const std::string saved = ReadText(ckpt + "/MANIFEST.json");
    Forge(ckpt, [&](OrderedJson& m) {
      m["files"].push_back(
          {{"name", name}, {"bytes", 27}, {"crc32c", fmt::format("{:08x}", secret_crc)}});
    });
    ExpectRefused(ckpt, "the name is not one this format writes");
    auto in = InspectCheckpoint(ckpt, /*verify=*/true);
    EXPECT_THAT(in.status().ToString(), ::testing::Not(HasSubstr("27 bytes")));
    std::ofstream(ckpt + "/MANIFEST.json", std::ios::trunc) << saved;
  }
  // A states list naming a file the files list does not have.
  Forge(ckpt, [](OrderedJson& m) { m["states"][0]["file"] = "../../secret"; });
  ExpectRefused(ckpt, "lists no ../../secret");
}

TEST_F(CheckpointExportTest, ACrcThatIsNotHexIsDataLossNamingTheEntry) {
  const Trained t = TrainAndSave(dir_.str() + "/ckpt");
  const std::string ckpt = t.root + "/ckpt-00000001";
  const std::string saved = ReadText(ckpt + "/MANIFEST.json");
  for (const OrderedJson& crc :
       {OrderedJson("zzzzzzzz"), OrderedJson("0x12"), OrderedJson(""), OrderedJson("123456789"),
        OrderedJson(12345678), OrderedJson(" 1234567")}) {
    SCOPED_TRACE(crc.dump());
    Forge(ckpt, [&](OrderedJson& m) { m["files"][0]["crc32c"] = crc; });
    ExpectRefused(ckpt, "files[0]");
    ExpectRefused(ckpt, "crc32c is not 8 hex digits");
    std::ofstream(ckpt + "/MANIFEST.json", std::ios::trunc) << saved;
  }
  Forge(ckpt, [](OrderedJson& m) { m["files"][1]["bytes"] = -5; });
  ExpectRefused(ckpt, "bytes is not a size");
}

TEST_F(CheckpointExportTest, ClaimedSizesAreCheckedAgainstTheFilesBeforeAllocating) {
  const Trained t = TrainAndSave(dir_.str() + "/ckpt");
  const std::string ckpt = t.root + "/ckpt-00000001";
  const std::string saved = ReadText(ckpt + "/MANIFEST.json");
  auto restore = [&] { std::ofstream(ckpt + "/MANIFEST.json", std::ios::trunc) << saved; };
  // 2^60 elements in sub-groups of 1: 2^60 sub-groups, were it believed.
  Forge(ckpt, [](OrderedJson& m) {
    m["config"]["zero_optimization"]["sub_group_size"] = 1;
    m["layout"]["parameters"][0][1] = int64_t{1} << 60;
    m["layout"].erase("shapes");
  });
  ExpectRefused(ckpt, "claims 1152921504606846976 elements, more than the checkpoint's files hold");
  restore();
  // Sizes that overflow when summed or multiplied.
  Forge(ckpt, [](OrderedJson& m) {
    m["layout"]["parameters"][0][1] = INT64_MAX;
    m["layout"]["shapes"][0] = {INT64_MAX / 2, 4};
  });
  ExpectRefused(ckpt, "more than the checkpoint's files hold");
  restore();
  Forge(ckpt, [](OrderedJson& m) {
    const int64_t n = m["layout"]["parameters"][0][1].get<int64_t>();
    m["layout"]["shapes"][0] = {n, int64_t{1} << 62, 4};
  });
  ExpectRefused(ckpt, "and shape");
  restore();
  Forge(ckpt, [](OrderedJson& m) {  // a product that overflows, then times 0
    m["layout"]["parameters"][0][1] = 0;
    m["layout"]["shapes"][0] = {int64_t{1} << 62, 4, 0};
  });
  ExpectRefused(ckpt, "and shape");
  restore();
  // A module (or group) index far past the parameters.
  Forge(ckpt, [](OrderedJson& m) { m["layout"]["parameters"][0][3] = INT32_MAX; });
  ExpectRefused(ckpt, "module 2147483647");
  restore();
  Forge(ckpt, [](OrderedJson& m) { m["layout"]["parameters"][0].push_back(1 << 30); });
  ExpectRefused(ckpt, "group 1073741824");
  restore();
  // More tied names than a parameter may have (each would be a copy of the
  // tensor in the export).
  Forge(ckpt, [](OrderedJson& m) {
    std::vector<std::string> names;
    for (size_t i = 0; i <= kMaxParamAliases; ++i) names.push_back(fmt::format("tied.{}", i));
    m["layout"]["aliases"][m["layout"]["parameters"][0][0].get<std::string>()] = names;
  });
  ExpectRefused(ckpt, "other names; a parameter may have at most 1024");
  restore();
  // A states file claimed larger than it is.
  Forge(ckpt, [](OrderedJson& m) {
    for (auto& f : m["files"])
      if (f["name"] == "states.bin") f["bytes"] = f["bytes"].get<int64_t>() * 1000;
    m["states"][0]["elem_end"] = m["states"][0]["elem_end"].get<int64_t>() * 1000;
  });
  auto in = InspectCheckpoint(ckpt, /*verify=*/true);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(in->validity.code(), StatusCode::kDataLoss) << in->validity;
  EXPECT_THAT(in->validity.ToString(), HasSubstr("states.bin"));
  restore();
  auto ok = InspectCheckpoint(ckpt, /*verify=*/true);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(ok->validity.ok()) << ok->validity;
}

// The engine refuses what a checkpoint would: a parameter with more names
// than kMaxParamAliases.
TEST(CheckpointExportShapes, AParameterWithTooManyAliasesIsRefused) {
  Config c = testing::ToyConfig(OffloadDevice::kCpu, OffloadDevice::kCpu, "");
  auto created = CreateEngine(c);
  ASSERT_TRUE(created.ok()) << created.status();
  ParamSpec p;
  p.name = "w";
  p.numel = 8;
  p.dtype = DType::kFp32;
  const std::vector<float> init(8, 0.5f);
  p.init = init;
  for (size_t i = 0; i <= kMaxParamAliases; ++i) p.aliases.push_back(fmt::format("tied.{}", i));
  const Status s = (*created)->RegisterParameter(p).status();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.ToString(), HasSubstr("1025 aliases, at most 1024"));
  p.aliases.pop_back();
  EXPECT_TRUE((*created)->RegisterParameter(p).ok());
}

}  // namespace
}  // namespace strata
