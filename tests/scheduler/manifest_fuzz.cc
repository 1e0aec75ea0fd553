// libFuzzer target for the checkpoint manifest reader: LoadManifest,
// ManifestFiles and StateFilesOf (src/scheduler/checkpoint_format.cc), and
// InspectCheckpoint and ExportCheckpoint (checkpoint_export.cc) over them.
//
// The input is a manifest's text. A manifest's CRC-32C guards against
// accidents only, so the target forges each input as an attacker would:
// where it parses (within the reader's own bounds), the data files it lists
// under names this format writes are created in a scratch checkpoint
// directory with the sizes it claims (up to 64 KiB each, a fixed pattern),
// their CRC-32C and the manifest's own are recomputed, and the result is
// written as MANIFEST.json; text that does not parse is written as it is.
// So mutations reach past the checksums into the layout, the states files
// and the export. Whatever the input: no crash, leak, hang or unbounded
// memory (ASan/UBSan and libFuzzer's limits watch), every error has a
// message and one of the codes a damaged checkpoint gives, and nothing is
// written outside the scratch directory.
//
// Built only where the compiler links -fsanitize=fuzzer; scripts/fuzz.sh
// runs it seeded with tests/scheduler/manifest_fuzz_seeds (manifests that
// `strata train` wrote).
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "src/common/crc32c.h"
#include "src/common/log.h"
#include "src/scheduler/checkpoint_export.h"
#include "src/scheduler/checkpoint_format.h"

namespace {

namespace fs = std::filesystem;
using strata::StatusCode;
using strata::scheduler::checkpoint_internal::IsCheckpointDataFileName;
using strata::scheduler::checkpoint_internal::Json;
using strata::scheduler::checkpoint_internal::ManifestCrc;
using strata::scheduler::checkpoint_internal::ParseManifestText;

// (Small: an export may copy a tensor under each of its names.)
constexpr int64_t kMaxFileBytes = int64_t{64} << 10;

std::string g_root;  // the scratch directory: g_root/ckpt is the checkpoint

[[noreturn]] void Broken(const char* what, const std::string& detail) {
  std::fprintf(stderr, "manifest_fuzz: invariant broken: %s\n%s\n", what, detail.c_str());
  std::abort();
}

void WriteFile(const std::string& path, std::string_view bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// An error is one a damaged or forged checkpoint gives, with a message.
void CheckError(const strata::Status& s, const char* what) {
  if (s.ok()) return;
  if (s.message().empty()) Broken("an error without a message", what);
  switch (s.code()) {
    case StatusCode::kDataLoss:
    case StatusCode::kNotSupported:
    case StatusCode::kNotFound:
    case StatusCode::kFailedPrecondition:
    case StatusCode::kResourceExhausted:
      return;
    default:
      Broken("an unexpected error code", std::string(what) + ": " + s.ToString());
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  strata::SetLogLevel("off");
  std::string tmpl = (fs::temp_directory_path() / "strata-manifest-fuzz-XXXXXX").string();
  if (::mkdtemp(tmpl.data()) == nullptr) Broken("mkdtemp", tmpl);
  g_root = tmpl;
  std::atexit([] {
    std::error_code ec;
    fs::remove_all(g_root, ec);
  });
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::string dir = g_root + "/ckpt";
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directory(dir, ec);
  ::chmod(dir.c_str(), 0700);
  const std::string manifest_path = dir + "/MANIFEST.json";

  strata::StatusOr<Json> parsed = ParseManifestText(text, manifest_path);
  if (!parsed.ok()) {
    CheckError(parsed.status(), "ParseManifestText");
    WriteFile(manifest_path, text);
  } else {
    Json& m = *parsed;
    auto files = m.find("files");
    if (files != m.end() && files->is_array()) {
      for (Json& f : *files) {
        if (!f.is_object()) continue;
        auto name = f.find("name"), bytes = f.find("bytes");
        if (name == f.end() || !name->is_string() || bytes == f.end() ||
            !bytes->is_number_integer())
          continue;
        const auto n = bytes->get<int64_t>();
        if (!IsCheckpointDataFileName(name->get<std::string>()) || n < 0 || n > kMaxFileBytes)
          continue;
        std::string content(static_cast<size_t>(n), '\0');
        for (size_t i = 0; i < content.size(); ++i)
          content[i] = static_cast<char>((i * 31 + 7) & 0xff);
        WriteFile(dir + "/" + name->get<std::string>(), content);
        f["crc32c"] = fmt::format("{:08x}", strata::Crc32c(content.data(), content.size()));
      }
    }
    m.erase("manifest_crc32c");
    m["manifest_crc32c"] = ManifestCrc(m);
    WriteFile(manifest_path, m.dump());
  }

  auto in = strata::scheduler::InspectCheckpoint(dir, /*verify=*/true);
  CheckError(in.ok() ? in->validity : in.status(), "InspectCheckpoint");
  const std::string out = g_root + "/out.safetensors";
  auto exported = strata::scheduler::ExportCheckpoint(dir, out, strata::ExportPrecision::kFp32);
  CheckError(exported.status(), "ExportCheckpoint");
  if (exported.ok() && !fs::exists(out)) Broken("an export without its file", out);
  fs::remove(out, ec);
  // Nothing but the scratch directory's own files.
  for (const fs::directory_entry& e : fs::directory_iterator(g_root, ec))
    if (e.path().filename() != "ckpt") Broken("a file left behind", e.path().string());
  return 0;
}
