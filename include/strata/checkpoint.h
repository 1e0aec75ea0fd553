// strata/checkpoint.h — a checkpoint's parameters as one safetensors file.
//
// Checkpoints are written and read by the Engine (engine.h: SaveCheckpoint,
// LoadCheckpoint); this exports the parameters of one without an Engine, as
// `strata checkpoint export` and the Python frontend's export do.
#pragma once

#include <cstdint>
#include <string>

#include "strata/status.h"

namespace strata {

// What ExportCheckpoint writes per parameter: the fp32 masters (from the
// states files, every rank's) or the working-precision bytes (from params.bin).
enum class ExportPrecision { kFp32, kTrain };

struct CheckpointExportResult {
  std::string checkpoint;  // the ckpt-<N> directory read
  int64_t optimizer_step = 0;
  int64_t tensors = 0;
  int64_t bytes = 0;  // of the file written
};

// Writes the parameters of the checkpoint at `dir` (a ckpt-<N> directory, or
// a root: its newest checkpoint whose files verify) to `out` in the
// safetensors format: an 8-byte little-endian header length, a JSON header
// {"<registered name>": {"dtype": "F32"|"BF16"|"F16", "shape": [numel],
// "data_offsets": [begin, end]}, "__metadata__": {...}} padded with spaces to
// a multiple of 8 bytes, then the tensors' bytes in the flat element order.
// The checkpoint's files are verified first: an invalid checkpoint is refused
// (DataLoss naming the file). The file is new, of mode 0600, beside `out`,
// fsync'd and renamed over it (a symlink or anything but a regular file at
// `out` is refused); nothing is left at `out` on error.
StatusOr<CheckpointExportResult> ExportCheckpoint(const std::string& dir, const std::string& out,
                                                  ExportPrecision precision);

}  // namespace strata
