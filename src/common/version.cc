#include "strata/build_config.h"
#include "strata/strata.h"

namespace strata {
std::string_view Version() { return STRATA_VERSION; }
}  // namespace strata
