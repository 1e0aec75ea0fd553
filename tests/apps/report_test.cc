// `strata report`: the checks' pass/fail logic and the exit code on fake
// measurements, the loss comparison on random losses, the charts' geometry
// (legend right of the data, x axis from the first point), the page and
// report.json, and the command itself at its smallest sizes (--tiny) and
// under a time limit that leaves no room.
#include "apps/strata/report/report.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <string>

#include "apps/strata/exit_codes.h"
#include "apps/strata/report/child.h"
#include "apps/strata/report/report_html.h"
#include "tests/test_util.h"

namespace strata::cli::report {
namespace {

using nlohmann::json;

Report FakeReport(double pcie_ratio, double adam_fraction) {
  Report r;
  r.version = "test";
  r.device = "fake";
  Section s{.id = "pcie", .title = "PCIe"};
  s.figures.push_back({"engine path / raw", pcie_ratio, "ratio", "fake GPU", "strata bench pcie"});
  r.sections.push_back(s);
  r.checks.push_back(RatioCheck("PCIe engine path vs raw", pcie_ratio, 0.9, "", "fake GPU",
                                "strata bench pcie --json"));
  r.checks.push_back(RatioCheck("CPU Adam vs roofline", adam_fraction, 0.85, "", "CPU",
                                "strata bench adam --json"));
  r.checks.push_back(SkippedCheck("NVMe engine vs fio's best", ">= 0.90", "fio not installed"));
  r.checks.push_back(NoFailureCheck(r.sections));
  return r;
}

TEST(ReportChecks, PassingMeasurementsExitZero) {
  const Report r = FakeReport(0.97, 0.91);
  EXPECT_EQ(r.checks[0].state, CheckState::kPass);
  EXPECT_EQ(r.checks[1].state, CheckState::kPass);
  EXPECT_EQ(r.checks[2].state, CheckState::kSkipped);  // skipped is not a pass, nor a failure
  EXPECT_EQ(ExitCodeFor(r), kExitOk);
}

TEST(ReportChecks, OneFailingCheckMakesTheExitNonZero) {
  const Report r = FakeReport(0.97, 0.60);
  EXPECT_EQ(r.checks[1].state, CheckState::kFail);
  EXPECT_EQ(ExitCodeFor(r), kExitFailed);
  const std::string table = SummaryTable(r);
  EXPECT_NE(table.find("FAIL"), std::string::npos) << table;
  EXPECT_NE(table.find("skipped: fio not installed"), std::string::npos) << table;
  EXPECT_EQ(ToJson(r)["exit_code"], kExitFailed);
}

TEST(ReportChecks, ThresholdIsInclusiveAndNanFails) {
  EXPECT_EQ(RatioCheck("x", 0.9, 0.9, "", "", "").state, CheckState::kPass);
  EXPECT_EQ(RatioCheck("x", 0.8999, 0.9, "", "", "").state, CheckState::kFail);
  EXPECT_EQ(RatioCheck("x", NAN, 0.9, "", "", "").state, CheckState::kFail);
  EXPECT_EQ(RatioCheck("x", INFINITY, 0.9, "", "", "").state, CheckState::kFail);
}

// A bound measured in pairs: a busy machine skips the check (naming why and
// keeping the figures), a "bound" most pairs beat fails, else the median is
// held to the threshold.
TEST(ReportChecks, BoundCheckSkipsOnBusyCoresAndFailsAnExceededBound) {
  Check c = BoundCheck("CPU Adam vs roofline", 0.91, 0.88, 0.94, 0.85, "", "2 threads", "CPU",
                       "strata bench adam");
  EXPECT_EQ(c.state, CheckState::kPass);
  EXPECT_NE(c.detail.find("quartiles 0.880-0.940"), std::string::npos) << c.detail;
  c = BoundCheck("CPU Adam vs roofline", 0.80, 0.75, 0.83, 0.85, "", "", "CPU", "x");
  EXPECT_EQ(c.state, CheckState::kFail);
  // Beyond 1 in the median alone is noise around a bound that holds...
  c = BoundCheck("CPU Adam vs roofline", 1.02, 0.97, 1.05, 0.85, "", "", "CPU", "x");
  EXPECT_EQ(c.state, CheckState::kPass);
  // ...beyond 1 in three quarters of the pairs is a wrong bound.
  c = BoundCheck("CPU Adam vs roofline", 1.10, 1.04, 1.15, 0.85, "", "", "CPU", "x");
  EXPECT_EQ(c.state, CheckState::kFail);
  EXPECT_NE(c.detail.find("not one"), std::string::npos) << c.detail;
  c = BoundCheck("CPU Adam vs roofline", 1.10, 1.04, 1.15, 0.85, "busy (290/s)", "", "CPU", "x");
  EXPECT_EQ(c.state, CheckState::kSkipped);
  EXPECT_NE(c.reason.find("busy (290/s)"), std::string::npos) << c.reason;
  EXPECT_NE(c.reason.find("1.100"), std::string::npos) << c.reason;
  c = BoundCheck("CPU Adam vs roofline", NAN, NAN, NAN, 0.85, "", "", "CPU", "x");
  EXPECT_EQ(c.state, CheckState::kFail);
}

TEST(ReportChecks, FailedSectionFailsTheNoFailureCheck) {
  std::vector<Section> sections(2);
  sections[0].id = "pcie";
  sections[1].id = "nvme";
  sections[1].state = SectionState::kFailed;
  sections[1].reason = "block 1M qd 4: exit 5";
  const Check c = NoFailureCheck(sections);
  EXPECT_EQ(c.state, CheckState::kFail);
  EXPECT_NE(c.detail.find("nvme: block 1M qd 4: exit 5"), std::string::npos) << c.detail;
  sections[1].state = SectionState::kSkipped;  // skipped (time limit, no GPU) is no failure
  EXPECT_EQ(NoFailureCheck(sections).state, CheckState::kPass);
}

TEST(ReportChecks, SkipRatioChecksKeepsYesNoChecks) {
  Report r = FakeReport(0.5, 0.5);
  ASSERT_EQ(ExitCodeFor(r), kExitFailed);
  SkipRatioChecks(&r.checks, "--tiny");
  EXPECT_EQ(r.checks[0].state, CheckState::kSkipped);
  EXPECT_NE(r.checks[0].reason.find("measured 0.500"), std::string::npos) << r.checks[0].reason;
  EXPECT_EQ(r.checks[3].state, CheckState::kPass);  // "no section failed" stays
  EXPECT_EQ(ExitCodeFor(r), kExitOk);
}

TEST(ReportLosses, AgreeWithinToleranceOnRandomLosses) {
  std::mt19937 rng(20261125);
  std::uniform_real_distribution<double> u(0.5, 6.0);
  std::vector<double> ref(40);
  for (double& v : ref) v = u(rng);
  std::vector<double> got = ref;
  for (double& v : got) v *= 1 + 4e-4 * (u(rng) > 3 ? 1 : -1);
  double worst = 0;
  int step = 0;
  EXPECT_TRUE(LossesAgree(got, ref, 1e-3, &worst, &step));
  EXPECT_GT(worst, 0);
  EXPECT_LE(worst, 1e-3);
  got[17] = ref[17] + 3e-3 * std::max(1.0, ref[17]);
  EXPECT_FALSE(LossesAgree(got, ref, 1e-3, &worst, &step));
  EXPECT_EQ(step, 18);
  EXPECT_NEAR(worst, 3e-3, 1e-9);
  got[17] = NAN;
  EXPECT_FALSE(LossesAgree(got, ref, 1e-3, &worst, &step));
  EXPECT_EQ(step, 18);
  EXPECT_FALSE(LossesAgree({}, ref, 1e-3, &worst, &step));
}

// Every number in `attr="..."` of the elements whose tag is `tag`.
std::vector<double> Attr(const std::string& svg, const std::string& tag, const std::string& attr,
                         const std::string& extra = "") {
  std::vector<double> out;
  std::regex re("<" + tag + "[^>]*?" + extra + "[^>]*?>");
  std::regex a(" " + attr + "=\"([-0-9.]+)\"");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), re); it != std::sregex_iterator();
       ++it) {
    std::smatch m;
    const std::string el = it->str();
    if (std::regex_search(el, m, a)) out.push_back(std::stod(m[1]));
  }
  return out;
}

