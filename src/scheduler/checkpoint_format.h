// src/scheduler/checkpoint_format.h — the checkpoint's on-disk format: what
// one ckpt-<N> directory holds, the identity its manifest records, what a
// resume compares, and the checked reading and restoring of its files.
//
// What this module promises:
//   - A manifest is used only when it is JSON of this format, a version this
//     build reads, and its own CRC-32C matches (LoadManifest).
//   - A data file is used only once its size and CRC-32C match the
//     manifest's (VerifyFile), and is checksummed again while it is restored
//     (RestoreStates): a file that changed in between is DataLoss.
//   - Every config key is compared on resume except those the config schema
//     marks as free to differ (CheckpointFreeKeys); the layout is compared
//     parameter by parameter.
//   - Every error names the file (and the offset and errno for I/O).
// It takes no lock and knows nothing of the other directories under a root
// (checkpoint_dir.h) nor of which checkpoint to load (checkpoint.h).
//
// On disk, one checkpoint directory:
//
//   ckpt-00000007/params.bin     every module's parameter bytes, in module
//                                order (module(m).bytes() each)
//   ckpt-00000007/states.bin     the fp32 states of the element space,
//                                sub-group by sub-group: master | exp_avg |
//                                exp_avg_sq (12 x elems bytes each)
//   ckpt-00000007/MANIFEST.json  what makes the directory a checkpoint
//
// Saved by several data-parallel ranks, the states are one file per rank
// instead of states.bin: states-rank-<k>.bin, rank k's partition of the
// element space (Layout::OwnedElems) cut into its sub-groups. The manifest's
// "states" list names each states file with the elements it covers and the
// size of its sub-groups (the last of a file may be shorter), so a reader
// finds any element's states whatever the number of ranks that wrote them.
//
// The manifest holds the format version, the sequence number, the optimizer
// step, the loss scaler's state, the caller's data position and note, the
// run id, the whole effective config (ConfigToJson; compared key by key on
// load but CheckpointFreeKeys()), the layout's identity (parameter names,
// numels, dtypes, modules, the one-rank element and sub-group counts, and
// its hash), the states files, per data file its size and CRC-32C, and last
// manifest_crc32c: the CRC-32C of the manifest's own content (its compact
// JSON without that key), so that an edited manifest is refused.
//
// The format does not depend on the placement: states and parameters are
// copied out of wherever they live and restored into wherever the loading
// engine keeps them.
//
// The names in checkpoint_internal are for the checkpoint files
// (checkpoint*.cc) only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "src/common/aligned_buffer.h"
#include "src/config/schema.h"
#include "src/scheduler/layout.h"
#include "src/scheduler/state_store.h"
#include "strata/config.h"
#include "strata/engine.h"
#include "strata/status.h"

namespace strata::scheduler {

inline constexpr char kCheckpointManifest[] = "MANIFEST.json";
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
// the reason: the keys the config schema marks so (its free_on_resume
// column, src/config/schema.cc), in its order. Every other key is compared:
// a difference is refused.
using CheckpointFreeKey = ResumeFreeKey;
std::span<const CheckpointFreeKey> CheckpointFreeKeys();
// Whether `key` (e.g. "zero_optimization.offload_param.nvme_path[0]") is
// covered by CheckpointFreeKeys().
bool CheckpointKeyMayDiffer(std::string_view key);
// The differences between the config saved in a checkpoint and `now` (both
// ConfigToJson text), the free keys left out: "strata.model.seed: 1234 in
// the checkpoint, 99 now" for the first, then "(also: key, key)"; "" when
// none.
std::string CheckpointConfigDifference(const std::string& then_json, const std::string& now_json);

namespace checkpoint_internal {

using Json = nlohmann::ordered_json;

inline constexpr char kFormat[] = "strata-checkpoint";
inline constexpr char kParamsFile[] = "params.bin";
inline constexpr char kStatesFile[] = "states.bin";
// The chunk a whole file is read in to be checksummed.
inline constexpr size_t kVerifyChunk = size_t{8} << 20;

// An open file descriptor, closed on destruction; every error names the path
// (and the offset for data transfers) and the errno.
class File {
 public:
  // With O_CREAT: a new file (O_EXCL | O_NOFOLLOW, mode 0600; a name that
  // exists is refused). Without: the regular file there (a symlink, FIFO or
  // device is refused, naming it). src/common/private_fs.h.
  static StatusOr<File> Open(const std::string& path, int flags);
  File(File&& o) noexcept;
  File& operator=(File&&) = delete;
  ~File();

  // Appends n bytes (at the running offset).
  Status Append(const void* data, size_t n);
  // Reads exactly n bytes at the running offset; a file that ends first is
  // DataLoss (truncated).
  Status ReadNext(void* buf, size_t n);
  // Moves the running offset (of the next ReadNext) to `offset`.
  void Seek(int64_t offset) { off_ = offset; }
  StatusOr<int64_t> Size() const;
  Status Sync();
  Status Close();

