// src/common/rank_env.h — the ranks the launcher describes in the
// environment, read and checked in one place: RANK, WORLD_SIZE, LOCAL_RANK
// and LOCAL_WORLD_SIZE, as torchrun, `deepspeed`, `strata train
// --nproc-per-node` and `python -m strata.launch` set them. Every reader of
// these variables (the communicator's options, the batch-size rules of the
// config, `strata info`) goes through here, so they agree on what a value
// means and on what is refused.
#pragma once

#include <optional>

#include "strata/status.h"

namespace strata {

struct RankEnv {
  int rank = 0;              // RANK, else 0
  int world_size = 1;        // WORLD_SIZE, else 1
  int local_rank = 0;        // LOCAL_RANK, else RANK
  int local_world_size = 1;  // LOCAL_WORLD_SIZE, else WORLD_SIZE
};

// One of the variables as a non-negative integer (at most 2^24): unset or
// empty → nullopt; anything else that is not such an integer →
// InvalidArgument naming the variable and its value.
StatusOr<std::optional<int>> RankEnvInteger(const char* name);

// The four variables, checked against each other: InvalidArgument, naming
// the variables and values, when one is not an integer, WORLD_SIZE is 0,
// RANK is not below WORLD_SIZE, or LOCAL_RANK is not below
// LOCAL_WORLD_SIZE. None set: one rank.
StatusOr<RankEnv> ReadRankEnv();

}  // namespace strata