TEST(ReportCharts, LegendSitsRightOfTheDataAndXStartsAtTheFirstStep) {
  LineChart c{.title = "Loss per step", .x_label = "step", .y_label = "loss"};
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(1, 5);
  for (int s = 0; s < 4; ++s) {
    Series ser{.name = "placement " + std::to_string(s)};
    for (int k = 1; k <= 30; ++k) ser.points.push_back({double(k), u(rng)});
    c.series.push_back(ser);
  }
  const std::string svg = RenderLineChart(c);
  const std::vector<double> cx = Attr(svg, "circle", "cx");
  ASSERT_EQ(cx.size(), 120u);
  for (double x : cx) {
    EXPECT_GE(x, kPlotLeft - 0.01);
    EXPECT_LE(x, kPlotRight + 0.01);
  }
  EXPECT_NEAR(*std::min_element(cx.begin(), cx.end()), kPlotLeft, 0.1);  // step 1 at the axis
  // Legend labels (anchored at their start) are right of the plot area.
  const std::vector<double> legend_x = Attr(svg, "text", "x", "text-anchor=\"start\"");
  ASSERT_EQ(legend_x.size(), 4u);
  for (double x : legend_x) EXPECT_GT(x, kPlotRight);
  EXPECT_GE(kLegendLeft, kPlotRight);
  // The x tick labels: whole steps from 1, none at 0 or below.
  std::smatch m;
  std::regex tick("text-anchor=\"middle\">(-?[0-9.]+)</text>");
  std::vector<double> ticks;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), tick); it != std::sregex_iterator();
       ++it)
    ticks.push_back(std::stod((*it)[1]));
  ASSERT_FALSE(ticks.empty());
  EXPECT_EQ(*std::min_element(ticks.begin(), ticks.end()), 1);
  for (double t : ticks) EXPECT_EQ(t, std::floor(t));
}

