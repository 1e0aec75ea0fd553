// The `scheduler` section: DeepSpeed's learning-rate schedules (WarmupLR,
// WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) with the keys and
// defaults of deepspeed/runtime/lr_schedules.py. Defaults that depend on
// other keys (warmup_max_lr, the second half of a OneCycle) are resolved
// here, so a SchedulerConfig holds the values used. The formulas are
// lr_schedule.cc's.
#include <fmt/format.h>

#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "src/config/config_internal.h"

namespace strata::config_internal {
namespace {

constexpr std::string_view kWarmupKeys[] = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                            "warmup_type"};
constexpr std::string_view kDecayKeys[] = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                                           "warmup_type", "total_num_steps"};
constexpr std::string_view kCosineKeys[] = {"total_num_steps", "warmup_min_ratio",
                                            "warmup_num_steps", "cos_min_ratio", "warmup_type"};
constexpr std::string_view kOneCycleKeys[] = {"cycle_min_lr",
                                              "cycle_max_lr",
                                              "decay_lr_rate",
                                              "cycle_first_step_size",
                                              "cycle_second_step_size",
                                              "cycle_first_stair_count",
                                              "cycle_second_stair_count",
                                              "decay_step_size",
                                              "cycle_momentum",
                                              "cycle_min_mom",
                                              "cycle_max_mom",
                                              "decay_mom_rate"};
constexpr std::string_view kRangeTestKeys[] = {"lr_range_test_min_lr", "lr_range_test_step_size",
                                               "lr_range_test_step_rate",
                                               "lr_range_test_staircase"};
// Every key of scheduler.params some type takes: the schema table's.
const std::vector<std::string_view>& AllParamKeys() {
  static const std::vector<std::string_view> keys = [] {
    constexpr std::string_view kPrefix = "scheduler.params.";
    std::vector<std::string_view> k;
    for (const KeySpec& spec : Schema())
      if (spec.use == KeyUse::kRead && spec.path.starts_with(kPrefix))
        k.push_back(spec.path.substr(kPrefix.size()));
    return k;
  }();
  return keys;
}

std::span<const std::string_view> KeysOf(LrScheduleType t) {
  switch (t) {
    case LrScheduleType::kWarmupLR:
      return kWarmupKeys;
    case LrScheduleType::kWarmupDecayLR:
      return kDecayKeys;
    case LrScheduleType::kWarmupCosineLR:
      return kCosineKeys;
    case LrScheduleType::kOneCycle:
      return kOneCycleKeys;
    case LrScheduleType::kLRRangeTest:
      return kRangeTestKeys;
    case LrScheduleType::kNone:
      break;
  }
  return {};
}

std::string KeyList(std::span<const std::string_view> keys) {
  std::string list;
  for (std::string_view k : keys) list += (list.empty() ? "" : ", ") + std::string(k);
  return list;
}

bool Takes(std::span<const std::string_view> keys, std::string_view key) {
  for (std::string_view k : keys)
    if (k == key) return true;
  return false;
}

Status Required(Section& p, std::string_view key, LrScheduleType t) {
  if (p.Given(key) || p.IsAutoKey(key)) return Status::Ok();
  return InvalidArgumentError(
      fmt::format("{}: required by scheduler.type {} (DeepSpeed has no "
                  "default for it)",
                  p.PathOf(key), LrScheduleTypeName(t)));
}

