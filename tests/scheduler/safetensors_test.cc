// The safetensors writer (src/scheduler/safetensors.h): the exact bytes of a
// small file; mode 0600; a symlink planted at the final or the temporary
// path is never followed (the final one is refused, the temporary one
// skipped); a directory is not replaced; bad tensors and short or long data
// are refused leaving nothing behind.
#include "src/scheduler/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using scheduler::SafetensorsTensor;
using scheduler::SafetensorsTensorData;
using scheduler::SafetensorsWriter;
using scheduler::WriteSafetensors;

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::set<std::string> Listing(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

// Two tensors: "a" F32 [2] = {1, 2}; "b\xc3\xa9" (b, e acute) BF16 [] = 1.0.
struct Small {
  std::vector<uint8_t> a, b;
  std::vector<SafetensorsTensorData> tensors;
  Small() {
    const float av[2] = {1.f, 2.f};
    a.resize(8);
    std::memcpy(a.data(), av, 8);
    b = {0x80, 0x3f};
    tensors.push_back({{"a", "F32", {2}}, a});
    tensors.push_back({{"b\xc3\xa9", "BF16", {}}, b});
  }
};

const std::vector<std::pair<std::string, std::string>> kMeta = {{"format", "pt"}};

class SafetensorsWriterTest : public ::testing::Test {
 protected:
  void SetUp() override { old_umask_ = ::umask(022); }
  void TearDown() override { ::umask(old_umask_); }
  std::string At(const std::string& name) const { return (dir_.path() / name).string(); }
  testing::ScratchDir dir_;
  mode_t old_umask_ = 0;
};

TEST_F(SafetensorsWriterTest, WritesTheExactBytesWithMode0600) {
  Small s;
  auto r = WriteSafetensors(At("m.safetensors"), kMeta, s.tensors);
  ASSERT_TRUE(r.ok()) << r.status();
  // Compact JSON in the order given, UTF-8 as is, spaces to a multiple of 8.
  std::string header =
      "{\"__metadata__\":{\"format\":\"pt\"},"
      "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"b\xc3\xa9\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[8,10]}}";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string want(8, '\0');
  for (int i = 0; i < 8; ++i) want[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  want += header;
  want.append(s.a.begin(), s.a.end());
  want.append(s.b.begin(), s.b.end());
  EXPECT_EQ(ReadAll(At("m.safetensors")), want);
  EXPECT_EQ(*r, static_cast<int64_t>(want.size()));
  struct stat st;
  ASSERT_EQ(::lstat(At("m.safetensors").c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(Listing(dir_.path()), std::set<std::string>{"m.safetensors"});
}

TEST_F(SafetensorsWriterTest, ReplacesARegularFileAndMakesIt0600) {
  WriteText(At("m.safetensors"), "old");
  ASSERT_EQ(::chmod(At("m.safetensors").c_str(), 0644), 0);
  Small s;
  auto r = WriteSafetensors(At("m.safetensors"), kMeta, s.tensors);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(static_cast<int64_t>(fs::file_size(At("m.safetensors"))), *r);
  struct stat st;
  ASSERT_EQ(::lstat(At("m.safetensors").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
}

TEST_F(SafetensorsWriterTest, SymlinkAtTheFinalPathIsRefusedAndNotFollowed) {
  WriteText(At("victim"), "keep");
  ASSERT_EQ(::symlink(At("victim").c_str(), At("m.safetensors").c_str()), 0);
  Small s;
  auto r = WriteSafetensors(At("m.safetensors"), kMeta, s.tensors);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("symbolic link"), std::string::npos) << r.status();
  EXPECT_EQ(ReadAll(At("victim")), "keep");
  EXPECT_TRUE(fs::is_symlink(At("m.safetensors")));
  EXPECT_EQ(Listing(dir_.path()), (std::set<std::string>{"m.safetensors", "victim"}));
}

TEST_F(SafetensorsWriterTest, SymlinkAtTheTemporaryPathIsNotFollowed) {
  WriteText(At("victim"), "keep");
  ASSERT_EQ(::symlink(At("victim").c_str(), At("m.safetensors.tmp").c_str()), 0);
  Small s;
  std::vector<SafetensorsTensor> described;
  for (const auto& t : s.tensors) described.push_back(t.tensor);
  auto w = SafetensorsWriter::Create(At("m.safetensors"), kMeta, described);
  ASSERT_TRUE(w.ok()) << w.status();
  // Another name in the same directory.
  EXPECT_EQ(fs::path(w->temp_path()).parent_path(), dir_.path());
  EXPECT_EQ(w->temp_path().rfind(At("m.safetensors.tmp."), 0), 0u) << w->temp_path();
  for (const auto& t : s.tensors) ASSERT_TRUE(w->Append(t.bytes.data(), t.bytes.size()).ok());
  ASSERT_TRUE(w->Commit().ok());
  EXPECT_EQ(ReadAll(At("victim")), "keep");
  EXPECT_TRUE(fs::is_symlink(At("m.safetensors.tmp")));
  struct stat st;
  ASSERT_EQ(::lstat(At("m.safetensors").c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(static_cast<int64_t>(st.st_size), w->file_bytes());
  EXPECT_EQ(Listing(dir_.path()),
            (std::set<std::string>{"m.safetensors", "m.safetensors.tmp", "victim"}));
}

TEST_F(SafetensorsWriterTest, ADirectoryIsNotReplaced) {
  fs::create_directory(At("m.safetensors"));
  Small s;
  auto r = WriteSafetensors(At("m.safetensors"), kMeta, s.tensors);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition) << r.status();
  EXPECT_TRUE(fs::is_directory(At("m.safetensors")));
  EXPECT_EQ(Listing(dir_.path()), std::set<std::string>{"m.safetensors"});
}

TEST_F(SafetensorsWriterTest, BadTensorsAreRefusedWritingNothing) {
  const std::vector<uint8_t> four(4);
  const std::vector<std::vector<SafetensorsTensorData>> bad = {
      {{{"x", "F32", {1}}, four}, {{"x", "F32", {1}}, four}},  // a name twice
      {{{"__metadata__", "F32", {1}}, four}},                  // the reserved name
      {{{"x", "F99", {1}}, four}},                             // no such dtype
      {{{"x", "F32", {-1}}, four}},                            // a negative dimension
      {{{"x", "F32", {2}}, four}},                             // 4 bytes for 8
      {{{"x\xff", "F32", {1}}, four}},                         // not UTF-8
  };
  for (const auto& tensors : bad) {
    auto r = WriteSafetensors(At("m.safetensors"), kMeta, tensors);
    ASSERT_FALSE(r.ok()) << tensors[0].tensor.name;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status();
    EXPECT_TRUE(fs::is_empty(dir_.path())) << r.status();
  }
}

TEST_F(SafetensorsWriterTest, ShortOrLongDataIsRefusedAndTheTemporaryFileGoes) {
  const std::vector<SafetensorsTensor> described = {{"x", "I64", {2, 3}}};
  {
    auto w = SafetensorsWriter::Create(At("m.safetensors"), kMeta, described);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->data_bytes(), 48);
    const std::vector<uint8_t> bytes(49);
    EXPECT_EQ(w->Append(bytes.data(), 49).code(), StatusCode::kInvalidArgument);
    ASSERT_TRUE(w->Append(bytes.data(), 40).ok());
    const Status s = w->Commit();
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  }
  EXPECT_TRUE(fs::is_empty(dir_.path()));
  {  // never committed
    auto w = SafetensorsWriter::Create(At("m.safetensors"), kMeta, described);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_TRUE(fs::exists(w->temp_path()));
  }
  EXPECT_TRUE(fs::is_empty(dir_.path()));
}

}  // namespace
}  // namespace strata
