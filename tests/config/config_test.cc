// Tests for src/config/config.cc: DeepSpeed defaults, "auto", exponent-form
// integers, every error category (message names path, value and what is
// allowed), unknown-key warnings, file errors, and ConfigToJson round trips.
#include "strata/config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace strata {
namespace {

using ::testing::AllOf;
using ::testing::Contains;
using ::testing::HasSubstr;
using json = nlohmann::json;

Config Parse(const std::string& text) {
  StatusOr<Config> c = ParseConfig(text);
  EXPECT_TRUE(c.ok()) << c.status() << "\n" << text;
  return c.ok() ? *c : Config{};
}

// The error message for `text`; fails the test if parsing succeeds.
std::string ErrorOf(const std::string& text) {
  StatusOr<Config> c = ParseConfig(text);
  EXPECT_FALSE(c.ok()) << "parsed but should not have:\n" << text;
  if (c.ok()) return "";
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status();
  return std::string(c.status().message());
}

// {"a": {"b": {"c": value}}} for path "a.b.c".
json Nest(const std::string& path, const json& value) {
  json root = json::object();
  json* cur = &root;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string key =
        path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (dot == std::string::npos) {
      (*cur)[key] = value;
      break;
    }
    cur = &(*cur)[key];
    start = dot + 1;
  }
  return root;
}

// Sets a stage so that offload sections are legal where the test needs them.
std::string WithPath(const std::string& path, const json& value) {
  json j = Nest(path, value);
  if (path.rfind("zero_optimization.", 0) == 0) j["zero_optimization"]["stage"] = 3;
  return j.dump();
}

std::vector<std::string> ExampleConfigs() {
  std::vector<std::string> files;
  for (const auto& e :
       std::filesystem::directory_iterator(std::string(STRATA_SOURCE_DIR) + "/configs"))
    if (e.path().extension() == ".json") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

// ---- Defaults -----------------------------------------------------------------

TEST(ConfigDefaults, EmptyObjectGivesDeepSpeedDefaults) {
  Config c = Parse("{}");
  EXPECT_TRUE(c.warnings.empty());
  EXPECT_TRUE(c == Config{});
  const ZeroConfig& z = c.zero_optimization;
  EXPECT_EQ(z.stage, 0);
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kNone);
  EXPECT_TRUE(z.offload_optimizer.nvme_path.empty());
  EXPECT_FALSE(z.offload_optimizer.pin_memory);
  EXPECT_EQ(z.offload_optimizer.buffer_count, 4);
  EXPECT_FALSE(z.offload_optimizer.fast_init);
  EXPECT_EQ(z.offload_optimizer.ratio, 1.0);
  EXPECT_FALSE(z.offload_optimizer.pipeline_read);
  EXPECT_FALSE(z.offload_optimizer.pipeline_write);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kNone);
  EXPECT_TRUE(z.offload_param.nvme_path.empty());
  EXPECT_FALSE(z.offload_param.pin_memory);
  EXPECT_EQ(z.offload_param.buffer_count, 5);
  EXPECT_EQ(z.offload_param.buffer_size, 100'000'000);
  EXPECT_EQ(z.offload_param.max_in_cpu, 1'000'000'000);
  EXPECT_EQ(z.sub_group_size, 1'000'000'000);
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 50'000'000);
  EXPECT_EQ(z.stage3_param_persistence_threshold, 100'000);
  EXPECT_EQ(z.stage3_max_live_parameters, 1'000'000'000);
  EXPECT_EQ(z.stage3_max_reuse_distance, 1'000'000'000);
  EXPECT_FALSE(z.overlap_comm);
  EXPECT_TRUE(z.contiguous_gradients);
  EXPECT_EQ(z.reduce_bucket_size, 500'000'000);
  EXPECT_EQ(z.allgather_bucket_size, 500'000'000);
  EXPECT_EQ(c.aio.block_size, 1'048'576);
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_EQ(c.aio.intra_op_parallelism, 1);
  EXPECT_FALSE(c.aio.single_submit);
  EXPECT_TRUE(c.aio.overlap_events);
  EXPECT_FALSE(c.aio.use_gds);
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdamW);
  EXPECT_EQ(c.optimizer.lr, 1e-3);
  EXPECT_EQ(c.optimizer.beta1, 0.9);
  EXPECT_EQ(c.optimizer.beta2, 0.999);
  EXPECT_EQ(c.optimizer.eps, 1e-8);
  EXPECT_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_TRUE(c.optimizer.adam_w_mode);
  EXPECT_TRUE(c.optimizer.bias_correction);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.loss_scale, 0.0);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.loss_scale_window, 1000);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_EQ(c.fp16.min_loss_scale, 1.0);
  EXPECT_FALSE(c.bf16_enabled);
  EXPECT_EQ(c.gradient_clipping, 0.0);
  EXPECT_EQ(c.train_batch_size, 1);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 1);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.strata.device, DeviceKind::kAuto);
  EXPECT_EQ(c.strata.device_id, 0);
  EXPECT_EQ(c.strata.hbm_budget_bytes, 0);
  EXPECT_EQ(c.strata.pinned_budget_bytes, 0);
  EXPECT_EQ(c.strata.trace_path, "");
  EXPECT_EQ(c.strata.threads, 0);
  EXPECT_EQ(c.strata.io_engine, IoEngineKind::kAuto);
  EXPECT_FALSE(c.strata.io_sqpoll);
  EXPECT_FALSE(c.strata.delayed_param_update);
  EXPECT_EQ(c.strata.delayed_param_update_warmup, 0);
  EXPECT_TRUE(c.strata.overlap_optimizer);
  EXPECT_EQ(c.strata.host_device.link_gbytes_per_s, 0.0);
  EXPECT_EQ(c.strata.host_device.link_latency_us, 0.0);
  EXPECT_TRUE(ValidateConfig(c).ok());
}

TEST(ConfigDefaults, EmptySectionsGiveDefaultsToo) {
  Config c =
      Parse(R"({"zero_optimization": {"offload_optimizer": {}, "offload_param": {}}, "aio": {},
                       "optimizer": {"params": {}}, "fp16": {}, "bf16": {}, "strata": {"host_device": {}}})");
  EXPECT_TRUE(c == Config{});
  EXPECT_TRUE(c.warnings.empty());
}

TEST(ConfigDefaults, OverlapCommDefaultsToTrueOnlyForStage3) {
  for (int stage = 0; stage <= 3; ++stage) {
    Config c = Parse(json{{"zero_optimization", {{"stage", stage}}}}.dump());
    EXPECT_EQ(c.zero_optimization.overlap_comm, stage == 3) << "stage " << stage;
  }
  Config c = Parse(R"({"zero_optimization": {"stage": 3, "overlap_comm": false}})");
  EXPECT_FALSE(c.zero_optimization.overlap_comm);
}

TEST(ConfigDefaults, AdamWModeFollowsTypeUnlessGiven) {
  // DeepSpeed's default is decoupled decay for Adam too; AdamW forces it.
  EXPECT_TRUE(Parse(R"({"optimizer": {"type": "Adam"}})").optimizer.adam_w_mode);
  EXPECT_FALSE(Parse(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})")
                   .optimizer.adam_w_mode);
  EXPECT_TRUE(Parse(R"({"optimizer": {"type": "AdamW"}})").optimizer.adam_w_mode);
  EXPECT_TRUE(Parse(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": true}}})")
                  .optimizer.adam_w_mode);
  EXPECT_TRUE(Parse(R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})")
                  .optimizer.adam_w_mode);
}

TEST(ConfigNames, EnumNames) {
  EXPECT_EQ(OffloadDeviceName(OffloadDevice::kNone), "none");
  EXPECT_EQ(OffloadDeviceName(OffloadDevice::kCpu), "cpu");
  EXPECT_EQ(OffloadDeviceName(OffloadDevice::kNvme), "nvme");
  EXPECT_EQ(OptimizerTypeName(OptimizerType::kAdam), "Adam");
  EXPECT_EQ(OptimizerTypeName(OptimizerType::kAdamW), "AdamW");
  EXPECT_EQ(OptimizerTypeName(OptimizerType::kAdagrad), "Adagrad");
  EXPECT_EQ(OptimizerTypeName(OptimizerType::kLion), "Lion");
  EXPECT_EQ(DeviceKindName(DeviceKind::kAuto), "auto");
  EXPECT_EQ(DeviceKindName(DeviceKind::kCuda), "cuda");
  EXPECT_EQ(DeviceKindName(DeviceKind::kHost), "host");
  EXPECT_EQ(IoEngineKindName(IoEngineKind::kAuto), "auto");
  EXPECT_EQ(IoEngineKindName(IoEngineKind::kUring), "uring");
  EXPECT_EQ(IoEngineKindName(IoEngineKind::kPosix), "posix");
}

