#include "src/scheduler/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <unordered_set>

#include "src/common/status_util.h"

namespace strata::scheduler {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

// How many names CreateTemp tries (<path>.tmp, then <path>.tmp.<random hex>).
constexpr int kTempTries = 16;

// What is at `path` must be nothing or a regular file (lstat: a symlink is
// refused as itself, never followed).
Status CheckReplaceable(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return Status();
    return ErrnoError(fmt::format("safetensors file {}: lstat", path), errno);
  }
  if (S_ISREG(st.st_mode)) return Status();
  const char* what = S_ISLNK(st.st_mode)   ? "a symbolic link"
                     : S_ISDIR(st.st_mode) ? "a directory"
                                           : "not a regular file";
  return FailedPreconditionError(
      fmt::format("safetensors file {}: {} is there; only a regular file is replaced", path, what));
}

// A new file of mode 0600 that was not there before: O_EXCL fails on any
// existing name, a symlink included, and O_NOFOLLOW on a symlink as the last
// component. Returns the fd and the name taken.
StatusOr<std::pair<int, std::string>> CreateTemp(const std::string& path) {
  std::random_device rd;
  std::string tmp = path + ".tmp";
  for (int i = 0;; ++i) {
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                          S_IRUSR | S_IWUSR);
    if (fd >= 0) return std::make_pair(fd, tmp);
    if (errno != EEXIST || i + 1 == kTempTries)
      return ErrnoError(fmt::format("create {}", tmp), errno);
    tmp = fmt::format("{}.tmp.{:08x}", path, rd());
  }
}

// fsync of the directory that holds `path` (so that a rename there lasts).
Status SyncParentDir(const std::string& path) {
  std::error_code ec;
  fs::path parent = fs::absolute(path, ec).parent_path();
  const std::string dir = parent.empty() ? "." : parent.string();
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(fmt::format("open {}", dir), errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoError(fmt::format("fsync {}", dir), err);
  return Status();
}

}  // namespace

StatusOr<int64_t> SafetensorsDTypeSize(const std::string& dtype) {
  static constexpr std::pair<const char*, int64_t> kSizes[] = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8}};
  for (const auto& [name, size] : kSizes)
    if (dtype == name) return size;
  std::string known;
  for (const auto& [name, size] : kSizes)
    known += fmt::format("{}{}", known.empty() ? "" : ", ", name);
  return InvalidArgumentError(fmt::format("safetensors dtype \"{}\": not one of {}", dtype, known));
}

StatusOr<SafetensorsWriter> SafetensorsWriter::Create(
    const std::string& path, const std::vector<std::pair<std::string, std::string>>& metadata,
    std::span<const SafetensorsTensor> tensors) {
  Json header = Json::object();
  Json meta = Json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  header["__metadata__"] = std::move(meta);
  std::unordered_set<std::string> names;
  int64_t data = 0;
  for (const SafetensorsTensor& t : tensors) {
    if (t.name == "__metadata__" || !names.insert(t.name).second)
      return InvalidArgumentError(
          fmt::format("safetensors file {}: tensor name \"{}\" {}", path, t.name,
                      t.name == "__metadata__" ? "is reserved" : "appears twice"));
    StatusOr<int64_t> es = SafetensorsDTypeSize(t.dtype);
    if (!es.ok())
      return InvalidArgumentError(
          fmt::format("safetensors file {}: tensor {}: {}", path, t.name, es.status().message()));
    int64_t bytes = *es;
    for (int64_t d : t.shape)
      if (d < 0 || __builtin_mul_overflow(bytes, d, &bytes))
        return InvalidArgumentError(
            fmt::format("safetensors file {}: tensor {}: dimension {} {}", path, t.name, d,
                        d < 0 ? "is negative" : "makes the tensor's size overflow 64 bits"));
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", Json::array({data, data + bytes})}};
    data += bytes;
  }
  std::string h;
  try {
    h = header.dump();
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgumentError(
        fmt::format("safetensors file {}: a tensor name or metadata string is not valid UTF-8 ({})",
                    path, e.what()));
  }
  h.append((8 - h.size() % 8) % 8, ' ');

  RETURN_IF_ERROR(CheckReplaceable(path));
  ASSIGN_OR_RETURN(auto created, CreateTemp(path));
  SafetensorsWriter w(path, std::move(created.second), created.first,
                      static_cast<int64_t>(8 + h.size()), data);
  uint8_t len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<uint8_t>(static_cast<uint64_t>(h.size()) >> (8 * i));
  RETURN_IF_ERROR(w.WriteAt(len, sizeof(len), 0));
  RETURN_IF_ERROR(w.WriteAt(h.data(), h.size(), sizeof(len)));
  return w;
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::string tmp, int fd, int64_t header_end,
                                     int64_t data_bytes)
    : path_(std::move(path)),
      tmp_(std::move(tmp)),
      fd_(fd),
      header_end_(header_end),
      data_bytes_(data_bytes) {}

