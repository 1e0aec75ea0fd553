// Strata's config loader: DeepSpeed JSON (as its users write it) plus the
// `strata` section. See include/strata/config.h for the contract and
// docs/design.md ("Config loader") for the rules.
//
// Shape of the code: a small `Section` reader walks one JSON object with its
// key path, type-checks each key it is asked for, marks it read, and at the end
// reports every key nobody asked for as a warning. Type errors are raised while
// reading (they need the JSON value); range and cross-field rules live in
// ValidateConfig so that a hand-edited Config is checked by the same code.
#include "strata/config.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <type_traits>
#include <unordered_set>
#include <utility>

#include "src/common/log.h"
#include "src/common/status_util.h"
#include "src/common/units.h"

namespace strata {
namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

// ---- Small helpers ---------------------------------------------------------

constexpr size_t kMaxShownValueChars = 64;
constexpr int kMaxShownDepth = 8;  // deeper containers print as [...] / {...}

// Appends `v` as compact JSON, stopping soon after `limit` characters and
// below kMaxShownDepth levels: the cost is bounded whatever the value.
void ShowInto(const json& v, size_t limit, int depth, std::string* out) {
  auto quoted = [](std::string_view text) {
    return json(std::string(text)).dump(-1, ' ', false, json::error_handler_t::replace);
  };
  switch (v.type()) {
    case json::value_t::object:
    case json::value_t::array: {
      const bool object = v.is_object();
      if (v.empty()) {
        *out += object ? "{}" : "[]";
        return;
      }
      if (depth >= kMaxShownDepth) {
        *out += object ? "{...}" : "[...]";
        return;
      }
      *out += object ? '{' : '[';
      bool first = true;
      for (auto it = v.begin(); it != v.end() && out->size() <= limit; ++it) {
        if (!first) *out += ',';
        first = false;
        if (object) *out += quoted(it.key().substr(0, limit)) + ":";
        ShowInto(*it, limit, depth + 1, out);
      }
      *out += object ? '}' : ']';
      return;
    }
    case json::value_t::string: {
      const std::string& text = v.get_ref<const std::string&>();
      *out += quoted(std::string_view(text).substr(0, limit));
      return;
    }
    default:  // numbers, booleans, null: a few characters
      *out += v.dump();
  }
}

// A JSON value as written (compact), cut short if long or deep.
std::string Show(const json& v) {
  std::string s;
  ShowInto(v, kMaxShownValueChars, 0, &s);
  if (s.size() > kMaxShownValueChars) s = s.substr(0, kMaxShownValueChars - 3) + "...";
  return s;
}

// A key as it may appear in a message: control characters replaced, cut short.
std::string ShowKey(std::string_view key) {
  constexpr size_t kMaxKeyChars = 48;
  std::string out(key.substr(0, kMaxKeyChars));
  for (char& c : out)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  if (key.size() > kMaxKeyChars) out += "...";
  return out;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

bool IsAuto(const json& v) { return v.is_string() && v.get_ref<const std::string&>() == "auto"; }

// "auto" (the Hugging Face integration's placeholder) and null resolve to the
// default only for the keys that pass Auto::kAllowed.
enum class Auto { kRejected, kAllowed };

Status ValueError(std::string_view path, const json& v, std::string_view what) {
  return InvalidArgumentError(fmt::format("{}: {} {}", path, Show(v), what));
}

// DeepSpeed keys Strata reads nothing from, because they change nothing here
// (one rank, no communication; monitoring; checkpoint formats; memory or
// speed approximations Strata does not make). They get a softer warning than
// a misspelt key ("DeepSpeed key X is not used by Strata") but still a
// warning: the user should know the setting has no effect here. `note`, when
// given, says why.
struct UnusedKey {
  std::string_view path;
  std::string_view note;
};
constexpr UnusedKey kUnusedDeepSpeedKeys[] = {
    {"steps_per_print", ""},
    {"wall_clock_breakdown", ""},
    {"memory_breakdown", ""},
    {"dump_state", ""},
    {"zero_allow_untested_optimizer", ""},
    {"zero_force_ds_cpu_optimizer", ""},
    {"scheduler", ""},
    {"communication_data_type", ""},
    {"seq_parallel_communication_data_type", ""},
    {"prescale_gradients", ""},
    {"gradient_predivide_factor", ""},
    {"sparse_gradients", ""},
    {"sparse_attention", ""},
    {"disable_allgather", ""},
    {"flops_profiler", ""},
    {"tensorboard", ""},
    {"wandb", ""},
    {"csv_monitor", ""},
    {"comet", ""},
    {"comms_logger", ""},
    {"activation_checkpointing", ""},
    {"checkpoint", ""},
    {"data_types", ""},
    {"amp", ""},
    {"torch_autocast", ""},
    {"autotuning", ""},
    {"elasticity", ""},
    {"compression_training", ""},
    {"data_efficiency", ""},
    {"curriculum_learning", ""},
    {"pipeline", ""},
    {"load_universal_checkpoint", ""},
    {"use_node_local_storage", ""},
    {"dataloader_drop_last", "the framework feeds the batches"},
    {"graph_harvesting", ""},
    {"eigenvalue", ""},
    {"progressive_layer_drop", ""},
    {"quantize_training", ""},
    {"weight_quantization", ""},
    {"use_data_before_expert_parallelism", ""},
    {"hybrid_engine", ""},
    {"nebula", ""},
    {"compile", ""},
    {"timers", ""},
    {"tensor_parallel", ""},
    {"zenflow", "Strata updates every parameter at every step"},
    {"allgather_size", "read only with the legacy \"zero_optimization\": true"},
    {"fp16.auto_cast", ""},
    {"fp16.consecutive_hysteresis", ""},
    {"fp16.fp16_master_weights_and_grads", "Strata keeps fp32 master weights and gradients"},
    {"bf16.immediate_grad_update", ""},
    {"bf16.bf16_master_weights_and_grads", "Strata keeps fp32 master weights and gradients"},
    {"bf16.bf16_optimizer_states", "Strata keeps fp32 optimizer states"},
    {"bfloat16.immediate_grad_update", ""},
    {"optimizer.legacy_fusion", ""},
    {"optimizer.params.torch_adam", ""},
    {"optimizer.params.fused", ""},
    {"optimizer.params.foreach", ""},
    {"optimizer.params.capturable", ""},
    {"optimizer.params.differentiable", ""},
    {"optimizer.params.fp32_optimizer_states", "Strata keeps fp32 optimizer states"},
    {"aio.io_backend", "Strata picks its I/O engine with strata.io_engine"},
    {"aio.parallel_write", ""},
    {"zero_optimization.allgather_partitions", ""},
    {"zero_optimization.reduce_scatter", ""},
    {"zero_optimization.use_multi_rank_bucket_allreduce", ""},
    {"zero_optimization.round_robin_gradients", ""},
    {"zero_optimization.elastic_checkpoint", ""},
    {"zero_optimization.ignore_unused_parameters", ""},
    {"zero_optimization.legacy_stage1", ""},
    {"zero_optimization.load_from_fp32_weights", ""},
    {"zero_optimization.stage3_gather_16bit_weights_on_model_save", ""},
    {"zero_optimization.gather_16bit_weights_on_model_save", ""},
    {"zero_optimization.stage3_gather_fp16_weights_on_model_save", ""},
    {"zero_optimization.stage3_model_persistence_threshold", ""},
    {"zero_optimization.model_persistence_threshold", ""},
    {"zero_optimization.stage3_module_granularity_threshold", ""},
    {"zero_optimization.module_granularity_threshold", ""},
    {"zero_optimization.stage3_use_all_reduce_for_fetch_params", ""},
    {"zero_optimization.use_all_reduce_for_fetch_params", ""},
    {"zero_optimization.zero_hpz_partition_size", ""},
    {"zero_optimization.zero_quantized_weights", ""},
    {"zero_optimization.zero_quantized_nontrainable_weights", ""},
    {"zero_optimization.zero_quantized_gradients", ""},
    {"zero_optimization.zeropp_loco_param", ""},
    {"zero_optimization.mics_shard_size", ""},
    {"zero_optimization.mics_hierarchical_params_gather", ""},
    {"zero_optimization.memory_efficient_linear", ""},
    {"zero_optimization.pipeline_loading_checkpoint", ""},
    {"zero_optimization.override_module_apply", ""},
    {"zero_optimization.log_trace_cache_warnings", ""},
    {"zero_optimization.zenflow", "Strata updates every parameter at every step"},
};

const UnusedKey* FindUnusedDeepSpeedKey(std::string_view path) {
  for (const UnusedKey& k : kUnusedDeepSpeedKeys)
    if (k.path == path) return &k;
  return nullptr;
}

// DeepSpeed settings that change nothing here at their neutral value (then
// they are reported like the unused keys above) but would change the
// training at any other value, in a way Strata does not implement: an error.
struct UnsupportedSetting {
  std::string_view path;
  bool (*neutral)(const json&);
  std::string_view neutral_text;  // what to write instead
  std::string_view why;
};
bool IsFalse(const json& v) { return v.is_boolean() && !v.get<bool>(); }
bool IsZero(const json& v) { return v.is_number() && v.get<double>() == 0.0; }
constexpr UnsupportedSetting kUnsupportedSettings[] = {
    {"optimizer.params.amsgrad", IsFalse, "false",
     "AMSGrad (the maximum of past second moments) is not implemented by Strata's CPU optimizer"},
    {"optimizer.params.maximize", IsFalse, "false", "Strata's optimizers minimize"},
    {"optimizer.params.lr_decay", IsZero, "0", "Strata's Adagrad has no learning-rate decay"},
    {"optimizer.params.initial_accumulator_value", IsZero, "0",
     "Strata's Adagrad starts its sum at 0"},
};

// ---- Value readers (type checks only; ranges are ValidateConfig's) ----------

Status ReadInt(const json& v, std::string_view path, int64_t* out) {
  constexpr std::string_view kExpect =
      "is not an integer (expected a whole number such as 8 or 5e8)";
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return ValueError(path, v, "is out of range (at most 9223372036854775807)");
    *out = static_cast<int64_t>(u);
    return Status::Ok();
  }
  if (v.is_number_integer()) {
    *out = v.get<int64_t>();
    return Status::Ok();
  }
  if (v.is_number_float()) {
    double d = v.get<double>();
    if (!std::isfinite(d) || d != std::trunc(d)) return ValueError(path, v, kExpect);
    // [-2^63, 2^63): the doubles that convert to int64 exactly.
    if (d < -9223372036854775808.0 || d >= 9223372036854775808.0)
      return ValueError(path, v, "is out of range (at most 9223372036854775807)");
    *out = static_cast<int64_t>(d);
    return Status::Ok();
  }
  if (IsAuto(v))
    return ValueError(path, v, "is not an integer (\"auto\" is not accepted for this key)");
  return ValueError(path, v, kExpect);
}

Status ReadDouble(const json& v, std::string_view path, double* out) {
  if (v.is_number()) {
    *out = v.get<double>();
    return Status::Ok();
  }
  if (IsAuto(v))
    return ValueError(path, v, "is not a number (\"auto\" is not accepted for this key)");
  return ValueError(path, v, "is not a number (expected a JSON number such as 0.9 or 1e-8)");
}

Status ReadBool(const json& v, std::string_view path, bool* out) {
  if (v.is_boolean()) {
    *out = v.get<bool>();
    return Status::Ok();
  }
  if (IsAuto(v))
    return ValueError(path, v, "is not a boolean (\"auto\" is not accepted for this key)");
  if (v.is_string())
    return ValueError(path, v, "is not a boolean (write true or false without quotes)");
  return ValueError(path, v, "is not a boolean (expected true or false)");
}

Status ReadBytes(const json& v, std::string_view path, int64_t* out) {
  constexpr std::string_view kExpect =
      "is not a byte count (expected a non-negative integer or a string such as \"8G\", "
      "\"512M\", \"64KiB\"; suffixes are binary, K = 1024)";
  if (v.is_number()) {
    if (!ReadInt(v, path, out).ok() || *out < 0) return ValueError(path, v, kExpect);
    return Status::Ok();
  }
  if (v.is_string() && ParseByteSize(v.get_ref<const std::string&>(), out)) return Status::Ok();
  return ValueError(path, v, kExpect);
}

template <typename E>
struct EnumName {
  std::string_view name;
  E value;
};

template <typename E, size_t N>
Status ReadEnum(const json& v, std::string_view path, const EnumName<E> (&names)[N], E* out,
                std::string_view note) {
  std::string allowed;
  for (size_t i = 0; i < N; ++i) allowed += (i ? ", " : "") + std::string(names[i].name);
  std::string tail = note.empty() ? "" : fmt::format(" ({})", note);
  if (!v.is_string())
    return ValueError(path, v, fmt::format("is not a string; expected one of {}{}", allowed, tail));
  std::string lower = Lower(v.get_ref<const std::string&>());
  for (const auto& n : names) {
    if (Lower(n.name) == lower) {
      *out = n.value;
      return Status::Ok();
    }
  }
  return ValueError(path, v, fmt::format("is not one of {}{}", allowed, tail));
}

constexpr EnumName<OffloadDevice> kOffloadDevices[] = {
    {"none", OffloadDevice::kNone}, {"cpu", OffloadDevice::kCpu}, {"nvme", OffloadDevice::kNvme}};
constexpr EnumName<OptimizerType> kOptimizerTypes[] = {{"Adam", OptimizerType::kAdam},
                                                       {"AdamW", OptimizerType::kAdamW},
                                                       {"Adagrad", OptimizerType::kAdagrad},
                                                       {"Lion", OptimizerType::kLion}};
constexpr EnumName<DeviceKind> kDeviceKinds[] = {
    {"auto", DeviceKind::kAuto}, {"cuda", DeviceKind::kCuda}, {"host", DeviceKind::kHost}};
constexpr EnumName<IoEngineKind> kIoEngines[] = {{"auto", IoEngineKind::kAuto},
                                                 {"uring", IoEngineKind::kUring},
                                                 {"posix", IoEngineKind::kPosix}};

// ---- Section: one JSON object, its path, and which keys were read ----------

// What reading produces besides the Config's values.
struct Diagnostics {
  std::vector<std::string>* warnings;
  std::vector<std::string>* notices;
};

class Section {
 public:
  // `auto_is_default`: "auto" for any key means "absent" (DeepSpeed's rule for
  // zero_optimization, its offload sections and aio).
  Section(const json& obj, std::string path, Diagnostics diag, bool auto_is_default = false)
      : obj_(obj), path_(std::move(path)), diag_(diag), auto_is_default_(auto_is_default) {}

