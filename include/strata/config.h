// strata/config.h — Strata's configuration: DeepSpeed's JSON, as its users
// already write it, plus a `strata` section for what DeepSpeed lacks.
//
// Loading fills every field with DeepSpeed's default when the key is absent.
// Numbers may be written as integers or in exponent form (5e8). A wrong type
// or value is an InvalidArgument error naming the path, the value and what is
// allowed, e.g.
//   zero_optimization.offload_optimizer.device: "gpu" is not one of none, cpu, nvme
// Malformed JSON is an InvalidArgument error naming the file, line and column.
//
// Input limits (any input gives a Config or an error, never a crash):
// objects and arrays nest at most kMaxConfigDepth levels, the text is at most
// kMaxConfigBytes long, and a key may appear only once in an object (DeepSpeed
// refuses duplicates too; the error names the key path).
//
// "auto" (the Hugging Face integration's placeholder):
//  - In zero_optimization, its offload sections and aio, "auto" means "use the
//    default", for every key (DeepSpeed drops "auto" there). An offload
//    section or aio written "auto" as a whole means its defaults too.
//  - train_batch_size, train_micro_batch_size_per_gpu,
//    gradient_accumulation_steps, gradient_clipping, optimizer.params.{lr,
//    betas, eps, weight_decay}, scheduler.params.{warmup_min_lr, warmup_max_lr,
//    warmup_num_steps, total_num_steps}, fp16.enabled and bf16.enabled take the value a
//    frontend passes in AutoValues (as the Hugging Face trainer does); without
//    one, Strata's default (batch sizes: derived from the others, else 1).
//    Each such resolution is one notice naming the key and the value used.
//  - null is read as absent for those keys too. Elsewhere "auto" is a type
//    error.
//
// DeepSpeed's aliases and old spellings are accepted (e.g. max_live_parameters
// for stage3_max_live_parameters, cpu_offload_param, aio.thread_count,
// bfloat16); a config giving two spellings of one key with different values
// is an error naming both paths. `"zero_optimization": true` is stage 1, false
// stage 0.
//
// Keys: unknown keys produce one warning each, naming the key path. DeepSpeed
// keys Strata does not use produce "DeepSpeed key ... is not used by Strata";
// a DeepSpeed setting that would change the training and that Strata does not
// implement (e.g. optimizer.params.amsgrad: true) is an error.
//
// Plain data; thread-compatible.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "strata/dtype.h"
#include "strata/status.h"

namespace strata {

enum class OffloadDevice { kNone, kCpu, kNvme };
std::string_view OffloadDeviceName(OffloadDevice d);  // "none", "cpu", "nvme"

// zero_optimization.offload_optimizer
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  // One or more directories; a JSON string or a list of strings. Several paths
  // are striped (one swap file per path). Required when device is nvme
  // (an empty string, empty list or null counts as absent).
  std::vector<std::string> nvme_path;
  bool pin_memory = false;
  // Pinned buffers of the NVMe pipeline. 0 is accepted when device is not
  // nvme (DeepSpeed allows it; the buffers are unused then); with nvme it is
  // an error (DeepSpeed stops at its first step: "ran out of swap buffers").
  int64_t buffer_count = 4;
  bool fast_init = false;
  // The fraction of the optimizer states stepped on the CPU, (0, 1]; the
  // first sub-groups' rest are kept in HBM and stepped on the device
  // (stage 3, as in DeepSpeed). "auto" (ratio_auto): the plan picks it.
  double ratio = 1.0;
  bool ratio_auto = false;
  bool pipeline_read = false;
  bool pipeline_write = false;

  bool operator==(const OffloadOptimizerConfig&) const = default;
};

// zero_optimization.offload_param
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::vector<std::string> nvme_path;
  bool pin_memory = false;
  int64_t buffer_count = 5;  // >= 1 with device nvme; 0 accepted otherwise (unused)
  // Not used by Strata (its parameter buffers are sized per module); >= 0.
  int64_t buffer_size = 100'000'000;   // elements
  int64_t max_in_cpu = 1'000'000'000;  // elements

  bool operator==(const OffloadParamConfig&) const = default;
};