Status ReadParams(Section& p, const AutoValues& autos, const OptimizerConfig& o,
                  SchedulerConfig* sc) {
  const LrScheduleType t = sc->type;
  const std::span<const std::string_view> takes = KeysOf(t);
  // A key of another type: DeepSpeed's constructor would refuse it.
  for (std::string_view key : AllParamKeys()) {
    if (Takes(takes, key)) continue;
    if (p.Given(key))
      return ValueError(p.PathOf(key), *p.Peek(key),
                        fmt::format("is not a parameter of {} (it takes {})", LrScheduleTypeName(t),
                                    KeyList(takes)));
    p.Take(key);  // "auto"/null: nothing to use
  }
  constexpr std::string_view kDefault = "Strata's default; no frontend value";
  switch (t) {
    case LrScheduleType::kWarmupLR:
    case LrScheduleType::kWarmupDecayLR: {
      // WarmupLR's warmup_max_lr defaults to the optimizer's lr; WarmupDecayLR
      // passes 0.001 explicitly. "auto" is the frontend's lr (the Hugging Face
      // trainer's learning_rate), else the optimizer's.
      sc->warmup_max_lr = t == LrScheduleType::kWarmupLR ? o.lr : 1e-3;
      RETURN_IF_ERROR(
          ReadAutoDouble(p, "warmup_min_lr", std::nullopt, kDefault, &sc->warmup_min_lr));
      if (p.IsAutoKey("warmup_max_lr")) sc->warmup_max_lr = o.lr;
      RETURN_IF_ERROR(ReadAutoDouble(p, "warmup_max_lr", autos.lr,
                                     "optimizer.params.lr; no frontend value", &sc->warmup_max_lr));
      break;
    }
    case LrScheduleType::kWarmupCosineLR:
      RETURN_IF_ERROR(p.Double("warmup_min_ratio", &sc->warmup_min_ratio));
      RETURN_IF_ERROR(p.Double("cos_min_ratio", &sc->cos_min_ratio));
      break;
    case LrScheduleType::kOneCycle: {
      RETURN_IF_ERROR(Required(p, "cycle_min_lr", t));
      RETURN_IF_ERROR(Required(p, "cycle_max_lr", t));
      RETURN_IF_ERROR(p.Double("cycle_min_lr", &sc->cycle_min_lr));
      RETURN_IF_ERROR(p.Double("cycle_max_lr", &sc->cycle_max_lr));
      RETURN_IF_ERROR(p.Double("decay_lr_rate", &sc->decay_lr_rate));
      RETURN_IF_ERROR(p.Int("cycle_first_step_size", &sc->cycle_first_step_size));
      // The second half and its stairs default to the first's.
      sc->cycle_second_step_size = sc->cycle_first_step_size;
      RETURN_IF_ERROR(p.Int("cycle_second_step_size", &sc->cycle_second_step_size));
      RETURN_IF_ERROR(p.Int("cycle_first_stair_count", &sc->cycle_first_stair_count));
      sc->cycle_second_stair_count = sc->cycle_first_stair_count;
      RETURN_IF_ERROR(p.Int("cycle_second_stair_count", &sc->cycle_second_stair_count));
      RETURN_IF_ERROR(p.Int("decay_step_size", &sc->decay_step_size));
      RETURN_IF_ERROR(p.Bool("cycle_momentum", &sc->cycle_momentum));
      RETURN_IF_ERROR(p.Double("cycle_min_mom", &sc->cycle_min_mom));
      RETURN_IF_ERROR(p.Double("cycle_max_mom", &sc->cycle_max_mom));
      RETURN_IF_ERROR(p.Double("decay_mom_rate", &sc->decay_mom_rate));
      if (sc->cycle_momentum && !ParamsOf(o.type).betas) {
        // DeepSpeed: "cycle_momentum is disabled because optimizer ... does
        // not support momentum".
        p.Warn(
            fmt::format("{}: true ignored: {} has no betas to cycle (DeepSpeed turns it off "
                        "too); only the lr follows the cycle",
                        p.PathOf("cycle_momentum"), OptimizerTypeName(o.type)));
        sc->cycle_momentum = false;
      }
      break;
    }
    case LrScheduleType::kLRRangeTest:
      RETURN_IF_ERROR(p.Double("lr_range_test_min_lr", &sc->lr_range_test_min_lr));
      RETURN_IF_ERROR(p.Int("lr_range_test_step_size", &sc->lr_range_test_step_size));
      RETURN_IF_ERROR(p.Double("lr_range_test_step_rate", &sc->lr_range_test_step_rate));
      RETURN_IF_ERROR(p.Bool("lr_range_test_staircase", &sc->lr_range_test_staircase));
      break;
    case LrScheduleType::kNone:
      break;
  }
  if (Takes(takes, "warmup_num_steps"))
    RETURN_IF_ERROR(ReadAutoInt(p, "warmup_num_steps", autos.warmup_num_steps, kDefault,
                                &sc->warmup_num_steps));
  if (Takes(takes, "warmup_type")) {
    RETURN_IF_ERROR(p.Enum("warmup_type", kWarmupTypes, &sc->warmup_type,
                           "DeepSpeed falls back to log for other names; Strata refuses them"));
  }
  if (Takes(takes, "total_num_steps")) {
    if (p.IsAutoKey("total_num_steps") && !autos.total_num_steps)
      return InvalidArgumentError(fmt::format(
          "{}: \"auto\" needs a value from the frontend (the number of optimizer steps of the "
          "run); none was given, and {} has no default for it",
          p.PathOf("total_num_steps"), LrScheduleTypeName(t)));
    RETURN_IF_ERROR(Required(p, "total_num_steps", t));
    RETURN_IF_ERROR(
        ReadAutoInt(p, "total_num_steps", autos.total_num_steps, kDefault, &sc->total_num_steps));
  }
  return p.ReportUnread();
}

}  // namespace

Status ReadScheduler(Section& s, const AutoValues& autos, const OptimizerConfig& o,
                     SchedulerConfig* sc) {
  if (!s.Given("type")) {
    // DeepSpeed builds no schedule without a type; the params are ignored
    // (a key no schedule takes, or last_batch_iteration, is still judged).
    s.Take("type");
    s.Warn(
        "scheduler: no type given, so no learning-rate schedule (DeepSpeed ignores the section "
        "too); the lr stays optimizer.params.lr. Types: WarmupLR, WarmupDecayLR, WarmupCosineLR, "
        "OneCycle, LRRangeTest");
    std::optional<Section> params;
    RETURN_IF_ERROR(s.Child("params", &params));
    if (params) {
      for (std::string_view key : AllParamKeys()) params->Take(key);
      RETURN_IF_ERROR(params->ReportUnread());
    }
    return s.ReportUnread();
  }
  RETURN_IF_ERROR(s.Enum("type", kLrSchedules, &sc->type,
                         "DeepSpeed's names for the torch.optim.lr_scheduler classes are not "
                         "implemented here; from Python, attach the torch scheduler to "
                         "engine.optimizer and leave the scheduler section out"));
  std::optional<Section> params;
  RETURN_IF_ERROR(s.Child("params", &params));
  if (params) {
    RETURN_IF_ERROR(ReadParams(*params, autos, o, sc));
  } else {
    // No params: every key at its default, required ones missing.
    const json empty = json::object();
    Section none(empty, s.PathOf("params"), s.diag());
    RETURN_IF_ERROR(ReadParams(none, autos, o, sc));
  }
  return s.ReportUnread();
}

}  // namespace strata::config_internal
