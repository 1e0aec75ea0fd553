// The DeepSpeed sections: zero_optimization (with its offload sections),
// aio, optimizer, fp16 and bf16, with DeepSpeed's aliases, old spellings and
// legacy forms; and ReadConfig, the walk over the whole document that hands
// the `strata` section to read_strata.cc. Every key read here is declared in
// schema.cc.
#include <fmt/format.h>

#include <initializer_list>
#include <optional>
#include <utility>

#include "src/config/config_internal.h"

namespace strata::config_internal {
namespace {

Status ReadOffloadOptimizer(Section& s, OffloadOptimizerConfig* c) {
  RETURN_IF_ERROR(s.Enum("device", kOffloadDevices, &c->device));
  RETURN_IF_ERROR(s.Paths("nvme_path", &c->nvme_path));
  RETURN_IF_ERROR(s.Bool("pin_memory", &c->pin_memory));
  RETURN_IF_ERROR(s.Int("buffer_count", &c->buffer_count));
  RETURN_IF_ERROR(s.Bool("fast_init", &c->fast_init));
  // "auto" here is not "the default": the plan picks the split.
  if (s.IsAutoKey("ratio")) {
    s.Take("ratio");
    c->ratio_auto = true;
  } else {
    RETURN_IF_ERROR(s.Double("ratio", &c->ratio));
  }
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
    RETURN_IF_ERROR(ReadAutoDouble(p, "lr", autos.lr, default_text, &o->lr));
    if (takes.betas) {
      if (p.Given("betas")) {
        const json& v = *p.Take("betas");
        if (!v.is_array() || v.size() != 2 || !v[0].is_number() || !v[1].is_number())
          return ValueError(p.PathOf("betas"), v,
                            "is not a pair of numbers (expected [beta1, beta2], each in [0, 1))");
        o->beta1 = v[0].get<double>();
        o->beta2 = v[1].get<double>();
      } else if (p.IsAutoKey("betas")) {
        ResolveAutoBetas(p, autos, default_text, o);
      } else {
        p.Take("betas");  // null: the default
      }
    }
    if (takes.eps) RETURN_IF_ERROR(ReadAutoDouble(p, "eps", autos.eps, default_text, &o->eps));
    RETURN_IF_ERROR(
        ReadAutoDouble(p, "weight_decay", autos.weight_decay, default_text, &o->weight_decay));
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
  RETURN_IF_ERROR(ReadAutoBool(s, "enabled", autos.fp16_enabled,
                               "Strata's default; no frontend value", &f->enabled));
  RETURN_IF_ERROR(s.Double("loss_scale", &f->loss_scale));
  RETURN_IF_ERROR(s.Int32("initial_scale_power", &f->initial_scale_power));
  RETURN_IF_ERROR(s.Int("loss_scale_window", &f->loss_scale_window));
  RETURN_IF_ERROR(s.Int32("hysteresis", &f->hysteresis));
  RETURN_IF_ERROR(s.Double("min_loss_scale", &f->min_loss_scale));
  return s.ReportUnread();
}

}  // namespace

Status ReadConfig(const json& root, const AutoValues& autos, Config* c) {
  std::string undeclared;
  const Diagnostics diag{&c->warnings, &c->notices, &undeclared};
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
  RETURN_IF_ERROR(top.Child("scheduler", &sec));
  if (sec) RETURN_IF_ERROR(ReadScheduler(*sec, autos, c->optimizer, &c->scheduler));
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
    RETURN_IF_ERROR(ReadAutoBool(*sec, "enabled", autos.bf16_enabled,
                                 "Strata's default; no frontend value", &c->bf16_enabled));
    RETURN_IF_ERROR(sec->Bool("bf16_master_weights_and_grads", &c->bf16_master_weights_and_grads));
    RETURN_IF_ERROR(sec->Bool("bf16_optimizer_states", &c->bf16_optimizer_states));
    RETURN_IF_ERROR(sec->ReportUnread());
  }
  sec.reset();
  RETURN_IF_ERROR(ReadAutoDouble(top, "gradient_clipping", autos.gradient_clipping,
                                 "Strata's default: no clipping; no frontend value",
                                 &c->gradient_clipping));
  // Batch sizes: "auto" takes the frontend's value, else is derived.
  RETURN_IF_ERROR(ReadBatchSizes(top, autos, c));
  RETURN_IF_ERROR(top.Child("strata", &sec));
  const bool states_given = sec && sec->Given("optimizer_states");
  if (sec) RETURN_IF_ERROR(ReadStrata(*sec, &c->strata));
  // DeepSpeed's bf16 keys select the bf16-master format (validate.cc
  // refuses the combinations DeepSpeed refuses, and the one Strata lacks).
  if (c->bf16_master_weights_and_grads && c->bf16_optimizer_states) {
    if (!states_given) {
      c->strata.optimizer_states = OptimizerStates::kBf16Master;
      c->notices.push_back(
          "strata.optimizer_states: \"bf16-master\" (from bf16.bf16_master_weights_and_grads "
          "and bf16.bf16_optimizer_states)");
    } else if (c->strata.optimizer_states != OptimizerStates::kBf16Master) {
      return InvalidArgumentError(fmt::format(
          "strata.optimizer_states: \"{}\" disagrees with bf16.bf16_master_weights_and_grads "
          "and bf16.bf16_optimizer_states true (a bf16 master and bf16 moments: "
          "\"bf16-master\"); give one of the two",
          OptimizerStatesName(c->strata.optimizer_states)));
    }
  }
  RETURN_IF_ERROR(top.ReportUnread());
  if (!undeclared.empty())
    return InternalError(
        fmt::format("config key {} is read but not declared in the schema", undeclared));
  return Status::Ok();
}

}  // namespace strata::config_internal
