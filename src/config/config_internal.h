// What the files of the config loader share (private to src/config; the
// contract is include/strata/config.h, the rules docs/design.md "Config
// loader"). Which file owns what:
//
//   input.cc          JSON text in: size and nesting limits, duplicate keys,
//                     malformed JSON, files; ParseConfig and LoadConfigFile.
//   schema.cc         THE table of every key Strata knows (path, type,
//                     default, allowed values or why it is not used, whether
//                     it may differ on resume), enum names, and the
//                     unknown/unused/unsupported verdict for a key nobody
//                     read. A new key is declared there first. What other
//                     modules read of it: schema.h.
//   section.cc        Section: typed reads of one JSON object's keys, with
//                     their key paths in error messages.
//   read_deepspeed.cc The DeepSpeed sections (zero_optimization, aio,
//                     optimizer, fp16, bf16) and their legacy spellings;
//                     ReadConfig, the walk over the whole document.
//   auto_values.cc    "auto" resolution (AutoValues) and the batch-size rule.
//   read_strata.cc    The `strata` section.
//   read_scheduler.cc The `scheduler` section (DeepSpeed's lr schedules).
//   lr_schedule.cc    ScheduleAt: the schedules' formulas.
//   validate.cc       ValidateConfig: ranges and cross-field rules.
//   to_json.cc        ConfigToJson and Config equality.
//
// Reading checks types (it needs the JSON value); ranges and cross-field
// rules are ValidateConfig's, so that a hand-edited Config is checked by the
// same code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "src/common/status_util.h"
#include "strata/config.h"
#include "strata/status.h"