// What zero_optimization.sub_group_size and reduce_bucket_size 0 resolve to.
// DeepSpeed's 0 means "one tensor per sub-group / per bucket": it closes a
// sub-group or flushes a bucket after every parameter. Strata cuts both from
// its flat element space without parameter boundaries, so the parser
// resolves 0 to this fixed size (with a notice): about one weight matrix of a
// small transformer layer; sub-group transfers (12 bytes of fp32 state per
// element: 12 MiB) and gradient staging chunks stay large enough for full
// NVMe and PCIe bandwidth. A Config never carries 0 for these two.
inline constexpr int64_t kZeroMeansOneTensorElems = 1 << 20;

// zero_optimization (the stage3_ keys also under DeepSpeed's short names:
// prefetch_bucket_size, param_persistence_threshold, max_live_parameters,
// max_reuse_distance).
struct ZeroConfig {
  int stage = 0;  // 0..3
  OffloadOptimizerConfig offload_optimizer;
  // Used with stage 3 only; below stage 3 the parser ignores the section with
  // a warning (as DeepSpeed does) and leaves the defaults here.
  OffloadParamConfig offload_param;
  // Elements per optimizer sub-group, >= 1 (0 in JSON: kZeroMeansOneTensorElems).
  int64_t sub_group_size = 1'000'000'000;
  // Elements fetched ahead of use; 0 = no prefetching (as in DeepSpeed).
  int64_t stage3_prefetch_bucket_size = 50'000'000;
  // Modules smaller than this stay on the device; 0 = none stays.
  int64_t stage3_param_persistence_threshold = 100'000;
  // Non-persistent elements resident at once; 0 = only the module in use
  // (nothing is prefetched), as in DeepSpeed. A positive value below the two
  // largest offloaded modules counts as those two (the one in use and the
  // next: the plan reserves their slots in any case).
  int64_t stage3_max_live_parameters = 1'000'000'000;
  // A module reused within this many elements stays; 0 = release right after use.
  int64_t stage3_max_reuse_distance = 1'000'000'000;
  bool overlap_comm = false;  // when absent from JSON: true for stage 3 (DeepSpeed)
  bool contiguous_gradients = true;
  // Elements per gradient bucket (sizes Strata's gradient staging), >= 1
  // (0 in JSON: kZeroMeansOneTensorElems).
  int64_t reduce_bucket_size = 500'000'000;
  // Elements one all-gather of parameters moves over all ranks (several
  // ranks; sizes the collectives' staging with reduce_bucket_size), >= 0
  // (0: kZeroMeansOneTensorElems).
  int64_t allgather_bucket_size = 500'000'000;

  bool operator==(const ZeroConfig&) const = default;
};

// aio
struct AioConfig {
  int64_t block_size = 1'048'576;  // bytes
  int64_t queue_depth = 8;
  int64_t intra_op_parallelism = 1;  // old name: thread_count
  bool single_submit = false;
  bool overlap_events = true;
  bool use_gds = false;

  bool operator==(const AioConfig&) const = default;
};

// The optimizer algorithm (optimizer.type, case-insensitive). The CPU
// optimizer implements all four (src/cpu_adam: Algorithm kAdam, kAdamW,
// kAdagrad, kLion); DeepSpeed's other optimizers (Lamb, OneBitAdam, ...) are
// an error naming these.
enum class OptimizerType { kAdam, kAdamW, kAdagrad, kLion };
// "Adam", "AdamW", "Adagrad", "Lion"
std::string_view OptimizerTypeName(OptimizerType t);

