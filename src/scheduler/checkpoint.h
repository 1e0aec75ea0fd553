// src/scheduler/checkpoint.h — crash-consistent checkpoints of the engine's
// states (Engine::SaveCheckpoint / LoadCheckpoint).
//
// On disk, under the directory the caller names (the root):
//
//   <root>/ckpt-00000007/params.bin     every module's parameter bytes, in
//                                       module order (module(m).bytes() each)
//   <root>/ckpt-00000007/states.bin     the fp32 states of the element space,
//                                       sub-group by sub-group: master |
//                                       exp_avg | exp_avg_sq (12 x elems
//                                       bytes each)
//   <root>/ckpt-00000007/MANIFEST.json  what makes the directory a checkpoint
//
// Saved by several data-parallel ranks, the states are one file per rank
// instead of states.bin: states-rank-<k>.bin, rank k's partition of the
// element space (Layout::OwnedElems) cut into its sub-groups. The manifest's
// "states" list names each states file with the elements it covers and the
// size of its sub-groups (the last of a file may be shorter), so a reader
// finds any element's states whatever the number of ranks that wrote them:
// a checkpoint saved by N ranks loads at M ranks, each rank reading the
// files that overlap its own partition.
//
// The manifest holds the format version, the sequence number, the optimizer
// step, the loss scaler's state, the caller's data position and note, the
// run id (CheckpointMeta::run_id), the whole effective config (ConfigToJson;
// compared key by key on load but CheckpointFreeKeys()), the layout's
// (parameter names, numels, dtypes, modules, the one-rank element and
// sub-group counts, and its hash), the states files, per data file its size
// and CRC-32C, and last manifest_crc32c: the CRC-32C of the manifest's own
// content (its compact JSON without that key), so that an edited manifest is
// refused.
//
// Writing (WriteCheckpoint): a new directory ckpt-<N> (N = 1 + the highest
// present); the data files are written, fsync'd, and the directory fsync'd;
// then MANIFEST.json.tmp is written and fsync'd, renamed to MANIFEST.json,
// and the checkpoint directory and the root are fsync'd. Only a directory
// with a MANIFEST.json is a checkpoint, so a crash at any point leaves the
// previous one as the newest. Then the run's checkpoints older than its last
// two, and directories left by interrupted saves, are removed (manifest
// first); another run's checkpoints are never removed. With several ranks
// (CheckpointRanks), rank 0 locks the root, makes the directory and writes
// params.bin (the parameters are replicated); every rank writes and fsyncs
// its states file; rank 0 writes the manifest after every rank reported its
// file durable, and every rank returns the same status. The root must be on
// a filesystem every rank sees.
//
// The format does not depend on the placement: states and parameters are
// copied out of wherever they live (HBM, DRAM, or the active NVMe versions,
// read through the swap store) and restored into wherever the loading
// engine keeps them, so a checkpoint saved with states on NVMe loads into an
// engine with states in DRAM and the reverse.
//
// Reading (ReadCheckpoint): the newest checkpoint under the root (or the root
// itself when it holds a MANIFEST.json). The manifest is checked against the
// engine's config and layout (the first difference is named), then every file's
// size and CRC-32C are verified, and only then are the states restored (the
// files are read a second time, checksummed again). A refusal leaves the
// engine's states untouched. Loaded from a root, it then removes what an
// interrupted save left there (a directory without a manifest, a third
// checkpoint), as that save would have. With several ranks, rank 0 picks the
// checkpoint (and holds the lock); each rank verifies params.bin and the
// states files it reads, and restores only after every rank verified.
//
// The points of a save (CheckpointMeta::at_point, for crash tests): "data"
// after the data files are durable, "manifest_tmp" after the temporary
// manifest is, "rename" after the rename, "cleanup" after the first old
// checkpoint lost its manifest.
//
// Threading: the engine's thread; no optimizer step in flight.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "src/scheduler/layout.h"
#include "src/scheduler/loss_scaler.h"
#include "src/scheduler/partition.h"
#include "src/scheduler/state_store.h"
#include "strata/config.h"
#include "strata/engine.h"