TEST(ReportCharts, StackedBarsStayInThePlotAndStackToTheTotal) {
  StackedBarChart c{.title = "Step time", .y_label = "s", .parts = {"a", "b", "c"}};
  c.bars = {{"none/none", {0.2, 0.1, 0.05}}, {"nvme/nvme", {0.2, 0.9, 0.3}}};
  const std::string svg = RenderStackedBars(c);
  const std::vector<double> xs = Attr(svg, "rect", "x", "<title>");
  // 6 stacked parts + 3 legend boxes (+ the background at 0).
  std::vector<double> bar_x, legend_x;
  for (double x : Attr(svg, "rect", "x"))
    if (x >= kLegendLeft)
      legend_x.push_back(x);
    else if (x > 0)
      bar_x.push_back(x);
  EXPECT_EQ(bar_x.size(), 6u);
  EXPECT_EQ(legend_x.size(), 3u);
  for (double x : bar_x) EXPECT_LT(x, kPlotRight);
  // The tallest bar (1.4 s) sets the axis: its top is at or below the plot's top.
  for (double y : Attr(svg, "rect", "y")) EXPECT_GE(y, 0);
}

TEST(ReportCharts, NiceTicksAndLabels) {
  const std::vector<double> fifths = NiceTicks(0, 1.0, 5), want = {0, 0.2, 0.4, 0.6, 0.8, 1.0};
  ASSERT_EQ(fifths.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(fifths[i], want[i], 1e-12);
  const auto t = NiceTicks(0, 47, 5);
  EXPECT_EQ(t.front(), 0);
  EXPECT_GE(t.back(), 47);
  EXPECT_EQ(BytesLabel(65536), "64K");
  EXPECT_EQ(BytesLabel(1 << 20), "1M");
  EXPECT_EQ(BytesLabel(double(1ull << 30)), "1G");
  EXPECT_EQ(Escape("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;");
}

TEST(ReportPage, OneSvgPerChartAndNoScript) {
  Report r = FakeReport(0.95, 0.9);
  LineChart c{.title = "t <x>", .x_label = "x", .y_label = "y"};
  c.series.push_back({.name = "s", .points = {{1, 2}, {2, 3}}});
  r.sections[0].charts = {RenderLineChart(c), RenderLineChart(c)};
  Section skipped{
      .id = "gpu_adam", .title = "GPU", .state = SectionState::kSkipped, .reason = "no GPU"};
  r.sections.push_back(skipped);
  const std::string html = RenderPage(r);
  size_t svgs = 0;
  for (size_t at = html.find("<svg"); at != std::string::npos; at = html.find("<svg", at + 1))
    ++svgs;
  EXPECT_EQ(svgs, 2u);
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("http://", html.find("<body")), html.find("http://www.w3.org/2000/svg"));
  EXPECT_NE(html.find("t &lt;x&gt;"), std::string::npos);
  EXPECT_NE(html.find("gpu_adam (no GPU)"), std::string::npos);
  const json j = ToJson(r);
  EXPECT_EQ(j["sections"][0]["charts"], 2);
  EXPECT_EQ(j["skipped"][0], "gpu_adam (no GPU)");
}

// ---------------------------------------------------------------- the child runner

TEST(ReportChild, CapturesOutputErrorTailAndExitCode) {
  const ChildResult r = RunChild({"/bin/sh", "-c", "echo out-line; echo err-line >&2; exit 7"}, 60);
  EXPECT_TRUE(r.error.empty()) << r.error;
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 7);
  EXPECT_EQ(r.out, "out-line\n");
  EXPECT_EQ(r.err_tail, "err-line\n");
}

