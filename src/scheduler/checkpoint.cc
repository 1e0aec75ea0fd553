#include "src/scheduler/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "src/common/aligned_buffer.h"
#include "src/common/crc32c.h"
#include "src/common/dtype.h"
#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/scheduler/hyperparams.h"
#include "src/scheduler/safetensors.h"

namespace strata::scheduler {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

constexpr char kFormat[] = "strata-checkpoint";
constexpr char kParamsFile[] = "params.bin";
constexpr char kStatesFile[] = "states.bin";
constexpr size_t kVerifyChunk = size_t{8} << 20;

// An open file descriptor, closed on destruction; every error names the path
// (and the offset for data transfers) and the errno.
class File {
 public:
  static StatusOr<File> Open(const std::string& path, int flags) {
    const int fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
    if (fd < 0) return ErrnoError(fmt::format("open {}", path), errno);
    return File(fd, path);
  }
  File(File&& o) noexcept
      : fd_(std::exchange(o.fd_, -1)), path_(std::move(o.path_)), off_(o.off_) {}
  File& operator=(File&&) = delete;
  ~File() {
    if (fd_ >= 0) ::close(fd_);
  }

  // Appends n bytes (at the running offset).
  Status Append(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (n > 0) {
      const ssize_t w = ::pwrite(fd_, p, std::min(n, size_t{1} << 30), off_);
      if (w < 0) {
        if (errno == EINTR) continue;
        return ErrnoError(fmt::format("write {} at offset {}", path_, off_), errno);
      }
      p += w;
      n -= static_cast<size_t>(w);
      off_ += w;
    }
    return Status();
  }
  // Reads exactly n bytes at the running offset; a file that ends first is
  // DataLoss (truncated).
  Status ReadNext(void* buf, size_t n) {
    auto* p = static_cast<uint8_t*>(buf);
    while (n > 0) {
      const ssize_t r = ::pread(fd_, p, std::min(n, size_t{1} << 30), off_);
      if (r < 0) {
        if (errno == EINTR) continue;
        return ErrnoError(fmt::format("read {} at offset {}", path_, off_), errno);
      }
      if (r == 0)
        return DataLossError(
            fmt::format("checkpoint file {}: ends at offset {}, {} more bytes "
                        "expected (truncated)",
                        path_, off_, n));
      p += r;
      n -= static_cast<size_t>(r);
      off_ += r;
    }
    return Status();
  }
  StatusOr<int64_t> Size() const {
    struct stat st;
    if (::fstat(fd_, &st) != 0) return ErrnoError(fmt::format("fstat {}", path_), errno);
    return static_cast<int64_t>(st.st_size);
  }
  Status Sync() {
    if (::fsync(fd_) != 0) return ErrnoError(fmt::format("fsync {}", path_), errno);
    return Status();
  }
  Status Close() {
    const int fd = std::exchange(fd_, -1);
    if (fd >= 0 && ::close(fd) != 0) return ErrnoError(fmt::format("close {}", path_), errno);
    return Status();
  }

