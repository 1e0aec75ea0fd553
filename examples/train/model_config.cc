// strata.model, the example model's section of the config: read from the
// JSON text the library keeps for the application
// (StrataConfig::application_sections["model"]), checked, and written back.
// See model.h.
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "examples/train/model.h"

namespace strata::example {
namespace {

using json = nlohmann::json;

constexpr std::string_view kSection = "model";

// A value as written, cut short when long.
std::string Show(const json& v) {
  constexpr size_t kMaxChars = 64;
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > kMaxChars) s = s.substr(0, kMaxChars - 3) + "...";
  return s;
}

// A key as it may appear in a message: control characters replaced, cut short.
std::string ShowKey(std::string_view key) {
  constexpr size_t kMaxChars = 48;
  std::string out(key.substr(0, kMaxChars));
  for (char& c : out)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  if (key.size() > kMaxChars) out += "...";
  return out;
}

Status ValueError(const std::string& path, const json& v, std::string_view what) {
  return InvalidArgumentError(path + ": " + Show(v) + " " + std::string(what));
}

// A whole number, also in exponent form (5e8), as the config loader reads one.
Status ReadInt(const json& v, const std::string& path, int64_t* out) {
  constexpr std::string_view kExpect =
      "is not an integer (expected a whole number such as 8 or 5e8)";
  constexpr std::string_view kRange = "is out of range (at most 9223372036854775807)";
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return ValueError(path, v, kRange);
    *out = static_cast<int64_t>(v.get<uint64_t>());
    return Status::Ok();
  }
  if (v.is_number_integer()) {
    *out = v.get<int64_t>();
    return Status::Ok();
  }
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d) || d != std::trunc(d)) return ValueError(path, v, kExpect);
    if (d < -9223372036854775808.0 || d >= 9223372036854775808.0)
      return ValueError(path, v, kRange);
    *out = static_cast<int64_t>(d);
    return Status::Ok();
  }
  if (v.is_string() && v.get_ref<const std::string&>() == "auto")
    return ValueError(path, v, "is not an integer (\"auto\" is not accepted for this key)");
  return ValueError(path, v, kExpect);
}

Status NotAllowed(const std::string& path, int64_t value, std::string_view rule) {
  return InvalidArgumentError(path + ": " + std::to_string(value) + " is not allowed; " +
                              std::string(rule));
}

}  // namespace

Status ValidateModelConfig(const ModelConfig& m) {
  if (m.layers <= 0) return NotAllowed("strata.model.layers", m.layers, "must be > 0");
  if (m.hidden < 8) return NotAllowed("strata.model.hidden", m.hidden, "must be >= 8");
  if (m.seq_len < 2) return NotAllowed("strata.model.seq_len", m.seq_len, "must be >= 2");
  if (m.vocab != 256)
    return NotAllowed("strata.model.vocab", m.vocab,
                      "must be 256 (the example model is byte-level)");
  if (m.seed < 0) return NotAllowed("strata.model.seed", m.seed, "must be >= 0");
  if (m.steps < 0) return NotAllowed("strata.model.steps", m.steps, "must be >= 0");
  return Status::Ok();
}

StatusOr<ModelConfig> ModelConfigFromConfig(const Config& config,
                                            std::vector<std::string>* warnings) {
  ModelConfig m;
  const auto& sections = config.strata.application_sections;
  const auto it = sections.find(std::string(kSection));
  if (it == sections.end()) return m;
  const json section = json::parse(it->second, nullptr, /*allow_exceptions=*/false);
  if (!section.is_object())
    return InvalidArgumentError("strata.model: the section's text is not a JSON object");
  const std::pair<std::string_view, int64_t*> fields[] = {
      {"layers", &m.layers}, {"hidden", &m.hidden}, {"seq_len", &m.seq_len},
      {"vocab", &m.vocab},   {"seed", &m.seed},     {"steps", &m.steps}};
  for (const auto& [key, field] : fields) {
    const auto value = section.find(std::string(key));
    if (value != section.end())
      STRATA_RETURN_IF_ERROR(ReadInt(*value, "strata.model." + std::string(key), field));
  }
  for (auto entry = section.begin(); entry != section.end(); ++entry) {
    bool known = false;
    for (const auto& f : fields) known |= f.first == entry.key();
    if (!known && warnings != nullptr)
      warnings->push_back("unknown key strata.model." + ShowKey(entry.key()) + " (ignored)");
  }
  STRATA_RETURN_IF_ERROR(ValidateModelConfig(m));
  return m;
}

void SetModelConfig(const ModelConfig& m, Config* config) {
  const json section = {{"layers", m.layers}, {"hidden", m.hidden}, {"seq_len", m.seq_len},
                        {"vocab", m.vocab},   {"seed", m.seed},     {"steps", m.steps}};
  config->strata.application_sections[std::string(kSection)] = section.dump();
}

}  // namespace strata::example
