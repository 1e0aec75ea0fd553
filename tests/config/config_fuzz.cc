// libFuzzer target for the config parser (src/config).
//
// Any byte string must give a Config or an error, never a crash, a leak, a
// hang or unbounded memory (ASan/UBSan watch). When a config parses, the
// invariants of config.h must hold: it validates, and ConfigToJson gives
// text that parses back to an equal Config. The input is also parsed with
// frontend-supplied "auto" values.
//
// Built only where the compiler links -fsanitize=fuzzer (clang with
// compiler-rt); scripts/fuzz.sh configures such a build and runs it, seeded
// with configs/*.json and tests/config/data/*.json, with
// tests/config/config_fuzz.dict.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "src/common/log.h"
#include "strata/config.h"

namespace {

[[noreturn]] void Broken(const char* what, const std::string& detail) {
  std::fprintf(stderr, "config_fuzz: invariant broken: %s\n%s\n", what, detail.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  strata::SetLogLevel("off");  // warnings and notices for every input would drown the output
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  strata::StatusOr<strata::Config> c = strata::ParseConfig(text);
  if (!c.ok()) {
    if (c.status().message().empty()) Broken("an error without a message", std::string(text));
  } else {
    strata::Status valid = strata::ValidateConfig(*c);
    if (!valid.ok()) Broken("a parsed Config does not validate", valid.ToString());
    const std::string out = strata::ConfigToJson(*c);
    strata::StatusOr<strata::Config> back = strata::ParseConfig(out);
    if (!back.ok())
      Broken("ConfigToJson output does not parse", back.status().ToString() + "\n" + out);
    if (!(*back == *c))
      Broken("round trip changed the Config", out + "\nvs\n" + strata::ConfigToJson(*back));
  }
  strata::AutoValues autos;
  autos.lr = 3e-5;
  autos.beta2 = 0.95;
  autos.gradient_clipping = 1.0;
  autos.bf16_enabled = true;
  autos.train_micro_batch_size_per_gpu = 4;
  autos.gradient_accumulation_steps = 2;
  strata::StatusOr<strata::Config> with_autos = strata::ParseConfig(text, "<fuzz>", autos);
  if (with_autos.ok() && !strata::ValidateConfig(*with_autos).ok())
    Broken("a Config parsed with AutoValues does not validate", std::string(text));
  return 0;
}
