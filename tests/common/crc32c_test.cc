// CRC-32C: the standard check value, the hardware path against the table on
// random data of every small length and alignment, and extension.
#include "src/common/crc32c.h"

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace strata {
namespace {

TEST(Crc32c, CheckValue) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32cExtendPortable(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
}

TEST(Crc32c, FastEqualsPortableAndExtends) {
  auto rng = testing::MakeRng();
  std::vector<uint8_t> data = testing::RandomBytes(rng, 4096 + 64);
  for (size_t off = 0; off < 9; ++off)
    for (size_t n : {0, 1, 7, 8, 9, 63, 64, 65, 1000, 4096}) {
      const uint32_t want = Crc32cExtendPortable(0, data.data() + off, n);
      EXPECT_EQ(Crc32c(data.data() + off, n), want) << off << " " << n;
      const size_t half = n / 3;
      EXPECT_EQ(Crc32cExtend(Crc32c(data.data() + off, half), data.data() + off + half, n - half),
                want);
    }
  // One flipped bit changes it.
  const uint32_t a = Crc32c(data.data(), data.size());
  data[100] ^= 4;
  EXPECT_NE(Crc32c(data.data(), data.size()), a);
}

}  // namespace
}  // namespace strata
