// ASSERT_OK / EXPECT_OK: a Status expression that must be OK; on failure the
// expression and the Status are printed.
#pragma once

#include <gtest/gtest.h>

#include "strata/status.h"

#define ASSERT_OK(expr)                                     \
  do {                                                      \
    const ::strata::Status s_ = (expr);                     \
    ASSERT_TRUE(s_.ok()) << #expr << ": " << s_.ToString(); \
  } while (0)
#define EXPECT_OK(expr)                                     \
  do {                                                      \
    const ::strata::Status s_ = (expr);                     \
    EXPECT_TRUE(s_.ok()) << #expr << ": " << s_.ToString(); \
  } while (0)
