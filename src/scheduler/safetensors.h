// src/scheduler/safetensors.h — the one safetensors writer: checkpoint export
// (ExportCheckpoint, checkpoint.h) and the Python frontend's
// write_safetensors / save_16bit_model (python/strata/_strata.cc) both write
// through it.
//
// The file: an 8-byte little-endian header length, the header, then every
// tensor's bytes back to back in the order given. The header is compact JSON
// (no spaces; names and strings as UTF-8, not \u-escaped), keys in this
// order: "__metadata__" (the metadata pairs, in the order given), then each
// tensor's name in the order given with {"dtype", "shape", "data_offsets"};
// then spaces up to a multiple of 8 bytes.
//
// How it is written: to a new file in the same directory as `path`, created
// with O_CREAT | O_EXCL | O_NOFOLLOW and mode 0600 (the umask may take more),
// named <path>.tmp, or <path>.tmp.<random hex> when that name is taken (by
// anything: a file, a symlink, which is never followed, or another writer);
// fsync'd, renamed over `path`, and the directory fsync'd. `path` itself may
// be absent or a regular file (replaced); anything else there (a symlink, a
// directory, a device) is refused, FailedPrecondition, and left alone. On
// any error, or a writer destroyed without Commit, the temporary file is
// removed and `path` is as it was.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "strata/status.h"

namespace strata::scheduler {

// One tensor of a safetensors file, as the header describes it.
struct SafetensorsTensor {
  std::string name;            // unique in the file, not "__metadata__"
  std::string dtype;           // the format's name: "F32", "BF16", "F16", "F64", "I64", ...
  std::vector<int64_t> shape;  // [] for a scalar
};

// The size of one element of a safetensors dtype name ("F32": 4, "BOOL": 1);
// InvalidArgument naming the known ones for any other name.
StatusOr<int64_t> SafetensorsDTypeSize(const std::string& dtype);

// Writes one safetensors file whose data arrive in pieces (checkpoint export
// copies them from the checkpoint's files chunk by chunk). Not thread-safe;
// movable, not copyable.
class SafetensorsWriter {
 public:
  // Checks the tensors (names unique and not "__metadata__", known dtypes,
  // no negative dimension: InvalidArgument naming the tensor; a name or
  // metadata string that is not valid UTF-8: InvalidArgument), checks what is
  // at `path` (above), creates the temporary file and writes the length and
  // the header. `metadata`: string pairs for "__metadata__" (e.g. {"format",
  // "pt"}).
  static StatusOr<SafetensorsWriter> Create(
      const std::string& path, const std::vector<std::pair<std::string, std::string>>& metadata,
      std::span<const SafetensorsTensor> tensors);

  SafetensorsWriter(SafetensorsWriter&& o) noexcept;
  SafetensorsWriter& operator=(SafetensorsWriter&&) = delete;
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  // Removes the temporary file unless Commit succeeded.
  ~SafetensorsWriter();

  // Appends the next n bytes of the data (the tensors' bytes, in the order
  // given to Create, back to back). More bytes than the tensors hold in all
  // is InvalidArgument; an I/O error names the file, offset and errno.
  Status Append(const void* data, size_t n);

  // Once every data byte is appended (fewer: FailedPrecondition naming how
  // many are missing): fsync, the check of `path` again, rename over it,
  // fsync of the directory. After an error the writer is spent.
  Status Commit();

  // The file's size: 8 + the padded header + the data.
  int64_t file_bytes() const { return header_end_ + data_bytes_; }
  // The data's size (what Append must deliver).
  int64_t data_bytes() const { return data_bytes_; }
  // The temporary file being written (empty once committed).
  const std::string& temp_path() const { return tmp_; }

 private:
  SafetensorsWriter(std::string path, std::string tmp, int fd, int64_t header_end,
                    int64_t data_bytes);
  // pwrite of all n bytes at `off` of the temporary file.
  Status WriteAt(const void* data, size_t n, int64_t off);

  std::string path_;
  std::string tmp_;  // removed by the destructor while not empty
  int fd_ = -1;
  int64_t header_end_ = 0;  // where the data start
  int64_t data_bytes_ = 0;
  int64_t written_ = 0;  // data bytes appended so far
};

// One tensor with its bytes in memory (size: the product of the shape times
// the dtype's size, else InvalidArgument naming the tensor).
struct SafetensorsTensorData {
  SafetensorsTensor tensor;
  std::span<const uint8_t> bytes;
};

// The whole file at once: Create, Append of each tensor's bytes, Commit.
// Returns the file's size.
StatusOr<int64_t> WriteSafetensors(const std::string& path,
                                   const std::vector<std::pair<std::string, std::string>>& metadata,
                                   std::span<const SafetensorsTensorData> tensors);

}  // namespace strata::scheduler