 private:
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
  int64_t off_ = 0;
};

Status SyncDir(const std::string& dir) {
  ASSIGN_OR_RETURN(File d, File::Open(dir, O_RDONLY | O_DIRECTORY));
  return d.Sync();
}

std::string Hex32(uint32_t v) { return fmt::format("{:08x}", v); }

// ---- Identity: what must match for a checkpoint to load ----------------------

// The whole effective config (ConfigToJson), application sections included.
Json ConfigIdentity(const Config& c) { return Json::parse(ConfigToJson(c, -1)); }

// Leaf values by key path: "a.b", "a.b[0]".
void Flatten(const Json& j, const std::string& path,
             std::vector<std::pair<std::string, Json>>* out) {
  if (j.is_object() && !j.empty()) {
    for (const auto& [k, v] : j.items()) Flatten(v, path.empty() ? k : path + "." + k, out);
  } else if (j.is_array() && !j.empty()) {
    for (size_t i = 0; i < j.size(); ++i) Flatten(j[i], fmt::format("{}[{}]", path, i), out);
  } else {
    out->emplace_back(path, j);
  }
}

Json LayoutIdentity(const Layout& l) {
  Json params = Json::array();
  for (const ParamRec& p : l.params()) {
    Json rec = {p.name, p.numel, std::string(DTypeName(p.dtype)), p.module};
    if (p.group != 0) rec.push_back(p.group);  // the optimizer parameter group, when not 0
    params.push_back(std::move(rec));
  }
  Json j;
  // The one-rank counts: the same whatever the number of ranks.
  j["elements"] = l.unpartitioned_elems();
  j["modules"] = l.num_modules();
  j["sub_groups"] = l.unpartitioned_groups();
  j["parameters"] = std::move(params);
  return j;
}

// The optimizer parameter groups as the manifest records them (absent: one
// group without overrides).
Json ParamGroupsIdentity(std::span<const ParamGroupSpec> groups) {
  Json out = Json::array();
  for (const ParamGroupSpec& g : groups) {
    Json j;
    j["name"] = g.name;
    auto put = [&](const char* key, const std::optional<double>& v) {
      if (v.has_value()) j[key] = *v;
    };
    put("lr", g.lr);
    put("weight_decay", g.weight_decay);
    put("beta1", g.beta1);
    put("beta2", g.beta2);
    put("eps", g.eps);
    out.push_back(std::move(j));
  }
  return out;
}

// The first difference between two ParamGroupsIdentity values ("" if none);
// names are for messages only.
std::string ParamGroupsDifference(const Json& then, const Json& now) {
  if (then.size() != now.size())
    return fmt::format("{} optimizer parameter group{} in the checkpoint, {} now", then.size(),
                       then.size() == 1 ? "" : "s", now.size());
  for (size_t i = 0; i < now.size(); ++i)
    for (const char* key : {"lr", "weight_decay", "beta1", "beta2", "eps"}) {
      const Json a = then[i].value(key, Json());
      const Json b = now[i].value(key, Json());
      if (a != b)
        return fmt::format("parameter group {} ({}): {} {} in the checkpoint, {} now", i,
                           now[i].value("name", ""), key, a.is_null() ? "unset" : a.dump(),
                           b.is_null() ? "unset" : b.dump());
    }
  return "";
}

std::string IdentityHash(const Json& j) {
  const std::string s = j.dump();
  return Hex32(Crc32c(s.data(), s.size()));
}

// CRC-32C of a manifest's canonical text (compact dump, keys in order),
// without its manifest_crc32c.
std::string ManifestCrc(const Json& m) {
  const std::string s = m.dump();
  return Hex32(Crc32c(s.data(), s.size()));
}

// A version-2 manifest's states were laid out densely. They are where this
// build reads them exactly when no tensor of the dense layout starts off a
// kElemAlign boundary (then no padding is inserted and the layouts agree);
// otherwise NotSupported naming the first such tensor. Throws on a malformed
// layout (the caller reports it).
Status CheckDenseLayoutMatches(const Json& layout, const std::string& manifest_path) {
  struct Rec {
    int module;
    int64_t numel;
    std::string name;
  };
  std::vector<Rec> recs;
  for (const Json& p : layout.at("parameters"))
    recs.push_back({p.at(3).get<int>(), p.at(1).get<int64_t>(), p.at(0).get<std::string>()});
  std::stable_sort(recs.begin(), recs.end(),
                   [](const Rec& a, const Rec& b) { return a.module < b.module; });
  int64_t off = 0;
  for (const Rec& r : recs) {
    if (off % kElemAlign != 0)
      return NotSupportedError(fmt::format(
          "{}: format version {} stores the optimizer states densely; this build reads version "
          "{}, which starts each tensor on a multiple of {} elements, and in this model tensor "
          "{} would move (the tensors before it hold {} elements): continue that run with the "
          "build that wrote it, or start afresh in another directory",
          manifest_path, kDenseLayoutCheckpointVersion, kCheckpointFormatVersion, kElemAlign,
          r.name, off));
    off += r.numel;
  }
  return Status::Ok();
}

// The manifest of checkpoint directory `dir`, read and checked: JSON, this
// format and version, and its own CRC-32C. Its fields are the caller's to read.
StatusOr<Json> LoadManifest(const std::string& dir) {
  const std::string manifest_path = dir + "/" + kCheckpointManifest;
  std::string text;
  {
    ASSIGN_OR_RETURN(File f, File::Open(manifest_path, O_RDONLY));
    ASSIGN_OR_RETURN(int64_t size, f.Size());
    if (size > (int64_t{256} << 20))
      return DataLossError(fmt::format("checkpoint manifest {}: {} bytes, expected at most 256 MiB",
                                       manifest_path, size));
    text.resize(static_cast<size_t>(size));
    RETURN_IF_ERROR(f.ReadNext(text.data(), text.size()));
  }
  Json m = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (m.is_discarded() || !m.is_object())
    return DataLossError(fmt::format("checkpoint manifest {}: not valid JSON", manifest_path));
  try {
    if (m.at("format") != kFormat)
      return DataLossError(
          fmt::format("{}: not a strata checkpoint manifest (format {}, expected {})",
                      manifest_path, m.at("format").dump(), kFormat));
    if (m.at("version") == kDenseLayoutCheckpointVersion)
      RETURN_IF_ERROR(CheckDenseLayoutMatches(m.at("layout"), manifest_path));
    else if (m.at("version") != kCheckpointFormatVersion &&
             m.at("version") != kSingleStatesFileVersion)
      return NotSupportedError(fmt::format(
          "{}: format version {}, this build reads versions {} to {} (version 1 recorded neither "
          "the run id nor the whole config): continue that run with the build that wrote it, or "
          "start afresh in another directory",
          manifest_path, m.at("version").dump(), kDenseLayoutCheckpointVersion,
          kCheckpointFormatVersion));
    Json content = m;
    content.erase("manifest_crc32c");
    const std::string want = m.at("manifest_crc32c").get<std::string>();
    if (const std::string got = ManifestCrc(content); got != want)
      return DataLossError(fmt::format(
          "checkpoint manifest {}: its content has crc32c {}, its manifest_crc32c says {} (edited "
          "or corrupt); remove {} to resume from the checkpoint before it",
          manifest_path, got, want, dir));
  } catch (const std::exception& e) {
    return DataLossError(fmt::format("checkpoint manifest {}: {}", manifest_path, e.what()));
  }
  return m;
}

std::string ValueText(const Json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

std::string ConfigDifference(const Json& then, const Json& now) {
  std::vector<std::pair<std::string, Json>> a, b;
  Flatten(then, "", &a);
  Flatten(now, "", &b);
  std::vector<std::string> keys;
  std::string first;
  auto differs = [&](const std::string& key, const std::string& what) {
    if (CheckpointKeyMayDiffer(key)) return;
    if (first.empty())
      first = key + ": " + what;
    else
      keys.push_back(key);
  };
  auto find = [](const std::vector<std::pair<std::string, Json>>& v, const std::string& key) {
    return std::find_if(v.begin(), v.end(), [&](const auto& kv) { return kv.first == key; });
  };
  for (const auto& [key, value] : b) {
    auto it = find(a, key);
    if (it == a.end())
      differs(key, fmt::format("absent in the checkpoint, {} now", ValueText(value)));
    else if (it->second != value)
      differs(key,
              fmt::format("{} in the checkpoint, {} now", ValueText(it->second), ValueText(value)));
  }
  for (const auto& [key, value] : a)
    if (find(b, key) == b.end())
      differs(key, fmt::format("{} in the checkpoint, absent now", ValueText(value)));
  if (first.empty() || keys.empty()) return first;
  std::string also;
  for (const std::string& k : keys) also += (also.empty() ? "" : ", ") + k;
  return fmt::format("{} (also: {})", first, also);
}

std::string LayoutDifference(const Json& then, const Json& now) {
  const Json& a = then.at("parameters");
  const Json& b = now.at("parameters");
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const std::string name = b[i][0].get<std::string>();
    if (a[i][0] != b[i][0])
      return fmt::format("parameter {}: named {} in the checkpoint, {} now", i,
                         a[i][0].get<std::string>(), name);
    if (a[i][1] != b[i][1])
      return fmt::format("parameter {}: numel {} in the checkpoint, {} now", name, a[i][1].dump(),
                         b[i][1].dump());
    if (a[i][2] != b[i][2])
      return fmt::format("parameter {}: dtype {} in the checkpoint, {} now", name,
                         a[i][2].get<std::string>(), b[i][2].get<std::string>());
    if (a[i][3] != b[i][3])
      return fmt::format("parameter {}: module {} in the checkpoint, {} now", name, a[i][3].dump(),
                         b[i][3].dump());
    const Json ga = a[i].size() > 4 ? a[i][4] : Json(0);
    const Json gb = b[i].size() > 4 ? b[i][4] : Json(0);
    if (ga != gb)
      return fmt::format("parameter {}: optimizer parameter group {} in the checkpoint, {} now",
                         name, ga.dump(), gb.dump());
  }
  if (a.size() != b.size())
    return fmt::format("{} parameters in the checkpoint, {} registered now", a.size(), b.size());
  for (const char* key : {"elements", "modules", "sub_groups"})
    if (then.at(key) != now.at(key))
      return fmt::format("{}: {} in the checkpoint, {} now", key, then.at(key).dump(),
                         now.at(key).dump());
  return "";
}

// ---- The checkpoint directories under a root ---------------------------------

// The run id and optimizer step of a manifest, when it parses.
void ReadSummary(const std::string& manifest, CheckpointEntry* e) {
  std::string text;
  {
    StatusOr<File> f = File::Open(manifest, O_RDONLY);
    if (!f.ok()) return;
    StatusOr<int64_t> size = f->Size();
    if (!size.ok() || *size > (int64_t{64} << 20)) return;
    text.resize(static_cast<size_t>(*size));
    if (!f->ReadNext(text.data(), text.size()).ok()) return;
  }
  const Json m = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!m.is_object()) return;
  if (m.contains("run_id") && m["run_id"].is_string()) e->run_id = m["run_id"].get<std::string>();
  if (m.contains("optimizer_step") && m["optimizer_step"].is_number_integer())
    e->optimizer_step = m["optimizer_step"].get<int64_t>();
}

// ckpt-<digits> directories, by sequence number; with `summaries`, the run
// id and step of each complete one.
std::vector<CheckpointEntry> Scan(const std::string& root, bool summaries = true) {
  std::vector<CheckpointEntry> out;
  std::error_code ec;
  for (const fs::directory_entry& d : fs::directory_iterator(root, ec)) {
    const std::string name = d.path().filename().string();
    if (name.size() <= 5 || name.compare(0, 5, "ckpt-") != 0) continue;
    if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; }))
      continue;
    if (name.size() > 5 + 18 || !d.is_directory(ec)) continue;
    CheckpointEntry e;
    e.sequence = std::stoll(name.substr(5));
    e.path = d.path().string();
    const fs::path manifest = d.path() / kCheckpointManifest;
    e.complete = fs::exists(manifest, ec);
    if (e.complete && summaries) ReadSummary(manifest.string(), &e);
    out.push_back(std::move(e));
  }
  std::sort(out.begin(), out.end(), [](const CheckpointEntry& a, const CheckpointEntry& b) {
    return a.sequence < b.sequence;
  });
  return out;
}

std::string RunName(const std::string& run_id) {
  return run_id.empty() ? "(no run id recorded)" : run_id;
}

// Removes the run's checkpoints but the newest kCheckpointsKept, and
// interrupted saves (no manifest: with the root locked, no save is in
// progress). Complete checkpoints of other runs are never touched. The
// manifest goes first, so that a crash half-way leaves a directory that is
// not a checkpoint. Failures are logged: the new checkpoint is valid
// whatever happens here.
void RemoveOld(const std::string& root, int64_t newest, const std::string& run_id,
               const std::function<void(std::string_view)>& at_point = {}) {
  std::vector<CheckpointEntry> entries = Scan(root);
  int kept = 0;
  bool removed = false;
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    if (it->sequence > newest) continue;  // newer than the one just written or loaded
    if (it->complete && it->run_id != run_id) continue;  // another run's
    if (it->complete && kept < kCheckpointsKept) {
      ++kept;
      continue;
    }
    const std::string manifest = it->path + "/" + kCheckpointManifest;
    if (::unlink(manifest.c_str()) != 0 && errno != ENOENT) {
      STRATA_LOG_WARN("checkpoint: removing old {}: {}", manifest,
                      ErrnoError("unlink", errno).ToString());
      continue;
    }
    if (!removed && at_point) at_point("cleanup");
    removed = true;
    std::error_code ec;
    fs::remove_all(it->path, ec);
    if (ec) STRATA_LOG_WARN("checkpoint: removing old {}: {}", it->path, ec.message());
  }
  if (removed) {
    Status s = SyncDir(root);
    if (!s.ok()) STRATA_LOG_WARN("checkpoint: {}", s.ToString());
  }
}

