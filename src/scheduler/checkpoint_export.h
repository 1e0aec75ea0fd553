// src/scheduler/checkpoint_export.h — reading a checkpoint without an engine
// (`strata checkpoint info|export`, strata.export): what it holds, whether
// its files verify, and its parameters written as one safetensors file.
//
// What this module promises:
//   - It takes no lock and never changes a checkpoint: a root may be read
//     while a run saves into it (an interrupted save is skipped).
//   - InspectCheckpoint reports a file that fails its size or CRC-32C check
//     in the result (validity), and ExportCheckpoint refuses such a
//     checkpoint: nothing unverified is exported.
//   - ExportCheckpoint writes <out>.tmp, fsyncs and renames it: `out` is
//     either the whole export or untouched.
// The format is checkpoint_format.h's; which checkpoint of a root is the
// newest, checkpoint_dir.h's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "src/scheduler/checkpoint_format.h"
#include "src/scheduler/layout.h"
#include "strata/checkpoint.h"
#include "strata/status.h"

namespace strata::scheduler {

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

// ExportCheckpoint (strata/checkpoint.h, the public API) writes a
// checkpoint's parameters as a safetensors file with SafetensorsWriter
// (src/scheduler/safetensors.h).
using ::strata::CheckpointExportResult;
using ::strata::ExportCheckpoint;
using ::strata::ExportPrecision;

}  // namespace strata::scheduler