  std::string PathOf(std::string_view key) const {
    return path_.empty() ? std::string(key) : fmt::format("{}.{}", path_, key);
  }
  const std::string& path() const { return path_; }
  Diagnostics diag() const { return diag_; }
  void Warn(std::string w) const { diag_.warnings->push_back(std::move(w)); }
  void Notice(std::string n) const { diag_.notices->push_back(std::move(n)); }

  // The value of `key`, marked as read; nullptr when absent (or "auto" in a
  // section where that means absent).
  const json* Take(std::string_view key) {
    const json* v = Peek(key);
    if (v == nullptr) return nullptr;
    read_.insert(std::string(key));
    return auto_is_default_ && IsAuto(*v) ? nullptr : v;
  }
  // The value of `key` without marking it read; nullptr when absent.
  const json* Peek(std::string_view key) const {
    auto it = obj_.find(std::string(key));
    return it == obj_.end() ? nullptr : &*it;
  }
  // True when `key` is present with a value other than "auto"/null.
  bool Given(std::string_view key) const {
    const json* v = Peek(key);
    return v != nullptr && !v->is_null() && !IsAuto(*v);
  }
  // True when `key` is written "auto".
  bool IsAutoKey(std::string_view key) const {
    const json* v = Peek(key);
    return v != nullptr && IsAuto(*v);
  }

