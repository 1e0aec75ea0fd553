// src/scheduler/checkpoint.h — crash-consistent checkpoints of the engine's
// states (Engine::SaveCheckpoint / LoadCheckpoint): WriteCheckpoint and
// ReadCheckpoint, and the entry to the checkpoint files for the rest of
// Strata. One job per file:
//
//   checkpoint_format.h  what one ckpt-<N> directory holds (params.bin, the
//                        states files, MANIFEST.json), the identity a resume
//                        compares and the keys it leaves out, checked reading
//                        and restoring of the files
//   checkpoint_dir.h     a root of checkpoints: its lock, its ckpt-<N>
//                        directories, the newest one, run ids, pruning
//   checkpoint_export.h  reading a checkpoint without an engine: inspection
//                        and the safetensors export
//   checkpoint.h (this)  the save and the load, over one rank or several
//
// What this module promises: a crash at any point of a save leaves the
// previous checkpoint loadable; a load restores nothing until every file it
// reads has verified, so a refused checkpoint leaves the engine as it was.
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
// a filesystem every rank sees. A checkpoint saved by N ranks loads at M
// ranks, each rank reading the files that overlap its own partition.
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

#include "src/scheduler/checkpoint_dir.h"
#include "src/scheduler/checkpoint_export.h"
#include "src/scheduler/checkpoint_format.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/loss_scaler.h"
#include "src/scheduler/partition.h"
#include "src/scheduler/state_store.h"
#include "strata/config.h"
#include "strata/engine.h"

namespace strata::scheduler {

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
// number of ranks. `convert_states`: CheckpointInfo::convert_optimizer_states
// (the state format's keys may differ; the states are encoded in this one).
StatusOr<CheckpointMeta> ReadCheckpoint(const std::string& root, const Config& config,
                                        const Layout& layout, StateStore* store,
                                        std::span<const ParamGroupSpec> groups = {},
                                        const CheckpointRanks* ranks = nullptr,
                                        bool convert_states = false);

}  // namespace strata::scheduler
