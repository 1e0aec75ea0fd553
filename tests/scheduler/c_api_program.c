/* Compiled as C: proves strata_c.h is C, and drives one training step. */
#include <stdio.h>
#include <string.h>

#include "strata/strata_c.h"

/* Returns 0 on success; writes what went wrong to err. */
int strata_c_api_smoke(char* err, size_t err_len) {
  const char* json =
      "{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": \"cpu\"},"
      " \"offload_param\": {\"device\": \"cpu\"}},"
      " \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.1}},"
      " \"strata\": {\"device\": \"host\", \"hbm_budget\": \"1M\"}}";
  strata_engine* e = NULL;
  if (strata_engine_create_from_json(json, &e) != STRATA_OK) {
    snprintf(err, err_len, "create: %s", strata_last_error());
    return 1;
  }
  float init[64];
  for (int i = 0; i < 64; ++i) init[i] = 0.01f * (float)(i + 1);
  int id = -1;
  if (strata_register_parameter(e, "w", 64, STRATA_FP32, 0, init, &id) != STRATA_OK) {
    snprintf(err, err_len, "register: %s", strata_last_error());
    strata_engine_destroy(e);
    return 1;
  }
  void* params[1];
  void* grads[1];
  int count = 0;
  int rc = strata_before_forward(e, 0, params, 1, &count);
  if (rc == STRATA_OK) rc = strata_after_forward(e, 0);
  if (rc == STRATA_OK) rc = strata_before_backward(e, 0, params, grads, 1, &count);
  if (rc == STRATA_OK) {
    float* g = (float*)grads[0];
    for (int i = 0; i < 64; ++i) g[i] = 1.0f;
    rc = strata_after_backward(e, 0);
  }
  strata_step_stats st;
  if (rc == STRATA_OK) rc = strata_step(e, &st);
  /* The step may still run (overlap_optimizer): wait for it explicitly. */
  if (rc == STRATA_OK) rc = strata_synchronize(e);
  float out[64];
  if (rc == STRATA_OK) rc = strata_read_parameter(e, id, out, 64);
  if (rc != STRATA_OK) {
    snprintf(err, err_len, "step: %s", strata_last_error());
    strata_engine_destroy(e);
    return 1;
  }
  /* AdamW's first step moves every weight by lr against the gradient's sign. */
  for (int i = 0; i < 64; ++i) {
    float want = init[i] - 0.1f;
    if (out[i] > want + 1e-4f || out[i] < want - 1e-4f || !st.applied) {
      snprintf(err, err_len, "w[%d] = %f, want %f (applied %d)", i, out[i], want, st.applied);
      strata_engine_destroy(e);
      return 1;
    }
  }
  char json_buf[4096];
  size_t needed = 0;
  rc = strata_stats_json(e, json_buf, sizeof json_buf, &needed);
  strata_engine_destroy(e);
  if (rc != STRATA_OK || strstr(json_buf, "overlap_efficiency") == NULL) {
    snprintf(err, err_len, "stats json: %s", strata_last_error());
    return 1;
  }
  /* Errors come back as codes with a message. */
  strata_engine* bad = NULL;
  if (strata_engine_create_from_json("{\"zero_optimization\": {\"stage\": 9}}", &bad) != STRATA_INVALID_ARGUMENT ||
      strstr(strata_last_error(), "zero_optimization.stage") == NULL) {
    snprintf(err, err_len, "bad config gave: %s", strata_last_error());
    return 1;
  }
  return 0;
}

/* strata_engine_create_from_json_auto: the frontend's lr replaces "auto". */
int strata_c_api_auto_values(char* err, size_t err_len) {
  const char* json =
      "{\"zero_optimization\": {\"stage\": 2, \"offload_optimizer\": {\"device\": \"cpu\"}},"
      " \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": \"auto\"}},"
      " \"train_micro_batch_size_per_gpu\": \"auto\","
      " \"strata\": {\"device\": \"host\", \"overlap_optimizer\": false}}";
  strata_auto_values av;
  memset(&av, 0, sizeof av);
  av.given = STRATA_AUTO_LR | STRATA_AUTO_TRAIN_MICRO_BATCH_SIZE_PER_GPU;
  av.lr = 0.05;
  av.train_micro_batch_size_per_gpu = 4;
  strata_engine* e = NULL;
  if (strata_engine_create_from_json_auto(json, &av, &e) != STRATA_OK) {
    snprintf(err, err_len, "create: %s", strata_last_error());
    return 1;
  }
  float init[16];
  for (int i = 0; i < 16; ++i) init[i] = 1.0f;
  int id = -1;
  void* params[1];
  void* grads[1];
  int count = 0;
  strata_step_stats st;
  float out[16];
  int rc = strata_register_parameter(e, "w", 16, STRATA_FP32, 0, init, &id);
  if (rc == STRATA_OK) rc = strata_before_forward(e, 0, params, 1, &count);
  if (rc == STRATA_OK) rc = strata_after_forward(e, 0);
  if (rc == STRATA_OK) rc = strata_before_backward(e, 0, params, grads, 1, &count);
  if (rc == STRATA_OK) {
    for (int i = 0; i < 16; ++i) ((float*)grads[0])[i] = -2.0f;
    rc = strata_after_backward(e, 0);
  }
  if (rc == STRATA_OK) rc = strata_step(e, &st);
  if (rc == STRATA_OK) rc = strata_synchronize(e);
  if (rc == STRATA_OK) rc = strata_read_parameter(e, id, out, 16);
  strata_engine_destroy(e);
  if (rc != STRATA_OK) {
    snprintf(err, err_len, "step: %s", strata_last_error());
    return 1;
  }
  /* AdamW's first step moves each weight by lr against the gradient's sign. */
  for (int i = 0; i < 16; ++i) {
    if (out[i] < 1.05f - 1e-4f || out[i] > 1.05f + 1e-4f) {
      snprintf(err, err_len, "w[%d] = %f, want 1.05 (lr 0.05 from the frontend)", i, out[i]);
      return 1;
    }
  }
  /* A frontend value out of range names the key; NULL gives no values. */
  av.lr = -1.0;
  strata_engine* bad = NULL;
  if (strata_engine_create_from_json_auto(json, &av, &bad) != STRATA_INVALID_ARGUMENT ||
      strstr(strata_last_error(), "optimizer.params.lr: -1") == NULL) {
    snprintf(err, err_len, "bad lr gave: %s", strata_last_error());
    return 1;
  }
  if (strata_engine_create_from_json_auto(json, NULL, &bad) != STRATA_OK) {
    snprintf(err, err_len, "NULL auto values: %s", strata_last_error());
    return 1;
  }
  strata_engine_destroy(bad);
  return 0;
}

