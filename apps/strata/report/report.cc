#include "apps/strata/report/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "apps/strata/exit_codes.h"

namespace strata::cli::report {

using nlohmann::json;

const char* SectionStateName(SectionState s) {
  switch (s) {
    case SectionState::kOk:
      return "ok";
    case SectionState::kSkipped:
      return "skipped";
    case SectionState::kFailed:
      return "failed";
  }
  return "?";
}

const char* CheckStateName(CheckState s) {
  switch (s) {
    case CheckState::kPass:
      return "pass";
    case CheckState::kFail:
      return "FAIL";
    case CheckState::kSkipped:
      return "skipped";
  }
  return "?";
}

std::string Fixed(double v, int digits) {
  if (!std::isfinite(v)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

Check RatioCheck(std::string name, double measured, double threshold, std::string detail,
                 std::string device, std::string command) {
  Check c;
  c.name = std::move(name);
  c.target = ">= " + Fixed(threshold, 2);
  c.measured = measured;
  c.detail = std::move(detail);
  c.device = std::move(device);
  c.command = std::move(command);
  if (!std::isfinite(measured)) {
    c.state = CheckState::kFail;
    c.detail += " (the measurement gave no finite value)";
  } else {
    c.state = measured >= threshold ? CheckState::kPass : CheckState::kFail;
  }
  return c;
}

Check BoundCheck(std::string name, double fraction, double p25, double p75, double threshold,
                 std::string busy, std::string detail, std::string device, std::string command) {
  const std::string spread = "median of pairs " + Fixed(fraction, 3) + ", quartiles " +
                             Fixed(p25, 3) + "-" + Fixed(p75, 3);
  if (!detail.empty()) detail += "; ";
  if (!busy.empty())
    return SkippedCheck(std::move(name), ">= " + Fixed(threshold, 2),
                        busy + ": the threads did not own their cores (" + detail + spread + ")");
  if (p25 > 1.0)
    return BoolCheck(std::move(name), ">= " + Fixed(threshold, 2) + " of a bound that holds", false,
                     detail + spread + ": most pairs beat the bound, so it is not one",
                     std::move(device), std::move(command));
  return RatioCheck(std::move(name), fraction, threshold, detail + spread, std::move(device),
                    std::move(command));
}

Check BoolCheck(std::string name, std::string target, bool ok, std::string detail,
                std::string device, std::string command) {
  Check c;
  c.name = std::move(name);
  c.target = std::move(target);
  c.measured = NAN;
  c.detail = std::move(detail);
  c.device = std::move(device);
  c.command = std::move(command);
  c.state = ok ? CheckState::kPass : CheckState::kFail;
  return c;
}

Check SkippedCheck(std::string name, std::string target, std::string reason) {
  Check c;
  c.name = std::move(name);
  c.target = std::move(target);
  c.measured = NAN;
  c.state = CheckState::kSkipped;
  c.reason = std::move(reason);
  return c;
}

bool LossesAgree(const std::vector<double>& got, const std::vector<double>& ref, double rel_tol,
                 double* worst, int* worst_step) {
  *worst = 0;
  *worst_step = 0;
  const size_t n = std::min(got.size(), ref.size());
  if (n == 0) {
    *worst = INFINITY;
    return false;
  }
  for (size_t i = 0; i < n; ++i) {
    const double d = std::fabs(got[i] - ref[i]) / std::max(std::fabs(ref[i]), 1.0);
    // A NaN loss disagrees with everything.
    if (!(d <= *worst)) {
      *worst = std::isnan(d) ? INFINITY : d;
      *worst_step = static_cast<int>(i) + 1;
    }
  }
  return *worst <= rel_tol;
}

Check NoFailureCheck(const std::vector<Section>& sections) {
  std::string failed;
  for (const Section& s : sections)
    if (s.state == SectionState::kFailed)
      failed += (failed.empty() ? "" : "; ") + s.id + ": " + s.reason;
  return BoolCheck("no section failed", "none failed", failed.empty(),
                   failed.empty() ? "every section that ran completed" : failed, "", "");
}

void SkipRatioChecks(std::vector<Check>* checks, const std::string& why) {
  for (Check& c : *checks) {
    if (c.state == CheckState::kSkipped || c.target.rfind(">=", 0) != 0) continue;
    c.reason = why + " (measured " + Fixed(c.measured, 3) + ")";
    c.state = CheckState::kSkipped;
  }
}

std::vector<std::string> SkippedParts(const Report& r) {
  std::vector<std::string> out;
  for (const Section& s : r.sections) {
    if (s.state == SectionState::kSkipped) out.push_back(s.id + " (" + s.reason + ")");
    for (const std::string& p : s.skipped) out.push_back(s.id + ": " + p);
  }
  return out;
}

int ExitCodeFor(const Report& r) {
  for (const Check& c : r.checks)
    if (c.state == CheckState::kFail) return kExitFailed;
  return kExitOk;
}

namespace {

json FigureJson(const Figure& f) {
  return {{"name", f.name},
          {"value", std::isfinite(f.value) ? json(f.value) : json(nullptr)},
          {"unit", f.unit},
          {"device", f.device},
          {"command", f.command}};
}

json TableJson(const Table& t) {
  return {{"caption", t.caption}, {"header", t.header}, {"rows", t.rows}};
}

}  // namespace

json ToJson(const Report& r) {
  json j;
  j["version"] = r.version;
  j["command"] = r.command;
  j["device"] = r.device;
  j["started_utc"] = r.started_utc;
  j["elapsed_s"] = r.elapsed_s;
  j["time_limit_s"] = r.time_limit_s;
  j["quick"] = r.quick;
  json sections = json::array();
  for (const Section& s : r.sections) {
    json js = {{"id", s.id},         {"title", s.title},     {"state", SectionStateName(s.state)},
               {"reason", s.reason}, {"device", s.device},   {"commands", s.commands},
               {"notes", s.notes},   {"skipped", s.skipped}, {"charts", s.charts.size()},
               {"raw", s.raw}};
    json figs = json::array();
    for (const Figure& f : s.figures) figs.push_back(FigureJson(f));
    js["figures"] = figs;
    json tables = json::array();
    for (const Table& t : s.tables) tables.push_back(TableJson(t));
    js["tables"] = tables;
    sections.push_back(js);
  }
  j["sections"] = sections;
  json checks = json::array();
  for (const Check& c : r.checks)
    checks.push_back({{"name", c.name},
                      {"target", c.target},
                      {"measured", std::isfinite(c.measured) ? json(c.measured) : json(nullptr)},
                      {"detail", c.detail},
                      {"device", c.device},
                      {"command", c.command},
                      {"state", CheckStateName(c.state)},
                      {"reason", c.reason}});
  j["checks"] = checks;
  j["skipped"] = SkippedParts(r);
  j["exit_code"] = ExitCodeFor(r);
  return j;
}

std::string SummaryTable(const Report& r) {
  std::ostringstream o;
  char buf[512];
  std::snprintf(buf, sizeof(buf), "%-32s %-18s %-10s %s\n", "check", "target", "measured",
                "result");
  o << buf;
  for (const Check& c : r.checks) {
    std::string result = CheckStateName(c.state);
    if (c.state == CheckState::kSkipped) result += ": " + c.reason;
    if (c.state == CheckState::kFail && !c.detail.empty()) result += " (" + c.detail + ")";
    std::snprintf(buf, sizeof(buf), "%-32s %-18s %-10s %s\n", c.name.c_str(), c.target.c_str(),
                  Fixed(c.measured, 3).c_str(), result.c_str());
    o << buf;
  }
  const std::vector<std::string> skipped = SkippedParts(r);
  if (!skipped.empty()) {
    o << "skipped:\n";
    for (const std::string& s : skipped) o << "  " << s << "\n";
  }
  return o.str();
}

}  // namespace strata::cli::report
