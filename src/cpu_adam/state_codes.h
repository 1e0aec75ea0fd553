// Internal to src/cpu_adam: the scalar definitions of the compact state
// formats' codes — the 8-bit moment codes of the int8 format, the per-block
// scales, and the stochastic rounding of a bf16 master — from
// src/common/state_codes.h, which the device Adam (src/gpu) shares. They are
// the reference: the vector versions in kernel_compact.h compute the same
// integer and float operations lane by lane and are tested against these bit
// for bit. Used by kernel_scalar.cc, state_format.cc and tests.
#pragma once

#include "src/common/state_codes.h"
#include "src/cpu_adam/kernel.h"

namespace strata::cpu_adam::internal {

using codes::BlockScale;
using codes::DecodeExpAvg8;
using codes::DecodeExpAvgSq8;
using codes::EncodeExpAvg8;
using codes::EncodeExpAvgSq8;
using codes::FloatToBf16Stochastic;
using codes::MakeBlockScale;
using codes::MakeSrKey;
using codes::Mix32;
using codes::SplitMix64;
using codes::SrBits;
using codes::SrHighKey;
using codes::SrKey;

}  // namespace strata::cpu_adam::internal
