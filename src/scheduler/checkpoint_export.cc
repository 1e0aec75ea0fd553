#include "src/scheduler/checkpoint_export.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <filesystem>
#include <optional>
#include <set>
#include <utility>

#include "src/common/aligned_buffer.h"
#include "src/common/crc32c.h"
#include "src/common/dtype.h"
#include "src/common/private_fs.h"
#include "src/common/status_util.h"
#include "src/cpu_adam/cpu_adam.h"
#include "src/scheduler/checkpoint_dir.h"
#include "src/scheduler/safetensors.h"

namespace strata::scheduler {

namespace {

namespace fs = std::filesystem;
using checkpoint_internal::File;
using checkpoint_internal::Hex32;
using checkpoint_internal::Json;
using checkpoint_internal::kParamsFile;
using checkpoint_internal::kVerifyChunk;
using checkpoint_internal::LoadManifest;
using checkpoint_internal::ManifestFile;
using checkpoint_internal::ManifestFiles;
using checkpoint_internal::ParamFileBytes;
using checkpoint_internal::StateFilesOf;
using checkpoint_internal::SyncDir;
using checkpoint_internal::VerifyFile;

// The manifest of `dir` as an inspection: identity, rebuilt layout and the
// files it lists (not checked).
StatusOr<CheckpointInspection> ParseManifest(const std::string& dir) {
  const std::string manifest_path = dir + "/" + kCheckpointManifest;
  ASSIGN_OR_RETURN(const Json m, LoadManifest(dir));
  CheckpointInspection in;
  in.path = dir;
  try {
    in.version = m.at("version").get<int>();
    in.sequence = m.at("sequence").get<int64_t>();
    in.run_id = m.at("run_id").get<std::string>();
    in.optimizer_step = m.at("optimizer_step").get<int64_t>();
    in.data_position = m.at("data_position").get<int64_t>();
    in.note = m.at("note").get<std::string>();
    in.config_hash = m.at("config_hash").get<std::string>();
    in.layout_hash = m.at("layout_hash").get<std::string>();
    const Json& cfg = m.at("config");
    in.config_json = cfg.dump();
    const Json& opt = cfg.at("optimizer");
    in.optimizer_type = opt.at("type").get<std::string>();
    if (opt.contains("params") && opt["params"].contains("lr"))
      in.lr = opt["params"]["lr"].get<double>();
    in.model_dtype = cfg.at("fp16").at("enabled").get<bool>()   ? "fp16"
                     : cfg.at("bf16").at("enabled").get<bool>() ? "bf16"
                                                                : "fp32";
    in.sub_group_size = cfg.at("zero_optimization").at("sub_group_size").get<int64_t>();
    // int8 states: tensors and sub-groups start on their blocks (the states
    // file holds them decoded to fp32 either way).
    const Json& st = cfg.contains("strata") ? cfg.at("strata") : Json::object();
    const bool int8_states =
        st.contains("optimizer_states") && st.at("optimizer_states").get<std::string>() == "int8";
    // The files first: checked names, and their sizes on disk, against
    // which every size the layout claims is checked before it sizes
    // anything (a forged manifest's numbers are only numbers).
    ASSIGN_OR_RETURN(const std::vector<ManifestFile> listed, ManifestFiles(m, manifest_path));
    int64_t params_on_disk = 0, states_on_disk = 0;
    for (const ManifestFile& f : listed) {
      CheckpointFileCheck c;
      c.name = f.name;
      c.bytes = f.bytes;
      c.crc32c = Hex32(f.crc);
      struct stat st {};
      const std::string path = dir + "/" + f.name;
      if (::lstat(path.c_str(), &st) == 0) {
        // Anything but a regular file is named as the reader refuses it
        // (OpenRegularFile); a missing one keeps actual_bytes -1.
        if (!S_ISREG(st.st_mode))
          return DataLossError(fmt::format("checkpoint file {}: {}, not a regular file", path,
                                           FileKind(st.st_mode)));
        c.actual_bytes = static_cast<int64_t>(st.st_size);
        (f.name == kParamsFile ? params_on_disk : states_on_disk) += c.actual_bytes;
      }
      in.files.push_back(std::move(c));
    }
    const Json& lj = m.at("layout");
    const Json& pjs = lj.at("parameters");
    const Json* shapes = lj.contains("shapes") ? &lj.at("shapes") : nullptr;
    const Json* aliases = lj.contains("aliases") ? &lj.at("aliases") : nullptr;
    std::vector<ParamRec> recs;
    // (What the parameters claim, summed without overflow: a sum beyond
    // the files on disk stops at the first tensor that passes them.)
    int64_t claimed_bytes = 0, claimed_elems = 0;
    for (const Json& pj : pjs) {
      ParamRec r;
      r.name = pj.at(0).get<std::string>();
      r.numel = pj.at(1).get<int64_t>();
      const std::string dt = pj.at(2).get<std::string>();
      const std::optional<DType> d = ParseDType(dt);
      if (!d.has_value())
        return DataLossError(
            fmt::format("{}: parameter {} has dtype {}, expected fp32, fp16 or bf16", manifest_path,
                        r.name, dt));
      r.dtype = *d;
      r.module = pj.at(3).get<int>();
      if (pj.size() > 4) r.group = pj.at(4).get<int>();
      // Module ids are dense from 0 (ParamSpec): fewer modules than
      // parameters; groups likewise.
      const auto count = static_cast<int64_t>(pjs.size());
      if (r.numel < 0 || r.module < 0 || r.module >= count || r.group < 0 || r.group >= count)
        return DataLossError(
            fmt::format("{}: parameter {} has numel {}, module {} and group {} (of {} parameters)",
                        manifest_path, r.name, r.numel, r.module, r.group, count));
      if (r.numel > (params_on_disk - claimed_bytes) / r.elem_size() ||
          r.numel > (states_on_disk / kOptimizerStateBytesPerElem) - claimed_elems) {
        // A file shorter than the manifest says: that file is the problem.
        for (const CheckpointFileCheck& c : in.files)
          if (c.actual_bytes != c.bytes)
            return DataLossError(
                fmt::format("checkpoint file {}/{}: {}, the manifest says {} bytes", dir, c.name,
                            c.actual_bytes < 0 ? std::string("missing or not a regular file")
                                               : fmt::format("{} bytes", c.actual_bytes),
                            c.bytes));
        return DataLossError(fmt::format(
            "{}: parameter {} claims {} elements, more than the checkpoint's files hold ({} has "
            "{} bytes, the states files {}; the parameters before it take {} and {})",
            manifest_path, r.name, r.numel, kParamsFile, params_on_disk, states_on_disk,
            claimed_bytes, kOptimizerStateBytesPerElem * claimed_elems));
      }
      claimed_bytes += r.numel * r.elem_size();
      claimed_elems += r.numel;
      // Shapes and tied names: recorded since checkpoints carry them (an
      // older one exports each tensor flat, under its first name).
      if (shapes != nullptr && recs.size() < shapes->size()) {
        r.shape = shapes->at(recs.size()).get<std::vector<int64_t>>();
        int64_t product = 1;
        bool bad = false;
        for (int64_t dim : r.shape)
          bad |= dim < 0 || __builtin_mul_overflow(product, dim, &product);
        if (bad || product != r.numel)
          return DataLossError(fmt::format("{}: parameter {} has numel {} and shape {}",
                                           manifest_path, r.name, r.numel,
                                           shapes->at(recs.size()).dump()));
      }
      if (aliases != nullptr && aliases->contains(r.name)) {
        const Json& a = aliases->at(r.name);
        if (!a.is_array() || a.size() > kMaxParamAliases)
          return DataLossError(
              fmt::format("{}: parameter {} has {} other names; a parameter may have at most {}",
                          manifest_path, r.name, a.size(), kMaxParamAliases));
        r.aliases = a.get<std::vector<std::string>>();
      }
      recs.push_back(std::move(r));
    }
    if (recs.empty())
      return DataLossError(fmt::format("{}: the layout lists no parameters", manifest_path));
    LayoutOptions lo;
    lo.sub_group_size = in.sub_group_size;
    if (int8_states) lo.elem_align = static_cast<int64_t>(cpu_adam::kStateBlock);
    in.layout = Layout::Build(std::move(recs), lo);
    if (in.layout.total_elems() != lj.at("elements").get<int64_t>() ||
        in.layout.num_modules() != lj.at("modules").get<int>() ||
        in.layout.num_groups() != lj.at("sub_groups").get<size_t>())
      return DataLossError(fmt::format(
          "{}: the layout records {} elements, {} modules and {} sub-groups; its parameters and "
          "sub_group_size {} give {}, {} and {}",
          manifest_path, lj.at("elements").dump(), lj.at("modules").dump(),
          lj.at("sub_groups").dump(), in.sub_group_size, in.layout.total_elems(),
          in.layout.num_modules(), in.layout.num_groups()));
    ASSIGN_OR_RETURN(in.state_files, StateFilesOf(
                                         m, in.layout.unpartitioned_elems(), in.sub_group_size,
                                         [&](const std::string& name) -> std::optional<int64_t> {
                                           for (const CheckpointFileCheck& c : in.files)
                                             if (c.name == name) return c.bytes;
                                           return std::nullopt;
                                         },
                                         manifest_path));
  } catch (const std::exception& e) {
    return DataLossError(fmt::format("checkpoint manifest {}: {}", manifest_path, e.what()));
  }
  auto it = std::find_if(in.files.begin(), in.files.end(),
                         [&](const CheckpointFileCheck& c) { return c.name == kParamsFile; });
  if (it == in.files.end())
    return DataLossError(fmt::format("{}: lists no {}", manifest_path, kParamsFile));
  if (it->bytes != ParamFileBytes(in.layout))
    return DataLossError(fmt::format("{}: {} of {} bytes, the layout's is {} bytes", manifest_path,
                                     kParamsFile, it->bytes, ParamFileBytes(in.layout)));
  return in;
}

// Sizes (ParseManifest's lstat) and with `verify` CRC-32C of the listed
// files; sets validity.
Status CheckFiles(CheckpointInspection* in, bool verify) {
  ASSIGN_OR_RETURN(AlignedBuffer buf, AlignedBuffer::Allocate(kVerifyChunk, kIoAlign));
  for (CheckpointFileCheck& c : in->files) {
    const std::string path = in->path + "/" + c.name;
    Status s;
    if (verify) {
      s = VerifyFile(path, c.bytes, static_cast<uint32_t>(std::stoul(c.crc32c, nullptr, 16)), buf);
    } else if (c.actual_bytes != c.bytes) {
      s = DataLossError(fmt::format("checkpoint file {}: {} bytes, the manifest says {}", path,
                                    c.actual_bytes, c.bytes));
    }
    c.ok = s.ok() && verify;
    if (!s.ok() && in->validity.ok()) in->validity = s;
  }
  return Status();
}

}  // namespace

StatusOr<CheckpointInspection> InspectCheckpoint(const std::string& dir, bool verify) {
  std::error_code ec;
  if (fs::exists(fs::path(dir) / kCheckpointManifest, ec)) {
    ASSIGN_OR_RETURN(CheckpointInspection in, ParseManifest(dir));
    RETURN_IF_ERROR(CheckFiles(&in, verify));
    return in;
  }
  if (!fs::is_directory(dir, ec))
    return NotFoundError(fmt::format("checkpoint directory {}: not a directory", dir));
  std::vector<CheckpointEntry> entries = ListCheckpoints(dir, /*summaries=*/false);
  std::optional<CheckpointInspection> newest;
  Status newest_error;
  std::vector<std::string> skipped;
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    if (!it->complete) continue;
    StatusOr<CheckpointInspection> in = ParseManifest(it->path);
    if (in.ok()) RETURN_IF_ERROR(CheckFiles(&*in, verify));
    const Status problem = in.ok() ? in->validity : in.status();
    if (problem.ok()) {
      in->skipped = std::move(skipped);
      return std::move(*in);
    }
    if (!newest.has_value() && newest_error.ok()) {
      if (in.ok())
        newest = std::move(*in);
      else
        newest_error = problem;
    }
    skipped.push_back(fmt::format("{}: {}", it->path, problem.message()));
  }
  if (newest.has_value()) {
    skipped.erase(skipped.begin());
    newest->skipped = std::move(skipped);
    return std::move(*newest);
  }
  if (!newest_error.ok()) return newest_error;
  return NotFoundError(fmt::format("no checkpoint in {} (no {} there and no ckpt-*/{})", dir,
                                   kCheckpointManifest, kCheckpointManifest));
}