TEST(ReportChild, DeadlineStopsTheChildAndWhatItStarted) {
  // The shell's own child (sleep) holds the pipes too: the whole process
  // group must go for the run to end.
  const ChildResult r = RunChild({"/bin/sh", "-c", "echo started; sleep 300 & wait"}, 1);
  EXPECT_TRUE(r.timed_out);
  EXPECT_EQ(r.out, "started\n");
  EXPECT_EQ(r.exit_code, 128 + SIGTERM);
  EXPECT_LT(r.seconds, 60);  // not the 300 s of the sleep
}

TEST(ReportChild, DeadlineAppliesAfterTheChildClosedItsOutput) {
  const ChildResult r = RunChild({"/bin/sh", "-c", "exec >&- 2>&-; sleep 300"}, 1);
  EXPECT_TRUE(r.timed_out);
  EXPECT_LT(r.seconds, 60);
}

TEST(ReportChild, MissingProgramIsExit127) {
  const ChildResult r = RunChild({"/nonexistent/strata-report-test"}, 10);
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_NE(r.err_tail.find("exec failed"), std::string::npos) << r.err_tail;
}

TEST(ReportChild, CommandLineQuotesWhatTheShellWouldSplit) {
  EXPECT_EQ(CommandLine({"strata", "bench", "nvme", "--path", "/tmp/a b"}),
            "strata bench nvme --path '/tmp/a b'");
  EXPECT_EQ(CommandLine({"x", "it's"}), "x 'it'\\''s'");
}

// ---------------------------------------------------------------- the command

struct RunResult {
  int exit_code = -1;
  std::string out, err;
};

