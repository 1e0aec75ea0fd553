// ConfigToJson, the effective configuration (every key the schema gives a
// default, defaults filled in) as DeepSpeed-style JSON, and Config equality.
// ParseConfig(ConfigToJson(c)) yields a Config equal to c.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/config/config_internal.h"

namespace strata {

using ojson = nlohmann::ordered_json;
using config_internal::OptimizerParams;
using config_internal::ParamsOf;

bool operator==(const Config& a, const Config& b) {
  return a.zero_optimization == b.zero_optimization && a.aio == b.aio &&
         a.optimizer == b.optimizer && a.scheduler == b.scheduler && a.fp16 == b.fp16 &&
         a.bf16_enabled == b.bf16_enabled &&
         a.bf16_master_weights_and_grads == b.bf16_master_weights_and_grads &&
         a.bf16_optimizer_states == b.bf16_optimizer_states &&
         a.gradient_clipping == b.gradient_clipping && a.train_batch_size == b.train_batch_size &&
         a.train_micro_batch_size_per_gpu == b.train_micro_batch_size_per_gpu &&
         a.gradient_accumulation_steps == b.gradient_accumulation_steps && a.strata == b.strata;
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
                                  {"ratio", oo.ratio_auto ? ojson("auto") : ojson(oo.ratio)},
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
  // The scheduler section only when there is a schedule, with the keys its
  // type takes.
  const SchedulerConfig& sc = c.scheduler;
  ojson sp;
  switch (sc.type) {
    case LrScheduleType::kNone:
      break;
    case LrScheduleType::kWarmupLR:
    case LrScheduleType::kWarmupDecayLR:
      sp = ojson{{"warmup_min_lr", sc.warmup_min_lr},
                 {"warmup_max_lr", sc.warmup_max_lr},
                 {"warmup_num_steps", sc.warmup_num_steps},
                 {"warmup_type", WarmupTypeName(sc.warmup_type)}};
      if (sc.type == LrScheduleType::kWarmupDecayLR) sp["total_num_steps"] = sc.total_num_steps;
      break;
    case LrScheduleType::kWarmupCosineLR:
      sp = ojson{{"total_num_steps", sc.total_num_steps},
                 {"warmup_min_ratio", sc.warmup_min_ratio},
                 {"warmup_num_steps", sc.warmup_num_steps},
                 {"cos_min_ratio", sc.cos_min_ratio},
                 {"warmup_type", WarmupTypeName(sc.warmup_type)}};
      break;
    case LrScheduleType::kOneCycle:
      sp = ojson{{"cycle_min_lr", sc.cycle_min_lr},
                 {"cycle_max_lr", sc.cycle_max_lr},
                 {"decay_lr_rate", sc.decay_lr_rate},
                 {"cycle_first_step_size", sc.cycle_first_step_size},
                 {"cycle_second_step_size", sc.cycle_second_step_size},
                 {"cycle_first_stair_count", sc.cycle_first_stair_count},
                 {"cycle_second_stair_count", sc.cycle_second_stair_count},
                 {"decay_step_size", sc.decay_step_size},
                 {"cycle_momentum", sc.cycle_momentum},
                 {"cycle_min_mom", sc.cycle_min_mom},
                 {"cycle_max_mom", sc.cycle_max_mom},
                 {"decay_mom_rate", sc.decay_mom_rate}};
      break;
    case LrScheduleType::kLRRangeTest:
      sp = ojson{{"lr_range_test_min_lr", sc.lr_range_test_min_lr},
                 {"lr_range_test_step_size", sc.lr_range_test_step_size},
                 {"lr_range_test_step_rate", sc.lr_range_test_step_rate},
                 {"lr_range_test_staircase", sc.lr_range_test_staircase}};
      break;
  }
  if (sc.type != LrScheduleType::kNone)
    j["scheduler"] = ojson{{"type", LrScheduleTypeName(sc.type)}, {"params", std::move(sp)}};
  const Fp16Config& f = c.fp16;
  j["fp16"] = ojson{{"enabled", f.enabled},
                    {"loss_scale", f.loss_scale},
                    {"initial_scale_power", f.initial_scale_power},
                    {"loss_scale_window", f.loss_scale_window},
                    {"hysteresis", f.hysteresis},
                    {"min_loss_scale", f.min_loss_scale}};
  j["bf16"] = ojson{{"enabled", c.bf16_enabled},
                    {"bf16_master_weights_and_grads", c.bf16_master_weights_and_grads},
                    {"bf16_optimizer_states", c.bf16_optimizer_states}};
  const StrataConfig& s = c.strata;
  j["strata"] =
      ojson{{"device", DeviceKindName(s.device)},
            {"device_id", s.device_id},
            {"hbm_budget", s.hbm_budget_bytes},
            {"pinned_budget", s.pinned_budget_bytes},
            {"dram_budget", s.dram_budget_bytes},
            {"trace_path", s.trace_path},
            {"threads", s.threads},
            {"io_engine", IoEngineKindName(s.io_engine)},
            {"io_sqpoll", s.io_sqpoll},
            {"grad_accumulator", GradAccumulatorPlaceName(s.grad_accumulator)},
            {"grad_tier", GradTierName(s.grad_tier)},
            {"overlap_optimizer", s.overlap_optimizer},
            {"delayed_param_update", s.delayed_param_update},
            {"delayed_param_update_warmup", s.delayed_param_update_warmup},
            {"speculative_step", s.speculative_step ? ojson(*s.speculative_step) : ojson("auto")},
            {"optimizer_states", OptimizerStatesName(s.optimizer_states)},
            {"host_device", ojson{{"link_gbytes_per_s", s.host_device.link_gbytes_per_s},
                                  {"link_latency_us", s.host_device.link_latency_us}}}};
  // Application-owned sections as kept; text that is not JSON (a Config
  // edited by hand; ValidateConfig refuses it) is written as a string.
  for (const auto& [name, text] : s.application_sections) {
    ojson section = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
    j["strata"][name] = section.is_discarded() ? ojson(text) : std::move(section);
  }
  // Strings a caller put into the Config by hand may be invalid UTF-8: they
  // are written with U+FFFD instead of throwing.
  return j.dump(indent, ' ', false, ojson::error_handler_t::replace);
}

}  // namespace strata
