// Strata's config loader: DeepSpeed JSON (as its users write it) plus the
// `strata` section. See include/strata/config.h for the contract and
// docs/parts/config-design.md for the rules.
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
#include <utility>

#include "src/common/log.h"
#include "src/common/units.h"
#include "src/common/status_util.h"

namespace strata {
namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

// ---- Small helpers ---------------------------------------------------------

constexpr size_t kMaxShownValueChars = 64;

// A JSON value as written (dumped), cut short if long.
std::string Show(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > kMaxShownValueChars) s = s.substr(0, kMaxShownValueChars - 3) + "...";
  return s;
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

// DeepSpeed keys Strata reads nothing from. They get a softer warning than a
// misspelt key ("DeepSpeed key X is not used by Strata") but still a warning:
// the user should know the setting has no effect here.
constexpr std::string_view kUnusedDeepSpeedKeys[] = {
    "steps_per_print",
    "wall_clock_breakdown",
    "memory_breakdown",
    "dump_state",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "scheduler",
    "communication_data_type",
    "seq_parallel_communication_data_type",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "sparse_attention",
    "disable_allgather",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "activation_checkpointing",
    "checkpoint",
    "data_types",
    "amp",
    "torch_autocast",
    "autotuning",
    "elasticity",
    "compression_training",
    "data_efficiency",
    "curriculum_learning",
    "pipeline",
    "load_universal_checkpoint",
    "use_node_local_storage",
    "fp16.auto_cast",
    "fp16.consecutive_hysteresis",
    "fp16.fp16_master_weights_and_grads",
    "bf16.immediate_grad_update",
    "optimizer.params.torch_adam",
    "zero_optimization.allgather_partitions",
    "zero_optimization.reduce_scatter",
    "zero_optimization.round_robin_gradients",
    "zero_optimization.elastic_checkpoint",
    "zero_optimization.ignore_unused_parameters",
    "zero_optimization.legacy_stage1",
    "zero_optimization.load_from_fp32_weights",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save",
    "zero_optimization.zero_hpz_partition_size",
    "zero_optimization.zero_quantized_weights",
    "zero_optimization.zero_quantized_gradients",
    "zero_optimization.mics_shard_size",
    "zero_optimization.mics_hierarchical_params_gather",
    "zero_optimization.memory_efficient_linear",
    "zero_optimization.pipeline_loading_checkpoint",
    "zero_optimization.override_module_apply",
};

bool IsUnusedDeepSpeedKey(std::string_view path) {
  return std::find(std::begin(kUnusedDeepSpeedKeys), std::end(kUnusedDeepSpeedKeys), path) !=
         std::end(kUnusedDeepSpeedKeys);
}

// ---- Value readers (type checks only; ranges are ValidateConfig's) ----------

Status ReadInt(const json& v, std::string_view path, int64_t* out) {
  constexpr std::string_view kExpect = "is not an integer (expected a whole number such as 8 or 5e8)";
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
  if (IsAuto(v)) return ValueError(path, v, "is not a number (\"auto\" is not accepted for this key)");
  return ValueError(path, v, "is not a number (expected a JSON number such as 0.9 or 1e-8)");
}

Status ReadBool(const json& v, std::string_view path, bool* out) {
  if (v.is_boolean()) {
    *out = v.get<bool>();
    return Status::Ok();
  }
  if (IsAuto(v)) return ValueError(path, v, "is not a boolean (\"auto\" is not accepted for this key)");
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
                                                       {"AdamW", OptimizerType::kAdamW}};
constexpr EnumName<DeviceKind> kDeviceKinds[] = {
    {"auto", DeviceKind::kAuto}, {"cuda", DeviceKind::kCuda}, {"host", DeviceKind::kHost}};
constexpr EnumName<IoEngineKind> kIoEngines[] = {
    {"auto", IoEngineKind::kAuto}, {"uring", IoEngineKind::kUring}, {"posix", IoEngineKind::kPosix}};

// ---- Section: one JSON object, its path, and which keys were read ----------

class Section {
 public:
  Section(const json& obj, std::string path, std::vector<std::string>* warnings)
      : obj_(obj), path_(std::move(path)), warnings_(warnings) {}

  std::string PathOf(std::string_view key) const {
    return path_.empty() ? std::string(key) : fmt::format("{}.{}", path_, key);
  }

