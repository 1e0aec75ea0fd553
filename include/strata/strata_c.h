/* strata/strata_c.h — the C API of the Strata engine, for FFI users
 * (Python ctypes/cffi, Rust, Julia, ...). It wraps strata/engine.h one to one;
 * see that header for the semantics of each call.
 *
 * Every function returning int returns 0 (STRATA_OK) on success or a
 * strata_code; the message of the last failure on the calling thread is
 * strata_last_error(). Handles are not thread-safe: one thread drives an
 * engine. Pointers returned through out-parameters are device pointers (host
 * pointers on the host device) owned by the engine.
 */
#ifndef STRATA_STRATA_C_H_
#define STRATA_STRATA_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum strata_code {
  STRATA_OK = 0,
  STRATA_INVALID_ARGUMENT = 1,
  STRATA_NOT_FOUND = 2,
  STRATA_IO_ERROR = 3,
  STRATA_RESOURCE_EXHAUSTED = 4,
  STRATA_NOT_SUPPORTED = 5,
  STRATA_UNAVAILABLE = 6,
  STRATA_FAILED_PRECONDITION = 7,
  STRATA_OUT_OF_RANGE = 8,
  STRATA_CANCELLED = 9,
  STRATA_DATA_LOSS = 10,
  STRATA_INTERNAL = 11
} strata_code;

typedef enum strata_dtype { STRATA_FP32 = 0, STRATA_FP16 = 1, STRATA_BF16 = 2 } strata_dtype;

typedef struct strata_engine strata_engine;

typedef struct strata_step_stats {
  int64_t step;
  int applied;
  int overflow;
  double loss_scale;
  double grad_norm;
  double step_time_s;
  double overlap_efficiency;
  int64_t nvme_read_bytes, nvme_written_bytes;
  int64_t pcie_h2d_bytes, pcie_d2h_bytes;
  int64_t hbm_high_water_bytes;
  double lr; /* the step's learning rate (StepStats::lr) */
} strata_step_stats;

/* The message of the last failed call on this thread ("" if none). */
const char* strata_last_error(void);
const char* strata_version(void);

int strata_engine_create_from_json(const char* json_text, strata_engine** out);
int strata_engine_create_from_file(const char* path, strata_engine** out);

/* Values for the config keys written "auto" (as the Hugging Face integration
 * fills them from its trainer); strata::AutoValues in strata/config.h.
 * `given` is a mask of STRATA_AUTO_* bits naming the members that hold a
 * value: a zero-initialized struct gives none. A given value replaces "auto"
 * only, never a value the config writes; the others resolve to Strata's
 * defaults. Each resolution is logged as one notice line. */
enum {
  STRATA_AUTO_TRAIN_BATCH_SIZE = 1u << 0,
  STRATA_AUTO_TRAIN_MICRO_BATCH_SIZE_PER_GPU = 1u << 1,
  STRATA_AUTO_GRADIENT_ACCUMULATION_STEPS = 1u << 2,
  STRATA_AUTO_GRADIENT_CLIPPING = 1u << 3,
  STRATA_AUTO_LR = 1u << 4,
  STRATA_AUTO_BETA1 = 1u << 5,
  STRATA_AUTO_BETA2 = 1u << 6,
  STRATA_AUTO_EPS = 1u << 7,
  STRATA_AUTO_WEIGHT_DECAY = 1u << 8,
  STRATA_AUTO_FP16_ENABLED = 1u << 9,
  STRATA_AUTO_BF16_ENABLED = 1u << 10,
  STRATA_AUTO_WARMUP_NUM_STEPS = 1u << 11,
  STRATA_AUTO_TOTAL_NUM_STEPS = 1u << 12
};
typedef struct strata_auto_values {
  uint32_t given; /* STRATA_AUTO_* bits */
  int64_t train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps;
  double gradient_clipping;
  double lr, beta1, beta2, eps, weight_decay; /* optimizer.params (betas[0], betas[1]) */
  int fp16_enabled, bf16_enabled;             /* 0 or 1 */
  int64_t warmup_num_steps, total_num_steps;  /* scheduler.params */
} strata_auto_values;

/* strata_engine_create_from_json, with values for the "auto" keys
 * (auto_values may be NULL: none given). A given value out of range is
 * STRATA_INVALID_ARGUMENT naming the key, as if the config had written it. */
int strata_engine_create_from_json_auto(const char* json_text,
                                        const strata_auto_values* auto_values, strata_engine** out);
void strata_engine_destroy(strata_engine* engine);

/* init: numel floats (copied), or NULL to start from zeros. */
int strata_register_parameter(strata_engine* engine, const char* name, int64_t numel,
                              strata_dtype dtype, int module, const float* init, int* out_id);
int strata_plan(strata_engine* engine);