// Size and CRC-32C of a whole file against the manifest's.
Status VerifyFile(const std::string& path, int64_t bytes, uint32_t crc, AlignedBuffer& buf) {
  StatusOr<File> f = File::Open(path, O_RDONLY);
  if (!f.ok())
    return DataLossError(
        fmt::format("checkpoint file {} listed in the manifest cannot be opened: "
                    "{}",
                    path, f.status().ToString()));
  ASSIGN_OR_RETURN(int64_t size, f->Size());
  if (size != bytes)
    return DataLossError(
        fmt::format("checkpoint file {}: {} bytes, the manifest says {} "
                    "(truncated or replaced)",
                    path, size, bytes));
  uint32_t c = 0;
  for (int64_t done = 0; done < bytes;) {
    const size_t n = static_cast<size_t>(std::min<int64_t>(bytes - done, kVerifyChunk));
    RETURN_IF_ERROR(f->ReadNext(buf.data(), n));
    c = Crc32cExtend(c, buf.data(), n);
    done += static_cast<int64_t>(n);
  }
  if (c != crc)
    return DataLossError(
        fmt::format("checkpoint file {}: crc32c {} does not match the manifest's "
                    "{} (corrupt)",
                    path, Hex32(c), Hex32(crc)));
  return Status();
}

int64_t ParamFileBytes(const Layout& l) {
  int64_t b = 0;
  for (const ModuleExtent& me : l.modules()) b += me.bytes();
  return b;
}

// One buffer big enough for any module's parameters or sub-group's states.
StatusOr<AlignedBuffer> SectionBuffer(const Layout& l) {
  const int64_t bytes = std::max({IoBytes(l.max_module_bytes()),
                                  IoBytes(kOptimizerStateBytesPerElem * l.max_group_elems()),
                                  static_cast<int64_t>(kVerifyChunk)});
  return AlignedBuffer::Allocate(static_cast<size_t>(bytes), kIoAlign);
}

// The states file rank `rank` of `world` writes.
std::string StateFileName(int rank, int world) {
  return world == 1 ? std::string(kStatesFile) : fmt::format("states-rank-{:05d}.bin", rank);
}

// The manifest's states files (a version 2 or 3 manifest: states.bin over the
// one-rank element space), checked: in element order, contiguous from 0,
// covering the layout's `elements`, each as big as the manifest's files list
// says (`file_bytes`: name -> bytes). Throws on a malformed entry (the caller
// reports it).
StatusOr<std::vector<CheckpointStateFile>> StateFilesOf(
    const Json& m, int64_t elements, int64_t sub_group_size,
    const std::function<std::optional<int64_t>(const std::string&)>& file_bytes,
    const std::string& manifest_path) {
  std::vector<CheckpointStateFile> out;
  if (!m.contains("states")) {
    out.push_back({kStatesFile, 0, elements, std::max<int64_t>(1, sub_group_size)});
  } else {
    for (const Json& f : m.at("states"))
      out.push_back({f.at("file").get<std::string>(), f.at("elem_begin").get<int64_t>(),
                     f.at("elem_end").get<int64_t>(), f.at("sub_group_elems").get<int64_t>()});
  }
  int64_t next = 0;
  for (const CheckpointStateFile& f : out) {
    if (f.elem_begin != next || f.elem_end < f.elem_begin || f.sub_group_elems < 1)
      return DataLossError(fmt::format(
          "{}: states file {} covers elements [{}, {}) in sub-groups of {}; expected it to start "
          "at element {} with sub-groups of at least 1",
          manifest_path, f.name, f.elem_begin, f.elem_end, f.sub_group_elems, next));
    const std::optional<int64_t> bytes = file_bytes(f.name);
    const int64_t want = kOptimizerStateBytesPerElem * (f.elem_end - f.elem_begin);
    if (!bytes.has_value())
      return DataLossError(fmt::format("{}: lists no {}", manifest_path, f.name));
    if (*bytes != want)
      return DataLossError(fmt::format("{}: {} of {} bytes; its elements [{}, {}) take {} bytes",
                                       manifest_path, f.name, *bytes, f.elem_begin, f.elem_end,
                                       want));
    next = f.elem_end;
  }
  if (next < elements)
    return DataLossError(fmt::format("{}: the states files cover {} elements, the layout has {}",
                                     manifest_path, next, elements));
  return out;
}

// Several ranks: every rank's `mine` (status and payload) gathered. OK with
// every payload in rank order when every rank's status is OK; else the
// first failing rank's error, the same on every rank ("rank k: ..."). One
// rank (null): `mine` alone.
StatusOr<std::vector<std::string>> Exchange(const CheckpointRanks* ranks, int rank,
                                            const Status& mine, const std::string& payload) {
  if (ranks == nullptr || ranks->exchange == nullptr) {
    if (!mine.ok()) return mine;
    return std::vector<std::string>{payload};
  }
  // One byte of status code, then the message or the payload.
  const std::string text =
      mine.ok() ? std::string(1, '\0') + payload
                : std::string(1, static_cast<char>(mine.code())) + std::string(mine.message());
  ASSIGN_OR_RETURN(std::vector<std::string> all, ranks->exchange->AllGatherBytes(text));
  std::vector<std::string> payloads;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) return InternalError(fmt::format("checkpoint: rank {} sent nothing", r));
    if (all[r][0] != 0) {
      if (static_cast<int>(r) == rank) return mine;
      return Status(static_cast<StatusCode>(all[r][0]),
                    fmt::format("rank {}: {}", r, all[r].substr(1)));
    }
    payloads.push_back(all[r].substr(1));
  }
  return payloads;
}

// Module m's current parameter bytes into buf (host memory): from the store,
// or with partitioned parameters gathered from every rank's part (a
// collective).
Status ReadModuleBytes(StateStore* store, const CheckpointRanks* ranks, int m, uint8_t* buf) {
  if (!store->partition().params_partitioned()) return store->ReadModuleParams(m, buf);
  AlignedBuffer piece;
  ASSIGN_OR_RETURN(const PartBytes mine,
                   store->PartOf(m, /*updated=*/false, /*to_host=*/true, &piece));
  return ranks->gatherer->GatherModule(m, mine, buf, Memory::kHost);
}