  Status Int(std::string_view key, int64_t* out, Auto a = Auto::kRejected) {
    const json* v = TakeValue(key, a);
    return v ? ReadInt(*v, PathOf(key), out) : Status::Ok();
  }
  // For `int` fields: the value must also fit in 32 bits.
  Status Int32(std::string_view key, int* out) {
    int64_t wide = *out;
    RETURN_IF_ERROR(Int(key, &wide));
    if (wide < std::numeric_limits<int>::min() || wide > std::numeric_limits<int>::max())
      return ValueError(PathOf(key), *Peek(key), "is out of range (must fit in 32 bits)");
    *out = static_cast<int>(wide);
    return Status::Ok();
  }
  Status Double(std::string_view key, double* out, Auto a = Auto::kRejected) {
    const json* v = TakeValue(key, a);
    return v ? ReadDouble(*v, PathOf(key), out) : Status::Ok();
  }
  Status Bool(std::string_view key, bool* out, Auto a = Auto::kRejected) {
    const json* v = TakeValue(key, a);
    return v ? ReadBool(*v, PathOf(key), out) : Status::Ok();
  }
  Status Bytes(std::string_view key, int64_t* out) {
    const json* v = Take(key);
    return v ? ReadBytes(*v, PathOf(key), out) : Status::Ok();
  }
  Status String(std::string_view key, std::string* out) {
    const json* v = Take(key);
    if (!v) return Status::Ok();
    if (!v->is_string()) return ValueError(PathOf(key), *v, "is not a string");
    *out = v->get<std::string>();
    return Status::Ok();
  }
  template <typename E, size_t N>
  Status Enum(std::string_view key, const EnumName<E> (&names)[N], E* out,
              std::string_view note = "") {
    const json* v = Take(key);
    return v ? ReadEnum(*v, PathOf(key), names, out, note) : Status::Ok();
  }
  // nvme_path: a string, or a non-empty list of strings. null = absent.
  Status Paths(std::string_view key, std::vector<std::string>* out) {
    const json* v = Take(key);
    if (!v || v->is_null()) return Status::Ok();
    constexpr std::string_view kExpect =
        "(expected a directory as a string, or a non-empty list of directory strings)";
    if (v->is_string()) {
      out->clear();
      if (!v->get_ref<const std::string&>().empty()) out->push_back(v->get<std::string>());
      return Status::Ok();
    }
    if (!v->is_array())
      return ValueError(PathOf(key), *v, fmt::format("is not a path {}", kExpect));
    // An empty list means "no path" (ConfigToJson writes one for a non-nvme
    // device); ValidateConfig rejects it when the device is nvme.
    std::vector<std::string> paths;
    for (size_t i = 0; i < v->size(); ++i) {
      const json& e = (*v)[i];
      if (!e.is_string() || e.get_ref<const std::string&>().empty())
        return ValueError(fmt::format("{}[{}]", PathOf(key), i), e,
                          fmt::format("is not a non-empty string {}", kExpect));
      paths.push_back(e.get<std::string>());
    }
    *out = std::move(paths);
    return Status::Ok();
  }
  // A nested object; `out` stays empty when the key is absent. The child
  // inherits auto_is_default.
  Status Child(std::string_view key, std::optional<Section>* out) {
    const json* v = Take(key);
    if (!v) return Status::Ok();
    if (!v->is_object()) return ValueError(PathOf(key), *v, "is not an object (expected { ... })");
    out->emplace(*v, PathOf(key), diag_, auto_is_default_);
    return Status::Ok();
  }

  // Reads `key` or `alias` (two spellings of one DeepSpeed key) with `read`
  // (a member such as &Section::Int). Either may be written; when both are,
  // they must agree.
  template <typename T, typename... Extra>
  Status Aliased(std::string_view key, std::string_view alias, T* out,
                 Status (Section::*read)(std::string_view, T*, Extra...), Extra... extra) {
    const bool has_key = Given(key), has_alias = Given(alias);
    T a = *out, b = *out;
    RETURN_IF_ERROR((this->*read)(key, &a, extra...));
    RETURN_IF_ERROR((this->*read)(alias, &b, extra...));
    if (has_key && has_alias && !(a == b)) return Conflict(key, alias);
    if (has_key)
      *out = a;
    else if (has_alias)
      *out = b;
    return Status::Ok();
  }
  // For two spellings of a key Strata does not read: they must agree (as
  // JSON values; 1e5 equals 100000).
  Status Agree(std::string_view key, std::string_view alias) const {
    if (Given(key) && Given(alias) && *Peek(key) != *Peek(alias)) return Conflict(key, alias);
    return Status::Ok();
  }
  Status Conflict(std::string_view key, std::string_view alias) const {
    return InvalidArgumentError(fmt::format(
        "{}: {} conflicts with {}: {} ({} and {} are two spellings of one DeepSpeed key; write "
        "one of them)",
        PathOf(key), Show(*Peek(key)), PathOf(alias), Show(*Peek(alias)), key, alias));
  }

  // One warning per key that nobody read; an error for a DeepSpeed setting
  // Strata does not implement (kUnsupportedSettings).
  Status ReportUnread() const {
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      if (read_.count(it.key())) continue;
      std::string path = PathOf(ShowKey(it.key()));
      for (const UnsupportedSetting& u : kUnsupportedSettings) {
        if (u.path != path || u.neutral(*it) || (auto_is_default_ && IsAuto(*it))) continue;
        return InvalidArgumentError(fmt::format(
            "{}: {} is not supported: {}; it would change the training (remove the key or "
            "write {})",
            path, Show(*it), u.why, u.neutral_text));
      }
      const UnusedKey* unused = FindUnusedDeepSpeedKey(path);
      bool unused_here = unused != nullptr;
      for (const UnsupportedSetting& u : kUnsupportedSettings) unused_here |= u.path == path;
      if (!unused_here) {
        Warn(fmt::format("unknown key {} (ignored)", path));
      } else if (unused == nullptr || unused->note.empty()) {
        Warn(fmt::format("DeepSpeed key {} is not used by Strata (ignored)", path));
      } else {
        Warn(fmt::format("DeepSpeed key {} is not used by Strata (ignored; {})", path,
                         unused->note));
      }
    }
    return Status::Ok();
  }

 private:
  // Take(key), but "auto"/null count as absent where allowed.
  const json* TakeValue(std::string_view key, Auto a) {
    const json* v = Take(key);
    if (v && a == Auto::kAllowed && (v->is_null() || IsAuto(*v))) return nullptr;
    return v;
  }

  const json& obj_;
  std::string path_;
  Diagnostics diag_;
  bool auto_is_default_;
  std::set<std::string> read_;
};

// ---- Sections ----------------------------------------------------------------

Status ReadOffloadOptimizer(Section& s, OffloadOptimizerConfig* c) {
  RETURN_IF_ERROR(s.Enum("device", kOffloadDevices, &c->device));
  RETURN_IF_ERROR(s.Paths("nvme_path", &c->nvme_path));
  RETURN_IF_ERROR(s.Bool("pin_memory", &c->pin_memory));
  RETURN_IF_ERROR(s.Int("buffer_count", &c->buffer_count));
  RETURN_IF_ERROR(s.Bool("fast_init", &c->fast_init));
  RETURN_IF_ERROR(s.Double("ratio", &c->ratio));
  RETURN_IF_ERROR(s.Bool("pipeline_read", &c->pipeline_read));
  RETURN_IF_ERROR(s.Bool("pipeline_write", &c->pipeline_write));
  // DeepSpeed's deprecated `pipeline` turns on both directions.
  if (const json* v = s.Take("pipeline")) {
    bool both = false;
    RETURN_IF_ERROR(ReadBool(*v, s.PathOf("pipeline"), &both));
    if (both) c->pipeline_read = c->pipeline_write = true;
  }
  return s.ReportUnread();
}

Status ReadOffloadParam(Section& s, OffloadParamConfig* c) {
  RETURN_IF_ERROR(s.Enum("device", kOffloadDevices, &c->device));
  RETURN_IF_ERROR(s.Paths("nvme_path", &c->nvme_path));
  RETURN_IF_ERROR(s.Bool("pin_memory", &c->pin_memory));
  RETURN_IF_ERROR(s.Int("buffer_count", &c->buffer_count));
  RETURN_IF_ERROR(s.Int("buffer_size", &c->buffer_size));
  RETURN_IF_ERROR(s.Int("max_in_cpu", &c->max_in_cpu));
  return s.ReportUnread();
}

// DeepSpeed's deprecated booleans for an offload section: `names` are its
// spellings (they must agree with each other), and `section` must agree with
// them when given too: true means device "cpu", false device "none".
Status ReadLegacyOffload(Section& s, std::initializer_list<std::string_view> names,
                         std::string_view section, OffloadDevice* device) {
  std::optional<bool> on;
  std::string_view first;
  for (std::string_view name : names) {
    bool value = false;
    if (!s.Given(name)) {
      s.Take(name);  // "auto"/null: nothing to do
      continue;
    }
    RETURN_IF_ERROR(ReadBool(*s.Take(name), s.PathOf(name), &value));
    if (on && *on != value) return s.Conflict(first, name);
    on = value;
    first = name;
  }
  if (!on) return Status::Ok();
  const OffloadDevice legacy = *on ? OffloadDevice::kCpu : OffloadDevice::kNone;
  if (s.Given(section)) {
    if (*device != legacy)
      return InvalidArgumentError(fmt::format(
          "{}: {} conflicts with {}.device: \"{}\" ({} is DeepSpeed's old spelling of {}.device "
          "\"{}\"; write only {})",
          s.PathOf(first), *on, s.PathOf(section), OffloadDeviceName(*device), first, section,
          OffloadDeviceName(legacy), section));
    return Status::Ok();
  }
  *device = legacy;
  s.Notice(fmt::format("{}: {} read as {}.device \"{}\" (DeepSpeed's old spelling)",
                       s.PathOf(first), *on, section, OffloadDeviceName(legacy)));
  return Status::Ok();
}

// Resolves DeepSpeed's 0 ("one tensor per sub-group / bucket") for a size
// Strata cuts from its flat element space; negative values are errors here
// because 0 is allowed in JSON but not in a Config.
Status ResolveZeroMeansOneTensor(Section& s, std::string_view key, std::string_view what,
                                 int64_t* value) {
  if (*value < 0)
    return InvalidArgumentError(
        fmt::format("{}: {} is not allowed; must be >= 0 (0: {})", s.PathOf(key), *value, what));
  if (*value == 0) {
    *value = kZeroMeansOneTensorElems;
    s.Notice(
        fmt::format("{}: 0 ({} in DeepSpeed) resolved to {} elements: Strata cuts them from "
                    "the flat parameter space, not at tensor boundaries",
                    s.PathOf(key), what, kZeroMeansOneTensorElems));
  }
  return Status::Ok();
}

