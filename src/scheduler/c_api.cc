// The C API (include/strata/strata_c.h): a thin wrapper over strata::Engine.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <system_error>
#include <vector>

#include "strata/engine.h"
#include "strata/strata.h"
#include "strata/strata_c.h"

struct strata_engine {
  std::unique_ptr<strata::Engine> engine;
};

namespace {

thread_local std::string g_last_error;

int Fail(const strata::Status& s) {
  g_last_error = s.ToString();
  return static_cast<int>(s.code());
}

int Check(const strata::Status& s) { return s.ok() ? STRATA_OK : Fail(s); }

int NullArg(const char* what) {
  return Fail(strata::InvalidArgumentError(std::string(what) + " is NULL"));
}

// The last line of defence: no exception crosses the C boundary. Whatever a
// call throws (std::bad_alloc, std::system_error from a thread that cannot
// start, anything else) becomes an error code and strata_last_error().
template <typename Fn>
int Guard(const char* call, Fn&& fn) noexcept {
  try {
    return fn();
  } catch (const std::bad_alloc& e) {
    return Fail(
        strata::ResourceExhaustedError(std::string(call) + ": out of memory (" + e.what() + ")"));
  } catch (const std::system_error& e) {
    return Fail(strata::ResourceExhaustedError(std::string(call) + ": " + e.what() + " (" +
                                               e.code().message() + ")"));
  } catch (const std::exception& e) {
    return Fail(strata::InternalError(std::string(call) + ": unexpected exception: " + e.what()));
  } catch (...) {
    return Fail(strata::InternalError(std::string(call) + ": unexpected exception"));
  }
}

int Create(strata::StatusOr<std::unique_ptr<strata::Engine>> e, strata_engine** out) {
  if (!e.ok()) return Fail(e.status());
  *out = new strata_engine{std::move(*e)};
  return STRATA_OK;
}

int CopyPointers(const std::vector<void*>& from, void** to, int capacity) {
  if (static_cast<int>(from.size()) > capacity)
    return Fail(strata::OutOfRangeError("the module has " + std::to_string(from.size()) +
                                        " parameters, capacity is " + std::to_string(capacity)));
  for (size_t i = 0; i < from.size(); ++i) to[i] = from[i];
  return STRATA_OK;
}

}  // namespace

