// Section: typed reads of one JSON object's keys. Each read names the key
// path in its error message, marks the key as read, and checks that the key
// is declared in the schema (schema.cc); at the end ReportUnread hands every
// key nobody read to the schema's verdict. Also the value readers (type
// checks only; ranges are validate.cc's) and how values appear in messages.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>

#include "src/common/units.h"
#include "src/config/config_internal.h"

namespace strata::config_internal {
namespace {

constexpr size_t kMaxShownValueChars = 64;
constexpr int kMaxShownDepth = 8;  // deeper containers print as [...] / {...}

// Appends `v` as compact JSON, stopping soon after `limit` characters and
// below kMaxShownDepth levels: the cost is bounded whatever the value.
void ShowInto(const json& v, size_t limit, int depth, std::string* out) {
  auto quoted = [](std::string_view text) {
    return json(std::string(text)).dump(-1, ' ', false, json::error_handler_t::replace);
  };
  switch (v.type()) {
    case json::value_t::object:
    case json::value_t::array: {
      const bool object = v.is_object();
      if (v.empty()) {
        *out += object ? "{}" : "[]";
        return;
      }
      if (depth >= kMaxShownDepth) {
        *out += object ? "{...}" : "[...]";
        return;
      }
      *out += object ? '{' : '[';
      bool first = true;
      for (auto it = v.begin(); it != v.end() && out->size() <= limit; ++it) {
        if (!first) *out += ',';
        first = false;
        if (object) *out += quoted(it.key().substr(0, limit)) + ":";
        ShowInto(*it, limit, depth + 1, out);
      }
      *out += object ? '}' : ']';
      return;
    }
    case json::value_t::string: {
      const std::string& text = v.get_ref<const std::string&>();
      *out += quoted(std::string_view(text).substr(0, limit));
      return;
    }
    default:  // numbers, booleans, null: a few characters
      *out += v.dump();
  }
}

}  // namespace

std::string Show(const json& v) {
  std::string s;
  ShowInto(v, kMaxShownValueChars, 0, &s);
  if (s.size() > kMaxShownValueChars) s = s.substr(0, kMaxShownValueChars - 3) + "...";
  return s;
}

std::string ShowKey(std::string_view key) {
  constexpr size_t kMaxKeyChars = 48;
  std::string out(key.substr(0, kMaxKeyChars));
  for (char& c : out)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  if (key.size() > kMaxKeyChars) out += "...";
  return out;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

Status ValueError(std::string_view path, const json& v, std::string_view what) {
  return InvalidArgumentError(fmt::format("{}: {} {}", path, Show(v), what));
}

// ---- Value readers -------------------------------------------------------------

Status ReadInt(const json& v, std::string_view path, int64_t* out) {
  constexpr std::string_view kExpect =
      "is not an integer (expected a whole number such as 8 or 5e8)";
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return ValueError(path, v, "is out of range (at most 9223372036854775807)");
    *out = static_cast<int64_t>(u);
    return Status::Ok();
  }
  if (v.is_number_integer()) {
    *out = v.get<int64_t>();
    return Status::Ok();
  }
  if (v.is_number_float()) {
    double d = v.get<double>();
    if (!std::isfinite(d) || d != std::trunc(d)) return ValueError(path, v, kExpect);
    // [-2^63, 2^63): the doubles that convert to int64 exactly.
    if (d < -9223372036854775808.0 || d >= 9223372036854775808.0)
      return ValueError(path, v, "is out of range (at most 9223372036854775807)");
    *out = static_cast<int64_t>(d);
    return Status::Ok();
  }
  if (IsAuto(v))
    return ValueError(path, v, "is not an integer (\"auto\" is not accepted for this key)");
  return ValueError(path, v, kExpect);
}

Status ReadDouble(const json& v, std::string_view path, double* out) {
  if (v.is_number()) {
    *out = v.get<double>();
    return Status::Ok();
  }
  if (IsAuto(v))
    return ValueError(path, v, "is not a number (\"auto\" is not accepted for this key)");
  return ValueError(path, v, "is not a number (expected a JSON number such as 0.9 or 1e-8)");
}

Status ReadBool(const json& v, std::string_view path, bool* out) {
  if (v.is_boolean()) {
    *out = v.get<bool>();
    return Status::Ok();
  }
  if (IsAuto(v))
    return ValueError(path, v, "is not a boolean (\"auto\" is not accepted for this key)");
  if (v.is_string())
    return ValueError(path, v, "is not a boolean (write true or false without quotes)");
  return ValueError(path, v, "is not a boolean (expected true or false)");
}

Status ReadBytes(const json& v, std::string_view path, int64_t* out) {
  constexpr std::string_view kExpect =
      "is not a byte count (expected a non-negative integer or a string such as \"8G\", "
      "\"512M\", \"64KiB\"; suffixes are binary, K = 1024)";
  if (v.is_number()) {
    if (!ReadInt(v, path, out).ok() || *out < 0) return ValueError(path, v, kExpect);
    return Status::Ok();
  }
  if (v.is_string() && ParseByteSize(v.get_ref<const std::string&>(), out)) return Status::Ok();
  return ValueError(path, v, kExpect);
}

// ---- Section ---------------------------------------------------------------------

std::string Section::PathOf(std::string_view key) const {
  return path_.empty() ? std::string(key) : fmt::format("{}.{}", path_, key);
}

const json* Section::Take(std::string_view key) {
  if (diag_.undeclared->empty() && FindKey(PathOf(key)) == nullptr) *diag_.undeclared = PathOf(key);
  const json* v = Peek(key);
  if (v == nullptr) return nullptr;
  read_.insert(std::string(key));
  return auto_is_default_ && IsAuto(*v) ? nullptr : v;
}

const json* Section::Peek(std::string_view key) const {
  auto it = obj_.find(std::string(key));
  return it == obj_.end() ? nullptr : &*it;
}

bool Section::Given(std::string_view key) const {
  const json* v = Peek(key);
  return v != nullptr && !v->is_null() && !IsAuto(*v);
}

bool Section::IsAutoKey(std::string_view key) const {
  const json* v = Peek(key);
  return v != nullptr && IsAuto(*v);
}

const json* Section::TakeValue(std::string_view key, Auto a) {
  const json* v = Take(key);
  if (v && a == Auto::kAllowed && (v->is_null() || IsAuto(*v))) return nullptr;
  return v;
}

Status Section::Int(std::string_view key, int64_t* out, Auto a) {
  const json* v = TakeValue(key, a);
  return v ? ReadInt(*v, PathOf(key), out) : Status::Ok();
}

Status Section::Int32(std::string_view key, int* out) {
  int64_t wide = *out;
  RETURN_IF_ERROR(Int(key, &wide));
  if (wide < std::numeric_limits<int>::min() || wide > std::numeric_limits<int>::max())
    return ValueError(PathOf(key), *Peek(key), "is out of range (must fit in 32 bits)");
  *out = static_cast<int>(wide);
  return Status::Ok();
}

Status Section::Double(std::string_view key, double* out, Auto a) {
  const json* v = TakeValue(key, a);
  return v ? ReadDouble(*v, PathOf(key), out) : Status::Ok();
}

Status Section::Bool(std::string_view key, bool* out, Auto a) {
  const json* v = TakeValue(key, a);
  return v ? ReadBool(*v, PathOf(key), out) : Status::Ok();
}

Status Section::Bytes(std::string_view key, int64_t* out) {
  const json* v = Take(key);
  return v ? ReadBytes(*v, PathOf(key), out) : Status::Ok();
}

Status Section::String(std::string_view key, std::string* out) {
  const json* v = Take(key);
  if (!v) return Status::Ok();
  if (!v->is_string()) return ValueError(PathOf(key), *v, "is not a string");
  *out = v->get<std::string>();
  return Status::Ok();
}

Status Section::Paths(std::string_view key, std::vector<std::string>* out) {
  const json* v = Take(key);
  if (!v || v->is_null()) return Status::Ok();
  constexpr std::string_view kExpect =
      "(expected a directory as a string, or a non-empty list of directory strings)";
  if (v->is_string()) {
    out->clear();
    if (!v->get_ref<const std::string&>().empty()) out->push_back(v->get<std::string>());
    return Status::Ok();
  }
  if (!v->is_array()) return ValueError(PathOf(key), *v, fmt::format("is not a path {}", kExpect));
  // An empty list means "no path" (ConfigToJson writes one for a non-nvme
  // device); ValidateConfig rejects it when the device is nvme.
  std::vector<std::string> paths;
  for (size_t i = 0; i < v->size(); ++i) {
    const json& e = (*v)[i];
    if (!e.is_string() || e.get_ref<const std::string&>().empty())
      return ValueError(fmt::format("{}[{}]", PathOf(key), i), e,
                        fmt::format("is not a non-empty string {}", kExpect));
    paths.push_back(e.get<std::string>());
  }
  *out = std::move(paths);
  return Status::Ok();
}

Status Section::Child(std::string_view key, std::optional<Section>* out) {
  const json* v = Take(key);
  if (!v) return Status::Ok();
  if (!v->is_object()) return ValueError(PathOf(key), *v, "is not an object (expected { ... })");
  out->emplace(*v, PathOf(key), diag_, auto_is_default_);
  return Status::Ok();
}

Status Section::Agree(std::string_view key, std::string_view alias) const {
  if (Given(key) && Given(alias) && *Peek(key) != *Peek(alias)) return Conflict(key, alias);
  return Status::Ok();
}

Status Section::Conflict(std::string_view key, std::string_view alias) const {
  return InvalidArgumentError(fmt::format(
      "{}: {} conflicts with {}: {} ({} and {} are two spellings of one DeepSpeed key; write "
      "one of them)",
      PathOf(key), Show(*Peek(key)), PathOf(alias), Show(*Peek(alias)), key, alias));
}

Status Section::ReportUnread() const {
  for (auto it = obj_.begin(); it != obj_.end(); ++it) {
    if (read_.count(it.key())) continue;
    RETURN_IF_ERROR(JudgeUnreadKey(path_, it.key(), *it, auto_is_default_, diag_.warnings));
  }
  return Status::Ok();
}

}  // namespace strata::config_internal