namespace strata::scheduler {

inline constexpr char kCheckpointManifest[] = "MANIFEST.json";
// The lock file of a root (see CheckpointDirLock); it stays after the run.
inline constexpr char kCheckpointLockFile[] = "LOCK";
// Version 4: the manifest lists the states files and the elements each
// covers (one per rank that saved). Version 3 had one states.bin over the
// one-rank element space, which is how version 4 reads it. Version 3 starts
// each tensor's states on a multiple of kElemAlign elements (layout.h);
// version 2 laid them out densely, and loads when no tensor needed padding
// (the two layouts are then the same) and is refused, naming the version and
// the tensor, otherwise.
inline constexpr int kCheckpointFormatVersion = 4;
inline constexpr int kSingleStatesFileVersion = 3;
inline constexpr int kDenseLayoutCheckpointVersion = 2;
// Checkpoints kept after a successful save (the new one included).
inline constexpr int kCheckpointsKept = 2;

class CheckpointDirLock;

// What the engine keeps besides the StateStore, and the caller's position.
struct CheckpointMeta {
  int64_t optimizer_step = 0;
  LossScaler::State scaler;
  int64_t data_position = 0;
  std::string note;
  std::string path;   // the checkpoint's directory (set by Write/Read)
  int64_t bytes = 0;  // data bytes written or read
  // The run (lineage) the checkpoint belongs to: written into the manifest;
  // set from it by Read. Write requires it non-empty.
  std::string run_id;
  // The optimizer parameter groups (index: group id; group 0 the config's),
  // part of the checkpoint's identity: written by Write; Read compares them
  // with these (empty: one group without overrides).
  std::vector<ParamGroupSpec> param_groups;
  // Set by Write, and by Read from a root: the lock on the root, taken for
  // the call. Keep it to hold the root beyond the call.
  std::shared_ptr<CheckpointDirLock> lock;
  // Writing: called at each point of the save named in the file comment.
  std::function<void(std::string_view point)> at_point;
};

// The data-parallel ranks saving or loading a checkpoint together. Every
// rank calls WriteCheckpoint / ReadCheckpoint with the same root; who this
// rank is and what it owns is the store's Partition; the ranks exchange
// their outcomes through `exchange`, and with partitioned parameters rank 0
// writes each module gathered from every rank's part through `gatherer`.
struct CheckpointRanks {
  RankExchange* exchange = nullptr;
  ParamGatherer* gatherer = nullptr;  // null unless the parameters are partitioned
};

// One states file: the fp32 states of elements [elem_begin, elem_end) as
// sub-groups of sub_group_elems elements cut from elem_begin (the last may
// be shorter), each master | exp_avg | exp_avg_sq.
struct CheckpointStateFile {
  std::string name;
  int64_t elem_begin = 0, elem_end = 0;
  int64_t sub_group_elems = 1;
};

// The config keys (ConfigToJson paths; an entry covers the keys below it)
// that may differ between a checkpoint and the engine loading it, each with
// the reason. Every other key is compared: a difference is refused.
struct CheckpointFreeKey {
  const char* key;
  const char* reason;
};
std::span<const CheckpointFreeKey> CheckpointFreeKeys();
// Whether `key` (e.g. "zero_optimization.offload_param.nvme_path[0]") is
// covered by CheckpointFreeKeys().
bool CheckpointKeyMayDiffer(std::string_view key);
// The differences between the config saved in a checkpoint and `now` (both
// ConfigToJson text), the free keys left out: "strata.model.seed: 1234 in
// the checkpoint, 99 now" for the first, then "(also: key, key)"; "" when
// none.
std::string CheckpointConfigDifference(const std::string& then_json, const std::string& now_json);

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
  friend StatusOr<std::shared_ptr<CheckpointDirLock>> LockCheckpointDir(const std::string&,
                                                                        const std::string&);
  CheckpointDirLock(int fd, std::string root, uint64_t dev, uint64_t ino)
      : fd_(fd), root_(std::move(root)), dev_(dev), ino_(ino) {}
  int fd_;
  std::string root_;
  uint64_t dev_, ino_;
};

// Locks `root` (created if missing) for this process; `run_id` (may be "")
// is written into the lock file. Unavailable when another process holds it:
// "checkpoint directory R is in use by pid P (run X): ...".
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
// The ckpt-<N> directories under root, by sequence number.
std::vector<CheckpointEntry> ListCheckpoints(const std::string& root);
// The complete checkpoints in `entries` not of `run_id`, as a phrase: "2
// checkpoints of run 1a2b up to step 6" (runs joined by "and"); "" if none.
std::string OtherRunsCheckpoints(const std::vector<CheckpointEntry>& entries,
                                 const std::string& run_id);
// Removes every ckpt-<N> directory under root (manifest first), whatever its
// run. REQUIRES: the caller holds the root's lock. Returns how many.
StatusOr<int> RemoveAllCheckpoints(const std::string& root);

// Writes a new checkpoint under `root` (created if missing) and removes old
// ones of the same run (meta->run_id); returns its directory in meta.path.
// It locks the root (Unavailable while another process holds it) and
// refuses (FailedPrecondition) a root holding complete checkpoints of
// another run, naming them: it never removes another run's checkpoints.
// IOError etc. name the file, offset and errno; an error leaves the previous
// checkpoints as they were.
// `ranks`: null for one rank; else how the ranks saving together exchange
// (the store's Partition says which rank this is and what it holds), and
// every rank returns the same status (an error names the rank it happened
// on).
Status WriteCheckpoint(const std::string& root, const Config& config, const Layout& layout,
                       StateStore* store, CheckpointMeta* meta,
                       const CheckpointRanks* ranks = nullptr);