extern "C" {

const char* strata_last_error(void) { return g_last_error.c_str(); }

const char* strata_version(void) {
  static const std::string v(strata::Version());
  return v.c_str();
}

int strata_engine_create_from_json(const char* json_text, strata_engine** out) {
  return Guard("strata_engine_create_from_json", [&]() -> int {
    if (json_text == nullptr) return NullArg("json_text");
    if (out == nullptr) return NullArg("out");
    return Create(strata::Engine::CreateFromJson(json_text), out);
  });
}

int strata_engine_create_from_json_auto(const char* json_text,
                                        const strata_auto_values* auto_values,
                                        strata_engine** out) {
  return Guard("strata_engine_create_from_json_auto", [&]() -> int {
    if (json_text == nullptr) return NullArg("json_text");
    if (out == nullptr) return NullArg("out");
    strata::AutoValues av;
    if (auto_values != nullptr) {
      const strata_auto_values& a = *auto_values;
      auto take = [&](uint32_t bit, auto value, auto* field) {
        if (a.given & bit) *field = value;
      };
      take(STRATA_AUTO_TRAIN_BATCH_SIZE, a.train_batch_size, &av.train_batch_size);
      take(STRATA_AUTO_TRAIN_MICRO_BATCH_SIZE_PER_GPU, a.train_micro_batch_size_per_gpu,
           &av.train_micro_batch_size_per_gpu);
      take(STRATA_AUTO_GRADIENT_ACCUMULATION_STEPS, a.gradient_accumulation_steps,
           &av.gradient_accumulation_steps);
      take(STRATA_AUTO_GRADIENT_CLIPPING, a.gradient_clipping, &av.gradient_clipping);
      take(STRATA_AUTO_LR, a.lr, &av.lr);
      take(STRATA_AUTO_BETA1, a.beta1, &av.beta1);
      take(STRATA_AUTO_BETA2, a.beta2, &av.beta2);
      take(STRATA_AUTO_EPS, a.eps, &av.eps);
      take(STRATA_AUTO_WEIGHT_DECAY, a.weight_decay, &av.weight_decay);
      take(STRATA_AUTO_FP16_ENABLED, a.fp16_enabled != 0, &av.fp16_enabled);
      take(STRATA_AUTO_BF16_ENABLED, a.bf16_enabled != 0, &av.bf16_enabled);
      take(STRATA_AUTO_WARMUP_NUM_STEPS, a.warmup_num_steps, &av.warmup_num_steps);
      take(STRATA_AUTO_TOTAL_NUM_STEPS, a.total_num_steps, &av.total_num_steps);
    }
    strata::StatusOr<strata::Config> config = strata::ParseConfig(json_text, "<string>", av);
    if (!config.ok()) return Fail(config.status());
    return Create(strata::Engine::Create(*config), out);
  });
}

int strata_engine_create_from_file(const char* path, strata_engine** out) {
  return Guard("strata_engine_create_from_file", [&]() -> int {
    if (path == nullptr) return NullArg("path");
    if (out == nullptr) return NullArg("out");
    return Create(strata::Engine::CreateFromFile(path), out);
  });
}

void strata_engine_destroy(strata_engine* engine) {
  try {
    delete engine;
  } catch (...) {  // destructors do not throw; never let one cross anyway
  }
}

int strata_register_parameter(strata_engine* e, const char* name, int64_t numel, strata_dtype dtype,
                              int module, const float* init, int* out_id) {
  return strata_register_parameter_in_group(e, name, numel, dtype, module, 0, init, out_id);
}

int strata_register_parameter_in_group(strata_engine* e, const char* name, int64_t numel,
                                       strata_dtype dtype, int module, int group, const float* init,
                                       int* out_id) {
  return Guard("strata_register_parameter", [&]() -> int {
    if (e == nullptr) return NullArg("engine");
    if (name == nullptr) return NullArg("name");
    if (dtype < STRATA_FP32 || dtype > STRATA_BF16)
      return Fail(
          strata::InvalidArgumentError("dtype " + std::to_string(static_cast<int>(dtype)) +
                                       " is not one of STRATA_FP32, STRATA_FP16, STRATA_BF16"));
    strata::ParamSpec spec;
    spec.name = name;
    spec.numel = numel;
    spec.dtype = static_cast<strata::DType>(dtype);
    spec.module = module;
    spec.group = group;
    if (init != nullptr && numel > 0) {
      spec.init = std::span<const float>(init, static_cast<size_t>(numel));
    } else {
      spec.initializer = [](std::span<float> v) { std::fill(v.begin(), v.end(), 0.f); };
    }
    strata::StatusOr<int> id = e->engine->RegisterParameter(spec);
    if (!id.ok()) return Fail(id.status());
    if (out_id) *out_id = *id;
    return STRATA_OK;
  });
}

int strata_add_param_group(strata_engine* e, const strata_param_group* g, int* out_id) {
  return Guard("strata_add_param_group", [&]() -> int {
    if (e == nullptr) return NullArg("engine");
    if (g == nullptr) return NullArg("group");
    strata::ParamGroupSpec spec;
    if (g->name != nullptr) spec.name = g->name;
    if (g->has_lr) spec.lr = g->lr;
    if (g->has_weight_decay) spec.weight_decay = g->weight_decay;
    if (g->has_betas) {
      spec.beta1 = g->beta1;
      spec.beta2 = g->beta2;
    }
    if (g->has_eps) spec.eps = g->eps;
    strata::StatusOr<int> id = e->engine->AddParamGroup(spec);
    if (!id.ok()) return Fail(id.status());
    if (out_id) *out_id = *id;
    return STRATA_OK;
  });
}

int strata_plan(strata_engine* e) {
  return Guard("strata_plan",
               [&]() -> int { return e ? Check(e->engine->Plan()) : NullArg("engine"); });
}

int strata_before_forward(strata_engine* e, int module, void** params, int capacity, int* count) {
  return Guard("strata_before_forward", [&]() -> int {
    if (e == nullptr) return NullArg("engine");
    auto v = e->engine->BeforeForward(module);
    if (!v.ok()) return Fail(v.status());
    if (count) *count = static_cast<int>(v->params.size());
    return params ? CopyPointers(v->params, params, capacity) : STRATA_OK;
  });
}

int strata_after_forward(strata_engine* e, int module) {
  return Guard("strata_after_forward", [&]() -> int {
    return e ? Check(e->engine->AfterForward(module)) : NullArg("engine");
  });
}

int strata_before_backward(strata_engine* e, int module, void** params, void** grads, int capacity,
                           int* count) {
  return Guard("strata_before_backward", [&]() -> int {
    if (e == nullptr) return NullArg("engine");
    auto v = e->engine->BeforeBackward(module);
    if (!v.ok()) return Fail(v.status());
    if (count) *count = static_cast<int>(v->params.size());
    if (params) {
      if (int rc = CopyPointers(v->params, params, capacity); rc != STRATA_OK) return rc;
    }
    return grads ? CopyPointers(v->grads, grads, capacity) : STRATA_OK;
  });
}

int strata_after_backward(strata_engine* e, int module) {
  return Guard("strata_after_backward", [&]() -> int {
    return e ? Check(e->engine->AfterBackward(module)) : NullArg("engine");
  });
}

int strata_step(strata_engine* e, strata_step_stats* stats) {
  return Guard("strata_step", [&]() -> int {
    if (e == nullptr) return NullArg("engine");
    auto s = e->engine->Step();
    if (!s.ok()) return Fail(s.status());
    if (stats) {
      stats->step = s->step;
      stats->applied = s->applied;
      stats->overflow = s->overflow;
      stats->loss_scale = s->loss_scale;
      stats->grad_norm = s->grad_norm;
      stats->step_time_s = s->step_time_s;
      stats->overlap_efficiency = s->overlap_efficiency;
      stats->nvme_read_bytes = s->nvme_read_bytes;
      stats->nvme_written_bytes = s->nvme_written_bytes;
      stats->pcie_h2d_bytes = s->pcie_h2d_bytes;
      stats->pcie_d2h_bytes = s->pcie_d2h_bytes;
      stats->hbm_high_water_bytes = s->hbm_high_water_bytes;
      stats->lr = s->lr;
    }
    return STRATA_OK;
  });
}

int strata_zero_grad(strata_engine* e) {
  return Guard("strata_zero_grad",
               [&]() -> int { return e ? Check(e->engine->ZeroGrad()) : NullArg("engine"); });
}

int strata_synchronize(strata_engine* e) {
  return Guard("strata_synchronize",
               [&]() -> int { return e ? Check(e->engine->Synchronize()) : NullArg("engine"); });
}

int strata_save_checkpoint(strata_engine* e, const char* dir, int64_t data_position,
                           const char* note) {
  return Guard("strata_save_checkpoint", [&]() -> int {
    if (e == nullptr) return NullArg("engine");
    if (dir == nullptr) return NullArg("dir");
    strata::CheckpointInfo info;
    info.data_position = data_position;
    if (note != nullptr) info.note = note;
    return Check(e->engine->SaveCheckpoint(dir, info));
  });
}

int strata_load_checkpoint(strata_engine* e, const char* dir, int64_t* data_position,
                           int64_t* optimizer_step, char* note_buf, size_t note_capacity,
                           size_t* note_needed) {
  return strata_load_checkpoint_flags(e, dir, 0, data_position, optimizer_step, note_buf,
                                      note_capacity, note_needed);
}

int strata_load_checkpoint_flags(strata_engine* e, const char* dir, unsigned flags,
                                 int64_t* data_position, int64_t* optimizer_step, char* note_buf,
                                 size_t note_capacity, size_t* note_needed) {
  return Guard("strata_load_checkpoint_flags", [&]() -> int {
    if (e == nullptr) return NullArg("engine");
    if (dir == nullptr) return NullArg("dir");
    if ((flags & ~STRATA_LOAD_CONVERT_OPTIMIZER_STATES) != 0)
      return Check(strata::InvalidArgumentError(fmt::format(
          "strata_load_checkpoint_flags: unknown flags 0x{:x} (allowed: "
          "STRATA_LOAD_CONVERT_OPTIMIZER_STATES = 0x{:x})",
          flags & ~STRATA_LOAD_CONVERT_OPTIMIZER_STATES, STRATA_LOAD_CONVERT_OPTIMIZER_STATES)));
    strata::CheckpointInfo info;
    info.convert_optimizer_states = (flags & STRATA_LOAD_CONVERT_OPTIMIZER_STATES) != 0;
    if (int rc = Check(e->engine->LoadCheckpoint(dir, &info)); rc != STRATA_OK) return rc;
    if (data_position) *data_position = info.data_position;
    if (optimizer_step) *optimizer_step = info.optimizer_step;
    if (note_needed) *note_needed = info.note.size() + 1;
    if (note_buf != nullptr && note_capacity > 0) {
      const size_t n = std::min(info.note.size(), note_capacity - 1);
      std::memcpy(note_buf, info.note.data(), n);
      note_buf[n] = '\0';
    }
    return STRATA_OK;
  });
}

int strata_set_learning_rate(strata_engine* e, double lr) {
  return Guard("strata_set_learning_rate", [&]() -> int {
    return e ? Check(e->engine->SetLearningRate(lr)) : NullArg("engine");
  });
}

double strata_learning_rate(const strata_engine* e) { return e ? e->engine->learning_rate() : 0.0; }

int strata_set_group_learning_rate(strata_engine* e, int group, double lr) {
  return Guard("strata_set_group_learning_rate", [&]() -> int {
    return e ? Check(e->engine->SetLearningRate(group, lr)) : NullArg("engine");
  });
}

double strata_group_learning_rate(const strata_engine* e, int group) {
  return e ? e->engine->learning_rate(group) : 0.0;
}

double strata_loss_scale(const strata_engine* e) { return e ? e->engine->loss_scale() : 1.0; }

void* strata_compute_stream(const strata_engine* e) {
  return e ? e->engine->ComputeStream() : nullptr;
}

int strata_read_parameter(strata_engine* e, int id, float* out, int64_t numel) {
  return Guard("strata_read_parameter", [&]() -> int {
    if (e == nullptr) return NullArg("engine");
    if (out == nullptr) return NullArg("out");
    return Check(e->engine->ReadParameter(id, std::span<float>(out, static_cast<size_t>(numel))));
  });
}

int strata_write_parameter(strata_engine* e, int id, const float* values, int64_t numel) {
  return Guard("strata_write_parameter", [&]() -> int {
    if (e == nullptr) return NullArg("engine");
    if (values == nullptr) return NullArg("values");
    if (numel < 0) return Check(strata::InvalidArgumentError("strata_write_parameter: numel < 0"));
    return Check(
        e->engine->WriteParameter(id, std::span<const float>(values, static_cast<size_t>(numel))));
  });
}

int strata_stats_json(const strata_engine* e, char* buf, size_t capacity, size_t* needed) {
  return Guard("strata_stats_json", [&]() -> int {
    if (e == nullptr) return NullArg("engine");
    const std::string j = e->engine->StatsJson();
    if (needed) *needed = j.size() + 1;
    if (buf == nullptr || capacity < j.size() + 1)
      return Fail(strata::OutOfRangeError("stats JSON needs " + std::to_string(j.size() + 1) +
                                          " bytes, capacity " + std::to_string(capacity)));
    std::memcpy(buf, j.c_str(), j.size() + 1);
    return STRATA_OK;
  });
}

}  // extern "C"
