// The `strata` section: what DeepSpeed has no key for (device, budgets,
// tracing, threads, I/O engine, the optimizer's overlap and delayed update,
// the host backend's link model), and the sections of `strata` that belong
// to the application (kept as JSON text). Its keys are declared in
// schema.cc; ranges are checked in validate.cc.
#include "src/config/config_internal.h"

namespace strata::config_internal {

Status ReadStrata(Section& s, StrataConfig* st) {
  RETURN_IF_ERROR(s.Enum("device", kDeviceKinds, &st->device));
  RETURN_IF_ERROR(s.Int("device_id", &st->device_id));
  RETURN_IF_ERROR(s.Bytes("hbm_budget", &st->hbm_budget_bytes));
  RETURN_IF_ERROR(s.Bytes("pinned_budget", &st->pinned_budget_bytes));
  RETURN_IF_ERROR(s.Bytes("dram_budget", &st->dram_budget_bytes));
  RETURN_IF_ERROR(s.String("trace_path", &st->trace_path));
  RETURN_IF_ERROR(s.Int("threads", &st->threads));
  RETURN_IF_ERROR(s.Enum("io_engine", kIoEngines, &st->io_engine));
  RETURN_IF_ERROR(s.Bool("io_sqpoll", &st->io_sqpoll));
  RETURN_IF_ERROR(s.Enum("grad_accumulator", kGradAccumulatorPlaces, &st->grad_accumulator));
  RETURN_IF_ERROR(s.Enum("grad_tier", kGradTiers, &st->grad_tier));
  RETURN_IF_ERROR(s.Bool("overlap_optimizer", &st->overlap_optimizer));
  RETURN_IF_ERROR(s.Bool("delayed_param_update", &st->delayed_param_update));
  RETURN_IF_ERROR(s.Int("delayed_param_update_warmup", &st->delayed_param_update_warmup));
  if (s.Given("speculative_step")) {
    bool on = false;
    RETURN_IF_ERROR(s.Bool("speculative_step", &on));
    st->speculative_step = on;
  } else {
    s.Take("speculative_step");  // absent, null or "auto": the plan decides
    st->speculative_step.reset();
  }
  RETURN_IF_ERROR(s.Enum("optimizer_states", kOptimizerStatesNames, &st->optimizer_states));
  std::optional<Section> host;
  RETURN_IF_ERROR(s.Child("host_device", &host));
  if (host) {
    RETURN_IF_ERROR(host->Double("link_gbytes_per_s", &st->host_device.link_gbytes_per_s));
    RETURN_IF_ERROR(host->Double("link_latency_us", &st->host_device.link_latency_us));
    RETURN_IF_ERROR(host->ReportUnread());
  }
  // Application-owned sections: kept as text, their keys unread here.
  for (std::string_view name : ApplicationSections()) {
    const json* v = s.Take(name);
    if (v == nullptr) continue;
    if (!v->is_object())
      return ValueError(s.PathOf(name), *v, "is not an object (expected { ... })");
    st->application_sections[std::string(name)] = v->dump();
  }
  return s.ReportUnread();
}

}  // namespace strata::config_internal
