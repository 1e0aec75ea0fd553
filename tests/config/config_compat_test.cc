// Tests for src/config/config.cc with DeepSpeed configs written the way
// people write them: the Hugging Face integration's "auto"
// configs, Megatron-DeepSpeed's alias keys, the legacy boolean form, zeros,
// misplaced sections, Adagrad and Lion, duplicate keys. Each checks the
// effective values against what DeepSpeed resolves on one rank
// (deepspeed/runtime/zero/config.py, offload_config.py; DeepSpeedConfigModel
// drops "auto"). The configs are in tests/config/data/ (also fuzzing seeds).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "strata/config.h"

namespace strata {
namespace {

using ::testing::AllOf;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using json = nlohmann::json;

Config Load(const std::string& name, const AutoValues& autos = {}) {
  const std::string path = std::string(STRATA_SOURCE_DIR) + "/tests/config/data/" + name;
  StatusOr<Config> c = LoadConfigFile(path, autos);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *c : Config{};
}

Config Parse(const std::string& text, const AutoValues& autos = {}) {
  StatusOr<Config> c = ParseConfig(text, "<string>", autos);
  EXPECT_TRUE(c.ok()) << c.status() << "\n" << text;
  return c.ok() ? *c : Config{};
}

std::string ErrorOf(const std::string& text) {
  StatusOr<Config> c = ParseConfig(text);
  EXPECT_FALSE(c.ok()) << "parsed but should not have:\n" << text;
  if (c.ok()) return "";
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument) << c.status();
  return std::string(c.status().message());
}

// ---- 1. "auto" -------------------------------------------------------------

TEST(ConfigCompatAuto, HuggingFaceZero3StandaloneUsesDefaultsAndSaysSo) {
  Config c = Load("hf_zero3_auto.json");
  const ZeroConfig& z = c.zero_optimization;
  EXPECT_EQ(z.stage, 3);
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_TRUE(z.offload_optimizer.pin_memory);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kCpu);
  EXPECT_TRUE(z.offload_param.pin_memory);
  EXPECT_TRUE(z.overlap_comm);
  EXPECT_EQ(z.sub_group_size, 1'000'000'000);
  // DeepSpeed drops "auto": its defaults 5e8, 5e7, 1e5.
  EXPECT_EQ(z.reduce_bucket_size, 500'000'000);
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 50'000'000);
  EXPECT_EQ(z.stage3_param_persistence_threshold, 100'000);
  EXPECT_EQ(z.stage3_max_live_parameters, 1'000'000'000);
  EXPECT_EQ(z.stage3_max_reuse_distance, 1'000'000'000);
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdamW);
  EXPECT_EQ(c.optimizer.lr, 1e-3);
  EXPECT_EQ(c.optimizer.beta1, 0.9);
  EXPECT_EQ(c.optimizer.beta2, 0.999);
  EXPECT_EQ(c.optimizer.eps, 1e-8);
  EXPECT_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_FALSE(c.bf16_enabled);
  EXPECT_EQ(c.gradient_clipping, 0.0);
  EXPECT_EQ(c.train_batch_size, 1);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 1);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  // One notice per trainer value, naming the value used; none for the zero keys.
  for (const char* n :
       {"optimizer.params.lr: \"auto\" resolved to 0.001 (Strata's default for AdamW; "
        "no frontend value)",
        "optimizer.params.betas: \"auto\" resolved to [0.9, 0.999] (Strata's default "
        "for AdamW; no frontend value)",
        "optimizer.params.eps: \"auto\" resolved to 1e-08 (Strata's default for AdamW; "
        "no frontend value)",
        "fp16.enabled: \"auto\" resolved to false (Strata's default; no frontend value)",
        "bf16.enabled: \"auto\" resolved to false (Strata's default; no frontend value)",
        "gradient_clipping: \"auto\" resolved to 0 (Strata's default: no clipping; no "
        "frontend value)"}) {
    EXPECT_THAT(c.notices, Contains(n));
  }
  EXPECT_THAT(c.notices,
              Contains(HasSubstr("train_batch_size: \"auto\" resolved to 1 (no frontend value")));
  EXPECT_THAT(c.notices,
              Contains(HasSubstr("train_micro_batch_size_per_gpu: \"auto\" resolved to 1")));
  EXPECT_THAT(c.notices,
              Contains(HasSubstr("gradient_accumulation_steps: \"auto\" resolved to 1")));
  // The scheduler section's "auto" keys: WarmupLR from 0 to the optimizer's
  // lr over DeepSpeed's default 1000 steps.
  EXPECT_EQ(c.scheduler.type, LrScheduleType::kWarmupLR);
  EXPECT_EQ(c.scheduler.warmup_min_lr, 0.0);
  EXPECT_EQ(c.scheduler.warmup_max_lr, 0.001);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 1000);
  EXPECT_THAT(c.notices, Contains("scheduler.params.warmup_max_lr: \"auto\" resolved to 0.001 "
                                  "(optimizer.params.lr; no frontend value)"));
  EXPECT_EQ(c.notices.size(), 13u);
  EXPECT_THAT(c.warnings,
              Contains("DeepSpeed key zero_optimization.stage3_gather_16bit_weights_on_model_save "
                       "is not used by Strata (ignored)"));
  EXPECT_EQ(c.warnings.size(), 3u);  // + steps_per_print, wall_clock_breakdown
}