namespace {
StatusOr<CheckpointExportResult> Export(const std::string& dir, const std::string& out,
                                        ExportPrecision precision) {
  ASSIGN_OR_RETURN(CheckpointInspection in, InspectCheckpoint(dir, /*verify=*/true));
  if (!in.validity.ok())
    return DataLossError(
        fmt::format("refusing to export checkpoint {}: {}", in.path, in.validity.message()));
  const Layout& l = in.layout;
  const bool fp32 = precision == ExportPrecision::kFp32;
  // The bytes to copy, as [begin, end) ranges of each source file, the
  // files and the ranges in the flat element order (which is the order of
  // the tensors in the output): params.bin, or the states files.
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  std::vector<std::pair<std::string, Ranges>> sources;
  Ranges param_ranges;
  std::vector<SafetensorsTensor> tensors;
  std::set<std::string> names;
  auto add_tensor = [&](const ParamRec& p, const std::string& name) -> Status {
    const DType t = fp32 ? DType::kFp32 : p.dtype;
    if (!names.insert(name).second)
      return FailedPreconditionError(
          fmt::format("checkpoint {}: parameter name {} appears twice", in.path, name));
    tensors.push_back({name, t == DType::kFp32 ? "F32" : (t == DType::kBf16 ? "BF16" : "F16"),
                       p.shape.empty() ? std::vector<int64_t>{p.numel} : p.shape});
    return Status();
  };
  // Where parameter p's bytes are in params.bin.
  std::vector<int64_t> param_file_off(l.params().size(), 0);
  int64_t module_file_off = 0;
  for (const ModuleExtent& me : l.modules()) {
    for (int id : me.params) {
      const ParamRec& p = l.param(id);
      RETURN_IF_ERROR(add_tensor(p, p.name));
      param_file_off[static_cast<size_t>(id)] = module_file_off + p.byte_off - me.byte_begin;
      if (p.numel > 0 && !fp32)
        param_ranges.emplace_back(
            param_file_off[static_cast<size_t>(id)],
            param_file_off[static_cast<size_t>(id)] + p.numel * p.elem_size());
    }
    module_file_off += me.bytes();
  }
  if (!fp32) sources.emplace_back(kParamsFile, std::move(param_ranges));
  // The masters of the elements [lo, hi) of each states file, as ranges of
  // it: each sub-group's section starts with its masters; padding (layout.h)
  // left out.
  auto master_ranges = [&](const CheckpointStateFile& f, int64_t lo, int64_t hi, Ranges* r) {
    for (int64_t s0 = f.elem_begin; s0 < f.elem_end; s0 += f.sub_group_elems)
      for (const Layout::Slice& sl :
           l.Slices(std::max(s0, lo), std::min({f.elem_end, s0 + f.sub_group_elems, hi}))) {
        const int64_t at = kOptimizerStateBytesPerElem * (s0 - f.elem_begin) +
                           kMasterBytesPerElem * (sl.elem_begin - s0);
        r->emplace_back(at, at + kMasterBytesPerElem * (sl.elem_end - sl.elem_begin));
      }
  };
  if (fp32)
    for (const CheckpointStateFile& f : in.state_files)
      master_ranges(f, f.elem_begin, f.elem_end, &sources.emplace_back(f.name, Ranges{}).second);
  // Tied parameters: each other name a tensor of its own after the others,
  // copied from the ranges already verified (read again, not checksummed).
  std::vector<std::pair<std::string, Ranges>> alias_sources;
  for (size_t id = 0; id < l.params().size(); ++id) {
    const ParamRec& p = l.params()[id];
    for (const std::string& a : p.aliases) {
      RETURN_IF_ERROR(add_tensor(p, a));
      if (p.numel == 0) continue;
      if (!fp32) {
        alias_sources.emplace_back(
            kParamsFile,
            Ranges{{param_file_off[id], param_file_off[id] + p.numel * p.elem_size()}});
        continue;
      }
      for (const CheckpointStateFile& f : in.state_files) {
        const int64_t lo = std::max(f.elem_begin, p.elem_off);
        const int64_t hi = std::min(f.elem_end, p.elem_off + p.numel);
        if (lo < hi) master_ranges(f, lo, hi, &alias_sources.emplace_back(f.name, Ranges{}).second);
      }
    }
  }
  // The header and the file's creation: src/scheduler/safetensors.h. A name
  // the header cannot hold (not UTF-8, "__metadata__") is the checkpoint's.
  StatusOr<SafetensorsWriter> created =
      SafetensorsWriter::Create(out,
                                {{"format", "pt"},
                                 {"strata_checkpoint", in.path},
                                 {"run_id", in.run_id},
                                 {"optimizer_step", std::to_string(in.optimizer_step)},
                                 {"precision", fp32 ? "fp32 masters" : "training dtype"}},
                                tensors);
  if (created.status().code() == StatusCode::kInvalidArgument)
    return DataLossError(fmt::format("checkpoint {}: {}", in.path, created.status().message()));
  ASSIGN_OR_RETURN(SafetensorsWriter f, std::move(created));
  // Room for the whole file before a byte of data is written (tied names
  // make it larger than the checkpoint).
  {
    const fs::path parent = fs::path(out).parent_path();
    const std::string out_dir = parent.empty() ? std::string(".") : parent.string();
    struct statvfs vfs {};
    if (::statvfs(out_dir.c_str(), &vfs) == 0) {
      const auto free_bytes = static_cast<int64_t>(
          std::min<uint64_t>(static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize, INT64_MAX));
      if (f.data_bytes() > free_bytes)
        return ResourceExhaustedError(fmt::format(
            "exporting checkpoint {} to {}: its {} tensors take {} bytes, {} has {} bytes free",
            in.path, out, tensors.size(), f.file_bytes(), out_dir, free_bytes));
    }
  }

  // Each source file, read once in chunks: checksummed whole, the ranges copied.
  ASSIGN_OR_RETURN(AlignedBuffer buf, AlignedBuffer::Allocate(kVerifyChunk, kIoAlign));
  for (const auto& [source, ranges] : sources) {
    const std::string src_path = in.path + "/" + source;
    const std::string& name =
        source;  // Clang 14 (the thread-safety check) cannot capture a binding
    const auto entry = std::find_if(in.files.begin(), in.files.end(),
                                    [&](const CheckpointFileCheck& c) { return c.name == name; });
    ASSIGN_OR_RETURN(File src, File::Open(src_path, O_RDONLY));
    uint32_t crc = 0;
    size_t r = 0;
    for (int64_t pos = 0; pos < entry->bytes;) {
      const int64_t n = std::min<int64_t>(entry->bytes - pos, kVerifyChunk);
      RETURN_IF_ERROR(src.ReadNext(buf.data(), static_cast<size_t>(n)));
      crc = Crc32cExtend(crc, buf.data(), static_cast<size_t>(n));
      for (; r < ranges.size() && ranges[r].first < pos + n; ++r) {
        const int64_t b = std::max(ranges[r].first, pos), e = std::min(ranges[r].second, pos + n);
        if (e > b)
          RETURN_IF_ERROR(f.Append(buf.as<uint8_t>() + (b - pos), static_cast<size_t>(e - b)));
        if (ranges[r].second > pos + n) break;  // continues in the next chunk
      }
      pos += n;
    }
    if (Hex32(crc) != entry->crc32c)
      return DataLossError(
          fmt::format("checkpoint file {}: changed while exporting (crc32c {}, the "
                      "manifest's {})",
                      src_path, Hex32(crc), entry->crc32c));
  }
  for (const auto& [source, ranges] : alias_sources) {
    ASSIGN_OR_RETURN(File src, File::Open(in.path + "/" + source, O_RDONLY));
    for (const auto& [b, e] : ranges)
      for (int64_t pos = b; pos < e;) {
        const auto n = static_cast<size_t>(std::min<int64_t>(e - pos, kVerifyChunk));
        src.Seek(pos);
        RETURN_IF_ERROR(src.ReadNext(buf.data(), n));
        RETURN_IF_ERROR(f.Append(buf.data(), n));
        pos += static_cast<int64_t>(n);
      }
  }
  RETURN_IF_ERROR(f.Commit());
  CheckpointExportResult res;
  res.checkpoint = in.path;
  res.optimizer_step = in.optimizer_step;
  res.tensors = static_cast<int64_t>(tensors.size());
  res.bytes = f.file_bytes();
  return res;
}

}  // namespace

}  // namespace strata::scheduler

namespace strata {

StatusOr<CheckpointExportResult> ExportCheckpoint(const std::string& dir, const std::string& out,
                                                  ExportPrecision precision) {
  return scheduler::Export(dir, out, precision);
}

}  // namespace strata