// optimizer. Which params apply depends on the type (DeepSpeed's names; a
// param the type does not take is an error):
//   Adam, AdamW: lr 1e-3, betas [0.9, 0.999], eps 1e-8, weight_decay 0,
//                adam_w_mode, bias_correction
//   Adagrad:     lr 1e-2, eps 1e-10, weight_decay 0 (L2, added to the gradient)
//   Lion:        lr 1e-3, betas [0.9, 0.999], weight_decay 0 (decoupled)
// The defaults are DeepSpeed's CPU optimizers' (DeepSpeedCPUAdam/Adagrad/
// Lion); the parser fills them per type. Fields a type does not use keep the
// values below.
struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  double lr = 1e-3;
  double beta1 = 0.9;    // params.betas[0]; Adam/AdamW/Lion
  double beta2 = 0.999;  // params.betas[1]; Adam/AdamW/Lion
  double eps = 1e-8;     // Adam/AdamW/Adagrad
  double weight_decay = 0.0;
  // Adam/AdamW: DeepSpeed's adam_w_mode: decoupled weight decay (AdamW) when
  // true, L2 (Adam) when false. Defaults to true as in DeepSpeed; type AdamW
  // forces it. Not used by Adagrad and Lion.
  bool adam_w_mode = true;
  bool bias_correction = true;  // Adam/AdamW only

  bool operator==(const OptimizerConfig&) const = default;
};

// The learning-rate schedule (the `scheduler` section): DeepSpeed's five
// schedules from deepspeed/runtime/lr_schedules.py, with their names, keys,
// defaults and formulas. A schedule is a function of the number of optimizer
// steps applied so far (steps skipped on an fp16 overflow do not advance it,
// as in DeepSpeed), so a resumed run continues it exactly. The optimizer step
// that follows k applied steps uses DeepSpeed's lr for last_batch_iteration
// k - 1 (ScheduleAt below): DeepSpeed sets the lr of iteration -1 when it
// builds the schedule and advances it after each applied step.
enum class LrScheduleType {
  kNone,
  kWarmupLR,
  kWarmupDecayLR,
  kWarmupCosineLR,
  kOneCycle,
  kLRRangeTest
};
// "none" (no section), "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"
std::string_view LrScheduleTypeName(LrScheduleType t);

// warmup_type of the three warmup schedules: log (DeepSpeed's default) or linear.
enum class WarmupType { kLog, kLinear };
std::string_view WarmupTypeName(WarmupType t);  // "log", "linear"

// scheduler.params. Which keys apply depends on the type (a key the type does
// not take is an error, as DeepSpeed's constructor refuses it):
//   WarmupLR:       warmup_min_lr 0, warmup_max_lr (optimizer.params.lr),
//                   warmup_num_steps 1000, warmup_type log
//   WarmupDecayLR:  the same with warmup_max_lr 0.001, and total_num_steps (required)
//   WarmupCosineLR: total_num_steps (required), warmup_min_ratio 0,
//                   warmup_num_steps 1000, cos_min_ratio 0.0001, warmup_type log;
//                   the lr is optimizer.params.lr × the ratio
//   OneCycle:       cycle_min_lr, cycle_max_lr (both required), decay_lr_rate 0,
//                   cycle_first_step_size 2000, cycle_second_step_size (= first),
//                   cycle_first_stair_count 0, cycle_second_stair_count (= first),
//                   decay_step_size 0, cycle_momentum true, cycle_min_mom 0.8,
//                   cycle_max_mom 0.9, decay_mom_rate 0
//   LRRangeTest:    lr_range_test_min_lr 0.001, lr_range_test_step_size 2000,
//                   lr_range_test_step_rate 1.0, lr_range_test_staircase false
// The parser resolves the defaults that depend on other keys, so the fields
// below hold the values used. warmup_num_steps below 2 counts as 2 (DeepSpeed).
struct SchedulerConfig {
  LrScheduleType type = LrScheduleType::kNone;
  double warmup_min_lr = 0.0;
  double warmup_max_lr = 1e-3;
  int64_t warmup_num_steps = 1000;
  WarmupType warmup_type = WarmupType::kLog;
  int64_t total_num_steps = 0;  // WarmupDecayLR, WarmupCosineLR: > 0
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 1e-4;
  double cycle_min_lr = 0.0;
  double cycle_max_lr = 0.0;
  double decay_lr_rate = 0.0;
  int64_t cycle_first_step_size = 2000;
  int64_t cycle_second_step_size = 2000;
  int64_t cycle_first_stair_count = 0;
  int64_t cycle_second_stair_count = 0;
  int64_t decay_step_size = 0;
  // OneCycle cycles betas[0] inversely to the lr and sets betas[1] to 0.99
  // (DeepSpeed's OneCycle does both). Adagrad has no betas: the parser turns
  // it off with a warning, as DeepSpeed does.
  bool cycle_momentum = true;
  double cycle_min_mom = 0.8;
  double cycle_max_mom = 0.9;
  double decay_mom_rate = 0.0;
  double lr_range_test_min_lr = 1e-3;
  int64_t lr_range_test_step_size = 2000;
  double lr_range_test_step_rate = 1.0;
  bool lr_range_test_staircase = false;

