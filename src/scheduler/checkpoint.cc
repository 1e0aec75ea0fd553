#include "src/scheduler/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "src/common/aligned_buffer.h"
#include "src/common/crc32c.h"
#include "src/common/log.h"
#include "src/common/private_fs.h"
#include "src/common/status_util.h"
#include "src/scheduler/hyperparams.h"

namespace strata::scheduler {
namespace {

namespace fs = std::filesystem;
using checkpoint_internal::ConfigDifference;
using checkpoint_internal::ConfigIdentity;
using checkpoint_internal::File;
using checkpoint_internal::Hex32;
using checkpoint_internal::IdentityHash;
using checkpoint_internal::Json;
using checkpoint_internal::kFormat;
using checkpoint_internal::kParamsFile;
using checkpoint_internal::LayoutDifference;
using checkpoint_internal::LayoutIdentity;
using checkpoint_internal::LoadManifest;
using checkpoint_internal::ManifestCrc;
using checkpoint_internal::ManifestFile;
using checkpoint_internal::ManifestFiles;
using checkpoint_internal::ParamFileBytes;
using checkpoint_internal::ParamGroupsDifference;
using checkpoint_internal::ParamGroupsIdentity;
using checkpoint_internal::RestoreStates;
using checkpoint_internal::SectionBuffer;
using checkpoint_internal::StateFileName;
using checkpoint_internal::StateFilesOf;
using checkpoint_internal::SyncDir;
using checkpoint_internal::VerifyFile;

// Several ranks: every rank's `mine` (status and payload) gathered. OK with
// every payload in rank order when every rank's status is OK; else the
// first failing rank's error, the same on every rank ("rank k: ..."). One
// rank (null): `mine` alone.
StatusOr<std::vector<std::string>> Exchange(const CheckpointRanks* ranks, int rank,
                                            const Status& mine, const std::string& payload) {
  if (ranks == nullptr || ranks->exchange == nullptr) {
    if (!mine.ok()) return mine;
    return std::vector<std::string>{payload};
  }
  // One byte of status code, then the message or the payload (appended:
  // string + string here draws GCC 12's false -Wrestrict at -O3).
  std::string text(1, mine.ok() ? '\0' : static_cast<char>(mine.code()));
  if (mine.ok())
    text += payload;
  else
    text += mine.message();
  ASSIGN_OR_RETURN(std::vector<std::string> all, ranks->exchange->AllGatherBytes(text));
  std::vector<std::string> payloads;
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) return InternalError(fmt::format("checkpoint: rank {} sent nothing", r));
    if (all[r][0] != 0) {
      if (static_cast<int>(r) == rank) return mine;
      return Status(static_cast<StatusCode>(all[r][0]),
                    fmt::format("rank {}: {}", r, all[r].substr(1)));
    }
    payloads.push_back(all[r].substr(1));
  }
  return payloads;
}

// Module m's current parameter bytes into buf (host memory): from the store,
// or with partitioned parameters gathered from every rank's part (a
// collective).
Status ReadModuleBytes(StateStore* store, const CheckpointRanks* ranks, int m, uint8_t* buf) {
  if (!store->partition().params_partitioned()) return store->ReadModuleParams(m, buf);
  AlignedBuffer piece;
  ASSIGN_OR_RETURN(const PartBytes mine,
                   store->PartOf(m, /*updated=*/false, /*to_host=*/true, &piece));
  return ranks->gatherer->GatherModule(m, mine, buf, Memory::kHost);
}

// Removes a checkpoint directory whose save failed (it has no manifest).
class PartialDir {
 public:
  explicit PartialDir(std::string path) : path_(std::move(path)) {}
  ~PartialDir() {
    if (path_.empty()) return;
    const Status s = RemoveCheckpointDir(path_);
    if (!s.ok())
      STRATA_LOG_WARN("checkpoint: removing the failed save {}: {}", path_, s.ToString());
  }
  void Keep() { path_.clear(); }

 private:
  std::string path_;
};

}  // namespace

