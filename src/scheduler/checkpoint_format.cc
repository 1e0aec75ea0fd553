#include "src/scheduler/checkpoint_format.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <exception>
#include <optional>
#include <utility>

#include "src/common/crc32c.h"
#include "src/common/dtype.h"
#include "src/common/private_fs.h"
#include "src/common/status_util.h"

namespace strata::scheduler {
namespace checkpoint_internal {

// ---- Files ---------------------------------------------------------------------

StatusOr<File> File::Open(const std::string& path, int flags) {
  if ((flags & O_CREAT) != 0) {
    ASSIGN_OR_RETURN(const int fd, CreateNewFile(path, flags & ~O_CREAT, "checkpoint file"));
    return File(fd, path);
  }
  ASSIGN_OR_RETURN(const int fd, OpenRegularFile(path, flags, "checkpoint file"));
  return File(fd, path);
}

File::File(File&& o) noexcept
    : fd_(std::exchange(o.fd_, -1)), path_(std::move(o.path_)), off_(o.off_) {}

File::~File() {
  if (fd_ >= 0) ::close(fd_);
}

Status File::Append(const void* data, size_t n) {
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

Status File::ReadNext(void* buf, size_t n) {
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

StatusOr<int64_t> File::Size() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) return ErrnoError(fmt::format("fstat {}", path_), errno);
  return static_cast<int64_t>(st.st_size);
}

Status File::Sync() {
  if (::fsync(fd_) != 0) return ErrnoError(fmt::format("fsync {}", path_), errno);
  return Status();
}

Status File::Close() {
  const int fd = std::exchange(fd_, -1);
  if (fd >= 0 && ::close(fd) != 0) return ErrnoError(fmt::format("close {}", path_), errno);
  return Status();
}

Status SyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(fmt::format("open {}", dir), errno);
  File d(fd, dir);
  return d.Sync();
}

std::string Hex32(uint32_t v) { return fmt::format("{:08x}", v); }

// ---- Identity: what must match for a checkpoint to load ----------------------

// The whole effective config (ConfigToJson), application sections included.
Json ConfigIdentity(const Config& c) { return Json::parse(ConfigToJson(c, -1)); }

namespace {

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

}  // namespace

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
  // Each parameter's shape (in the order of "parameters"; [numel] when none
  // was registered) and the other names of tied ones: what an export needs
  // to give the model's tensors under every name. (A checkpoint from before
  // has neither: its export is flat and under the first names.)
  Json shapes = Json::array();
  Json aliases = Json::object();
  for (const ParamRec& p : l.params()) {
    shapes.push_back(p.shape.empty() ? std::vector<int64_t>{p.numel} : p.shape);
    if (!p.aliases.empty()) aliases[p.name] = p.aliases;
  }
  j["shapes"] = std::move(shapes);
  if (!aliases.empty()) j["aliases"] = std::move(aliases);
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

namespace {

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
    if (r.numel < 0 || r.numel > INT64_MAX - off)
      return DataLossError(
          fmt::format("{}: tensor {} has numel {}", manifest_path, r.name, r.numel));
    off += r.numel;
  }
  return Status::Ok();
}

}  // namespace

namespace {

// Refuses nesting deeper than kMaxManifestDepth while nlohmann parses (its
// callback sees every container as it opens), so that no recursive walk
// (copy, dump, comparison) ever meets a deeper document.
struct TooDeep {};

}  // namespace

StatusOr<Json> ParseManifestText(std::string_view text, const std::string& manifest_path) {
  Json m;
  try {
    m = Json::parse(
        text.begin(), text.end(),
        [](int depth, Json::parse_event_t event, Json&) {
          if ((event == Json::parse_event_t::object_start ||
               event == Json::parse_event_t::array_start) &&
              depth >= kMaxManifestDepth)
            throw TooDeep{};
          return true;
        },
        /*allow_exceptions=*/false);
  } catch (const TooDeep&) {
    return DataLossError(
        fmt::format("checkpoint manifest {}: nested deeper than {} levels of objects and arrays "
                    "(a manifest this build writes has at most {}); not read",
                    manifest_path, kMaxManifestDepth, kMaxManifestDepth));
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(
        fmt::format("checkpoint manifest {}: out of memory while parsing it", manifest_path));
  }
  if (m.is_discarded() || !m.is_object())
    return DataLossError(fmt::format("checkpoint manifest {}: not valid JSON", manifest_path));
  return m;
}