Status ReadZero(Section& s, ZeroConfig* z, bool top_level_aio) {
  RETURN_IF_ERROR(s.Int32("stage", &z->stage));
  std::optional<Section> sub;
  RETURN_IF_ERROR(s.Child("offload_optimizer", &sub));
  if (sub) RETURN_IF_ERROR(ReadOffloadOptimizer(*sub, &z->offload_optimizer));
  sub.reset();
  RETURN_IF_ERROR(s.Child("offload_param", &sub));
  if (sub) RETURN_IF_ERROR(ReadOffloadParam(*sub, &z->offload_param));
  // DeepSpeed's deprecated booleans for CPU offload.
  RETURN_IF_ERROR(
      ReadLegacyOffload(s, {"cpu_offload"}, "offload_optimizer", &z->offload_optimizer.device));
  RETURN_IF_ERROR(ReadLegacyOffload(s, {"cpu_offload_param", "cpu_offload_params"}, "offload_param",
                                    &z->offload_param.device));
  if (s.Given("cpu_offload_use_pin_memory")) {
    bool on = false;
    RETURN_IF_ERROR(ReadBool(*s.Take("cpu_offload_use_pin_memory"),
                             s.PathOf("cpu_offload_use_pin_memory"), &on));
    // It applies to both sections, except where one writes its own pin_memory.
    for (auto [section, pin] : {std::pair{"offload_optimizer", &z->offload_optimizer.pin_memory},
                                std::pair{"offload_param", &z->offload_param.pin_memory}}) {
      const json* sec = s.Peek(section);
      const bool own = sec != nullptr && sec->is_object() && sec->contains("pin_memory") &&
                       !IsAuto(sec->at("pin_memory"));
      if (own && *pin != on)
        return InvalidArgumentError(fmt::format(
            "{}: {} conflicts with {}.pin_memory: {} (cpu_offload_use_pin_memory is DeepSpeed's "
            "old spelling; write only {}.pin_memory)",
            s.PathOf("cpu_offload_use_pin_memory"), on, s.PathOf(section), *pin, section));
      *pin = on;
    }
  } else {
    s.Take("cpu_offload_use_pin_memory");
  }
  RETURN_IF_ERROR(s.Int("sub_group_size", &z->sub_group_size));
  RETURN_IF_ERROR(ResolveZeroMeansOneTensor(s, "sub_group_size", "one parameter per sub-group",
                                            &z->sub_group_size));
  // DeepSpeed accepts each stage3_ key under its short name too.
  RETURN_IF_ERROR(s.Aliased("stage3_prefetch_bucket_size", "prefetch_bucket_size",
                            &z->stage3_prefetch_bucket_size, &Section::Int, Auto::kAllowed));
  RETURN_IF_ERROR(s.Aliased("stage3_param_persistence_threshold", "param_persistence_threshold",
                            &z->stage3_param_persistence_threshold, &Section::Int, Auto::kAllowed));
  RETURN_IF_ERROR(s.Aliased("stage3_max_live_parameters", "max_live_parameters",
                            &z->stage3_max_live_parameters, &Section::Int, Auto::kAllowed));
  RETURN_IF_ERROR(s.Aliased("stage3_max_reuse_distance", "max_reuse_distance",
                            &z->stage3_max_reuse_distance, &Section::Int, Auto::kAllowed));
  // Spellings of keys Strata does not read must agree too.
  RETURN_IF_ERROR(s.Agree("stage3_model_persistence_threshold", "model_persistence_threshold"));
  RETURN_IF_ERROR(
      s.Agree("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"));
  RETURN_IF_ERROR(
      s.Agree("stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"));
  RETURN_IF_ERROR(s.Agree("stage3_gather_fp16_weights_on_model_save",
                          "stage3_gather_16bit_weights_on_model_save"));
  RETURN_IF_ERROR(s.Agree("stage3_module_granularity_threshold", "module_granularity_threshold"));
  RETURN_IF_ERROR(
      s.Agree("stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params"));
  // DeepSpeed: overlap_comm defaults to true for stage 3, false otherwise.
  z->overlap_comm = z->stage == 3;
  RETURN_IF_ERROR(s.Bool("overlap_comm", &z->overlap_comm));
  RETURN_IF_ERROR(s.Bool("contiguous_gradients", &z->contiguous_gradients));
  RETURN_IF_ERROR(s.Int("reduce_bucket_size", &z->reduce_bucket_size, Auto::kAllowed));
  RETURN_IF_ERROR(ResolveZeroMeansOneTensor(
      s, "reduce_bucket_size", "one parameter's gradient per bucket", &z->reduce_bucket_size));
  RETURN_IF_ERROR(s.Int("allgather_bucket_size", &z->allgather_bucket_size, Auto::kAllowed));
  if (s.Peek("aio") != nullptr) {
    s.Take("aio");
    s.Warn(fmt::format(
        "{}: aio belongs at the top level of the config, not inside zero_optimization; ignored "
        "here, {}",
        s.PathOf("aio"),
        top_level_aio ? "the top-level aio section is used"
                      : "so the aio defaults are used (block_size 1048576, queue_depth 8, "
                        "intra_op_parallelism 1, single_submit false, overlap_events true)"));
  }
  // DeepSpeed ignores offload_param below stage 3; so does Strata, saying so.
  // (Its other fields are inert without a device and are kept as written.)
  if (z->stage < 3 && z->offload_param.device != OffloadDevice::kNone) {
    s.Warn(fmt::format(
        "{}: device \"{}\" ignored because zero_optimization.stage is {} (parameter offload "
        "needs stage 3; DeepSpeed ignores it too); the parameters stay on the device",
        s.PathOf("offload_param"), OffloadDeviceName(z->offload_param.device), z->stage));
    z->offload_param.device = OffloadDevice::kNone;
  }
  return s.ReportUnread();
}

Status ReadAio(Section& s, AioConfig* a) {
  RETURN_IF_ERROR(s.Int("block_size", &a->block_size));
  RETURN_IF_ERROR(s.Int("queue_depth", &a->queue_depth));
  // thread_count is DeepSpeed's old name for intra_op_parallelism.
  RETURN_IF_ERROR(s.Aliased("intra_op_parallelism", "thread_count", &a->intra_op_parallelism,
                            &Section::Int, Auto::kRejected));
  if (s.Given("thread_count") && a->intra_op_parallelism <= 0)
    return InvalidArgumentError(
        fmt::format("aio.thread_count: {} is not allowed; must be > 0", a->intra_op_parallelism));
  RETURN_IF_ERROR(s.Bool("single_submit", &a->single_submit));
  RETURN_IF_ERROR(s.Bool("overlap_events", &a->overlap_events));
  RETURN_IF_ERROR(s.Bool("use_gds", &a->use_gds));
  return s.ReportUnread();
}

// A key the frontend may fill when the config writes "auto" (AutoValues):
// the value used, and a notice saying where it came from.
template <typename T>
Status ReadAutoKey(Section& s, std::string_view key, const std::optional<T>& supplied,
                   std::string_view fallback, T* out) {
  if (!s.IsAutoKey(key)) {
    if constexpr (std::is_same_v<T, bool>)
      return s.Bool(key, out, Auto::kAllowed);
    else
      return s.Double(key, out, Auto::kAllowed);
  }
  s.Take(key);
  if (supplied) *out = *supplied;
  s.Notice(fmt::format("{}: \"auto\" resolved to {} ({})", s.PathOf(key), *out,
                       supplied ? "given by the frontend" : fallback));
  return Status::Ok();
}

// Which optimizer.params each type takes (DeepSpeed's CPU optimizers' names).
struct OptimizerParams {
  bool betas, eps, adam;  // adam: adam_w_mode, bias_correction
  std::string_view list;
};
OptimizerParams ParamsOf(OptimizerType t) {
  switch (t) {
    case OptimizerType::kAdagrad:
      return {false, true, false, "lr, eps, weight_decay"};
    case OptimizerType::kLion:
      return {true, false, false, "lr, betas, weight_decay"};
    default:
      return {true, true, true, "lr, betas, eps, weight_decay, adam_w_mode, bias_correction"};
  }
}