/* Optimizer parameter groups (Engine::AddParamGroup, strata/engine.h): each
 * `has_*` flag says whether the value replaces the config's. The new group's
 * id (1, 2, ...; group 0 is the config's) goes to *out_id (may be NULL).
 * strata_register_parameter_in_group registers into one (strata_register_parameter:
 * group 0). Both before strata_plan. */
typedef struct strata_param_group {
  const char* name; /* may be NULL: "group <id>" */
  int has_lr, has_weight_decay, has_betas, has_eps;
  double lr, weight_decay, beta1, beta2, eps;
} strata_param_group;
int strata_add_param_group(strata_engine* engine, const strata_param_group* group, int* out_id);
int strata_register_parameter_in_group(strata_engine* engine, const char* name, int64_t numel,
                                       strata_dtype dtype, int module, int group, const float* init,
                                       int* out_id);

/* params/grads: arrays of `capacity` pointers; *count is set to the number of
 * the module's parameters (STRATA_OUT_OF_RANGE if capacity is too small). */
int strata_before_forward(strata_engine* engine, int module, void** params, int capacity,
                          int* count);
int strata_after_forward(strata_engine* engine, int module);
int strata_before_backward(strata_engine* engine, int module, void** params, void** grads,
                           int capacity, int* count);
int strata_after_backward(strata_engine* engine, int module);
int strata_step(strata_engine* engine, strata_step_stats* stats /* may be NULL */);
int strata_zero_grad(strata_engine* engine);
/* Waits for the optimizer step running in the background
   (strata.overlap_optimizer, delayed_param_update), commits it and returns
   its error, if any. */
int strata_synchronize(strata_engine* engine);

/* Checkpoints (Engine::SaveCheckpoint / LoadCheckpoint in strata/engine.h):
 * save after the strata_step that ends an accumulation window; `data_position`
 * and `note` (UTF-8 text, may be NULL) are the caller's and come back from
 * strata_load_checkpoint. Load: *note_needed is the note's size including the
 * NUL; it is copied into note_buf when it fits in note_capacity bytes (else
 * truncated, still NUL-terminated). Out-parameters may be NULL. */
int strata_save_checkpoint(strata_engine* engine, const char* dir, int64_t data_position,
                           const char* note);
int strata_load_checkpoint(strata_engine* engine, const char* dir, int64_t* data_position,
                           int64_t* optimizer_step, char* note_buf, size_t note_capacity,
                           size_t* note_needed);
/* strata_load_checkpoint with flags (0: the same). With
 * STRATA_LOAD_CONVERT_OPTIMIZER_STATES a checkpoint of another
 * strata.optimizer_states format is loaded in this engine's format
 * (CheckpointInfo::convert_optimizer_states; not between int8 and the
 * others); without it such a checkpoint is STRATA_FAILED_PRECONDITION naming
 * both formats. Unknown flag bits: STRATA_INVALID_ARGUMENT. */
#define STRATA_LOAD_CONVERT_OPTIMIZER_STATES 1u
int strata_load_checkpoint_flags(strata_engine* engine, const char* dir, unsigned flags,
                                 int64_t* data_position, int64_t* optimizer_step, char* note_buf,
                                 size_t note_capacity, size_t* note_needed);

/* Engine::SetLearningRate / learning_rate (strata/engine.h): the lr of the
 * later optimizer steps; STRATA_FAILED_PRECONDITION when the config has a
 * scheduler section, STRATA_INVALID_ARGUMENT for a negative or non-finite lr.
 * strata_learning_rate: the lr of the next optimizer step (0 for NULL). */
int strata_set_learning_rate(strata_engine* engine, double lr);
double strata_learning_rate(const strata_engine* engine);
/* The same for one parameter group (STRATA_INVALID_ARGUMENT for a group that
 * does not exist; strata_group_learning_rate gives 0 then). */
int strata_set_group_learning_rate(strata_engine* engine, int group, double lr);
double strata_group_learning_rate(const strata_engine* engine, int group);

double strata_loss_scale(const strata_engine* engine);
void* strata_compute_stream(const strata_engine* engine);
int strata_read_parameter(strata_engine* engine, int id, float* out, int64_t numel);
/* Sets parameter `id` (master and working copy) to numel floats; moments kept.
 * Between accumulation windows (Engine::WriteParameter). */
int strata_write_parameter(strata_engine* engine, int id, const float* values, int64_t numel);
/* Writes the last step's statistics as JSON (NUL-terminated) if it fits in
 * `capacity` bytes; *needed is the size including the NUL. */
int strata_stats_json(const strata_engine* engine, char* buf, size_t capacity, size_t* needed);

#ifdef __cplusplus
}
#endif

#endif /* STRATA_STRATA_C_H_ */
