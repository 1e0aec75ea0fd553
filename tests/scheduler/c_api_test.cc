#include <gtest/gtest.h>

#include <cstddef>

extern "C" int strata_c_api_smoke(char* err, size_t err_len);
extern "C" int strata_c_api_auto_values(char* err, size_t err_len);

TEST(CApiTest, TrainsOneStepFromC) {
  char err[512] = {0};
  EXPECT_EQ(strata_c_api_smoke(err, sizeof err), 0) << err;
}

TEST(CApiTest, AutoValuesFromTheFrontend) {
  char err[512] = {0};
  EXPECT_EQ(strata_c_api_auto_values(err, sizeof err), 0) << err;
}

extern "C" int strata_c_api_param_groups(char* err, size_t err_len);

TEST(CApiTest, ParameterGroups) {
  char err[512] = {0};
  EXPECT_EQ(strata_c_api_param_groups(err, sizeof err), 0) << err;
}