TEST(ConfigCompatAuto, FrontendSuppliesTheTrainerValues) {
  // What the Hugging Face trainer passes with its TrainingArguments defaults
  // (learning_rate 5e-5, adam_beta2 0.999, max_grad_norm 1, bf16, batch 8, ...).
  AutoValues autos;
  autos.lr = 5e-5;
  autos.beta1 = 0.9;
  autos.beta2 = 0.98;
  autos.eps = 1e-6;
  autos.weight_decay = 0.01;
  autos.gradient_clipping = 1.0;
  autos.fp16_enabled = false;
  autos.bf16_enabled = true;
  autos.train_micro_batch_size_per_gpu = 8;
  autos.gradient_accumulation_steps = 4;
  autos.train_batch_size = 32;
  autos.warmup_num_steps = 50;
  Config c = Load("hf_zero3_auto.json", autos);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 50);
  EXPECT_EQ(c.scheduler.warmup_max_lr, 5e-5);  // the trainer's learning_rate
  EXPECT_EQ(c.scheduler.warmup_min_lr, 0.0);
  EXPECT_EQ(c.optimizer.lr, 5e-5);
  EXPECT_EQ(c.optimizer.beta1, 0.9);
  EXPECT_EQ(c.optimizer.beta2, 0.98);
  EXPECT_EQ(c.optimizer.eps, 1e-6);
  EXPECT_EQ(c.optimizer.weight_decay, 0.01);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_TRUE(c.bf16_enabled);
  EXPECT_EQ(c.train_batch_size, 32);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 8);
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  EXPECT_THAT(c.notices,
              Contains("optimizer.params.lr: \"auto\" resolved to 5e-05 (given by the frontend)"));
  EXPECT_THAT(c.notices,
              Contains("train_batch_size: \"auto\" resolved to 32 (given by the frontend)"));
  EXPECT_THAT(c.notices,
              Contains("bf16.enabled: \"auto\" resolved to true (given by the frontend)"));

  // Only "auto" is replaced: a value the config writes wins.
  Config explicit_lr = Parse(
      R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.02}}, "train_batch_size": 6})", autos);
  EXPECT_EQ(explicit_lr.optimizer.lr, 0.02);
  EXPECT_EQ(explicit_lr.train_batch_size, 6);
  // The frontend's values are validated like the config's.
  AutoValues bad;
  bad.lr = -1;
  StatusOr<Config> refused =
      ParseConfig(R"({"optimizer": {"params": {"lr": "auto"}}})", "<string>", bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("optimizer.params.lr: -1"));
  // Inconsistent batch sizes from the frontend are an error too.
  AutoValues batch;
  batch.train_batch_size = 10;
  batch.train_micro_batch_size_per_gpu = 4;
  StatusOr<Config> bad_batch =
      ParseConfig(R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"})",
                  "<string>", batch);
  ASSERT_FALSE(bad_batch.ok());
  EXPECT_THAT(std::string(bad_batch.status().message()), HasSubstr("not a multiple"));
}

