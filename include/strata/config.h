// strata/config.h — Strata's configuration: DeepSpeed's JSON, as its users
// already write it, plus a `strata` section for what DeepSpeed lacks.
//
// Loading fills every field with DeepSpeed's default when the key is absent.
// Numbers may be written as integers or in exponent form (5e8); "auto" is
// accepted where DeepSpeed (and its Hugging Face integration) accept it and
// resolves to the default here. Unknown keys produce one warning each, naming
// the key path (also returned in Config::warnings). A wrong type or value is an
// InvalidArgument error naming the path, the value and what is allowed, e.g.
//   zero_optimization.offload_optimizer.device: "gpu" is not one of none, cpu, nvme
// Malformed JSON is an InvalidArgument error naming the file, line and column.
// Keys that take "auto": train_batch_size, train_micro_batch_size_per_gpu,
// gradient_accumulation_steps, gradient_clipping, optimizer.params.{lr, betas,
// eps, weight_decay}, fp16.enabled, bf16.enabled, zero_optimization.{
// reduce_bucket_size, allgather_bucket_size, stage3_prefetch_bucket_size,
// stage3_param_persistence_threshold, sub_group_size}; null is read as absent
// there too. Elsewhere "auto" is a type error.
//
// Plain data; thread-compatible.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

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
  int64_t buffer_count = 4;
  bool fast_init = false;
  double ratio = 1.0;  // fraction of the optimizer step done on the CPU (0, 1]
  bool pipeline_read = false;
  bool pipeline_write = false;

  bool operator==(const OffloadOptimizerConfig&) const = default;
};

// zero_optimization.offload_param
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::vector<std::string> nvme_path;
  bool pin_memory = false;
  int64_t buffer_count = 5;
  int64_t buffer_size = 100'000'000;   // elements
  int64_t max_in_cpu = 1'000'000'000;  // elements

  bool operator==(const OffloadParamConfig&) const = default;
};

// zero_optimization
struct ZeroConfig {
  int stage = 0;  // 0..3
  OffloadOptimizerConfig offload_optimizer;
  OffloadParamConfig offload_param;
  int64_t sub_group_size = 1'000'000'000;                // elements
  int64_t stage3_prefetch_bucket_size = 50'000'000;      // elements
  int64_t stage3_param_persistence_threshold = 100'000;  // elements
  int64_t stage3_max_live_parameters = 1'000'000'000;    // elements
  int64_t stage3_max_reuse_distance = 1'000'000'000;     // elements
  bool overlap_comm = false;  // when absent from JSON: true for stage 3 (DeepSpeed)
  bool contiguous_gradients = true;
  int64_t reduce_bucket_size = 500'000'000;     // elements
  int64_t allgather_bucket_size = 500'000'000;  // elements

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

enum class OptimizerType { kAdam, kAdamW };
std::string_view OptimizerTypeName(OptimizerType t);  // "Adam", "AdamW"

// optimizer
struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  double lr = 1e-3;
  double beta1 = 0.9;    // params.betas[0]
  double beta2 = 0.999;  // params.betas[1]
  double eps = 1e-8;
  double weight_decay = 0.0;
  // DeepSpeed's adam_w_mode: decoupled weight decay (AdamW) when true, L2
  // (Adam) when false. Defaults to true as in DeepSpeed; type AdamW forces it.
  bool adam_w_mode = true;
  bool bias_correction = true;

  bool operator==(const OptimizerConfig&) const = default;
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

// strata.host_device: the host backend's model of a PCIe link.
struct HostDeviceConfig {
  double link_gbytes_per_s = 0.0;  // 0 = unlimited (copies at memcpy speed)
  double link_latency_us = 0.0;

  bool operator==(const HostDeviceConfig&) const = default;
};

// strata.model: the example model `strata train` builds (examples/train): a
// byte-level residual-MLP language model.
struct ModelConfig {
  int64_t layers = 4;    // residual blocks, >= 1
  int64_t hidden = 256;  // width, >= 8
  int64_t seq_len = 64;  // tokens per sequence, >= 2
  int64_t vocab = 256;   // byte-level: must be 256
  int64_t seed = 1234;   // initialization and data; >= 0
  int64_t steps = 0;     // optimizer steps; 0 = use --steps or the command's default

  bool operator==(const ModelConfig&) const = default;
};

// strata: what DeepSpeed has no key for.
struct StrataConfig {
  DeviceKind device = DeviceKind::kAuto;
  int64_t device_id = 0;
  int64_t hbm_budget_bytes = 0;     // 0 = all free device memory
  int64_t pinned_budget_bytes = 0;  // 0 = sized from the placement
  std::string trace_path;           // Chrome-trace/Perfetto JSON; empty = off
  int64_t threads = 0;              // CPU optimizer threads; 0 = all cores of the NUMA node
  IoEngineKind io_engine = IoEngineKind::kAuto;
  bool io_sqpoll = false;             // io_uring SQPOLL
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
  HostDeviceConfig host_device;
  ModelConfig model;  // strata.model

  bool operator==(const StrataConfig&) const = default;
};

struct Config {
  ZeroConfig zero_optimization;
  AioConfig aio;
  OptimizerConfig optimizer;
  Fp16Config fp16;
  bool bf16_enabled = false;       // bf16.enabled
  double gradient_clipping = 0.0;  // 0 = no clipping
  // Batch sizes: any two determine the third (train = micro × accumulation on
  // one rank). Absent or "auto" values are derived; all three absent gives
  // micro = 1, accumulation = 1, train = 1. Inconsistent values are an error.
  int64_t train_batch_size = 1;
  int64_t train_micro_batch_size_per_gpu = 1;
  int64_t gradient_accumulation_steps = 1;
  StrataConfig strata;

  // Warnings produced while loading (unknown keys), one line each.
  std::vector<std::string> warnings;
};

// Compares every setting; ignores `warnings`.
bool operator==(const Config& a, const Config& b);

// Parses JSON text. `source` names it in error messages (a file path, or
// "<string>"). Logs each warning as well as storing it.
StatusOr<Config> ParseConfig(std::string_view json_text, std::string_view source = "<string>");
// Reads and parses a file. A missing or unreadable file is NotFound/IOError
// naming the path.
StatusOr<Config> LoadConfigFile(const std::string& path);
// The effective configuration (every key, defaults filled in) as DeepSpeed-
// style JSON. ParseConfig(ConfigToJson(c)) yields a Config equal to c.
std::string ConfigToJson(const Config& config, int indent = 2);
// Checks cross-field rules (e.g. nvme device needs nvme_path). ParseConfig
// calls it; call it again after editing a Config by hand.
Status ValidateConfig(const Config& config);

}  // namespace strata