  // The value of `key`, marked as read; nullptr when absent.
  const json* Take(std::string_view key) {
    auto it = obj_.find(std::string(key));
    if (it == obj_.end()) return nullptr;
    read_.insert(std::string(key));
    return &*it;
  }
  // True when `key` is present with a value other than "auto"/null.
  bool Given(std::string_view key) const {
    auto it = obj_.find(std::string(key));
    return it != obj_.end() && !it->is_null() && !IsAuto(*it);
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
      return ValueError(PathOf(key), *obj_.find(std::string(key)), "is out of range (must fit in 32 bits)");
    *out = static_cast<int>(wide);
    return Status::Ok();
  }
  Status OptionalInt(std::string_view key, std::optional<int64_t>* out) {
    const json* v = TakeValue(key, Auto::kAllowed);
    if (!v) return Status::Ok();
    int64_t value = 0;
    RETURN_IF_ERROR(ReadInt(*v, PathOf(key), &value));
    *out = value;
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
    if (!v->is_array()) return ValueError(PathOf(key), *v, fmt::format("is not a path {}", kExpect));
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
  // A nested object; `out` stays empty when the key is absent.
  Status Child(std::string_view key, std::optional<Section>* out) {
    const json* v = Take(key);
    if (!v) return Status::Ok();
    if (!v->is_object()) return ValueError(PathOf(key), *v, "is not an object (expected { ... })");
    out->emplace(*v, PathOf(key), warnings_);
    return Status::Ok();
  }

  // One warning per key that nobody read.
  void ReportUnread() const {
    for (const auto& [key, value] : obj_.items()) {
      if (read_.count(key)) continue;
      std::string path = PathOf(key);
      warnings_->push_back(IsUnusedDeepSpeedKey(path)
                               ? fmt::format("DeepSpeed key {} is not used by Strata (ignored)", path)
                               : fmt::format("unknown key {} (ignored)", path));
    }
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
  std::vector<std::string>* warnings_;
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
  s.ReportUnread();
  return Status::Ok();
}

Status ReadOffloadParam(Section& s, OffloadParamConfig* c) {
  RETURN_IF_ERROR(s.Enum("device", kOffloadDevices, &c->device));
  RETURN_IF_ERROR(s.Paths("nvme_path", &c->nvme_path));
  RETURN_IF_ERROR(s.Bool("pin_memory", &c->pin_memory));
  RETURN_IF_ERROR(s.Int("buffer_count", &c->buffer_count));
  RETURN_IF_ERROR(s.Int("buffer_size", &c->buffer_size));
  RETURN_IF_ERROR(s.Int("max_in_cpu", &c->max_in_cpu));
  s.ReportUnread();
  return Status::Ok();
}

Status ReadZero(Section& s, ZeroConfig* z) {
  RETURN_IF_ERROR(s.Int32("stage", &z->stage));
  std::optional<Section> sub;
  RETURN_IF_ERROR(s.Child("offload_optimizer", &sub));
  if (sub) RETURN_IF_ERROR(ReadOffloadOptimizer(*sub, &z->offload_optimizer));
  sub.reset();
  RETURN_IF_ERROR(s.Child("offload_param", &sub));
  if (sub) RETURN_IF_ERROR(ReadOffloadParam(*sub, &z->offload_param));
  // DeepSpeed's deprecated booleans for CPU offload, honoured when the new
  // sections are absent.
  if (const json* v = s.Take("cpu_offload")) {
    bool on = false;
    RETURN_IF_ERROR(ReadBool(*v, s.PathOf("cpu_offload"), &on));
    if (on && !s.Given("offload_optimizer")) z->offload_optimizer.device = OffloadDevice::kCpu;
  }
  if (const json* v = s.Take("cpu_offload_params")) {
    bool on = false;
    RETURN_IF_ERROR(ReadBool(*v, s.PathOf("cpu_offload_params"), &on));
    if (on && !s.Given("offload_param")) z->offload_param.device = OffloadDevice::kCpu;
  }
  if (const json* v = s.Take("cpu_offload_use_pin_memory")) {
    bool on = false;
    RETURN_IF_ERROR(ReadBool(*v, s.PathOf("cpu_offload_use_pin_memory"), &on));
    if (!s.Given("offload_optimizer")) z->offload_optimizer.pin_memory = on;
    if (!s.Given("offload_param")) z->offload_param.pin_memory = on;
  }
  RETURN_IF_ERROR(s.Int("sub_group_size", &z->sub_group_size, Auto::kAllowed));
  RETURN_IF_ERROR(s.Int("stage3_prefetch_bucket_size", &z->stage3_prefetch_bucket_size, Auto::kAllowed));
  RETURN_IF_ERROR(s.Int("stage3_param_persistence_threshold", &z->stage3_param_persistence_threshold,
                        Auto::kAllowed));
  RETURN_IF_ERROR(s.Int("stage3_max_live_parameters", &z->stage3_max_live_parameters));
  RETURN_IF_ERROR(s.Int("stage3_max_reuse_distance", &z->stage3_max_reuse_distance));
  // DeepSpeed: overlap_comm defaults to true for stage 3, false otherwise.
  z->overlap_comm = z->stage == 3;
  RETURN_IF_ERROR(s.Bool("overlap_comm", &z->overlap_comm));
  RETURN_IF_ERROR(s.Bool("contiguous_gradients", &z->contiguous_gradients));
  RETURN_IF_ERROR(s.Int("reduce_bucket_size", &z->reduce_bucket_size, Auto::kAllowed));
  RETURN_IF_ERROR(s.Int("allgather_bucket_size", &z->allgather_bucket_size, Auto::kAllowed));
  s.ReportUnread();
  return Status::Ok();
}

Status ReadAio(Section& s, AioConfig* a) {
  RETURN_IF_ERROR(s.Int("block_size", &a->block_size));
  RETURN_IF_ERROR(s.Int("queue_depth", &a->queue_depth));
  RETURN_IF_ERROR(s.Int("intra_op_parallelism", &a->intra_op_parallelism));
  if (const json* v = s.Take("thread_count")) {  // DeepSpeed's old name for intra_op_parallelism
    int64_t threads = 0;
    RETURN_IF_ERROR(ReadInt(*v, s.PathOf("thread_count"), &threads));
    if (s.Given("intra_op_parallelism") && threads != a->intra_op_parallelism)
      return InvalidArgumentError(fmt::format(
          "aio.thread_count: {} conflicts with aio.intra_op_parallelism: {} (thread_count is the "
          "old name of intra_op_parallelism; write only one)",
          threads, a->intra_op_parallelism));
    if (threads <= 0)
      return InvalidArgumentError(fmt::format("aio.thread_count: {} is not allowed; must be > 0", threads));
    a->intra_op_parallelism = threads;
  }
  RETURN_IF_ERROR(s.Bool("single_submit", &a->single_submit));
  RETURN_IF_ERROR(s.Bool("overlap_events", &a->overlap_events));
  RETURN_IF_ERROR(s.Bool("use_gds", &a->use_gds));
  s.ReportUnread();
  return Status::Ok();
}

Status ReadOptimizer(Section& s, OptimizerConfig* o) {
  RETURN_IF_ERROR(s.Enum("type", kOptimizerTypes, &o->type, "Strata's CPU optimizer supports Adam and AdamW"));
  std::optional<Section> params;
  RETURN_IF_ERROR(s.Child("params", &params));
  if (params) {
    Section& p = *params;
    RETURN_IF_ERROR(p.Double("lr", &o->lr, Auto::kAllowed));
    if (p.Given("betas")) {
      const json& v = *p.Take("betas");
      if (!v.is_array() || v.size() != 2 || !v[0].is_number() || !v[1].is_number())
        return ValueError(p.PathOf("betas"), v,
                          "is not a pair of numbers (expected [beta1, beta2], each in [0, 1))");
      o->beta1 = v[0].get<double>();
      o->beta2 = v[1].get<double>();
    } else {
      p.Take("betas");  // "auto" or null: the default
    }
    RETURN_IF_ERROR(p.Double("eps", &o->eps, Auto::kAllowed));
    RETURN_IF_ERROR(p.Double("weight_decay", &o->weight_decay, Auto::kAllowed));
    RETURN_IF_ERROR(p.Bool("adam_w_mode", &o->adam_w_mode));
    RETURN_IF_ERROR(p.Bool("bias_correction", &o->bias_correction));
    p.ReportUnread();
  }
  // DeepSpeed: adam_w_mode defaults to true, and type AdamW forces it
  // (engine.py: effective_adam_w_mode = name == "adamw" or adam_w_mode).
  if (o->type == OptimizerType::kAdamW) o->adam_w_mode = true;
  s.ReportUnread();
  return Status::Ok();
}

Status ReadFp16(Section& s, Fp16Config* f) {
  RETURN_IF_ERROR(s.Bool("enabled", &f->enabled, Auto::kAllowed));
  RETURN_IF_ERROR(s.Double("loss_scale", &f->loss_scale));
  RETURN_IF_ERROR(s.Int32("initial_scale_power", &f->initial_scale_power));
  RETURN_IF_ERROR(s.Int("loss_scale_window", &f->loss_scale_window));
  RETURN_IF_ERROR(s.Int32("hysteresis", &f->hysteresis));
  RETURN_IF_ERROR(s.Double("min_loss_scale", &f->min_loss_scale));
  s.ReportUnread();
  return Status::Ok();
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
    host->ReportUnread();
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
    model->ReportUnread();
  }
  s.ReportUnread();
  return Status::Ok();
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
      return InvalidArgumentError(fmt::format(
          "train_batch_size: {} is not a multiple of train_micro_batch_size_per_gpu {}", *train, *micro));
    gas = *train / *micro;
  } else if (train && gas) {
    if (*train % *gas != 0)
      return InvalidArgumentError(fmt::format(
          "train_batch_size: {} is not a multiple of gradient_accumulation_steps {}", *train, *gas));
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

Status ReadConfig(const json& root, Config* c) {
  Section top(root, "", &c->warnings);
  std::optional<Section> sec;
  RETURN_IF_ERROR(top.Child("zero_optimization", &sec));
  if (sec) RETURN_IF_ERROR(ReadZero(*sec, &c->zero_optimization));
  sec.reset();
  RETURN_IF_ERROR(top.Child("aio", &sec));
  if (sec) RETURN_IF_ERROR(ReadAio(*sec, &c->aio));
  sec.reset();
  RETURN_IF_ERROR(top.Child("optimizer", &sec));
  if (sec) RETURN_IF_ERROR(ReadOptimizer(*sec, &c->optimizer));
  sec.reset();
  RETURN_IF_ERROR(top.Child("fp16", &sec));
  if (sec) RETURN_IF_ERROR(ReadFp16(*sec, &c->fp16));
  sec.reset();
  // bf16; DeepSpeed's old spelling is "bfloat16".
  if (root.contains("bf16") && root.contains("bfloat16"))
    return InvalidArgumentError("bf16 and bfloat16 are both given (bfloat16 is the old name of bf16; write only bf16)");
  RETURN_IF_ERROR(top.Child(root.contains("bfloat16") ? "bfloat16" : "bf16", &sec));
  if (sec) {
    RETURN_IF_ERROR(sec->Bool("enabled", &c->bf16_enabled, Auto::kAllowed));
    sec->ReportUnread();
  }
  sec.reset();
  RETURN_IF_ERROR(top.Double("gradient_clipping", &c->gradient_clipping, Auto::kAllowed));
  std::optional<int64_t> train, micro, gas;
  RETURN_IF_ERROR(top.OptionalInt("train_batch_size", &train));
  RETURN_IF_ERROR(top.OptionalInt("train_micro_batch_size_per_gpu", &micro));
  RETURN_IF_ERROR(top.OptionalInt("gradient_accumulation_steps", &gas));
  RETURN_IF_ERROR(ResolveBatch(train, micro, gas, c));
  RETURN_IF_ERROR(top.Child("strata", &sec));
  if (sec) RETURN_IF_ERROR(ReadStrata(*sec, &c->strata));
  top.ReportUnread();
  return Status::Ok();
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
    if (first_.ok()) first_ = InvalidArgumentError(fmt::format("{}: {} is not allowed; {}", path, value, rule));
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
      k.Fail(fmt::format("zero_optimization.{}.nvme_path[{}]", section, i), "\"\"", "must be a non-empty path");
  if (device != OffloadDevice::kNone && stage < min_stage)
    k.Fail(fmt::format("zero_optimization.{}.device: \"{}\" requires zero_optimization.stage {} "
                       "(stage is {})",
                       section, OffloadDeviceName(device), min_stage == 3 ? "3" : ">= 1", stage));
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
  return a.zero_optimization == b.zero_optimization && a.aio == b.aio && a.optimizer == b.optimizer &&
         a.fp16 == b.fp16 && a.bf16_enabled == b.bf16_enabled &&
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
  k.Positive("zero_optimization.offload_optimizer.buffer_count", oo.buffer_count);
  if (!(oo.ratio > 0.0 && oo.ratio <= 1.0))
    k.Fail("zero_optimization.offload_optimizer.ratio", fmt::format("{}", oo.ratio), "must be in (0, 1]");
  const OffloadParamConfig& op = z.offload_param;
  CheckOffloadCommon(k, "offload_param", op.device, op.nvme_path, z.stage, 3);
  k.Positive("zero_optimization.offload_param.buffer_count", op.buffer_count);
  k.Positive("zero_optimization.offload_param.buffer_size", op.buffer_size);
  k.Positive("zero_optimization.offload_param.max_in_cpu", op.max_in_cpu);
  k.Positive("zero_optimization.sub_group_size", z.sub_group_size);
  k.Positive("zero_optimization.stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size);
  // 0 is meaningful: persist no parameter.
  k.NonNegative("zero_optimization.stage3_param_persistence_threshold", z.stage3_param_persistence_threshold);
  k.Positive("zero_optimization.stage3_max_live_parameters", z.stage3_max_live_parameters);
  // 0 is meaningful: release every parameter right after use.
  k.NonNegative("zero_optimization.stage3_max_reuse_distance", z.stage3_max_reuse_distance);
  k.Positive("zero_optimization.reduce_bucket_size", z.reduce_bucket_size);
  k.Positive("zero_optimization.allgather_bucket_size", z.allgather_bucket_size);

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
    k.Fail("fp16.initial_scale_power", fmt::format("{}", f.initial_scale_power), "must be in [0, 64]");
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
      (__builtin_mul_overflow(c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps, &product) ||
       product != c.train_batch_size))
    k.Fail(fmt::format(
        "train_batch_size: {} is not train_micro_batch_size_per_gpu {} × gradient_accumulation_steps {} "
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
    k.Fail("strata.model.vocab", fmt::format("{}", m.vocab), "must be 256 (the example model is byte-level)");
  k.NonNegative("strata.model.seed", m.seed);
  k.NonNegative("strata.model.steps", m.steps);
  return k.status();
}

StatusOr<Config> ParseConfig(std::string_view json_text, std::string_view source) {
  json root;
  try {
    root = json::parse(json_text.begin(), json_text.end());
  } catch (const json::parse_error& e) {
    auto [line, column] = LineColumn(json_text, e.byte);
    return InvalidArgumentError(
        fmt::format("{}:{}:{}: malformed JSON: {}", source, line, column, ParseErrorReason(e.what())));
  } catch (const json::exception& e) {  // nothing else is expected; never let it escape
    return InvalidArgumentError(fmt::format("{}: malformed JSON: {}", source, e.what()));
  }
  const bool named = source != "<string>";
  auto with_source = [&](Status s) { return named ? s.WithContext(source) : s; };
  if (!root.is_object())
    return with_source(InvalidArgumentError(
        fmt::format("the top level is {} {}, expected a JSON object {{ ... }}", root.type_name(), Show(root))));
  Config config;
  Status s;
  try {
    s = ReadConfig(root, &config);
  } catch (const json::exception& e) {  // a reader bug, not the user's; keep it inside
    s = InternalError(fmt::format("reading config: {}", e.what()));
  }
  if (s.ok()) s = ValidateConfig(config);
  if (!s.ok()) return with_source(std::move(s));
  for (const std::string& w : config.warnings) STRATA_LOG_WARN("{}: {}", source, w);
  return config;
}

StatusOr<Config> LoadConfigFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    int err = errno;
    if (err == ENOENT || err == ENOTDIR) return NotFoundError(fmt::format("config file {} does not exist", path));
    return ErrnoError(fmt::format("config file {}", path), err);
  }
  if (S_ISDIR(st.st_mode)) return IOError(fmt::format("config file {} is a directory, not a file", path));
  std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!file) {
    int err = errno;
    Status s = ErrnoError(fmt::format("cannot open config file {}", path), err);
    return s.code() == StatusCode::kNotFound ? s : IOError(std::string(s.message()));
  }
  std::string text;
  char buf[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof(buf), file.get())) > 0) text.append(buf, n);
  if (std::ferror(file.get())) {
    int err = errno;
    return IOError(std::string(ErrnoError(fmt::format("cannot read config file {}", path), err).message()));
  }
  return ParseConfig(text, path);
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
  const OptimizerConfig& o = c.optimizer;
  j["optimizer"] = ojson{{"type", OptimizerTypeName(o.type)},
                         {"params", ojson{{"lr", o.lr},
                                          {"betas", ojson::array({o.beta1, o.beta2})},
                                          {"eps", o.eps},
                                          {"weight_decay", o.weight_decay},
                                          {"adam_w_mode", o.adam_w_mode},
                                          {"bias_correction", o.bias_correction}}}};
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