TEST(ConfigCompatAuto, BatchAutoIsDerivedFromTheOthers) {
  Config c = Parse(R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 3,
                       "gradient_accumulation_steps": 7})");
  EXPECT_EQ(c.train_batch_size, 21);
  EXPECT_THAT(c.notices,
              Contains(HasSubstr("train_batch_size: \"auto\" resolved to 21 (no frontend value; "
                                 "derived on one rank as train = micro x accumulation")));
}

TEST(ConfigCompatAuto, AutoEverywhereInZeroAndAioMeansTheDefault) {
  Config c = Load("hf_zero3_auto_everywhere.json");
  Config expected;
  ZeroConfig& z = expected.zero_optimization;
  z.stage = 3;
  z.overlap_comm = true;  // DeepSpeed's stage-3 default, "auto" dropped
  z.offload_param.device = OffloadDevice::kNvme;
  z.offload_param.nvme_path = {"/local_nvme"};
  z.offload_param.pin_memory = true;
  // (offload_optimizer.ratio "auto" is not the default: the plan picks it.)
  z.offload_optimizer.ratio_auto = true;
  EXPECT_TRUE(c == expected) << ConfigToJson(c);
  // No warning: every key is known; "auto" in the zero and aio sections is
  // silent, as in DeepSpeed.
  EXPECT_THAT(c.warnings, Contains(HasSubstr("stage3_gather_16bit_weights_on_model_save")));
  EXPECT_EQ(c.warnings.size(), 1u);
  for (const std::string& n : c.notices) EXPECT_THAT(n, Not(HasSubstr("zero_optimization"))) << n;

  // Each key on its own, and whole offload sections.
  for (const char* key :
       {"zero_optimization.stage", "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.overlap_comm", "zero_optimization.offload_optimizer.device",
        "zero_optimization.offload_param.buffer_size", "zero_optimization.offload_param",
        "zero_optimization.offload_optimizer", "zero_optimization.cpu_offload", "aio.block_size",
        "aio.use_gds", "aio.thread_count", "aio"}) {
    SCOPED_TRACE(key);
    json j = json::object();
    json* cur = &j;
    std::string path = key;
    for (size_t dot; (dot = path.find('.')) != std::string::npos; path = path.substr(dot + 1))
      cur = &(*cur)[path.substr(0, dot)];
    (*cur)[path] = "auto";
    Config one = Parse(j.dump());
    EXPECT_TRUE(one == Config{}) << ConfigToJson(one);
    EXPECT_THAT(one.warnings, IsEmpty());
  }
}

// ---- 2. Zeros ----------------------------------------------------------------

