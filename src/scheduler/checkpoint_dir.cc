#include "src/scheduler/checkpoint_dir.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>

#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/thread_annotations.h"
#include "src/scheduler/checkpoint_format.h"

namespace strata::scheduler {

namespace fs = std::filesystem;
using checkpoint_internal::File;
using checkpoint_internal::Json;
using checkpoint_internal::SyncDir;

// ---- The checkpoint directories under a root ---------------------------------

namespace {

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

std::string RunName(const std::string& run_id) {
  return run_id.empty() ? "(no run id recorded)" : run_id;
}

}  // namespace

// ckpt-<digits> directories, by sequence number; with `summaries`, the run
// id and step of each complete one.
std::vector<CheckpointEntry> ListCheckpoints(const std::string& root, bool summaries) {
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

// Removes the run's checkpoints but the newest kCheckpointsKept, and
// interrupted saves (no manifest: with the root locked, no save is in
// progress). Complete checkpoints of other runs are never touched. The
// manifest goes first, so that a crash half-way leaves a directory that is
// not a checkpoint. Failures are logged: the new checkpoint is valid
// whatever happens here.
void RemoveOldCheckpoints(const std::string& root, int64_t newest, const std::string& run_id,
                          const std::function<void(std::string_view)>& at_point) {
  std::vector<CheckpointEntry> entries = ListCheckpoints(root);
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

// ---- Run ids and the lock on a root -------------------------------------------

std::string NewCheckpointRunId() {
  std::random_device rd;
  const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return fmt::format("{:016x}", v);
}

namespace {

// The locks this process holds, by the root's device and inode. One for the
// process, never destroyed (a lock may be dropped during exit).
struct HeldLocks {
  Mutex mu;
  std::map<std::pair<uint64_t, uint64_t>, std::weak_ptr<CheckpointDirLock>> by_root GUARDED_BY(mu);
};
HeldLocks& Held() {
  static auto* held = new HeldLocks;
  return *held;
}

void WriteLockText(int fd, const std::string& run_id) {
  const std::string text =
      fmt::format("pid {} run {}\n", ::getpid(), run_id.empty() ? "-" : run_id);
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) < 0)
    STRATA_LOG_WARN("checkpoint lock: cannot describe the holder: {}", std::strerror(errno));
}

// Closes a lock's fd (which drops the flock) and forgets its root when no
// holder is left, under the mutex like every use of the map. The destructor
// calls it: Clang's analysis does not check destructors.
void DropLock(int fd, std::pair<uint64_t, uint64_t> key) {
  HeldLocks& held = Held();
  MutexLock lock(&held.mu);
  ::close(fd);
  auto it = held.by_root.find(key);
  if (it != held.by_root.end() && it->second.expired()) held.by_root.erase(it);
}

}  // namespace

CheckpointDirLock::~CheckpointDirLock() { DropLock(fd_, {dev_, ino_}); }

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
  HeldLocks& locks = Held();
  MutexLock lock(&locks.mu);
  if (auto it = locks.by_root.find(key); it != locks.by_root.end())
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
  locks.by_root[key] = held;
  return held;
}

// ---- What a root holds ---------------------------------------------------------

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
  for (const CheckpointEntry& e : ListCheckpoints(root, /*summaries=*/false)) {
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
  std::vector<CheckpointEntry> entries = ListCheckpoints(root, /*summaries=*/false);
  for (auto it = entries.rbegin(); it != entries.rend(); ++it)
    if (it->complete) return it->path;
  return "";
}

}  // namespace strata::scheduler