Status ReadOptimizer(Section& s, const AutoValues& autos, OptimizerConfig* o) {
  if (s.Given("type")) {
    RETURN_IF_ERROR(s.Enum("type", kOptimizerTypes, &o->type,
                           "Strata's CPU optimizer implements Adam, AdamW, Adagrad and Lion; "
                           "DeepSpeed's Lamb, OneBitAdam, ZeroOneAdam, OneBitLamb, MuAdam, "
                           "MuAdamW and MuSGD are not implemented"));
  } else {
    s.Take("type");
    s.Notice(fmt::format("optimizer.type not given: Strata uses {}", OptimizerTypeName(o->type)));
  }
  // DeepSpeed's CPU optimizers' defaults for the type (DeepSpeedCPUAdagrad:
  // lr 1e-2, eps 1e-10; DeepSpeedCPULion: lr 1e-3, betas (0.9, 0.999)).
  if (o->type == OptimizerType::kAdagrad) {
    o->lr = 1e-2;
    o->eps = 1e-10;
  }
  const OptimizerParams takes = ParamsOf(o->type);
  const std::string default_text =
      fmt::format("Strata's default for {}; no frontend value", OptimizerTypeName(o->type));
  std::optional<Section> params;
  RETURN_IF_ERROR(s.Child("params", &params));
  if (params) {
    Section& p = *params;
    // A param the type does not take: DeepSpeed's optimizer would refuse it.
    for (auto [key, taken] :
         {std::pair{"betas", takes.betas}, std::pair{"eps", takes.eps},
          std::pair{"adam_w_mode", takes.adam}, std::pair{"bias_correction", takes.adam}}) {
      if (taken) continue;
      if (p.Given(key))
        return ValueError(p.PathOf(key), *p.Peek(key),
                          fmt::format("is not a parameter of {} (it takes {})",
                                      OptimizerTypeName(o->type), takes.list));
      p.Take(key);  // "auto"/null: nothing to use
    }
    RETURN_IF_ERROR(ReadAutoKey(p, "lr", autos.lr, default_text, &o->lr));
    if (takes.betas) {
      if (p.Given("betas")) {
        const json& v = *p.Take("betas");
        if (!v.is_array() || v.size() != 2 || !v[0].is_number() || !v[1].is_number())
          return ValueError(p.PathOf("betas"), v,
                            "is not a pair of numbers (expected [beta1, beta2], each in [0, 1))");
        o->beta1 = v[0].get<double>();
        o->beta2 = v[1].get<double>();
      } else if (p.IsAutoKey("betas")) {
        p.Take("betas");
        if (autos.beta1) o->beta1 = *autos.beta1;
        if (autos.beta2) o->beta2 = *autos.beta2;
        p.Notice(fmt::format("{}: \"auto\" resolved to [{}, {}] ({})", p.PathOf("betas"), o->beta1,
                             o->beta2,
                             autos.beta1 || autos.beta2 ? "given by the frontend" : default_text));
      } else {
        p.Take("betas");  // null: the default
      }
    }
    if (takes.eps) RETURN_IF_ERROR(ReadAutoKey(p, "eps", autos.eps, default_text, &o->eps));
    RETURN_IF_ERROR(
        ReadAutoKey(p, "weight_decay", autos.weight_decay, default_text, &o->weight_decay));
    if (takes.adam) {
      RETURN_IF_ERROR(p.Bool("adam_w_mode", &o->adam_w_mode));
      RETURN_IF_ERROR(p.Bool("bias_correction", &o->bias_correction));
    }
    RETURN_IF_ERROR(p.ReportUnread());
  }
  // DeepSpeed: adam_w_mode defaults to true, and type AdamW forces it
  // (engine.py: effective_adam_w_mode = name == "adamw" or adam_w_mode).
  if (o->type == OptimizerType::kAdamW) o->adam_w_mode = true;
  return s.ReportUnread();
}

Status ReadFp16(Section& s, const AutoValues& autos, Fp16Config* f) {
  RETURN_IF_ERROR(ReadAutoKey(s, "enabled", autos.fp16_enabled,
                              "Strata's default; no frontend value", &f->enabled));
  RETURN_IF_ERROR(s.Double("loss_scale", &f->loss_scale));
  RETURN_IF_ERROR(s.Int32("initial_scale_power", &f->initial_scale_power));
  RETURN_IF_ERROR(s.Int("loss_scale_window", &f->loss_scale_window));
  RETURN_IF_ERROR(s.Int32("hysteresis", &f->hysteresis));
  RETURN_IF_ERROR(s.Double("min_loss_scale", &f->min_loss_scale));
  return s.ReportUnread();
}

Status ReadStrata(Section& s, StrataConfig* st) {
  RETURN_IF_ERROR(s.Enum("device", kDeviceKinds, &st->device));
  RETURN_IF_ERROR(s.Int("device_id", &st->device_id));
  RETURN_IF_ERROR(s.Bytes("hbm_budget", &st->hbm_budget_bytes));
  RETURN_IF_ERROR(s.Bytes("pinned_budget", &st->pinned_budget_bytes));
  RETURN_IF_ERROR(s.String("trace_path", &st->trace_path));
  RETURN_IF_ERROR(s.Int("threads", &st->threads));
  RETURN_IF_ERROR(s.Enum("io_engine", kIoEngines, &st->io_engine));
  RETURN_IF_ERROR(s.Bool("io_sqpoll", &st->io_sqpoll));
  RETURN_IF_ERROR(s.Bool("overlap_optimizer", &st->overlap_optimizer));
  RETURN_IF_ERROR(s.Bool("delayed_param_update", &st->delayed_param_update));
  RETURN_IF_ERROR(s.Int("delayed_param_update_warmup", &st->delayed_param_update_warmup));
  std::optional<Section> host;
  RETURN_IF_ERROR(s.Child("host_device", &host));
  if (host) {
    RETURN_IF_ERROR(host->Double("link_gbytes_per_s", &st->host_device.link_gbytes_per_s));
    RETURN_IF_ERROR(host->Double("link_latency_us", &st->host_device.link_latency_us));
    RETURN_IF_ERROR(host->ReportUnread());
  }
  std::optional<Section> model;
  RETURN_IF_ERROR(s.Child("model", &model));
  if (model) {
    RETURN_IF_ERROR(model->Int("layers", &st->model.layers));
    RETURN_IF_ERROR(model->Int("hidden", &st->model.hidden));
    RETURN_IF_ERROR(model->Int("seq_len", &st->model.seq_len));
    RETURN_IF_ERROR(model->Int("vocab", &st->model.vocab));
    RETURN_IF_ERROR(model->Int("seed", &st->model.seed));
    RETURN_IF_ERROR(model->Int("steps", &st->model.steps));
    RETURN_IF_ERROR(model->ReportUnread());
  }
  return s.ReportUnread();
}

// Batch sizes on one rank: train = micro × accumulation. Any two derive the
// third; one alone sets the missing ones as DeepSpeed does (accumulation 1).
Status ResolveBatch(std::optional<int64_t> train, std::optional<int64_t> micro,
                    std::optional<int64_t> gas, Config* c) {
  const std::pair<const char*, const std::optional<int64_t>*> given[] = {
      {"train_batch_size", &train},
      {"train_micro_batch_size_per_gpu", &micro},
      {"gradient_accumulation_steps", &gas}};
  for (const auto& [name, v] : given)
    if (v->has_value() && **v <= 0)
      return InvalidArgumentError(fmt::format("{}: {} is not allowed; must be > 0", name, **v));
  auto product = [](int64_t a, int64_t b, int64_t* out) -> Status {
    if (__builtin_mul_overflow(a, b, out))
      return InvalidArgumentError(fmt::format(
          "train_micro_batch_size_per_gpu {} × gradient_accumulation_steps {} overflows", a, b));
    return Status::Ok();
  };
  if (train && micro && gas) {
    int64_t p = 0;
    RETURN_IF_ERROR(product(*micro, *gas, &p));
    if (p != *train)
      return InvalidArgumentError(fmt::format(
          "train_batch_size: {} is not train_micro_batch_size_per_gpu {} × "
          "gradient_accumulation_steps {} = {} (one rank: train = micro × accumulation)",
          *train, *micro, *gas, p));
  } else if (train && micro) {
    if (*train % *micro != 0)
      return InvalidArgumentError(
          fmt::format("train_batch_size: {} is not a multiple of train_micro_batch_size_per_gpu {}",
                      *train, *micro));
    gas = *train / *micro;
  } else if (train && gas) {
    if (*train % *gas != 0)
      return InvalidArgumentError(
          fmt::format("train_batch_size: {} is not a multiple of gradient_accumulation_steps {}",
                      *train, *gas));
    micro = *train / *gas;
  } else if (micro && gas) {
    int64_t p = 0;
    RETURN_IF_ERROR(product(*micro, *gas, &p));
    train = p;
  } else if (train) {
    micro = *train;
    gas = 1;
  } else if (micro) {
    train = *micro;
    gas = 1;
  } else if (gas) {
    micro = 1;
    train = *gas;
  } else {
    train = micro = gas = 1;
  }
  c->train_batch_size = *train;
  c->train_micro_batch_size_per_gpu = *micro;
  c->gradient_accumulation_steps = *gas;
  return Status::Ok();
}