// ---- Values as DeepSpeed users write them --------------------------------------

TEST(ConfigValues, EveryKeyIsRead) {
  Config c = Parse(R"({
    "train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 8,
    "gradient_clipping": 0.5,
    "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": ["/a", "/b"], "pin_memory": true, "buffer_count": 7,
                            "fast_init": true, "ratio": 0.25, "pipeline_read": true, "pipeline_write": true},
      "offload_param": {"device": "cpu", "nvme_path": "/p", "pin_memory": true, "buffer_count": 9,
                        "buffer_size": 123, "max_in_cpu": 456},
      "sub_group_size": 11, "stage3_prefetch_bucket_size": 12, "stage3_param_persistence_threshold": 13,
      "stage3_max_live_parameters": 14, "stage3_max_reuse_distance": 15, "overlap_comm": false,
      "contiguous_gradients": false, "reduce_bucket_size": 16, "allgather_bucket_size": 17},
    "aio": {"block_size": 4096, "queue_depth": 64, "intra_op_parallelism": 4, "single_submit": true,
            "overlap_events": false, "use_gds": true},
    "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.95], "eps": 1e-6,
                  "weight_decay": 0.1, "adam_w_mode": true, "bias_correction": false}},
    "fp16": {"enabled": true, "loss_scale": 128, "initial_scale_power": 12, "loss_scale_window": 500,
             "hysteresis": 3, "min_loss_scale": 0.5},
    "bf16": {"enabled": false},
    "strata": {"device": "host", "device_id": 2, "hbm_budget": "8G", "pinned_budget": 4096,
               "trace_path": "/tmp/t.json", "threads": 6, "io_engine": "posix", "io_sqpoll": true,
               "delayed_param_update": true, "delayed_param_update_warmup": 40,
               "overlap_optimizer": false, "grad_accumulator": "device", "dram_budget": "2G",
               "host_device": {"link_gbytes_per_s": 25.5, "link_latency_us": 3}}})");
  EXPECT_TRUE(c.warnings.empty());
  const ZeroConfig& z = c.zero_optimization;
  EXPECT_EQ(c.train_batch_size, 24);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 3);
  EXPECT_EQ(c.gradient_accumulation_steps, 8);
  EXPECT_EQ(c.gradient_clipping, 0.5);
  EXPECT_EQ(z.stage, 3);
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(z.offload_optimizer.nvme_path, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_TRUE(z.offload_optimizer.pin_memory);
  EXPECT_EQ(z.offload_optimizer.buffer_count, 7);
  EXPECT_TRUE(z.offload_optimizer.fast_init);
  EXPECT_EQ(z.offload_optimizer.ratio, 0.25);
  EXPECT_TRUE(z.offload_optimizer.pipeline_read);
  EXPECT_TRUE(z.offload_optimizer.pipeline_write);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(z.offload_param.nvme_path, (std::vector<std::string>{"/p"}));
  EXPECT_TRUE(z.offload_param.pin_memory);
  EXPECT_EQ(z.offload_param.buffer_count, 9);
  EXPECT_EQ(z.offload_param.buffer_size, 123);
  EXPECT_EQ(z.offload_param.max_in_cpu, 456);
  EXPECT_EQ(z.sub_group_size, 11);
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 12);
  EXPECT_EQ(z.stage3_param_persistence_threshold, 13);
  EXPECT_EQ(z.stage3_max_live_parameters, 14);
  EXPECT_EQ(z.stage3_max_reuse_distance, 15);
  EXPECT_FALSE(z.overlap_comm);
  EXPECT_FALSE(z.contiguous_gradients);
  EXPECT_EQ(z.reduce_bucket_size, 16);
  EXPECT_EQ(z.allgather_bucket_size, 17);
  EXPECT_EQ(c.aio.block_size, 4096);
  EXPECT_EQ(c.aio.queue_depth, 64);
  EXPECT_EQ(c.aio.intra_op_parallelism, 4);
  EXPECT_TRUE(c.aio.single_submit);
  EXPECT_FALSE(c.aio.overlap_events);
  EXPECT_TRUE(c.aio.use_gds);
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdam);
  EXPECT_EQ(c.optimizer.lr, 0.01);
  EXPECT_EQ(c.optimizer.beta1, 0.8);
  EXPECT_EQ(c.optimizer.beta2, 0.95);
  EXPECT_EQ(c.optimizer.eps, 1e-6);
  EXPECT_EQ(c.optimizer.weight_decay, 0.1);
  EXPECT_TRUE(c.optimizer.adam_w_mode);
  EXPECT_FALSE(c.optimizer.bias_correction);
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_EQ(c.fp16.loss_scale, 128.0);
  EXPECT_EQ(c.fp16.initial_scale_power, 12);
  EXPECT_EQ(c.fp16.loss_scale_window, 500);
  EXPECT_EQ(c.fp16.hysteresis, 3);
  EXPECT_EQ(c.fp16.min_loss_scale, 0.5);
  EXPECT_FALSE(c.bf16_enabled);
  EXPECT_EQ(c.strata.device, DeviceKind::kHost);
  EXPECT_EQ(c.strata.device_id, 2);
  EXPECT_EQ(c.strata.hbm_budget_bytes, int64_t{8} << 30);
  EXPECT_EQ(c.strata.pinned_budget_bytes, 4096);
  EXPECT_EQ(c.strata.trace_path, "/tmp/t.json");
  EXPECT_EQ(c.strata.threads, 6);
  EXPECT_EQ(c.strata.io_engine, IoEngineKind::kPosix);
  EXPECT_TRUE(c.strata.io_sqpoll);
  EXPECT_TRUE(c.strata.delayed_param_update);
  EXPECT_EQ(c.strata.delayed_param_update_warmup, 40);
  EXPECT_FALSE(c.strata.overlap_optimizer);
  EXPECT_EQ(c.strata.grad_accumulator, GradAccumulatorPlace::kDevice);
  EXPECT_EQ(c.strata.dram_budget_bytes, int64_t{2} << 30);
  EXPECT_EQ(c.strata.host_device.link_gbytes_per_s, 25.5);
  EXPECT_EQ(c.strata.host_device.link_latency_us, 3.0);
}

TEST(ConfigValues, ExponentFormIntegers) {
  Config c =
      Parse(R"({"zero_optimization": {"reduce_bucket_size": 5e8, "allgather_bucket_size": 2E9,
                       "stage3_max_live_parameters": 1.0e9, "stage": 2.0}, "train_batch_size": 6.4e1})");
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size, 500'000'000);
  EXPECT_EQ(c.zero_optimization.allgather_bucket_size, 2'000'000'000);
  EXPECT_EQ(c.zero_optimization.stage3_max_live_parameters, 1'000'000'000);
  EXPECT_EQ(c.zero_optimization.stage, 2);
  EXPECT_EQ(c.train_batch_size, 64);
}

TEST(ConfigValues, NonWholeOrHugeIntegersAreErrors) {
  EXPECT_THAT(ErrorOf(R"({"aio": {"queue_depth": 1.5}})"),
              AllOf(HasSubstr("aio.queue_depth"), HasSubstr("1.5"), HasSubstr("not an integer")));
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"reduce_bucket_size": 1e30}})"),
              AllOf(HasSubstr("zero_optimization.reduce_bucket_size"), HasSubstr("1e+30"),
                    HasSubstr("out of range")));
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"sub_group_size": 18446744073709551615}})"),
              AllOf(HasSubstr("zero_optimization.sub_group_size"),
                    HasSubstr("18446744073709551615"), HasSubstr("out of range")));
  EXPECT_THAT(ErrorOf(R"({"fp16": {"hysteresis": 1e10}})"),
              AllOf(HasSubstr("fp16.hysteresis"), HasSubstr("32 bits")));
  EXPECT_THAT(ErrorOf(R"({"aio": {"queue_depth": "8"}})"),
              AllOf(HasSubstr("aio.queue_depth"), HasSubstr("\"8\""), HasSubstr("not an integer")));
}

TEST(ConfigValues, EnumsAreCaseInsensitive) {
  Config c = Parse(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "CPU"},
                       "offload_param": {"device": "Cpu"}}, "optimizer": {"type": "adamw"},
                       "strata": {"device": "CUDA", "io_engine": "URing"}})");
  EXPECT_EQ(c.zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.zero_optimization.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdamW);
  EXPECT_EQ(c.strata.device, DeviceKind::kCuda);
  EXPECT_EQ(c.strata.io_engine, IoEngineKind::kUring);
  EXPECT_EQ(Parse(R"({"optimizer": {"type": "ADAM"}})").optimizer.type, OptimizerType::kAdam);
}

