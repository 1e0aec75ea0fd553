// The `strata` section: what DeepSpeed has no key for (device, budgets,
// tracing, threads, I/O engine, the optimizer's overlap and delayed update,
// the host backend's link model, the example model). Its keys are declared in
// schema.cc; ranges are checked in validate.cc.
#include "src/config/config_internal.h"

namespace strata::config_internal {

Status ReadStrata(Section& s, StrataConfig* st) {
  RETURN_IF_ERROR(s.Enum("device", kDeviceKinds, &st->device));
  RETURN_IF_ERROR(s.Int("device_id", &st->device_id));
  RETURN_IF_ERROR(s.Bytes("hbm_budget", &st->hbm_budget_bytes));
  RETURN_IF_ERROR(s.Bytes("pinned_budget", &st->pinned_budget_bytes));
  RETURN_IF_ERROR(s.String("trace_path", &st->trace_path));
  RETURN_IF_ERROR(s.Int("threads", &st->threads));
  RETURN_IF_ERROR(s.Enum("io_engine", kIoEngines, &st->io_engine));
  RETURN_IF_ERROR(s.Bool("io_sqpoll", &st->io_sqpoll));
  RETURN_IF_ERROR(s.Bool("overlap_optimizer", &st->overlap_optimizer));
  RETURN_IF_ERROR(s.Bool("delayed_param_update", &st->delayed_param_update));
  RETURN_IF_ERROR(s.Int("delayed_param_update_warmup", &st->delayed_param_update_warmup));
  std::optional<Section> host;
  RETURN_IF_ERROR(s.Child("host_device", &host));
  if (host) {
    RETURN_IF_ERROR(host->Double("link_gbytes_per_s", &st->host_device.link_gbytes_per_s));
    RETURN_IF_ERROR(host->Double("link_latency_us", &st->host_device.link_latency_us));
    RETURN_IF_ERROR(host->ReportUnread());
  }
  std::optional<Section> model;
  RETURN_IF_ERROR(s.Child("model", &model));
  if (model) {
    RETURN_IF_ERROR(model->Int("layers", &st->model.layers));
    RETURN_IF_ERROR(model->Int("hidden", &st->model.hidden));
    RETURN_IF_ERROR(model->Int("seq_len", &st->model.seq_len));
    RETURN_IF_ERROR(model->Int("vocab", &st->model.vocab));
    RETURN_IF_ERROR(model->Int("seed", &st->model.seed));
    RETURN_IF_ERROR(model->Int("steps", &st->model.steps));
    RETURN_IF_ERROR(model->ReportUnread());
  }
  return s.ReportUnread();
}

}  // namespace strata::config_internal