Status ReadConfig(const json& root, const AutoValues& autos, Config* c) {
  const Diagnostics diag{&c->warnings, &c->notices};
  Section top(root, "", diag);
  // zero_optimization: an object, or DeepSpeed's legacy boolean (true is
  // stage 1 with the top-level allgather_size, false stage 0).
  if (const json* z = top.Peek("zero_optimization"); z != nullptr && z->is_boolean()) {
    top.Take("zero_optimization");
    c->zero_optimization.stage = z->get<bool>() ? 1 : 0;
    top.Notice(fmt::format("zero_optimization: {} read as stage {} (DeepSpeed's legacy form)",
                           z->get<bool>(), c->zero_optimization.stage));
    if (c->zero_optimization.stage == 1)
      RETURN_IF_ERROR(top.Int("allgather_size", &c->zero_optimization.allgather_bucket_size));
  } else if (z != nullptr) {
    if (!z->is_object())
      return ValueError("zero_optimization", *z,
                        "is not an object (expected { ... }, or the legacy true / false)");
    top.Take("zero_optimization");
    Section zs(*z, "zero_optimization", diag, /*auto_is_default=*/true);
    RETURN_IF_ERROR(ReadZero(zs, &c->zero_optimization, top.Given("aio")));
  }
  if (const json* a = top.Take("aio"); a != nullptr && !IsAuto(*a)) {
    if (!a->is_object()) return ValueError("aio", *a, "is not an object (expected { ... })");
    Section as(*a, "aio", diag, /*auto_is_default=*/true);
    RETURN_IF_ERROR(ReadAio(as, &c->aio));
  }
  std::optional<Section> sec;
  RETURN_IF_ERROR(top.Child("optimizer", &sec));
  if (sec) {
    RETURN_IF_ERROR(ReadOptimizer(*sec, autos, &c->optimizer));
  } else {
    const OptimizerConfig& o = c->optimizer;
    top.Notice(fmt::format(
        "no optimizer section: Strata uses {} with lr {}, betas [{}, {}], eps {}, weight_decay {} "
        "(DeepSpeed's defaults)",
        OptimizerTypeName(o.type), o.lr, o.beta1, o.beta2, o.eps, o.weight_decay));
  }
  sec.reset();
  RETURN_IF_ERROR(top.Child("fp16", &sec));
  if (sec) RETURN_IF_ERROR(ReadFp16(*sec, autos, &c->fp16));
  sec.reset();
  // bf16; DeepSpeed's old spelling is "bfloat16".
  if (root.contains("bf16") && root.contains("bfloat16"))
    return InvalidArgumentError(
        "bf16 and bfloat16 are both given (bfloat16 is the old name of bf16; write only bf16)");
  RETURN_IF_ERROR(top.Child(root.contains("bfloat16") ? "bfloat16" : "bf16", &sec));
  if (sec) {
    RETURN_IF_ERROR(ReadAutoKey(*sec, "enabled", autos.bf16_enabled,
                                "Strata's default; no frontend value", &c->bf16_enabled));
    RETURN_IF_ERROR(sec->ReportUnread());
  }
  sec.reset();
  RETURN_IF_ERROR(ReadAutoKey(top, "gradient_clipping", autos.gradient_clipping,
                              "Strata's default: no clipping; no frontend value",
                              &c->gradient_clipping));
  // Batch sizes: "auto" takes the frontend's value, else is derived.
  struct BatchKey {
    const char* key;
    const std::optional<int64_t>& supplied;
    std::optional<int64_t> value;
    bool is_auto;
  } batch[] = {{"train_batch_size", autos.train_batch_size, {}, false},
               {"train_micro_batch_size_per_gpu", autos.train_micro_batch_size_per_gpu, {}, false},
               {"gradient_accumulation_steps", autos.gradient_accumulation_steps, {}, false}};
  for (BatchKey& b : batch) {
    b.is_auto = top.IsAutoKey(b.key);
    const json* v = top.Take(b.key);
    if (b.is_auto) {
      b.value = b.supplied;
    } else if (v != nullptr && !v->is_null()) {
      int64_t n = 0;
      RETURN_IF_ERROR(ReadInt(*v, b.key, &n));
      b.value = n;
    }
  }
  RETURN_IF_ERROR(ResolveBatch(batch[0].value, batch[1].value, batch[2].value, c));
  const int64_t resolved[] = {c->train_batch_size, c->train_micro_batch_size_per_gpu,
                              c->gradient_accumulation_steps};
  for (size_t i = 0; i < std::size(batch); ++i) {
    if (!batch[i].is_auto) continue;
    top.Notice(fmt::format("{}: \"auto\" resolved to {} ({})", batch[i].key, resolved[i],
                           batch[i].supplied ? "given by the frontend"
                                             : "no frontend value; derived on one rank as train = "
                                               "micro x accumulation, 1 where nothing says more"));
  }
  RETURN_IF_ERROR(top.Child("strata", &sec));
  if (sec) RETURN_IF_ERROR(ReadStrata(*sec, &c->strata));
  return top.ReportUnread();
}

// Byte offset (nlohmann counts the characters read, 1-based) → line, column.
std::pair<size_t, size_t> LineColumn(std::string_view text, size_t byte) {
  size_t idx = std::min(byte == 0 ? 0 : byte - 1, text.size());
  size_t line = 1, line_start = 0;
  for (size_t i = 0; i < idx; ++i) {
    if (text[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
  return {line, idx - line_start + 1};
}

// nlohmann's what() is "[json.exception.parse_error.101] parse error at line
// L, column C: <reason>"; keep the reason.
std::string ParseErrorReason(const std::string& what) {
  size_t at = what.find("column ");
  if (at != std::string::npos) {
    size_t colon = what.find(": ", at);
    if (colon != std::string::npos) return what.substr(colon + 2);
  }
  size_t bracket = what.find("] ");
  return bracket == std::string::npos ? what : what.substr(bracket + 2);
}

// Watches nlohmann's parser (its callback sees every event in order) and
// refuses what the DOM would silently accept or what could hurt later:
// a key repeated in one object (nlohmann keeps the last; DeepSpeed refuses
// duplicates) and nesting deeper than kMaxConfigDepth. It throws Refused,
// which ParseConfig catches; nothing escapes the module. Its own state grows
// with the nesting depth (bounded) and the keys of the open objects.
class InputGuard {
 public:
  struct Refused {
    std::string message;
  };

  bool Observe(int /*depth*/, json::parse_event_t event, const json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        CountElement();
        if (frames_.size() >= static_cast<size_t>(kMaxConfigDepth))
          throw Refused{fmt::format(
              "{}: nested deeper than {} levels of objects and arrays (a DeepSpeed config needs "
              "4)",
              Path(), kMaxConfigDepth)};
        frames_.emplace_back().array = event == json::parse_event_t::array_start;
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!frames_.empty()) frames_.pop_back();
        break;
      case json::parse_event_t::key: {
        Frame& f = frames_.back();
        f.key = parsed.get<std::string>();
        if (!f.keys.insert(f.key).second)
          throw Refused{fmt::format(
              "{}: duplicate key (a key may appear once in an object; DeepSpeed refuses "
              "duplicates too)",
              Path())};
        break;
      }
      case json::parse_event_t::value:
        CountElement();
        break;
    }
    return true;
  }

 private:
  struct Frame {
    bool array = false;
    size_t elements = 0;                   // arrays: elements begun so far
    std::string key;                       // objects: the key being read
    std::unordered_set<std::string> keys;  // objects: keys seen
  };

  void CountElement() {
    if (!frames_.empty() && frames_.back().array) ++frames_.back().elements;
  }

  // The key path of the current position ("<top level>" before any key),
  // cut short when long.
  std::string Path() const {
    constexpr size_t kMaxPathChars = 100;
    std::string path;
    for (const Frame& f : frames_) {
      if (path.size() > kMaxPathChars) {
        path += "...";
        break;
      }
      if (f.array) {
        path += fmt::format("[{}]", f.elements == 0 ? 0 : f.elements - 1);
      } else if (!f.key.empty() || !f.keys.empty()) {
        if (!path.empty()) path += '.';
        path += ShowKey(f.key);
      }
    }
    return path.empty() ? "<top level>" : path;
  }

  std::vector<Frame> frames_;
};

// ---- Validation helpers ----------------------------------------------------

class Checker {
 public:
  template <typename T>
  void Positive(std::string_view path, T v) {
    if (!(v > 0)) Fail(path, fmt::format("{}", v), "must be > 0");
  }
  template <typename T>
  void NonNegative(std::string_view path, T v) {
    if (!(v >= 0)) Fail(path, fmt::format("{}", v), "must be >= 0");
  }
  void Fail(std::string_view path, std::string_view value, std::string_view rule) {
    if (first_.ok())
      first_ = InvalidArgumentError(fmt::format("{}: {} is not allowed; {}", path, value, rule));
  }
  void Fail(std::string message) {
    if (first_.ok()) first_ = InvalidArgumentError(std::move(message));
  }
  Status status() const { return first_; }

 private:
  Status first_;
};

void CheckOffloadCommon(Checker& k, std::string_view section, OffloadDevice device,
                        const std::vector<std::string>& nvme_path, int stage, int min_stage) {
  if (device == OffloadDevice::kNvme && nvme_path.empty())
    k.Fail(fmt::format(
        "zero_optimization.{}.nvme_path: required (a directory, or a list of directories) when "
        "zero_optimization.{}.device is \"nvme\"",
        section, section));
  for (size_t i = 0; i < nvme_path.size(); ++i)
    if (nvme_path[i].empty())
      k.Fail(fmt::format("zero_optimization.{}.nvme_path[{}]", section, i), "\"\"",
             "must be a non-empty path");
  if (device != OffloadDevice::kNone && stage < min_stage)
    k.Fail(
        fmt::format("zero_optimization.{}.device: \"{}\" requires zero_optimization.stage {} "
                    "(stage is {})",
                    section, OffloadDeviceName(device), min_stage == 3 ? "3" : ">= 1", stage));
}

// DeepSpeed allows buffer_count 0 (ge=0); with an nvme device its swapper
// then has no buffer and stops at the first step ("ran out of swap buffers").
void CheckBufferCount(Checker& k, std::string_view section, OffloadDevice device, int64_t count) {
  const std::string path = fmt::format("zero_optimization.{}.buffer_count", section);
  if (count < 0) k.Fail(path, fmt::format("{}", count), "must be >= 0");
  if (count == 0 && device == OffloadDevice::kNvme)
    k.Fail(path, "0",
           fmt::format("must be >= 1 when zero_optimization.{}.device is \"nvme\" (the NVMe "
                       "pipeline needs a buffer; DeepSpeed would stop at its first step)",
                       section));
}

template <typename Enum, size_t N>
std::string_view NameOf(const EnumName<Enum> (&names)[N], Enum value) {
  for (const auto& n : names)
    if (n.value == value) return n.name;
  return "?";
}

}  // namespace