/* Parameter groups from C: "a" in group 0 (lr 0.1), "b" in a group with lr
 * 0.02, set to 0.03 before the step; AdamW's first step moves each by its lr. */
int strata_c_api_param_groups(char* err, size_t err_len) {
  const char* json =
      "{\"zero_optimization\": {\"stage\": 3, \"offload_optimizer\": {\"device\": \"cpu\"}},"
      " \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.1, \"weight_decay\": 0.5}},"
      " \"strata\": {\"device\": \"host\", \"overlap_optimizer\": false}}";
  strata_engine* e = NULL;
  if (strata_engine_create_from_json(json, &e) != STRATA_OK) {
    snprintf(err, err_len, "create: %s", strata_last_error());
    return 1;
  }
  strata_param_group g;
  memset(&g, 0, sizeof g);
  g.name = "slow";
  g.has_lr = 1;
  g.lr = 0.02;
  g.has_weight_decay = 1;
  g.weight_decay = 0.0;
  int gid = -1, a = -1, b = -1;
  float init[8];
  for (int i = 0; i < 8; ++i) init[i] = 1.0f;
  int rc = strata_add_param_group(e, &g, &gid);
  if (rc == STRATA_OK && gid != 1) {
    snprintf(err, err_len, "group id %d, want 1", gid);
    strata_engine_destroy(e);
    return 1;
  }
  if (rc == STRATA_OK) rc = strata_register_parameter(e, "a", 8, STRATA_FP32, 0, init, &a);
  if (rc == STRATA_OK)
    rc = strata_register_parameter_in_group(e, "b", 8, STRATA_FP32, 0, gid, init, &b);
  if (rc == STRATA_OK && strata_group_learning_rate(e, gid) != 0.02) {
    snprintf(err, err_len, "group lr %f, want 0.02", strata_group_learning_rate(e, gid));
    strata_engine_destroy(e);
    return 1;
  }
  if (rc == STRATA_OK) rc = strata_set_group_learning_rate(e, gid, 0.03);
  void* params[2];
  void* grads[2];
  int count = 0;
  if (rc == STRATA_OK) rc = strata_before_forward(e, 0, params, 2, &count);
  if (rc == STRATA_OK) rc = strata_after_forward(e, 0);
  if (rc == STRATA_OK) rc = strata_before_backward(e, 0, params, grads, 2, &count);
  if (rc == STRATA_OK) {
    for (int k = 0; k < 2; ++k)
      for (int i = 0; i < 8; ++i) ((float*)grads[k])[i] = 1.0f;
    rc = strata_after_backward(e, 0);
  }
  strata_step_stats st;
  float out_a[8], out_b[8];
  if (rc == STRATA_OK) rc = strata_step(e, &st);
  if (rc == STRATA_OK) rc = strata_read_parameter(e, a, out_a, 8);
  if (rc == STRATA_OK) rc = strata_read_parameter(e, b, out_b, 8);
  int bad_group = strata_set_group_learning_rate(e, 7, 0.1);
  strata_engine_destroy(e);
  if (rc != STRATA_OK) {
    snprintf(err, err_len, "groups: %s", strata_last_error());
    return 1;
  }
  /* a: 1 (1 - 0.1 × 0.5 decay) - 0.1; b: 1 - 0.03, no decay. */
  const float want_a = 1.0f * (1.0f - 0.1f * 0.5f) - 0.1f, want_b = 0.97f;
  if (out_a[3] < want_a - 1e-5f || out_a[3] > want_a + 1e-5f || out_b[3] < want_b - 1e-5f ||
      out_b[3] > want_b + 1e-5f) {
    snprintf(err, err_len, "a %f (want %f), b %f (want %f)", out_a[3], want_a, out_b[3], want_b);
    return 1;
  }
  if (bad_group != STRATA_INVALID_ARGUMENT) {
    snprintf(err, err_len, "group 7 gave %d", bad_group);
    return 1;
  }
  return 0;
}
