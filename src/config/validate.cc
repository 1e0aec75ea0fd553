// ValidateConfig: the ranges and cross-field rules of a Config (the schema's
// "allowed values"), for parsed and hand-edited Configs alike. The first
// broken rule is the error; its message names the key path, the value and
// the rule.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "src/common/rank_env.h"
#include "src/config/config_internal.h"

namespace strata {
namespace {

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

// The scheduler's ranges (DeepSpeed's constructors refuse the same values,
// or divide by them).
void CheckScheduler(Checker& k, const SchedulerConfig& s) {
  auto path = [](std::string_view key) { return fmt::format("scheduler.params.{}", key); };
  switch (s.type) {
    case LrScheduleType::kNone:
      return;
    case LrScheduleType::kWarmupLR:
    case LrScheduleType::kWarmupDecayLR:
      k.NonNegative(path("warmup_min_lr"), s.warmup_min_lr);
      k.NonNegative(path("warmup_max_lr"), s.warmup_max_lr);
      break;
    case LrScheduleType::kWarmupCosineLR:
      k.NonNegative(path("warmup_min_ratio"), s.warmup_min_ratio);
      k.NonNegative(path("cos_min_ratio"), s.cos_min_ratio);
      break;
    case LrScheduleType::kOneCycle:
      k.NonNegative(path("cycle_min_lr"), s.cycle_min_lr);
      k.NonNegative(path("cycle_max_lr"), s.cycle_max_lr);
      k.NonNegative(path("decay_lr_rate"), s.decay_lr_rate);
      k.Positive(path("cycle_first_step_size"), s.cycle_first_step_size);
      k.NonNegative(path("cycle_second_step_size"), s.cycle_second_step_size);
      k.NonNegative(path("cycle_first_stair_count"), s.cycle_first_stair_count);
      k.NonNegative(path("cycle_second_stair_count"), s.cycle_second_stair_count);
      k.NonNegative(path("decay_step_size"), s.decay_step_size);
      k.NonNegative(path("decay_mom_rate"), s.decay_mom_rate);
      for (auto [key, v] : {std::pair{"cycle_min_mom", s.cycle_min_mom},
                            std::pair{"cycle_max_mom", s.cycle_max_mom}})
        if (s.cycle_momentum && !(v >= 0 && v < 1))
          k.Fail(path(key), fmt::format("{}", v), "must be in [0, 1) (it is betas[0])");
      break;
    case LrScheduleType::kLRRangeTest:
      k.NonNegative(path("lr_range_test_min_lr"), s.lr_range_test_min_lr);
      k.Positive(path("lr_range_test_step_size"), s.lr_range_test_step_size);
      k.NonNegative(path("lr_range_test_step_rate"), s.lr_range_test_step_rate);
      break;
  }
  if (s.type != LrScheduleType::kOneCycle && s.type != LrScheduleType::kLRRangeTest)
    k.Positive(path("warmup_num_steps"), s.warmup_num_steps);
  if (s.type == LrScheduleType::kWarmupDecayLR || s.type == LrScheduleType::kWarmupCosineLR)
    k.Positive(path("total_num_steps"), s.total_num_steps);
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

}  // namespace

int64_t DataParallelRanks() {
  // Lenient: a WORLD_SIZE that is not a positive integer counts one rank
  // here; the engine's ReadRankEnv then refuses it, naming it.
  const StatusOr<std::optional<int>> n = RankEnvInteger("WORLD_SIZE");
  return (n.ok() && n->has_value() && **n > 0) ? **n : 1;
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
  else if (oo.ratio < 1.0 && z.stage != 3)
    k.Fail("zero_optimization.offload_optimizer.ratio", fmt::format("{}", oo.ratio),
           fmt::format("below 1 it needs zero_optimization.stage 3 (it is {}), as in DeepSpeed",
                       z.stage));
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
  CheckScheduler(k, c.scheduler);

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
  const int64_t ranks = DataParallelRanks();
  if (c.train_micro_batch_size_per_gpu > 0 && c.gradient_accumulation_steps > 0 &&
      (__builtin_mul_overflow(c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps,
                              &product) ||
       __builtin_mul_overflow(product, ranks, &product) || product != c.train_batch_size))
    k.Fail(
        fmt::format("train_batch_size: {} is not train_micro_batch_size_per_gpu {} × "
                    "gradient_accumulation_steps {} × {} rank{} "
                    "(train = micro × accumulation × data-parallel ranks, WORLD_SIZE)",
                    c.train_batch_size, c.train_micro_batch_size_per_gpu,
                    c.gradient_accumulation_steps, ranks, ranks == 1 ? "" : "s"));

  const StrataConfig& s = c.strata;
  k.NonNegative("strata.device_id", s.device_id);
  k.NonNegative("strata.hbm_budget", s.hbm_budget_bytes);
  k.NonNegative("strata.pinned_budget", s.pinned_budget_bytes);
  k.NonNegative("strata.dram_budget", s.dram_budget_bytes);
  k.NonNegative("strata.threads", s.threads);
  k.NonNegative("strata.delayed_param_update_warmup", s.delayed_param_update_warmup);
  if (s.speculative_step.value_or(false) && s.delayed_param_update)
    k.Fail(
        "strata.speculative_step: true cannot be combined with strata.delayed_param_update true "
        "(the delayed step already runs beside the next window); allowed: false, \"auto\"");
  if (s.grad_tier == GradTier::kNvme) {
    if (c.zero_optimization.offload_optimizer.device != OffloadDevice::kNvme)
      k.Fail(fmt::format(
          "strata.grad_tier: \"nvme\" keeps the gradients beside the optimizer states on NVMe "
          "and needs zero_optimization.offload_optimizer.device \"nvme\" (it is \"{}\"); "
          "allowed with other placements: \"auto\", \"dram\"",
          OffloadDeviceName(c.zero_optimization.offload_optimizer.device)));
    if (s.delayed_param_update)
      k.Fail(
          "strata.grad_tier: \"nvme\" cannot be combined with strata.delayed_param_update true "
          "(the step would read one window's gradients while the next is written there)");
  }
  if (s.grad_tier == GradTier::kHbm) {
    if (c.zero_optimization.offload_optimizer.device != OffloadDevice::kCpu)
      k.Fail(fmt::format(
          "strata.grad_tier: \"hbm\" keeps the window's sums in HBM until the CPU step reads "
          "them and needs zero_optimization.offload_optimizer.device \"cpu\" (it is \"{}\"); "
          "allowed with other placements: \"auto\", \"dram\"{}",
          OffloadDeviceName(c.zero_optimization.offload_optimizer.device),
          c.zero_optimization.offload_optimizer.device == OffloadDevice::kNvme ? ", \"nvme\""
                                                                               : ""));
    if (s.delayed_param_update)
      k.Fail(
          "strata.grad_tier: \"hbm\" cannot be combined with strata.delayed_param_update true "
          "(the step would read one window's sums while the next is added into them)");
  }
  // DeepSpeed's bf16 keys: its own constraints, and the combination Strata
  // has no format for.
  for (const auto& [on, key] :
       {std::pair{c.bf16_master_weights_and_grads, "bf16.bf16_master_weights_and_grads"},
        std::pair{c.bf16_optimizer_states, "bf16.bf16_optimizer_states"}}) {
    if (!on) continue;
    if (!c.bf16_enabled) k.Fail(fmt::format("{}: true needs bf16.enabled true", key));
    if (c.zero_optimization.stage < 1)
      k.Fail(fmt::format("{}: true needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is {})", key,
                         c.zero_optimization.stage));
  }
  if (c.bf16_optimizer_states && !c.bf16_master_weights_and_grads)
    k.Fail(
        "bf16.bf16_optimizer_states: true needs bf16.bf16_master_weights_and_grads true (as in "
        "DeepSpeed); for bf16 moments beside an fp32 master set strata.optimizer_states \"bf16\"");
  if (c.bf16_master_weights_and_grads && !c.bf16_optimizer_states)
    k.Fail(
        "bf16.bf16_master_weights_and_grads: true without bf16.bf16_optimizer_states (a bf16 "
        "master beside fp32 moments) is not a state format Strata offers; allowed: "
        "bf16.bf16_optimizer_states true (a bf16 master and bf16 moments), or "
        "strata.optimizer_states \"fp32\", \"bf16\", \"bf16-master\", \"int8\"");
  if (s.optimizer_states != OptimizerStates::kFp32) {
    const std::string_view f = OptimizerStatesName(s.optimizer_states);
    const OptimizerType t = c.optimizer.type;
    if (t == OptimizerType::kAdagrad ||
        (t == OptimizerType::kLion && s.optimizer_states == OptimizerStates::kBf16Master))
      k.Fail(fmt::format(
          "strata.optimizer_states: \"{}\" is not offered for optimizer.type \"{}\" (Adam and "
          "AdamW take fp32, bf16, bf16-master and int8; Lion fp32, bf16 and int8; Adagrad fp32)",
          f, OptimizerTypeName(t)));
  }
  k.NonNegative("strata.host_device.link_gbytes_per_s", s.host_device.link_gbytes_per_s);
  k.NonNegative("strata.host_device.link_latency_us", s.host_device.link_latency_us);
  const std::vector<std::string_view> known = config_internal::ApplicationSections();
  for (const auto& [name, text] : s.application_sections) {
    const std::string path = "strata." + name;
    if (std::find(known.begin(), known.end(), name) == known.end())
      k.Fail(fmt::format("{}: not a section Strata keeps for the application (known: {})",
                         config_internal::ShowKey(path), fmt::join(known, ", ")));
    else if (!config_internal::json::accept(text) ||
             !config_internal::json::parse(text).is_object())
      k.Fail(fmt::format("{}: the section's text is not a JSON object", path));
  }
  return k.status();
}

}  // namespace strata
