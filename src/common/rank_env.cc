#include "src/common/rank_env.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>

#include "src/common/status_util.h"

namespace strata {

StatusOr<std::optional<int>> RankEnvInteger(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::optional<int>();
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (errno != 0 || *end != '\0' || x < 0 || x > (1 << 24))
    return InvalidArgumentError(
        fmt::format("environment {}=\"{}\" is not a non-negative integer", name, v));
  return std::optional<int>(static_cast<int>(x));
}

StatusOr<RankEnv> ReadRankEnv() {
  ASSIGN_OR_RETURN(auto rank, RankEnvInteger("RANK"));
  ASSIGN_OR_RETURN(auto world, RankEnvInteger("WORLD_SIZE"));
  ASSIGN_OR_RETURN(auto local, RankEnvInteger("LOCAL_RANK"));
  ASSIGN_OR_RETURN(auto local_world, RankEnvInteger("LOCAL_WORLD_SIZE"));
  RankEnv e;
  e.rank = rank.value_or(0);
  e.world_size = world.value_or(1);
  e.local_rank = local.value_or(e.rank);
  e.local_world_size = local_world.value_or(e.world_size);
  if (e.local_world_size < 1 || e.local_rank >= e.local_world_size)
    return InvalidArgumentError(
        fmt::format("environment LOCAL_RANK={} is not below LOCAL_WORLD_SIZE={}", e.local_rank,
                    e.local_world_size));
  if (e.world_size < 1) return InvalidArgumentError("environment WORLD_SIZE=0: must be at least 1");
  if (e.rank >= e.world_size)
    return InvalidArgumentError(
        fmt::format("environment RANK={} is not below WORLD_SIZE={}", e.rank, e.world_size));
  return e;
}

}  // namespace strata