SafetensorsWriter::SafetensorsWriter(SafetensorsWriter&& o) noexcept
    : path_(std::move(o.path_)),
      tmp_(std::exchange(o.tmp_, std::string())),
      fd_(std::exchange(o.fd_, -1)),
      header_end_(o.header_end_),
      data_bytes_(o.data_bytes_),
      written_(o.written_) {}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

Status SafetensorsWriter::Append(const void* data, size_t n) {
  if (fd_ < 0)
    return FailedPreconditionError(fmt::format("safetensors file {}: written already", path_));
  if (static_cast<int64_t>(n) > data_bytes_ - written_)
    return InvalidArgumentError(
        fmt::format("safetensors file {}: {} more bytes appended than the tensors hold ({})", path_,
                    static_cast<int64_t>(n) - (data_bytes_ - written_), data_bytes_));
  RETURN_IF_ERROR(WriteAt(data, n, header_end_ + written_));
  written_ += static_cast<int64_t>(n);
  return Status();
}

Status SafetensorsWriter::WriteAt(const void* data, size_t n, int64_t off) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd_, p, std::min(n, size_t{1} << 30), off);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(fmt::format("write {} at offset {}", tmp_, off), errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
    off += w;
  }
  return Status();
}

Status SafetensorsWriter::Commit() {
  if (fd_ < 0)
    return FailedPreconditionError(fmt::format("safetensors file {}: written already", path_));
  const int fd = std::exchange(fd_, -1);
  if (written_ != data_bytes_) {
    ::close(fd);
    return FailedPreconditionError(fmt::format(
        "safetensors file {}: {} of the tensors' {} bytes appended", path_, written_, data_bytes_));
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoError(fmt::format("fsync {}", tmp_), err);
  }
  if (::close(fd) != 0) return ErrnoError(fmt::format("close {}", tmp_), errno);
  RETURN_IF_ERROR(CheckReplaceable(path_));
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    return ErrnoError(fmt::format("rename {} to {}", tmp_, path_), errno);
  tmp_.clear();
  return SyncParentDir(path_);
}

StatusOr<int64_t> WriteSafetensors(const std::string& path,
                                   const std::vector<std::pair<std::string, std::string>>& metadata,
                                   std::span<const SafetensorsTensorData> tensors) {
  std::vector<SafetensorsTensor> described;
  described.reserve(tensors.size());
  for (const SafetensorsTensorData& t : tensors) described.push_back(t.tensor);
  ASSIGN_OR_RETURN(SafetensorsWriter w, SafetensorsWriter::Create(path, metadata, described));
  for (const SafetensorsTensorData& t : tensors) {
    int64_t want = *SafetensorsDTypeSize(t.tensor.dtype);
    for (int64_t d : t.tensor.shape) want *= d;
    if (static_cast<int64_t>(t.bytes.size()) != want)
      return InvalidArgumentError(fmt::format(
          "safetensors file {}: tensor {}: {} bytes given, its dtype {} and shape make {}", path,
          t.tensor.name, t.bytes.size(), t.tensor.dtype, want));
    if (!t.bytes.empty()) RETURN_IF_ERROR(w.Append(t.bytes.data(), t.bytes.size()));
  }
  RETURN_IF_ERROR(w.Commit());
  return w.file_bytes();
}

}  // namespace strata::scheduler
