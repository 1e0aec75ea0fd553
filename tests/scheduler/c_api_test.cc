#include <gtest/gtest.h>

#include <cstddef>

extern "C" int strata_c_api_smoke(char* err, size_t err_len);

TEST(CApiTest, TrainsOneStepFromC) {
  char err[512] = {0};
  EXPECT_EQ(strata_c_api_smoke(err, sizeof err), 0) << err;
}
