// src/scheduler/checkpoint.h — crash-consistent checkpoints of the engine's
// states (Engine::SaveCheckpoint / LoadCheckpoint).
//
// On disk, under the directory the caller names (the root):
//
//   <root>/ckpt-00000007/params.bin     every module's parameter bytes, in
//                                       module order (module(m).bytes() each)
//   <root>/ckpt-00000007/states.bin     every sub-group's fp32 states, in
//                                       order: master | exp_avg | exp_avg_sq
//                                       (12 x elems bytes each)
//   <root>/ckpt-00000007/MANIFEST.json  what makes the directory a checkpoint
//
// The manifest holds the format version, the sequence number, the optimizer
// step, the loss scaler's state, the caller's data position and note, the
// config's identity (the fields that change the arithmetic or the layout,
// and their hash), the layout's (parameter names, numels, dtypes, modules,
// sub_group_size, and its hash), and per data file its size and CRC-32C.
//
// Writing (WriteCheckpoint): a new directory ckpt-<N> (N = 1 + the highest
// present); the data files are written, fsync'd, and the directory fsync'd;
// then MANIFEST.json.tmp is written and fsync'd, renamed to MANIFEST.json,
// and the checkpoint directory and the root are fsync'd. Only a directory
// with a MANIFEST.json is a checkpoint, so a crash at any point leaves the
// previous one as the newest. Then checkpoints older than the last two, and
// directories left by interrupted saves, are removed (manifest first).
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
// checkpoint), as that save would have.
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
#include <string>
#include <string_view>

#include "src/scheduler/layout.h"
#include "src/scheduler/loss_scaler.h"
#include "src/scheduler/state_store.h"
#include "strata/config.h"

namespace strata::scheduler {

inline constexpr char kCheckpointManifest[] = "MANIFEST.json";
inline constexpr int kCheckpointFormatVersion = 1;
// Checkpoints kept after a successful save (the new one included).
inline constexpr int kCheckpointsKept = 2;

// What the engine keeps besides the StateStore, and the caller's position.
struct CheckpointMeta {
  int64_t optimizer_step = 0;
  LossScaler::State scaler;
  int64_t data_position = 0;
  std::string note;
  std::string path;   // the checkpoint's directory (set by Write/Read)
  int64_t bytes = 0;  // data bytes written or read
  // Writing: called at each point of the save named in the file comment.
  std::function<void(std::string_view point)> at_point;
};

// Writes a new checkpoint under `root` (created if missing) and removes old
// ones; returns its directory in meta.path. IOError etc. name the file,
// offset and errno; an error leaves the previous checkpoints as they were.
Status WriteCheckpoint(const std::string& root, const Config& config, const Layout& layout,
                       StateStore* store, CheckpointMeta* meta);

// Verifies and restores the newest checkpoint under `root` into `store`.
// NotFound: no checkpoint there. FailedPrecondition: a different config or
// layout (the message names the first difference). DataLoss: a file missing,
// truncated or failing its checksum (named, with both checksums).
StatusOr<CheckpointMeta> ReadCheckpoint(const std::string& root, const Config& config,
                                        const Layout& layout, StateStore* store);

// The newest checkpoint directory under root ("" when there is none), or
// root itself when it holds a manifest.
std::string LatestCheckpoint(const std::string& root);

}  // namespace strata::scheduler