TEST(ConfigValues, AutoResolvesToDefaultWhereDeepSpeedAllowsIt) {
  const char* kAutoKeys[] = {"train_batch_size",
                             "train_micro_batch_size_per_gpu",
                             "gradient_accumulation_steps",
                             "gradient_clipping",
                             "optimizer.params.lr",
                             "optimizer.params.betas",
                             "optimizer.params.eps",
                             "optimizer.params.weight_decay",
                             "fp16.enabled",
                             "bf16.enabled",
                             "zero_optimization.reduce_bucket_size",
                             "zero_optimization.stage3_prefetch_bucket_size",
                             "zero_optimization.stage3_param_persistence_threshold",
                             "zero_optimization.sub_group_size",
                             "zero_optimization.allgather_bucket_size"};
  for (const char* key : kAutoKeys) {
    SCOPED_TRACE(key);
    std::string text = Nest(key, "auto").dump();
    Config c = Parse(text);
    EXPECT_TRUE(c == Config{}) << ConfigToJson(c);
    EXPECT_TRUE(c.warnings.empty());
  }
  // A typical Hugging Face config: everything "auto" at once.
  Config c = Parse(R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
      "stage3_param_persistence_threshold": "auto", "sub_group_size": "auto", "allgather_bucket_size": "auto"}})");
  Config expected;
  expected.zero_optimization.stage = 3;
  expected.zero_optimization.overlap_comm = true;
  EXPECT_TRUE(c == expected) << ConfigToJson(c);
}

TEST(ConfigValues, AutoIsATypeErrorElsewhere) {
  // (zero_optimization and aio keys take "auto" as "the default": config_compat_test.cc.)
  const char* kNoAutoKeys[] = {"fp16.loss_scale",
                               "fp16.hysteresis",
                               "optimizer.params.adam_w_mode",
                               "optimizer.params.bias_correction",
                               "strata.threads",
                               "strata.device_id",
                               "strata.host_device.link_latency_us"};
  for (const char* key : kNoAutoKeys) {
    SCOPED_TRACE(key);
    EXPECT_THAT(ErrorOf(Nest(key, "auto").dump()), AllOf(HasSubstr(key), HasSubstr("\"auto\""),
                                                         HasSubstr("not accepted for this key")));
  }
}

TEST(ConfigValues, NvmePathStringOrList) {
  Config c = Parse(R"({"zero_optimization": {"stage": 3,
    "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"},
    "offload_param": {"device": "nvme", "nvme_path": ["/nvme0", "/nvme1", "/nvme2"]}}})");
  EXPECT_EQ(c.zero_optimization.offload_optimizer.nvme_path,
            (std::vector<std::string>{"/local_nvme"}));
  EXPECT_EQ(c.zero_optimization.offload_param.nvme_path,
            (std::vector<std::string>{"/nvme0", "/nvme1", "/nvme2"}));
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"offload_optimizer": {"nvme_path": ["/a", 3]}}})"),
              AllOf(HasSubstr("zero_optimization.offload_optimizer.nvme_path[1]"), HasSubstr("3"),
                    HasSubstr("non-empty string")));
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"offload_param": {"nvme_path": 7}}})"),
              AllOf(HasSubstr("zero_optimization.offload_param.nvme_path"), HasSubstr("7"),
                    HasSubstr("list of directory strings")));
}

TEST(ConfigValues, ByteSizesInStrataSection) {
  struct Case {
    json value;
    int64_t bytes;
  } cases[] = {{"8G", int64_t{8} << 30},
               {"512M", int64_t{512} << 20},
               {"64KiB", 64 << 10},
               {"1.5GB", int64_t{3} << 29},
               {"2t", int64_t{2} << 40},
               {"4096", 4096},
               {"100B", 100},
               {1073741824, int64_t{1} << 30},
               {4e9, 4'000'000'000},
               {" 16 MiB ", int64_t{16} << 20}};
  for (const auto& [value, bytes] : cases) {
    SCOPED_TRACE(value.dump());
    Config c = Parse(json{{"strata", {{"hbm_budget", value}, {"pinned_budget", value}}}}.dump());
    EXPECT_EQ(c.strata.hbm_budget_bytes, bytes);
    EXPECT_EQ(c.strata.pinned_budget_bytes, bytes);
  }
  for (const json& bad : {json("8X"), json("G"), json("-1G"), json(-5), json(1.5), json("1.2.3M"),
                          json(true), json("0.1K"), json("99999999999T")}) {
    SCOPED_TRACE(bad.dump());
    EXPECT_THAT(ErrorOf(json{{"strata", {{"pinned_budget", bad}}}}.dump()),
                AllOf(HasSubstr("strata.pinned_budget"), HasSubstr(bad.dump()),
                      HasSubstr("byte count"), HasSubstr("\"8G\"")));
  }
}

TEST(ConfigValues, DeprecatedDeepSpeedSpellings) {
  Config c = Parse(R"({"aio": {"thread_count": 3}, "bfloat16": {"enabled": true}})");
  EXPECT_EQ(c.aio.intra_op_parallelism, 3);
  EXPECT_TRUE(c.bf16_enabled);
  EXPECT_TRUE(c.warnings.empty());
  EXPECT_EQ(
      Parse(R"({"aio": {"thread_count": 3, "intra_op_parallelism": 3}})").aio.intra_op_parallelism,
      3);
  EXPECT_THAT(ErrorOf(R"({"aio": {"thread_count": 3, "intra_op_parallelism": 2}})"),
              AllOf(HasSubstr("aio.thread_count: 3"), HasSubstr("aio.intra_op_parallelism: 2")));
  EXPECT_THAT(ErrorOf(R"({"aio": {"thread_count": 0}})"),
              AllOf(HasSubstr("aio.thread_count: 0"), HasSubstr("> 0")));
  EXPECT_THAT(ErrorOf(R"({"bf16": {"enabled": true}, "bfloat16": {"enabled": true}})"),
              AllOf(HasSubstr("bf16"), HasSubstr("bfloat16")));

  Config old = Parse(
      R"({"zero_optimization": {"stage": 2, "cpu_offload": true, "cpu_offload_use_pin_memory": true}})");
  EXPECT_EQ(old.zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_TRUE(old.zero_optimization.offload_optimizer.pin_memory);
  Config old3 = Parse(R"({"zero_optimization": {"stage": 3, "cpu_offload_params": true}})");
  EXPECT_EQ(old3.zero_optimization.offload_param.device, OffloadDevice::kCpu);
  Config pipe =
      Parse(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"pipeline": true}}})");
  EXPECT_TRUE(pipe.zero_optimization.offload_optimizer.pipeline_read);
  EXPECT_TRUE(pipe.zero_optimization.offload_optimizer.pipeline_write);
}

// ---- Batch sizes -----------------------------------------------------------------

TEST(ConfigBatch, AnyTwoDeriveTheThird) {
  struct Case {
    const char* text;
    int64_t train, micro, gas;
  } cases[] = {
      {R"({})", 1, 1, 1},
      {R"({"train_batch_size": 32})", 32, 32, 1},
      {R"({"train_micro_batch_size_per_gpu": 4})", 4, 4, 1},
      {R"({"gradient_accumulation_steps": 5})", 5, 1, 5},
      {R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})", 32, 4, 8},
      {R"({"train_batch_size": 32, "gradient_accumulation_steps": 2})", 32, 16, 2},
      {R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 7})", 21, 3, 7},
      {R"({"train_batch_size": 21, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 7})",
       21, 3, 7},
      {R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 7})",
       21, 3, 7},
  };
  for (const auto& k : cases) {
    SCOPED_TRACE(k.text);
    Config c = Parse(k.text);
    EXPECT_EQ(c.train_batch_size, k.train);
    EXPECT_EQ(c.train_micro_batch_size_per_gpu, k.micro);
    EXPECT_EQ(c.gradient_accumulation_steps, k.gas);
  }
}