// ---- Public API -------------------------------------------------------------

std::string_view OffloadDeviceName(OffloadDevice d) { return NameOf(kOffloadDevices, d); }
std::string_view OptimizerTypeName(OptimizerType t) { return NameOf(kOptimizerTypes, t); }
std::string_view DeviceKindName(DeviceKind k) { return NameOf(kDeviceKinds, k); }
std::string_view IoEngineKindName(IoEngineKind k) { return NameOf(kIoEngines, k); }

bool operator==(const Config& a, const Config& b) {
  return a.zero_optimization == b.zero_optimization && a.aio == b.aio &&
         a.optimizer == b.optimizer && a.fp16 == b.fp16 && a.bf16_enabled == b.bf16_enabled &&
         a.gradient_clipping == b.gradient_clipping && a.train_batch_size == b.train_batch_size &&
         a.train_micro_batch_size_per_gpu == b.train_micro_batch_size_per_gpu &&
         a.gradient_accumulation_steps == b.gradient_accumulation_steps && a.strata == b.strata;
}

Status ValidateConfig(const Config& c) {
  Checker k;
  const ZeroConfig& z = c.zero_optimization;
  if (z.stage < 0 || z.stage > 3)
    k.Fail("zero_optimization.stage", fmt::format("{}", z.stage), "must be one of 0, 1, 2, 3");
  const OffloadOptimizerConfig& oo = z.offload_optimizer;
  CheckOffloadCommon(k, "offload_optimizer", oo.device, oo.nvme_path, z.stage, 1);
  CheckBufferCount(k, "offload_optimizer", oo.device, oo.buffer_count);
  if (!(oo.ratio > 0.0 && oo.ratio <= 1.0))
    k.Fail("zero_optimization.offload_optimizer.ratio", fmt::format("{}", oo.ratio),
           "must be in (0, 1]");
  const OffloadParamConfig& op = z.offload_param;
  CheckOffloadCommon(k, "offload_param", op.device, op.nvme_path, z.stage, 3);
  CheckBufferCount(k, "offload_param", op.device, op.buffer_count);
  // DeepSpeed allows 0 for these (ge=0); see config.h for what 0 means.
  k.NonNegative("zero_optimization.offload_param.buffer_size", op.buffer_size);
  k.NonNegative("zero_optimization.offload_param.max_in_cpu", op.max_in_cpu);
  // The parser resolves 0 (kZeroMeansOneTensorElems); a Config carries >= 1.
  k.Positive("zero_optimization.sub_group_size", z.sub_group_size);
  k.NonNegative("zero_optimization.stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size);
  k.NonNegative("zero_optimization.stage3_param_persistence_threshold",
                z.stage3_param_persistence_threshold);
  k.NonNegative("zero_optimization.stage3_max_live_parameters", z.stage3_max_live_parameters);
  k.NonNegative("zero_optimization.stage3_max_reuse_distance", z.stage3_max_reuse_distance);
  k.Positive("zero_optimization.reduce_bucket_size", z.reduce_bucket_size);
  k.NonNegative("zero_optimization.allgather_bucket_size", z.allgather_bucket_size);

  k.Positive("aio.block_size", c.aio.block_size);
  if (c.aio.block_size > 0 && c.aio.block_size % 512 != 0)
    k.Fail("aio.block_size", fmt::format("{}", c.aio.block_size), "must be a multiple of 512");
  k.Positive("aio.queue_depth", c.aio.queue_depth);
  k.Positive("aio.intra_op_parallelism", c.aio.intra_op_parallelism);

  const OptimizerConfig& o = c.optimizer;
  k.NonNegative("optimizer.params.lr", o.lr);
  if (!(o.beta1 >= 0.0 && o.beta1 < 1.0))
    k.Fail("optimizer.params.betas[0]", fmt::format("{}", o.beta1), "must be in [0, 1)");
  if (!(o.beta2 >= 0.0 && o.beta2 < 1.0))
    k.Fail("optimizer.params.betas[1]", fmt::format("{}", o.beta2), "must be in [0, 1)");
  k.Positive("optimizer.params.eps", o.eps);
  k.NonNegative("optimizer.params.weight_decay", o.weight_decay);

  const Fp16Config& f = c.fp16;
  k.NonNegative("fp16.loss_scale", f.loss_scale);  // 0 = dynamic
  if (f.initial_scale_power < 0 || f.initial_scale_power > 64)
    k.Fail("fp16.initial_scale_power", fmt::format("{}", f.initial_scale_power),
           "must be in [0, 64]");
  k.Positive("fp16.loss_scale_window", f.loss_scale_window);
  if (f.hysteresis < 1) k.Fail("fp16.hysteresis", fmt::format("{}", f.hysteresis), "must be >= 1");
  k.Positive("fp16.min_loss_scale", f.min_loss_scale);
  if (f.enabled && c.bf16_enabled)
    k.Fail("fp16.enabled and bf16.enabled are both true; enable at most one");
  k.NonNegative("gradient_clipping", c.gradient_clipping);

  k.Positive("train_batch_size", c.train_batch_size);
  k.Positive("train_micro_batch_size_per_gpu", c.train_micro_batch_size_per_gpu);
  k.Positive("gradient_accumulation_steps", c.gradient_accumulation_steps);
  int64_t product = 0;
  if (c.train_micro_batch_size_per_gpu > 0 && c.gradient_accumulation_steps > 0 &&
      (__builtin_mul_overflow(c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps,
                              &product) ||
       product != c.train_batch_size))
    k.Fail(fmt::format(
        "train_batch_size: {} is not train_micro_batch_size_per_gpu {} × "
        "gradient_accumulation_steps {} "
        "(one rank: train = micro × accumulation)",
        c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps));

  const StrataConfig& s = c.strata;
  k.NonNegative("strata.device_id", s.device_id);
  k.NonNegative("strata.hbm_budget", s.hbm_budget_bytes);
  k.NonNegative("strata.pinned_budget", s.pinned_budget_bytes);
  k.NonNegative("strata.threads", s.threads);
  k.NonNegative("strata.delayed_param_update_warmup", s.delayed_param_update_warmup);
  k.NonNegative("strata.host_device.link_gbytes_per_s", s.host_device.link_gbytes_per_s);
  k.NonNegative("strata.host_device.link_latency_us", s.host_device.link_latency_us);
  const ModelConfig& m = s.model;
  k.Positive("strata.model.layers", m.layers);
  if (m.hidden < 8) k.Fail("strata.model.hidden", fmt::format("{}", m.hidden), "must be >= 8");
  if (m.seq_len < 2) k.Fail("strata.model.seq_len", fmt::format("{}", m.seq_len), "must be >= 2");
  if (m.vocab != 256)
    k.Fail("strata.model.vocab", fmt::format("{}", m.vocab),
           "must be 256 (the example model is byte-level)");
  k.NonNegative("strata.model.seed", m.seed);
  k.NonNegative("strata.model.steps", m.steps);
  return k.status();
}

StatusOr<Config> ParseConfig(std::string_view json_text, std::string_view source) {
  return ParseConfig(json_text, source, AutoValues{});
}

StatusOr<Config> ParseConfig(std::string_view json_text, std::string_view source,
                             const AutoValues& auto_values) {
  const bool named = source != "<string>";
  auto with_source = [&](Status s) { return named ? s.WithContext(source) : s; };
  if (json_text.size() > kMaxConfigBytes)
    return with_source(InvalidArgumentError(fmt::format(
        "the config is {} bytes; at most {} ({} MiB) are accepted (a DeepSpeed config is a few KB)",
        json_text.size(), kMaxConfigBytes, kMaxConfigBytes >> 20)));
  json root;
  InputGuard guard;
  try {
    root = json::parse(json_text.begin(), json_text.end(),
                       [&guard](int depth, json::parse_event_t event, json& parsed) {
                         return guard.Observe(depth, event, parsed);
                       });
  } catch (const InputGuard::Refused& e) {
    return with_source(InvalidArgumentError(e.message));
  } catch (const json::parse_error& e) {
    auto [line, column] = LineColumn(json_text, e.byte);
    return InvalidArgumentError(fmt::format("{}:{}:{}: malformed JSON: {}", source, line, column,
                                            ParseErrorReason(e.what())));
  } catch (const json::exception& e) {  // nothing else is expected; never let it escape
    return InvalidArgumentError(fmt::format("{}: malformed JSON: {}", source, e.what()));
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(
        fmt::format("{}: out of memory while parsing the config", source));
  }
  if (!root.is_object())
    return with_source(InvalidArgumentError(fmt::format(
        "the top level is {} {}, expected a JSON object {{ ... }}", root.type_name(), Show(root))));
  Config config;
  Status s;
  try {
    s = ReadConfig(root, auto_values, &config);
  } catch (const json::exception& e) {  // a reader bug, not the user's; keep it inside
    s = InternalError(fmt::format("reading config: {}", e.what()));
  }
  if (s.ok()) s = ValidateConfig(config);
  if (!s.ok()) return with_source(std::move(s));
  for (const std::string& w : config.warnings) STRATA_LOG_WARN("{}: {}", source, w);
  for (const std::string& n : config.notices) STRATA_LOG_INFO("{}: {}", source, n);
  return config;
}

StatusOr<Config> LoadConfigFile(const std::string& path) {
  return LoadConfigFile(path, AutoValues{});
}

StatusOr<Config> LoadConfigFile(const std::string& path, const AutoValues& auto_values) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    int err = errno;
    if (err == ENOENT || err == ENOTDIR)
      return NotFoundError(fmt::format("config file {} does not exist", path));
    return ErrnoError(fmt::format("config file {}", path), err);
  }
  if (S_ISDIR(st.st_mode))
    return IOError(fmt::format("config file {} is a directory, not a file", path));
  std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!file) {
    int err = errno;
    Status s = ErrnoError(fmt::format("cannot open config file {}", path), err);
    return s.code() == StatusCode::kNotFound ? s : IOError(std::string(s.message()));
  }
  // Read at most one byte past the limit (the size of a pipe or /proc file is
  // unknown in advance); ParseConfig refuses the oversized text.
  std::string text;
  char buf[1 << 16];
  size_t n = 0;
  while (text.size() <= kMaxConfigBytes && (n = std::fread(buf, 1, sizeof(buf), file.get())) > 0)
    text.append(buf, n);
  if (std::ferror(file.get())) {
    int err = errno;
    return IOError(
        std::string(ErrnoError(fmt::format("cannot read config file {}", path), err).message()));
  }
  return ParseConfig(text, path, auto_values);
}