  bool operator==(const SchedulerConfig&) const = default;
};

// fp16
struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;  // 0 = dynamic loss scaling
  int initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int hysteresis = 2;
  double min_loss_scale = 1.0;

  bool operator==(const Fp16Config&) const = default;
};

enum class DeviceKind { kAuto, kCuda, kHost };
std::string_view DeviceKindName(DeviceKind k);  // "auto", "cuda", "host"

enum class IoEngineKind { kAuto, kUring, kPosix };
std::string_view IoEngineKindName(IoEngineKind k);  // "auto", "uring", "posix"

// Where the window's gradients are summed across micro-batches
// (strata.grad_accumulator): auto (the plan decides from the HBM room and the
// measured rates), device (an fp32 accumulator in HBM, copied to the host once
// per window) or host (every micro-batch's gradients copied and added in DRAM).
enum class GradAccumulatorPlace { kAuto, kDevice, kHost };
std::string_view GradAccumulatorPlaceName(GradAccumulatorPlace p);  // "auto", "device", "host"

// Where the window's fp32 gradient sums are kept for the optimizer
// (strata.grad_tier): auto (in DRAM when the plan fits the DRAM budget with
// them; else, with states on NVMe, on NVMe, and with states in DRAM on one
// rank, in HBM), dram (one fp32 array over every parameter), nvme (states on
// NVMe: one shard per sub-group on the NVMe paths, a few sub-groups cached in
// DRAM; the optimizer pipeline reads them with the states), hbm
// (offload_optimizer cpu, one rank: the sums stay in an fp32 array in HBM
// and the step copies each sub-group's to the host, a chunk at a time, as
// it steps it). The same bits every way.
enum class GradTier { kAuto, kDram, kNvme, kHbm };
std::string_view GradTierName(GradTier t);  // "auto", "dram", "nvme", "hbm"

// How the CPU optimizer keeps its states between steps
// (strata.optimizer_states; DeepSpeed's bf16.bf16_master_weights_and_grads
// with bf16.bf16_optimizer_states select kBf16Master):
//   fp32         fp32 master, exp_avg, exp_avg_sq              12 B/param
//   bf16         fp32 master, bf16 moments                       8 B/param
//   bf16-master  bf16 master (stochastic rounding), bf16 moments 6 B/param
//   int8         fp32 master, 8-bit moments in blocks of 256 with one fp32
//                scale per block and moment                   ~6.06 B/param
// Adam and AdamW take every format, Lion fp32, bf16 and int8, Adagrad fp32.
// The compact formats run with offload_optimizer "cpu" (docs/design.md,
// "Compact state formats").
using OptimizerStates = StateFormat;
// "fp32", "bf16", "bf16-master", "int8"
std::string_view OptimizerStatesName(OptimizerStates f);

// strata.host_device: the host backend's model of a PCIe link.
struct HostDeviceConfig {
  double link_gbytes_per_s = 0.0;  // 0 = unlimited (copies at memcpy speed)
  double link_latency_us = 0.0;

  bool operator==(const HostDeviceConfig&) const = default;
};