// Restores this rank's sub-groups of `layout` (the store's) from the states
// files, each overlapping file read whole, in order, and checksummed again;
// elements no file covers (the partitions' tail padding) get zeros. `dst`:
// SectionBuffer(layout).
Status RestoreStates(const std::string& dir, const std::vector<CheckpointStateFile>& files,
                     const std::function<uint32_t(const std::string&)>& crc_of,
                     const Layout& layout, StateStore* store, AlignedBuffer& dst) {
  // (Named variables: Clang 14 cannot capture a structured binding.)
  const size_t g0 = store->partition().groups().first, g1 = store->partition().groups().second;
  if (g0 >= g1) return Status();
  const int64_t own0 = layout.group(g0).elem_begin, own1 = layout.group(g1 - 1).elem_end;
  int64_t src_elems = 0;
  for (const CheckpointStateFile& f : files)
    if (f.elem_end > own0 && f.elem_begin < own1)
      src_elems = std::max(src_elems, std::min(f.sub_group_elems, f.elem_end - f.elem_begin));
  ASSIGN_OR_RETURN(
      AlignedBuffer src,
      AlignedBuffer::Allocate(static_cast<size_t>(IoBytes(kOptimizerStateBytesPerElem *
                                                          std::max<int64_t>(1, src_elems))),
                              kIoAlign));
  size_t g = g0;
  auto clear = [&] {
    if (g < g1)
      std::memset(
          dst.data(), 0,
          static_cast<size_t>(IoBytes(kOptimizerStateBytesPerElem * layout.group(g).elems())));
  };
  clear();
  auto* d = dst.as<uint8_t>();
  const auto* sp = src.as<uint8_t>();
  for (const CheckpointStateFile& f : files) {
    if (f.elem_end <= own0 || f.elem_begin >= own1) continue;
    const std::string path = dir + "/" + f.name;
    ASSIGN_OR_RETURN(File in, File::Open(path, O_RDONLY));
    uint32_t crc = 0;
    for (int64_t s0 = f.elem_begin; s0 < f.elem_end; s0 += f.sub_group_elems) {
      const int64_t s1 = std::min(f.elem_end, s0 + f.sub_group_elems), n = s1 - s0;
      const size_t bytes = static_cast<size_t>(kOptimizerStateBytesPerElem * n);
      RETURN_IF_ERROR(in.ReadNext(src.data(), bytes));
      crc = Crc32cExtend(crc, src.data(), bytes);
      // Copy what falls in this rank's sub-groups; hand each over once
      // its last element has been read.
      while (g < g1) {
        const SubGroup& to = layout.group(g);
        const int64_t lo = std::max(s0, to.elem_begin), hi = std::min(s1, to.elem_end);
        for (int64_t k = 0; k < kOptimizerStateArrays && lo < hi; ++k)
          std::memcpy(d + kMasterBytesPerElem * (k * to.elems() + lo - to.elem_begin),
                      sp + kMasterBytesPerElem * (k * n + lo - s0),
                      static_cast<size_t>(kMasterBytesPerElem * (hi - lo)));
        if (to.elem_end > s1) break;
        RETURN_IF_ERROR(store->WriteGroupStates(g, dst.data()));
        ++g;
        clear();
      }
    }
    if (crc != crc_of(f.name))
      return DataLossError(
          fmt::format("checkpoint file {}: changed while loading (crc32c {}, the manifest's {})",
                      path, Hex32(crc), Hex32(crc_of(f.name))));
  }
  for (; g < g1; ++g, clear()) RETURN_IF_ERROR(store->WriteGroupStates(g, dst.data()));
  return Status();
}

// Removes a checkpoint directory whose save failed (it has no manifest).
class PartialDir {
 public:
  explicit PartialDir(std::string path) : path_(std::move(path)) {}
  ~PartialDir() {
    if (path_.empty()) return;
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  void Keep() { path_.clear(); }

 private:
  std::string path_;
};

}  // namespace

// ---- What may differ on load ---------------------------------------------------

namespace {
constexpr CheckpointFreeKey kFreeKeys[] = {
    {"train_micro_batch_size_per_gpu",
     "how the global batch (train_batch_size, compared) is split over ranks, micro-batches and "
     "accumulation: a checkpoint loads at another number of ranks"},
    {"gradient_accumulation_steps", "how the global batch is split (as above)"},
    {"zero_optimization.stage",
     "how states are partitioned over the ranks: the format does not depend on it"},
    {"zero_optimization.offload_optimizer",
     "where the optimizer states live: the same arithmetic runs on every placement, and the "
     "format does not depend on it"},
    {"zero_optimization.offload_param", "where the parameters live (as above)"},
    {"zero_optimization.stage3_prefetch_bucket_size", "how far ahead parameters are fetched"},
    {"zero_optimization.stage3_param_persistence_threshold",
     "which parameters stay resident in HBM"},
    {"zero_optimization.stage3_max_live_parameters", "how many parameters are resident at once"},
    {"zero_optimization.stage3_max_reuse_distance", "when a fetched parameter is kept"},
    {"zero_optimization.overlap_comm", "whether transfers overlap compute"},
    {"zero_optimization.contiguous_gradients", "the staging of gradient copies"},
    {"zero_optimization.reduce_bucket_size", "the size of gradient transfers"},
    {"zero_optimization.allgather_bucket_size", "the size of parameter transfers"},
    {"aio", "NVMe I/O tuning"},
    {"strata.device", "the device that runs the model (resuming on another device is allowed)"},
    {"strata.device_id", "which GPU of the machine runs the model"},
    {"strata.hbm_budget", "a memory budget: it changes the placement only"},
    {"strata.pinned_budget", "a memory budget: it changes the placement only"},
    {"strata.dram_budget", "a memory budget: it changes the placement only"},
    {"strata.trace_path", "where the timeline is written"},
    {"strata.threads",
     "CPU optimizer threads: each element's update does not depend on how the work is split"},
    {"strata.io_engine", "the NVMe I/O engine"},
    {"strata.io_sqpoll", "NVMe I/O submission polling"},
    {"strata.overlap_optimizer", "the overlapped step computes exactly what the blocking one does"},
    {"strata.grad_accumulator", "the window's sum has the same bits in HBM or in DRAM"},
    {"strata.host_device", "the simulated link of the host device (timing only)"},
    {"strata.model.steps", "the run's length (strata train: --steps counts from step 0)"},
};
}  // namespace

std::span<const CheckpointFreeKey> CheckpointFreeKeys() { return kFreeKeys; }

bool CheckpointKeyMayDiffer(std::string_view key) {
  for (const CheckpointFreeKey& f : kFreeKeys) {
    const std::string_view k = f.key;
    if (key.substr(0, k.size()) != k) continue;
    if (key.size() == k.size() || key[k.size()] == '.' || key[k.size()] == '[') return true;
  }
  return false;
}

std::string CheckpointConfigDifference(const std::string& then_json, const std::string& now_json) {
  return ConfigDifference(Json::parse(then_json), Json::parse(now_json));
}

// ---- Run ids and the lock on a root -------------------------------------------

std::string NewCheckpointRunId() {
  std::random_device rd;
  const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return fmt::format("{:016x}", v);
}

namespace {

// The locks this process holds, by the root's device and inode.
std::mutex g_locks_mu;
std::map<std::pair<uint64_t, uint64_t>, std::weak_ptr<CheckpointDirLock>>& Locks() {
  static auto* locks =
      new std::map<std::pair<uint64_t, uint64_t>, std::weak_ptr<CheckpointDirLock>>;
  return *locks;
}

void WriteLockText(int fd, const std::string& run_id) {
  const std::string text =
      fmt::format("pid {} run {}\n", ::getpid(), run_id.empty() ? "-" : run_id);
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) < 0)
    STRATA_LOG_WARN("checkpoint lock: cannot describe the holder: {}", std::strerror(errno));
}

}  // namespace

CheckpointDirLock::~CheckpointDirLock() {
  std::lock_guard<std::mutex> lock(g_locks_mu);
  ::close(fd_);  // drops the flock
  auto it = Locks().find({dev_, ino_});
  if (it != Locks().end() && it->second.expired()) Locks().erase(it);
}

void CheckpointDirLock::SetRunId(const std::string& run_id) { WriteLockText(fd_, run_id); }

StatusOr<std::shared_ptr<CheckpointDirLock>> LockCheckpointDir(const std::string& root,
                                                               const std::string& run_id) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec)
    return IOError(
        fmt::format("checkpoint directory {}: cannot create it: {}", root, ec.message()));
  struct stat st;
  if (::stat(root.c_str(), &st) != 0)
    return ErrnoError(fmt::format("checkpoint directory {}", root), errno);
  if (!S_ISDIR(st.st_mode))
    return FailedPreconditionError(fmt::format("checkpoint directory {}: not a directory", root));
  const std::pair<uint64_t, uint64_t> key{st.st_dev, st.st_ino};
  std::lock_guard<std::mutex> lock(g_locks_mu);
  if (auto it = Locks().find(key); it != Locks().end())
    if (std::shared_ptr<CheckpointDirLock> held = it->second.lock()) {
      if (!run_id.empty()) held->SetRunId(run_id);
      return held;
    }
  const std::string path = root + "/" + kCheckpointLockFile;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(fmt::format("checkpoint lock file {}: open", path), errno);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[256] = {};
    const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
    ::close(fd);
    if (err != EWOULDBLOCK) return ErrnoError(fmt::format("flock {}", path), err);
    std::string holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    return UnavailableError(fmt::format(
        "checkpoint directory {} is in use by another run ({}; {} is locked): wait for it to end "
        "or use another directory",
        root, holder.empty() ? "holder unknown" : holder, path));
  }
  WriteLockText(fd, run_id);
  std::shared_ptr<CheckpointDirLock> held(new CheckpointDirLock(
      fd, root, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)));
  Locks()[key] = held;
  return held;
}