 private:
  File(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  friend Status SyncDir(const std::string& dir);
  int fd_ = -1;
  std::string path_;
  int64_t off_ = 0;
};

// fsync of a directory (its entries made durable).
Status SyncDir(const std::string& dir);
// 8 hex digits, as the manifest writes a CRC-32C.
std::string Hex32(uint32_t v);

// ---- Identity: what must match for a checkpoint to load ----------------------

// The whole effective config (ConfigToJson), application sections included.
Json ConfigIdentity(const Config& c);
// Every parameter's name, numel, dtype and module (and group, when not 0),
// with the one-rank element, module and sub-group counts.
Json LayoutIdentity(const Layout& l);
// The optimizer parameter groups as the manifest records them (absent: one
// group without overrides).
Json ParamGroupsIdentity(std::span<const ParamGroupSpec> groups);
// The first difference between two ParamGroupsIdentity values ("" if none);
// names are for messages only.
std::string ParamGroupsDifference(const Json& then, const Json& now);
// The config's differences but the free keys (CheckpointConfigDifference),
// and but the state format's keys (strata.optimizer_states and DeepSpeed's
// bf16 state keys) with `ignore_state_format`.
std::string ConfigDifference(const Json& then, const Json& now, bool ignore_state_format = false);
// The first difference between two LayoutIdentity values ("" if none).
std::string LayoutDifference(const Json& then, const Json& now);
// CRC-32C of an identity's compact text, as 8 hex digits.
std::string IdentityHash(const Json& j);
// CRC-32C of a manifest's canonical text (compact dump, keys in order),
// without its manifest_crc32c.
std::string ManifestCrc(const Json& m);

// ---- Reading and checking ------------------------------------------------------
//
// A manifest's CRC-32C guards against accidents only: whoever can write the
// directory can recompute it. So a manifest is read as untrusted input: its
// size and nesting are bounded before and while it is parsed, the files it
// names are plain names of this format (never a path), its numbers are
// checked before they size anything, and every claimed size is checked
// against the files that exist before memory is allocated or a byte is
// written (checkpoint_export.cc). A forged manifest gives a DataLoss error
// naming it, never a crash, a hang or a read outside its directory.

// The longest manifest text read (a model of a million tensors has one of
// about 100 MiB).
inline constexpr int64_t kMaxManifestBytes = int64_t{256} << 20;
// The deepest nesting of objects and arrays: the config's bound, and the
// manifest's own levels around it.
inline constexpr int kMaxManifestDepth = kMaxConfigDepth + 8;

// `text` as a manifest's JSON (an object), its nesting bounded by
// kMaxManifestDepth; errors name `manifest_path`.
StatusOr<Json> ParseManifestText(std::string_view text, const std::string& manifest_path);
// The manifest of checkpoint directory `dir`, read and checked: at most
// kMaxManifestBytes, JSON, this format and version, and its own CRC-32C. Its
// fields are the caller's to read (ManifestFiles for its files).
StatusOr<Json> LoadManifest(const std::string& dir);
// Whether `name` is one this format writes into a checkpoint directory:
// params.bin, states.bin or states-rank-<digits>.bin. Nothing else is read.
bool IsCheckpointDataFileName(std::string_view name);
// One data file the manifest lists, checked.
struct ManifestFile {
  std::string name;   // IsCheckpointDataFileName
  int64_t bytes = 0;  // >= 0
  uint32_t crc = 0;   // from 8 hex digits
};
// The manifest's "files" list, each entry checked (a file name this format
// writes, listed once; a size >= 0; a CRC-32C of 8 hex digits); DataLoss
// naming the manifest and the entry otherwise.
StatusOr<std::vector<ManifestFile>> ManifestFiles(const Json& m, const std::string& manifest_path);
// Size and CRC-32C of a whole file against the manifest's; `buf` holds at
// least kVerifyChunk bytes.
Status VerifyFile(const std::string& path, int64_t bytes, uint32_t crc, AlignedBuffer& buf);
// The size params.bin has for layout `l`.
int64_t ParamFileBytes(const Layout& l);
// One buffer big enough for any module's parameters or sub-group's states.
StatusOr<AlignedBuffer> SectionBuffer(const Layout& l);
// The states file rank `rank` of `world` writes.
std::string StateFileName(int rank, int world);
// The manifest's states files (a version 2 or 3 manifest: states.bin over the
// one-rank element space), checked: in element order, contiguous from 0,
// covering the layout's `elements`, each as big as the manifest's files list
// says (`file_bytes`: name -> bytes). Throws on a malformed entry (the caller
// reports it).
StatusOr<std::vector<CheckpointStateFile>> StateFilesOf(
    const Json& m, int64_t elements, int64_t sub_group_size,
    const std::function<std::optional<int64_t>(const std::string&)>& file_bytes,
    const std::string& manifest_path);
// Restores this rank's sub-groups of `layout` (the store's) from the states
// files, each overlapping file read whole, in order, and checksummed again;
// elements no file covers (the partitions' tail padding) get zeros. `dst`:
// SectionBuffer(layout).
Status RestoreStates(const std::string& dir, const std::vector<CheckpointStateFile>& files,
                     const std::function<uint32_t(const std::string&)>& crc_of,
                     const Layout& layout, StateStore* store, AlignedBuffer& dst);

}  // namespace checkpoint_internal
}  // namespace strata::scheduler
