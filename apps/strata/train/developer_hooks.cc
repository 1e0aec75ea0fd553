// DeveloperHooksFromEnv (train.h): the engine hooks `strata train` runs with.
// Each executable compiles this file itself: the `strata` command without
// STRATA_TEST_HOOKS, so no environment makes the shipped binary kill itself;
// the tests' `strata-test-hooks` with it (apps/strata/CMakeLists.txt).
#include <signal.h>

#include <string>
#include <string_view>

#include "apps/strata/train/train.h"
#include "src/common/env_param.h"

namespace strata::cli {

EngineTestHooks DeveloperHooksFromEnv() {
  EngineTestHooks hooks;
  const std::string fold = EnvString("STRATA_FOLD_GRADS", "auto");
  hooks.fold_override = fold == "on" ? 1 : (fold == "off" ? 0 : -1);
#if defined(STRATA_TEST_HOOKS)
  // Crash tests (tests/train/checkpoint_cli_test.cc): SIGKILL at the named
  // point of a checkpoint save.
  const std::string crash_at = EnvString("STRATA_CHECKPOINT_CRASH_AT", "");
  if (!crash_at.empty())
    hooks.checkpoint_point = [crash_at](std::string_view point) {
      if (point == crash_at) ::raise(SIGKILL);
    };
#endif
  return hooks;
}

}  // namespace strata::cli