TEST(ConfigCompatZeros, ZerosHaveDeepSpeedsMeaning) {
  Config c = Load("zeros_nvme.json");
  const ZeroConfig& z = c.zero_optimization;
  // DeepSpeed: one parameter per sub-group / per gradient bucket. Strata's
  // sub-groups and buckets are element ranges: the documented fixed size.
  EXPECT_EQ(z.sub_group_size, kZeroMeansOneTensorElems);
  EXPECT_EQ(z.reduce_bucket_size, kZeroMeansOneTensorElems);
  EXPECT_EQ(kZeroMeansOneTensorElems, 1 << 20);
  EXPECT_THAT(c.notices,
              Contains(HasSubstr("zero_optimization.sub_group_size: 0 (one parameter per sub-group "
                                 "in DeepSpeed) resolved to 1048576 elements")));
  EXPECT_THAT(c.notices, Contains(HasSubstr(
                             "zero_optimization.reduce_bucket_size: 0 (one parameter's gradient "
                             "per bucket in DeepSpeed) resolved to 1048576 elements")));
  // 0 = no prefetching / only the module in use: carried as 0, as in DeepSpeed.
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 0);
  EXPECT_EQ(z.stage3_max_live_parameters, 0);
  // buffer_count 0 is fine where the buffers are unused (cpu).
  EXPECT_EQ(z.offload_optimizer.buffer_count, 0);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(c.aio.intra_op_parallelism, 1);
  EXPECT_TRUE(ValidateConfig(c).ok());
  // A Config never carries 0 for these two (the scheduler divides by them).
  Config hand = c;
  hand.zero_optimization.sub_group_size = 0;
  EXPECT_THAT(std::string(ValidateConfig(hand).message()),
              AllOf(HasSubstr("zero_optimization.sub_group_size: 0"), HasSubstr("must be > 0")));
}

TEST(ConfigCompatZeros, NoNvmeBuffersIsAnErrorWithNvme) {
  // DeepSpeed's swapper would stop at its first step ("ran out of swap buffers").
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme",
                         "nvme_path": "/nvme", "buffer_count": 0}}})"),
              AllOf(HasSubstr("zero_optimization.offload_optimizer.buffer_count: 0"),
                    HasSubstr("must be >= 1"), HasSubstr("\"nvme\"")));
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                         "nvme_path": "/nvme", "buffer_count": 0}}})"),
              AllOf(HasSubstr("zero_optimization.offload_param.buffer_count: 0"),
                    HasSubstr("must be >= 1")));
}

// ---- 3. Aliases ----------------------------------------------------------------

