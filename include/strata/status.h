// strata/status.h — the error type of every Strata call.
//
// A Status is either OK or carries a code and a message that names what went
// wrong (the config key path, the file/offset/errno, the bytes asked for and
// the budget left). StatusOr<T> carries a value or a non-OK Status. Neither
// throws; both are cheap to move. Thread-compatible (no internal locking).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace strata {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,     // the caller passed something wrong (config, argument)
  kNotFound = 2,            // a file, shard, parameter or module that does not exist
  kIOError = 3,             // the OS or a device failed an operation
  kResourceExhausted = 4,   // a budget (HBM, pinned, disk space) would be exceeded
  kNotSupported = 5,        // the feature is not available in this build or machine
  kUnavailable = 6,         // transient: try again (EAGAIN, busy)
  kFailedPrecondition = 7,  // the call is not valid in the object's current state
  kOutOfRange = 8,          // offset or index past the end
  kCancelled = 9,           // the operation was cancelled (shutdown, drain)
  kDataLoss = 10,           // data was lost or is corrupt (short file, truncated)
  kInternal = 11,           // a broken invariant inside Strata
};

// "OK", "InvalidArgument", ...
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message);

  static Status Ok() { return Status(); }

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  // The message without the code; empty for OK.
  std::string_view message() const { return rep_ ? std::string_view(rep_->message) : ""; }
  // "OK" or "<CodeName>: <message>".
  std::string ToString() const;

  // Returns a copy whose message is "<context>: <message>" (OK stays OK).
  Status WithContext(std::string_view context) const;

  // Marks a Status as deliberately ignored.
  void IgnoreError() const {}

  Status(const Status& other) : rep_(other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr) {}
  Status& operator=(const Status& other) {
    if (this != &other) rep_ = other.rep_ ? std::make_unique<Rep>(*other.rep_) : nullptr;
    return *this;
  }
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct Rep {
    StatusCode code;
    std::string message;
  };
  std::unique_ptr<Rep> rep_;  // null means OK: the OK path allocates nothing
};

inline std::ostream& operator<<(std::ostream& os, const Status& s) { return os << s.ToString(); }

// Factories, one per code.
Status InvalidArgumentError(std::string message);
Status NotFoundError(std::string message);
Status IOError(std::string message);
Status ResourceExhaustedError(std::string message);
Status NotSupportedError(std::string message);
Status UnavailableError(std::string message);
Status FailedPreconditionError(std::string message);
Status OutOfRangeError(std::string message);
Status CancelledError(std::string message);
Status DataLossError(std::string message);
Status InternalError(std::string message);

// A value of type T, or a non-OK Status explaining why there is none.
template <typename T>
class [[nodiscard]] StatusOr {
  static_assert(!std::is_same_v<std::decay_t<T>, Status>, "StatusOr<Status> is not allowed");

 public:
  // From an error. Passing an OK Status is a bug and becomes an Internal error.
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT(implicit)
    if (status_.ok()) status_ = InternalError("StatusOr constructed from an OK Status");
  }
  StatusOr(const T& value) : value_(value) {}        // NOLINT(implicit)
  StatusOr(T&& value) : value_(std::move(value)) {}  // NOLINT(implicit)
  template <typename U, typename = std::enable_if_t<std::is_constructible_v<T, U&&> &&
                                                    !std::is_same_v<std::decay_t<U>, T> &&
                                                    !std::is_same_v<std::decay_t<U>, Status> &&
                                                    !std::is_same_v<std::decay_t<U>, StatusOr>>>
  StatusOr(U&& value) : value_(std::forward<U>(value)) {}  // NOLINT(implicit)

  bool ok() const { return value_.has_value(); }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }

  // REQUIRES: ok(). Calling these on an error aborts with the error's text.
  const T& value() const& {
    CheckOk();
    return *value_;
  }
  T& value() & {
    CheckOk();
    return *value_;
  }
  T&& value() && {
    CheckOk();
    return std::move(*value_);
  }
  const T& operator*() const& { return value(); }
  T& operator*() & { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  const T* operator->() const { return &value(); }
  T* operator->() { return &value(); }

  template <typename U>
  T value_or(U&& fallback) const& {
    return ok() ? *value_ : static_cast<T>(std::forward<U>(fallback));
  }

 private:
  void CheckOk() const;
  Status status_;  // OK when value_ holds a value
  std::optional<T> value_;
};

namespace internal {
[[noreturn]] void DieOnBadStatusOrAccess(const Status& status);
}  // namespace internal

template <typename T>
void StatusOr<T>::CheckOk() const {
  if (!value_.has_value()) internal::DieOnBadStatusOrAccess(status_);
}

}  // namespace strata

// Propagation helpers usable by callers of the public API as well.
#define STRATA_STATUS_CONCAT_INNER_(a, b) a##b
#define STRATA_STATUS_CONCAT_(a, b) STRATA_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (a Status); returns it from the enclosing function if not OK.
#define STRATA_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::strata::Status strata_status_ = (expr);        \
    if (!strata_status_.ok()) return strata_status_; \
  } while (0)

// `lhs = value of expr` (a StatusOr), or returns its Status if not OK.
#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL_(STRATA_STATUS_CONCAT_(strata_statusor_, __LINE__), lhs, expr)
#define STRATA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return std::move(tmp).status();      \
  lhs = std::move(tmp).value()