// ---- What a root holds ---------------------------------------------------------

std::vector<CheckpointEntry> ListCheckpoints(const std::string& root) { return Scan(root); }

std::string OtherRunsCheckpoints(const std::vector<CheckpointEntry>& entries,
                                 const std::string& run_id) {
  struct Run {
    int count = 0;
    int64_t step = 0;
  };
  std::vector<std::pair<std::string, Run>> runs;  // in order of first appearance
  for (const CheckpointEntry& e : entries) {
    if (!e.complete || e.run_id == run_id) continue;
    auto it =
        std::find_if(runs.begin(), runs.end(), [&](const auto& r) { return r.first == e.run_id; });
    if (it == runs.end()) it = runs.insert(runs.end(), {e.run_id, Run{}});
    ++it->second.count;
    it->second.step = std::max(it->second.step, e.optimizer_step);
  }
  std::string out;
  for (const auto& [id, r] : runs)
    out += fmt::format("{}{} checkpoint{} of run {} up to step {}", out.empty() ? "" : " and ",
                       r.count, r.count == 1 ? "" : "s", RunName(id), r.step);
  return out;
}

StatusOr<int> RemoveAllCheckpoints(const std::string& root) {
  int removed = 0;
  for (const CheckpointEntry& e : Scan(root, /*summaries=*/false)) {
    const std::string manifest = e.path + "/" + kCheckpointManifest;
    if (::unlink(manifest.c_str()) != 0 && errno != ENOENT)
      return ErrnoError(fmt::format("removing checkpoint {}: unlink {}", e.path, manifest), errno);
    std::error_code ec;
    fs::remove_all(e.path, ec);
    if (ec) return IOError(fmt::format("removing checkpoint {}: {}", e.path, ec.message()));
    ++removed;
  }
  if (removed > 0) RETURN_IF_ERROR(SyncDir(root));
  return removed;
}

std::string LatestCheckpoint(const std::string& root) {
  std::error_code ec;
  if (fs::exists(fs::path(root) / kCheckpointManifest, ec)) return root;
  std::vector<CheckpointEntry> entries = Scan(root, /*summaries=*/false);
  for (auto it = entries.rbegin(); it != entries.rend(); ++it)
    if (it->complete) return it->path;
  return "";
}

Status WriteCheckpoint(const std::string& root, const Config& config, const Layout& layout,
                       StateStore* store, CheckpointMeta* meta, const CheckpointRanks* ranks) {
  const Partition& part = store->partition();
  const int rank = part.rank();
  const int world = part.world_size();
  if (part.params_partitioned() && (ranks == nullptr || ranks->gatherer == nullptr))
    return FailedPreconditionError("WriteCheckpoint: partitioned parameters without a gatherer");
  if (meta->run_id.empty())
    return InvalidArgumentError("WriteCheckpoint: no run id (CheckpointMeta::run_id)");
  // Rank 0 locks the root, checks it and makes the directory; every rank
  // learns the directory and rank 0's run id.
  std::string dir;
  int64_t seq = 0;
  std::optional<PartialDir> partial;
  const Status made = [&]() -> Status {
    if (rank != 0) return Status();
    std::error_code ec;
    const bool existed = fs::exists(root, ec);
    ASSIGN_OR_RETURN(meta->lock, LockCheckpointDir(root, ""));
    if (!existed) {
      const fs::path parent = fs::absolute(root, ec).parent_path();
      RETURN_IF_ERROR(SyncDir(parent.empty() ? "." : parent.string()));
    }
    const std::vector<CheckpointEntry> entries = Scan(root);
    if (const std::string others = OtherRunsCheckpoints(entries, meta->run_id); !others.empty())
      return FailedPreconditionError(fmt::format(
          "checkpoint directory {} holds {}, not of this run ({}): load its newest checkpoint "
          "first to continue that run, save into another directory, or remove them",
          root, others, meta->run_id));
    seq = (entries.empty() ? 0 : entries.back().sequence) + 1;
    dir = fmt::format("{}/ckpt-{:08d}", root, seq);
    if (::mkdir(dir.c_str(), 0755) != 0) return ErrnoError(fmt::format("mkdir {}", dir), errno);
    partial.emplace(dir);
    return SyncDir(root);
  }();
  {
    ASSIGN_OR_RETURN(std::vector<std::string> got,
                     Exchange(ranks, rank, made, rank == 0 ? dir + "\n" + meta->run_id : ""));
    const size_t nl = got[0].find('\n');
    dir = got[0].substr(0, nl);
    meta->run_id = got[0].substr(nl + 1);
  }

  // Data files: written in full, fsync'd, closed. Rank 0 writes the
  // parameters; every rank its partition's states.
  Json files = Json::array();
  meta->bytes = 0;
  const size_t g0 = store->partition().groups().first, g1 = store->partition().groups().second;
  const CheckpointStateFile mine{StateFileName(rank, world), layout.group(g0).elem_begin,
                                 layout.group(g1 - 1).elem_end, layout.group(g0).elems()};
  const Status wrote = [&]() -> Status {
    if (rank != 0 && !fs::is_directory(dir))
      return FailedPreconditionError(fmt::format(
          "checkpoint directory {} (made by rank 0) is not there: the ranks of a run must save "
          "into a directory on a filesystem every rank sees",
          dir));
    ASSIGN_OR_RETURN(AlignedBuffer buf, SectionBuffer(layout));
    // A data file: every section filled (`fill`) and, with `to_disk`,
    // appended, the file fsync'd and listed. After a write error the
    // sections are still filled (a fill may be a collective the other ranks
    // wait for) and the error is returned at the end.
    auto write_file = [&](const std::string& name, size_t first, size_t end, bool to_disk,
                          const std::function<StatusOr<int64_t>(size_t, void*)>& fill) -> Status {
      std::optional<File> f;
      Status write_error;
      if (to_disk) {
        StatusOr<File> opened = File::Open(dir + "/" + name, O_WRONLY | O_CREAT | O_EXCL);
        if (opened.ok()) f.emplace(std::move(*opened));
        write_error = opened.status();
      }
      uint32_t crc = 0;
      int64_t bytes = 0;
      for (size_t i = first; i < end; ++i) {
        ASSIGN_OR_RETURN(int64_t n, fill(i, buf.data()));
        if (!to_disk || !write_error.ok()) continue;
        crc = Crc32cExtend(crc, buf.data(), static_cast<size_t>(n));
        write_error = f->Append(buf.data(), static_cast<size_t>(n));
        bytes += n;
      }
      if (!to_disk) return Status();
      if (write_error.ok()) write_error = f->Sync();
      if (write_error.ok()) write_error = f->Close();
      RETURN_IF_ERROR(write_error);
      files.push_back({{"name", name}, {"bytes", bytes}, {"crc32c", Hex32(crc)}});
      meta->bytes += bytes;
      return Status();
    };
    // The parameters, written by rank 0; with partitioned parameters every
    // rank gathers each module for it (a collective).
    if (rank == 0 || part.params_partitioned())
      RETURN_IF_ERROR(write_file(kParamsFile, 0, static_cast<size_t>(layout.num_modules()),
                                 rank == 0, [&](size_t m, void* b) -> StatusOr<int64_t> {
                                   RETURN_IF_ERROR(ReadModuleBytes(store, ranks,
                                                                   static_cast<int>(m),
                                                                   static_cast<uint8_t*>(b)));
                                   return layout.module(static_cast<int>(m)).bytes();
                                 }));
    return write_file(mine.name, g0, g1, true, [&](size_t g, void* b) -> StatusOr<int64_t> {
      RETURN_IF_ERROR(store->ReadGroupStates(g, b));
      return kOptimizerStateBytesPerElem * layout.group(g).elems();
    });
  }();
  const Json report = {{"files", files},
                       {"states",
                        {{"file", mine.name},
                         {"elem_begin", mine.elem_begin},
                         {"elem_end", mine.elem_end},
                         {"sub_group_elems", mine.sub_group_elems}}}};
  ASSIGN_OR_RETURN(const std::vector<std::string> reports,
                   Exchange(ranks, rank, wrote, report.dump()));

  // Rank 0: the manifest, once every rank's file is durable.
  const Status done = [&]() -> Status {
    if (rank != 0) return Status();
    Json all_files = Json::array(), states = Json::array();
    for (const std::string& text : reports) {
      const Json r = Json::parse(text);
      for (const Json& f : r.at("files")) all_files.push_back(f);
      states.push_back(r.at("states"));
    }
    RETURN_IF_ERROR(SyncDir(dir));
    if (meta->at_point) meta->at_point("data");

    const Json config_id = ConfigIdentity(config);
    const Json layout_id = LayoutIdentity(layout);
    Json m;
    m["format"] = kFormat;
    m["version"] = kCheckpointFormatVersion;
    m["sequence"] = seq;
    m["run_id"] = meta->run_id;
    m["optimizer_step"] = meta->optimizer_step;
    m["loss_scaler"] = {{"scale", meta->scaler.scale},
                        {"hysteresis_left", meta->scaler.hysteresis_left},
                        {"iteration", meta->scaler.iteration},
                        {"last_overflow_iteration", meta->scaler.last_overflow_iteration}};
    m["data_position"] = meta->data_position;
    m["note"] = meta->note;
    m["config_hash"] = IdentityHash(config_id);
    m["config"] = config_id;
    m["layout_hash"] = IdentityHash(layout_id);
    m["layout"] = layout_id;
    if (meta->param_groups.size() > 1) m["param_groups"] = ParamGroupsIdentity(meta->param_groups);
    m["ranks"] = world;
    m["states"] = std::move(states);
    m["files"] = std::move(all_files);
    std::string text;
    try {
      m["manifest_crc32c"] = ManifestCrc(m);
      text = m.dump(1) + "\n";
    } catch (const nlohmann::json::exception& e) {
      return InvalidArgumentError(
          fmt::format("SaveCheckpoint: the note is not valid UTF-8 ({})", e.what()));
    }
    const std::string final_path = dir + "/" + kCheckpointManifest;
    const std::string tmp = final_path + ".tmp";
    {
      ASSIGN_OR_RETURN(File f, File::Open(tmp, O_WRONLY | O_CREAT | O_EXCL));
      RETURN_IF_ERROR(f.Append(text.data(), text.size()));
      RETURN_IF_ERROR(f.Sync());
      RETURN_IF_ERROR(f.Close());
    }
    if (meta->at_point) meta->at_point("manifest_tmp");
    if (::rename(tmp.c_str(), final_path.c_str()) != 0)
      return ErrnoError(fmt::format("rename {} to {}", tmp, final_path), errno);
    partial->Keep();
    if (meta->at_point) meta->at_point("rename");
    RETURN_IF_ERROR(SyncDir(dir));
    RETURN_IF_ERROR(SyncDir(root));
    RemoveOld(root, seq, meta->run_id, meta->at_point);
    return Status();
  }();
  RETURN_IF_ERROR(Exchange(ranks, rank, done, "").status());
  meta->path = dir;
  return Status();
}