TEST(ConfigCompatAliases, MegatronStyleShortNames) {
  Config c = Load("megatron_aliases.json");
  const ZeroConfig& z = c.zero_optimization;
  EXPECT_EQ(z.stage, 3);
  EXPECT_EQ(z.stage3_max_live_parameters, 3'000'000'000);
  EXPECT_EQ(z.stage3_max_reuse_distance, 3'000'000'000);
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 50'000'000);
  EXPECT_EQ(z.stage3_param_persistence_threshold, 100'000);
  EXPECT_EQ(z.reduce_bucket_size, 90'000'000);
  // cpu_offload_param: offload_param.device cpu; cpu_offload_use_pin_memory
  // pins both sections (offload_optimizer writes no pin_memory of its own).
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kCpu);
  EXPECT_TRUE(z.offload_param.pin_memory);
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_TRUE(z.offload_optimizer.pin_memory);
  EXPECT_TRUE(c.bf16_enabled);
  EXPECT_EQ(c.gradient_accumulation_steps, 8);
  EXPECT_EQ(c.gradient_clipping, 1.0);
  for (const char* key :
       {"zero_optimization.model_persistence_threshold",
        "zero_optimization.gather_16bit_weights_on_model_save", "prescale_gradients"})
    EXPECT_THAT(c.warnings,
                Contains(std::string("DeepSpeed key ") + key + " is not used by Strata (ignored)"));
  for (const std::string& w : c.warnings) EXPECT_THAT(w, Not(HasSubstr("unknown key"))) << w;
}

TEST(ConfigCompatAliases, BothSpellingsMustAgree) {
  struct Case {
    const char* key;
    const char* alias;
  } cases[] = {{"stage3_max_live_parameters", "max_live_parameters"},
               {"stage3_max_reuse_distance", "max_reuse_distance"},
               {"stage3_prefetch_bucket_size", "prefetch_bucket_size"},
               {"stage3_param_persistence_threshold", "param_persistence_threshold"},
               {"stage3_model_persistence_threshold", "model_persistence_threshold"},
               {"stage3_module_granularity_threshold", "module_granularity_threshold"}};
  for (const auto& k : cases) {
    SCOPED_TRACE(k.key);
    // The same value twice (1e5 and 100000 are equal) is accepted.
    Parse(json{{"zero_optimization", {{"stage", 3}, {k.key, 1e5}, {k.alias, 100000}}}}.dump());
    EXPECT_THAT(
        ErrorOf(json{{"zero_optimization", {{"stage", 3}, {k.key, 5}, {k.alias, 7}}}}.dump()),
        AllOf(HasSubstr(std::string("zero_optimization.") + k.key + ": 5"),
              HasSubstr(std::string("zero_optimization.") + k.alias + ": 7"),
              HasSubstr("two spellings")));
  }
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": true,
                         "gather_16bit_weights_on_model_save": false}})"),
              AllOf(HasSubstr("stage3_gather_16bit_weights_on_model_save: true"),
                    HasSubstr("gather_16bit_weights_on_model_save: false")));
  EXPECT_THAT(ErrorOf(R"({"aio": {"intra_op_parallelism": 2, "thread_count": 4}})"),
              AllOf(HasSubstr("aio.intra_op_parallelism: 2"), HasSubstr("aio.thread_count: 4")));
  // The old offload booleans against each other and against the sections.
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"stage": 3, "cpu_offload_param": true,
                         "cpu_offload_params": false}})"),
              AllOf(HasSubstr("zero_optimization.cpu_offload_param: true"),
                    HasSubstr("zero_optimization.cpu_offload_params: false")));
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"stage": 3, "cpu_offload_param": true,
                         "offload_param": {"device": "nvme", "nvme_path": "/n"}}})"),
              AllOf(HasSubstr("zero_optimization.cpu_offload_param: true"),
                    HasSubstr("zero_optimization.offload_param.device: \"nvme\"")));
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"stage": 2, "cpu_offload": false,
                         "offload_optimizer": {"device": "cpu"}}})"),
              AllOf(HasSubstr("zero_optimization.cpu_offload: false"),
                    HasSubstr("zero_optimization.offload_optimizer.device: \"cpu\"")));
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": {"stage": 2, "cpu_offload_use_pin_memory": true,
                         "offload_optimizer": {"device": "cpu", "pin_memory": false}}})"),
              AllOf(HasSubstr("zero_optimization.cpu_offload_use_pin_memory: true"),
                    HasSubstr("zero_optimization.offload_optimizer.pin_memory: false")));
  // Agreeing spellings are fine.
  Config ok = Parse(R"({"zero_optimization": {"stage": 3, "cpu_offload_param": true,
                        "offload_param": {"device": "cpu"}, "cpu_offload": true,
                        "offload_optimizer": {"device": "cpu"}}})");
  EXPECT_EQ(ok.zero_optimization.offload_param.device, OffloadDevice::kCpu);
}

// ---- 4. Legacy boolean ---------------------------------------------------------------

TEST(ConfigCompatLegacy, ZeroOptimizationTrueIsStage1) {
  Config c = Load("legacy_boolean.json");
  EXPECT_EQ(c.zero_optimization.stage, 1);
  EXPECT_FALSE(c.zero_optimization.overlap_comm);
  EXPECT_EQ(c.zero_optimization.allgather_bucket_size,
            200'000'000);  // DeepSpeed reads allgather_size
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdam);
  EXPECT_EQ(c.optimizer.lr, 0.00015);
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_EQ(c.train_batch_size, 8);
  EXPECT_THAT(c.notices,
              Contains("zero_optimization: true read as stage 1 (DeepSpeed's legacy form)"));
  EXPECT_THAT(c.warnings, IsEmpty());

  Config off = Parse(R"({"zero_optimization": false, "allgather_size": 5})");
  EXPECT_EQ(off.zero_optimization.stage, 0);
  EXPECT_EQ(off.zero_optimization.allgather_bucket_size, 500'000'000);
  EXPECT_THAT(off.warnings,
              Contains(HasSubstr("DeepSpeed key allgather_size is not used by Strata")));
  EXPECT_THAT(ErrorOf(R"({"zero_optimization": 1})"),
              AllOf(HasSubstr("zero_optimization: 1"), HasSubstr("legacy true / false")));
}

