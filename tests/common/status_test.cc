#include "strata/status.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <memory>
#include <string>

#include "src/common/status_util.h"

namespace strata {
namespace {

TEST(StatusTest, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOk);
  EXPECT_EQ(s.ToString(), "OK");
  EXPECT_EQ(s.message(), "");
}

TEST(StatusTest, ErrorCarriesCodeAndMessage) {
  Status s = ResourceExhaustedError("asked 10 bytes, 4 left");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "asked 10 bytes, 4 left");
  EXPECT_EQ(s.ToString(), "ResourceExhausted: asked 10 bytes, 4 left");
}

TEST(StatusTest, EveryFactoryHasItsCode) {
  EXPECT_EQ(InvalidArgumentError("x").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(NotFoundError("x").code(), StatusCode::kNotFound);
  EXPECT_EQ(IOError("x").code(), StatusCode::kIOError);
  EXPECT_EQ(NotSupportedError("x").code(), StatusCode::kNotSupported);
  EXPECT_EQ(UnavailableError("x").code(), StatusCode::kUnavailable);
  EXPECT_EQ(FailedPreconditionError("x").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(OutOfRangeError("x").code(), StatusCode::kOutOfRange);
  EXPECT_EQ(CancelledError("x").code(), StatusCode::kCancelled);
  EXPECT_EQ(DataLossError("x").code(), StatusCode::kDataLoss);
  EXPECT_EQ(InternalError("x").code(), StatusCode::kInternal);
  EXPECT_EQ(StatusCodeName(StatusCode::kDataLoss), "DataLoss");
}

TEST(StatusTest, CopyMoveAndCompare) {
  Status a = IOError("disk");
  Status b = a;
  EXPECT_EQ(a, b);
  Status c = std::move(b);
  EXPECT_EQ(c, a);
  c = Status();
  EXPECT_TRUE(c.ok());
  EXPECT_FALSE(c == a);
}

TEST(StatusTest, WithContextPrefixesMessage) {
  Status s = IOError("EIO").WithContext("write /x offset 4096");
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  EXPECT_EQ(s.message(), "write /x offset 4096: EIO");
  EXPECT_TRUE(Status().WithContext("ignored").ok());
}

TEST(StatusTest, ErrnoErrorMapsCodesAndNamesErrno) {
  Status s = ErrnoError("open /nope", ENOENT);
  EXPECT_EQ(s.code(), StatusCode::kNotFound);
  EXPECT_NE(s.message().find("open /nope"), std::string::npos);
  EXPECT_NE(s.message().find("errno 2"), std::string::npos);
  EXPECT_EQ(ErrnoError("w", ENOSPC).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoError("w", EAGAIN).code(), StatusCode::kUnavailable);
  EXPECT_EQ(ErrnoError("w", EIO).code(), StatusCode::kIOError);
  EXPECT_EQ(ErrnoError("w", EINVAL).code(), StatusCode::kInvalidArgument);
}

StatusOr<int> Half(int x) {
  if (x % 2) return InvalidArgumentError("odd: " + std::to_string(x));
  return x / 2;
}

Status UsesMacros(int x, int* out) {
  ASSIGN_OR_RETURN(int h, Half(x));
  RETURN_IF_ERROR(h > 100 ? OutOfRangeError("too big") : Status());
  *out = h;
  return Status();
}

TEST(StatusOrTest, ValueAndError) {
  StatusOr<int> v = Half(8);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, 4);
  EXPECT_EQ(v.value_or(-1), 4);
  StatusOr<int> e = Half(3);
  EXPECT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(e.value_or(-1), -1);
}

TEST(StatusOrTest, MoveOnlyValues) {
  StatusOr<std::unique_ptr<int>> p = std::make_unique<int>(7);
  ASSERT_TRUE(p.ok());
  std::unique_ptr<int> q = std::move(p).value();
  EXPECT_EQ(*q, 7);
}

TEST(StatusOrTest, OkStatusBecomesInternalError) {
  StatusOr<int> v = Status();
  EXPECT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), StatusCode::kInternal);
}

TEST(StatusOrTest, MacrosPropagate) {
  int out = 0;
  EXPECT_TRUE(UsesMacros(10, &out).ok());
  EXPECT_EQ(out, 5);
  EXPECT_EQ(UsesMacros(3, &out).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(UsesMacros(400, &out).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(out, 5);
}

TEST(StatusOrDeathTest, ValueOnErrorAborts) {
  StatusOr<int> e = Half(1);
  EXPECT_DEATH((void)e.value(), "odd: 1");
}

}  // namespace
}  // namespace strata
