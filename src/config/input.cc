// JSON text in: the entry points ParseConfig and LoadConfigFile. Enforces
// the input limits of config.h (kMaxConfigBytes of text, kMaxConfigDepth
// levels of nesting, each key once per object), turns malformed JSON into an
// error naming the source, line and column, then hands the document to
// ReadConfig (read_deepspeed.cc) and the result to ValidateConfig
// (validate.cc). Nothing thrown by nlohmann escapes.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <memory>
#include <new>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "src/common/log.h"
#include "src/config/config_internal.h"

namespace strata {
namespace {

using config_internal::json;
using config_internal::ShowKey;

// Byte offset (nlohmann counts the characters read, 1-based) → line, column.
std::pair<size_t, size_t> LineColumn(std::string_view text, size_t byte) {
  size_t idx = std::min(byte == 0 ? 0 : byte - 1, text.size());
  size_t line = 1, line_start = 0;
  for (size_t i = 0; i < idx; ++i) {
    if (text[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
  return {line, idx - line_start + 1};
}

// nlohmann's what() is "[json.exception.parse_error.101] parse error at line
// L, column C: <reason>"; keep the reason.
std::string ParseErrorReason(const std::string& what) {
  size_t at = what.find("column ");
  if (at != std::string::npos) {
    size_t colon = what.find(": ", at);
    if (colon != std::string::npos) return what.substr(colon + 2);
  }
  size_t bracket = what.find("] ");
  return bracket == std::string::npos ? what : what.substr(bracket + 2);
}

// Watches nlohmann's parser (its callback sees every event in order) and
// refuses what the DOM would silently accept or what could hurt later:
// a key repeated in one object (nlohmann keeps the last; DeepSpeed refuses
// duplicates) and nesting deeper than kMaxConfigDepth. It throws Refused,
// which ParseConfig catches; nothing escapes the module. Its own state grows
// with the nesting depth (bounded) and the keys of the open objects.
class InputGuard {
 public:
  struct Refused {
    std::string message;
  };

  bool Observe(int /*depth*/, json::parse_event_t event, const json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        CountElement();
        if (frames_.size() >= static_cast<size_t>(kMaxConfigDepth))
          throw Refused{fmt::format(
              "{}: nested deeper than {} levels of objects and arrays (a DeepSpeed config needs "
              "4)",
              Path(), kMaxConfigDepth)};
        frames_.emplace_back().array = event == json::parse_event_t::array_start;
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!frames_.empty()) frames_.pop_back();
        break;
      case json::parse_event_t::key: {
        Frame& f = frames_.back();
        f.key = parsed.get<std::string>();
        if (!f.keys.insert(f.key).second)
          throw Refused{fmt::format(
              "{}: duplicate key (a key may appear once in an object; DeepSpeed refuses "
              "duplicates too)",
              Path())};
        break;
      }
      case json::parse_event_t::value:
        CountElement();
        break;
    }
    return true;
  }

 private:
  struct Frame {
    bool array = false;
    size_t elements = 0;                   // arrays: elements begun so far
    std::string key;                       // objects: the key being read
    std::unordered_set<std::string> keys;  // objects: keys seen
  };

  void CountElement() {
    if (!frames_.empty() && frames_.back().array) ++frames_.back().elements;
  }

  // The key path of the current position ("<top level>" before any key),
  // cut short when long.
  std::string Path() const {
    constexpr size_t kMaxPathChars = 100;
    std::string path;
    for (const Frame& f : frames_) {
      if (path.size() > kMaxPathChars) {
        path += "...";
        break;
      }
      if (f.array) {
        path += fmt::format("[{}]", f.elements == 0 ? 0 : f.elements - 1);
      } else if (!f.key.empty() || !f.keys.empty()) {
        if (!path.empty()) path += '.';
        path += ShowKey(f.key);
      }
    }
    return path.empty() ? "<top level>" : path;
  }

  std::vector<Frame> frames_;
};

}  // namespace

StatusOr<Config> ParseConfig(std::string_view json_text, std::string_view source) {
  return ParseConfig(json_text, source, AutoValues{});
}

StatusOr<Config> ParseConfig(std::string_view json_text, std::string_view source,
                             const AutoValues& auto_values) {
  const bool named = source != "<string>";
  auto with_source = [&](Status s) { return named ? s.WithContext(source) : s; };
  if (json_text.size() > kMaxConfigBytes)
    return with_source(InvalidArgumentError(fmt::format(
        "the config is {} bytes; at most {} ({} MiB) are accepted (a DeepSpeed config is a few KB)",
        json_text.size(), kMaxConfigBytes, kMaxConfigBytes >> 20)));
  // JSON text has no NUL byte (not even in a string, where control
  // characters are escaped); nlohmann would call it the end of the input.
  if (const size_t nul = json_text.find('\0'); nul != std::string_view::npos) {
    auto [line, column] = LineColumn(json_text, nul + 1);
    return InvalidArgumentError(fmt::format(
        "{}:{}:{}: a NUL byte (0x00) at byte offset {}: a config is JSON text, which has none",
        source, line, column, nul));
  }
  json root;
  InputGuard guard;
  try {
    root = json::parse(json_text.begin(), json_text.end(),
                       [&guard](int depth, json::parse_event_t event, json& parsed) {
                         return guard.Observe(depth, event, parsed);
                       });
  } catch (const InputGuard::Refused& e) {
    return with_source(InvalidArgumentError(e.message));
  } catch (const json::parse_error& e) {
    auto [line, column] = LineColumn(json_text, e.byte);
    return InvalidArgumentError(fmt::format("{}:{}:{}: malformed JSON: {}", source, line, column,
                                            ParseErrorReason(e.what())));
  } catch (const json::exception& e) {  // nothing else is expected; never let it escape
    return InvalidArgumentError(fmt::format("{}: malformed JSON: {}", source, e.what()));
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError(
        fmt::format("{}: out of memory while parsing the config", source));
  }
  if (root.is_null())
    return with_source(
        InvalidArgumentError("the top level is null, expected a JSON object { ... }"));
  if (!root.is_object())
    return with_source(
        InvalidArgumentError(fmt::format("the top level is {} {}, expected a JSON object {{ ... }}",
                                         root.type_name(), config_internal::Show(root))));
  Config config;
  Status s;
  try {
    s = config_internal::ReadConfig(root, auto_values, &config);
  } catch (const json::exception& e) {  // a reader bug, not the user's; keep it inside
    s = InternalError(fmt::format("reading config: {}", e.what()));
  } catch (const std::bad_alloc&) {
    s = ResourceExhaustedError("out of memory while reading the config");
  }
  if (s.ok()) s = ValidateConfig(config);
  if (!s.ok()) return with_source(std::move(s));
  for (const std::string& w : config.warnings) STRATA_LOG_WARN("{}: {}", source, w);
  for (const std::string& n : config.notices) STRATA_LOG_INFO("{}: {}", source, n);
  return config;
}

StatusOr<Config> LoadConfigFile(const std::string& path) {
  return LoadConfigFile(path, AutoValues{});
}

StatusOr<Config> LoadConfigFile(const std::string& path, const AutoValues& auto_values) {
  // O_NONBLOCK: a FIFO without a writer would block open() for ever; the
  // file is refused below unless it is a regular one, and the flag cleared.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT || err == ENOTDIR)
      return NotFoundError(fmt::format("config file {} does not exist", path));
    Status s = ErrnoError(fmt::format("cannot open config file {}", path), err);
    return s.code() == StatusCode::kNotFound ? s : IOError(std::string(s.message()));
  }
  std::unique_ptr<FILE, int (*)(FILE*)> file(::fdopen(fd, "rb"), &std::fclose);
  if (!file) {
    int err = errno;
    ::close(fd);
    return IOError(
        std::string(ErrnoError(fmt::format("cannot open config file {}", path), err).message()));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    return IOError(std::string(ErrnoError(fmt::format("config file {}", path), err).message()));
  }
  if (S_ISDIR(st.st_mode))
    return IOError(fmt::format("config file {} is a directory, not a file", path));
  if (!S_ISREG(st.st_mode))
    return IOError(fmt::format("config file {}: not a regular file ({}); refused", path,
                               S_ISFIFO(st.st_mode)   ? "a FIFO"
                               : S_ISSOCK(st.st_mode) ? "a socket"
                                                      : "a device"));
  if (static_cast<uint64_t>(st.st_size) > kMaxConfigBytes)
    return InvalidArgumentError(fmt::format(
        "config file {}: the config is {} bytes; at most {} ({} MiB) are accepted (a DeepSpeed "
        "config is a few KB)",
        path, static_cast<uint64_t>(st.st_size), kMaxConfigBytes, kMaxConfigBytes >> 20));
  if (::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) {
    int err = errno;
    return IOError(std::string(ErrnoError(fmt::format("config file {}", path), err).message()));
  }
  // Read at most one byte past the limit (the size of a /proc file is unknown
  // in advance); ParseConfig refuses the oversized text.
  std::string text;
  char buf[1 << 16];
  size_t n = 0;
  while (text.size() <= kMaxConfigBytes && (n = std::fread(buf, 1, sizeof(buf), file.get())) > 0)
    text.append(buf, n);
  if (std::ferror(file.get())) {
    int err = errno;
    return IOError(
        std::string(ErrnoError(fmt::format("cannot read config file {}", path), err).message()));
  }
  // Only a file whose size stat does not give (a /proc file) gets here with
  // more than the limit: its size is unknown.
  if (text.size() > kMaxConfigBytes)
    return InvalidArgumentError(fmt::format(
        "config file {} gives more than {} bytes ({} MiB), the most accepted, and has no size "
        "of its own (a /proc file; a DeepSpeed config is a few KB)",
        path, kMaxConfigBytes, kMaxConfigBytes >> 20));
  return ParseConfig(text, path, auto_values);
}

}  // namespace strata
