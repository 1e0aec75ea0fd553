// The reports of `strata train`: the summary table, the --json object and
// the plots of a TrainResult (train.h).
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "apps/strata/train/train.h"
#include "src/common/private_fs.h"

namespace strata::cli {
namespace {

using nlohmann::json;

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Steps after the first (which records the fetch trace and warms up), when there are any.
std::vector<const StepStats*> SteadySteps(const TrainResult& r) {
  std::vector<const StepStats*> out;
  for (size_t i = r.steps.size() > 1 ? 1 : 0; i < r.steps.size(); ++i) out.push_back(&r.steps[i]);
  return out;
}

}  // namespace

double MedianStepTime(const TrainResult& r) {
  std::vector<double> v;
  for (const StepStats* s : SteadySteps(r)) v.push_back(s->step_time_s);
  return Median(v);
}

double MeasuredAmount(const TrainResult& r, const std::string& resource) {
  std::vector<double> v;
  for (const StepStats* s : SteadySteps(r)) {
    if (resource == "pcie_h2d")
      v.push_back(static_cast<double>(s->pcie_h2d_bytes));
    else if (resource == "pcie_d2h")
      v.push_back(static_cast<double>(s->pcie_d2h_bytes));
    else if (resource == "nvme_read")
      v.push_back(static_cast<double>(s->nvme_read_bytes));
    else if (resource == "nvme_write")
      v.push_back(static_cast<double>(s->nvme_written_bytes));
    else
      return -1;
  }
  return v.empty() ? -1 : Median(v);
}

double MedianOverlap(const TrainResult& r) {
  std::vector<double> v;
  for (const StepStats* s : SteadySteps(r)) v.push_back(s->overlap_efficiency);
  return Median(v);
}

double MedianBoundEfficiency(const TrainResult& r) {
  std::vector<double> v;
  for (const StepStats* s : SteadySteps(r)) v.push_back(s->bound_efficiency);
  return Median(v);
}

std::string MostCommonBound(const TrainResult& r) {
  std::map<std::string, int> count;
  for (const StepStats* s : SteadySteps(r)) ++count[s->bound_by];
  std::string best;
  int n = 0;
  for (const auto& [by, c] : count)
    if (c > n) best = by, n = c;
  return best;
}

std::string ResultJson(const TrainResult& r, const Status& error) {
  const double step_time = MedianStepTime(r);
  json j;
  if (!error.ok()) j["error"] = OneLine(error.ToString());
  j["device"] = r.device;
  j["dtype"] = r.dtype;
  j["parameters"] = r.parameters;
  j["state_bytes"] = r.state_bytes;
  j["hbm_budget_bytes"] = r.hbm_budget_bytes;
  j["workspace_bytes"] = r.workspace_bytes;
  j["steps"] = static_cast<int64_t>(r.losses.size());
  // null when no step ran (and, as for every NaN in the output, for a NaN).
  j["initial_loss"] = r.losses.empty() ? json(nullptr) : json(r.losses.front());
  j["final_loss"] = r.losses.empty() ? json(nullptr) : json(r.losses.back());
  j["losses"] = r.losses;
  j["step_time_s"] = step_time;
  j["total_time_s"] = r.total_time_s;
  j["tokens_per_step"] = r.tokens_per_step;
  j["tokens_per_s"] = step_time > 0 ? static_cast<double>(r.tokens_per_step) / step_time : 0.0;
  j["overlap_efficiency"] = MedianOverlap(r);
  j["bound_efficiency"] = MedianBoundEfficiency(r);
  j["bound_by"] = MostCommonBound(r);
  if (!r.steps.empty()) {
    j["h2d_gbytes_per_s"] = r.steps.back().h2d_gbytes_per_s;
    j["d2h_gbytes_per_s"] = r.steps.back().d2h_gbytes_per_s;
    j["nvme_gbytes_per_s"] = r.steps.back().nvme_gbytes_per_s;
    j["nvme_read_gbytes_per_s"] = r.steps.back().nvme_read_gbytes_per_s;
    j["nvme_write_gbytes_per_s"] = r.steps.back().nvme_write_gbytes_per_s;
  }
  j["skipped_steps"] = r.skipped_steps;
  j["hbm_high_water_bytes"] = r.hbm_high_water_bytes;
  j["pinned_high_water_bytes"] = r.pinned_high_water_bytes;
  j["peak_rss_bytes"] = r.peak_rss_bytes;
  if (r.world_size > 1) {
    j["rank"] = r.rank;
    j["world_size"] = r.world_size;
    j["max_peak_rss_bytes"] = r.max_peak_rss_bytes;
    j["max_total_time_s"] = r.max_total_time_s;
  }
  j["planned_host_bytes"] = r.planned_host_bytes;
  j["nvme_read_bytes"] = r.nvme_read_bytes;
  j["nvme_written_bytes"] = r.nvme_written_bytes;
  j["pcie_h2d_bytes"] = r.pcie_h2d_bytes;
  j["pcie_d2h_bytes"] = r.pcie_d2h_bytes;
  const double t = r.total_time_s > 0 ? r.total_time_s : 1;
  j["gbytes_per_s"] = {{"nvme_read", r.nvme_read_bytes / t * 1e-9},
                       {"nvme_write", r.nvme_written_bytes / t * 1e-9},
                       {"pcie_h2d", r.pcie_h2d_bytes / t * 1e-9},
                       {"pcie_d2h", r.pcie_d2h_bytes / t * 1e-9}};
  json per_step = json::array();
  for (const StepStats& s : r.steps)
    per_step.push_back({{"step_time_s", s.step_time_s},
                        {"compute_s", s.compute_s},
                        {"fetch_wait_s", s.fetch_wait_s},
                        {"optimizer_wall_s", s.optimizer_wall_s},
                        {"optimizer_wait_s", s.optimizer_wait_s},
                        {"grad_offload_s", s.grad_offload_s},
                        {"nvme_busy_s", s.nvme_busy_s},
                        {"pcie_busy_s", s.pcie_busy_s},
                        {"overlap_efficiency", s.overlap_efficiency},
                        {"bound_s", s.bound_s},
                        {"bound_efficiency", s.bound_efficiency},
                        {"bound_by", s.bound_by},
                        {"grad_norm", s.grad_norm},
                        {"lr", s.lr},
                        {"loss_scale", s.loss_scale},
                        {"sub_groups_speculated", s.sub_groups_speculated},
                        {"sub_groups_redone", s.sub_groups_redone},
                        {"nvme_read_bytes", s.nvme_read_bytes},
                        {"nvme_written_bytes", s.nvme_written_bytes},
                        {"pcie_h2d_bytes", s.pcie_h2d_bytes},
                        {"pcie_d2h_bytes", s.pcie_d2h_bytes}});
  if (r.world_size > 1)
    for (size_t i = 0; i < r.steps.size(); ++i) {
      per_step[i]["comm_s"] = r.steps[i].comm_s;
      per_step[i]["comm_busy_s"] = r.steps[i].comm_busy_s;
      per_step[i]["comm_ring_bytes"] = r.steps[i].comm_ring_bytes;
      per_step[i]["comm_gbytes_per_s"] = r.steps[i].comm_gbytes_per_s;
      per_step[i]["comm_reduced_bytes"] = r.steps[i].comm_reduced_bytes;
      per_step[i]["comm_overlapped_bytes"] = r.steps[i].comm_overlapped_bytes;
      per_step[i]["comm_gathered_bytes"] = r.steps[i].comm_gathered_bytes;
    }
  j["per_step"] = per_step;
  json budgets = json::array();
  for (const TierBudget& b : r.budgets)
    budgets.push_back({{"tier", b.tier},
                       {"needed_bytes", b.needed_bytes},
                       {"available_bytes", b.available_bytes},
                       {"detail", b.detail}});
  j["budgets"] = budgets;
  json predicted = json::array();
  for (const PredictedTerm& t : r.predicted)
    predicted.push_back({{"resource", t.resource},
                         {"amount", t.amount},
                         {"seconds", t.seconds},
                         {"what", t.what},
                         {"measured_amount", MeasuredAmount(r, t.resource)}});
  j["predicted_step"] = predicted;
  if (!r.trace_path.empty()) j["trace_path"] = r.trace_path;
  if (!r.checkpoint_dir.empty()) {
    // null unless a checkpoint was loaded and training went on from it.
    j["resumed_from_step"] = r.resumed_from.empty() ? json(nullptr) : json(r.resumed_from_step);
    j["checkpoint"] = {{"dir", r.checkpoint_dir},
                       {"run_id", r.checkpoint_run_id},
                       {"overwritten", r.checkpoints_overwritten},
                       {"resumed_from", r.resumed_from},
                       {"load_s", r.checkpoint_load_s},
                       {"saves", r.checkpoint_save_s.size()},
                       {"save_s_median", Median(r.checkpoint_save_s)},
                       {"save_s", r.checkpoint_save_s}};
  }
  return j.dump();
}

std::string ResultTable(const TrainResult& r) {
  std::ostringstream o;
  char buf[1024];  // the plan rows are long
  const double step_time = MedianStepTime(r);
  std::snprintf(buf, sizeof(buf), "\nstrata train: %zu steps on %s, %.2fM parameters (%s)\n",
                r.losses.size(), r.device.c_str(), static_cast<double>(r.parameters) * 1e-6,
                r.dtype.c_str());
  o << buf;
  std::snprintf(buf, sizeof(buf), "  model states      %s (%.1fx the HBM budget of %s)\n",
                Human(static_cast<double>(r.state_bytes)).c_str(),
                r.hbm_budget_bytes > 0
                    ? static_cast<double>(r.state_bytes) / static_cast<double>(r.hbm_budget_bytes)
                    : 0.0,
                Human(static_cast<double>(r.hbm_budget_bytes)).c_str());
  o << buf;
  if (!r.losses.empty()) {
    std::snprintf(buf, sizeof(buf), "  loss              %.4f -> %.4f\n", r.losses.front(),
                  r.losses.back());
    o << buf;
  }
  std::snprintf(buf, sizeof(buf),
                "  step time         %.3f s median (%.1f s total), %.0f tokens/s\n", step_time,
                r.total_time_s,
                step_time > 0 ? static_cast<double>(r.tokens_per_step) / step_time : 0.0);
  o << buf;
  std::snprintf(buf, sizeof(buf),
                "  overlap           %.2f (busiest of compute, PCIe, CPU optimizer, NVMe / step "
                "time; median)\n",
                MedianOverlap(r));
  o << buf;
  if (!r.steps.empty()) {
    const StepStats& l = r.steps.back();
    std::snprintf(
        buf, sizeof(buf),
        "  bound             %.2f of the step (lower bound / step time; median), bound by "
        "%s (h2d %.1f GB/s, d2h %.1f GB/s, nvme read %.2f write %.2f GB/s)\n",
        MedianBoundEfficiency(r), MostCommonBound(r).c_str(), l.h2d_gbytes_per_s,
        l.d2h_gbytes_per_s, l.nvme_read_gbytes_per_s, l.nvme_write_gbytes_per_s);
    o << buf;
  }
  if (r.skipped_steps) o << "  skipped steps     " << r.skipped_steps << " (fp16 overflow)\n";
  const double t = r.total_time_s > 0 ? r.total_time_s : 1;
  o << "  link              bytes moved      GB/s\n";
  auto link = [&](const char* name, int64_t b) {
    std::snprintf(buf, sizeof(buf), "  %-16s  %12s  %8.3f\n", name,
                  Human(static_cast<double>(b)).c_str(), static_cast<double>(b) / t * 1e-9);
    o << buf;
  };
  link("nvme read", r.nvme_read_bytes);
  link("nvme write", r.nvme_written_bytes);
  link("pcie h2d", r.pcie_h2d_bytes);
  link("pcie d2h", r.pcie_d2h_bytes);
  if (!r.predicted.empty()) {
    // The plan's prediction (at the rates measured when it planned) against
    // the steady steps' medians; busy seconds where the engine measures them.
    o << "  per step          predicted     measured  predicted s  (plan vs run; fetches: upper "
         "bound)\n";
    for (const PredictedTerm& t : r.predicted) {
      const double m = MeasuredAmount(r, t.resource);
      const bool elems = t.resource == "cpu_optimizer";
      auto amount = [&](double a) {
        if (a < 0) return std::string("-");
        return elems ? std::to_string(static_cast<int64_t>(a)) : Human(a);
      };
      char secs[32] = "-";
      if (t.seconds > 0) std::snprintf(secs, sizeof(secs), "%.4f s", t.seconds);
      std::snprintf(buf, sizeof(buf), "  %-16s  %9s  %11s  %11s\n", t.resource.c_str(),
                    amount(t.amount).c_str(), amount(m).c_str(), secs);
      o << buf;
    }
    std::vector<double> opt, nvme, h2d, comm, comm_busy;
    for (const StepStats* s : SteadySteps(r)) {
      opt.push_back(s->optimizer_s);
      nvme.push_back(s->nvme_busy_s);
      h2d.push_back(s->pcie_busy_s);
      comm.push_back(s->comm_s);
      comm_busy.push_back(s->comm_busy_s);
    }
    std::snprintf(buf, sizeof(buf),
                  "  measured busy     CPU optimizer %.3f s, NVMe %.3f s, PCIe h2d %.3f s%s "
                  "(medians)\n",
                  Median(opt), Median(nvme), Median(h2d),
                  r.world_size > 1
                      ? fmt::format(", collectives {:.3f} s (waited for {:.3f} s; bus bandwidth "
                                    "{:.2f} GB/s)",
                                    Median(comm_busy), Median(comm),
                                    r.steps.empty() ? 0.0 : r.steps.back().comm_gbytes_per_s)
                            .c_str()
                      : "");
    o << buf;
  }
  o << "  tier              high water       budget / needed by the plan\n";
  std::snprintf(buf, sizeof(buf), "  %-16s  %12s  %12s\n", "hbm",
                Human(static_cast<double>(r.hbm_high_water_bytes)).c_str(),
                Human(static_cast<double>(r.hbm_budget_bytes)).c_str());
  o << buf;
  for (const TierBudget& b : r.budgets)
    if (b.tier == "pinned") {
      // The plan's pinned placement: the pools, and what crosses PCIe.
      std::snprintf(buf, sizeof(buf), "  %-16s  %12s  %12s (%s)\n", "pinned",
                    Human(static_cast<double>(r.pinned_high_water_bytes)).c_str(),
                    Human(static_cast<double>(b.needed_bytes)).c_str(), b.detail.c_str());
      o << buf;
    }
  // The plan's gradient path: the part of the pinned or dram row that says
  // whether the last micro-batch is folded into the optimizer.
  for (const TierBudget& b : r.budgets)
    for (const char* key : {"gradient landing ", "last micro-batch accumulated "}) {
      const size_t at = b.detail.find(key);
      if (at == std::string::npos) continue;
      const size_t end = b.detail.find(" + ", at);
      o << "  gradients         "
        << b.detail.substr(at, end == std::string::npos ? std::string::npos : end - at) << " ["
        << b.tier << "]\n";
    }
  for (const TierBudget& b : r.budgets)
    if (b.tier == "dram") {
      std::snprintf(buf, sizeof(buf), "  %-16s  %12s  %12s (%s)\n", "dram", "-",
                    Human(static_cast<double>(b.needed_bytes)).c_str(), b.detail.c_str());
      o << buf;
    }
  if (r.peak_rss_bytes > 0) {
    // What the process holds against what the plan allocates on the host.
    std::snprintf(buf, sizeof(buf), "  %-16s  %12s  %12s (peak RSS; planned: pinned + dram%s)\n",
                  "host", Human(static_cast<double>(r.peak_rss_bytes)).c_str(),
                  Human(static_cast<double>(r.planned_host_bytes)).c_str(),
                  r.device.rfind("host", 0) == 0 ? " + hbm of the host device" : "");
    o << buf;
  }
  for (const TierBudget& b : r.budgets)
    if (b.tier == "nvme") {
      std::snprintf(buf, sizeof(buf), "  %-16s  %12s  %12s needed (%s)\n", "nvme", "-",
                    Human(static_cast<double>(b.needed_bytes)).c_str(), b.detail.c_str());
      o << buf;
    }
  if (r.world_size > 1) {
    // Rank 0's table; the maxima over the ranks beside it.
    std::snprintf(buf, sizeof(buf),
                  "  ranks             %d (this is rank %d; loss: the mean over the ranks); "
                  "over the ranks: peak RSS at most %s, loop %.2f s at most\n",
                  r.world_size, r.rank, Human(static_cast<double>(r.max_peak_rss_bytes)).c_str(),
                  r.max_total_time_s);
    o << buf;
  }
  if (!r.trace_path.empty())
    o << "  timeline          " << r.trace_path << " (open in ui.perfetto.dev)\n";
  if (!r.checkpoint_dir.empty()) {
    std::snprintf(buf, sizeof(buf), "  checkpoints       %zu saved in %s (run %s), %.3f s median",
                  r.checkpoint_save_s.size(), r.checkpoint_dir.c_str(), r.checkpoint_run_id.c_str(),
                  Median(r.checkpoint_save_s));
    o << buf;
    if (!r.resumed_from.empty()) {
      std::snprintf(buf, sizeof(buf), "; resumed from step %lld (%s, loaded in %.3f s)",
                    static_cast<long long>(r.resumed_from_step), r.resumed_from.c_str(),
                    r.checkpoint_load_s);
      o << buf;
    }
    o << "\n";
  }
  return o.str();
}

StatusOr<std::vector<std::string>> WritePlots(const TrainResult& r, const std::string& dir,
                                              std::string* note) {
  STRATA_RETURN_IF_ERROR(MakeDirs(dir, "--plot"));
  std::vector<std::string> files;
  const std::string loss_dat = dir + "/loss.dat", time_dat = dir + "/step_time.dat";
  {
    std::ostringstream f;
    f << "# step loss\n";
    for (size_t i = 0; i < r.losses.size(); ++i) f << i + 1 << " " << r.losses[i] << "\n";
    STRATA_RETURN_IF_ERROR(WriteFileReplacing(loss_dat, f.str(), "--plot file"));
  }
  {
    std::ostringstream f;
    f << "# step step_time_s compute_s fetch_wait_s optimizer_s other_s\n";
    for (size_t i = 0; i < r.steps.size(); ++i) {
      const StepStats& s = r.steps[i];
      // Optimizer: what the step blocked on it (in Step(), and hooks waiting
      // for the new parameters of a step overlapping the forward pass).
      const double opt = s.optimizer_wall_s + s.optimizer_wait_s;
      const double other = std::max(0.0, s.step_time_s - s.compute_s - s.fetch_wait_s - opt);
      f << i + 1 << " " << s.step_time_s << " " << s.compute_s << " " << s.fetch_wait_s << " "
        << opt << " " << other << "\n";
    }
    STRATA_RETURN_IF_ERROR(WriteFileReplacing(time_dat, f.str(), "--plot file"));
  }
  files.push_back(loss_dat);
  files.push_back(time_dat);
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    *note =
        "gnuplot not found on PATH: wrote the .dat files only (apt-get install gnuplot-nox for "
        "SVGs)";
    return files;
  }
  // gnuplot opens its outputs as they are named, following a symlink: it
  // writes into new files this process created (O_EXCL, mode 0600), renamed
  // over the SVGs once it is done, and only over regular files.
  const std::string loss_svg = dir + "/loss.svg", time_svg = dir + "/step_time.svg";
  for (const std::string& svg : {loss_svg, time_svg})
    STRATA_RETURN_IF_ERROR(CheckReplaceable(svg, "--plot file"));
  struct Temp {
    std::string path;
    ~Temp() {
      if (!path.empty()) ::unlink(path.c_str());
    }
  };
  std::random_device rd;
  Temp loss_tmp, time_tmp;
  for (auto [tmp, svg] : {std::pair{&loss_tmp, &loss_svg}, std::pair{&time_tmp, &time_svg}}) {
    const std::string name = fmt::format("{}.tmp.{:08x}", *svg, rd());
    STRATA_ASSIGN_OR_RETURN(const int fd, CreateNewFile(name, O_WRONLY, "--plot file"));
    ::close(fd);
    tmp->path = name;
  }
  const std::string script = dir + "/plot.gp";
  {
    // X from step 1 to the last step (ticks every `every` steps from 1); the
    // step-time bars are boxes at x = step, stacked by drawing the running
    // sums tallest first, and the legend sits outside the plot, right of it.
    const size_t n = std::max<size_t>(1, std::max(r.losses.size(), r.steps.size()));
    const size_t every = std::max<size_t>(1, (n + 9) / 10);
    std::ostringstream f;
    f << "set terminal svg size 800,450 dynamic\n"
      << "set output '" << loss_tmp.path << "'\n"
      << "set title 'strata train: loss (" << r.device
      << ")'\nset xlabel 'step'\nset ylabel 'loss'\n"
      << "set xrange [" << (n > 1 ? "1" : "0.5") << ":" << (n > 1 ? std::to_string(n) : "1.5")
      << "]\nset xtics 1," << every << "\nset key outside right top vertical\n"
      << "plot '" << loss_dat << "' using 1:2 with linespoints title 'loss'\n"
      << "set output '" << time_tmp.path << "'\n"
      << "set title 'strata train: step time by phase'\nset xlabel 'step'\nset ylabel 'seconds'\n"
      << "set xrange [0.5:" << n << ".5]\nset yrange [0:*]\n"
      << "set style fill solid 0.8 noborder\nset boxwidth 0.8\n"
      << "plot '" << time_dat << "' using 1:($3+$4+$5+$6) with boxes title 'other', "
      << "'' using 1:($3+$4+$5) with boxes title 'waiting for the optimizer', "
      << "'' using 1:($3+$4) with boxes title 'fetch wait (PCIe/NVMe)', "
      << "'' using 1:3 with boxes title 'compute'\n"
      << "unset output\n";
    STRATA_RETURN_IF_ERROR(WriteFileReplacing(script, f.str(), "--plot file"));
  }
  const std::string cmd = "gnuplot '" + script + "' 2>&1";
  if (std::system(cmd.c_str()) != 0) return IOError("gnuplot " + script + " failed");
  for (auto [tmp, svg] : {std::pair{&loss_tmp, &loss_svg}, std::pair{&time_tmp, &time_svg}}) {
    STRATA_RETURN_IF_ERROR(CheckReplaceable(*svg, "--plot file"));
    if (::rename(tmp->path.c_str(), svg->c_str()) != 0)
      return IOError("--plot file " + *svg + ": rename " + tmp->path + ": " + std::strerror(errno));
    tmp->path.clear();
    files.push_back(*svg);
  }
  return files;
}

}  // namespace strata::cli