StatusOr<Json> LoadManifest(const std::string& dir) {
  const std::string manifest_path = dir + "/" + kCheckpointManifest;
  std::string text;
  {
    ASSIGN_OR_RETURN(File f, File::Open(manifest_path, O_RDONLY));
    ASSIGN_OR_RETURN(int64_t size, f.Size());
    if (size > kMaxManifestBytes)
      return DataLossError(fmt::format("checkpoint manifest {}: {} bytes, expected at most {} MiB",
                                       manifest_path, size, kMaxManifestBytes >> 20));
    text.resize(static_cast<size_t>(size));
    RETURN_IF_ERROR(f.ReadNext(text.data(), text.size()));
  }
  ASSIGN_OR_RETURN(Json m, ParseManifestText(text, manifest_path));
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

bool IsCheckpointDataFileName(std::string_view name) {
  if (name == kParamsFile || name == kStatesFile) return true;
  constexpr std::string_view kPrefix = "states-rank-", kSuffix = ".bin";
  if (name.size() <= kPrefix.size() + kSuffix.size() || !name.starts_with(kPrefix) ||
      !name.ends_with(kSuffix) || name.size() > kPrefix.size() + kSuffix.size() + 9)
    return false;
  const std::string_view digits =
      name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
  return std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
}

namespace {

// A manifest string shown in a message: at most 80 characters, control
// characters escaped (it is the forger's text).
std::string Shown(const Json& v) {
  std::string s = v.dump(-1, ' ', /*ensure_ascii=*/true, Json::error_handler_t::replace);
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

}  // namespace

StatusOr<std::vector<ManifestFile>> ManifestFiles(const Json& m, const std::string& manifest_path) {
  const auto it = m.find("files");
  if (it == m.end() || !it->is_array())
    return DataLossError(fmt::format("{}: no \"files\" list", manifest_path));
  std::vector<ManifestFile> out;
  for (size_t i = 0; i < it->size(); ++i) {
    const Json& f = (*it)[i];
    auto bad = [&](std::string_view what) {
      return DataLossError(fmt::format("{}: files[{}] {}: {}", manifest_path, i, Shown(f), what));
    };
    if (!f.is_object()) return bad("expected an object {name, bytes, crc32c}");
    const auto name = f.find("name"), bytes = f.find("bytes"), crc = f.find("crc32c");
    if (name == f.end() || !name->is_string() ||
        !IsCheckpointDataFileName(name->get_ref<const std::string&>()))
      return bad(
          "the name is not one this format writes (params.bin, states.bin, "
          "states-rank-<k>.bin): only those, in the checkpoint's own directory, are read");
    if (bytes == f.end() || !bytes->is_number_integer() || bytes->get<int64_t>() < 0)
      return bad("bytes is not a size (an integer >= 0)");
    const std::string* hex =
        crc != f.end() && crc->is_string() ? &crc->get_ref<const std::string&>() : nullptr;
    if (hex == nullptr || hex->size() != 8 ||
        !std::all_of(hex->begin(), hex->end(), [](char c) { return std::isxdigit(c) != 0; }))
      return bad("crc32c is not 8 hex digits");
    ManifestFile mf;
    mf.name = name->get<std::string>();
    mf.bytes = bytes->get<int64_t>();
    mf.crc = static_cast<uint32_t>(std::stoul(*hex, nullptr, 16));
    for (const ManifestFile& seen : out)
      if (seen.name == mf.name) return bad("the file is listed twice");
    out.push_back(std::move(mf));
  }
  return out;
}

namespace {
std::string ValueText(const Json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }
}  // namespace

std::string ConfigDifference(const Json& then, const Json& now, bool ignore_state_format) {
  std::vector<std::pair<std::string, Json>> a, b;
  Flatten(then, "", &a);
  Flatten(now, "", &b);
  std::vector<std::string> keys;
  std::string first;
  auto differs = [&](const std::string& key, const std::string& what) {
    if (CheckpointKeyMayDiffer(key)) return;
    if (ignore_state_format &&
        (key == "strata.optimizer_states" || key == "bf16.bf16_master_weights_and_grads" ||
         key == "bf16.bf16_optimizer_states"))
      return;
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
  // (Shapes: compared when the checkpoint records them.)
  const Json* shapes_then = then.contains("shapes") ? &then.at("shapes") : nullptr;
  const Json* shapes_now = now.contains("shapes") ? &now.at("shapes") : nullptr;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const std::string name = b[i][0].get<std::string>();
    if (a[i][0] != b[i][0])
      return fmt::format("parameter {}: named {} in the checkpoint, {} now", i,
                         a[i][0].get<std::string>(), name);
    if (a[i][1] != b[i][1])
      return fmt::format("parameter {}: numel {} in the checkpoint, {} now", name, a[i][1].dump(),
                         b[i][1].dump());
    if (shapes_then != nullptr && shapes_now != nullptr && i < shapes_then->size() &&
        i < shapes_now->size() && (*shapes_then)[i] != (*shapes_now)[i])
      return fmt::format("parameter {}: shape {} in the checkpoint, {} now", name,
                         (*shapes_then)[i].dump(), (*shapes_now)[i].dump());
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

// ---- Data files ----------------------------------------------------------------

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
    if (!bytes.has_value())
      return DataLossError(fmt::format("{}: lists no {}", manifest_path, f.name));
    // (Elements a file of its size cannot hold are compared without
    // computing their bytes, which could overflow.)
    const int64_t elems = f.elem_end - f.elem_begin;
    const int64_t want =
        elems <= *bytes / kOptimizerStateBytesPerElem ? kOptimizerStateBytesPerElem * elems : -1;
    if (*bytes != want)
      return DataLossError(fmt::format("{}: {} of {} bytes; its elements [{}, {}) take {} bytes",
                                       manifest_path, f.name, *bytes, f.elem_begin, f.elem_end,
                                       want >= 0 ? std::to_string(want) : "more than that"));
    next = f.elem_end;
  }
  if (next < elements)
    return DataLossError(fmt::format("{}: the states files cover {} elements, the layout has {}",
                                     manifest_path, next, elements));
  return out;
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

}  // namespace checkpoint_internal

// ---- What may differ on load ---------------------------------------------------

std::span<const CheckpointFreeKey> CheckpointFreeKeys() { return ResumeFreeKeys(); }

bool CheckpointKeyMayDiffer(std::string_view key) {
  for (const CheckpointFreeKey& f : CheckpointFreeKeys()) {
    const std::string_view k = f.key;
    if (key.substr(0, k.size()) != k) continue;
    if (key.size() == k.size() || key[k.size()] == '.' || key[k.size()] == '[') return true;
  }
  return false;
}

std::string CheckpointConfigDifference(const std::string& then_json, const std::string& now_json) {
  using checkpoint_internal::Json;
  return checkpoint_internal::ConfigDifference(Json::parse(then_json), Json::parse(now_json));
}

}  // namespace strata::scheduler