Status WriteCheckpoint(const std::string& root, const Config& config, const Layout& layout,
                       StateStore* store, CheckpointMeta* meta, const CheckpointRanks* ranks) {
  const Partition& part = store->partition();
  const int rank = part.rank();
  const int world = part.world_size();
  if (part.params_partitioned() && (ranks == nullptr || ranks->gatherer == nullptr))
    return FailedPreconditionError("WriteCheckpoint: partitioned parameters without a gatherer");
  if (meta->run_id.empty())
    return InvalidArgumentError("WriteCheckpoint: no run id (CheckpointMeta::run_id)");
  // Rank 0 locks the root, checks it and makes the directory; every rank
  // learns the directory and rank 0's run id.
  std::string dir;
  int64_t seq = 0;
  std::optional<PartialDir> partial;
  const Status made = [&]() -> Status {
    if (rank != 0) return Status();
    std::error_code ec;
    const bool existed = fs::exists(root, ec);
    ASSIGN_OR_RETURN(meta->lock, LockCheckpointDir(root, ""));
    if (!existed) {
      const fs::path parent = fs::absolute(root, ec).parent_path();
      RETURN_IF_ERROR(SyncDir(parent.empty() ? "." : parent.string()));
    }
    const std::vector<CheckpointEntry> entries = ListCheckpoints(root);
    if (const std::string others = OtherRunsCheckpoints(entries, meta->run_id); !others.empty())
      return FailedPreconditionError(fmt::format(
          "checkpoint directory {} holds {}, not of this run ({}): load its newest checkpoint "
          "first to continue that run, save into another directory, or remove them",
          root, others, meta->run_id));
    seq = (entries.empty() ? 0 : entries.back().sequence) + 1;
    dir = fmt::format("{}/ckpt-{:08d}", root, seq);
    // A new directory of this user only; the name must not exist (a symlink
    // or another user's directory there is refused).
    if (::mkdir(dir.c_str(), kPrivateDirMode) != 0)
      return ErrnoError(fmt::format("mkdir {}", dir), errno);
    partial.emplace(dir);
    return SyncDir(root);
  }();
  {
    // As JSON: a path may hold any byte but NUL, a newline included.
    ASSIGN_OR_RETURN(
        std::vector<std::string> got,
        Exchange(ranks, rank, made, rank == 0 ? Json::array({dir, meta->run_id}).dump() : ""));
    const Json j = Json::parse(got[0], nullptr, /*allow_exceptions=*/false);
    if (!j.is_array() || j.size() != 2 || !j[0].is_string() || !j[1].is_string())
      return InternalError("checkpoint: rank 0 sent no directory and run id");
    dir = j[0].get<std::string>();
    meta->run_id = j[1].get<std::string>();
  }

  // Data files: written in full, fsync'd, closed. Rank 0 writes the
  // parameters; every rank its partition's states.
  Json files = Json::array();
  meta->bytes = 0;
  const size_t g0 = store->partition().groups().first, g1 = store->partition().groups().second;
  const CheckpointStateFile mine{StateFileName(rank, world), layout.group(g0).elem_begin,
                                 layout.group(g1 - 1).elem_end, layout.group(g0).elems()};
  const Status wrote = [&]() -> Status {
    if (rank != 0 && !fs::is_directory(dir))
      return FailedPreconditionError(fmt::format(
          "checkpoint directory {} (made by rank 0) is not there: the ranks of a run must save "
          "into a directory on a filesystem every rank sees",
          dir));
    ASSIGN_OR_RETURN(AlignedBuffer buf, SectionBuffer(layout));
    // A data file: every section filled (`fill`) and, with `to_disk`,
    // appended, the file fsync'd and listed. After a write error the
    // sections are still filled (a fill may be a collective the other ranks
    // wait for) and the error is returned at the end.
    auto write_file = [&](const std::string& name, size_t first, size_t end, bool to_disk,
                          const std::function<StatusOr<int64_t>(size_t, void*)>& fill) -> Status {
      std::optional<File> f;
      Status write_error;
      if (to_disk) {
        StatusOr<File> opened = File::Open(dir + "/" + name, O_WRONLY | O_CREAT | O_EXCL);
        if (opened.ok()) f.emplace(std::move(*opened));
        write_error = opened.status();
      }
      uint32_t crc = 0;
      int64_t bytes = 0;
      for (size_t i = first; i < end; ++i) {
        ASSIGN_OR_RETURN(int64_t n, fill(i, buf.data()));
        if (!to_disk || !write_error.ok()) continue;
        crc = Crc32cExtend(crc, buf.data(), static_cast<size_t>(n));
        write_error = f->Append(buf.data(), static_cast<size_t>(n));
        bytes += n;
      }
      if (!to_disk) return Status();
      if (write_error.ok()) write_error = f->Sync();
      if (write_error.ok()) write_error = f->Close();
      RETURN_IF_ERROR(write_error);
      files.push_back({{"name", name}, {"bytes", bytes}, {"crc32c", Hex32(crc)}});
      meta->bytes += bytes;
      return Status();
    };
    // The parameters, written by rank 0; with partitioned parameters every
    // rank gathers each module for it (a collective).
    if (rank == 0 || part.params_partitioned())
      RETURN_IF_ERROR(write_file(kParamsFile, 0, static_cast<size_t>(layout.num_modules()),
                                 rank == 0, [&](size_t m, void* b) -> StatusOr<int64_t> {
                                   RETURN_IF_ERROR(ReadModuleBytes(store, ranks,
                                                                   static_cast<int>(m),
                                                                   static_cast<uint8_t*>(b)));
                                   return layout.module(static_cast<int>(m)).bytes();
                                 }));
    return write_file(mine.name, g0, g1, true, [&](size_t g, void* b) -> StatusOr<int64_t> {
      RETURN_IF_ERROR(store->ReadGroupStates(g, b));
      return kOptimizerStateBytesPerElem * layout.group(g).elems();
    });
  }();
  const Json report = {{"files", files},
                       {"states",
                        {{"file", mine.name},
                         {"elem_begin", mine.elem_begin},
                         {"elem_end", mine.elem_end},
                         {"sub_group_elems", mine.sub_group_elems}}}};
  ASSIGN_OR_RETURN(const std::vector<std::string> reports,
                   Exchange(ranks, rank, wrote, report.dump()));

  // Rank 0: the manifest, once every rank's file is durable.
  const Status done = [&]() -> Status {
    if (rank != 0) return Status();
    Json all_files = Json::array(), states = Json::array();
    for (const std::string& text : reports) {
      const Json r = Json::parse(text);
      for (const Json& f : r.at("files")) all_files.push_back(f);
      states.push_back(r.at("states"));
    }
    RETURN_IF_ERROR(SyncDir(dir));
    if (meta->at_point) meta->at_point("data");

    const Json config_id = ConfigIdentity(config);
    const Json layout_id = LayoutIdentity(layout);
    Json m;
    m["format"] = kFormat;
    m["version"] = kCheckpointFormatVersion;
    m["sequence"] = seq;
    m["run_id"] = meta->run_id;
    m["optimizer_step"] = meta->optimizer_step;
    m["loss_scaler"] = {{"scale", meta->scaler.scale},
                        {"hysteresis_left", meta->scaler.hysteresis_left},
                        {"iteration", meta->scaler.iteration},
                        {"last_overflow_iteration", meta->scaler.last_overflow_iteration}};
    m["data_position"] = meta->data_position;
    m["note"] = meta->note;
    m["config_hash"] = IdentityHash(config_id);
    m["config"] = config_id;
    m["layout_hash"] = IdentityHash(layout_id);
    m["layout"] = layout_id;
    if (meta->param_groups.size() > 1) m["param_groups"] = ParamGroupsIdentity(meta->param_groups);
    m["ranks"] = world;
    m["states"] = std::move(states);
    m["files"] = std::move(all_files);
    std::string text;
    try {
      m["manifest_crc32c"] = ManifestCrc(m);
      text = m.dump(1) + "\n";
    } catch (const nlohmann::json::exception& e) {
      return InvalidArgumentError(
          fmt::format("SaveCheckpoint: the note is not valid UTF-8 ({})", e.what()));
    }
    const std::string final_path = dir + "/" + kCheckpointManifest;
    const std::string tmp = final_path + ".tmp";
    {
      ASSIGN_OR_RETURN(File f, File::Open(tmp, O_WRONLY | O_CREAT | O_EXCL));
      RETURN_IF_ERROR(f.Append(text.data(), text.size()));
      RETURN_IF_ERROR(f.Sync());
      RETURN_IF_ERROR(f.Close());
    }
    if (meta->at_point) meta->at_point("manifest_tmp");
    if (::rename(tmp.c_str(), final_path.c_str()) != 0)
      return ErrnoError(fmt::format("rename {} to {}", tmp, final_path), errno);
    partial->Keep();
    if (meta->at_point) meta->at_point("rename");
    RETURN_IF_ERROR(SyncDir(dir));
    RETURN_IF_ERROR(SyncDir(root));
    RemoveOldCheckpoints(root, seq, meta->run_id, meta->at_point);
    return Status();
  }();
  RETURN_IF_ERROR(Exchange(ranks, rank, done, "").status());
  meta->path = dir;
  return Status();
}