TEST(ConfigBatch, InconsistentOrNonPositiveIsAnError) {
  EXPECT_THAT(
      ErrorOf(
          R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4})"),
      AllOf(HasSubstr("train_batch_size: 32"), HasSubstr("train_micro_batch_size_per_gpu 4"),
            HasSubstr("gradient_accumulation_steps 4"), HasSubstr("16")));
  EXPECT_THAT(ErrorOf(R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4})"),
              AllOf(HasSubstr("train_batch_size: 30"), HasSubstr("not a multiple"),
                    HasSubstr("train_micro_batch_size_per_gpu 4")));
  EXPECT_THAT(ErrorOf(R"({"train_batch_size": 30, "gradient_accumulation_steps": 4})"),
              AllOf(HasSubstr("train_batch_size: 30"), HasSubstr("gradient_accumulation_steps 4")));
  for (const char* key :
       {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"}) {
    for (int v : {0, -3}) {
      SCOPED_TRACE(std::string(key) + "=" + std::to_string(v));
      EXPECT_THAT(
          ErrorOf(json{{key, v}}.dump()),
          AllOf(HasSubstr(std::string(key) + ": " + std::to_string(v)), HasSubstr("must be > 0")));
    }
  }
  EXPECT_THAT(
      ErrorOf(R"({"train_micro_batch_size_per_gpu": 4e18, "gradient_accumulation_steps": 4})"),
      HasSubstr("overflows"));
}

// ---- Errors: type, enum, range, cross-field ---------------------------------------

TEST(ConfigErrors, BadTypes) {
  struct Case {
    const char* path;
    json value;
    const char* allowed;
  } cases[] = {
      {"zero_optimization.stage", "two", "not an integer"},
      {"zero_optimization.offload_optimizer.pin_memory", "true", "without quotes"},
      {"zero_optimization.offload_param.pin_memory", 1, "expected true or false"},
      {"zero_optimization.contiguous_gradients", "yes", "not a boolean"},
      {"aio.single_submit", 0, "not a boolean"},
      {"fp16.enabled", "true", "not a boolean"},
      {"bf16.enabled", 1, "not a boolean"},
      {"strata.io_sqpoll", "false", "not a boolean"},
      {"strata.delayed_param_update", json::array(), "not a boolean"},
      {"strata.overlap_optimizer", "yes", "not a boolean"},
      {"strata.speculative_step", "yes", "not a boolean"},
      {"strata.speculative_step", 1, "expected true or false"},
      {"strata.grad_accumulator", "gpu", "auto, device, host"},
      {"strata.grad_tier", "disk", "auto, dram, nvme, hbm"},
      {"optimizer.params.lr", "1e-3", "not a number"},
      {"optimizer.params.eps", json::object(), "not a number"},
      {"gradient_clipping", true, "not a number"},
      {"strata.host_device.link_gbytes_per_s", "fast", "not a number"},
      {"strata.trace_path", 5, "not a string"},
      {"zero_optimization.offload_optimizer.device", 1, "expected one of none, cpu, nvme"},
      {"strata.device", true, "expected one of auto, cuda, host"},
      {"zero_optimization.offload_optimizer", "cpu", "not an object"},
      {"strata.host_device", 3, "not an object"},
      {"optimizer.params", json::array({1}), "not an object"},
  };
  for (const auto& k : cases) {
    SCOPED_TRACE(k.path);
    EXPECT_THAT(ErrorOf(Nest(k.path, k.value).dump()),
                AllOf(HasSubstr(std::string(k.path) + ": "), HasSubstr(k.value.dump()),
                      HasSubstr(k.allowed)));
  }
}

TEST(ConfigErrors, BadEnums) {
  EXPECT_EQ(ErrorOf(R"({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})"),
            "zero_optimization.offload_optimizer.device: \"gpu\" is not one of none, cpu, nvme");
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"offload_param": {"device": "disk"}}})"),
              AllOf(HasSubstr("zero_optimization.offload_param.device"), HasSubstr("\"disk\""),
                    HasSubstr("none, cpu, nvme")));
  EXPECT_THAT(ErrorOf(R"({"optimizer": {"type": "Lamb"}})"),
              AllOf(HasSubstr("optimizer.type"), HasSubstr("\"Lamb\""), HasSubstr("Adam, AdamW"),
                    HasSubstr("Adagrad, Lion"),
                    HasSubstr("Strata's CPU optimizer implements Adam, AdamW, Adagrad and Lion")));
  EXPECT_THAT(
      ErrorOf(R"({"strata": {"device": "tpu"}})"),
      AllOf(HasSubstr("strata.device"), HasSubstr("\"tpu\""), HasSubstr("auto, cuda, host")));
  EXPECT_THAT(
      ErrorOf(R"({"strata": {"io_engine": "aio"}})"),
      AllOf(HasSubstr("strata.io_engine"), HasSubstr("\"aio\""), HasSubstr("auto, uring, posix")));
}

TEST(ConfigErrors, ZeroOrNegativeSizes) {
  const char* kPositive[] = {"aio.block_size",           "aio.queue_depth",
                             "aio.intra_op_parallelism", "fp16.loss_scale_window",
                             "fp16.min_loss_scale",      "optimizer.params.eps"};
  for (const char* key : kPositive) {
    for (int v : {0, -1}) {
      SCOPED_TRACE(std::string(key) + "=" + std::to_string(v));
      EXPECT_THAT(
          ErrorOf(WithPath(key, v)),
          AllOf(HasSubstr(std::string(key) + ": " + std::to_string(v)), HasSubstr("must be > 0")));
    }
  }
  // Zero is meaningful here (DeepSpeed allows it too: ge=0); sub_group_size
  // and reduce_bucket_size 0 are resolved (config_compat_test.cc).
  const char* kNonNegative[] = {"zero_optimization.stage3_param_persistence_threshold",
                                "zero_optimization.stage3_max_reuse_distance",
                                "zero_optimization.sub_group_size",
                                "zero_optimization.reduce_bucket_size",
                                "zero_optimization.stage3_prefetch_bucket_size",
                                "zero_optimization.stage3_max_live_parameters",
                                "zero_optimization.allgather_bucket_size",
                                "zero_optimization.offload_optimizer.buffer_count",
                                "zero_optimization.offload_param.buffer_count",
                                "zero_optimization.offload_param.buffer_size",
                                "zero_optimization.offload_param.max_in_cpu",
                                "optimizer.params.lr",
                                "optimizer.params.weight_decay",
                                "fp16.loss_scale",
                                "gradient_clipping",
                                "strata.device_id",
                                "strata.threads",
                                "strata.delayed_param_update_warmup",
                                "strata.host_device.link_gbytes_per_s",
                                "strata.host_device.link_latency_us"};
  for (const char* key : kNonNegative) {
    SCOPED_TRACE(key);
    Parse(WithPath(key, 0));  // zero is meaningful here
    EXPECT_THAT(ErrorOf(WithPath(key, -2)),
                AllOf(HasSubstr(std::string(key) + ": -2"), HasSubstr("must be >= 0")));
  }
}

TEST(ConfigErrors, OtherRanges) {
  for (int stage : {-1, 4}) {
    EXPECT_THAT(ErrorOf(json{{"zero_optimization", {{"stage", stage}}}}.dump()),
                AllOf(HasSubstr("zero_optimization.stage: " + std::to_string(stage)),
                      HasSubstr("0, 1, 2, 3")));
  }
  EXPECT_THAT(ErrorOf(R"({"aio": {"block_size": 1000}})"),
              AllOf(HasSubstr("aio.block_size: 1000"), HasSubstr("multiple of 512")));
  for (double ratio : {0.0, -0.5, 1.5}) {
    SCOPED_TRACE(ratio);
    EXPECT_THAT(
        ErrorOf(WithPath("zero_optimization.offload_optimizer.ratio", ratio)),
        AllOf(HasSubstr("zero_optimization.offload_optimizer.ratio: "), HasSubstr("(0, 1]")));
  }
  // Below 1: stage 3 only, as in DeepSpeed; read, and not applied, with a
  // warning that says so.
  EXPECT_THAT(
      ErrorOf(
          R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})"),
      AllOf(HasSubstr("zero_optimization.offload_optimizer.ratio: 0.3"),
            HasSubstr("zero_optimization.stage 3 (it is 2)")));
  const Config partial = Parse(
      R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})");
  EXPECT_EQ(partial.zero_optimization.offload_optimizer.ratio, 0.3);
  EXPECT_FALSE(partial.zero_optimization.offload_optimizer.ratio_auto);
  EXPECT_TRUE(partial.warnings.empty());
  // "auto": the plan picks the split (not DeepSpeed's default of 1).
  const Config picked = Parse(
      R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": "auto"}}})");
  EXPECT_TRUE(picked.zero_optimization.offload_optimizer.ratio_auto);
  EXPECT_EQ(picked.zero_optimization.offload_optimizer.ratio, 1.0);
  EXPECT_THAT(ErrorOf(R"({"fp16": {"hysteresis": 0}})"),
              AllOf(HasSubstr("fp16.hysteresis: 0"), HasSubstr(">= 1")));
  EXPECT_THAT(ErrorOf(R"({"fp16": {"initial_scale_power": 100}})"),
              AllOf(HasSubstr("fp16.initial_scale_power: 100"), HasSubstr("[0, 64]")));
}

