#include "src/common/units.h"

#include <gtest/gtest.h>

#include <cstdint>

namespace strata {
namespace {

TEST(UnitsTest, FormatBytes) {
  EXPECT_EQ(FormatBytes(0), "0 B");
  EXPECT_EQ(FormatBytes(1023), "1023 B");
  EXPECT_EQ(FormatBytes(1024), "1.00 KiB");
  EXPECT_EQ(FormatBytes(2363136), "2.25 MiB");
  EXPECT_EQ(FormatBytes(int64_t{3} << 29), "1.50 GiB");
  EXPECT_EQ(FormatBytes(int64_t{5} << 40), "5.00 TiB");
}

TEST(UnitsTest, ParseByteSizeBinarySuffixes) {
  int64_t v = -1;
  ASSERT_TRUE(ParseByteSize("4096", &v));
  EXPECT_EQ(v, 4096);
  ASSERT_TRUE(ParseByteSize("64K", &v));
  EXPECT_EQ(v, 65536);
  ASSERT_TRUE(ParseByteSize("64KiB", &v));
  EXPECT_EQ(v, 65536);
  ASSERT_TRUE(ParseByteSize(" 512 mb ", &v));
  EXPECT_EQ(v, int64_t{512} << 20);
  ASSERT_TRUE(ParseByteSize("1.5G", &v));
  EXPECT_EQ(v, int64_t{3} << 29);
  ASSERT_TRUE(ParseByteSize("2TiB", &v));
  EXPECT_EQ(v, int64_t{2} << 40);
  ASSERT_TRUE(ParseByteSize("7B", &v));
  EXPECT_EQ(v, 7);
}

TEST(UnitsTest, ParseByteSizeRejectsJunkAndLeavesOutAlone) {
  for (const char* bad : {"", "G", "-1", "1.5", "1..5G", "1x", "12 apples", "1e3", "99999999T"}) {
    int64_t v = 42;
    EXPECT_FALSE(ParseByteSize(bad, &v)) << bad;
    EXPECT_EQ(v, 42) << bad;
  }
}

TEST(UnitsTest, ParseCountDecimalSuffixes) {
  int64_t v = -1;
  ASSERT_TRUE(ParseCount("100000000", &v));
  EXPECT_EQ(v, 100000000);
  ASSERT_TRUE(ParseCount("1e8", &v));
  EXPECT_EQ(v, 100000000);
  ASSERT_TRUE(ParseCount("100M", &v));
  EXPECT_EQ(v, 100000000);
  ASSERT_TRUE(ParseCount("1.5B", &v));
  EXPECT_EQ(v, 1500000000);
  ASSERT_TRUE(ParseCount("4G", &v));
  EXPECT_EQ(v, 4000000000);
  ASSERT_TRUE(ParseCount("2k", &v));
  EXPECT_EQ(v, 2000);
  ASSERT_TRUE(ParseCount("1T", &v));
  EXPECT_EQ(v, 1000000000000);
}

TEST(UnitsTest, ParseCountRejectsJunkAndLeavesOutAlone) {
  for (const char* bad : {"", "M", "-5", "1.5", "0.0001K", "1e", "3 cows", "1e-3", "1e30"}) {
    int64_t v = 42;
    EXPECT_FALSE(ParseCount(bad, &v)) << bad;
    EXPECT_EQ(v, 42) << bad;
  }
}

}  // namespace
}  // namespace strata