// strata: what DeepSpeed has no key for.
struct StrataConfig {
  DeviceKind device = DeviceKind::kAuto;
  int64_t device_id = 0;
  int64_t hbm_budget_bytes = 0;     // 0 = all free device memory
  int64_t pinned_budget_bytes = 0;  // 0 = sized from the placement
  // Pageable host memory the plan may use (the gradient accumulator,
  // host-resident states and parameters): a plan over it is refused before
  // step 1 with the tier table. 0 = what the machine has available
  // (MemAvailable) less a margin of 10 % of that, at most 4 GiB.
  int64_t dram_budget_bytes = 0;
  std::string trace_path;  // Chrome-trace/Perfetto JSON; empty = off
  // CPU optimizer threads; 0 = every PU with one rank, this rank's share of its
  // NUMA node's PUs with several.
  int64_t threads = 0;
  IoEngineKind io_engine = IoEngineKind::kAuto;
  bool io_sqpoll = false;  // io_uring SQPOLL
  // With gradient accumulation and the optimizer offloaded: where the
  // window's gradients are summed (GradAccumulatorPlace). The same bits
  // either way.
  GradAccumulatorPlace grad_accumulator = GradAccumulatorPlace::kAuto;
  // With offload_optimizer nvme: where the window's gradient sums are kept
  // (GradTier).
  GradTier grad_tier = GradTier::kAuto;
  // The optimizer step runs in the background while the next forward pass
  // starts: a module's forward waits only for the sub-groups holding its
  // parameters. Arithmetic is unchanged (bitwise the same parameters); an
  // I/O error of the step is reported by the next Engine call instead of by
  // Step(). false = Step() returns when the optimizer is done (DeepSpeed's
  // behaviour).
  bool overlap_optimizer = true;
  // ZeRO-Offload's one-step delayed parameter update (DPU): the optimizer of
  // step t runs during forward/backward of step t+1, which uses the
  // parameters of step t-1. Off by default: it changes the trajectory.
  bool delayed_param_update = false;
  // Optimizer steps taken synchronously before DPU starts (the ZeRO-Offload
  // paper starts it after a few dozen steps, when gradients change slowly).
  int64_t delayed_param_update_warmup = 0;
  // The CPU step during the window's last backward pass, validated after
  // the global checks (docs/design.md, "The speculative step"): each
  // sub-group is stepped as soon as its gradients are final, assuming no
  // overflow and no clipping, and redone from its saved states when the
  // checks disagree. Bitwise the same parameters and states either way.
  // Unset ("auto"): on with a GPU where it applies (the optimizer on the CPU
  // with its states in memory, one rank, no delayed_param_update); off on
  // the host device, where the CPU step would compete with the backward
  // pass for the same cores.
  std::optional<bool> speculative_step;
  // The optimizer states' format (OptimizerStates). Not given: bf16-master
  // when DeepSpeed's bf16.bf16_master_weights_and_grads and
  // bf16.bf16_optimizer_states are both true, else fp32; given beside them,
  // it must agree.
  OptimizerStates optimizer_states = OptimizerStates::kFp32;
  HostDeviceConfig host_device;
  // Sections of `strata` owned by the application that reads them, not by
  // the library (`strata.model`, the example model of `strata train`, is
  // one): section name -> the section's JSON object as compact text with
  // sorted keys (nlohmann::json::dump()), present when the config gives the
  // section. The loader checks only that each is an object and does not warn
  // about its keys; ConfigToJson writes it back; the application parses and
  // validates it. ValidateConfig refuses a name the loader does not know and
  // text that is not a JSON object.
  std::map<std::string, std::string> application_sections;

  bool operator==(const StrataConfig&) const = default;
};

struct Config {
  ZeroConfig zero_optimization;
  AioConfig aio;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;  // type kNone: the lr stays optimizer.params.lr
  Fp16Config fp16;
  bool bf16_enabled = false;  // bf16.enabled
  // DeepSpeed's bf16.bf16_master_weights_and_grads and
  // bf16.bf16_optimizer_states, as given: both true select the bf16-master
  // state format (strata.optimizer_states). Strata's gradient sums stay fp32.
  bool bf16_master_weights_and_grads = false;
  bool bf16_optimizer_states = false;
  double gradient_clipping = 0.0;  // 0 = no clipping
  // Batch sizes: any two determine the third (train = micro × accumulation on
  // one rank). Absent or "auto" values are derived; all three absent gives
  // micro = 1, accumulation = 1, train = 1. Inconsistent values are an error.
  int64_t train_batch_size = 1;
  int64_t train_micro_batch_size_per_gpu = 1;
  int64_t gradient_accumulation_steps = 1;
  StrataConfig strata;