RunResult RunCli(const std::string& args, const std::string& scratch) {
  const std::string err_file = scratch + "/stderr.txt";
  RunResult r;
  FILE* p = popen((std::string(STRATA_CLI_PATH) + " " + args + " 2>" + err_file).c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int st = pclose(p);
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  std::ifstream f(err_file);
  r.err.assign(std::istreambuf_iterator<char>(f), {});
  return r;
}

std::string ReadAll(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST(ReportCommand, TinyHostRunWritesEveryFigureWithUnitDeviceAndCommand) {
  testing::ScratchDir dir;
  const std::string out = dir.str() + "/report";
  const RunResult r = RunCli("report --tiny --device host --out " + out, dir.str());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("placements' losses agree"), std::string::npos) << r.out;
  const json j = json::parse(ReadAll(out + "/report.json"), nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  for (const char* key : {"version", "command", "device", "elapsed_s", "time_limit_s", "sections",
                          "checks", "skipped", "exit_code"})
    EXPECT_TRUE(j.contains(key)) << key;
  std::map<std::string, json> sections;
  for (const json& s : j["sections"]) sections[s["id"]] = s;
  for (const char* id : {"machine", "pcie", "cpu_adam", "nvme", "training"}) {
    ASSERT_TRUE(sections.count(id)) << id;
    EXPECT_EQ(sections[id]["state"], "ok") << id << ": " << sections[id]["reason"];
  }
  EXPECT_EQ(sections["gpu_adam"]["state"], "skipped");
  EXPECT_EQ(sections["gpu_adam"]["reason"], "no GPU");
  size_t figures = 0;
  for (const json& s : j["sections"])
    for (const json& f : s["figures"]) {
      ++figures;
      EXPECT_FALSE(f["unit"].get<std::string>().empty()) << f;
      EXPECT_FALSE(f["device"].get<std::string>().empty()) << f;
      EXPECT_EQ(f["command"].get<std::string>().rfind("strata ", 0), 0u) << f;
    }
  EXPECT_GT(figures, 20u);
  // Four placements trained, three of them again with the speculative step
  // (off by default on the host device), cpu/none with
  // delayed_param_update and with bf16 moments, cpu/none and cpu/cpu with
  // offload_optimizer.ratio 0.5, their losses compared (but the delayed
  // one's; the bf16 moments' shown, outside the fp32 agreement).
  EXPECT_EQ(sections["training"]["raw"].size(), 11u);
  EXPECT_TRUE(sections["training"]["raw"].contains("cpu/none, delayed_param_update"));
  EXPECT_TRUE(sections["training"]["raw"].contains("cpu/none, bf16 moments"));
  {
    const json cfg = json::parse(ReadAll(out + "/configs/cpu_none_bf16.json"), nullptr, false);
    ASSERT_FALSE(cfg.is_discarded());
    EXPECT_EQ(cfg["strata"]["optimizer_states"], "bf16");
  }
  bool vs_fp32 = false;
  for (const json& f : sections["training"]["figures"])
    vs_fp32 |= f["name"] == "cpu/none, bf16 moments tokens/s vs cpu/none";
  EXPECT_TRUE(vs_fp32);
  for (const char* file : {"cpu_none_split", "cpu_cpu_split"}) {
    const json cfg = json::parse(ReadAll(out + "/configs/" + file + ".json"), nullptr, false);
    ASSERT_FALSE(cfg.is_discarded()) << file;
    EXPECT_EQ(cfg["zero_optimization"]["offload_optimizer"]["ratio"], 0.5) << file;
  }
  EXPECT_TRUE(sections["training"]["raw"].contains("cpu/cpu, ratio 0.5"));
  // How many sub-groups the speculative step reaches before backward ends
  // is the machine's timing (a loaded machine may reach none: a test
  // assert on it would flake); SpeculationTest covers what it steps. Here:
  // the run had the speculation on, and its losses agreed (the check below).
  for (const auto& [name, file] :
       {std::pair{"cpu/none, speculative step", "cpu_none_speculative"},
        std::pair{"cpu/cpu, speculative step", "cpu_cpu_speculative"},
        std::pair{"nvme/nvme, speculative step", "nvme_nvme_speculative"}}) {
    ASSERT_TRUE(sections["training"]["raw"].contains(name)) << name;
    const json cfg = json::parse(ReadAll(out + "/configs/" + file + ".json"), nullptr, false);
    ASSERT_FALSE(cfg.is_discarded()) << file;
    EXPECT_EQ(cfg["strata"]["speculative_step"], true) << file;
    for (const json& st : sections["training"]["raw"][name][0]["per_step"])
      EXPECT_TRUE(st.contains("sub_groups_speculated")) << name;
  }
  // With fio, the NVMe check re-measures fio's best grid point as
  // engine/fio pairs: the two grid points and that run.
  if (std::system("command -v fio >/dev/null 2>&1") == 0) {
    EXPECT_EQ(sections["nvme"]["raw"].size(), 3u);
    for (const json& c : j["checks"])
      if (c["name"] == "NVMe engine vs fio's best") {
        EXPECT_NE(c.dump().find("pairs' ratios"), std::string::npos) << c;
        EXPECT_NE(c.dump().find("quartiles"), std::string::npos) << c;
      }
  }
  // The state formats at every PU, in one process, in a table and checks
  // (skipped with --tiny): bf16 and int8 against fp32 and their rooflines.
  {
    const json& raw = sections["cpu_adam"]["raw"];
    ASSERT_FALSE(raw.empty());
    ASSERT_TRUE(raw.back().contains("formats")) << raw.back();
    EXPECT_EQ(raw.back()["formats"].size(), 4u);
    bool table = false;
    for (const json& t : sections["cpu_adam"]["tables"])
      if (t["caption"].get<std::string>().rfind("Optimizer-state formats", 0) == 0) {
        table = true;
        EXPECT_EQ(t["rows"].size(), 4u) << t;
      }
    EXPECT_TRUE(table) << sections["cpu_adam"]["tables"];
    size_t format_checks = 0;
    for (const json& c : j["checks"])
      if (c["name"].get<std::string>().rfind("CPU Adam bf16 ", 0) == 0 ||
          c["name"].get<std::string>().rfind("CPU Adam int8 ", 0) == 0) {
        ++format_checks;
        // "--tiny: sizes too small to judge", or a busy machine's reason.
        EXPECT_EQ(c["state"], "skipped") << c;
      }
    EXPECT_EQ(format_checks, 4u) << j["checks"];
  }
  bool losses_checked = false;
  for (const json& c : j["checks"])
    if (c["name"] == "placements' losses agree") losses_checked = c["state"] == "pass";
  EXPECT_TRUE(losses_checked) << j["checks"];
  // The page: one <svg> per chart, as report.json counts them.
  const std::string html = ReadAll(out + "/index.html");
  size_t charts = 0, svgs = 0;
  for (const json& s : j["sections"]) charts += s["charts"].get<size_t>();
  for (size_t at = html.find("<svg"); at != std::string::npos; at = html.find("<svg", at + 1))
    ++svgs;
  EXPECT_EQ(charts, 6u);  // pcie, cpu adam, nvme write + read, step phases, loss
  EXPECT_EQ(svgs, charts);
  EXPECT_NE(html.find("</html>"), std::string::npos);
}

TEST(ReportCommand, TimeLimitStopsAndListsWhatItSkipped) {
  testing::ScratchDir dir;
  const std::string out = dir.str() + "/report";
  const RunResult r =
      RunCli("report --tiny --device host --time-limit 1 --json --out " + out, dir.str());
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  // --json prints report.json itself.
  const json j = json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j, json::parse(ReadAll(out + "/report.json"), nullptr, false));
  std::string skipped;
  for (const json& s : j["skipped"]) skipped += s.get<std::string>() + "\n";
  for (const char* id :
       {"pcie (time limit", "cpu_adam (time limit", "nvme (time limit", "training (time limit"})
    EXPECT_NE(skipped.find(id), std::string::npos) << id << " in\n" << skipped;
  for (const json& c : j["checks"]) EXPECT_NE(c["state"], "FAIL") << c;
}

TEST(ReportCommand, BadConfigIsAConfigError) {
  testing::ScratchDir dir;
  std::ofstream(dir.str() + "/bad.json") << "{ not json";
  const RunResult r = RunCli(
      "report --tiny --device host --out " + dir.str() + "/r --config " + dir.str() + "/bad.json",
      dir.str());
  EXPECT_EQ(r.exit_code, kExitConfig) << r.err;
  EXPECT_NE(r.err.find("bad.json"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace strata::cli::report