StatusOr<CheckpointMeta> ReadCheckpoint(const std::string& root, const Config& config,
                                        const Layout& layout, StateStore* store,
                                        std::span<const ParamGroupSpec> groups,
                                        const CheckpointRanks* ranks) {
  const int rank = store->partition().rank();
  // Rank 0 picks the checkpoint. A root is locked: a save of another process
  // must not be judged interrupted, nor a checkpoint removed under it.
  std::shared_ptr<CheckpointDirLock> lock;
  std::string dir;
  const Status picked = [&]() -> Status {
    if (rank != 0) return Status();
    if (LatestCheckpoint(root).empty())
      return NotFoundError(
          fmt::format("no checkpoint in {} (no ckpt-*/{})", root, kCheckpointManifest));
    if (LatestCheckpoint(root) != root) {
      StatusOr<std::shared_ptr<CheckpointDirLock>> l = LockCheckpointDir(root, "");
      if (l.ok()) {
        lock = *l;
      } else if (l.status().code() == StatusCode::kUnavailable ||
                 ::access(root.c_str(), W_OK) == 0) {
        return l.status();
      }  // else read-only: read without the lock, tidy nothing
    }
    dir = LatestCheckpoint(root);
    if (dir.empty())
      return NotFoundError(
          fmt::format("no checkpoint in {} (no ckpt-*/{})", root, kCheckpointManifest));
    if (dir != root) {
      std::string skipped;
      bool newer = false;
      for (const CheckpointEntry& e : Scan(root, /*summaries=*/false)) {
        if (e.path == dir)
          newer = true;
        else if (newer && !e.complete)
          skipped += (skipped.empty() ? "" : ", ") + e.path;
      }
      if (!skipped.empty())
        STRATA_LOG_WARN("checkpoint: loading {}; skipped the newer {} (no {}: an interrupted save)",
                        dir, skipped, kCheckpointManifest);
    }
    return Status();
  }();
  {
    ASSIGN_OR_RETURN(std::vector<std::string> got, Exchange(ranks, rank, picked, dir));
    dir = got[0];
  }
  const std::string manifest_path = dir + "/" + kCheckpointManifest;

  CheckpointMeta meta;
  meta.path = dir;
  struct FileEntry {
    int64_t bytes = 0;
    uint32_t crc = 0;
  };
  std::map<std::string, FileEntry> listed;
  std::vector<CheckpointStateFile> state_files;
  ASSIGN_OR_RETURN(AlignedBuffer buf, SectionBuffer(layout));
  const auto [g0, g1] = store->partition().groups();
  const int64_t own0 = layout.group(g0).elem_begin, own1 = layout.group(g1 - 1).elem_end;
  auto mine = [&](const CheckpointStateFile& f) {
    return f.elem_end > own0 && f.elem_begin < own1;
  };
  // Every rank checks the manifest and verifies what it will read.
  const Status checked = [&]() -> Status {
    ASSIGN_OR_RETURN(const Json m, LoadManifest(dir));
    try {
      std::string diff = ConfigDifference(m.at("config"), ConfigIdentity(config));
      if (!diff.empty())
        return FailedPreconditionError(
            fmt::format("checkpoint {} was saved with a different config: {}", dir, diff));
      diff = LayoutDifference(m.at("layout"), LayoutIdentity(layout));
      if (!diff.empty())
        return FailedPreconditionError(
            fmt::format("checkpoint {} has a different model layout: {}", dir, diff));
      const ParamGroupSpec default_group = DefaultParamGroup();
      const std::span<const ParamGroupSpec> one_group(&default_group, 1);
      const Json groups_now = ParamGroupsIdentity(groups.size() > 1 ? groups : one_group);
      const Json groups_then =
          m.contains("param_groups") ? m.at("param_groups") : ParamGroupsIdentity(one_group);
      diff = ParamGroupsDifference(groups_then, groups_now);
      if (!diff.empty())
        return FailedPreconditionError(
            fmt::format("checkpoint {} has different optimizer parameter groups: {}", dir, diff));
      meta.run_id = m.at("run_id").get<std::string>();
      meta.optimizer_step = m.at("optimizer_step").get<int64_t>();
      const Json& ls = m.at("loss_scaler");
      meta.scaler.scale = ls.at("scale").get<double>();
      meta.scaler.hysteresis_left = ls.at("hysteresis_left").get<int>();
      meta.scaler.iteration = ls.at("iteration").get<int64_t>();
      meta.scaler.last_overflow_iteration = ls.at("last_overflow_iteration").get<int64_t>();
      meta.data_position = m.at("data_position").get<int64_t>();
      meta.note = m.at("note").get<std::string>();
      for (const Json& f : m.at("files")) {
        FileEntry e;
        e.bytes = f.at("bytes").get<int64_t>();
        e.crc = static_cast<uint32_t>(std::stoul(f.at("crc32c").get<std::string>(), nullptr, 16));
        listed[f.at("name").get<std::string>()] = e;
      }
      ASSIGN_OR_RETURN(state_files, StateFilesOf(
                                        m, layout.unpartitioned_elems(), layout.sub_group_size(),
                                        [&](const std::string& name) -> std::optional<int64_t> {
                                          auto it = listed.find(name);
                                          if (it == listed.end()) return std::nullopt;
                                          return it->second.bytes;
                                        },
                                        manifest_path));
    } catch (const std::exception& e) {
      return DataLossError(fmt::format("checkpoint manifest {}: {}", manifest_path, e.what()));
    }
    auto params = listed.find(kParamsFile);
    if (params == listed.end())
      return DataLossError(fmt::format("{}: lists no {}", manifest_path, kParamsFile));
    if (params->second.bytes != ParamFileBytes(layout))
      return DataLossError(fmt::format("{}: {} of {} bytes, the layout's is {} bytes",
                                       manifest_path, kParamsFile, params->second.bytes,
                                       ParamFileBytes(layout)));
    // Everything is verified before anything is restored.
    RETURN_IF_ERROR(
        VerifyFile(dir + "/" + kParamsFile, params->second.bytes, params->second.crc, buf));
    for (const CheckpointStateFile& f : state_files)
      if (mine(f))
        RETURN_IF_ERROR(
            VerifyFile(dir + "/" + f.name, listed[f.name].bytes, listed[f.name].crc, buf));
    return Status();
  }();
  RETURN_IF_ERROR(Exchange(ranks, rank, checked, "").status());

  // Every rank restores the parameters and its partition's states.
  const Status restored = [&]() -> Status {
    const std::string params_path = dir + "/" + kParamsFile;
    ASSIGN_OR_RETURN(File f, File::Open(params_path, O_RDONLY));
    uint32_t crc = 0;
    for (int mi = 0; mi < layout.num_modules(); ++mi) {
      const int64_t n = layout.module(mi).bytes();
      if (n == 0) continue;
      RETURN_IF_ERROR(f.ReadNext(buf.data(), static_cast<size_t>(n)));
      crc = Crc32cExtend(crc, buf.data(), static_cast<size_t>(n));
      // Page padding of the section buffer: zeros (NVMe writes whole pages).
      std::memset(buf.as<uint8_t>() + n, 0, static_cast<size_t>(IoBytes(n) - n));
      RETURN_IF_ERROR(store->WriteModuleParams(mi, buf.data()));
    }
    if (crc != listed[kParamsFile].crc)
      return DataLossError(
          fmt::format("checkpoint file {}: changed while loading (crc32c {}, the manifest's {})",
                      params_path, Hex32(crc), Hex32(listed[kParamsFile].crc)));
    return RestoreStates(
        dir, state_files, [&](const std::string& name) { return listed[name].crc; }, layout, store,
        buf);
  }();
  const Status all_restored = Exchange(ranks, rank, restored, "").status();
  if (!all_restored.ok())
    return DataLossError(
        fmt::format("restoring checkpoint {}: {}; the engine's states are partly "
                    "restored: load again or recreate the engine",
                    dir, all_restored.ToString()));
  for (const CheckpointStateFile& f : state_files)
    if (mine(f)) meta.bytes += listed[f.name].bytes;
  meta.bytes += listed[kParamsFile].bytes;
  // A resume tidies what a crash left under the root, as the save it
  // interrupted would have: directories without a manifest and checkpoints
  // beyond the newest kCheckpointsKept, none newer than the one loaded.
  if (lock != nullptr) {
    lock->SetRunId(meta.run_id);
    for (const CheckpointEntry& e : Scan(root, /*summaries=*/false))
      if (e.path == dir) RemoveOld(root, e.sequence, meta.run_id);
  }
  meta.lock = std::move(lock);
  return meta;
}