namespace strata::config_internal {

using json = nlohmann::json;

// ---- Showing values in messages (section.cc) --------------------------------

// A JSON value as written (compact), cut short if long or deep.
std::string Show(const json& v);
// A key as it may appear in a message: control characters replaced, cut short.
std::string ShowKey(std::string_view key);
std::string Lower(std::string_view s);
inline bool IsAuto(const json& v) {
  return v.is_string() && v.get_ref<const std::string&>() == "auto";
}
// InvalidArgument "<path>: <value> <what>".
Status ValueError(std::string_view path, const json& v, std::string_view what);

// ---- The schema (schema.cc) --------------------------------------------------

// The JSON type a key takes (for an unused or unsupported key: what DeepSpeed
// takes).
enum class KeyType {
  kInt,     // whole number, also in exponent form (5e8)
  kDouble,  // any JSON number
  kBool,    // true / false
  kBytes,   // byte count: integer or "8G"-style string
  kString,  // string
  kEnum,    // one string of a fixed list (case-insensitive)
  kPaths,   // a directory string or a list of them
  kPair,    // [a, b] of numbers
  kObject,  // a section
  kAny,     // a DeepSpeed key or section Strata reads nothing from
};

// What Strata does with a key.
enum class KeyUse {
  kRead,         // read into the Config
  kUnused,       // a DeepSpeed key with no effect here: a softer warning
  kUnsupported,  // a DeepSpeed setting Strata does not implement: an error
                 // unless written at its neutral value
  kApplication,  // a `strata` section the application owns: kept as JSON text
                 // (StrataConfig::application_sections), its keys unread; or a
                 // key of one that the library must know of (free_on_resume)
};

// One known key. `path` is dot-separated from the top level.
struct KeySpec {
  std::string_view path;
  KeyType type;
  KeyUse use = KeyUse::kRead;
  // The default as JSON text, as ParseConfig("{}") produces it (what
  // ConfigToJson writes for an empty config); "" where the key has none
  // (sections, legacy spellings, aliases, keys Strata does not use).
  std::string_view default_json = "";
  // kRead: the allowed values (validate.cc enforces them); kUnused: why
  // Strata ignores the key ("" when only "not used"); kUnsupported: why it
  // would change the training.
  std::string_view note = "";
  // Why the key (and every key below it) may differ between a checkpoint
  // and the engine that loads it, for `strata checkpoint info` and the
  // design notes; "" (most keys): compared, and a difference refuses the
  // checkpoint (ResumeFreeKeys, src/config/schema.h).
  std::string_view free_on_resume = "";
  // kUnsupported only: true for the value that changes nothing, and that
  // value as text.
  bool (*neutral)(const json&) = nullptr;
  std::string_view neutral_text = "";
};

// Every known key, in the order of the documentation.
const std::vector<KeySpec>& Schema();
// The name of each application-owned section of `strata` (the
// KeyUse::kApplication entries directly below `strata`).
std::vector<std::string_view> ApplicationSections();
// The entry of `path`, or nullptr for a key Strata does not know.
const KeySpec* FindKey(std::string_view path);
// The verdict on a key `key` of the section `section` ("" for the top level)
// present in the JSON that no reader asked for. Inside a section, a key
// Strata does not know is an error, with the section's closest known key as
// a suggestion; at the top level, a key close to one Strata reads is an error
// naming it, any other unknown key a warning. A DeepSpeed key Strata does not
// use is a warning (added to `warnings`); a DeepSpeed setting Strata does not
// implement, written at a value that would change the training, an error.
// `auto_is_default`: the section reads "auto" as absent (then "auto" is
// neutral everywhere).
Status JudgeUnreadKey(std::string_view section, std::string_view key, const json& value,
                      bool auto_is_default, std::vector<std::string>* warnings);
// The edit distance of `a` and `b` (insertions, deletions, substitutions and
// swaps of neighbours), or limit + 1 when it is above `limit`.
size_t EditDistance(std::string_view a, std::string_view b, size_t limit);

// ---- Enum names (schema.cc) --------------------------------------------------

template <typename E>
struct EnumName {
  std::string_view name;
  E value;
};

inline constexpr EnumName<OffloadDevice> kOffloadDevices[] = {
    {"none", OffloadDevice::kNone}, {"cpu", OffloadDevice::kCpu}, {"nvme", OffloadDevice::kNvme}};
inline constexpr EnumName<OptimizerType> kOptimizerTypes[] = {{"Adam", OptimizerType::kAdam},
                                                              {"AdamW", OptimizerType::kAdamW},
                                                              {"Adagrad", OptimizerType::kAdagrad},
                                                              {"Lion", OptimizerType::kLion}};
inline constexpr EnumName<DeviceKind> kDeviceKinds[] = {
    {"auto", DeviceKind::kAuto}, {"cuda", DeviceKind::kCuda}, {"host", DeviceKind::kHost}};
inline constexpr EnumName<GradTier> kGradTiers[] = {{"auto", GradTier::kAuto},
                                                    {"dram", GradTier::kDram},
                                                    {"nvme", GradTier::kNvme},
                                                    {"hbm", GradTier::kHbm}};
inline constexpr EnumName<OptimizerStates> kOptimizerStatesNames[] = {
    {"fp32", OptimizerStates::kFp32},
    {"bf16", OptimizerStates::kBf16},
    {"bf16-master", OptimizerStates::kBf16Master},
    {"int8", OptimizerStates::kInt8}};
inline constexpr EnumName<GradAccumulatorPlace> kGradAccumulatorPlaces[] = {
    {"auto", GradAccumulatorPlace::kAuto},
    {"device", GradAccumulatorPlace::kDevice},
    {"host", GradAccumulatorPlace::kHost}};
inline constexpr EnumName<IoEngineKind> kIoEngines[] = {{"auto", IoEngineKind::kAuto},
                                                        {"uring", IoEngineKind::kUring},
                                                        {"posix", IoEngineKind::kPosix}};

inline constexpr EnumName<LrScheduleType> kLrSchedules[] = {
    {"WarmupLR", LrScheduleType::kWarmupLR},
    {"WarmupDecayLR", LrScheduleType::kWarmupDecayLR},
    {"WarmupCosineLR", LrScheduleType::kWarmupCosineLR},
    {"OneCycle", LrScheduleType::kOneCycle},
    {"LRRangeTest", LrScheduleType::kLRRangeTest}};
inline constexpr EnumName<WarmupType> kWarmupTypes[] = {{"log", WarmupType::kLog},
                                                        {"linear", WarmupType::kLinear}};

// Which optimizer.params each type takes (DeepSpeed's CPU optimizers' names).
struct OptimizerParams {
  bool betas, eps, adam;  // adam: adam_w_mode, bias_correction
  std::string_view list;
};
OptimizerParams ParamsOf(OptimizerType t);

// ---- Value readers (section.cc; type checks only, ranges are validate.cc's) ----

Status ReadInt(const json& v, std::string_view path, int64_t* out);
Status ReadDouble(const json& v, std::string_view path, double* out);
Status ReadBool(const json& v, std::string_view path, bool* out);
Status ReadBytes(const json& v, std::string_view path, int64_t* out);

template <typename E, size_t N>
Status ReadEnum(const json& v, std::string_view path, const EnumName<E> (&names)[N], E* out,
                std::string_view note) {
  std::string allowed;
  for (size_t i = 0; i < N; ++i) allowed += (i ? ", " : "") + std::string(names[i].name);
  std::string tail = note.empty() ? "" : " (" + std::string(note) + ")";
  if (!v.is_string())
    return ValueError(path, v, "is not a string; expected one of " + allowed + tail);
  std::string lower = Lower(v.get_ref<const std::string&>());
  for (const auto& n : names) {
    if (Lower(n.name) == lower) {
      *out = n.value;
      return Status::Ok();
    }
  }
  return ValueError(path, v, "is not one of " + allowed + tail);
}

// ---- Section: one JSON object, its path, and which keys were read ----------

// "auto" (the Hugging Face integration's placeholder) and null resolve to the
// default only for the keys that pass Auto::kAllowed.
enum class Auto { kRejected, kAllowed };

// What reading produces besides the Config's values.
struct Diagnostics {
  std::vector<std::string>* warnings;
  std::vector<std::string>* notices;
  // The first key a reader asked for that the schema does not declare (a
  // bug in the loader, reported as InternalError by ReadConfig).
  std::string* undeclared;
};

class Section {
 public:
  // `auto_is_default`: "auto" for any key means "absent" (DeepSpeed's rule for
  // zero_optimization, its offload sections and aio).
  Section(const json& obj, std::string path, Diagnostics diag, bool auto_is_default = false)
      : obj_(obj), path_(std::move(path)), diag_(diag), auto_is_default_(auto_is_default) {}