std::string ConfigToJson(const Config& c, int indent) {
  auto paths = [](const std::vector<std::string>& p) {
    ojson list = ojson::array();
    for (const auto& s : p) list.push_back(s);
    return list;
  };
  const ZeroConfig& z = c.zero_optimization;
  const OffloadOptimizerConfig& oo = z.offload_optimizer;
  const OffloadParamConfig& op = z.offload_param;
  ojson j;
  j["train_batch_size"] = c.train_batch_size;
  j["train_micro_batch_size_per_gpu"] = c.train_micro_batch_size_per_gpu;
  j["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  j["gradient_clipping"] = c.gradient_clipping;
  ojson& zj = j["zero_optimization"];
  zj["stage"] = z.stage;
  zj["offload_optimizer"] = ojson{{"device", OffloadDeviceName(oo.device)},
                                  {"nvme_path", paths(oo.nvme_path)},
                                  {"pin_memory", oo.pin_memory},
                                  {"buffer_count", oo.buffer_count},
                                  {"fast_init", oo.fast_init},
                                  {"ratio", oo.ratio},
                                  {"pipeline_read", oo.pipeline_read},
                                  {"pipeline_write", oo.pipeline_write}};
  zj["offload_param"] = ojson{{"device", OffloadDeviceName(op.device)},
                              {"nvme_path", paths(op.nvme_path)},
                              {"pin_memory", op.pin_memory},
                              {"buffer_count", op.buffer_count},
                              {"buffer_size", op.buffer_size},
                              {"max_in_cpu", op.max_in_cpu}};
  zj["sub_group_size"] = z.sub_group_size;
  zj["stage3_prefetch_bucket_size"] = z.stage3_prefetch_bucket_size;
  zj["stage3_param_persistence_threshold"] = z.stage3_param_persistence_threshold;
  zj["stage3_max_live_parameters"] = z.stage3_max_live_parameters;
  zj["stage3_max_reuse_distance"] = z.stage3_max_reuse_distance;
  zj["overlap_comm"] = z.overlap_comm;
  zj["contiguous_gradients"] = z.contiguous_gradients;
  zj["reduce_bucket_size"] = z.reduce_bucket_size;
  zj["allgather_bucket_size"] = z.allgather_bucket_size;
  j["aio"] = ojson{{"block_size", c.aio.block_size},
                   {"queue_depth", c.aio.queue_depth},
                   {"intra_op_parallelism", c.aio.intra_op_parallelism},
                   {"single_submit", c.aio.single_submit},
                   {"overlap_events", c.aio.overlap_events},
                   {"use_gds", c.aio.use_gds}};
  // The params the type takes (another type's params would be refused).
  const OptimizerConfig& o = c.optimizer;
  const OptimizerParams takes = ParamsOf(o.type);
  ojson params{{"lr", o.lr}};
  if (takes.betas) params["betas"] = ojson::array({o.beta1, o.beta2});
  if (takes.eps) params["eps"] = o.eps;
  params["weight_decay"] = o.weight_decay;
  if (takes.adam) {
    params["adam_w_mode"] = o.adam_w_mode;
    params["bias_correction"] = o.bias_correction;
  }
  j["optimizer"] = ojson{{"type", OptimizerTypeName(o.type)}, {"params", std::move(params)}};
  const Fp16Config& f = c.fp16;
  j["fp16"] = ojson{{"enabled", f.enabled},
                    {"loss_scale", f.loss_scale},
                    {"initial_scale_power", f.initial_scale_power},
                    {"loss_scale_window", f.loss_scale_window},
                    {"hysteresis", f.hysteresis},
                    {"min_loss_scale", f.min_loss_scale}};
  j["bf16"] = ojson{{"enabled", c.bf16_enabled}};
  const StrataConfig& s = c.strata;
  j["strata"] = ojson{{"device", DeviceKindName(s.device)},
                      {"device_id", s.device_id},
                      {"hbm_budget", s.hbm_budget_bytes},
                      {"pinned_budget", s.pinned_budget_bytes},
                      {"trace_path", s.trace_path},
                      {"threads", s.threads},
                      {"io_engine", IoEngineKindName(s.io_engine)},
                      {"io_sqpoll", s.io_sqpoll},
                      {"overlap_optimizer", s.overlap_optimizer},
                      {"delayed_param_update", s.delayed_param_update},
                      {"delayed_param_update_warmup", s.delayed_param_update_warmup},
                      {"host_device", ojson{{"link_gbytes_per_s", s.host_device.link_gbytes_per_s},
                                            {"link_latency_us", s.host_device.link_latency_us}}},
                      {"model", ojson{{"layers", s.model.layers},
                                      {"hidden", s.model.hidden},
                                      {"seq_len", s.model.seq_len},
                                      {"vocab", s.model.vocab},
                                      {"seed", s.model.seed},
                                      {"steps", s.model.steps}}}};
  // Strings a caller put into the Config by hand may be invalid UTF-8: they
  // are written with U+FFFD instead of throwing.
  return j.dump(indent, ' ', false, ojson::error_handler_t::replace);
}

}  // namespace strata