// ---- Reading a checkpoint without an engine ------------------------------------

namespace {

// The manifest of `dir` as an inspection: identity, rebuilt layout and the
// files it lists (not checked).
StatusOr<CheckpointInspection> ParseManifest(const std::string& dir) {
  const std::string manifest_path = dir + "/" + kCheckpointManifest;
  ASSIGN_OR_RETURN(const Json m, LoadManifest(dir));
  CheckpointInspection in;
  in.path = dir;
  try {
    in.version = m.at("version").get<int>();
    in.sequence = m.at("sequence").get<int64_t>();
    in.run_id = m.at("run_id").get<std::string>();
    in.optimizer_step = m.at("optimizer_step").get<int64_t>();
    in.data_position = m.at("data_position").get<int64_t>();
    in.note = m.at("note").get<std::string>();
    in.config_hash = m.at("config_hash").get<std::string>();
    in.layout_hash = m.at("layout_hash").get<std::string>();
    const Json& cfg = m.at("config");
    in.config_json = cfg.dump();
    const Json& opt = cfg.at("optimizer");
    in.optimizer_type = opt.at("type").get<std::string>();
    if (opt.contains("params") && opt["params"].contains("lr"))
      in.lr = opt["params"]["lr"].get<double>();
    in.model_dtype = cfg.at("fp16").at("enabled").get<bool>()   ? "fp16"
                     : cfg.at("bf16").at("enabled").get<bool>() ? "bf16"
                                                                : "fp32";
    in.sub_group_size = cfg.at("zero_optimization").at("sub_group_size").get<int64_t>();
    const Json& lj = m.at("layout");
    std::vector<ParamRec> recs;
    for (const Json& pj : lj.at("parameters")) {
      ParamRec r;
      r.name = pj.at(0).get<std::string>();
      r.numel = pj.at(1).get<int64_t>();
      const std::string dt = pj.at(2).get<std::string>();
      const std::optional<DType> d = ParseDType(dt);
      if (!d.has_value())
        return DataLossError(
            fmt::format("{}: parameter {} has dtype {}, expected fp32, fp16 or bf16", manifest_path,
                        r.name, dt));
      r.dtype = *d;
      r.module = pj.at(3).get<int>();
      if (pj.size() > 4) r.group = pj.at(4).get<int>();
      if (r.numel < 0 || r.module < 0 || r.group < 0)
        return DataLossError(fmt::format("{}: parameter {} has numel {} and module {}",
                                         manifest_path, r.name, r.numel, r.module));
      recs.push_back(std::move(r));
    }
    if (recs.empty())
      return DataLossError(fmt::format("{}: the layout lists no parameters", manifest_path));
    LayoutOptions lo;
    lo.sub_group_size = in.sub_group_size;
    in.layout = Layout::Build(std::move(recs), lo);
    if (in.layout.total_elems() != lj.at("elements").get<int64_t>() ||
        in.layout.num_modules() != lj.at("modules").get<int>() ||
        in.layout.num_groups() != lj.at("sub_groups").get<size_t>())
      return DataLossError(fmt::format(
          "{}: the layout records {} elements, {} modules and {} sub-groups; its parameters and "
          "sub_group_size {} give {}, {} and {}",
          manifest_path, lj.at("elements").dump(), lj.at("modules").dump(),
          lj.at("sub_groups").dump(), in.sub_group_size, in.layout.total_elems(),
          in.layout.num_modules(), in.layout.num_groups()));
    for (const Json& f : m.at("files")) {
      CheckpointFileCheck c;
      c.name = f.at("name").get<std::string>();
      c.bytes = f.at("bytes").get<int64_t>();
      c.crc32c = f.at("crc32c").get<std::string>();
      in.files.push_back(std::move(c));
    }
    ASSIGN_OR_RETURN(in.state_files, StateFilesOf(
                                         m, in.layout.unpartitioned_elems(), in.sub_group_size,
                                         [&](const std::string& name) -> std::optional<int64_t> {
                                           for (const CheckpointFileCheck& c : in.files)
                                             if (c.name == name) return c.bytes;
                                           return std::nullopt;
                                         },
                                         manifest_path));
  } catch (const std::exception& e) {
    return DataLossError(fmt::format("checkpoint manifest {}: {}", manifest_path, e.what()));
  }
  auto it = std::find_if(in.files.begin(), in.files.end(),
                         [&](const CheckpointFileCheck& c) { return c.name == kParamsFile; });
  if (it == in.files.end())
    return DataLossError(fmt::format("{}: lists no {}", manifest_path, kParamsFile));
  if (it->bytes != ParamFileBytes(in.layout))
    return DataLossError(fmt::format("{}: {} of {} bytes, the layout's is {} bytes", manifest_path,
                                     kParamsFile, it->bytes, ParamFileBytes(in.layout)));
  return in;
}

// Sizes (and with `verify` CRC-32C) of the listed files; sets validity.
Status CheckFiles(CheckpointInspection* in, bool verify) {
  ASSIGN_OR_RETURN(AlignedBuffer buf, AlignedBuffer::Allocate(kVerifyChunk, kIoAlign));
  for (CheckpointFileCheck& c : in->files) {
    const std::string path = in->path + "/" + c.name;
    std::error_code ec;
    const uintmax_t size = fs::file_size(path, ec);
    c.actual_bytes = ec ? -1 : static_cast<int64_t>(size);
    Status s;
    if (verify) {
      s = VerifyFile(path, c.bytes, static_cast<uint32_t>(std::stoul(c.crc32c, nullptr, 16)), buf);
    } else if (c.actual_bytes != c.bytes) {
      s = DataLossError(fmt::format("checkpoint file {}: {} bytes, the manifest says {}", path,
                                    c.actual_bytes, c.bytes));
    }
    c.ok = s.ok() && verify;
    if (!s.ok() && in->validity.ok()) in->validity = s;
  }
  return Status();
}

}  // namespace

