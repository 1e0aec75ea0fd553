// strata/strata.h — everything a framework includes to use Strata.
#pragma once

#include <string_view>

#include "strata/config.h"
#include "strata/status.h"

namespace strata {

// The library's version, "MAJOR.MINOR.PATCH".
std::string_view Version();

}  // namespace strata