// ---- 5, 6, 7. Ignored sections and DeepSpeed keys Strata does not use ----------------

TEST(ConfigCompatIgnored, OffloadParamBelowStage3AndAioInsideZero) {
  Config c = Load("zero2_misplaced.json");
  EXPECT_EQ(c.zero_optimization.stage, 2);
  EXPECT_EQ(c.zero_optimization.offload_param.device, OffloadDevice::kNone);
  EXPECT_EQ(c.zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.zero_optimization.allgather_bucket_size, 200'000'000);
  EXPECT_TRUE(c.aio == AioConfig{});
  EXPECT_THAT(c.warnings,
              Contains(AllOf(HasSubstr("zero_optimization.offload_param: device \"cpu\" ignored"),
                             HasSubstr("stage is 2"))));
  EXPECT_THAT(c.warnings,
              Contains(AllOf(HasSubstr("zero_optimization.aio: aio belongs at the top level"),
                             HasSubstr("the aio defaults are used"))));
  for (const char* key :
       {"zero_optimization.allgather_partitions", "zero_optimization.reduce_scatter",
        "zero_optimization.round_robin_gradients",
        "zero_optimization.stage3_module_granularity_threshold"})
    EXPECT_THAT(c.warnings,
                Contains(std::string("DeepSpeed key ") + key + " is not used by Strata (ignored)"));
  EXPECT_THAT(c.warnings,
              Contains("DeepSpeed key dataloader_drop_last is not used by Strata (ignored; the "
                       "framework feeds the batches)"));
  // DeepSpeed's bf16 state keys are read (a false one changes nothing).
  EXPECT_FALSE(c.bf16_master_weights_and_grads);
  EXPECT_EQ(c.strata.optimizer_states, OptimizerStates::kFp32);
  for (const std::string& w : c.warnings) EXPECT_THAT(w, Not(HasSubstr("unknown key"))) << w;

  // With a top-level aio, that one is used.
  Config both =
      Parse(R"({"aio": {"queue_depth": 64}, "zero_optimization": {"aio": {"queue_depth": 2}}})");
  EXPECT_EQ(both.aio.queue_depth, 64);
  EXPECT_THAT(both.warnings, Contains(HasSubstr("the top-level aio section is used")));
}

TEST(ConfigCompatIgnored, KnownKeysThatChangeNothingGetANotUsedWarning) {
  Config c = Parse(R"({"zenflow": {"topk_ratio": 0.1}, "zero_optimization": {"zenflow": {}},
                       "aio": {"io_backend": "aio"}, "optimizer": {"type": "AdamW", "params": {"amsgrad": false,
                       "fused": true}}, "fp16": {"fp16_master_weights_and_grads": false}})");
  for (const char* key :
       {"zenflow", "zero_optimization.zenflow", "aio.io_backend", "optimizer.params.amsgrad",
        "optimizer.params.fused", "fp16.fp16_master_weights_and_grads"})
    EXPECT_THAT(c.warnings, Contains(HasSubstr(std::string("DeepSpeed key ") + key +
                                               " is not used by Strata")));
  EXPECT_EQ(c.warnings.size(), 6u);
}

