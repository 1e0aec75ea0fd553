// strata checkpoint info|export: reads a checkpoint without an engine.
//
//   strata checkpoint info DIR [--json]
//       The step, run id, format version, the config's identity (optimizer,
//       lr, model dtype), the parameters and elements, the files with their
//       sizes and CRC-32C, and whether every file verifies. DIR is a
//       checkpoint root (the newest checkpoint that verifies is shown) or one
//       ckpt-<N> directory. An invalid checkpoint exits with 5 (I/O).
//   strata checkpoint export DIR --out FILE [--dtype fp32|train]
//       The parameters as one safetensors file keyed by the registered names:
//       the fp32 masters (default) or the training-dtype copies.
#include <cstdio>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "apps/strata/commands.h"
#include "apps/strata/exit_codes.h"
#include "src/common/dtype.h"
#include "src/common/private_fs.h"
#include "src/common/units.h"
#include "src/scheduler/checkpoint.h"

namespace strata::cli {
namespace {

using nlohmann::ordered_json;
using scheduler::CheckpointInspection;

// What a resume compares: every config key saved in the manifest but these
// (each with the reason it may differ), and the layout.
ordered_json ResumeComparesJson() {
  ordered_json free = ordered_json::array();
  for (const scheduler::CheckpointFreeKey& k : scheduler::CheckpointFreeKeys())
    free.push_back({{"key", k.key}, {"reason", k.reason}});
  return {{"config", "every key of the saved config except not_compared"},
          {"layout", "every parameter's name, size, dtype and module; the sub-group count"},
          {"not_compared", free}};
}

ordered_json InspectionJson(const CheckpointInspection& in) {
  const scheduler::Layout& l = in.layout;
  ordered_json files = ordered_json::array();
  for (const auto& f : in.files)
    files.push_back({{"name", f.name},
                     {"bytes", f.bytes},
                     {"crc32c", f.crc32c},
                     {"bytes_on_disk", f.actual_bytes},
                     {"ok", f.ok}});
  ordered_json dtypes = ordered_json::object();
  for (const auto& p : l.params()) {
    const std::string d(DTypeName(p.dtype));
    dtypes[d] = dtypes.value(d, 0) + 1;
  }
  return {{"path", in.path},
          {"valid", in.validity.ok()},
          {"error", in.validity.ok() ? "" : std::string(in.validity.message())},
          {"format_version", in.version},
          {"sequence", in.sequence},
          {"run_id", in.run_id},
          {"optimizer_step", in.optimizer_step},
          {"data_position", in.data_position},
          {"note", in.note},
          {"optimizer", {{"type", in.optimizer_type}, {"lr", in.lr}}},
          {"model_dtype", in.model_dtype},
          {"parameters", l.params().size()},
          {"elements", l.param_elems()},
          {"parameter_dtypes", dtypes},
          {"modules", l.num_modules()},
          {"sub_groups", l.num_groups()},
          {"sub_group_size", in.sub_group_size},
          {"config_hash", in.config_hash},
          {"layout_hash", in.layout_hash},
          {"files", files},
          {"skipped", in.skipped},
          {"resume_compares", ResumeComparesJson()}};
}

// A path with a control character is a usage error (as for `strata train`):
// a newline in it would read as two in any line-based record.
bool RefusedPath(const char* cmd, const char* what, const std::string& path) {
  if (!HasControlChar(path)) return false;
  std::fprintf(stderr,
               "strata checkpoint %s: %s: the path holds a control character (a newline, tab, "
               "escape, ...); give a path without one\n",
               cmd, what);
  return true;
}

int RunCheckpointInfo(const std::string& dir, bool as_json) {
  if (RefusedPath("info", "DIR", dir)) return kExitUsage;
  StatusOr<CheckpointInspection> in = scheduler::InspectCheckpoint(dir);
  if (!in.ok()) {
    std::fprintf(stderr, "strata checkpoint info: %s\n", in.status().ToString().c_str());
    return ExitCodeOf(in.status());
  }
  if (as_json) {
    std::cout << InspectionJson(*in).dump(2) << "\n";
  } else {
    const scheduler::Layout& l = in->layout;
    std::cout << "checkpoint      " << in->path << "\n"
              << "valid           "
              << (in->validity.ok() ? "yes (every file's size and CRC-32C match)"
                                    : "NO: " + std::string(in->validity.message()))
              << "\n"
              << "step            " << in->optimizer_step << "\n"
              << "run id          " << in->run_id << "\n"
              << "format version  " << in->version << "\n"
              << "optimizer       " << in->optimizer_type << ", lr " << in->lr << "\n"
              << "model dtype     " << in->model_dtype << "\n"
              << "parameters      " << l.params().size() << " (" << l.param_elems() << " elements, "
              << l.num_modules() << " modules, " << l.num_groups() << " sub-groups)\n"
              << "data position   " << in->data_position << "\n";
    if (!in->note.empty()) std::cout << "note            " << in->note << "\n";
    for (const auto& f : in->files)
      std::cout << "file            " << f.name << ": " << FormatBytes(f.bytes) << " (" << f.bytes
                << " bytes), crc32c " << f.crc32c << (f.ok ? ", ok" : ", NOT OK") << "\n";
    for (const std::string& s : in->skipped) std::cout << "skipped newer   " << s << "\n";
    std::cout << "resume compares every config key and the layout, except:\n";
    for (const scheduler::CheckpointFreeKey& k : scheduler::CheckpointFreeKeys())
      std::cout << "  " << k.key << " (" << k.reason << ")\n";
  }
  if (!in->validity.ok()) {
    std::fprintf(stderr, "strata checkpoint info: %s\n", in->validity.ToString().c_str());
    return ExitCodeOf(in->validity);
  }
  return kExitOk;
}

int RunCheckpointExport(const std::string& dir, const std::string& out, const std::string& dtype,
                        bool as_json) {
  if (RefusedPath("export", "DIR", dir) || RefusedPath("export", "--out", out)) return kExitUsage;
  const auto precision =
      dtype == "train" ? scheduler::ExportPrecision::kTrain : scheduler::ExportPrecision::kFp32;
  StatusOr<scheduler::CheckpointExportResult> r = scheduler::ExportCheckpoint(dir, out, precision);
  if (!r.ok()) {
    std::fprintf(stderr, "strata checkpoint export: %s\n", r.status().ToString().c_str());
    return ExitCodeOf(r.status());
  }
  if (as_json) {
    std::cout << ordered_json{{"checkpoint", r->checkpoint},
                              {"optimizer_step", r->optimizer_step},
                              {"out", out},
                              {"dtype", dtype},
                              {"tensors", r->tensors},
                              {"bytes", r->bytes}}
                     .dump(2)
              << "\n";
  } else {
    std::cout << "wrote " << out << ": " << r->tensors << " tensors (" << dtype << "), "
              << FormatBytes(r->bytes) << ", from " << r->checkpoint << " (step "
              << r->optimizer_step << ")\n";
  }
  return kExitOk;
}

CommandRegistrar reg("", [](CLI::App& app, CliResult& r) {
  auto* ckpt =
      app.add_subcommand("checkpoint", "Inspect or export a checkpoint (no engine needed)");
  ckpt->require_subcommand(1);

  auto* info = ckpt->add_subcommand("info",
                                    "Show a checkpoint's step, run, config identity, "
                                    "files, and whether every file verifies");
  auto info_dir = std::make_shared<std::string>();
  auto info_json = std::make_shared<bool>(false);
  info->add_option("DIR", *info_dir, "A checkpoint root or one ckpt-<N> directory")->required();
  info->add_flag("--json", *info_json, "Machine-readable output (one object)");
  info->callback(
      [&r, info_dir, info_json] { r.exit_code = RunCheckpointInfo(*info_dir, *info_json); });

  auto* exp = ckpt->add_subcommand(
      "export", "Write a checkpoint's parameters as one safetensors file (loads in PyTorch)");
  auto exp_dir = std::make_shared<std::string>();
  auto exp_out = std::make_shared<std::string>();
  auto exp_dtype = std::make_shared<std::string>("fp32");
  auto exp_json = std::make_shared<bool>(false);
  exp->add_option("DIR", *exp_dir, "A checkpoint root or one ckpt-<N> directory")->required();
  exp->add_option("--out", *exp_out, "The safetensors file to write")->required();
  exp->add_option("--dtype", *exp_dtype,
                  "fp32: the fp32 master parameters (default); train: the training-dtype copies")
      ->check(CLI::IsMember({"fp32", "train"}));
  exp->add_flag("--json", *exp_json, "Machine-readable output");
  exp->callback([&r, exp_dir, exp_out, exp_dtype, exp_json] {
    r.exit_code = RunCheckpointExport(*exp_dir, *exp_out, *exp_dtype, *exp_json);
  });
});

}  // namespace
}  // namespace strata::cli