TEST(ConfigErrors, Betas) {
  EXPECT_THAT(ErrorOf(R"({"optimizer": {"params": {"betas": [0.9, 1.0]}}})"),
              AllOf(HasSubstr("optimizer.params.betas[1]: 1"), HasSubstr("[0, 1)")));
  EXPECT_THAT(ErrorOf(R"({"optimizer": {"params": {"betas": [-0.1, 0.9]}}})"),
              AllOf(HasSubstr("optimizer.params.betas[0]: -0.1"), HasSubstr("[0, 1)")));
  for (const char* bad :
       {"[0.9]", "[0.9, 0.99, 0.999]", "0.9", "[\"0.9\", 0.99]", "{\"b1\": 0.9}"}) {
    SCOPED_TRACE(bad);
    EXPECT_THAT(ErrorOf(std::string(R"({"optimizer": {"params": {"betas": )") + bad + "}}}"),
                AllOf(HasSubstr("optimizer.params.betas: "), HasSubstr("[beta1, beta2]")));
  }
}

TEST(ConfigErrors, CrossFieldRules) {
  EXPECT_THAT(
      ErrorOf(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}})"),
      AllOf(HasSubstr("zero_optimization.offload_optimizer.nvme_path"), HasSubstr("required"),
            HasSubstr("\"nvme\"")));
  EXPECT_THAT(
      ErrorOf(
          R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ""}}})"),
      AllOf(HasSubstr("zero_optimization.offload_param.nvme_path"), HasSubstr("required")));
  EXPECT_THAT(
      ErrorOf(
          R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": []}}})"),
      AllOf(HasSubstr("zero_optimization.offload_param.nvme_path"), HasSubstr("required")));
  // Below stage 3 the parser ignores offload_param (a warning, as DeepSpeed
  // ignores it: config_compat_test.cc); a hand-edited Config is still checked.
  Config stage2;
  stage2.zero_optimization.stage = 2;
  stage2.zero_optimization.offload_param.device = OffloadDevice::kCpu;
  EXPECT_THAT(std::string(ValidateConfig(stage2).message()),
              AllOf(HasSubstr("zero_optimization.offload_param.device: \"cpu\""),
                    HasSubstr("stage 3"), HasSubstr("stage is 2")));
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})"),
              AllOf(HasSubstr("zero_optimization.offload_optimizer.device: \"cpu\""),
                    HasSubstr(">= 1"), HasSubstr("stage is 0")));
  Parse(R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})");
  Parse(
      R"({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}}})");
  EXPECT_THAT(
      ErrorOf(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})"),
      AllOf(HasSubstr("fp16.enabled"), HasSubstr("bf16.enabled"), HasSubstr("at most one")));
  // Gradients on NVMe sit beside the states there, one window at a time.
  EXPECT_THAT(
      ErrorOf(
          R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "strata": {"grad_tier": "nvme"}})"),
      AllOf(HasSubstr("strata.grad_tier"), HasSubstr("offload_optimizer.device"),
            HasSubstr("\"cpu\""), HasSubstr("auto")));
  EXPECT_THAT(
      ErrorOf(
          R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, "strata": {"grad_tier": "nvme", "delayed_param_update": true}})"),
      AllOf(HasSubstr("strata.grad_tier"), HasSubstr("delayed_param_update")));
  Parse(
      R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, "strata": {"grad_tier": "nvme"}})");
  // Sums in HBM until the CPU step reads them: states in DRAM, one window
  // at a time.
  EXPECT_THAT(
      ErrorOf(
          R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, "strata": {"grad_tier": "hbm"}})"),
      AllOf(HasSubstr("strata.grad_tier"), HasSubstr("offload_optimizer.device"),
            HasSubstr("\"nvme\""), HasSubstr("\"dram\"")));
  EXPECT_THAT(
      ErrorOf(
          R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "strata": {"grad_tier": "hbm", "delayed_param_update": true}})"),
      AllOf(HasSubstr("strata.grad_tier"), HasSubstr("delayed_param_update")));
  Parse(
      R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "strata": {"grad_tier": "hbm"}})");
}

TEST(ConfigErrors, TopLevelMustBeAnObject) {
  EXPECT_THAT(ErrorOf("[1, 2]"), AllOf(HasSubstr("array"), HasSubstr("JSON object")));
  EXPECT_THAT(ErrorOf("42"), AllOf(HasSubstr("42"), HasSubstr("JSON object")));
}

TEST(ConfigErrors, MalformedJsonNamesLineAndColumn) {
  std::string msg = ErrorOf("{\n  \"aio\": {\n    \"block_size\": ,\n  }\n}");
  EXPECT_THAT(msg, AllOf(HasSubstr("<string>:3:19: malformed JSON"), HasSubstr("unexpected ','")));
  EXPECT_THAT(ErrorOf("{\"a\": 1,}"), HasSubstr("<string>:1:9: malformed JSON"));
  EXPECT_THAT(ErrorOf(""), HasSubstr("<string>:1:1: malformed JSON"));
  StatusOr<Config> c = ParseConfig("{\"a\": tru}", "my.json");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("my.json:1:"));
}

TEST(ConfigErrors, SourceNamedInValueErrors) {
  StatusOr<Config> c = ParseConfig(R"({"aio": {"queue_depth": 0}})", "run.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().message(), "run.json: aio.queue_depth: 0 is not allowed; must be > 0");
}

TEST(ConfigErrors, LongValuesAreTruncated) {
  std::string long_name(500, 'x');
  std::string msg = ErrorOf(json{{"strata", {{"device", long_name}}}}.dump());
  EXPECT_THAT(
      msg, AllOf(HasSubstr("strata.device"), HasSubstr("xxx..."), HasSubstr("auto, cuda, host")));
  EXPECT_LT(msg.size(), 200u);
}

// ---- Validation of hand-edited Configs ----------------------------------------------

TEST(ConfigValidate, HandEditedConfigs) {
  EXPECT_TRUE(ValidateConfig(Config{}).ok());
  Config c;
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  Status s = ValidateConfig(c);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("zero_optimization.offload_optimizer.nvme_path"));
  c.zero_optimization.offload_optimizer.nvme_path = {"/nvme", ""};
  EXPECT_THAT(std::string(ValidateConfig(c).message()), HasSubstr("nvme_path[1]"));
  c.zero_optimization.offload_optimizer.nvme_path = {"/nvme"};
  EXPECT_TRUE(ValidateConfig(c).ok());
  c.train_batch_size = 7;
  EXPECT_THAT(std::string(ValidateConfig(c).message()), HasSubstr("train_batch_size: 7"));
  c.train_batch_size = 1;
  c.strata.pinned_budget_bytes = -1;
  EXPECT_THAT(std::string(ValidateConfig(c).message()), HasSubstr("strata.pinned_budget: -1"));
}

// ---- Unknown keys ------------------------------------------------------------------

TEST(ConfigUnknownKeys, InsideASectionAreErrorsWithASuggestion) {
  // A misspelt key would leave its setting at the default: here, the
  // optimizer states on the device instead of the CPU.
  EXPECT_EQ(
      ErrorOf(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"devcie": "cpu"}}})"),
      "zero_optimization.offload_optimizer.devcie: unknown key; did you mean device?");
  EXPECT_EQ(ErrorOf(R"({"aio": {"queue_dept": 3}})"),
            "aio.queue_dept: unknown key; did you mean queue_depth?");
  EXPECT_EQ(ErrorOf(R"({"optimizer": {"params": {"Weight_Decay": 0.1}}})"),
            "optimizer.params.Weight_Decay: unknown key; did you mean weight_decay?");
  EXPECT_EQ(ErrorOf(R"({"strata": {"host_device": {"gbps": 3}}})"),
            "strata.host_device.gbps: unknown key (no such key in strata.host_device)");
  EXPECT_EQ(ErrorOf(R"({"strata": {"modle": {}}})"),
            "strata.modle: unknown key; did you mean model?");
  EXPECT_EQ(ErrorOf(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}})"),
            "scheduler.params.warmup_num_step: unknown key; did you mean warmup_num_steps?");
  // With no type DeepSpeed builds no schedule, but a key no schedule takes is
  // still refused.
  EXPECT_EQ(ErrorOf(R"({"scheduler": {"params": {"warmup_maxlr": 5}}})"),
            "scheduler.params.warmup_maxlr: unknown key; did you mean warmup_max_lr?");
  EXPECT_EQ(ErrorOf(R"({"zero_optimization": {"stage": 3, "bar": true}})"),
            "zero_optimization.bar: unknown key (no such key in zero_optimization)");
  // A DeepSpeed top-level name nested somewhere else is unknown there.
  EXPECT_THAT(ErrorOf(R"({"aio": {"steps_per_print": 1}})"),
              HasSubstr("aio.steps_per_print: unknown key"));
}