TEST(ConfigCompatIgnored, SettingsThatWouldChangeTrainingAreErrors) {
  EXPECT_EQ(ErrorOf(R"({"optimizer": {"type": "AdamW", "params": {"amsgrad": true}}})"),
            "optimizer.params.amsgrad: true is not supported: AMSGrad (the maximum of past second "
            "moments) "
            "is not implemented by Strata's CPU optimizer; it would change the training (remove "
            "the key or "
            "write false)");
  EXPECT_THAT(
      ErrorOf(R"({"optimizer": {"type": "Adagrad", "params": {"lr_decay": 0.01}}})"),
      AllOf(HasSubstr("optimizer.params.lr_decay: 0.01 is not supported"), HasSubstr("write 0")));
  EXPECT_THAT(
      ErrorOf(
          R"({"optimizer": {"type": "Adagrad", "params": {"initial_accumulator_value": 0.1}}})"),
      HasSubstr("optimizer.params.initial_accumulator_value: 0.1 is not supported"));
  EXPECT_THAT(ErrorOf(R"({"optimizer": {"params": {"maximize": true}}})"),
              HasSubstr("optimizer.params.maximize: true is not supported"));
  // Their neutral values are merely unused.
  Config c = Parse(
      R"({"optimizer": {"type": "Adagrad", "params": {"lr_decay": 0, "initial_accumulator_value": 0}}})");
  EXPECT_THAT(c.warnings, Contains(HasSubstr("optimizer.params.lr_decay is not used by Strata")));
}

// ---- 8, 9. Optimizers ---------------------------------------------------------------

TEST(ConfigCompatOptimizer, NoOptimizerSectionSaysAdamW) {
  Config c = Parse(R"({"zero_optimization": {"stage": 2}})");
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdamW);
  EXPECT_EQ(c.optimizer.lr, 1e-3);
  EXPECT_THAT(c.notices,
              Contains("no optimizer section: Strata uses AdamW with lr 0.001, betas [0.9, 0.999], "
                       "eps 1e-08, weight_decay 0 (DeepSpeed's defaults)"));
  EXPECT_EQ(c.notices.size(), 1u);
  Config no_type = Parse(R"({"optimizer": {"params": {"lr": 0.1}}})");
  EXPECT_THAT(no_type.notices, Contains("optimizer.type not given: Strata uses AdamW"));
  EXPECT_THAT(Parse(R"({"optimizer": {"type": "AdamW"}})").notices, IsEmpty());
}

TEST(ConfigCompatOptimizer, LionWithDeepSpeedsParams) {
  Config c = Load("lion.json");
  EXPECT_EQ(c.optimizer.type, OptimizerType::kLion);
  EXPECT_EQ(c.optimizer.lr, 1e-4);
  EXPECT_EQ(c.optimizer.beta1, 0.9);
  EXPECT_EQ(c.optimizer.beta2, 0.99);
  EXPECT_EQ(c.optimizer.weight_decay, 0.1);
  EXPECT_EQ(c.train_batch_size, 8);
  EXPECT_THAT(c.warnings, IsEmpty());
  // DeepSpeedCPULion's defaults: lr 1e-3, betas (0.9, 0.999), weight_decay 0.
  Config d = Parse(R"({"optimizer": {"type": "lion"}})");
  EXPECT_EQ(d.optimizer.type, OptimizerType::kLion);
  EXPECT_EQ(d.optimizer.lr, 1e-3);
  EXPECT_EQ(d.optimizer.beta1, 0.9);
  EXPECT_EQ(d.optimizer.beta2, 0.999);
  EXPECT_EQ(d.optimizer.weight_decay, 0.0);
  EXPECT_EQ(
      ErrorOf(R"({"optimizer": {"type": "Lion", "params": {"eps": 1e-8}}})"),
      "optimizer.params.eps: 1e-08 is not a parameter of Lion (it takes lr, betas, weight_decay)");
}

