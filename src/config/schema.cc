// The schema: every key of the config that Strata knows, in one table, and
// the verdict on a key present in a config that no reader asked for.
//
// A key is declared here before any reader may take it (Section::Take
// reports an undeclared key as an internal error), and every key
// ConfigToJson writes is declared here with its default (tests/config
// checks both). A key absent from this table is "unknown": an error inside a
// section, with the section's closest key as a suggestion; at the top level
// an error when close to a key Strata reads, else a warning.
//
// Columns: path, JSON type, use (read / a DeepSpeed key Strata does not use /
// a DeepSpeed setting Strata does not implement / a `strata` section the
// application owns, or a key of one), default as JSON text, note (allowed
// values; or why the key is not used), and on resume: why the key (and the
// keys below it) may differ between a checkpoint and the engine loading it,
// or nothing: compared, a difference refuses the checkpoint (the checkpoint
// code takes this column as it is, ResumeFreeKeys).
#include "src/config/schema.h"

#include <fmt/format.h>

#include <algorithm>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "src/config/config_internal.h"

namespace strata::config_internal {
namespace {

constexpr KeyType kInt = KeyType::kInt, kDouble = KeyType::kDouble, kBool = KeyType::kBool,
                  kBytes = KeyType::kBytes, kString = KeyType::kString, kEnum = KeyType::kEnum,
                  kPaths = KeyType::kPaths, kPair = KeyType::kPair, kObject = KeyType::kObject,
                  kAny = KeyType::kAny;
constexpr KeyUse kRead = KeyUse::kRead, kUnused = KeyUse::kUnused,
                 kUnsupported = KeyUse::kUnsupported, kApplication = KeyUse::kApplication;

// The resume column: compared (most keys), or the reason a key may differ.
constexpr std::string_view kCompared = "";
constexpr std::string_view kBudget = "a memory budget: it changes the placement only";

bool IsFalse(const json& v) { return v.is_boolean() && !v.get<bool>(); }
bool IsZero(const json& v) { return v.is_number() && v.get<double>() == 0.0; }
bool IsMinusOne(const json& v) { return v.is_number() && v.get<double>() == -1.0; }

// clang-format off
const KeySpec kSchema[] = {
    // ---- Top level ----------------------------------------------------------
    {"train_batch_size", kInt, kRead, "1", "> 0; train = micro x accumulation x ranks"},
    {"train_micro_batch_size_per_gpu", kInt, kRead, "1", "> 0",
     "how the global batch (train_batch_size, compared) is split over ranks, micro-batches and "
     "accumulation: a checkpoint loads at another number of ranks"},
    {"gradient_accumulation_steps", kInt, kRead, "1", "> 0",
     "how the global batch is split (as above)"},
    {"gradient_clipping", kDouble, kRead, "0.0", ">= 0; 0 = no clipping"},
    {"zero_optimization", kObject, kRead, "", "an object, or the legacy true (stage 1) / false"},
    {"aio", kObject, kRead, "", "", "NVMe I/O tuning"},
    {"optimizer", kObject},
    {"fp16", kObject},
    {"bf16", kObject},
    {"bfloat16", kObject, kRead, "", "old name of bf16"},
    {"strata", kObject},
    {"scheduler", kObject},

    // ---- zero_optimization ----------------------------------------------------
    {"zero_optimization.stage", kInt, kRead, "0", "0, 1, 2, 3",
     "how states are partitioned over the ranks: the format does not depend on it"},
    {"zero_optimization.offload_optimizer", kObject, kRead, "", "",
     "where the optimizer states live: the same arithmetic runs on every placement, and the "
     "format does not depend on it"},
    {"zero_optimization.offload_param", kObject, kRead, "", "stage 3 only",
     "where the parameters live (as above)"},
    {"zero_optimization.cpu_offload", kBool, kRead, "", "old spelling of offload_optimizer.device \"cpu\""},
    {"zero_optimization.cpu_offload_param", kBool, kRead, "", "old spelling of offload_param.device \"cpu\""},
    {"zero_optimization.cpu_offload_params", kBool, kRead, "", "old spelling of offload_param.device \"cpu\""},
    {"zero_optimization.cpu_offload_use_pin_memory", kBool, kRead, "", "old spelling of both sections' pin_memory"},
    {"zero_optimization.sub_group_size", kInt, kRead, "1000000000", ">= 0; 0 = kZeroMeansOneTensorElems"},
    {"zero_optimization.stage3_prefetch_bucket_size", kInt, kRead, "50000000", ">= 0",
     "how far ahead parameters are fetched"},
    {"zero_optimization.prefetch_bucket_size", kInt, kRead, "", "alias of stage3_prefetch_bucket_size"},
    {"zero_optimization.stage3_param_persistence_threshold", kInt, kRead, "100000", ">= 0",
     "which parameters stay resident in HBM"},
    {"zero_optimization.param_persistence_threshold", kInt, kRead, "", "alias of stage3_param_persistence_threshold"},
    {"zero_optimization.stage3_max_live_parameters", kInt, kRead, "1000000000", ">= 0",
     "how many parameters are resident at once"},
    {"zero_optimization.max_live_parameters", kInt, kRead, "", "alias of stage3_max_live_parameters"},
    {"zero_optimization.stage3_max_reuse_distance", kInt, kRead, "1000000000", ">= 0",
     "when a fetched parameter is kept"},
    {"zero_optimization.max_reuse_distance", kInt, kRead, "", "alias of stage3_max_reuse_distance"},
    {"zero_optimization.overlap_comm", kBool, kRead, "false", "default true for stage 3",
     "whether transfers overlap compute"},
    {"zero_optimization.contiguous_gradients", kBool, kRead, "true", "always in effect (one flat accumulator)",
     "the staging of gradient copies"},
    {"zero_optimization.reduce_bucket_size", kInt, kRead, "500000000", ">= 0; 0 = kZeroMeansOneTensorElems",
     "the size of gradient transfers"},
    {"zero_optimization.allgather_bucket_size", kInt, kRead, "500000000", ">= 0",
     "the size of parameter transfers"},
    {"zero_optimization.aio", kObject, kRead, "", "misplaced: ignored with a warning (aio is top-level)"},

    {"zero_optimization.offload_optimizer.device", kEnum, kRead, "\"none\"", "none, cpu, nvme"},
    {"zero_optimization.offload_optimizer.nvme_path", kPaths, kRead, "[]", "required with device nvme"},
    {"zero_optimization.offload_optimizer.pin_memory", kBool, kRead, "false"},
    {"zero_optimization.offload_optimizer.buffer_count", kInt, kRead, "4", ">= 0; >= 1 with device nvme"},
    {"zero_optimization.offload_optimizer.fast_init", kBool, kRead, "false"},
    {"zero_optimization.offload_optimizer.ratio", kDouble, kRead, "1.0", "(0, 1] or \"auto\""},
    {"zero_optimization.offload_optimizer.pipeline_read", kBool, kRead, "false"},
    {"zero_optimization.offload_optimizer.pipeline_write", kBool, kRead, "false"},
    {"zero_optimization.offload_optimizer.pipeline", kBool, kRead, "", "old spelling: true sets pipeline_read and pipeline_write"},

    {"zero_optimization.offload_param.device", kEnum, kRead, "\"none\"", "none, cpu, nvme"},
    {"zero_optimization.offload_param.nvme_path", kPaths, kRead, "[]", "required with device nvme"},
    {"zero_optimization.offload_param.pin_memory", kBool, kRead, "false"},
    {"zero_optimization.offload_param.buffer_count", kInt, kRead, "5", ">= 0; >= 1 with device nvme"},
    {"zero_optimization.offload_param.buffer_size", kInt, kRead, "100000000", ">= 0; not used by Strata"},
    {"zero_optimization.offload_param.max_in_cpu", kInt, kRead, "1000000000", ">= 0; not used by Strata"},

    // ---- aio ------------------------------------------------------------------
    {"aio.block_size", kInt, kRead, "1048576", "> 0, a multiple of 512"},
    {"aio.queue_depth", kInt, kRead, "8", "> 0"},
    {"aio.intra_op_parallelism", kInt, kRead, "1", "> 0"},
    {"aio.thread_count", kInt, kRead, "", "old name of intra_op_parallelism"},
    {"aio.single_submit", kBool, kRead, "false"},
    {"aio.overlap_events", kBool, kRead, "true"},
    {"aio.use_gds", kBool, kRead, "false"},

    // ---- optimizer (defaults of AdamW; Adagrad: lr 1e-2, eps 1e-10) -------------
    {"optimizer.type", kEnum, kRead, "\"AdamW\"", "Adam, AdamW, Adagrad, Lion (case-insensitive)"},
    {"optimizer.params", kObject},
    {"optimizer.params.lr", kDouble, kRead, "0.001", ">= 0"},
    {"optimizer.params.betas", kPair, kRead, "[0.9, 0.999]", "each in [0, 1); Adam, AdamW, Lion"},
    {"optimizer.params.eps", kDouble, kRead, "1e-8", "> 0; Adam, AdamW, Adagrad"},
    {"optimizer.params.weight_decay", kDouble, kRead, "0.0", ">= 0"},
    {"optimizer.params.adam_w_mode", kBool, kRead, "true", "Adam, AdamW (AdamW forces true)"},
    {"optimizer.params.bias_correction", kBool, kRead, "true", "Adam, AdamW"},

    // ---- scheduler (DeepSpeed's lr_schedules.py; the keys each type takes:
    // include/strata/config.h, SchedulerConfig) ---------------------------------
    {"scheduler.type", kEnum, kRead, "", "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest"},
    {"scheduler.params", kObject},
    {"scheduler.params.warmup_min_lr", kDouble, kRead, "", ">= 0; default 0"},
    {"scheduler.params.warmup_max_lr", kDouble, kRead, "", ">= 0; default optimizer.params.lr (WarmupDecayLR: 0.001)"},
    {"scheduler.params.warmup_num_steps", kInt, kRead, "", "> 0; default 1000; below 2 counts as 2"},
    {"scheduler.params.warmup_type", kEnum, kRead, "", "log, linear; default log"},
    {"scheduler.params.total_num_steps", kInt, kRead, "", "> 0; required by WarmupDecayLR and WarmupCosineLR"},
    {"scheduler.params.warmup_min_ratio", kDouble, kRead, "", ">= 0; default 0"},
    {"scheduler.params.cos_min_ratio", kDouble, kRead, "", ">= 0; default 0.0001"},
    {"scheduler.params.cycle_min_lr", kDouble, kRead, "", ">= 0; required by OneCycle"},
    {"scheduler.params.cycle_max_lr", kDouble, kRead, "", ">= 0; required by OneCycle"},
    {"scheduler.params.decay_lr_rate", kDouble, kRead, "", ">= 0; default 0"},
    {"scheduler.params.cycle_first_step_size", kInt, kRead, "", "> 0; default 2000"},
    {"scheduler.params.cycle_second_step_size", kInt, kRead, "", ">= 0; default cycle_first_step_size"},
    {"scheduler.params.cycle_first_stair_count", kInt, kRead, "", ">= 0; default 0 (no stairs)"},
    {"scheduler.params.cycle_second_stair_count", kInt, kRead, "", ">= 0; default cycle_first_stair_count"},
    {"scheduler.params.decay_step_size", kInt, kRead, "", ">= 0; default 0 (no decay)"},
    {"scheduler.params.cycle_momentum", kBool, kRead, "", "default true; not with Adagrad"},
    {"scheduler.params.cycle_min_mom", kDouble, kRead, "", "[0, 1); default 0.8"},
    {"scheduler.params.cycle_max_mom", kDouble, kRead, "", "[0, 1); default 0.9"},
    {"scheduler.params.decay_mom_rate", kDouble, kRead, "", ">= 0; default 0"},
    {"scheduler.params.lr_range_test_min_lr", kDouble, kRead, "", ">= 0; default 0.001"},
    {"scheduler.params.lr_range_test_step_size", kInt, kRead, "", "> 0; default 2000"},
    {"scheduler.params.lr_range_test_step_rate", kDouble, kRead, "", ">= 0; default 1.0"},
    {"scheduler.params.lr_range_test_staircase", kBool, kRead, "", "default false"},

    // ---- fp16, bf16 -------------------------------------------------------------
    {"fp16.enabled", kBool, kRead, "false", "not together with bf16.enabled"},
    {"fp16.loss_scale", kDouble, kRead, "0.0", ">= 0; 0 = dynamic"},
    {"fp16.initial_scale_power", kInt, kRead, "16", "[0, 64]"},
    {"fp16.loss_scale_window", kInt, kRead, "1000", "> 0"},
    {"fp16.hysteresis", kInt, kRead, "2", ">= 1"},
    {"fp16.min_loss_scale", kDouble, kRead, "1.0", "> 0"},
    {"bf16.enabled", kBool, kRead, "false"},
    {"bf16.bf16_master_weights_and_grads", kBool, kRead, "false",
     "with bf16_optimizer_states true: strata.optimizer_states \"bf16-master\""},
    {"bf16.bf16_optimizer_states", kBool, kRead, "false",
     "needs bf16_master_weights_and_grads true (as in DeepSpeed)"},
    {"bfloat16.enabled", kBool, kRead, "", "old name of bf16.enabled"},
    {"bfloat16.bf16_master_weights_and_grads", kBool, kRead, "", "old name of bf16's key"},
    {"bfloat16.bf16_optimizer_states", kBool, kRead, "", "old name of bf16's key"},

    // ---- strata -------------------------------------------------------------------
    {"strata.device", kEnum, kRead, "\"auto\"", "auto, cuda, host",
     "the device that runs the model (resuming on another device is allowed)"},
    {"strata.device_id", kInt, kRead, "0", ">= 0", "which GPU of the machine runs the model"},
    {"strata.hbm_budget", kBytes, kRead, "0", ">= 0; 0 = all free device memory", kBudget},
    {"strata.pinned_budget", kBytes, kRead, "0", ">= 0; 0 = sized from the placement", kBudget},
    {"strata.dram_budget", kBytes, kRead, "0", ">= 0; 0 = available memory less a margin", kBudget},
    {"strata.trace_path", kString, kRead, "\"\"", "empty = no trace",
     "where the timeline is written"},
    {"strata.threads", kInt, kRead, "0", ">= 0; 0 = every PU with one rank, this rank's share of its NUMA node's with several",
     "CPU optimizer threads: each element's update does not depend on how the work is split"},
    {"strata.io_engine", kEnum, kRead, "\"auto\"", "auto, uring, posix", "the NVMe I/O engine"},
    {"strata.io_sqpoll", kBool, kRead, "false", "", "NVMe I/O submission polling"},
    {"strata.grad_accumulator", kEnum, kRead, "\"auto\"", "auto, device, host",
     "the window's sum has the same bits in HBM or in DRAM"},
    {"strata.grad_tier", kEnum, kRead, "\"auto\"", "auto, dram, nvme, hbm",
     "the window's sums have the same bits in DRAM, on NVMe or in HBM"},
    {"strata.overlap_optimizer", kBool, kRead, "true", "",
     "the overlapped step computes exactly what the blocking one does"},
    {"strata.delayed_param_update", kBool, kRead, "false"},
    {"strata.speculative_step", kBool, kRead, "\"auto\"",
     "true, false, or \"auto\": on with a GPU where it applies",
     "the speculative step gives bitwise what the step after backward does"},
    {"strata.delayed_param_update_warmup", kInt, kRead, "0", ">= 0"},
    {"strata.optimizer_states", kEnum, kRead, "\"fp32\"", "fp32, bf16, bf16-master, int8"},
    {"strata.host_device", kObject, kRead, "", "",
     "the simulated link of the host device (timing only)"},
    {"strata.host_device.link_gbytes_per_s", kDouble, kRead, "0.0", ">= 0; 0 = unlimited"},
    {"strata.host_device.link_latency_us", kDouble, kRead, "0.0", ">= 0"},
    // Application-owned: the example model of `strata train`
    // (examples/train/model_config.cc reads and validates it).
    {"strata.model", kObject, kApplication, "", "the example model of `strata train`"},
    // Its keys the library must know of: none but the one that may differ on
    // resume (every other one is compared).
    {"strata.model.steps", kInt, kApplication, "", "the run's length",
     "the run's length (strata train: --steps counts from step 0)"},

    // ---- DeepSpeed keys Strata reads nothing from ----------------------------------
    // They change nothing here (one rank, no communication; monitoring;
    // checkpoint formats; memory or speed approximations Strata does not
    // make). They get a softer warning than a misspelt key ("DeepSpeed key X
    // is not used by Strata") but still a warning: the user should know the
    // setting has no effect here. The note, when given, says why.
    {"steps_per_print", kAny, kUnused},
    {"wall_clock_breakdown", kAny, kUnused},
    {"memory_breakdown", kAny, kUnused},
    {"dump_state", kAny, kUnused},
    {"zero_allow_untested_optimizer", kAny, kUnused},
    {"zero_force_ds_cpu_optimizer", kAny, kUnused},
    {"communication_data_type", kAny, kUnused},
    {"seq_parallel_communication_data_type", kAny, kUnused},
    {"prescale_gradients", kAny, kUnused},
    {"gradient_predivide_factor", kAny, kUnused},
    {"sparse_gradients", kAny, kUnused},
    {"sparse_attention", kAny, kUnused},
    {"disable_allgather", kAny, kUnused},
    {"flops_profiler", kAny, kUnused},
    {"tensorboard", kAny, kUnused},
    {"wandb", kAny, kUnused},
    {"csv_monitor", kAny, kUnused},
    {"comet", kAny, kUnused},
    {"comms_logger", kAny, kUnused},
    {"activation_checkpointing", kAny, kUnused},
    {"checkpoint", kAny, kUnused},
    {"data_types", kAny, kUnused},
    {"amp", kAny, kUnused},
    {"torch_autocast", kAny, kUnused},
    {"autotuning", kAny, kUnused},
    {"elasticity", kAny, kUnused},
    {"compression_training", kAny, kUnused},
    {"data_efficiency", kAny, kUnused},
    {"curriculum_learning", kAny, kUnused},
    {"pipeline", kAny, kUnused},
    {"load_universal_checkpoint", kAny, kUnused},
    {"use_node_local_storage", kAny, kUnused},
    {"dataloader_drop_last", kAny, kUnused, "", "the framework feeds the batches"},
    {"graph_harvesting", kAny, kUnused},
    {"eigenvalue", kAny, kUnused},
    {"progressive_layer_drop", kAny, kUnused},
    {"quantize_training", kAny, kUnused},
    {"weight_quantization", kAny, kUnused},
    {"use_data_before_expert_parallelism", kAny, kUnused},
    {"hybrid_engine", kAny, kUnused},
    {"nebula", kAny, kUnused},
    {"compile", kAny, kUnused},
    {"timers", kAny, kUnused},
    {"tensor_parallel", kAny, kUnused},
    {"zenflow", kAny, kUnused, "", "Strata updates every parameter at every step"},
    {"allgather_size", kInt, kUnused, "", "read only with the legacy \"zero_optimization\": true"},
    {"fp16.auto_cast", kAny, kUnused},
    {"fp16.consecutive_hysteresis", kAny, kUnused},
    {"fp16.fp16_master_weights_and_grads", kAny, kUnused, "", "Strata keeps fp32 master weights and gradients"},
    {"bf16.immediate_grad_update", kAny, kUnused},
    {"bfloat16.immediate_grad_update", kAny, kUnused},
    {"optimizer.legacy_fusion", kAny, kUnused},
    {"optimizer.params.torch_adam", kAny, kUnused},
    {"optimizer.params.fused", kAny, kUnused},
    {"optimizer.params.foreach", kAny, kUnused},
    {"optimizer.params.capturable", kAny, kUnused},
    {"optimizer.params.differentiable", kAny, kUnused},
    {"optimizer.params.fp32_optimizer_states", kAny, kUnused, "", "Strata keeps fp32 optimizer states"},
    {"aio.io_backend", kAny, kUnused, "", "Strata picks its I/O engine with strata.io_engine"},
    {"aio.parallel_write", kAny, kUnused},
    {"zero_optimization.allgather_partitions", kAny, kUnused},
    {"zero_optimization.reduce_scatter", kAny, kUnused},
    {"zero_optimization.use_multi_rank_bucket_allreduce", kAny, kUnused},
    {"zero_optimization.round_robin_gradients", kAny, kUnused},
    {"zero_optimization.elastic_checkpoint", kAny, kUnused},
    {"zero_optimization.ignore_unused_parameters", kAny, kUnused},
    {"zero_optimization.legacy_stage1", kAny, kUnused},
    {"zero_optimization.load_from_fp32_weights", kAny, kUnused},
    {"zero_optimization.stage3_gather_16bit_weights_on_model_save", kAny, kUnused},
    {"zero_optimization.gather_16bit_weights_on_model_save", kAny, kUnused},
    {"zero_optimization.stage3_gather_fp16_weights_on_model_save", kAny, kUnused},
    {"zero_optimization.stage3_model_persistence_threshold", kAny, kUnused},
    {"zero_optimization.model_persistence_threshold", kAny, kUnused},
    {"zero_optimization.stage3_module_granularity_threshold", kAny, kUnused},
    {"zero_optimization.module_granularity_threshold", kAny, kUnused},
    {"zero_optimization.stage3_use_all_reduce_for_fetch_params", kAny, kUnused},
    {"zero_optimization.use_all_reduce_for_fetch_params", kAny, kUnused},
    {"zero_optimization.zero_hpz_partition_size", kAny, kUnused},
    {"zero_optimization.zero_quantized_weights", kAny, kUnused},
    {"zero_optimization.zero_quantized_nontrainable_weights", kAny, kUnused},
    {"zero_optimization.zero_quantized_gradients", kAny, kUnused},
    {"zero_optimization.zeropp_loco_param", kAny, kUnused},
    {"zero_optimization.mics_shard_size", kAny, kUnused},
    {"zero_optimization.mics_hierarchical_params_gather", kAny, kUnused},
    {"zero_optimization.memory_efficient_linear", kAny, kUnused},
    {"zero_optimization.pipeline_loading_checkpoint", kAny, kUnused},
    {"zero_optimization.override_module_apply", kAny, kUnused},
    {"zero_optimization.log_trace_cache_warnings", kAny, kUnused},
    {"zero_optimization.zenflow", kAny, kUnused, "", "Strata updates every parameter at every step"},

    // ---- DeepSpeed settings Strata does not implement -------------------------------
    // At their neutral value they change nothing (reported like the unused
    // keys above); at any other value they would change the training in a
    // way Strata does not implement: an error.
    {"optimizer.params.amsgrad", kBool, kUnsupported, "",
     "AMSGrad (the maximum of past second moments) is not implemented by Strata's CPU optimizer",
     kCompared, IsFalse, "false"},
    {"optimizer.params.maximize", kBool, kUnsupported, "", "Strata's optimizers minimize",
     kCompared, IsFalse, "false"},
    {"scheduler.params.last_batch_iteration", kInt, kUnsupported, "",
     "Strata's schedule follows the engine's optimizer step count (restored by LoadCheckpoint)",
     kCompared, IsMinusOne, "-1"},
    {"optimizer.params.lr_decay", kDouble, kUnsupported, "",
     "Strata's Adagrad has no learning-rate decay", kCompared, IsZero, "0"},
    {"optimizer.params.initial_accumulator_value", kDouble, kUnsupported, "",
     "Strata's Adagrad starts its sum at 0", kCompared, IsZero, "0"},
};
// clang-format on

template <typename Enum, size_t N>
std::string_view NameOf(const EnumName<Enum> (&names)[N], Enum value) {
  for (const auto& n : names)
    if (n.value == value) return n.name;
  return "?";
}

}  // namespace

const std::vector<KeySpec>& Schema() {
  static const std::vector<KeySpec> schema(std::begin(kSchema), std::end(kSchema));
  return schema;
}

std::vector<std::string_view> ApplicationSections() {
  constexpr std::string_view kPrefix = "strata.";
  std::vector<std::string_view> names;
  for (const KeySpec& k : kSchema) {
    if (k.use != KeyUse::kApplication) continue;
    const std::string_view name = k.path.substr(kPrefix.size());
    // A section, not a key of one (strata.model.steps).
    if (name.find('.') == std::string_view::npos) names.push_back(name);
  }
  return names;
}

const KeySpec* FindKey(std::string_view path) {
  static const auto* index = [] {
    auto* m = new std::unordered_map<std::string_view, const KeySpec*>();
    for (const KeySpec& k : kSchema) m->emplace(k.path, &k);
    return m;
  }();
  auto it = index->find(path);
  return it == index->end() ? nullptr : it->second;
}

size_t EditDistance(std::string_view a, std::string_view b, size_t limit) {
  const size_t gap = a.size() > b.size() ? a.size() - b.size() : b.size() - a.size();
  if (gap > limit) return limit + 1;
  // Optimal string alignment: insertions, deletions, substitutions and swaps
  // of two neighbours cost 1 each. Three rows of the table.
  std::vector<size_t> before(b.size() + 1), prev(b.size() + 1), row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    row[0] = i;
    size_t best = row[0];
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      row[j] = std::min({prev[j] + 1, row[j - 1] + 1, prev[j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        row[j] = std::min(row[j], before[j - 2] + 1);
      best = std::min(best, row[j]);
    }
    if (best > limit) return limit + 1;  // every later row is at least this far
    std::swap(before, prev);
    std::swap(prev, row);
  }
  return std::min(prev[b.size()], limit + 1);
}

namespace {

// The schema's key `name` the unknown key `key` most likely misspells: the
// closest within 2 edits (1 for a name of 4 characters or fewer, where 2
// edits reach too many unrelated words), among the keys of `section` that
// `use` accepts; "" when none is that close.
std::string_view ClosestKey(std::string_view section, std::string_view key,
                            bool (*use)(const KeySpec&)) {
  std::string_view best;
  size_t best_distance = 3;
  for (const KeySpec& k : kSchema) {
    std::string_view name = k.path;
    if (section.empty()) {
      if (name.find('.') != std::string_view::npos) continue;
    } else {
      if (name.size() <= section.size() + 1 || !name.starts_with(section) ||
          name[section.size()] != '.')
        continue;
      name.remove_prefix(section.size() + 1);
      if (name.find('.') != std::string_view::npos) continue;
    }
    if (!use(k)) continue;
    const size_t limit = name.size() <= 4 ? 1 : 2;
    const size_t d = EditDistance(Lower(key), name, limit);
    if (d <= limit && d < best_distance) {
      best = name;
      best_distance = d;
    }
  }
  return best;
}

bool AnyKey(const KeySpec&) { return true; }
// At the top level, a name for a typo's target: a section or key Strata reads
// (a misspelt DeepSpeed key Strata does not use changes nothing here).
bool ReadAtTopLevel(const KeySpec& k) { return k.use == KeyUse::kRead; }

}  // namespace

Status JudgeUnreadKey(std::string_view section, std::string_view key, const json& value,
                      bool auto_is_default, std::vector<std::string>* warnings) {
  const std::string prefix = section.empty() ? "" : std::string(section) + ".";
  const std::string path = prefix + ShowKey(key);
  const KeySpec* k = FindKey(prefix + std::string(key));
  if (k != nullptr && k->use == KeyUse::kUnsupported && !k->neutral(value) &&
      !(auto_is_default && IsAuto(value)))
    return InvalidArgumentError(fmt::format(
        "{}: {} is not supported: {}; it would change the training (remove the key or write {})",
        path, Show(value), k->note, k->neutral_text));
  // A key Strata reads that no reader took counts as unknown here.
  if (k == nullptr || k->use == KeyUse::kRead || k->use == KeyUse::kApplication) {
    if (!section.empty()) {
      // Inside a section every key is known (DeepSpeed's config models
      // refuse unknown fields too): a misspelt key would silently leave its
      // setting at the default.
      const std::string_view near = ClosestKey(section, key, AnyKey);
      return InvalidArgumentError(
          near.empty() ? fmt::format("{}: unknown key (no such key in {})", path, section)
                       : fmt::format("{}: unknown key; did you mean {}?", path, near));
    }
    if (const std::string_view near = ClosestKey("", key, ReadAtTopLevel); !near.empty())
      return InvalidArgumentError(fmt::format(
          "{}: unknown key; did you mean {}? (as written, {} is not read and keeps its default)",
          path, near, near));
    warnings->push_back(fmt::format("unknown key {} (ignored)", path));
  } else if (k->use == KeyUse::kUnsupported || k->note.empty()) {
    warnings->push_back(fmt::format("DeepSpeed key {} is not used by Strata (ignored)", path));
  } else {
    warnings->push_back(
        fmt::format("DeepSpeed key {} is not used by Strata (ignored; {})", path, k->note));
  }
  return Status::Ok();
}

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

}  // namespace strata::config_internal

namespace strata {

std::span<const ResumeFreeKey> ResumeFreeKeys() {
  static const std::vector<ResumeFreeKey> keys = [] {
    std::vector<ResumeFreeKey> free;
    for (const config_internal::KeySpec& k : config_internal::Schema())
      if (!k.free_on_resume.empty()) free.push_back({k.path, k.free_on_resume});
    return free;
  }();
  return keys;
}

std::string_view OffloadDeviceName(OffloadDevice d) {
  return config_internal::NameOf(config_internal::kOffloadDevices, d);
}
std::string_view OptimizerTypeName(OptimizerType t) {
  return config_internal::NameOf(config_internal::kOptimizerTypes, t);
}
std::string_view DeviceKindName(DeviceKind k) {
  return config_internal::NameOf(config_internal::kDeviceKinds, k);
}
std::string_view GradTierName(GradTier t) {
  return config_internal::NameOf(config_internal::kGradTiers, t);
}
std::string_view OptimizerStatesName(OptimizerStates f) {
  return config_internal::NameOf(config_internal::kOptimizerStatesNames, f);
}
std::string_view GradAccumulatorPlaceName(GradAccumulatorPlace p) {
  return config_internal::NameOf(config_internal::kGradAccumulatorPlaces, p);
}

std::string_view IoEngineKindName(IoEngineKind k) {
  return config_internal::NameOf(config_internal::kIoEngines, k);
}
std::string_view LrScheduleTypeName(LrScheduleType t) {
  return t == LrScheduleType::kNone ? "none"
                                    : config_internal::NameOf(config_internal::kLrSchedules, t);
}
std::string_view WarmupTypeName(WarmupType t) {
  return config_internal::NameOf(config_internal::kWarmupTypes, t);
}

}  // namespace strata
