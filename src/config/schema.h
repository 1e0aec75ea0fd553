// src/config/schema.h — what the rest of Strata reads from the config schema
// (schema.cc, the one table of every key the config knows). The config's
// contract is include/strata/config.h; this header is for other modules
// inside Strata (the scheduler's checkpoints), not for frameworks.
//
// It promises that what it returns comes from the schema table itself, so a
// key's verdict is stated in one row and nowhere else.
#pragma once

#include <span>
#include <string_view>

namespace strata {

// A key (a ConfigToJson path; it covers the keys below it) that may differ
// between a checkpoint and the engine resuming from it, with the reason.
struct ResumeFreeKey {
  std::string_view key;
  std::string_view reason;
};
// The keys the schema marks as free to differ on resume, in the schema's
// order; every other key is compared. Thread-safe; the strings are static.
std::span<const ResumeFreeKey> ResumeFreeKeys();

}  // namespace strata