  std::string PathOf(std::string_view key) const;
  const std::string& path() const { return path_; }
  Diagnostics diag() const { return diag_; }
  void Warn(std::string w) const { diag_.warnings->push_back(std::move(w)); }
  void Notice(std::string n) const { diag_.notices->push_back(std::move(n)); }

  // The value of `key`, marked as read; nullptr when absent (or "auto" in a
  // section where that means absent). `key` must be declared in the schema.
  const json* Take(std::string_view key);
  // The value of `key` without marking it read; nullptr when absent.
  const json* Peek(std::string_view key) const;
  // True when `key` is present with a value other than "auto"/null.
  bool Given(std::string_view key) const;
  // True when `key` is written "auto".
  bool IsAutoKey(std::string_view key) const;

  Status Int(std::string_view key, int64_t* out, Auto a = Auto::kRejected);
  // For `int` fields: the value must also fit in 32 bits.
  Status Int32(std::string_view key, int* out);
  Status Double(std::string_view key, double* out, Auto a = Auto::kRejected);
  Status Bool(std::string_view key, bool* out, Auto a = Auto::kRejected);
  Status Bytes(std::string_view key, int64_t* out);
  Status String(std::string_view key, std::string* out);
  template <typename E, size_t N>
  Status Enum(std::string_view key, const EnumName<E> (&names)[N], E* out,
              std::string_view note = "") {
    const json* v = Take(key);
    return v ? ReadEnum(*v, PathOf(key), names, out, note) : Status::Ok();
  }
  // nvme_path: a string, or a non-empty list of strings. null = absent.
  Status Paths(std::string_view key, std::vector<std::string>* out);
  // A nested object; `out` stays empty when the key is absent. The child
  // inherits auto_is_default.
  Status Child(std::string_view key, std::optional<Section>* out);

  // Reads `key` or `alias` (two spellings of one DeepSpeed key) with `read`
  // (a member such as &Section::Int). Either may be written; when both are,
  // they must agree.
  template <typename T, typename... Extra>
  Status Aliased(std::string_view key, std::string_view alias, T* out,
                 Status (Section::*read)(std::string_view, T*, Extra...), Extra... extra) {
    const bool has_key = Given(key), has_alias = Given(alias);
    T a = *out, b = *out;
    RETURN_IF_ERROR((this->*read)(key, &a, extra...));
    RETURN_IF_ERROR((this->*read)(alias, &b, extra...));
    if (has_key && has_alias && !(a == b)) return Conflict(key, alias);
    if (has_key)
      *out = a;
    else if (has_alias)
      *out = b;
    return Status::Ok();
  }
  // For two spellings of a key Strata does not read: they must agree (as
  // JSON values; 1e5 equals 100000).
  Status Agree(std::string_view key, std::string_view alias) const;
  Status Conflict(std::string_view key, std::string_view alias) const;

  // Each key nobody read, judged by the schema (JudgeUnreadKey).
  Status ReportUnread() const;

 private:
  // Take(key), but "auto"/null count as absent where allowed.
  const json* TakeValue(std::string_view key, Auto a);

  const json& obj_;
  std::string path_;
  Diagnostics diag_;
  bool auto_is_default_;
  std::set<std::string> read_;
};

// ---- Readers (one per file, see the top) --------------------------------------

// read_deepspeed.cc: the whole document into `c` (values and diagnostics).
Status ReadConfig(const json& root, const AutoValues& autos, Config* c);

// read_scheduler.cc: the `scheduler` section (after the optimizer's: defaults
// depend on it).
Status ReadScheduler(Section& s, const AutoValues& autos, const OptimizerConfig& o,
                     SchedulerConfig* sc);

// read_strata.cc: the `strata` section.
Status ReadStrata(Section& s, StrataConfig* st);

// auto_values.cc: a key the frontend may fill when the config writes "auto"
// (AutoValues): the value used, and a notice saying where it came from.
// `fallback` says where the value comes from when the frontend gives none.
Status ReadAutoBool(Section& s, std::string_view key, const std::optional<bool>& supplied,
                    std::string_view fallback, bool* out);
Status ReadAutoDouble(Section& s, std::string_view key, const std::optional<double>& supplied,
                      std::string_view fallback, double* out);
Status ReadAutoInt(Section& s, std::string_view key, const std::optional<int64_t>& supplied,
                   std::string_view fallback, int64_t* out);
// optimizer.params.betas written "auto" (both values from AutoValues).
void ResolveAutoBetas(Section& p, const AutoValues& autos, std::string_view fallback,
                      OptimizerConfig* o);
// The three batch-size keys of the top level: "auto" takes the frontend's
// value; absent ones are derived (train = micro × accumulation on one rank).
Status ReadBatchSizes(Section& top, const AutoValues& autos, Config* c);

}  // namespace strata::config_internal