StatusOr<CheckpointMeta> ReadCheckpoint(const std::string& root, const Config& config,
                                        const Layout& layout, StateStore* store,
                                        std::span<const ParamGroupSpec> groups,
                                        const CheckpointRanks* ranks, bool convert_states) {
  const int rank = store->partition().rank();
  // Rank 0 picks the checkpoint. A root is locked: a save of another process
  // must not be judged interrupted, nor a checkpoint removed under it.
  std::shared_ptr<CheckpointDirLock> lock;
  std::string dir;
  const Status picked = [&]() -> Status {
    if (rank != 0) return Status();
    if (LatestCheckpoint(root).empty())
      return NotFoundError(
          fmt::format("no checkpoint in {} (no ckpt-*/{})", root, kCheckpointManifest));
    if (LatestCheckpoint(root) != root) {
      StatusOr<std::shared_ptr<CheckpointDirLock>> l = LockCheckpointDir(root, "");
      if (l.ok()) {
        lock = *l;
      } else if (l.status().code() == StatusCode::kUnavailable ||
                 ::access(root.c_str(), W_OK) == 0) {
        return l.status();
      }  // else read-only: read without the lock, tidy nothing
    }
    dir = LatestCheckpoint(root);
    if (dir.empty())
      return NotFoundError(
          fmt::format("no checkpoint in {} (no ckpt-*/{})", root, kCheckpointManifest));
    // A directory this run will go on to prune must be this user's alone.
    if (lock != nullptr && dir != root) RETURN_IF_ERROR(CheckPrivateDir(dir, "checkpoint"));
    if (dir != root) {
      std::string skipped;
      bool newer = false;
      for (const CheckpointEntry& e : ListCheckpoints(root, /*summaries=*/false)) {
        if (e.path == dir)
          newer = true;
        else if (newer && !e.complete)
          skipped += (skipped.empty() ? "" : ", ") + e.path;
      }
      if (!skipped.empty())
        STRATA_LOG_WARN("checkpoint: loading {}; skipped the newer {} (no {}: an interrupted save)",
                        dir, skipped, kCheckpointManifest);
    }
    return Status();
  }();
  {
    ASSIGN_OR_RETURN(std::vector<std::string> got, Exchange(ranks, rank, picked, dir));
    dir = got[0];
  }
  const std::string manifest_path = dir + "/" + kCheckpointManifest;

  CheckpointMeta meta;
  meta.path = dir;
  struct FileEntry {
    int64_t bytes = 0;
    uint32_t crc = 0;
  };
  std::map<std::string, FileEntry> listed;
  std::vector<CheckpointStateFile> state_files;
  ASSIGN_OR_RETURN(AlignedBuffer buf, SectionBuffer(layout));
  const auto [g0, g1] = store->partition().groups();
  const int64_t own0 = layout.group(g0).elem_begin, own1 = layout.group(g1 - 1).elem_end;
  auto mine = [&](const CheckpointStateFile& f) {
    return f.elem_end > own0 && f.elem_begin < own1;
  };
  // Every rank checks the manifest and verifies what it will read.
  const Status checked = [&]() -> Status {
    ASSIGN_OR_RETURN(const Json m, LoadManifest(dir));
    try {
      std::string diff = ConfigDifference(m.at("config"), ConfigIdentity(config), convert_states);
      if (!diff.empty())
        return FailedPreconditionError(
            fmt::format("checkpoint {} was saved with a different config: {}{}", dir, diff,
                        diff.starts_with("strata.optimizer_states")
                            ? " (CheckpointInfo::convert_optimizer_states loads it in this format)"
                            : ""));
      if (convert_states) {
        const Json& st = m.at("config").contains("strata") ? m.at("config").at("strata") : Json();
        const std::string then = st.is_object() && st.contains("optimizer_states")
                                     ? st.at("optimizer_states").get<std::string>()
                                     : "fp32";
        const std::string now(OptimizerStatesName(config.strata.optimizer_states));
        if ((then == "int8") != (now == "int8"))
          return FailedPreconditionError(fmt::format(
              "checkpoint {}: converting its optimizer states from {} to {} is not offered: "
              "int8 lays the model out in 256-element blocks, the other formats do not",
              dir, then, now));
      }
      diff = LayoutDifference(m.at("layout"), LayoutIdentity(layout));
      if (!diff.empty())
        return FailedPreconditionError(
            fmt::format("checkpoint {} has a different model layout: {}", dir, diff));
      const ParamGroupSpec default_group = DefaultParamGroup();
      const std::span<const ParamGroupSpec> one_group(&default_group, 1);
      const Json groups_now = ParamGroupsIdentity(groups.size() > 1 ? groups : one_group);
      const Json groups_then =
          m.contains("param_groups") ? m.at("param_groups") : ParamGroupsIdentity(one_group);
      diff = ParamGroupsDifference(groups_then, groups_now);
      if (!diff.empty())
        return FailedPreconditionError(
            fmt::format("checkpoint {} has different optimizer parameter groups: {}", dir, diff));
      meta.run_id = m.at("run_id").get<std::string>();
      meta.optimizer_step = m.at("optimizer_step").get<int64_t>();
      const Json& ls = m.at("loss_scaler");
      meta.scaler.scale = ls.at("scale").get<double>();
      meta.scaler.hysteresis_left = ls.at("hysteresis_left").get<int>();
      meta.scaler.iteration = ls.at("iteration").get<int64_t>();
      meta.scaler.last_overflow_iteration = ls.at("last_overflow_iteration").get<int64_t>();
      meta.data_position = m.at("data_position").get<int64_t>();
      meta.note = m.at("note").get<std::string>();
      ASSIGN_OR_RETURN(const std::vector<ManifestFile> files, ManifestFiles(m, manifest_path));
      for (const ManifestFile& f : files) listed[f.name] = FileEntry{f.bytes, f.crc};
      ASSIGN_OR_RETURN(state_files, StateFilesOf(
                                        m, layout.unpartitioned_elems(), layout.sub_group_size(),
                                        [&](const std::string& name) -> std::optional<int64_t> {
                                          auto it = listed.find(name);
                                          if (it == listed.end()) return std::nullopt;
                                          return it->second.bytes;
                                        },
                                        manifest_path));
    } catch (const std::exception& e) {
      return DataLossError(fmt::format("checkpoint manifest {}: {}", manifest_path, e.what()));
    }
    auto params = listed.find(kParamsFile);
    if (params == listed.end())
      return DataLossError(fmt::format("{}: lists no {}", manifest_path, kParamsFile));
    if (params->second.bytes != ParamFileBytes(layout))
      return DataLossError(fmt::format("{}: {} of {} bytes, the layout's is {} bytes",
                                       manifest_path, kParamsFile, params->second.bytes,
                                       ParamFileBytes(layout)));
    // Everything is verified before anything is restored.
    RETURN_IF_ERROR(
        VerifyFile(dir + "/" + kParamsFile, params->second.bytes, params->second.crc, buf));
    for (const CheckpointStateFile& f : state_files)
      if (mine(f))
        RETURN_IF_ERROR(
            VerifyFile(dir + "/" + f.name, listed[f.name].bytes, listed[f.name].crc, buf));
    return Status();
  }();
  RETURN_IF_ERROR(Exchange(ranks, rank, checked, "").status());

  // Every rank restores the parameters and its partition's states.
  const Status restored = [&]() -> Status {
    const std::string params_path = dir + "/" + kParamsFile;
    ASSIGN_OR_RETURN(File f, File::Open(params_path, O_RDONLY));
    uint32_t crc = 0;
    for (int mi = 0; mi < layout.num_modules(); ++mi) {
      const int64_t n = layout.module(mi).bytes();
      if (n == 0) continue;
      RETURN_IF_ERROR(f.ReadNext(buf.data(), static_cast<size_t>(n)));
      crc = Crc32cExtend(crc, buf.data(), static_cast<size_t>(n));
      // Page padding of the section buffer: zeros (NVMe writes whole pages).
      std::memset(buf.as<uint8_t>() + n, 0, static_cast<size_t>(IoBytes(n) - n));
      RETURN_IF_ERROR(store->WriteModuleParams(mi, buf.data()));
    }
    if (crc != listed[kParamsFile].crc)
      return DataLossError(
          fmt::format("checkpoint file {}: changed while loading (crc32c {}, the manifest's {})",
                      params_path, Hex32(crc), Hex32(listed[kParamsFile].crc)));
    return RestoreStates(
        dir, state_files, [&](const std::string& name) { return listed[name].crc; }, layout, store,
        buf);
  }();
  const Status all_restored = Exchange(ranks, rank, restored, "").status();
  if (!all_restored.ok())
    return DataLossError(
        fmt::format("restoring checkpoint {}: {}; the engine's states are partly "
                    "restored: load again or recreate the engine",
                    dir, all_restored.ToString()));
  for (const CheckpointStateFile& f : state_files)
    if (mine(f)) meta.bytes += listed[f.name].bytes;
  meta.bytes += listed[kParamsFile].bytes;
  // A resume tidies what a crash left under the root, as the save it
  // interrupted would have: directories without a manifest and checkpoints
  // beyond the newest kCheckpointsKept, none newer than the one loaded.
  if (lock != nullptr) {
    lock->SetRunId(meta.run_id);
    for (const CheckpointEntry& e : ListCheckpoints(root, /*summaries=*/false))
      if (e.path == dir) RemoveOldCheckpoints(root, e.sequence, meta.run_id);
  }
  meta.lock = std::move(lock);
  return meta;
}

}  // namespace strata::scheduler
