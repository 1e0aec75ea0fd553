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
#include <set>

#include "src/common/log.h"
#include "src/common/private_fs.h"
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
  StatusOr<Json> parsed = checkpoint_internal::ParseManifestText(text, manifest);
  if (!parsed.ok()) return;
  const Json& m = *parsed;
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
    // A symlink is never a checkpoint: it is not followed, read or removed.
    if (name.size() > 5 + 18 || d.symlink_status(ec).type() != fs::file_type::directory) continue;
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

namespace {

// Whether `name` is one Strata writes into a checkpoint directory.
bool IsOwnFileName(const std::string& name) {
  return name == kCheckpointManifest || name == std::string(kCheckpointManifest) + ".tmp" ||
         checkpoint_internal::IsCheckpointDataFileName(name);
}

// The data file names a manifest lists (names without a '/' only).
std::set<std::string> ListedFiles(const std::string& manifest) {
  std::set<std::string> out;
  StatusOr<File> f = File::Open(manifest, O_RDONLY);
  if (!f.ok()) return out;
  StatusOr<int64_t> size = f->Size();
  if (!size.ok() || *size > checkpoint_internal::kMaxManifestBytes) return out;
  std::string text(static_cast<size_t>(*size), '\0');
  if (!f->ReadNext(text.data(), text.size()).ok()) return out;
  StatusOr<Json> parsed = checkpoint_internal::ParseManifestText(text, manifest);
  if (!parsed.ok()) return out;
  const Json& m = *parsed;
  if (!m.contains("files") || !m["files"].is_array()) return out;
  for (const Json& e : m["files"])
    if (e.is_object() && e.contains("name") && e["name"].is_string()) {
      const std::string name = e["name"].get<std::string>();
      if (!name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos)
        out.insert(name);
    }
  return out;
}

}  // namespace

Status RemoveCheckpointDir(const std::string& path, const std::function<void()>& manifest_gone) {
  RETURN_IF_ERROR(CheckPrivateDir(path, "checkpoint directory"));
  const std::string manifest = path + "/" + kCheckpointManifest;
  const std::set<std::string> listed = ListedFiles(manifest);
  if (::unlink(manifest.c_str()) != 0 && errno != ENOENT)
    return ErrnoError(fmt::format("removing checkpoint {}: unlink {}", path, manifest), errno);
  if (manifest_gone) manifest_gone();
  std::vector<std::string> left;
  std::error_code ec;
  for (const fs::directory_entry& d : fs::directory_iterator(path, ec)) {
    const std::string name = d.path().filename().string();
    if ((IsOwnFileName(name) || listed.count(name) != 0) &&
        d.symlink_status(ec).type() == fs::file_type::regular) {
      if (::unlink(d.path().c_str()) == 0 || errno == ENOENT) continue;
      STRATA_LOG_WARN("checkpoint: removing {}: {}", d.path().string(),
                      ErrnoError("unlink", errno).ToString());
    }
    left.push_back(name);
  }
  if (ec) return IOError(fmt::format("removing checkpoint {}: listing it: {}", path, ec.message()));
  if (!left.empty()) {
    std::sort(left.begin(), left.end());
    std::string names;
    for (const std::string& n : left) names += (names.empty() ? "" : ", ") + n;
    STRATA_LOG_WARN(
        "checkpoint: removed the files Strata wrote in {}; left {} (not written by Strata), and "
        "so the directory",
        path, names);
    return Status();
  }
  if (::rmdir(path.c_str()) != 0 && errno != ENOENT)
    return ErrnoError(fmt::format("removing checkpoint {}: rmdir", path), errno);
  return Status();
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
    const Status s = RemoveCheckpointDir(it->path, [&] {
      if (!removed && at_point) at_point("cleanup");
      removed = true;
    });
    if (!s.ok()) STRATA_LOG_WARN("checkpoint: removing old {}: {}", it->path, s.ToString());
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

void CheckpointDirLock::SetRunId(const std::string& run_id) {
  run_id_ = run_id;
  WriteLockText(fd_, run_id);
}

// The lock file at the root's path must still be the file this process
// locked (fstat of the held descriptor against lstat of the path). Removed
// and not re-created: it is created anew (O_EXCL) and locked again. Replaced
// (another process may hold the new one): Unavailable.
Status CheckpointDirLock::Recheck() {
  const std::string path = root_ + "/" + kCheckpointLockFile;
  struct stat held, now;
  if (::fstat(fd_, &held) != 0)
    return ErrnoError(fmt::format("checkpoint lock file {}: fstat", path), errno);
  if (::lstat(path.c_str(), &now) == 0) {
    if (now.st_dev == held.st_dev && now.st_ino == held.st_ino) return Status();
    return UnavailableError(fmt::format(
        "checkpoint lock file {} was replaced while this run held it: another run may be using "
        "{} now; nothing more is saved there by this run",
        path, root_));
  }
  if (errno != ENOENT)
    return ErrnoError(fmt::format("checkpoint lock file {}: lstat", path), errno);
  StatusOr<int> fd = CreateNewFile(path, O_RDWR, "checkpoint lock file");
  if (!fd.ok())
    return UnavailableError(fmt::format(
        "checkpoint lock file {} was removed while this run held it and cannot be re-created "
        "({}): another run may be using {} now; nothing more is saved there by this run",
        path, fd.status().message(), root_));
  if (::flock(*fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(*fd);
    return UnavailableError(fmt::format(
        "checkpoint lock file {} was removed while this run held it, and another process locked "
        "the new one first: nothing more is saved in {} by this run",
        path, root_));
  }
  ::close(std::exchange(fd_, *fd));
  WriteLockText(fd_, run_id_);
  STRATA_LOG_WARN(
      "checkpoint lock file {} was removed while this run held it; created it again and locked it",
      path);
  return Status();
}

StatusOr<std::shared_ptr<CheckpointDirLock>> LockCheckpointDir(const std::string& root,
                                                               const std::string& run_id) {
  RETURN_IF_ERROR(MakeDirs(root, "checkpoint directory"));
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
      RETURN_IF_ERROR(held->Recheck());
      if (!run_id.empty()) held->SetRunId(run_id);
      return held;
    }
  const std::string path = root + "/" + kCheckpointLockFile;
  ASSIGN_OR_RETURN(const int fd, OpenRegularFile(path, O_RDWR | O_CREAT, "checkpoint lock file"));
  if (struct stat lst{}; ::fstat(fd, &lst) != 0 || lst.st_nlink != 1) {
    ::close(fd);
    return FailedPreconditionError(fmt::format(
        "checkpoint lock file {}: has {} links (a hard link to another file?); refusing to use it",
        path, lst.st_nlink));
  }
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
  std::shared_ptr<CheckpointDirLock> held(new CheckpointDirLock(
      fd, root, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)));
  held->SetRunId(run_id);
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
    RETURN_IF_ERROR(RemoveCheckpointDir(e.path));
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