TEST(ConfigUnknownKeys, TopLevelNearAKnownNameIsAnErrorOtherwiseAWarning) {
  // zero_optimisation (British spelling) would mean no ZeRO at all.
  EXPECT_EQ(ErrorOf(R"({"zero_optimisation": {"stage": 3}})"),
            "zero_optimisation: unknown key; did you mean zero_optimization? (as written, "
            "zero_optimization is not read and keeps its default)");
  EXPECT_THAT(ErrorOf(R"({"Optimiser": {}})"), HasSubstr("did you mean optimizer?"));
  EXPECT_THAT(ErrorOf(R"({"gradient_cliping": 1.0})"),
              HasSubstr("did you mean gradient_clipping?"));
  EXPECT_THAT(ErrorOf(R"({"fp61": {}})"), HasSubstr("did you mean fp16?"));
  // Far from every name Strata reads: one warning, the rest of the config used.
  Config c = Parse(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                       "toplevel_typo": 1, "fp8": {}, "my_run_name": "x"})");
  EXPECT_THAT(c.warnings, Contains("unknown key toplevel_typo (ignored)"));
  EXPECT_THAT(c.warnings, Contains("unknown key fp8 (ignored)"));
  EXPECT_THAT(c.warnings, Contains("unknown key my_run_name (ignored)"));
  EXPECT_EQ(c.warnings.size(), 3u);
  // Warnings do not take part in equality.
  Config expected;
  expected.zero_optimization.stage = 3;
  expected.zero_optimization.overlap_comm = true;
  expected.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  EXPECT_TRUE(c == expected);
}

TEST(ConfigUnknownKeys, DeepSpeedKeysStrataDoesNotUseStayWarnings) {
  Config c = Parse(R"({"optimizer": {"params": {"amsgrad": false}},
                       "zero_optimization": {"stage": 3, "zenflow": {}}})");
  // amsgrad is DeepSpeed's; false changes nothing (true is an error: config_compat_test.cc).
  EXPECT_THAT(c.warnings,
              Contains("DeepSpeed key optimizer.params.amsgrad is not used by Strata (ignored)"));
  EXPECT_THAT(c.warnings,
              Contains(HasSubstr("DeepSpeed key zero_optimization.zenflow is not used")));
  EXPECT_EQ(c.warnings.size(), 2u);
}

TEST(ConfigWarnings, KnownDeepSpeedKeysGetASofterMessage) {
  Config c = Parse(
      R"({"steps_per_print": 10, "wall_clock_breakdown": false, "zero_allow_untested_optimizer": true,
                       "communication_data_type": "fp32",
                       "zero_optimization": {"stage": 2, "reduce_scatter": true, "allgather_partitions": true},
                       "fp16": {"auto_cast": false}})");
  for (const char* key :
       {"steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
        "communication_data_type", "zero_optimization.reduce_scatter",
        "zero_optimization.allgather_partitions", "fp16.auto_cast"}) {
    EXPECT_THAT(c.warnings,
                Contains(std::string("DeepSpeed key ") + key + " is not used by Strata (ignored)"));
  }
  EXPECT_EQ(c.warnings.size(), 7u);
}

// ---- Files -----------------------------------------------------------------------

TEST(ConfigFile, MissingFileIsNotFound) {
  testing::ScratchDir dir;
  std::string path = dir.str() + "/nope.json";
  StatusOr<Config> c = LoadConfigFile(path);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr(path));
}

TEST(ConfigFile, DirectoryIsIOError) {
  testing::ScratchDir dir;
  StatusOr<Config> c = LoadConfigFile(dir.str());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kIOError);
  EXPECT_THAT(std::string(c.status().message()),
              AllOf(HasSubstr(dir.str()), HasSubstr("directory")));
}

TEST(ConfigFile, UnreadableFileIsIOError) {
  if (::geteuid() == 0) GTEST_SKIP() << "root reads files whatever their mode";
  testing::ScratchDir dir;
  std::string path = dir.str() + "/secret.json";
  std::ofstream(path) << "{}";
  ASSERT_EQ(::chmod(path.c_str(), 0), 0);
  StatusOr<Config> c = LoadConfigFile(path);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kIOError);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr(path));
}

TEST(ConfigFile, ReadErrorIsIOError) {
  // Opening /proc/self/mem works; reading it from offset 0 fails (EIO), also as root.
  if (!std::filesystem::exists("/proc/self/mem")) GTEST_SKIP() << "no /proc";
  StatusOr<Config> c = LoadConfigFile("/proc/self/mem");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kIOError);
  EXPECT_THAT(std::string(c.status().message()),
              AllOf(HasSubstr("/proc/self/mem"), HasSubstr("errno")));
}

TEST(ConfigFile, MalformedFileNamesFileLineColumn) {
  testing::ScratchDir dir;
  std::string path = dir.str() + "/bad.json";
  std::ofstream(path) << "{\n  \"zero_optimization\": {\n    \"stage\": 2\n    \"x\": 1\n  }\n}\n";
  StatusOr<Config> c = LoadConfigFile(path);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  // nlohmann reports the position of the last character it read: the end of
  // the offending token ("x" in column 5..7).
  EXPECT_THAT(std::string(c.status().message()), AllOf(HasSubstr(path + ":4:7: malformed JSON"),
                                                       HasSubstr("unexpected string literal")));
}

TEST(ConfigFile, LoadsAndNamesFileInErrors) {
  testing::ScratchDir dir;
  std::string path = dir.str() + "/c.json";
  std::ofstream(path)
      << R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "gpu"}}})";
  StatusOr<Config> c = LoadConfigFile(path);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(
      c.status().message(),
      path + ": zero_optimization.offload_optimizer.device: \"gpu\" is not one of none, cpu, nvme");
  std::ofstream(path) << R"({"zero_optimization": {"stage": 1}})";
  StatusOr<Config> ok = LoadConfigFile(path);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->zero_optimization.stage, 1);
}

// ---- Examples and round trips ------------------------------------------------------------