TEST(ConfigCompatOptimizer, AdagradWithDeepSpeedsParams) {
  Config c = Load("adagrad.json");
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdagrad);
  EXPECT_EQ(c.optimizer.lr, 0.05);
  EXPECT_EQ(c.optimizer.eps, 1e-10);  // DeepSpeedCPUAdagrad's default
  EXPECT_EQ(c.optimizer.weight_decay, 1e-4);
  EXPECT_EQ(c.zero_optimization.stage, 1);
  EXPECT_EQ(c.zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);
  Config d = Parse(R"({"optimizer": {"type": "Adagrad"}})");
  EXPECT_EQ(d.optimizer.lr, 1e-2);
  EXPECT_EQ(d.optimizer.eps, 1e-10);
  EXPECT_THAT(ErrorOf(R"({"optimizer": {"type": "Adagrad", "params": {"betas": [0.9, 0.99]}}})"),
              AllOf(HasSubstr("optimizer.params.betas: [0.9,0.99] is not a parameter of Adagrad"),
                    HasSubstr("lr, eps, weight_decay")));
  EXPECT_THAT(ErrorOf(R"({"optimizer": {"type": "Adagrad", "params": {"adam_w_mode": false}}})"),
              HasSubstr("optimizer.params.adam_w_mode: false is not a parameter of Adagrad"));
  // A round trip writes only the type's params.
  std::string text = ConfigToJson(c);
  json j = json::parse(text);
  EXPECT_FALSE(j["optimizer"]["params"].contains("betas"));
  StatusOr<Config> back = ParseConfig(text);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == c);
}

TEST(ConfigCompatOptimizer, OtherDeepSpeedOptimizersAreNamedAsUnsupported) {
  for (const char* type : {"Lamb", "OneBitAdam", "ZeroOneAdam", "MuAdam", "SGD"}) {
    SCOPED_TRACE(type);
    EXPECT_THAT(ErrorOf(json{{"optimizer", {{"type", type}}}}.dump()),
                AllOf(HasSubstr(std::string("optimizer.type: \"") + type + "\""),
                      HasSubstr("Adam, AdamW, Adagrad, Lion"), HasSubstr("Lamb")));
  }
}

// ---- 10. Duplicate keys -----------------------------------------------------------------

TEST(ConfigCompatDuplicates, RefusedNamingThePath) {
  EXPECT_EQ(ErrorOf(R"({"zero_optimization": {"stage": 2, "stage": 3}})"),
            "zero_optimization.stage: duplicate key (a key may appear once in an object; DeepSpeed "
            "refuses "
            "duplicates too)");
  EXPECT_THAT(ErrorOf(R"({"train_batch_size": 8, "train_batch_size": 8})"),
              HasSubstr("train_batch_size: duplicate"));
  EXPECT_THAT(
      ErrorOf(R"({"zero_optimization": {"offload_param": {"nvme_path": ["/a"], "device": "cpu",
                         "device": "nvme"}}})"),
      HasSubstr("zero_optimization.offload_param.device: duplicate key"));
  EXPECT_THAT(ErrorOf(R"({"x": [{"a": 1}, {"b": 1, "b": 2}]})"),
              HasSubstr("x[1].b: duplicate key"));
  // The same key in different objects is no duplicate.
  Parse(
      R"({"aio": {"queue_depth": 8}, "zero_optimization": {"stage": 0, "offload_param": {"pin_memory": false},
           "offload_optimizer": {"pin_memory": false}}})");
  // A file names itself.
  StatusOr<Config> c = ParseConfig(R"({"aio": {}, "aio": {}})", "ds.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().message(),
            "ds.json: aio: duplicate key (a key may appear once in an object; DeepSpeed "
            "refuses duplicates too)");
}

// ---- Every data config round-trips --------------------------------------------------

TEST(ConfigCompatRoundTrip, EveryDataConfig) {
  for (const char* name : {"hf_zero3_auto.json", "hf_zero3_auto_everywhere.json",
                           "megatron_aliases.json", "legacy_boolean.json", "zeros_nvme.json",
                           "zero2_misplaced.json", "lion.json", "adagrad.json"}) {
    SCOPED_TRACE(name);
    Config c = Load(name);
    StatusOr<Config> back = ParseConfig(ConfigToJson(c));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(*back == c) << ConfigToJson(c);
    EXPECT_THAT(back->warnings, IsEmpty());
  }
}

}  // namespace
}  // namespace strata