StatusOr<CheckpointInspection> InspectCheckpoint(const std::string& dir, bool verify) {
  std::error_code ec;
  if (fs::exists(fs::path(dir) / kCheckpointManifest, ec)) {
    ASSIGN_OR_RETURN(CheckpointInspection in, ParseManifest(dir));
    RETURN_IF_ERROR(CheckFiles(&in, verify));
    return in;
  }
  if (!fs::is_directory(dir, ec))
    return NotFoundError(fmt::format("checkpoint directory {}: not a directory", dir));
  std::vector<CheckpointEntry> entries = Scan(dir, /*summaries=*/false);
  std::optional<CheckpointInspection> newest;
  Status newest_error;
  std::vector<std::string> skipped;
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    if (!it->complete) continue;
    StatusOr<CheckpointInspection> in = ParseManifest(it->path);
    if (in.ok()) RETURN_IF_ERROR(CheckFiles(&*in, verify));
    const Status problem = in.ok() ? in->validity : in.status();
    if (problem.ok()) {
      in->skipped = std::move(skipped);
      return std::move(*in);
    }
    if (!newest.has_value() && newest_error.ok()) {
      if (in.ok())
        newest = std::move(*in);
      else
        newest_error = problem;
    }
    skipped.push_back(fmt::format("{}: {}", it->path, problem.message()));
  }
  if (newest.has_value()) {
    skipped.erase(skipped.begin());
    newest->skipped = std::move(skipped);
    return std::move(*newest);
  }
  if (!newest_error.ok()) return newest_error;
  return NotFoundError(fmt::format("no checkpoint in {} (no {} there and no ckpt-*/{})", dir,
                                   kCheckpointManifest, kCheckpointManifest));
}

StatusOr<CheckpointExportResult> ExportCheckpoint(const std::string& dir, const std::string& out,
                                                  ExportPrecision precision) {
  ASSIGN_OR_RETURN(CheckpointInspection in, InspectCheckpoint(dir, /*verify=*/true));
  if (!in.validity.ok())
    return DataLossError(
        fmt::format("refusing to export checkpoint {}: {}", in.path, in.validity.message()));
  const Layout& l = in.layout;
  const bool fp32 = precision == ExportPrecision::kFp32;
  // The bytes to copy, as [begin, end) ranges of each source file, the
  // files and the ranges in the flat element order (which is the order of
  // the tensors in the output): params.bin, or the states files.
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  std::vector<std::pair<std::string, Ranges>> sources;
  Ranges param_ranges;
  std::vector<SafetensorsTensor> tensors;
  std::set<std::string> names;
  auto add_tensor = [&](const ParamRec& p, int64_t file_off) -> Status {
    const int64_t es = fp32 ? 4 : p.elem_size();
    const DType t = fp32 ? DType::kFp32 : p.dtype;
    if (!names.insert(p.name).second)
      return FailedPreconditionError(
          fmt::format("checkpoint {}: parameter name {} appears twice", in.path, p.name));
    tensors.push_back(
        {p.name, t == DType::kFp32 ? "F32" : (t == DType::kBf16 ? "BF16" : "F16"), {p.numel}});
    if (p.numel > 0 && !fp32) param_ranges.emplace_back(file_off, file_off + p.numel * es);
    return Status();
  };
  int64_t module_file_off = 0;
  for (const ModuleExtent& me : l.modules()) {
    for (int id : me.params)
      RETURN_IF_ERROR(
          add_tensor(l.param(id), module_file_off + l.param(id).byte_off - me.byte_begin));
    module_file_off += me.bytes();
  }
  if (!fp32) sources.emplace_back(kParamsFile, std::move(param_ranges));
  if (fp32)  // each sub-group's section starts with its masters; padding (layout.h) left out
    for (const CheckpointStateFile& f : in.state_files) {
      Ranges& r = sources.emplace_back(f.name, Ranges{}).second;
      for (int64_t s0 = f.elem_begin; s0 < f.elem_end; s0 += f.sub_group_elems)
        for (const Layout::Slice& sl : l.Slices(s0, std::min(f.elem_end, s0 + f.sub_group_elems))) {
          const int64_t at = kOptimizerStateBytesPerElem * (s0 - f.elem_begin) +
                             kMasterBytesPerElem * (sl.elem_begin - s0);
          r.emplace_back(at, at + kMasterBytesPerElem * (sl.elem_end - sl.elem_begin));
        }
    }
  // The header and the file's creation: src/scheduler/safetensors.h. A name
  // the header cannot hold (not UTF-8, "__metadata__") is the checkpoint's.
  StatusOr<SafetensorsWriter> created =
      SafetensorsWriter::Create(out,
                                {{"format", "pt"},
                                 {"strata_checkpoint", in.path},
                                 {"run_id", in.run_id},
                                 {"optimizer_step", std::to_string(in.optimizer_step)},
                                 {"precision", fp32 ? "fp32 masters" : "training dtype"}},
                                tensors);
  if (created.status().code() == StatusCode::kInvalidArgument)
    return DataLossError(fmt::format("checkpoint {}: {}", in.path, created.status().message()));
  ASSIGN_OR_RETURN(SafetensorsWriter f, std::move(created));

  // Each source file, read once in chunks: checksummed whole, the ranges copied.
  ASSIGN_OR_RETURN(AlignedBuffer buf, AlignedBuffer::Allocate(kVerifyChunk, kIoAlign));
  for (const auto& [source, ranges] : sources) {
    const std::string src_path = in.path + "/" + source;
    const std::string& name =
        source;  // Clang 14 (the thread-safety check) cannot capture a binding
    const auto entry = std::find_if(in.files.begin(), in.files.end(),
                                    [&](const CheckpointFileCheck& c) { return c.name == name; });
    ASSIGN_OR_RETURN(File src, File::Open(src_path, O_RDONLY));
    uint32_t crc = 0;
    size_t r = 0;
    for (int64_t pos = 0; pos < entry->bytes;) {
      const int64_t n = std::min<int64_t>(entry->bytes - pos, kVerifyChunk);
      RETURN_IF_ERROR(src.ReadNext(buf.data(), static_cast<size_t>(n)));
      crc = Crc32cExtend(crc, buf.data(), static_cast<size_t>(n));
      for (; r < ranges.size() && ranges[r].first < pos + n; ++r) {
        const int64_t b = std::max(ranges[r].first, pos), e = std::min(ranges[r].second, pos + n);
        if (e > b)
          RETURN_IF_ERROR(f.Append(buf.as<uint8_t>() + (b - pos), static_cast<size_t>(e - b)));
        if (ranges[r].second > pos + n) break;  // continues in the next chunk
      }
      pos += n;
    }
    if (Hex32(crc) != entry->crc32c)
      return DataLossError(
          fmt::format("checkpoint file {}: changed while exporting (crc32c {}, the "
                      "manifest's {})",
                      src_path, Hex32(crc), entry->crc32c));
  }
  RETURN_IF_ERROR(f.Commit());
  CheckpointExportResult res;
  res.checkpoint = in.path;
  res.optimizer_step = in.optimizer_step;
  res.tensors = static_cast<int64_t>(l.params().size());
  res.bytes = f.file_bytes();
  return res;
}

}  // namespace strata::scheduler
