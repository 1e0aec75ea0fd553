// src/scheduler/checkpoint_dir.h — a checkpoint root: the directory the
// caller names, holding ckpt-<N> directories (checkpoint_format.h) and the
// lock file. Its lock, what it holds, the newest checkpoint, whose each one
// is (run ids), and their removal.
//
// What this module promises:
//   - One process at a time holds a root: LockCheckpointDir (flock(2) on
//     <root>/LOCK, dropped by the kernel when the process dies); within the
//     process the lock is shared.
//   - Only a ckpt-<N> directory holding a manifest is a checkpoint; one
//     without is a dead save once the root is locked, and safe to remove.
//   - Pruning (RemoveOldCheckpoints) never removes another run's
//     checkpoints, and removes a checkpoint's manifest before its files, so
//     that a crash half-way leaves a directory that is no checkpoint rather
//     than a broken one.
// It never reads a data file, nor checks a manifest's content beyond its run
// id and step.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "strata/status.h"

namespace strata::scheduler {

// The lock file of a root (see CheckpointDirLock); it stays after the run.
inline constexpr char kCheckpointLockFile[] = "LOCK";
// Checkpoints kept after a successful save (the new one included).
inline constexpr int kCheckpointsKept = 2;

// A new run id: 16 random hex digits.
std::string NewCheckpointRunId();

// The exclusive lock of one process on a checkpoint root: flock(2) on
// <root>/LOCK, which holds "pid <pid> run <run id>". Another process's
// LockCheckpointDir on the same root is refused (Unavailable, naming the
// holder's pid and run id) until every holder in this process has dropped
// it; the kernel drops it when the process dies (kill -9 included).
// Within one process the lock is shared: LockCheckpointDir returns the lock
// already held. Thread-safe.
class CheckpointDirLock {
 public:
  ~CheckpointDirLock();
  CheckpointDirLock(const CheckpointDirLock&) = delete;
  CheckpointDirLock& operator=(const CheckpointDirLock&) = delete;
  const std::string& root() const { return root_; }
  // Rewrites the lock file with this process's pid and `run_id`.
  void SetRunId(const std::string& run_id);

 private:
  // Whether <root>/LOCK is still the file this lock holds (LockCheckpointDir
  // calls it, under its mutex, when it returns a lock already held).
  Status Recheck();
  friend StatusOr<std::shared_ptr<CheckpointDirLock>> LockCheckpointDir(const std::string&,
                                                                        const std::string&);
  CheckpointDirLock(int fd, std::string root, uint64_t dev, uint64_t ino)
      : fd_(fd), root_(std::move(root)), dev_(dev), ino_(ino) {}
  int fd_;
  std::string root_;
  uint64_t dev_, ino_;
  std::string run_id_;  // what the lock file says
};

// Locks `root` (created if missing, each directory created with mode 0700)
// for this process; `run_id` (may be "") is written into the lock file, mode
// 0600. A symlink, FIFO or anything but a regular file with one link at
// <root>/LOCK is refused, naming it, and never followed. Unavailable when
// another process holds it: "checkpoint directory R is in use by pid P (run
// X): ...".
//
// When this process holds the lock already, the lock file is checked again
// (fstat of the held descriptor against lstat of the path: the same device
// and inode): a lock file removed meanwhile is created anew (O_EXCL) and
// locked again, with a warning; one replaced by another file, or re-created
// and locked by another process first, is Unavailable: the save (or load)
// that asked fails, naming the file, and this process saves nothing more
// there.
StatusOr<std::shared_ptr<CheckpointDirLock>> LockCheckpointDir(const std::string& root,
                                                               const std::string& run_id);

// One ckpt-<N> directory under a root.
struct CheckpointEntry {
  int64_t sequence = 0;
  std::string path;
  bool complete = false;  // has a manifest
  // From the manifest (when it parses): the run id ("" for one written
  // before run ids were recorded) and the optimizer step.
  std::string run_id;
  int64_t optimizer_step = 0;
};
// The ckpt-<N> directories under root, by sequence number (a symlink named
// ckpt-<N> is not one, and is left alone). Without
// `summaries` no manifest is read (run_id and optimizer_step stay unset).
std::vector<CheckpointEntry> ListCheckpoints(const std::string& root, bool summaries = true);
// The complete checkpoints in `entries` not of `run_id`, as a phrase: "2
// checkpoints of run 1a2b up to step 6" (runs joined by "and"); "" if none.
std::string OtherRunsCheckpoints(const std::vector<CheckpointEntry>& entries,
                                 const std::string& run_id);
// Removes checkpoint directory `path` (CheckPrivateDir first: a directory
// not of this user, or writable by others, is refused): its manifest first
// (then `manifest_gone()`), then the files Strata writes there (those the
// manifest lists, MANIFEST.json.tmp, params.bin, states.bin,
// states-rank-<k>.bin; regular files only), then the directory when it is
// empty. Anything else stays, and so does the directory, with a warning
// naming what was left.
Status RemoveCheckpointDir(const std::string& path,
                           const std::function<void()>& manifest_gone = {});
// Removes every ckpt-<N> directory under root (manifest first), whatever its
// run. REQUIRES: the caller holds the root's lock. Returns how many.
StatusOr<int> RemoveAllCheckpoints(const std::string& root);
// Removes the checkpoints of `run_id` but the newest kCheckpointsKept among
// those up to sequence `newest`, and the directories without a manifest up
// to it (interrupted saves); nothing newer than `newest`, nothing of another
// run. Manifest first; `at_point("cleanup")` is called once the first
// manifest is gone. Failures are logged, not returned: the checkpoints kept
// are valid whatever happens here. REQUIRES: the caller holds the root's
// lock.
void RemoveOldCheckpoints(const std::string& root, int64_t newest, const std::string& run_id,
                          const std::function<void(std::string_view)>& at_point = {});

// The newest checkpoint directory under root ("" when there is none), or
// root itself when it holds a manifest.
std::string LatestCheckpoint(const std::string& root);

}  // namespace strata::scheduler