  // Warnings produced while loading (unknown or unused keys, ignored
  // sections), one line each.
  std::vector<std::string> warnings;
  // Notices: what Strata chose where the config left it open ("auto"
  // resolved, no optimizer section, a legacy form read, a 0 resolved), one
  // line each naming the key and the value used.
  std::vector<std::string> notices;
};

// Compares every setting; ignores `warnings` and `notices`.
bool operator==(const Config& a, const Config& b);

// Input limits of ParseConfig (see the top of this file).
inline constexpr int kMaxConfigDepth = 64;                  // nested objects/arrays
inline constexpr size_t kMaxConfigBytes = size_t{4} << 20;  // 4 MiB of JSON text

// Values a frontend supplies for the keys a config writes as "auto", the way
// the Hugging Face integration fills them from its TrainingArguments. A
// member that is set replaces "auto" (never a value the config writes); one
// that is unset leaves Strata's default. Either way the notice says which
// value was used. The values are validated like the config's own.
struct AutoValues {
  std::optional<int64_t> train_batch_size;
  std::optional<int64_t> train_micro_batch_size_per_gpu;
  std::optional<int64_t> gradient_accumulation_steps;
  std::optional<double> gradient_clipping;
  std::optional<double> lr;            // optimizer.params.lr
  std::optional<double> beta1, beta2;  // optimizer.params.betas (both or either)
  std::optional<double> eps;
  std::optional<double> weight_decay;
  std::optional<bool> fp16_enabled;
  std::optional<bool> bf16_enabled;
  // scheduler.params (the Hugging Face trainer fills these from its warmup
  // and max steps; warmup_max_lr "auto" takes `lr`, warmup_min_lr "auto" 0).
  std::optional<int64_t> warmup_num_steps;
  std::optional<int64_t> total_num_steps;
};

// What the schedule gives the optimizer step that follows `applied_steps`
// applied optimizer steps: its learning rate and, for OneCycle with
// cycle_momentum, its betas. Without a schedule: optimizer.params.lr and the
// optimizer's betas.
struct ScheduledValues {
  double lr = 0.0;
  double beta1 = 0.0;
  double beta2 = 0.0;
  // For a schedule that scales each parameter group's own lr (none: 1;
  // WarmupCosineLR: its ratio, as DeepSpeed multiplies each group's initial
  // lr), the factor; empty for one that sets every group to `lr`.
  std::optional<double> lr_ratio;
};
ScheduledValues ScheduleAt(const Config& config, int64_t applied_steps);

// Parses JSON text. `source` names it in error messages (a file path, or
// "<string>"). Logs each warning (warn) and notice (info) as well as storing
// it. Never throws.
StatusOr<Config> ParseConfig(std::string_view json_text, std::string_view source = "<string>");
// The same, with values for the "auto" keys.
StatusOr<Config> ParseConfig(std::string_view json_text, std::string_view source,
                             const AutoValues& auto_values);
// Reads and parses a file. A missing or unreadable file is NotFound/IOError
// naming the path, and so is anything but a regular file (a FIFO, a device:
// opened without blocking and refused); a file over kMaxConfigBytes is
// InvalidArgument.
StatusOr<Config> LoadConfigFile(const std::string& path);
StatusOr<Config> LoadConfigFile(const std::string& path, const AutoValues& auto_values);
// The effective configuration (every key, defaults filled in) as DeepSpeed-
// style JSON. ParseConfig(ConfigToJson(c)) yields a Config equal to c.
std::string ConfigToJson(const Config& config, int indent = 2);
// Checks cross-field rules (e.g. nvme device needs nvme_path). ParseConfig
// calls it; call it again after editing a Config by hand.
Status ValidateConfig(const Config& config);

// The data-parallel ranks the batch sizes count (train_batch_size =
// train_micro_batch_size_per_gpu × gradient_accumulation_steps × ranks, as
// DeepSpeed's world size): WORLD_SIZE when it is a positive integer (as
// torchrun sets it; at most 2^24), else 1.
int64_t DataParallelRanks();

}  // namespace strata