// Verifies and restores the newest checkpoint under `root` into `store`.
// Loading from a root locks it (as Write; a root where the lock file cannot
// be created, e.g. read-only, is read without the lock and left untidied).
// NotFound: no checkpoint there. FailedPrecondition: a different config or
// layout (the message names the first difference). DataLoss: a file missing,
// truncated or failing its checksum (named, with both checksums).
// `groups`: the engine's optimizer parameter groups (CheckpointMeta::param_groups).
// `ranks`: as for WriteCheckpoint; the checkpoint may have been saved by any
// number of ranks.
StatusOr<CheckpointMeta> ReadCheckpoint(const std::string& root, const Config& config,
                                        const Layout& layout, StateStore* store,
                                        std::span<const ParamGroupSpec> groups = {},
                                        const CheckpointRanks* ranks = nullptr);

// The newest checkpoint directory under root ("" when there is none), or
// root itself when it holds a manifest.
std::string LatestCheckpoint(const std::string& root);

// ---- Reading a checkpoint without an engine (`strata checkpoint`) -----------

// One data file as the manifest lists it, and what was found on disk.
struct CheckpointFileCheck {
  std::string name;           // "params.bin"
  int64_t bytes = 0;          // the manifest's
  std::string crc32c;         // the manifest's (8 hex digits)
  int64_t actual_bytes = -1;  // on disk (-1: cannot be opened)
  bool ok = false;            // size and CRC-32C match (false when not verified)
};

// What a checkpoint holds, from its manifest, and whether its files verify.
struct CheckpointInspection {
  std::string path;  // the ckpt-<N> directory
  int version = 0;
  int64_t sequence = 0;
  std::string run_id;
  int64_t optimizer_step = 0;
  int64_t data_position = 0;
  std::string note;
  std::string optimizer_type;  // config optimizer.type
  double lr = 0;               // config optimizer.params.lr
  std::string model_dtype;     // "fp16", "bf16" or "fp32" (the config's fp16/bf16 sections)
  int64_t sub_group_size = 0;
  std::string config_hash, layout_hash;
  std::string config_json;  // the whole effective config saved
  // The parameters with the offsets Layout::Build assigns (modules, sub-groups
  // and offsets rebuilt from the manifest's parameter list and sub_group_size).
  Layout layout;
  std::vector<CheckpointFileCheck> files;
  // The states files, in element order (covering the layout's elements).
  std::vector<CheckpointStateFile> state_files;
  // OK, or DataLoss naming the file and what is wrong (size or CRC-32C).
  Status validity;
  // Newer complete checkpoints under the root that failed verification:
  // "<dir>: <reason>" each (only when a root was given).
  std::vector<std::string> skipped;
};

// Reads and checks `dir`: a ckpt-<N> directory (one holding a manifest), or a
// root, for which the newest checkpoint whose files verify is taken (the
// newest one, with its validity, when none does). With `verify`, every data
// file's size and CRC-32C are checked (validity); without, only sizes. Takes
// no lock and changes nothing. NotFound: no checkpoint. DataLoss: a manifest
// that does not parse or fails its own CRC; NotSupported: another format
// version. A file that fails its check is not an error here: see validity.
StatusOr<CheckpointInspection> InspectCheckpoint(const std::string& dir, bool verify = true);

// What ExportCheckpoint writes per parameter: the fp32 masters (from the
// states files, every rank's) or the working-precision bytes (from params.bin).
enum class ExportPrecision { kFp32, kTrain };

struct CheckpointExportResult {
  std::string checkpoint;  // the ckpt-<N> directory read
  int64_t optimizer_step = 0;
  int64_t tensors = 0;
  int64_t bytes = 0;  // of the file written
};

// Writes the parameters of the checkpoint at `dir` (as InspectCheckpoint
// picks it) to `out` in the safetensors format: an 8-byte little-endian
// header length, a JSON header {"<registered name>": {"dtype": "F32"|"BF16"|
// "F16", "shape": [numel], "data_offsets": [begin, end]}, "__metadata__":
// {...}} padded with spaces to a multiple of 8 bytes, then the tensors' bytes
// in the flat element order. The checkpoint's files are verified first: an
// invalid checkpoint is refused (DataLoss naming the file). The file is
// written by SafetensorsWriter (src/scheduler/safetensors.h: a new file of
// mode 0600 beside `out`, fsync'd and renamed over it; a symlink or anything
// but a regular file at `out` is refused); nothing is left at `out` on error.
StatusOr<CheckpointExportResult> ExportCheckpoint(const std::string& dir, const std::string& out,
                                                  ExportPrecision precision);

}  // namespace strata::scheduler