TEST(ConfigExamples, AllThreeExamplesLoad) {
  std::vector<std::string> files = ExampleConfigs();
  ASSERT_GE(files.size(), 3u);
  const std::string dir = std::string(STRATA_SOURCE_DIR) + "/configs/";

  StatusOr<Config> z2 = LoadConfigFile(dir + "zero2_cpu_offload.json");
  ASSERT_TRUE(z2.ok()) << z2.status();
  EXPECT_EQ(z2->zero_optimization.stage, 2);
  EXPECT_EQ(z2->zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_TRUE(z2->zero_optimization.offload_optimizer.pin_memory);
  EXPECT_TRUE(z2->bf16_enabled);
  EXPECT_EQ(z2->zero_optimization.reduce_bucket_size, 500'000'000);

  StatusOr<Config> z3 = LoadConfigFile(dir + "zero3_cpu_offload.json");
  ASSERT_TRUE(z3.ok()) << z3.status();
  EXPECT_EQ(z3->zero_optimization.stage, 3);
  EXPECT_EQ(z3->zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(z3->zero_optimization.offload_param.device, OffloadDevice::kCpu);
  EXPECT_TRUE(z3->fp16.enabled);
  EXPECT_EQ(z3->fp16.loss_scale, 0.0);
  EXPECT_EQ(z3->train_batch_size, 32);

  StatusOr<Config> nv = LoadConfigFile(dir + "zero3_nvme_offload.json");
  ASSERT_TRUE(nv.ok()) << nv.status();
  EXPECT_EQ(nv->zero_optimization.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(nv->zero_optimization.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(nv->zero_optimization.offload_optimizer.nvme_path,
            std::vector<std::string>{"/local_nvme"});
  EXPECT_EQ(nv->zero_optimization.offload_param.nvme_path, std::vector<std::string>{"/local_nvme"});
  EXPECT_EQ(nv->aio.queue_depth, 16);
  EXPECT_EQ(nv->gradient_accumulation_steps, 8);
}

void ExpectRoundTrip(const Config& c) {
  std::string text = ConfigToJson(c);
  StatusOr<Config> back = ParseConfig(text);
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << text;
  EXPECT_TRUE(*back == c) << text << "\nvs\n" << ConfigToJson(*back);
  EXPECT_TRUE(back->warnings.empty()) << back->warnings.front();
  EXPECT_EQ(ConfigToJson(*back), text);
  // Compact form too.
  StatusOr<Config> compact = ParseConfig(ConfigToJson(c, -1));
  ASSERT_TRUE(compact.ok()) << compact.status();
  EXPECT_TRUE(*compact == c);
}

TEST(ConfigRoundTrip, Default) { ExpectRoundTrip(Config{}); }

TEST(ConfigRoundTrip, EveryExampleFile) {
  // What a frontend supplies for a config whose "auto" values have no
  // default (configs/hf_zero3_llama.json: the run's step counts).
  AutoValues autos;
  autos.warmup_num_steps = 10;
  autos.total_num_steps = 100;
  for (const std::string& file : ExampleConfigs()) {
    SCOPED_TRACE(file);
    StatusOr<Config> c = LoadConfigFile(file);
    if (!c.ok() &&
        c.status().message().find("needs a value from the frontend") != std::string_view::npos)
      c = LoadConfigFile(file, autos);
    ASSERT_TRUE(c.ok()) << c.status();
    ExpectRoundTrip(*c);
  }
}

TEST(ConfigRoundTrip, WritesEveryKeyWithEffectiveValues) {
  Config c = Parse(R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                       "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}},
                       "strata": {"pinned_budget": "1K"}})");
  json j = json::parse(ConfigToJson(c));
  EXPECT_EQ(j["train_batch_size"], 6);
  EXPECT_EQ(j["zero_optimization"]["offload_param"]["nvme_path"], json::array({"/x"}));
  EXPECT_EQ(j["zero_optimization"]["offload_optimizer"]["nvme_path"], json::array());
  EXPECT_EQ(j["zero_optimization"]["overlap_comm"], true);
  EXPECT_EQ(j["strata"]["pinned_budget"], 1024);
  EXPECT_EQ(j["optimizer"]["params"]["betas"], json::array({0.9, 0.999}));
  EXPECT_EQ(j["aio"]["intra_op_parallelism"], 1);
  for (const char* section : {"zero_optimization", "aio", "optimizer", "fp16", "bf16", "strata"})
    EXPECT_TRUE(j.contains(section)) << section;
  EXPECT_EQ(j["zero_optimization"].size(), 12u);
  // Application-owned sections (strata.model) only when the config gives them.
  EXPECT_EQ(j["strata"].size(), 17u);
  EXPECT_EQ(j["strata"]["speculative_step"], "auto");
  EXPECT_EQ(j["strata"]["optimizer_states"], "fp32");
  EXPECT_EQ(j["bf16"]["bf16_optimizer_states"], false);
  EXPECT_EQ(j["strata"]["grad_accumulator"], "auto");
  EXPECT_EQ(j["strata"]["grad_tier"], "auto");
}

TEST(ConfigRoundTrip, InvalidUtf8DoesNotThrow) {
  Config c;
  c.strata.trace_path = "/tmp/bad\xff\xfe.json";
  std::string text = ConfigToJson(c);
  StatusOr<Config> back = ParseConfig(text);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->strata.trace_path,
            "/tmp/bad\xEF\xBF\xBD\xEF\xBF\xBD.json");  // U+FFFD per bad byte
}

TEST(ConfigRoundTrip, RandomConfigs) {
  uint64_t seed = 0;
  std::mt19937_64 rng = testing::MakeRng(&seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  auto pos = [&](int64_t hi) { return std::uniform_int_distribution<int64_t>(1, hi)(rng); };
  auto unit = [&] { return std::uniform_real_distribution<double>(1e-6, 0.999999)(rng); };
  auto coin = [&] { return (rng() & 1) != 0; };
  for (int i = 0; i < 50; ++i) {
    Config c;
    ZeroConfig& z = c.zero_optimization;
    z.stage = static_cast<int>(rng() % 4);
    if (z.stage >= 1) z.offload_optimizer.device = static_cast<OffloadDevice>(rng() % 3);
    if (z.stage == 3) z.offload_param.device = static_cast<OffloadDevice>(rng() % 3);
    for (int p = 0, n = static_cast<int>(pos(3)); p < n; ++p) {
      z.offload_optimizer.nvme_path.push_back("/nvme" + std::to_string(pos(1000)));
      z.offload_param.nvme_path.push_back("/mnt/é/" + std::to_string(pos(1000)));
    }
    z.offload_optimizer.pin_memory = coin();
    z.offload_optimizer.buffer_count = pos(64);
    z.offload_optimizer.fast_init = coin();
    // (Below 1, at stage 3 only, it is read with a warning: not applied.)
    z.offload_optimizer.ratio = 1.0;
    z.offload_optimizer.pipeline_read = coin();
    z.offload_optimizer.pipeline_write = coin();
    z.offload_param.pin_memory = coin();
    z.offload_param.buffer_count = pos(64);
    z.offload_param.buffer_size = pos(int64_t{1} << 40);
    z.offload_param.max_in_cpu = pos(int64_t{1} << 40);
    z.sub_group_size = pos(int64_t{1} << 40);
    z.stage3_prefetch_bucket_size = pos(int64_t{1} << 40);
    z.stage3_param_persistence_threshold = pos(int64_t{1} << 40);
    z.stage3_max_live_parameters = pos(int64_t{1} << 40);
    z.stage3_max_reuse_distance = pos(int64_t{1} << 40);
    z.overlap_comm = coin();
    z.contiguous_gradients = coin();
    z.reduce_bucket_size = pos(int64_t{1} << 40);
    z.allgather_bucket_size = pos(int64_t{1} << 40);
    c.aio.block_size = 512 * pos(1 << 16);
    c.aio.queue_depth = pos(1024);
    c.aio.intra_op_parallelism = pos(64);
    c.aio.single_submit = coin();
    c.aio.overlap_events = coin();
    c.aio.use_gds = coin();
    c.optimizer.type = static_cast<OptimizerType>(rng() % 4);
    const bool adam =
        c.optimizer.type == OptimizerType::kAdam || c.optimizer.type == OptimizerType::kAdamW;
    c.optimizer.lr = unit() * 1e-2;
    c.optimizer.weight_decay = unit();
    // A type's own params; the others keep their defaults (config.h).
    if (c.optimizer.type != OptimizerType::kAdagrad) {
      c.optimizer.beta1 = unit();
      c.optimizer.beta2 = unit();
    }
    if (c.optimizer.type != OptimizerType::kLion) c.optimizer.eps = unit() * 1e-6;
    if (adam) {
      c.optimizer.adam_w_mode =
          c.optimizer.type == OptimizerType::kAdamW || coin();  // AdamW forces it
      c.optimizer.bias_correction = coin();
    }
    c.fp16.enabled = coin();
    c.bf16_enabled = !c.fp16.enabled && coin();
    c.fp16.loss_scale = coin() ? 0.0 : unit() * 65536;
    c.fp16.initial_scale_power = static_cast<int>(pos(32));
    c.fp16.loss_scale_window = pos(100000);
    c.fp16.hysteresis = static_cast<int>(pos(10));
    c.fp16.min_loss_scale = unit();
    c.gradient_clipping = unit() * 10;
    c.train_micro_batch_size_per_gpu = pos(64);
    c.gradient_accumulation_steps = pos(64);
    c.train_batch_size = c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps;
    c.strata.device = static_cast<DeviceKind>(rng() % 3);
    c.strata.device_id = pos(8) - 1;
    c.strata.hbm_budget_bytes = pos(int64_t{1} << 50);
    c.strata.pinned_budget_bytes = pos(int64_t{1} << 50);
    c.strata.trace_path = coin() ? "" : "/tmp/trace \"" + std::to_string(pos(100)) + "\".json";
    c.strata.threads = pos(256) - 1;
    c.strata.io_engine = static_cast<IoEngineKind>(rng() % 3);
    c.strata.io_sqpoll = coin();
    c.strata.delayed_param_update = coin();
    c.strata.delayed_param_update_warmup = pos(100) - 1;
    c.strata.overlap_optimizer = coin();
    if (coin()) c.strata.speculative_step = !c.strata.delayed_param_update && coin();
    c.strata.grad_accumulator = static_cast<GradAccumulatorPlace>(rng() % 3);
    c.strata.grad_tier = static_cast<GradTier>(rng() % 2);  // nvme and hbm need the states there
    c.strata.dram_budget_bytes = pos(int64_t{1} << 50) - 1;
    c.strata.host_device.link_gbytes_per_s = unit() * 64;
    c.strata.host_device.link_latency_us = unit() * 10;
    if (coin())
      c.strata.application_sections["model"] = json{
          {"layers", pos(96)},
          {"hidden", unit() * 1e4},
          {"name", std::to_string(pos(9))}}.dump();
    ASSERT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
    ExpectRoundTrip(c);
  }
}

}  // namespace
}  // namespace strata

// ---- strata.model: a section the application owns ------------------------------------

namespace strata {
namespace {

TEST(ConfigApplicationSection, AbsentByDefault) {
  EXPECT_TRUE(Parse("{}").strata.application_sections.empty());
}

TEST(ConfigApplicationSection, KeptAsTextUnreadAndWithoutWarnings) {
  // The library reads nothing in it: values it would refuse elsewhere, and
  // keys it does not know, are the application's to judge.
  Config c = Parse(R"({"strata": {"model": {"layers": 0, "hidden": "auto", "heads": 8}}})");
  ASSERT_EQ(c.strata.application_sections.count("model"), 1u);
  EXPECT_EQ(json::parse(c.strata.application_sections.at("model")),
            json::parse(R"({"layers": 0, "hidden": "auto", "heads": 8})"));
  EXPECT_TRUE(c.warnings.empty());
}

TEST(ConfigApplicationSection, MustBeAnObject) {
  StatusOr<Config> c = ParseConfig(R"({"strata": {"model": 3}})");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(), HasSubstr("strata.model: 3 is not an object"));
}

TEST(ConfigApplicationSection, RoundTrip) {
  Config c = Parse(R"({"strata": {"model": {"layers": 3, "hidden": 96, "seed": 1e2}}})");
  ExpectRoundTrip(c);
  Config hand;
  hand.strata.application_sections["model"] = R"({"hidden":96,"layers":3})";
  ExpectRoundTrip(hand);
}

TEST(ConfigApplicationSection, ValidateRefusesUnknownNamesAndText) {
  Config c;
  c.strata.application_sections["modle"] = "{}";
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("strata.modle: not a section"));
  c.strata.application_sections.clear();
  c.strata.application_sections["model"] = "[1, 2";
  EXPECT_THAT(ValidateConfig(c).message(), HasSubstr("strata.model: the section's text is not"));
}

// strata.speculative_step: true, false, or "auto" / absent (the plan
// decides); not true with delayed_param_update.
TEST(ConfigStrata, SpeculativeStep) {
  auto spec = [](const char* text) {
    StatusOr<Config> c = ParseConfig(text);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? c->strata.speculative_step : std::optional<bool>(std::nullopt);
  };
  EXPECT_EQ(spec(R"({})"), std::nullopt);
  EXPECT_EQ(spec(R"({"strata": {"speculative_step": "auto"}})"), std::nullopt);
  EXPECT_EQ(spec(R"({"strata": {"speculative_step": true}})"), std::optional<bool>(true));
  EXPECT_EQ(spec(R"({"strata": {"speculative_step": false}})"), std::optional<bool>(false));
  const std::string msg =
      ErrorOf(R"({"strata": {"speculative_step": true, "delayed_param_update": true}})");
  EXPECT_THAT(msg, AllOf(HasSubstr("strata.speculative_step"),
                         HasSubstr("strata.delayed_param_update"), HasSubstr("\"auto\"")));
  EXPECT_TRUE(
      ParseConfig(R"({"strata": {"speculative_step": false, "delayed_param_update": true}})").ok());
}

// strata.optimizer_states and DeepSpeed's bf16 keys: what each selects, the
// combinations DeepSpeed refuses, the one Strata has no format for, and the
// optimizers and placements a compact format does not run with.
TEST(ConfigStrata, OptimizerStatesAndDeepSpeedsBf16Keys) {
  const std::string cpu =
      R"("zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}})";
  auto states = [&](const std::string& rest) {
    const Config c = Parse("{" + cpu + (rest.empty() ? "" : ", " + rest) + "}");
    return OptimizerStatesName(c.strata.optimizer_states);
  };
  EXPECT_EQ(states(""), "fp32");
  for (const char* f : {"fp32", "bf16", "bf16-master", "int8"})
    EXPECT_EQ(states(std::string(R"("strata": {"optimizer_states": ")") + f + "\"}"), f);
  const std::string both =
      R"("bf16": {"enabled": true, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true})";
  EXPECT_EQ(states(both), "bf16-master");
  EXPECT_EQ(states(both + R"(, "strata": {"optimizer_states": "bf16-master"})"), "bf16-master");
  // The old section name reads the same.
  EXPECT_EQ(
      states(
          R"("bfloat16": {"enabled": true, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true})"),
      "bf16-master");
  {
    const Config c = Parse("{" + cpu + ", " + both + "}");
    EXPECT_THAT(c.notices, Contains(HasSubstr("strata.optimizer_states: \"bf16-master\"")));
    // Round trip: the keys and the format they chose come back.
    StatusOr<Config> again = ParseConfig(ConfigToJson(c));
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(*again == c);
  }
  EXPECT_THAT(ErrorOf("{" + cpu + ", " + both + R"(, "strata": {"optimizer_states": "int8"}})"),
              AllOf(HasSubstr("strata.optimizer_states: \"int8\" disagrees"),
                    HasSubstr("bf16.bf16_optimizer_states")));
  // DeepSpeed: bf16_optimizer_states needs the bf16 master.
  EXPECT_THAT(ErrorOf("{" + cpu + R"(, "bf16": {"enabled": true, "bf16_optimizer_states": true}})"),
              AllOf(HasSubstr("bf16.bf16_optimizer_states: true needs "
                              "bf16.bf16_master_weights_and_grads true"),
                    HasSubstr("strata.optimizer_states \"bf16\"")));
  // A bf16 master beside fp32 moments: no such format here.
  EXPECT_THAT(
      ErrorOf("{" + cpu + R"(, "bf16": {"enabled": true, "bf16_master_weights_and_grads": true}})"),
      AllOf(HasSubstr("bf16.bf16_master_weights_and_grads: true without"),
            HasSubstr("not a state format Strata offers")));
  EXPECT_THAT(
      ErrorOf(
          "{" + cpu +
          R"(, "bf16": {"enabled": false, "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true}})"),
      HasSubstr("bf16.bf16_master_weights_and_grads: true needs bf16.enabled true"));
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"stage": 0}, )" + both + "}"),
              HasSubstr("needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0)"));
  EXPECT_THAT(ErrorOf("{" + cpu + R"(, "strata": {"optimizer_states": "fp8"}})"),
              AllOf(HasSubstr("strata.optimizer_states"), HasSubstr("bf16-master")));
  // Optimizers: Adagrad fp32 only, Lion not with a bf16 master.
  EXPECT_THAT(
      ErrorOf("{" + cpu +
              R"(, "optimizer": {"type": "Adagrad"}, "strata": {"optimizer_states": "bf16"}})"),
      AllOf(HasSubstr("strata.optimizer_states: \"bf16\" is not offered for "
                      "optimizer.type \"Adagrad\""),
            HasSubstr("Lion fp32, bf16 and int8")));
  EXPECT_THAT(
      ErrorOf("{" + cpu +
              R"(, "optimizer": {"type": "Lion"}, "strata": {"optimizer_states": "bf16-master"}})"),
      HasSubstr("\"bf16-master\" is not offered for optimizer.type \"Lion\""));
  EXPECT_EQ(states(R"("optimizer": {"type": "Lion"}, "strata": {"optimizer_states": "int8"})"),
            "int8");
  // Placements: every format in the CPU optimizer (states in DRAM or on
  // NVMe) and in HBM.
  for (const auto& [name, f] : {std::pair{"bf16", OptimizerStates::kBf16},
                                {"bf16-master", OptimizerStates::kBf16Master},
                                {"int8", OptimizerStates::kInt8}})
    EXPECT_EQ(Parse(std::string(R"({"zero_optimization": {"stage": 3, "offload_optimizer": )"
                                R"({"device": "none"}}, "strata": {"optimizer_states": ")") +
                    name + "\"}}")
                  .strata.optimizer_states,
              f)
        << name;
  EXPECT_EQ(
      Parse(
          R"({"strata": {"optimizer_states": "int8"}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})")
          .strata.optimizer_states,
      OptimizerStates::kInt8);
}

}  // namespace
}  // namespace strata
